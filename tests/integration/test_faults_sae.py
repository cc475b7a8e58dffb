"""Faults found by a breaker (issue: SAE training and its cache): NaN weights, training values that
cannot mean what they say, a damaged cached SAE, leftovers of killed trainings, SAELens' signal
handlers. Real NaN weights, real bit flips and truncations, real signals to real processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import GPT2_BPE, TINY_SAE_TRAIN, communicate_or_dump, start_child, tiny_overrides
from tracekit.config import parse_config
from tracekit.errors import ConfigError, SAEError

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
         "device": "cpu"}


@pytest.fixture
def sae_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(root))
    return root / "saes"


def _trained(model, cache_root):
    from tracekit.sae import SAETrainSpec, train_sae

    return train_sae(model, SAETrainSpec(**TINY_SAE_TRAIN), cache_dir=cache_root)


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
def test_an_sae_with_nan_weights_is_refused_at_load(tiny_gpt2, tmp_path):
    from safetensors.torch import load_file, save_file

    from tracekit import SAEEval, SAEFeatures

    src, _, _ = _trained(tiny_gpt2, tmp_path / "saes")
    bad = tmp_path / "nan_sae"
    shutil.copytree(src, bad)
    state = load_file(bad / "sae_weights.safetensors")
    state["W_dec"][3, 5] = float("nan")
    state["b_enc"][0] = float("inf")
    save_file(state, str(bad / "sae_weights.safetensors"))
    with pytest.raises(SAEError, match=r"non-finite value\(s\) \(NaN/inf\)"):
        SAEFeatures(sae={"path": str(bad)}, prompts=["The capital of France is"], target=" Paris",
                    expect=[{"metric": "max_sum_error", "max": 0.001}]).run(tiny_gpt2, progress=False)
    with pytest.raises(SAEError, match="W_dec|b_enc"):
        SAEEval(sae={"path": str(bad)}, max_tokens=128, seq_len=32).run(tiny_gpt2, progress=False)


def test_non_finite_results_never_meet_an_expectation():
    from tracekit.experiments.base import Expectation

    for obs in (float("nan"), float("inf"), None):
        for exp in ({"metric": "x", "max": 0.001}, {"metric": "x", "min": 0.5}, {"metric": "x", "value": 1.0, "atol": 1}):
            row = Expectation(**exp).check({"x": obs})
            assert row["met"] is False and "not a finite number" in row["error"], (obs, exp)
    assert Expectation(metric="x", max=0.001).check({"x": 0.0})["met"] is True


@pytest.mark.parametrize("train,message", [
    ({"k": 100, "d_sae": 32}, "k: 100 active features per token is more than d_sae (32)"),
    ({"training_tokens": 64, "train_batch_size_tokens": 1024}, "training_tokens: 64 is less than one batch"),
])
def test_training_values_that_cannot_mean_what_they_say_are_refused(train, message):
    cfg = {"model": MODEL, "experiments": [{"kind": "sae_train",
                                            "sae": {"train": {**TINY_SAE_TRAIN, **train}}}]}
    with pytest.raises(ConfigError) as e:
        parse_config(cfg)
    assert "experiments[0].sae.train" in str(e.value) and message in str(e.value)


def test_a_k_above_the_derived_width_is_refused_before_the_model_loads():
    from tracekit.runner import check_config

    t = {k: v for k, v in TINY_SAE_TRAIN.items() if k != "d_sae"}
    cfg = parse_config({"model": MODEL, "experiments": [
        {"kind": "sae_train", "sae": {"train": {**t, "expansion_factor": 1, "k": 65}}}]})
    with pytest.raises(Exception, match=r"k: 65 active features per token is more than the SAE's 64 features"):
        check_config(cfg)


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
@pytest.mark.parametrize("damage", ["bit_flip", "truncate", "manifest_gone"])
def test_a_damaged_cached_sae_is_detected_removed_and_retrained(tiny_gpt2, tmp_path, damage):
    from tracekit.sae import SAETrainSpec, load_sae, train_sae  # noqa: F401

    root = tmp_path / "saes"
    d, hit, _ = _trained(tiny_gpt2, root)
    assert not hit
    from tracekit.core.io import verify_files_manifest

    w = d / "sae_weights.safetensors"
    good = w.read_bytes()
    if damage == "bit_flip":  # same size, one bit of one weight flipped
        data = bytearray(good)
        data[len(data) - 17] ^= 0x10
        w.write_bytes(bytes(data))
    elif damage == "truncate":
        w.write_bytes(good[: len(good) // 2])
    else:
        (d / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="is invalid .*removing it and training it again"):
        d2, hit2, _ = _trained(tiny_gpt2, root)
    assert not hit2 and d2 == d
    verify_files_manifest(d2)  # a fresh, complete entry (SAELens' training is not bit-reproducible)
    assert len((d2 / "sae_weights.safetensors").read_bytes()) == len(good)
    _, hit3, _ = _trained(tiny_gpt2, root)
    assert hit3


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
def test_leftovers_of_killed_trainings_are_cleaned_and_the_cache_command_covers_saes(tiny_gpt2, sae_cache):
    from tracekit.cli import main

    d, _, _ = _trained(tiny_gpt2, sae_cache)
    dead = sae_cache / f".{'f' * 16}.tmp-999999-deadbeef"  # a training killed with SIGKILL (no such process)
    (dead / "activations").mkdir(parents=True)
    (dead / "activations" / "shard.npy").write_bytes(b"x" * 1000)
    live = sae_cache / f".{'e' * 16}.tmp-{os.getpid()}-cafef00d"  # a training still running here
    live.mkdir()
    _trained(tiny_gpt2, sae_cache)  # a later start cleans up
    assert not dead.exists() and live.exists()
    live.rmdir()
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["cache"]) == 0
    assert d.name in buf.getvalue() and "trained SAEs" in buf.getvalue()
    with redirect_stdout(io.StringIO()):
        assert main(["cache", "clear"]) == 0
    assert not d.exists()


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
def test_training_leaves_the_signal_handlers_as_they_were(tiny_gpt2, tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    from tracekit.sae import SAETrainSpec, train_sae

    train_sae(tiny_gpt2, SAETrainSpec(**{**TINY_SAE_TRAIN, "seed": 5}), cache_dir=tmp_path / "saes")
    assert {s: signal.getsignal(s) for s in before} == before


# ---- real signals to real processes ---------------------------------------------------------

LONG_TRAIN = {**TINY_SAE_TRAIN, "training_tokens": 50_000_000, "dataset_tokens": 2048}


def _start(args, cache: Path, cwd: Path):
    env = {**os.environ, "TRACEKIT_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return start_child([sys.executable, "-m", "tracekit.cli", *args], cwd=cwd, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_training(cache: Path, proc, timeout: float = 240.0) -> None:
    """Until the training's activations are cached and SAELens' trainer runs (a second more)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        tmps = list((cache / "saes").glob(".*.tmp-*")) if (cache / "saes").is_dir() else []
        if any((t / "activations").is_dir() and any((t / "activations").iterdir()) for t in tmps):
            time.sleep(3.0)
            return
        time.sleep(0.2)
    raise AssertionError("training never started")


