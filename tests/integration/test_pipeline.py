"""Pipelines: step fields taken from earlier steps' results (tracekit.pipeline), on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers import GPT2_BPE, tiny_overrides
from tracekit.config import parse_config
from tracekit.errors import ConfigError
from tracekit.pipeline import PendingStep, Reference, lookup_path, resolve_reference
from tracekit.runner import StepFailed, run_config

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"
MODEL = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
         "device": "cpu"}
TOP_HEAD = {"from": "dla", "table": "heads", "where": "head_idx >= 0 and row_id == 0", "order_by": "contribution",
            "abs": True, "descending": True, "row": 0}


def lens(name="lens"):
    return {"kind": "logit_lens", "name": name, "prompts": [PROMPT], "target": " Paris"}


def dla(name="dla"):
    return {"kind": "direct_logit_attribution", "name": name, "prompts": [PROMPT], "target": " Paris"}


def attention(layer, head=None, name="att"):
    step = {"kind": "attention_pattern", "name": name, "prompts": [PROMPT], "layer": layer}
    if head is not None:
        step["head"] = head
    return step


def config(*steps):
    return {"model": MODEL, "seed": 0, "experiments": list(steps)}


def quiet(*a, **k):
    pass


def test_references_resolve_to_saved_values_and_are_recorded(tiny_gpt2, tmp_path):
    neurons = {"kind": "neuron_attribution", "name": "neurons", "prompts": [PROMPT], "target": " Paris",
               "layers": [{"from": "lens", "key": "hidden_states[-1]", "offset": -1}], "contexts": None,
               "ablation": None,
               "top_k": 3}
    cfg = parse_config(config(lens(), dla(), attention({**TOP_HEAD, "column": "layer"}, {**TOP_HEAD, "column": "head_idx"}),
                              neurons))
    assert [type(s) is PendingStep for s in cfg.experiments] == [False, False, True, True]
    run_dir, summary = run_config(cfg, tmp_path, "pipe", model=tiny_gpt2, progress=False, log=quiet)

    # expected values computed here, independently, from what the earlier steps saved
    heads = pd.read_parquet(run_dir / "dla" / "heads.parquet")
    heads = heads[(heads["head_idx"] >= 0) & (heads["row_id"] == 0)]
    top = heads.loc[heads["contribution"].abs().idxmax()]
    lens_summary = json.loads((run_dir / "lens" / "summary.json").read_text())
    att_cfg = json.loads((run_dir / "att" / "config.json").read_text())
    assert (att_cfg["layer"], att_cfg["head"]) == (int(top["layer"]), int(top["head_idx"]))
    neu_cfg = json.loads((run_dir / "neurons" / "config.json").read_text())
    assert neu_cfg["layers"] == [lens_summary["hidden_states"][-1] - 1] == [tiny_gpt2.cfg.n_layers - 1]
    # the run dir says what ran: values in config.resolved.yaml, provenance in references.json
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["experiments"][2]["layer"] == int(top["layer"])
    assert resolved["experiments"][3]["layers"] == neu_cfg["layers"]
    assert parse_config(resolved).experiments[2].layer == int(top["layer"])  # rerunnable as a plain config
    refs = json.loads((run_dir / "references.json").read_text())
    assert {r["field"]: r["value"] for r in refs["att"]} == {"experiments[2].layer": int(top["layer"]),
                                                             "experiments[2].head": int(top["head_idx"])}
    assert refs["neurons"][0]["from"] == {"from": "lens", "key": "hidden_states[-1]", "offset": -1}
    assert summary["steps"]["att"]  # the step ran on the resolved values


@pytest.mark.parametrize("steps, path, words", [
    ([lens(), attention({"from": "nosuch", "key": "x"})], "experiments[1].layer.from", ["unknown step 'nosuch'"]),
    ([attention({"from": "lens", "key": "layers[0]"}), lens()], "experiments[0].layer.from", ["runs later", "move"]),
    ([lens(), attention({"from": "att", "key": "layer"})], "experiments[1].layer.from", ["itself", "cycle"]),
    ([{**dla("a"), "position": {"from": "b", "key": "x"}}, {**dla("b"), "position": {"from": "a", "key": "x"}}],
     "experiments[0].position.from", ["cycle", "a -> b -> a"]),
    ([lens(), attention({"from": "lens", "key": "layers", "table": "main", "column": "layer"})],
     "experiments[1].layer", ["exactly one of 'key'"]),
    ([lens(), attention({"from": "lens", "table": "main"})], "experiments[1].layer", ["needs 'column'"]),
    ([lens(), attention({"from": "lens", "key": "x", "colum": "layer"})], "experiments[1].layer.colum",
     ["unknown key of a reference"]),
    ([lens(), attention({"from": "lens", "key": "x", "row": 0})], "experiments[1].layer", ["only apply to a table"]),
    ([lens(), {**attention({"from": "lens", "key": "x"}), "dominance": 5}], "experiments[1].dominance",
     ["less than or equal"]),
    ([lens(), {**attention({"from": "lens", "key": "x"}), "nosuch": 1}], "experiments[1].nosuch", ["unknown key"]),
])
def test_reference_errors_before_any_model(steps, path, words):
    with pytest.raises(ConfigError) as e:
        parse_config(config(*steps))
    msg = str(e.value)
    assert path in msg, msg
    for w in words:
        assert w in msg, msg


def test_documented_summary_keys_are_checked_at_parse_time(monkeypatch):
    from tracekit.experiments.logit_lens import LogitLensResult

    monkeypatch.setattr(LogitLensResult, "summary_keys", ("emergence_layer", "hidden_states"), raising=False)
    parse_config(config(lens(), attention({"from": "lens", "key": "hidden_states[0]"})))
    with pytest.raises(ConfigError, match=r"experiments\[1\]\.layer\.key: logit_lens step 'lens' has no summary key "
                                          r"'emergence_layr'"):
        parse_config(config(lens(), attention({"from": "lens", "key": "emergence_layr"})))


@pytest.mark.parametrize("ref, words", [
    ({"from": "lens", "key": "jump.nosuch"}, ["experiments[1].layer.key", "no summary value"]),
    ({"from": "lens", "key": "final_top1"}, ["experiments[1].layer: the value", "does not fit",
                                              "valid integer"]),
    ({"from": "lens", "table": "main", "column": "nosuch", "row": 0}, ["experiments[1].layer.column",
                                                                       "no column 'nosuch'"]),
    ({"from": "lens", "table": "main", "column": "layer", "where": "layer > 999", "row": 0},
     ["experiments[1].layer.row", "out of range"]),
])
def test_resolution_errors_name_the_yaml_path(tiny_gpt2, tmp_path, ref, words):
    cfg = parse_config(config(lens(), attention(ref)))
    with pytest.raises(StepFailed) as e:
        run_config(cfg, tmp_path, "bad", model=tiny_gpt2, progress=False, log=quiet)
    cause = e.value.__cause__
    assert isinstance(cause, ConfigError)
    for w in words:
        assert w in str(cause), str(cause)
    run_dir = next(tmp_path.iterdir())
    assert (run_dir / "lens" / "manifest.json").is_file()  # the earlier step's result is kept
    assert not (run_dir / "att").exists()


def test_path_references_and_lookup(tmp_path):
    step = tmp_path / "train"
    (step / "sae").mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"tables": []}))
    (step / "summary.json").write_text(json.dumps({"top": [{"layer": 3, "index": [7, 8]}], "d": {"a b": 1}}))
    ref = Reference.model_validate({"from": "train", "path": "sae"})
    assert resolve_reference(ref, tmp_path) == str((step / "sae").resolve())
    with pytest.raises(ConfigError, match="saved no 'nosuch'"):
        resolve_reference(Reference.model_validate({"from": "train", "path": "nosuch"}), tmp_path, "x.sae")
    with pytest.raises(ConfigError, match="leaves the step's folder"):
        resolve_reference(Reference.model_validate({"from": "train", "path": "../train2"}), tmp_path, "x.sae")
    with pytest.raises(ConfigError, match="has no saved result"):
        resolve_reference(Reference.model_validate({"from": "other", "key": "x"}), tmp_path, "x.y")
    ref = Reference.model_validate({"from": "train", "key": "top[0].index[-1]", "offset": 2})
    assert resolve_reference(ref, tmp_path) == 10
    summary = json.loads((step / "summary.json").read_text())
    assert lookup_path(summary, "d['a b']") == 1
    with pytest.raises(IndexError):
        lookup_path(summary, "top[3]")
    with pytest.raises(ConfigError, match="not an integer"):
        resolve_reference(Reference.model_validate({"from": "train", "key": "d", "offset": 1}), tmp_path, "x")


def test_shipped_pipeline_config_validates():
    from tracekit.config import load_config

    cfg, _ = load_config(ROOT / "experiments" / "paris_pipeline.yaml")
    pending = [s.step_name for s in cfg.experiments if isinstance(s, PendingStep)]
    assert pending == ["neurons", "heads", "patching"]
