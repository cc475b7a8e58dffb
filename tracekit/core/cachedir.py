"""Cache folders: list, clear, and remove what interrupted writers left (shared by every on-disk cache).

:data:`CACHES` is the one registry of the caches tracekit writes under the cache root
(:func:`cache_root`); every writer takes its folder from :func:`cache_path` (an unregistered name is
a ``KeyError``), and ``tracekit cache`` lists and clears what the registry names, so a new cache
cannot be left out of the listing (tests/unit/test_cache_registry.py checks every cache user).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .io import ManifestInvalid, read_manifest

log = logging.getLogger("tracekit.cache")


@dataclass(frozen=True)
class CacheKind:
    """One cache tracekit writes: ``<cache root>/<subdir>/<key>/`` folders, one per entry.

    Attributes:
        name: the name ``tracekit cache clear NAME`` takes.
        subdir: the folder under :func:`cache_root` (``/``-separated; a kind's folder may sit inside
            another's: the outer kind's listing leaves it out).
        title: what its entries hold, for the listing.
        writer: the module that writes (and reads) it.
        lister: ``"module:function"`` returning its rows (``key, size_bytes, valid`` plus details),
            or None for the generic listing (:func:`kind_entries`).
        files: a glob (``"*.pkl"``) when the entries are single files rather than folders.
    """

    name: str
    subdir: str
    title: str
    writer: str
    lister: str | None = None
    files: str | None = None


#: Every cache under the cache root. Add a new cache here (and take its folder from :func:`cache_path`).
CACHES: tuple[CacheKind, ...] = (
    CacheKind("weights", "gguf", "dequantised GGUF weights (with TransformerLens' processed weights and load "
              "verifications inside each entry)", "tracekit.model.weights_cache",
              "tracekit.model.weights_cache:list_entries"),
    CacheKind("saes", "saes", "trained SAEs", "tracekit.sae.train", "tracekit.sae.train:sae_cache_entries"),
    CacheKind("tuned_lenses", "tuned_lenses", "trained tuned lenses", "tracekit.lenses.train"),
    CacheKind("transcoders", "transcoders", "trained transcoder sets", "tracekit.dictionaries.train"),
    CacheKind("transcoder_stores", "transcoders/stores", "activation stores written to train transcoders",
              "tracekit.dictionaries.train"),
    CacheKind("model_info", "model-info", "local models' TransformerLens configs and hook names (read by "
              "`tracekit validate` instead of importing TransformerLens; one small file per model)",
              "tracekit.model.info", files="*.pkl"),
)


def cache_root() -> Path:
    """The tracekit cache root: ``$TRACEKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/tracekit``, else
    ``~/.cache/tracekit``. Raises nothing."""
    env = os.environ.get("TRACEKIT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tracekit"


def cache_kind(name: str) -> CacheKind:
    """The registered cache called ``name``.

    Raises:
        KeyError: no cache of that name in :data:`CACHES` (register it there).
    """
    for k in CACHES:
        if k.name == name:
            return k
    raise KeyError(f"no cache named {name!r} in tracekit.core.cachedir.CACHES (register it there): "
                   f"{', '.join(k.name for k in CACHES)}")


def cache_path(name: str) -> Path:
    """The folder of the registered cache ``name`` under :func:`cache_root`.

    Raises:
        KeyError: ``name`` is not registered in :data:`CACHES`.
    """
    return cache_root().joinpath(*cache_kind(name).subdir.split("/"))


def _nested(kind: CacheKind) -> set[str]:
    """Names of the folders directly under ``kind``'s folder that are other kinds' folders."""
    pre = kind.subdir + "/"
    return {k.subdir[len(pre):] for k in CACHES if k.subdir.startswith(pre) and "/" not in k.subdir[len(pre):]}


def _describe_generic(d: Path, man: dict) -> dict:
    return {"created": man.get("created"), "valid": sizes_match(d, man)}


def kind_entries(kind: CacheKind) -> list[dict]:
    """The rows of one registered cache (``key, path, size_bytes, valid`` and details): its own
    lister's, or the generic one (a folder with a readable manifest whose files have their sizes is
    valid); other kinds' folders nested in it are left out. Raises nothing (unreadable: invalid)."""
    if kind.files is not None:
        root = cache_path(kind.name)
        return [{"key": f.name, "path": str(f), "size_bytes": f.stat().st_size, "valid": True}
                for f in sorted(root.glob(kind.files)) if f.is_file()] if root.is_dir() else []
    if kind.lister is not None:
        import importlib

        mod, fn = kind.lister.split(":")
        rows = getattr(importlib.import_module(mod), fn)()
    else:
        rows = dir_entries(cache_path(kind.name), _describe_generic)
    skip = _nested(kind)
    return [r for r in rows if r["key"] not in skip]


