"""Config parsing, overrides, CLI and model-loading errors (no real model needed)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

import tracekit as tk
from tracekit.cli import main
from tracekit.compat import sae_lens_status
from tracekit.config import ConfigError, apply_override, load_config, parse_config
from tracekit.errors import ModelLoadError
from tracekit.model.load import load_model
from tracekit.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_shipped_configs_validate():
    for p in sorted((ROOT / "experiments").glob("*.yaml")):
        if "sweep" in yaml.safe_load(p.read_text()):  # a sweep: every point validates (tracekit.sweep)
            assert tk.sweep.expand_sweep(p)[0], p
            continue
        if sae_lens_status(import_check=False) is not None and re.search(r"[{\s,]release:", p.read_text()):
            # without SAELens (the TransformerLens 4 env) only a SAELens pretrained release is refused, naming
            # why and the fix (SAE paths and training run there: tracekit reads and trains them itself)
            with pytest.raises(ConfigError, match="SAELens issue #738"):
                load_config(p)
            continue
        cfg, _ = load_config(p)
        assert cfg.experiments, p


def test_unknown_key_names_yaml_path(tmp_path):
    p = write(tmp_path, """
        model: {name: gpt2}
        experiments:
          - kind: logit_lens
            prompts: ["a"]
            targte: " Paris"
    """)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "experiments[0].targte: unknown key" in str(e.value)


def test_wrong_type_and_bad_value_name_paths(tmp_path):
    p = write(tmp_path, """
        model: {name: gpt2, dtype: float64, device: tpu}
        experiments:
          - kind: logit_lens
            prompts: ["a"]
            top_k: many
            position: middle
    """)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    for path in ("model.dtype", "model.device", "experiments[0].top_k", "experiments[0].position"):
        assert path in msg, (path, msg)
    p = write(tmp_path, """
        experiments:
          - {kind: logit_lens, prompts: ["a"], positions: all}
    """)
    with pytest.raises(ConfigError, match=r"experiments\[0\].*'positions' was renamed to 'position'"):
        load_config(p)


def test_missing_required_and_unknown_kind(tmp_path):
    with pytest.raises(ConfigError, match=r"experiments\[0\]: give prompts .*or a dataset"):
        parse_config({"experiments": [{"kind": "logit_lens"}]})
    with pytest.raises(ConfigError, match=r"experiments\[0\].kind: unknown experiment kind 'lens'"):
        parse_config({"experiments": [{"kind": "lens"}]})
    with pytest.raises(ConfigError, match="experiments: required"):
        parse_config({"model": {"name": "gpt2"}})
    with pytest.raises(ConfigError, match="unique"):
        parse_config({"experiments": [{"kind": "logit_lens", "prompts": ["a"]}] * 2})


def test_bad_yaml_and_missing_file(tmp_path):
    p = write(tmp_path, "model: {name: gpt2\nexperiments: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_set_overrides():
    raw = {"model": {"name": "gpt2"}, "experiments": [{"kind": "logit_lens", "prompts": ["a"]}]}
    apply_override(raw, "model.device=cpu")
    apply_override(raw, 'experiments[0].target=" Rome"')
    apply_override(raw, "experiments.0.top_k=3")
    apply_override(raw, "model.config_overrides={n_layer: 2}")
    assert apply_override({"a": 1}, "a= Paris")["a"] == " Paris"  # unquoted: leading space kept
    assert apply_override({"a": 1}, "a=' Paris'")["a"] == " Paris"
    assert apply_override({"a": 1}, "a=3")["a"] == 3
    cfg = parse_config(raw)
    assert cfg.model.device == "cpu" and cfg.model.config_overrides == {"n_layer": 2}
    step: Any = cfg.experiments[0]  # a LogitLens
    assert step.target == " Rome" and step.top_k == 3
    with pytest.raises(ConfigError, match="index"):
        apply_override(raw, "experiments[3].top_k=1")
    with pytest.raises(ConfigError, match="path=value"):
        apply_override(raw, "model.device")


def test_cli_validate(capsys, gpt2_tokenizer_dir):
    cfg = str(ROOT / "experiments/paris_logit_lens.yaml")
    assert main(["validate", cfg, "--schema-only"]) == 0
    assert "valid (schema)" in capsys.readouterr().out
    assert main(["validate", cfg, "--schema-only", "--set", "experiments[0].top_k=0"]) == 2
    assert "experiments[0].top_k" in capsys.readouterr().err
    # without the weights, the full check still reads the tokenizer and config (random_init here)
    rnd = ["--set", "model.random_init=true", "--set", f"model.tokenizer={gpt2_tokenizer_dir}",
           "--set", "model.config_overrides={n_layer: 2, n_embd: 64, n_head: 4}", "--set", "model.device=cpu"]
    assert main(["validate", cfg, *rnd]) == 0
    assert "tokenizer" in capsys.readouterr().out
    assert main(["validate", cfg, *rnd, "--set", "experiments[0].target=' Parisian'"]) == 2
    assert "exactly one token" in capsys.readouterr().err
    # GPT-2's weights are not cached here: the full check says so at once
    assert main(["validate", cfg]) == 2
    assert "not in the local Hugging Face cache" in capsys.readouterr().err


def test_validate_lists_every_invalid_step_input(tmp_path, capsys, gpt2_tokenizer_dir):
    """The tokenizer checks of three steps fail: one `validate` lists all three, each naming its step."""
    p = write(tmp_path, f"""
        model: {{name: gpt2, random_init: true, tokenizer: {gpt2_tokenizer_dir}, device: cpu,
                config_overrides: {{n_layer: 1, n_embd: 32, n_head: 2}}}}
        experiments:
          - {{kind: logit_lens, name: a, prompts: ["The capital of France is"], target: " Parisian"}}
          - {{kind: logit_lens, name: b, prompts: ["The capital of France is"], target: " Paris"}}
          - {{kind: direct_logit_attribution, name: c, prompts: ["The capital of France is"], target: " Romeward"}}
          - {{kind: logit_lens, name: d, prompts: ["The capital of France is"], target: " Paris", foil: " Lyonnais"}}
    """)
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert "3 steps have invalid inputs" in err
    for name in ("a", "c", "d"):
        assert f"({name})" in err
    assert "(b)" not in err and err.count("exactly one token") >= 3


def test_missing_model_fails_fast_with_advice(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        load_model("some-org/definitely-not-cached-model")
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_model("./no/such/dir")
    with pytest.raises(ModelLoadError, match="no such GGUF"):
        load_model("/tmp/none.gguf")


def test_cuda_request_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_model(ModelSpec(name="gpt2", device="cuda"))


def test_cli_run_gpt2_config_on_random_weights(tmp_path, gpt2_tokenizer_dir, capsys):
    """The shipped GPT-2 config runs end to end (random weights, GPT-2's real tokenizer): the run
    directory holds every promised file and the expectations are reported (not met here)."""
    code = main(["run", str(ROOT / "experiments/paris_logit_lens.yaml"), "--out", str(tmp_path), "--no-progress",
                 "--set", "model.random_init=true", "--set", f"model.tokenizer={gpt2_tokenizer_dir}",
                 "--set", "model.config_overrides={n_layer: 2, n_embd: 64, n_head: 4}", "--set", "model.device=cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    run_dir = next(tmp_path.iterdir())
    for f in ("config.resolved.yaml", "summary.json", "environment.json", "expectations.json",
              "paris/main.parquet", "paris/topk.parquet", "paris/target_by_layer.png", "paris/top1_grid.png"):
        assert (run_dir / f).exists(), f
    s = json.loads((run_dir / "summary.json").read_text())
    for k in ("target_prob_final", "target_prob_by_hidden_state", "target_rank_by_hidden_state", "emergence_layer"):
        assert k in s
    assert len(s["target_prob_by_hidden_state"]) == 3
    assert s["expectations_total"] == 5
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["versions"]["torch"] and env["seed"] == 0 and env["dtype"] == "float32"
    toks = __import__("pandas").read_parquet(run_dir / "paris/tokens.parquet")
    assert toks["token_id"].tolist()[:3] == [464, 3139, 286]  # no BOS: starts with the article's 464 ("The")
    assert toks["token_id"].tolist()[-5:] == [383, 3139, 286, 4881, 318]  # " The capital of France is"
    assert "NOT MET" in out
    # `tracekit show`: the step's headline numbers, read from its saved summary (4 significant digits)
    assert main(["show", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    step = json.loads((run_dir / "paris" / "summary.json").read_text())
    assert "paris" in shown and "logit_lens" in shown and "expectations met: 0/5" in shown
    # the step's expectation metrics come first (then floats, other scalars, lists)
    assert re.search(rf"paris\s+logit_lens\s+done\s+target_prob_final\s+{step['target_prob_final']:.4g}\n", shown)
    assert re.search(rf"\s+final_top1\s+{step['final_top1']}\n", shown)
    assert main(["show", str(run_dir), "--max", "0"]) == 0  # every key
    every = capsys.readouterr().out
    assert all(k in every for k in step if k != "expectations")
    assert main(["run", str(ROOT / "experiments/paris_logit_lens.yaml"), "--out", str(tmp_path), "--no-progress",
                 "--strict", "--set", "model.random_init=true", "--set", f"model.tokenizer={gpt2_tokenizer_dir}",
                 "--set", "model.config_overrides={n_layer: 2, n_embd: 64, n_head: 4}", "--set", "model.device=cpu"]) == 1


def test_cli_bad_target_stops_before_model_work(tmp_path, gpt2_tokenizer_dir, capsys):
    code = main(["run", str(ROOT / "experiments/paris_logit_lens.yaml"), "--out", str(tmp_path), "--no-progress",
                 "--set", "model.random_init=true", "--set", f"model.tokenizer={gpt2_tokenizer_dir}",
                 "--set", "model.config_overrides={n_layer: 1, n_embd: 32, n_head: 2}",
                 "--set", "experiments[0].target=' Parisian'"])
    err = capsys.readouterr().err
    assert code == 2 and "exactly one token" in err and "target" in err
    assert not any(tmp_path.iterdir())  # checked from the tokenizer before any run directory exists


def test_missing_model_via_cli(tmp_path, capsys):
    code = main(["run", str(ROOT / "experiments/paris_logit_lens.yaml"), "--out", str(tmp_path), "--no-progress",
                 "--set", "model.name=some-org/not-cached"])
    assert code == 2
    assert "not in the local Hugging Face cache" in capsys.readouterr().err


def test_step_name_cannot_escape_the_run_directory():
    with pytest.raises(ConfigError, match=r"experiments\[0\].name"):
        parse_config({"experiments": [{"kind": "logit_lens", "name": "../../evil", "prompts": ["a"]}]})


def test_patching_target_equal_to_foil_is_a_config_error():
    step = {"kind": "activation_patching", "pairs": [{"clean": "a b", "corrupted": "a c", "target": " x", "foil": " x"}]}
    with pytest.raises(ConfigError, match="target and foil must differ"):
        parse_config({"experiments": [step]})


def test_config_override_typo_is_an_error(gpt2_tokenizer_dir):
    with pytest.raises(ModelLoadError, match="n_layers"):
        load_model(ModelSpec(name="gpt2", random_init=True, tokenizer=gpt2_tokenizer_dir,
                             config_overrides={"n_layers": 2}))


def test_unknown_expectation_metric_lists_available_keys():
    from tracekit.experiments.base import Expectation

    row = Expectation(metric="target_prob_finall", value=1).check({"target_prob_final": 0.5})
    assert row["met"] is False and "target_prob_final" in row["error"]


def test_device_and_tokenizer_errors_before_loading(gpt2_tokenizer_dir):
    import torch

    if torch.cuda.device_count() < 2:
        with pytest.raises(ModelLoadError, match="n_devices"):
            load_model(ModelSpec(name="gpt2", n_devices=2))
    with pytest.raises(ModelLoadError, match="model.tokenizer: no such tokenizer directory"):
        load_model(ModelSpec(name="gpt2", random_init=True, tokenizer="/no/such/tok"))


def test_bad_pairs_jsonl_names_file_and_line(tmp_path):
    from tracekit.experiments.patching import load_pairs

    p = tmp_path / "pairs.jsonl"
    p.write_text('{"clean": "a", "corrupted": "b", "target": " x", "foil": " y"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"pairs\.jsonl line 2 is not valid JSON"):
        load_pairs(p)


def test_result_load_on_a_non_result_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete saved tracekit result"):
        tk.Result.load(tmp_path)