@pytest.mark.sae  # SAELens' runner: waits for its cached activations on disk, then signals it
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_training_run_is_interrupted_not_failed(tmp_path, sig, code):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"model": MODEL, "experiments": [{"kind": "sae_train", "name": "train",
                                                                    "sae": {"train": LONG_TRAIN}}]}))
    cache = tmp_path / "cache"
    proc = _start(["run", str(cfg), "--out", str(tmp_path / "out"), "--no-progress"], cache, tmp_path)
    _wait_training(cache, proc)
    proc.send_signal(sig)
    out, _ = communicate_or_dump(proc, 120)
    assert proc.returncode == code, out
    run_dir = next((tmp_path / "out").iterdir())
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "interrupted", status
    assert not list((cache / "saes").glob(".*.tmp-*")), "the killed training's activations were left behind"


@pytest.mark.sae  # SAELens' runner: waits for its cached activations on disk, then signals it
def test_ctrl_c_stops_a_sweep_of_trainings(tmp_path):
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump({"model": MODEL, "experiments": [{"kind": "sae_train", "name": "train",
                                                                    "sae": {"train": LONG_TRAIN}}],
                                   "sweep": {"grid": {"experiments[0].sae.train.seed": [1, 2]}}}))
    cache = tmp_path / "cache"
    proc = _start(["sweep", str(cfg), "--out", str(tmp_path / "sw"), "--no-progress"], cache, tmp_path)
    _wait_training(cache, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = communicate_or_dump(proc, 120)
    assert proc.returncode == 130, out
    import pandas as pd

    idx = pd.read_parquet(tmp_path / "sw" / "index.parquet")
    assert not (idx["status"] == "complete").any(), idx[["point", "status"]]
    assert (idx["status"] != "failed").all(), "Ctrl-C is an interrupt, not a failed point"
    assert "point 1" not in out or "interrupted" in out
