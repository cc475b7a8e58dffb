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


# --- half precision (issue #33 items 10, 16) -----------------------------------------------------------
#: Per dtype, a weight scale (initializer_range) of a 3-block random GPT-2 at which the dtype's own
#: rounding moves log-probabilities past the dtype's fixed table tolerance (5e-2 / 0.25 nats): two
#: correct half-precision runs (transformers, the bridge with processed weights) then differ by
#: 2.2 / 0.47 nats; each is as far from the float32 run of the same weights as the other.
HALF_SCALES = {"float16": 1.0, "bfloat16": 0.3}


def _half_spec(dtype: str, **kw) -> ModelSpec:
    from typing import Any, cast

    from helpers import tiny_overrides

    return ModelSpec(name="gpt2", random_init=True, tokenizer=harness.GPT2_BPE, device="cpu", dtype=cast(Any, dtype),
                     config_overrides={**tiny_overrides("gpt2"), "initializer_range": HALF_SCALES[dtype]}, **kw)


@pytest.fixture()
def fresh():
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_correct_half_precision_model_loads(dtype, fresh):
    """The load-time check compares the bridge in float16 / bfloat16 with transformers on the same
    weights in float32, within a multiple of transformers' own half-precision error: a correct model
    whose two half-precision runs differ by more than the dtype's fixed tolerance loads (it was
    refused: 'max |difference| 2.18 > 0.05')."""
    m = load_model(_half_spec(dtype))  # refused before: max |difference| 2.18 > 0.05 / 0.471 > 0.25
    from tracekit.model.checks import HALF_FACTOR
    from tracekit.model.state import state_of

    assert next(m.parameters()).dtype == getattr(torch, dtype)
    v = state_of(m).verification
    assert v is not None and v["passed"] is True
    checks = {c["name"]: c for c in v["checks"]}
    assert set(checks) == {"forward", "forward_mean", "lens_final"}
    for name in ("forward", "forward_mean"):
        c = checks[name]
        assert c["status"] == "pass" and c["value"] <= c["tolerance"]
        assert "float32" in c["detail"] and f"transformers' own {dtype} error" in c["detail"]
    # the rule is a multiple of the reference's own error, which is itself well above the table's 5e-2 / 0.25
    own = (checks["forward"]["tolerance"] - 1e-3) / HALF_FACTOR["max"]
    assert own > {"float16": 5e-2, "bfloat16": 0.25}[dtype]


def _break_one_block(monkeypatch, scale: float = 1.1):
    """A wiring error after the bridge is built: block 1's MLP output weight scaled by ``scale``
    (the reference logits are computed before the bridge exists, so only the bridge is wrong)."""
    from transformer_lens.model_bridge import TransformerBridge

    real = TransformerBridge.enable_compatibility_mode

    def broken(self, *a, **k):
        out = real(self, *a, **k)
        p = next(p for p in self.blocks[1].mlp.out.parameters() if p.ndim == 2)
        with torch.no_grad():
            p.mul_(scale)
        return out
    monkeypatch.setattr(TransformerBridge, "enable_compatibility_mode", broken)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_wiring_error_in_half_precision_is_still_refused_naming_the_dtype(dtype, fresh, monkeypatch):
    """A 10% error in one block's MLP output is refused in half precision as in float32; the
    refusal names the dtype (half precision as the likely cause, float32 as the way to tell)."""
    from tracekit.errors import ModelLoadError

    _break_one_block(monkeypatch)
    with pytest.raises(ModelLoadError, match="different log-probabilities from transformers") as e32:
        load_model(_half_spec(dtype).model_copy(update={"dtype": "float32"}))
    assert "float16" not in str(e32.value) and "bfloat16" not in str(e32.value)
    clear_cache()
    with pytest.raises(ModelLoadError, match=rf"in {dtype} \(model\.dtype\).*float32 run of the same weights") as e:
        load_model(_half_spec(dtype))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg or "gpt2" in msg.lower()
    assert "half precision is the likely cause" in msg and "model.dtype: float32" in msg


def test_verify_model_forward_in_half_precision_uses_the_float32_rule(fresh):
    """`tracekit verify --dtype bfloat16`: its forward check is the load-time rule (float32 reference
    of the same weights), so a correct bfloat16 model passes it (0.47 > 0.25 failed it before)."""
    from tracekit.model import load as L
    from tracekit.verify import HFReference, bridge_layers_path, verify_model

    spec = _half_spec("bfloat16")
    m = load_model(spec)
    hf = L._hf_from_weights(L._WEIGHTS[spec.weights_key()], torch.bfloat16).eval()
    path = bridge_layers_path(m)
    assert path is not None
    rep = verify_model(m, HFReference(hf, path))
    checks = {c.name: c for c in rep.checks}
    for name in ("forward", "forward_mean"):
        assert checks[name].status == "pass", checks[name]
        assert "float32" in checks[name].detail


def test_edge_methods_head_write_identity_uses_the_dtype_tolerance(fresh):
    """EAP / circuits check that head writes add up to the attention output; in bfloat16 the model's
    own attention output is rounded (relative error 2.8e-3 to 3.8e-3 on this model), which the float32
    tolerance 1e-3 refused as 'heads are not separable'. A real mismatch is still refused, naming
    the dtype."""
    from tracekit.circuits.graph import check_head_writes
    from tracekit.errors import MethodRefused

    m = load_model(_half_spec("bfloat16"))
    a, b = torch.tensor([[464, 3139, 286, 4881, 318]]), torch.tensor([[464, 3139, 286, 8031, 318]])

    def names(n):
        return n.endswith("hook_z") or n.endswith("hook_attn_out")
    _, ca = m.run_with_cache(a, names_filter=names)
    _, cb = m.run_with_cache(b, names_filter=names)
    for L in range(int(m.cfg.n_layers)):
        dz = ca[f"blocks.{L}.attn.hook_z"].float() - cb[f"blocks.{L}.attn.hook_z"].float()
        dout = ca[f"blocks.{L}.hook_attn_out"].float() - cb[f"blocks.{L}.hook_attn_out"].float()
        check_head_writes(m, L, dz, dout, "eap")  # refused before: max difference 0.021 > 1e-3 x 7.6
        with pytest.raises(MethodRefused, match="tolerance of bfloat16"):
            check_head_writes(m, L, dz, dout * 1.5, "eap")
