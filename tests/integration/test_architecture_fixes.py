"""The named architecture bugs, each pinned by a test that failed before its fix (tiny perturbed
models from tests/conformance, compared with plain transformers run by the test).

* Gemma 2's final soft-cap was dropped by the readout (lens, patching, DLA totals off by nats);
* post-norm blocks (Gemma 2/3, OLMo 2, GLM-4): heads / neurons did not sum to their layer's write;
* Nemotron's ``(1 + w)`` LayerNorm was read as ``w``;
* MoE: a second load with another spec folded the norm into shared expert weights again;
  neuron attribution crashed and the neuron patching site patched the wrong axis;
* OPT / GPT-J: attention patterns never fired (SDPA);
* Bloom: patching crashed (ALiBi is [batch x heads, 1, pos]);
* layouts the bridge cannot run failed with raw errors that did not name the architecture.
"""

from __future__ import annotations

import pytest
import torch
from conformance import harness  # noqa: I001

from tracekit.compat import tl_major
from tracekit.errors import ModelLoadError, PatchingError
from tracekit.model.architectures import MethodRefused
from tracekit.model.load import clear_cache, load_model
from tracekit.model.spec import ModelSpec

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def tiny(arch: str, variant=None, **kw):
    d = harness.build(arch, variant)
    return d, load_model(ModelSpec(name=d, tokenizer=harness.GPT2_BPE, device="cpu", **kw))


def ids_of(model, prompt=PROMPT):
    from tracekit.tokens import tokenize

    return tokenize(model, [prompt]).tokens


def top2(model, ids):
    lp = torch.log_softmax(model(ids).float(), -1)[0, -1]
    from tracekit.verify import _pick_tokens

    return _pick_tokens(model, lp)


def test_gemma2_soft_cap_is_in_the_readout_lens_and_dla():
    from tracekit.dla import logit_attribution
    from tracekit.fastpath import residual_stream
    from tracekit.model.readout import Readout
    from tracekit.tokens import pad_ids

    d, model = tiny("Gemma2ForCausalLM")
    ref = harness.reference(d, model)
    ids = ids_of(model)
    r = ref.run(ids)
    hf_lp = torch.log_softmax(r["logits"][0], -1)
    n = int(model.cfg.n_layers)
    hooks = ["blocks.0.hook_resid_pre"] + [f"blocks.{L}.hook_resid_post" for L in range(n)]
    resid = residual_stream(model, pad_ids(model, [ids[0].tolist()]), hooks)[:, 0]
    lens = Readout(model).log_probs(resid)
    # the cap bites: without it the last hidden state's lens is off by more than 0.1 nats
    uncapped = torch.log_softmax(Readout(model).pre_transform_logits(resid[-1]).float(), -1)
    assert (uncapped - hf_lp).abs().max() > 0.1
    assert (lens[-1] - hf_lp).abs().max() < 1e-4
    for h in range(n + 1):  # every hidden state's lens == Gemma 2's own head on it
        assert (lens[h] - ref.head_log_probs(ids, r["hidden"][h])[0]).abs().max() < 1e-4
    t, f = top2(model, ids)
    da = logit_attribution(model, PROMPT, t, f)[0]
    from tracekit.tokens import single_token_id

    ti, fi = single_token_id(model, t), single_token_id(model, f)
    assert abs(da.logit - float(r["logits"][0, -1, ti] - r["logits"][0, -1, fi])) < 1e-4  # the model's (capped)
    assert abs(da.attributed - float(r["pre_logits"][0, -1, ti] - r["pre_logits"][0, -1, fi])) < 1e-4  # pre-cap
    assert abs(da.total() - da.attributed) < 1e-4
    assert "soft-cap 5" in da.transform


