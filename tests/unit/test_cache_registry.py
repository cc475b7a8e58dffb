"""``tracekit cache`` lists and clears every cache tracekit writes, from one registry
(:data:`tracekit.core.cachedir.CACHES`): a module that finds its own folder under the cache root
without the registry fails here, and each registered cache is listed (entry count, size) and cleared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tracekit

PKG = Path(tracekit.__file__).resolve().parent


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PKG.parent)): p.read_text() for p in PKG.rglob("*.py")}


def test_every_cache_user_goes_through_the_registry():
    """No module but the registry reads the cache root's variables; every ``cache_path("name")``
    names a registered cache; every registered cache's writer module exists and uses the registry."""
    from tracekit.core.cachedir import CACHES

    names = {k.name for k in CACHES}
    assert len(names) == len(CACHES)
    users = {}
    for path, text in _sources().items():
        if path == "tracekit/core/cachedir.py":
            continue
        # the root's environment variables or a hand-built ~/.cache/tracekit folder: a cache the registry misses
        assert not re.search(r"environ(?:\.get)?\s*[\[(]\s*['\"](?:TRACEKIT_CACHE_DIR|XDG_CACHE_HOME)['\"]", text), \
            f"{path} reads the cache root itself: take its folder from tracekit.core.cachedir.cache_path"
        assert "~/.cache/tracekit\")" not in text and "'.cache' / 'tracekit'" not in text, path
        for name in re.findall(r"cache_path\(\s*['\"](\w+)['\"]", text):
            assert name in names, f"{path} uses cache {name!r}, not registered in tracekit.core.cachedir.CACHES"
            users.setdefault(name, set()).add(path.removesuffix(".py").replace("/", "."))
    for k in CACHES:
        mod = PKG.parent / (k.writer.replace(".", "/") + ".py")
        assert mod.is_file(), k
        assert k.writer in users.get(k.name, set()) or k.name == "transcoder_stores", \
            f"{k.writer} does not take the folder of {k.name!r} from cache_path"
    # the nested store folder is the transcoders' own "stores" subfolder
    assert 'root / "stores"' in (PKG / "dictionaries" / "train.py").read_text()


def _fake_entry(d: Path, size: int) -> None:
    d.mkdir(parents=True)
    (d / "blob.bin").write_bytes(b"\0" * size)
    (d / "manifest.json").write_text(json.dumps({"created": "2026-01-01", "files": {"blob.bin": {"size": size}}}))


@pytest.fixture
def full_cache(tmp_path, monkeypatch):
    from tracekit.core.cachedir import CACHES, cache_path

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    sizes = {}
    for i, k in enumerate(CACHES):
        sizes[k.name] = (i + 1) * 2**20
        if k.files is not None:  # entries are single files (the model-info cache's *.pkl)
            cache_path(k.name).mkdir(parents=True, exist_ok=True)
            (cache_path(k.name) / k.files.replace("*", f"entry-{k.name}")).write_bytes(b"\0" * sizes[k.name])
        else:
            _fake_entry(cache_path(k.name) / f"entry-{k.name}", sizes[k.name])
    return tmp_path / "cache", sizes


def _section(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(f"{name}: "))


def test_cache_lists_every_registered_cache_with_count_and_size(full_cache, capsys):
    from tracekit.cli import main
    from tracekit.core.cachedir import CACHES, cache_path

    root, sizes = full_cache
    assert {k.name for k in CACHES} >= {"weights", "saes", "tuned_lenses", "transcoders", "transcoder_stores"}
    assert cache_path("tuned_lenses") == root / "tuned_lenses" and cache_path("transcoders") == root / "transcoders"
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    total = 0
    for k in CACHES:
        size = sizes[k.name] + (0 if k.files is not None else
                                len((cache_path(k.name) / f"entry-{k.name}" / "manifest.json").read_bytes()))
        total += size
        line = _section(out, k.name)
        assert "1 entry," in line and f"{size / 2**20:.1f} MiB" in line, line
        assert f"entry-{k.name}" in out
    # the nested store folder is listed under its own cache, not as an entry of the transcoders'
    assert "MiB  stores  created" not in out
    assert f"total: {len(CACHES)} entries, {total / 2**20:.1f} MiB" in out


def test_cache_clear_all_and_by_name(full_cache, capsys):
    from tracekit.cli import main
    from tracekit.core.cachedir import CACHES, cache_path, kind_entries

    assert main(["cache", "clear", "tuned_lenses", "transcoder_stores"]) == 0
    capsys.readouterr()
    left = {k.name: len(kind_entries(k)) for k in CACHES}
    assert left == {k.name: 0 if k.name in ("tuned_lenses", "transcoder_stores") else 1 for k in CACHES}
    assert cache_path("transcoder_stores").is_dir() or not cache_path("transcoder_stores").exists()
    assert main(["cache", "clear", "nope"]) == 2
    assert main(["cache", "clear"]) == 0
    assert f"removed {len(CACHES) - 2} entries" in capsys.readouterr().out
    assert all(kind_entries(k) == [] for k in CACHES)
