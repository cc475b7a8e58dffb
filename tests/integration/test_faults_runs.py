"""Faults found by a breaker (issue: runs and the weight cache): step names that would replace the
run's own files, and a full disk while the weight cache is written (a real file-size limit)."""

from __future__ import annotations

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