def test_gemma2_dla_kind_reports_what_is_attributed():
    from tracekit import DirectLogitAttribution

    _, model = tiny("Gemma2ForCausalLM")
    t, f = top2(model, ids_of(model))
    res = DirectLogitAttribution(prompts=[PROMPT], target=t, foil=f).run(model)
    s = res.summary()
    assert s["max_sum_error"] < 1e-4  # |attributed - sum of parts|
    attributed = s["attributed_logit_diff_by_row"][0]
    assert abs(attributed - res.tables["rows"]["sum_of_parts"].iloc[0]) < 1e-4
    assert attributed != pytest.approx(s["logit_diff_by_row"][0], abs=1e-3)  # the cap changes the logit difference
    assert "pre-transform" in res.report() and "soft-cap" in res.report()


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", "Glm4ForCausalLM"])
def test_post_norm_heads_and_neurons_sum_to_their_layer(arch):
    from tracekit.dla import logit_attribution
    from tracekit.neurons import neuron_intervention

    _, model = tiny(arch)
    t, f = top2(model, ids_of(model))
    da = logit_attribution(model, PROMPT, t, f, neuron_layers="all")[0]
    assert (da.heads.sum(-1) + da.attn_bias - da.attn).abs().max() < 1e-4
    for L in da.neuron_contrib:
        assert abs(float(da.neuron_contrib[L].sum() + da.mlp_bias[L] - da.mlp[L])) < 1e-4
    # the direct path through the post-MLP norm at its frozen scale: zero-ablating the two largest
    # neurons with everything downstream frozen moves the logit difference by minus their contributions
    # (an identity of the logits DLA attributes: under Gemma 2's soft-cap those are pre-cap, while an
    # intervention measures the model's capped output, so the identity is checked where they coincide)
    from tracekit.model.readout import output_transform

    if not output_transform(model).linear:
        return
    L = int(model.cfg.n_layers) - 1
    top = da.neuron_contrib[L].abs().topk(2).indices.tolist()
    out = neuron_intervention(model, PROMPT, t, [(L, n) for n in top], mode="zero", foil=f, freeze_downstream=True)
    want = -float(sum(da.neuron_contrib[L][n] for n in top))
    assert abs(out["delta"]["logit_diff"] - want) < 1e-3


def test_nemotron_one_plus_w_norm_is_read_as_applied():
    from tracekit.dla import logit_attribution
    from tracekit.model.readout import Readout

    d, model = tiny("NemotronForCausalLM", process_weights=False)
    ref = harness.reference(d, model)
    w = ref.hf.model.norm.weight.detach().float()
    assert (Readout(model).final_norm.weight - (1 + w)).abs().max() < 1e-5
    ids = ids_of(model)
    t, f = top2(model, ids)
    da = logit_attribution(model, PROMPT, t, f)[0]
    r = ref.run(ids)
    from tracekit.tokens import single_token_id

    ti, fi = single_token_id(model, t), single_token_id(model, f)
    assert abs(da.total() - float(r["logits"][0, -1, ti] - r["logits"][0, -1, fi])) < 1e-4


def test_moe_second_load_changes_neither_model():
    clear_cache()
    d = harness.build("MixtralForCausalLM")
    ref = None
    specs = [dict(process_weights=True), dict(process_weights=False, padding_side="left"),
             dict(process_weights=True, prepend_bos=True)]
    models, before = [], []
    for kw in specs:
        m = load_model(ModelSpec(name=d, tokenizer=harness.GPT2_BPE, device="cpu", **kw))
        ref = ref or harness.reference(d, m)
        models.append(m)
    ids = torch.tensor([[464, 3139, 286, 4881, 318, 6342, 11, 290, 262, 3139]])
    want = torch.log_softmax(ref.run(ids)["logits"], -1)
    for m in models:
        before.append(torch.log_softmax(m(ids).float(), -1))
        assert (before[-1] - want).abs().max() < 1e-4
    clear_cache()


def test_moe_neurons_are_refused_not_misread():
    from tracekit import ActivationPatching, NeuronAttribution

    _, model = tiny("MixtralForCausalLM")
    t, f = top2(model, ids_of(model))
    with pytest.raises(MethodRefused, match="MixtralForCausalLM.*mixture-of-experts"):
        NeuronAttribution(prompts=[PROMPT], target=t, layers=[0]).run(model)
    exp = ActivationPatching(pairs=[{"clean": "The capital of France is", "corrupted": "The capital of Italy is",
                                     "target": t, "foil": f}], sites=["neuron"], neuron_layers=[0], neurons=[0])
    with pytest.raises(MethodRefused, match="mixture-of-experts"):
        exp.run(model)