def clear_kind(kind: CacheKind) -> tuple[int, int]:
    """Remove every entry of one registered cache (and leftover temporary folders), leaving other
    kinds' folders nested in it: ``(entries removed, bytes freed)``. Raises nothing."""
    if kind.files is not None:
        n = freed = 0
        root = cache_path(kind.name)
        for f in (sorted(root.glob(kind.files)) if root.is_dir() else []):
            try:
                size = f.stat().st_size
                f.unlink()
            except OSError:
                continue
            n, freed = n + 1, freed + size
        return n, freed
    return clear_dir(cache_path(kind.name), keep=_nested(kind))



def remove_entry(d: Path) -> None:
    """Remove a cache entry folder ``d``: rename it aside first (atomic), then delete; tolerate a
    concurrent remover (a folder already gone is no error). Raises nothing."""
    trash = d.parent / f".trash-{d.name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(d, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


_TEMP = re.compile(r"\.tmp-(?:.*-)?(\d+)-[0-9a-f]{8}$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(root: Path) -> list[Path]:
    """Remove temporary folders left under ``root`` by writers that died (SIGKILL, power loss):
    ``.tmp-...-<pid>-<id>`` folders whose process is gone, and ``.trash-*`` folders. A live writer's
    folder is kept. Returns what was removed."""
    removed = []
    if not root.is_dir():
        return removed
    for d in root.iterdir():
        if not d.is_dir():
            continue
        m = _TEMP.search(d.name)
        legacy = re.search(r"\.tmp-[0-9a-f]{8}$", d.name) is not None  # written before names carried a pid
        stale = d.name.startswith(".trash-") or legacy or (m is not None and not _pid_alive(int(m.group(1))))
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def dir_size(d: Path) -> int:
    """The total size in bytes of the files under folder ``d`` (recursively).

    Raises:
        OSError: a file vanished or cannot be stat-ed while counting.
    """
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def sizes_match(d: Path, man: dict) -> bool:
    """Every file the manifest lists exists with its size (the cheap check; a load checks sha256)."""
    return all((d / n).is_file() and (d / n).stat().st_size == r.get("size") for n, r in man.get("files", {}).items())


def dir_entries(root: Path, describe: Callable[[Path, dict], dict]) -> list[dict]:
    """One row per folder under a cache root: ``key, path, size_bytes`` plus ``describe(folder,
    manifest)`` (which sets ``valid``); a folder without a readable manifest (a leftover of an
    interrupted write) is listed with ``valid`` False."""
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        if not d.is_dir():
            continue
        row: dict[str, Any] = {"key": d.name, "path": str(d), "size_bytes": dir_size(d), "valid": False}
        try:
            row.update(describe(d, read_manifest(d)))
        except (ManifestInvalid, OSError, ValueError):
            pass
        out.append(row)
    return out


def clear_dir(root: Path, keep: set[str] | frozenset[str] = frozenset()) -> tuple[int, int]:
    """Remove every entry under a cache root (and leftover temporary folders), except the folders
    named in ``keep``; returns ``(entries removed, bytes freed)``."""
    if not root.is_dir():
        return 0, 0
    n = freed = 0
    for d in list(root.iterdir()):
        if d.is_dir() and d.name not in keep:
            freed += dir_size(d)
            n += 0 if d.name.startswith(".") else 1
            remove_entry(d) if not d.name.startswith(".") else shutil.rmtree(d, ignore_errors=True)
    return n, freed

