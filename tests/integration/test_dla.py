"""Direct logit attribution (tracekit.dla) and the direct_logit_attribution kind.

Invariants run on ``perturbed_model`` (tiny GPT-2 / Llama (GQA) / tied-embedding Llama with norm
weights and biases perturbed away from 1 / 0, weight processing on and off), so the final-norm
weight/bias and the b_O / b_out terms really matter. Tolerance: float32 sums over <= a few
thousand O(1) terms round at ~1e-6, so 1e-4 absolute leaves a wide margin while catching a
missing term (the bias terms are > 1e-3, checked).
"""

from __future__ import annotations

import pytest
import torch

from tracekit.compat import tl_major
from tracekit.dla import AttributionError, logit_attribution
from tracekit.model.readout import Readout
from tracekit.tokens import TokenizationError

ATOL = 1e-4
PROMPTS = ["The capital of France is", "Hello, my name is John and I live in"]


@pytest.mark.parametrize("foil", [" London", None])
def test_parts_and_biases_sum_to_logit(perturbed_model, foil):
    das = logit_attribution(perturbed_model, PROMPTS, " Paris", foil, neuron_layers="all")
    assert len(das) == 2
    for d in das:
        assert abs(d.logit) > 1e-2  # the test is not vacuous
        assert d.total() == pytest.approx(d.logit, abs=ATOL)
        assert d.components_frame()["contribution"].sum() == pytest.approx(d.logit, abs=ATOL)
        # heads + b_O = attention layer; neurons + b_out = MLP layer
        torch.testing.assert_close(d.heads.sum(1) + d.attn_bias, d.attn, atol=ATOL, rtol=0)
        for L, c in d.neuron_contrib.items():
            assert float(c.sum() + d.mlp_bias[L]) == pytest.approx(float(d.mlp[L]), abs=ATOL)
            torch.testing.assert_close(c, d.neuron_act[L] * d.neuron_value[L], atol=1e-6, rtol=0)


def test_bias_terms_are_exercised():
    from helpers import make_perturbed

    d = logit_attribution(make_perturbed("gpt2", process_weights=False), PROMPTS[0], " Paris", " London")[0]
    assert d.attn_bias.abs().max() > 1e-3 and d.mlp_bias.abs().max() > 1e-3 and abs(d.final_bias) > 1e-3
    assert d.pos_embed is not None


@pytest.mark.parametrize("arch,tied", [("gpt2", False), ("llama", False), ("llama", True)])
def test_attribution_does_not_depend_on_weight_processing(arch, tied):
    from helpers import make_perturbed

    a = logit_attribution(make_perturbed(arch, True, tied), PROMPTS, " Paris", " London")
    b = logit_attribution(make_perturbed(arch, False, tied), PROMPTS, " Paris", " London")
    for x, y in zip(a, b):
        assert x.logit == pytest.approx(y.logit, abs=ATOL)
        torch.testing.assert_close(x.attn, y.attn, atol=ATOL, rtol=0)
        torch.testing.assert_close(x.mlp, y.mlp, atol=ATOL, rtol=0)
        if arch == "llama":  # no value biases; GPT-2's b_V is folded into b_O by processing
            torch.testing.assert_close(x.heads, y.heads, atol=ATOL, rtol=0)


def test_scale_is_the_runs_final_norm_scale(perturbed_model):
    from tracekit.tokens import run_with_cache, tokenize

    d = logit_attribution(perturbed_model, PROMPTS[0], " Paris")[0]
    batch = tokenize(perturbed_model, PROMPTS[0])
    _, cache = run_with_cache(perturbed_model, batch, ["ln_final.hook_in"])
    want = float(Readout(perturbed_model).scale(cache["ln_final.hook_in"][0, -1]))
    assert d.final_scale == pytest.approx(want, rel=1e-5)


def test_positions_int_last_and_token(perturbed_model):
    prompt = "The capital of France is a city"
    last = logit_attribution(perturbed_model, prompt, " Paris", " London", position="last")[0]
    minus1 = logit_attribution(perturbed_model, prompt, " Paris", " London", position=-1)[0]
    assert last.position == minus1.position == len(last.tokens) - 1 and last.logit == minus1.logit
    tok = logit_attribution(perturbed_model, prompt, " Paris", " London", position="token: is")[0]
    assert tok.tokens[tok.position] == " is" and tok.position < last.position
    idx = logit_attribution(perturbed_model, prompt, " Paris", " London", position=tok.position)[0]
    assert idx.logit == pytest.approx(tok.logit, abs=1e-6)
    assert tok.total() == pytest.approx(tok.logit, abs=ATOL)


def test_batched_equals_one_by_one(tiny_model):
    a = logit_attribution(tiny_model, PROMPTS, " Paris", " London", batch_size=2)
    b = logit_attribution(tiny_model, PROMPTS, " Paris", " London", batch_size=1)
    for x, y in zip(a, b):
        assert x.position == y.position and x.logit == pytest.approx(y.logit, abs=1e-5)
        torch.testing.assert_close(x.heads, y.heads, atol=1e-5, rtol=0)


