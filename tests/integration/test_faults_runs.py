"""Faults found by a breaker (issue: runs and the weight cache): step names that would replace the
run's own files, and a full disk while the weight cache is written (a real file-size limit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import GPT2_BPE, tiny_overrides
from tracekit.config import parse_config
from tracekit.errors import ConfigError

MODEL = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
         "device": "cpu"}


@pytest.mark.parametrize("name", ["status.json", "summary.json", "environment.json", "references.json",
                                  "config.resolved.yaml", "expectations.json", "error.txt", "Status.JSON"])
def test_a_step_named_like_a_run_file_is_refused(name):
    with pytest.raises(ConfigError) as e:
        parse_config({"model": MODEL, "experiments": [{"kind": "logit_lens", "name": name,
                                                       "prompts": ["The capital of France is"]}]})
    assert "experiments[0].name" in str(e.value) and "keeps for itself" in str(e.value)


@pytest.mark.slow
def test_a_full_disk_while_the_weight_cache_is_written_warns_and_goes_on(tmp_path):
    """RLIMIT_FSIZE makes every write past 1 MiB fail (EFBIG): the cache write fails like on a full
    disk. load_model warns, returns a working model, and leaves no temporary folder behind."""
    cache = tmp_path / "cache"
    script = textwrap.dedent("""
        import resource, signal, warnings
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), not the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        import tracekit as tk
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model = tk.load_model("smollm2-135m", device="cpu")
        print("WARNED:", any("could not write its weight cache" in str(x.message) for x in w))
        res = tk.LogitLens(prompts=["The capital of France is"], target=" Paris").run(model, progress=False)
        print("P_FINAL:", res.summary()["target_prob_final"])
    """)
    env = {**os.environ, "TRACEKIT_CACHE_DIR": str(cache), "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "WARNED: True" in r.stdout and "P_FINAL:" in r.stdout
    left = [p for p in cache.rglob("*") if ".tmp-" in p.name]
    assert not left, f"temporary folders left behind: {left}"


def _same_size(path, text: str) -> None:
    """Overwrite a file with ``text`` padded to its old size (the manifest's size check still passes)."""
    n = path.stat().st_size
    assert len(text.encode()) <= n
    path.write_text(text + " " * (n - len(text.encode())))


def _set_manifest(d, edit) -> None:
    man = json.loads((d / "manifest.json").read_text())
    edit(man)
    (d / "manifest.json").write_text(json.dumps(man))


def _resize(d, name) -> None:
    _set_manifest(d, lambda m: m["files"].__setitem__(name, (d / name).stat().st_size))


def _bad_config(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["top_kk"] = 3  # a key the kind does not have: pydantic's ValidationError before
    (d / "config.json").write_text(json.dumps(cfg))
    _resize(d, "config.json")


def _drop_config(d):
    (d / "config.json").unlink()
    _set_manifest(d, lambda m: m["files"].pop("config.json"))


#: name -> (how the saved folder is damaged, words the error must hold besides the folder)
DAMAGE = {
    "foreign manifest (a list)": (lambda d: (d / "manifest.json").write_text("[1, 2]"), ["manifest.json"]),
    "foreign manifest, no config": (lambda d: ((d / "manifest.json").write_text('{"name": "other tool"}'),
                                               (d / "config.json").unlink()), ["config.json", "missing"]),
    "config not JSON": (lambda d: _same_size(d / "config.json", "{not json"), ["config.json", "not valid JSON"]),
    "config of another shape": (_bad_config, ["config.json", "top_kk"]),
    "config gone and unlisted": (_drop_config, ["config.json", "missing"]),
    "meta not JSON": (lambda d: _same_size(d / "meta.json", "[[["), ["meta.json", "not valid JSON"]),
    "table not parquet": (lambda d: _same_size(d / "main.parquet", "PAR1 garbage"), ["main.parquet"]),
    "listed table unlisted file gone": (lambda d: (_set_manifest(d, lambda m: m["files"].pop("main.parquet")),
                                                   (d / "main.parquet").unlink()), ["main.parquet", "missing"]),
    "summary not JSON": (lambda d: _same_size(d / "summary.json", "nope"), ["summary.json", "not valid JSON"]),
}


@pytest.fixture(scope="module")
def saved_lens(tiny_gpt2, tmp_path_factory):
    import tracekit as tk

    res = tk.LogitLens(prompts=["The capital of France is"], target=" Paris").run(tiny_gpt2, progress=False)
    return res.save(tmp_path_factory.mktemp("saved") / "lens")


@pytest.mark.parametrize("case", list(DAMAGE))
def test_loading_a_foreign_or_damaged_result_folder_is_a_tracekit_error(saved_lens, tmp_path, case):
    """Every file of a result folder is read through one checked loader: a foreign or half-written
    folder is a ResultLoadError naming the folder and the file, never a raw ValidationError /
    FileNotFoundError / JSONDecodeError."""
    import shutil

    from tracekit.errors import ResultLoadError, TracekitError
    from tracekit.results import Result

    d = tmp_path / "lens"
    shutil.copytree(saved_lens, d)
    damage, words = DAMAGE[case]
    damage(d)
    with pytest.raises(TracekitError) as e:
        Result.load(d).summary()
    assert isinstance(e.value, ResultLoadError), f"{type(e.value).__name__}: {e.value}"
    msg = str(e.value)
    assert str(d) in msg, msg
    for w in words:
        assert w in msg, msg
