"""Faults found by a breaker (issue: pipelines): a reference that resolves to null, a table
reference that matches no rows and a plain empty selection are refused before any work, naming the
YAML path and why; none silently becomes the field's default."""

from __future__ import annotations

import json

import pytest

from helpers import GPT2_BPE, tiny_overrides
from tracekit.config import parse_config
from tracekit.errors import ConfigError
from tracekit.runner import StepFailed, run_config

MODEL = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
         "device": "cpu"}
PROMPT = "The capital of France is"
PAIR = {"clean": "The capital of France is", "corrupted": "The capital of Italy is", "target": " Paris",
        "foil": " Rome"}


def quiet(*a, **k):
    pass


def _run(steps, tmp_path, model):
    cfg = parse_config({"model": MODEL, "seed": 0, "experiments": steps})
    return run_config(cfg, tmp_path, "faults", model=model, progress=False, log=quiet)


def test_a_null_reference_is_an_error_naming_the_key_and_why(tiny_gpt2, tmp_path):
    # a random tiny GPT-2 never puts ' Paris' on top: emergence_layer is null
    lens = {"kind": "logit_lens", "name": "lens", "prompts": [PROMPT], "target": " Paris"}
    patch = {"kind": "activation_patching", "name": "patch", "pairs": [PAIR], "sites": ["resid_pre"],
             "layers": [{"from": "lens", "key": "emergence_layer"}]}
    patch_scalar = {**patch, "name": "patch2", "layers": None}
    with pytest.raises(StepFailed) as e:
        _run([lens, patch], tmp_path, tiny_gpt2)
    msg = str(e.value.__cause__ or e.value)
    assert "experiments[1].layers[0]" in msg and "emergence_layer" in msg and "is null" in msg
    assert "never stays top-1" in msg
    run_dir = next(tmp_path.iterdir())
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and "patch" not in status.get("finished", [])
    assert not (run_dir / "patch").exists()  # nothing patched every layer
    # a reference as the whole field: null would have become "every layer"
    patch_scalar["layers"] = {"from": "lens", "key": "emergence_layer"}
    with pytest.raises(StepFailed) as e:
        _run([lens, patch_scalar], tmp_path / "b", tiny_gpt2)
    msg = str(e.value.__cause__ or e.value)
    assert "experiments[1].layers" in msg and "null: every one" in msg


def test_a_field_that_opts_in_takes_a_null(tiny_gpt2, tmp_path):
    lens = {"kind": "logit_lens", "name": "lens", "prompts": [PROMPT], "target": " Paris"}
    dla = {"kind": "direct_logit_attribution", "name": "dla", "prompts": [PROMPT], "target": " Paris",
           "foil": {"from": "lens", "key": "emergence_layer"}}
    run_dir, _ = _run([lens, dla], tmp_path, tiny_gpt2)
    assert json.loads((run_dir / "lens" / "summary.json").read_text())["emergence_layer"] is None
    assert json.loads((run_dir / "dla" / "summary.json").read_text())["foil_by_row"] == [None]  # null means "no foil"


def test_a_table_reference_matching_no_rows_is_refused(tiny_gpt2, tmp_path):
    dla = {"kind": "direct_logit_attribution", "name": "dla", "prompts": [PROMPT], "target": " Paris"}
    patch = {"kind": "activation_patching", "name": "patch", "pairs": [PAIR], "sites": ["resid_pre"],
             "layers": {"from": "dla", "table": "heads", "where": "head_idx > 1000", "column": "layer"}}
    with pytest.raises(StepFailed) as e:
        _run([dla, patch], tmp_path, tiny_gpt2)
    msg = str(e.value.__cause__ or e.value)
    assert "experiments[1].layers" in msg and "matches no rows" in msg and "head_idx > 1000" in msg


@pytest.mark.parametrize("kind,field", [("activation_patching", "layers"), ("activation_patching", "neurons"),
                                        ("neuron_attribution", "layers"), ("attention_pattern", "heads"),
                                        ("head_scan", "layers"), ("linear_probe", "layers")])
def test_an_empty_selection_is_refused_at_validation(kind, field):
    base = {"activation_patching": {"pairs": [PAIR], "sites": ["neuron"], "neuron_layers": [0]},
            "neuron_attribution": {"prompts": [PROMPT], "target": " Paris"},
            "attention_pattern": {"prompts": [PROMPT], "layer": 0},
            "head_scan": {},
            "linear_probe": {"dataset": {"builtin": "countries"}}}[kind]
    with pytest.raises(ConfigError) as e:
        parse_config({"model": MODEL, "experiments": [{"kind": kind, **base, field: []}]})
    assert f"experiments[0].{field}" in str(e.value) and "empty list selects nothing" in str(e.value)