@pytest.mark.parametrize("unit", ["component", "head"])
def test_parity_with_transformer_lens(perturbed_model, unit):
    """TransformerLens' direct_logit_attribution (decompose_resid / stack_head_results + logit_attrs)
    gives the same parts on processed models; without weight processing its direction misses the
    final norm's weight (TransformerLens 3.9 answers wrongly, 4.x refuses), so tracekit keeps its own
    implementation (Readout.direction)."""
    from transformer_lens.tools.analysis.direct_logit_attribution import direct_logit_attribution as tl_dla

    from tracekit.tokens import single_token_id, tokenize

    m = perturbed_model
    t, f = single_token_id(m, " Paris"), single_token_id(m, " London")
    d = logit_attribution(m, PROMPTS[0], " Paris", " London")[0]
    batch = tokenize(m, PROMPTS[0])
    _, cache = m.run_with_cache(batch.tokens)
    if not m.tracekit_spec.process_weights and tl_major() >= 4:
        with pytest.raises(ValueError, match="identity final norm weight"):  # TransformerLens 4 refuses instead
            tl_dla(m, cache=cache, answer_tokens=torch.tensor([t]), incorrect_tokens=torch.tensor([f]), unit=unit)
        return
    tl = tl_dla(m, cache=cache, answer_tokens=torch.tensor([t]), incorrect_tokens=torch.tensor([f]), unit=unit)
    vals = dict(zip(tl.labels, tl.attribution.reshape(len(tl.labels)).tolist()))
    if unit == "component":
        ours = {"embed": d.embed, **({"pos_embed": d.pos_embed} if d.pos_embed is not None else {})}
        for L in range(len(d.attn)):
            ours[f"{L}_attn_out"], ours[f"{L}_mlp_out"] = float(d.attn[L]), float(d.mlp[L])
    else:
        ours = {f"L{L}H{h}": float(d.heads[L, h]) for L in range(d.heads.shape[0]) for h in range(d.heads.shape[1])}
        vals = {k: v for k, v in vals.items() if k in ours}
    assert set(vals) == set(ours)
    diff = max(abs(vals[k] - ours[k]) for k in ours)
    if m.tracekit_spec.process_weights:
        assert diff < ATOL
    else:
        assert diff > 1e-3  # TransformerLens assumes the norm weight folded into W_U


def test_check_works_on_model_info(tiny_gpt2):
    import tracekit as tk
    from tracekit.model.info import ModelInfo

    m = tiny_gpt2
    info = ModelInfo(m.tracekit_spec, m.tokenizer, m.cfg, list(m.hook_dict), m._gated_hook_reason)
    tk.DirectLogitAttribution(prompts=PROMPTS, target=" Paris", foil=" London", position="token: is").check(info)
    with pytest.raises(TokenizationError, match="position"):
        tk.DirectLogitAttribution(prompts=PROMPTS, target=" Paris", position="token: Rome").check(info)
    with pytest.raises(TokenizationError, match="position: 40 is out of range"):
        tk.DirectLogitAttribution(prompts=PROMPTS, target=" Paris", position=40).check(info)
    with pytest.raises(TokenizationError, match="target"):
        tk.DirectLogitAttribution(prompts=PROMPTS, target=" Parisian-ish").check(info)


def test_bad_inputs_name_the_field(tiny_gpt2):
    import tracekit as tk

    m = tiny_gpt2
    with pytest.raises(TokenizationError, match="target"):
        logit_attribution(m, "The capital of France is", " Parisian-ish")
    with pytest.raises(TokenizationError, match="foil"):
        logit_attribution(m, "The capital of France is", " Paris", foil=" Sacramento-ville")
    with pytest.raises(AttributionError, match="foil"):
        logit_attribution(m, "x", " Paris", foil=" Paris")
    with pytest.raises(AttributionError, match=r"neuron_layers\[0\]: layer 5"):
        logit_attribution(m, "x", " Paris", neuron_layers=[5])
    with pytest.raises(TokenizationError, match="position"):
        logit_attribution(m, "The capital", " Paris", position=10)
    with pytest.raises(TokenizationError, match="token: is"):
        logit_attribution(m, "The capital is", " Paris", position=" is")
    with pytest.raises(TokenizationError, match="not accepted"):
        logit_attribution(m, "The capital is", " Paris", position="all")
    with pytest.raises(ValueError, match="token: is"):
        tk.DirectLogitAttribution(prompts="a is", target=" Paris", position=" is")


def test_experiment_roundtrip(tiny_llama, tmp_path):
    import tracekit as tk

    dla = tk.DirectLogitAttribution(prompts=PROMPTS, target=" Paris", foil=" London").run(tiny_llama)
    ds = dla.summary()
    rows = dla.tables["rows"]
    assert ds["max_sum_error"] < ATOL
    assert rows["sum_of_parts"].tolist() == pytest.approx(ds["logit_diff_by_row"], abs=ATOL)
    assert ds["n_rows"] == 2 and "direct logit attribution" in dla.report()
    assert set(dla.figures()) == {"components", "heads"}
    dla.save(tmp_path / "dla")
    assert tk.experiments.Result.load(tmp_path / "dla").summary() == ds


@pytest.mark.slow
def test_embedded_model_additivity(embedded_model):
    d = logit_attribution(embedded_model, "The capital of China is Beijing. The capital of France is", " Paris",
                          " Beijing", neuron_layers=[27, 29])[0]
    assert d.total() == pytest.approx(d.logit, abs=1e-3)  # 30 layers of O(10) logits: float32 margin
    torch.testing.assert_close(d.heads.sum(1) + d.attn_bias, d.attn, atol=1e-3, rtol=0)
    for L in (27, 29):
        assert float(d.neuron_contrib[L].sum() + d.mlp_bias[L]) == pytest.approx(float(d.mlp[L]), abs=1e-3)
