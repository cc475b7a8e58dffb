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
    monkeypatch.setattr(load, "_CACHE", {})  # a model loaded by an earlier test would answer first
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


_CHILD = """
import json, sys
import tracekit.model.load as load
def no_weights(*a, **k):
    raise AssertionError("validate loaded weights")
load.load_model = no_weights
from tracekit.cli import main
rc = main(["validate", *sys.argv[1:]])
print(json.dumps({"rc": rc, "transformer_lens": "transformer_lens" in sys.modules}))
"""


def _child(tmp_path, *files) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRACEKIT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", _CHILD, *files], env=env, capture_output=True, text=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_validate_reads_the_model_info_cache_without_importing_transformer_lens(tmp_path):
    """The speed guard (not a timing): the first validate builds the model's hook names (importing
    TransformerLens) and caches them; the next one reads them back, imports no TransformerLens
    (about a second of CPU) and still finds the same problems. Neither loads weights."""
    good = _write(tmp_path, "good.yaml", SINGLE)
    bad_cfg = copy.deepcopy(SINGLE)
    bad_cfg["experiments"][0]["target"] = " Parisian"
    bad = _write(tmp_path, "bad.yaml", bad_cfg)
    assert _child(tmp_path, good) == {"rc": 0, "transformer_lens": True}
    assert _child(tmp_path, good) == {"rc": 0, "transformer_lens": False}
    assert _child(tmp_path, bad) == {"rc": 2, "transformer_lens": False}


def test_cached_model_info_equals_the_built_one(tmp_path, monkeypatch):
    import tracekit.model.info as info
    from tracekit.model.spec import as_spec

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    spec = as_spec(MODEL)
    cfg, tok, bridge = info._load_config_and_tokenizer(spec)
    built = info._info_from_config(spec, cfg, tok, bridge)
    where = info._info_cache_file(spec)
    assert where is not None and not where.exists()
    info._write_cached_info(where, built)
    cached = info._read_cached_info(where, spec, tok)
    assert cached is not None
    assert list(cached.hook_dict) == list(built.hook_dict)
    assert vars(cached.cfg) == vars(built.cfg) and cached.cfg.head_dim == built.cfg.head_dim
    assert all(cached._gated_hook_reason(n) == built._gated_hook_reason(n) for n in built.hook_dict)
    assert any(built._gated_hook_reason(n) for n in built.hook_dict)  # the comparison covers gated hooks
    other = as_spec({**MODEL, "config_overrides": tiny_overrides("gpt2", 3)})
    assert info._info_cache_file(other) != where  # another config: another entry


def test_steering_sweep_compare_key_is_checked_and_declared_keys_are_the_summarys(tmp_path, capsys):
    """The issue's case: a steering sweep whose ``compare`` names no metric is refused before any run
    (steering declares its summary keys), and the declared keys are exactly what its summary holds
    (so the check cannot refuse a real key)."""
    from helpers import KIND_EXAMPLES, make_tiny
    from tracekit.experiments.steering import Steering, SteeringResult
    from tracekit.results import COMMON_SUMMARY_KEYS

    step = {"kind": "steering", "name": "steer", **KIND_EXAMPLES["steering"]}
    cfg = {"model": MODEL, "experiments": [step],
           "sweep": {"grid": {"experiments[0].layer": [0, 1]}, "compare": ["steer/mean_target_prob_by_alpa"]}}
    assert main(["validate", _write(tmp_path, "steer.yaml", cfg)]) == 2
    err = capsys.readouterr().err
    assert "'mean_target_prob_by_alpa'" in err and "did you mean 'mean_target_prob_by_alpha'" in err
    cfg["sweep"]["compare"] = ["steer/mean_target_prob_by_alpha", "steer/dataset_filter"]
    assert main(["validate", _write(tmp_path, "steer_ok.yaml", cfg)]) == 0
    capsys.readouterr()
    res = Steering.model_validate({k: v for k, v in step.items() if k not in ("kind", "name")}).run(
        make_tiny("gpt2"), progress=False)
    keys = set(res.summary())
    assert keys <= set(SteeringResult.summary_keys) | set(COMMON_SUMMARY_KEYS), keys - set(SteeringResult.summary_keys)
    generation = {"generation_alpha", "generated_row_ids", "steered_text_by_row", "unsteered_text_by_row",
                  "steered_first_token_by_row", "unsteered_first_token_by_row"}
    assert set(SteeringResult.summary_keys) - keys <= generation  # only the keys of `generate` may be absent
