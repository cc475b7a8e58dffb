"""A run without progress bars still shows it is alive: `tracekit run --no-progress` prints, to stderr,
the model load, one line when each step starts and one when it ends with its wall time, and the
throttled ``n/total, elapsed, ETA`` lines of a step's loop (interval 0 here, so every update prints)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from tracekit.cli import main


def _config(tmp_path: Path) -> Path:
    p = tmp_path / "two_steps.yaml"
    p.write_text(textwrap.dedent("""
        experiments:
          - {kind: logit_lens, name: first, prompts: ["The capital of France is"], target: " Paris"}
          - {kind: logit_lens, name: second, prompts: ["The capital of France is", "The capital of Italy is"],
             target: " Paris", batch_size: 1}
    """))
    return p


def _tiny(tok_dir) -> list[str]:
    return ["--set", "model.name=gpt2", "--set", "model.random_init=true", "--set", f"model.tokenizer={tok_dir}",
            "--set", "model.device=cpu",
            "--set", "model.config_overrides={n_layer: 1, n_embd: 32, n_head: 2}"]


def test_no_progress_run_prints_step_lines_with_elapsed_and_eta(tmp_path, gpt2_tokenizer_dir, capsys, monkeypatch):
    monkeypatch.setenv("TRACEKIT_PROGRESS_INTERVAL", "0")
    code = main(["run", str(_config(tmp_path)), "--out", str(tmp_path / "out"), "--no-progress",
                 *_tiny(gpt2_tokenizer_dir)])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    err = cap.err.splitlines()
    seconds = r"(\d+\.\d s|\d+m\d\ds|\d+h\d\dm)"
    assert any(s.startswith("loading model 'gpt2' ...") for s in err), err
    assert any(re.fullmatch(rf"model loaded in {seconds}", s) for s in err), err
    for i, name in ((1, "first"), (2, "second")):
        start = err.index(f"[step {i}/2 {name}] start")
        done = [k for k, s in enumerate(err) if re.fullmatch(rf"\[step {i}/2 {name}\] done in {seconds}", s)]
        assert len(done) == 1 and done[0] > start, err
    # the second step's loop over its 2 rows: a line per row (interval 0), between its start and done
    s2 = err.index("[step 2/2 second] start")
    eta = [s for s in err[s2:] if s.startswith("[logit lens] ")]
    assert re.fullmatch(rf"\[logit lens\] 1/2 row \(50%\), elapsed {seconds}, ETA {seconds}", eta[0]), eta
    assert eta[-1].startswith("[logit lens] 2/2 ")
    # stdout keeps the reports and the run directory; the progress lines are not there
    assert "run directory:" in cap.out and "[step " not in cap.out
    run_dir = next((tmp_path / "out").iterdir())
    st = json.loads((run_dir / "status.json").read_text())
    assert st["status"] == "complete" and st["finished"] == ["first", "second"] and st["step_started"]


def test_a_failing_step_says_when_it_stopped(tmp_path, gpt2_tokenizer_dir, capsys, monkeypatch):
    from tracekit.experiments.logit_lens import LogitLens

    def boom(self, *a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(LogitLens, "_run", boom)
    code = main(["run", str(_config(tmp_path)), "--out", str(tmp_path / "out"), "--no-progress",
                 *_tiny(gpt2_tokenizer_dir)])
    err = capsys.readouterr().err
    assert code == 1
    assert re.search(r"^\[step 1/2 first\] stopped after \d+\.\d s$", err, re.M), err
    assert "[step 2/2" not in err


@pytest.mark.parametrize("progress", [True, False])
def test_library_runs_send_progress_lines_to_the_log(tmp_path, tiny_gpt2, progress):
    """run_config's lines go to ``progress_log`` (default: ``log``); a quiet log stays quiet."""
    from tracekit.config import parse_config
    from tracekit.runner import run_config

    cfg = parse_config({"experiments": [{"kind": "logit_lens", "name": "only", "prompts": ["a b c"]}]})
    logged: list[str] = []
    run_config(cfg, tmp_path, model=tiny_gpt2, progress=progress, log=logged.append, figures=False)
    assert "[step 1/1 only] start" in logged and any(s.startswith("[step 1/1 only] done in ") for s in logged)
    quiet: list[str] = []
    run_config(cfg, tmp_path, model=tiny_gpt2, progress=progress, log=lambda s: None, figures=False,
               progress_log=quiet.append)
    assert quiet[0] == "[step 1/1 only] start" and quiet[-1].startswith("[step 1/1 only] done in ")


def test_graph_backward_passes_report_rows_and_eta(monkeypatch):
    """build_graph with bars off: a line per update at interval 0, counting every backward row
    (logit and feature nodes) up to the total, with an ETA before the end."""
    from graph_models import IDS, PARIS, random_transcoders

    from tests.helpers import make_perturbed
    from tracekit.core.progress import progress_sink
    from tracekit.graphs import build_graph

    monkeypatch.setenv("TRACEKIT_PROGRESS_INTERVAL", "0")
    m = make_perturbed("llama")
    lines: list[str] = []
    with progress_sink(lines.append):
        g = build_graph(m, random_transcoders(m, d_sae=12), IDS[:5], target=PARIS, batch_size=4, progress=False)
    rows = [re.match(r"\[attribution graph backward passes\] (\d+)/(\d+) row", s) for s in lines]
    assert rows and all(rows), lines
    assert len(lines) == g.settings["backward_passes"]
    done = [int(r.group(1)) for r in rows if r]
    total = int(rows[-1].group(2)) if rows[-1] else 0
    assert done == sorted(done) and done[-1] == total
    assert "ETA" in lines[0] and "ETA" not in lines[-1]
