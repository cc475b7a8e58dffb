"""A run is a record even when it dies: real signals to real `tracekit run` subprocesses.

Each test starts `python -m tracekit.cli run` on a tiny random GPT-2 (GPT-2's real tokenizer) with a
quick first step and a slow second one, waits until status.json says the second step is running,
and then interrupts it (SIGINT, SIGTERM, SIGKILL), or breaks the output folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

import tracekit as tk
from helpers import communicate_or_dump, start_child
from tracekit.runner import read_status

ROOT = Path(__file__).resolve().parents[2]
RANDOM = ["--set", "model.name=gpt2", "--set", "model.random_init=true", "--set", "model.tokenizer=gpt2-bpe", "--set", "model.device=cpu",
          "--set", "model.config_overrides={n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64}"]


def _config(tmp_path: Path, n_slow: int = 4000) -> Path:
    slow = ", ".join(['"The capital of France is"'] * n_slow)
    p = tmp_path / "two_steps.yaml"
    p.write_text(textwrap.dedent(f"""
        experiments:
          - {{kind: logit_lens, name: quick, prompts: ["The capital of France is"], target: " Paris"}}
          - {{kind: logit_lens, name: slow, prompts: [{slow}], target: " Paris", batch_size: 1}}
    """))
    return p


def _start(cfg: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return start_child([sys.executable, "-m", "tracekit.cli", "run", str(cfg), "--out", str(out),
                        "--no-progress", *RANDOM, *extra], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)


def _wait_for_step(out: Path, step: str, proc: subprocess.Popen, timeout: float = 120) -> Path:
    t0 = time.time()
    while time.time() - t0 < timeout:
        for d in out.glob("*/status.json"):
            st = json.loads(d.read_text())
            if st.get("step") == step:
                return d.parent
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("step never started")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_keeps_finished_steps_and_records_where(tmp_path, sig, code):
    out = tmp_path / "out"
    proc = _start(_config(tmp_path), out)
    run_dir = _wait_for_step(out, "slow", proc)
    time.sleep(0.5)
    proc.send_signal(sig)
    stdout, stderr = communicate_or_dump(proc, 60)
    assert proc.returncode == code, (stdout, stderr)
    assert "Traceback" not in stderr and "interrupted" in stderr
    # one error line, no 23-frame traceback; the rest of stderr is the run's progress lines
    progress = re.compile(r"^(loading model |model loaded in |\[loading model |\[step \d+/\d+ \w+\] |\[logit lens\] )")
    assert len([s for s in stderr.strip().splitlines() if not progress.match(s)]) == 1, stderr
    assert re.search(r"^\[step 2/2 slow\] stopped after ", stderr, re.M), stderr
    st = read_status(run_dir)
    assert st["status"] == "interrupted" and st["step"] == "slow" and st["finished"] == ["quick"]
    assert (run_dir / "error.txt").read_text().startswith("interrupted")
    for f in ("environment.json", "config.resolved.yaml", "summary.json"):
        assert (run_dir / f).is_file(), f
    assert not (run_dir / "slow").exists() and not (run_dir / ".scratch").exists()
    # the finished step reloads equal to an uninterrupted run of it
    got = tk.Result.load(run_dir / "quick")
    from helpers import make_tiny  # noqa: F401  (same spec as the CLI's --set)
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name="gpt2", random_init=True, tokenizer="gpt2-bpe", device="cpu",
                     config_overrides={"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64})
    ref = tk.LogitLens(prompts=["The capital of France is"], target=" Paris", name="quick").run(spec, progress=False)
    pd.testing.assert_frame_equal(got.tables["main"], ref.tables["main"], check_exact=False, atol=1e-6)
    # `tracekit show` reports it
    show = subprocess.run([sys.executable, "-m", "tracekit.cli", "show", str(run_dir)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "interrupted" in show.stdout and "slow" in show.stdout


def test_sigkill_leaves_a_status_that_reads_as_interrupted(tmp_path):
    out = tmp_path / "out"
    proc = _start(_config(tmp_path), out)
    run_dir = _wait_for_step(out, "slow", proc)
    proc.kill()
    proc.wait(timeout=30)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "running"  # written before the kill
    st = read_status(run_dir)
    assert st["status"] == "interrupted" and st["process_gone"] and st["step"] == "slow"
    assert (run_dir / "environment.json").is_file() and (run_dir / "quick" / "manifest.json").is_file()
    tk.Result.load(run_dir / "quick")


def test_two_runs_started_together_both_succeed(tmp_path):
    out = tmp_path / "out"
    cfg = _config(tmp_path, n_slow=1)
    procs = [_start(cfg, out) for _ in range(3)]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], results
    dirs = sorted(out.iterdir())
    assert len(dirs) == 3 and all(read_status(d)["status"] == "complete" for d in dirs)


def test_read_only_output_fails_before_the_model_loads(tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits: use a path under a regular file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        out = blocker / "out"
    else:
        out = tmp_path / "ro"
        out.mkdir()
        out.chmod(0o500)
    t0 = time.time()
    proc = _start(_config(tmp_path, n_slow=1), out)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--out" in stderr and "not a writable folder" in stderr, stderr
    assert "loading model" not in stderr
    assert time.time() - t0 < 60


def test_output_vanishing_mid_run_reports_the_real_error_and_rescues(tmp_path, monkeypatch):
    """The folder turns unwritable after the run starts: the save error is reported (not error.txt's),
    and the computed step is saved elsewhere, with the path in the message."""
    from tracekit.config import load_config
    from tracekit.errors import OutputError
    from tracekit.runner import StepFailed, run_config

    cfg, _ = load_config(_config(tmp_path, n_slow=1), RANDOM[1::2])
    real_save = tk.Result.save

    def failing_save(self, directory, figures=True):
        if Path(directory).name == "slow" and "tracekit-rescue-" not in str(directory):
            raise OutputError(f"cannot write the result to {directory}: Read-only file system")
        return real_save(self, directory, figures)

    monkeypatch.setattr(tk.Result, "save", failing_save)
    with pytest.raises(StepFailed) as e:
        run_config(cfg, tmp_path / "out", stem="t", progress=False, log=lambda *_: None)
    msg = str(e.value)
    assert "Read-only file system" in msg and "saved to" in msg
    rescued = Path(msg.split("saved to ")[1].split(" instead")[0])
    assert (rescued / "manifest.json").is_file()
    run_dir = e.value.run_dir
    assert read_status(run_dir)["status"] == "failed"
    assert "Read-only" in (run_dir / "error.txt").read_text().splitlines()[0]
