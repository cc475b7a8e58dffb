"""Low precision: metrics computed in float32 from bfloat16 logits, and the ``precision`` summary
key of a bfloat16 run (docs/precision.md; the real-model comparison is benchmarks/bench_precision.py)."""

from __future__ import annotations

import json
from typing import Literal

import pytest
import torch

import tracekit.metrics as M
from tests.helpers import KIND_EXAMPLES, tiny_overrides
from tracekit.core.kinds import BUILTIN_KINDS
from tracekit.experiments.base import PRECISION, REGISTRY, precision_note


def _load(dtype: Literal["float32", "float16", "bfloat16"]):
    from tests.helpers import GPT2_BPE
    from tracekit.model.load import load_model
    from tracekit.model.spec import ModelSpec

    return load_model(ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE,
                                config_overrides=tiny_overrides("gpt2"), dtype=dtype, device="cpu", seed=0))


@pytest.fixture(scope="module")
def bf16_model():
    return _load("bfloat16")


@pytest.fixture(scope="module")
def bf16_logits(bf16_model):
    ids = torch.tensor([[464, 3139, 286, 4881, 318], [15496, 995, 318, 257, 1332]])
    with torch.no_grad():
        lg = bf16_model(ids)[:, -1]
    assert lg.dtype == torch.bfloat16
    return lg


def test_metrics_are_float32_computations_of_the_bfloat16_logits(bf16_logits):
    """Each metric of bfloat16 logits equals the same formula in float64 on those logits (upcast
    first): logit_diff exactly (two bfloat16 values differ exactly in float32), the log-softmax
    metrics and KL to 1e-5 nats (float32 log-sum-exp over the vocabulary vs float64)."""
    lg = bf16_logits
    target, foil = torch.tensor([[6342], [995]]), torch.tensor([[10598], [318]])
    ref = lg.double()
    ld = M.logit_diff(lg, target, foil)
    assert ld.dtype == torch.float32
    want = (ref.gather(-1, target) - ref.gather(-1, foil)).mean(-1)
    torch.testing.assert_close(ld.double(), want, atol=0, rtol=0)
    lp = torch.log_softmax(ref, -1)
    torch.testing.assert_close(M.target_log_prob(lg, target).double(), lp.gather(-1, target).mean(-1),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(M.target_prob(lg, target).double(), lp.gather(-1, target).exp().mean(-1),
                               atol=1e-6, rtol=0)
    # KL with the clean log-probabilities in bfloat16 too: both upcast before subtracting
    clean = torch.log_softmax(lg.float().flip(0), -1).bfloat16()
    kl = M.kl_div(lg, clean)
    assert kl.dtype == torch.float32
    cd = clean.double()
    torch.testing.assert_close(kl.double(), (cd.exp() * (cd - lp)).sum(-1), atol=1e-5, rtol=0)
    out = M.compute_metrics(["logit_diff", "prob", "log_prob", "kl"], lg,
                            M.MetricInputs(target, foil, clean))
    assert out.dtype == torch.float32 and out.shape == (2, 4)


def test_logit_diff_is_not_quantised_by_bfloat16(bf16_logits):
    """The float32 metric keeps what bfloat16 arithmetic would round away: averaged over 50
    target/foil pairs, the bfloat16 computation differs from it, the float32 one equals float64."""
    lg = bf16_logits
    ids = torch.arange(200).reshape(2, 100)
    ld = M.logit_diff(lg, ids[:, :50], ids[:, 50:])
    in_bf16 = (lg.gather(-1, ids[:, :50]) - lg.gather(-1, ids[:, 50:])).mean(-1)  # bfloat16 arithmetic
    assert in_bf16.dtype == torch.bfloat16
    assert not torch.equal(ld, in_bf16.float())
    ref = lg.double()
    torch.testing.assert_close(ld.double(), (ref.gather(-1, ids[:, :50]) - ref.gather(-1, ids[:, 50:])).mean(-1),
                               atol=1e-6, rtol=0)


def test_every_kind_states_its_tolerance():
    assert set(PRECISION) == set(BUILTIN_KINDS)
    for kind, tol in PRECISION.items():
        assert tol.sensitive, kind
        assert 0 <= tol.rel < 1 and 0 <= tol.min_overlap <= 1, kind
        assert bool(tol.columns) == (tol.rel > 0), kind


def test_precision_note_only_below_float32():
    assert precision_note("logit_lens", torch.float32) is None
    assert precision_note("logit_lens", torch.float64) is None
    note = precision_note("edge_attribution", torch.float16)
    assert note is not None and note["dtype"] == "float16" and "compare with a float32 run" in note["sensitive"]
    assert note["tolerance"]["columns"] == ["score"]
    dla = precision_note("direct_logit_attribution", torch.bfloat16)
    assert dla is not None and "computed in float32" in dla["sensitive"]
    assert "compare with a float32 run" not in dla["sensitive"]
    other = precision_note("a_kind_from_elsewhere", torch.bfloat16)
    assert other is not None and other["tolerance"] is None


@pytest.mark.parametrize("kind", ["direct_logit_attribution", "activation_patching", "attribution_patching"])
def test_low_precision_run_states_its_precision(bf16_model, kind, tmp_path):
    """A bfloat16 run's summary (in memory and in summary.json) has the ``precision`` key; its
    table has the columns and keys the tolerance names. Existing keys are unchanged."""
    exp = REGISTRY[kind].model_validate({"kind": kind, **KIND_EXAMPLES[kind]})
    res = exp.run(bf16_model, progress=False)
    s = res.summary()
    assert s["precision"]["dtype"] == "bfloat16"
    assert s["precision"]["tolerance"] == PRECISION[kind].as_dict()
    assert res.meta["precision"] == s["precision"]
    tol = PRECISION[kind]
    df = res.tables[tol.table]
    assert set(tol.columns) | set(tol.keys) <= set(df.columns)
    res.save(tmp_path / kind, figures=False)
    assert json.loads((tmp_path / kind / "summary.json").read_text())["precision"]["dtype"] == "bfloat16"


def test_float32_run_has_no_precision_key(tiny_gpt2):
    kind = "direct_logit_attribution"
    res = REGISTRY[kind].model_validate({"kind": kind, **KIND_EXAMPLES[kind]}).run(tiny_gpt2, progress=False)
    assert "precision" not in res.summary() and "precision" not in res.meta
