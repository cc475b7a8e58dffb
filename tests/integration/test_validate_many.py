"""``tracekit validate`` (issue 36, items 1, 4 and 9): several files in one call (one result line
each, exit 2 when any is invalid, the model's tokenizer and config read once), sweep configs
expanded and every point checked, a sweep's ``compare`` metric that names no summary key refused
before anything runs (validate, ``sweep --dry-run`` and a real sweep), and no weights read."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from helpers import GPT2_BPE, tiny_overrides
from tracekit.cli import main
from tracekit.errors import ConfigError
from tracekit.sweep import run_sweep

MODEL = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2", 2),
         "device": "cpu"}
SINGLE = {"model": MODEL, "experiments": [{"kind": "logit_lens", "name": "lens",
                                           "prompts": ["The capital of France is"], "target": " Paris"}]}
SWEEP = {**SINGLE, "sweep": {"grid": {"experiments[0].target": [" Paris", " Rome"],
                                      "experiments[0].prompts": [["The capital of France is"], ["Paris is in"]]},
                             "compare": ["lens/target_prob_by_hidden_state"]}}


def _write(tmp_path: Path, name: str, cfg: dict) -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def test_validate_expands_a_sweep_and_checks_every_point(tmp_path, capsys):
    assert main(["validate", _write(tmp_path, "sweep.yaml", SWEEP)]) == 0
    out = capsys.readouterr().out
    assert "4 configs valid" in out and "tracekit sweep" in out
    bad = copy.deepcopy(SWEEP)
    bad["sweep"]["grid"]["experiments[0].target"] = [" Paris", " Parisian"]  # two tokens: 2 of 4 points fail
    assert main(["validate", _write(tmp_path, "bad.yaml", bad)]) == 2
    err = capsys.readouterr().err
    assert "2 of 4 sweep point(s) are invalid" in err and "Parisian" in err


def _misnamed(tmp_path) -> str:
    bad = copy.deepcopy(SWEEP)
    bad["sweep"]["compare"] = ["lens/target_prob_by_hiden_state"]
    return _write(tmp_path, "typo.yaml", bad)


def test_compare_metric_matching_nothing_is_refused_before_any_run(tmp_path, capsys):
    cfg = _misnamed(tmp_path)
    assert main(["validate", cfg]) == 2
    err = capsys.readouterr().err
    assert "'target_prob_by_hiden_state'" in err and "did you mean 'target_prob_by_hidden_state'" in err
    out = tmp_path / "out"
    assert main(["sweep", cfg, "--out", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "'target_prob_by_hiden_state'" in err and "did you mean" in err
    with pytest.raises(ConfigError, match="target_prob_by_hiden_state"):
        run_sweep(cfg, out, progress=False, log=lambda *a: None)
    assert not out.exists()  # nothing ran, no folder written
    step = copy.deepcopy(SWEEP)
    step["sweep"]["compare"] = ["lnes/target_prob_by_hidden_state"]
    assert main(["validate", _write(tmp_path, "step.yaml", step)]) == 2
    assert "names no step 'lnes' (did you mean 'lens'?)" in capsys.readouterr().err


def test_validate_takes_several_files_and_fails_if_one_is_bad(tmp_path, capsys, monkeypatch):
    """Three files naming one model: one result line each, exit 2 for the bad one, the tokenizer
    and config read once, and no weights loaded (the guard for validate's speed)."""
    import tracekit.model.info as info
    import tracekit.model.load as load
    import tracekit.model.source as source

    def no_weights(*a, **k):
        raise AssertionError("validate loaded weights")

    monkeypatch.setattr(load, "load_model", no_weights)
    monkeypatch.setattr(source, "load_hf", no_weights)
    monkeypatch.setattr(info, "_INFO", {})
    reads = []
    real = info._load_config_and_tokenizer
    monkeypatch.setattr(info, "_load_config_and_tokenizer", lambda spec: reads.append(spec) or real(spec))
    good = _write(tmp_path, "good.yaml", SINGLE)
    bad_cfg = copy.deepcopy(SINGLE)
    bad_cfg["experiments"][0]["target"] = " Parisian"
    bad = _write(tmp_path, "bad.yaml", bad_cfg)
    sweep = _write(tmp_path, "sweep.yaml", SWEEP)
    assert main(["validate", good, bad, sweep]) == 2
    cap = capsys.readouterr()
    assert f"{good}: valid" in cap.out and f"{sweep}: 4 configs valid" in cap.out
    assert f"{bad}:" in cap.err and "exactly one token" in cap.err and f"{bad}: valid" not in cap.out
    assert "2/3 file(s) valid" in cap.out
    assert len(reads) == 1  # one model: its tokenizer and config read once for the three files
    assert main(["validate", good, sweep]) == 0