def test_neuron_index_past_the_layer_width_is_refused(tiny_gpt2):
    from tracekit.patching import batched_act_patch_mlp_neuron
    from tracekit.tokens import tokenize

    toks = tokenize(tiny_gpt2, ["The capital of France is"]).tokens
    width = int(tiny_gpt2.blocks[0].mlp.W_out.shape[0])
    with pytest.raises(PatchingError, match=f"has {width} neurons"):
        batched_act_patch_mlp_neuron(tiny_gpt2, toks, toks, lambda lg, b: lg[:, 0], layers=[0], neurons=[width])


@pytest.mark.parametrize("arch", ["OPTForCausalLM", "GPTJForCausalLM"])
def test_attention_patterns_fire_on_families_that_delegate_attention(arch):
    from tracekit.attention import attention_pattern

    d, model = tiny(arch)
    ref = harness.reference(d, model)
    atts = ref.run(ids_of(model), attentions=True)["attentions"]
    for L in range(int(model.cfg.n_layers)):
        la = attention_pattern(model, PROMPT, L)
        assert (la.weights - atts[L][0].float()).abs().max() < 1e-5


def test_bloom_patching_runs_and_a_full_residual_patch_restores_the_clean_run():
    from tracekit import ActivationPatching

    _, model = tiny("BloomForCausalLM")
    t, f = top2(model, ids_of(model, "The capital of France is"))
    exp = ActivationPatching(pairs=[{"clean": "The capital of France is", "corrupted": "The capital of Italy is",
                                     "target": t, "foil": f},
                                    {"clean": "The capital of Spain is", "corrupted": "The capital of Japan is",
                                     "target": t, "foil": f}],
                             sites=["resid_pre_layer", "head_out"], directions=["denoising"], layers=[0, 1])
    res = exp.run(model)
    tab = res.tables["results"] if "results" in res.tables else res.tables[res.main_table]
    full = tab[(tab["site"] == "resid_pre_layer") & (tab["layer"] == 0)]
    col = next(c for c in ("logit_diff_normalized", "normalized", "value") if c in full.columns)
    assert (full[col] - 1.0).abs().max() < 1e-4


@pytest.mark.parametrize("arch,variant,where", [("FalconForCausalLM", "new_decoder_arch", "at boot"),
                                                ("CodeGenForCausalLM", None, "cannot run"),
                                                ("HunYuanDenseV1ForCausalLM", None, "different log-probabilities")])
def test_an_unusable_layout_is_refused_naming_its_architecture(arch, variant, where):
    if arch == "HunYuanDenseV1ForCausalLM" and tl_major() >= 4:
        tiny(arch, variant)  # TransformerLens 4's bridge matches transformers here: the load's verification passes
        return
    with pytest.raises(ModelLoadError, match=f"{arch}.*{where}|{where}.*{arch}|{arch}"):
        tiny(arch, variant)
    try:
        tiny(arch, variant)
    except ModelLoadError as e:
        assert arch in str(e) and where in str(e)


def test_categories_tracekit_does_not_read_are_refused_before_weights(tmp_path):
    from transformers import T5Config

    from tracekit.model.info import load_model_info

    T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8,
             architectures=["T5ForConditionalGeneration"]).save_pretrained(tmp_path)  # config only: no weights
    for load in (load_model, load_model_info):
        with pytest.raises(ModelLoadError, match="T5ForConditionalGeneration is an encoder-decoder"):
            load(ModelSpec(name=str(tmp_path), tokenizer=harness.GPT2_BPE, device="cpu"))


def test_recurrent_models_are_padded_on_the_right():
    from tracekit.tokens import tokenize

    _, model = tiny("RwkvForCausalLM", padding_side="left")
    b = tokenize(model, ["a b c d e f", "a"])
    assert b.padding_side == "right"
