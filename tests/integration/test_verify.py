"""``tracekit verify``: passes on a healthy model, reports the failing check and exits non-zero on a
deliberately broken one; the load-time subset refuses a broken model and is recorded per run."""

from __future__ import annotations

import json

import pytest
import torch
from conformance import harness  # noqa: I001

from tracekit.cli import main
from tracekit.model.load import clear_cache, load_model
from tracekit.model.spec import ModelSpec


@pytest.fixture()
def llama_dir():
    clear_cache()
    yield harness.build("LlamaForCausalLM")
    clear_cache()


def test_verify_passes_on_a_healthy_model(llama_dir, tmp_path, capsys):
    rc = main(["verify", llama_dir, "--tokenizer", "gpt2-bpe", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rep = json.loads((tmp_path / "verify.json").read_text())
    assert rep["passed"] and rep["architecture"] == "LlamaForCausalLM"
    statuses = {c["name"]: c["status"] for c in rep["checks"]}
    assert set(statuses.values()) == {"pass"}, statuses
    assert len(statuses) == 11
    for c in rep["checks"]:
        assert c["value"] <= c["tolerance"]
    assert "PASSED" in out and "transformer-lens" in out and "lens_hidden_states" in out


def test_verify_reports_a_broken_readout_and_exits_nonzero(llama_dir, tmp_path, capsys, monkeypatch):
    from tracekit.model.readout import Readout

    real = Readout.apply_transform
    monkeypatch.setattr(Readout, "apply_transform", lambda self, x: real(self, x) * 1.5)  # a wrong readout
    rc = main(["verify", llama_dir, "--tokenizer", "gpt2-bpe", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    rep = json.loads((tmp_path / "verify.json").read_text())
    failed = {c["name"] for c in rep["checks"] if c["status"] == "fail"}
    assert {"lens_final", "lens_hidden_states", "patch_full_residual"} <= failed
    assert "FAILED" in out and "lens_final" in out


def test_a_model_that_fails_the_load_check_is_refused_naming_its_architecture(llama_dir, monkeypatch):
    from tracekit.errors import ModelLoadError
    from tracekit.model.readout import Readout

    real = Readout.apply_transform
    monkeypatch.setattr(Readout, "apply_transform", lambda self, x: real(self, x) + torch.arange(x.shape[-1]) * 1e-2)
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM: the readout"):
        load_model(ModelSpec(name=llama_dir, tokenizer=harness.GPT2_BPE, device="cpu"))
    # verify: false loads it (and says it was not verified)
    m = load_model(ModelSpec(name=llama_dir, tokenizer=harness.GPT2_BPE, device="cpu", verify=False))
    from tracekit.model.state import state_of

    assert state_of(m).verification is None


def test_every_run_records_the_verification(llama_dir, tmp_path):
    from tracekit.config import parse_config
    from tracekit.runner import run_config

    cfg = parse_config({"model": {"name": llama_dir, "tokenizer": "gpt2-bpe", "device": "cpu"},
                        "experiments": [{"kind": "logit_lens", "prompts": ["The capital of France is"]}]})
    run_dir, _ = run_config(cfg, tmp_path, progress=False)
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["architecture"] == "LlamaForCausalLM"
    v = env["verification"]
    assert v["passed"] is True and v["level"] == "load"
    assert {c["name"] for c in v["checks"]} == {"forward", "lens_final"}
