"""Direct logit attribution, neuron attribution, value/key readout and interventions.

Invariants are tested on tiny random GPT-2 (LayerNorm, biases, learned positions) and Llama
(RMSNorm, GQA, SwiGLU, no biases) models whose norm weights and biases are perturbed away from
their init (1 / 0), so the final-norm weight/bias and b_O / b_out terms really matter; with
weight processing on and off. Tolerances: float32 sums over <= a few thousand terms of O(1)
values round at ~1e-6, so 1e-4 absolute leaves a wide margin while catching a missing term.
"""

from __future__ import annotations

import json

import pytest
import torch

from tracekit.attribution import (
    AttributionError,
    direct_logit_attribution,
    key_readout,
    neuron_intervention,
    parse_neuron,
    random_neurons,
    value_logits,
    value_readout,
)
from tracekit.readout import Readout
from tracekit.tokens import TokenizationError
from helpers import make_perturbed

ATOL = 1e-4
PROMPTS = ["The capital of France is", "Hello, my name is John and I live in"]


def perturbed_tiny(arch: str, tokenizer_dir: str, process_weights: bool):
    return make_perturbed(arch, process_weights=process_weights)


@pytest.fixture(scope="module", params=[("gpt2", True), ("gpt2", False), ("llama", True), ("llama", False)],
                ids=["gpt2-processed", "gpt2-raw", "llama-processed", "llama-raw"])
def pmodel(request, gpt2_tokenizer_dir):
    arch, pw = request.param
    return perturbed_tiny(arch, gpt2_tokenizer_dir, pw)


@pytest.mark.parametrize("foil", [" London", None])
def test_components_sum_to_logit(pmodel, foil):
    das = direct_logit_attribution(pmodel, PROMPTS, " Paris", foil, neuron_layers="all")
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


def test_bias_terms_are_exercised(gpt2_tokenizer_dir):
    m = perturbed_tiny("gpt2", gpt2_tokenizer_dir, False)
    d = direct_logit_attribution(m, PROMPTS[0], " Paris", " London")[0]
    assert d.attn_bias.abs().max() > 1e-3 and d.mlp_bias.abs().max() > 1e-3 and abs(d.final_bias) > 1e-3
    assert d.pos_embed is not None


def test_attribution_does_not_depend_on_weight_processing(gpt2_tokenizer_dir):
    for arch in ("gpt2", "llama"):
        a = direct_logit_attribution(perturbed_tiny(arch, gpt2_tokenizer_dir, True), PROMPTS, " Paris", " London")
        b = direct_logit_attribution(perturbed_tiny(arch, gpt2_tokenizer_dir, False), PROMPTS, " Paris", " London")
        for x, y in zip(a, b):
            assert x.logit == pytest.approx(y.logit, abs=ATOL)
            torch.testing.assert_close(x.attn, y.attn, atol=ATOL, rtol=0)
            torch.testing.assert_close(x.mlp, y.mlp, atol=ATOL, rtol=0)
            if arch == "llama":  # no value biases; GPT-2's b_V is folded into b_O by processing
                torch.testing.assert_close(x.heads, y.heads, atol=ATOL, rtol=0)


def test_scale_is_the_runs_final_norm_scale(pmodel):
    from tracekit.tokens import run_with_cache, tokenize

    d = direct_logit_attribution(pmodel, PROMPTS[0], " Paris")[0]
    batch = tokenize(pmodel, PROMPTS[0])
    _, cache = run_with_cache(pmodel, batch, ["ln_final.hook_in"])
    assert d.final_scale == pytest.approx(float(Readout(pmodel).scale(cache["ln_final.hook_in"][0, -1])), rel=1e-5)


def test_frozen_direct_path_ablation_equals_contribution(pmodel):
    d = direct_logit_attribution(pmodel, PROMPTS[0], " Paris", " London", neuron_layers="all")[0]
    nf = d.neurons_frame()
    top = nf.loc[nf["contribution"].abs().idxmax()]
    one = [(int(top.layer), int(top.neuron))]
    r = neuron_intervention(pmodel, PROMPTS[0], " Paris", one, "zero", foil=" London", freeze_downstream=True)
    assert abs(top.contribution) > 1e-3
    assert r["delta"]["logit_diff"] == pytest.approx(-float(top.contribution), abs=ATOL)
    # several neurons in two layers: effects add on the direct path
    two = one + [(0, 5), (2, 7)]
    two = list(dict.fromkeys(two))
    want = -sum(float(nf[(nf.layer == L) & (nf.neuron == n)]["contribution"].iloc[0]) for L, n in two)
    r = neuron_intervention(pmodel, PROMPTS[0], " Paris", two, "zero", foil=" London", freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx(want, abs=ATOL)
    # amplification by 2 on the direct path adds the contribution once more
    r = neuron_intervention(pmodel, PROMPTS[0], " Paris", one, "scale", foil=" London", factor=2.0,
                            freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx(float(top.contribution), abs=ATOL)


def test_value_logits_match_attribution(pmodel):
    from tracekit.tokens import single_token_id

    d = direct_logit_attribution(pmodel, PROMPTS[0], " Paris", " London", neuron_layers=[1])[0]
    t, f = single_token_id(pmodel, " Paris"), single_token_id(pmodel, " London")
    for n in (0, 3, 17):
        v = value_logits(pmodel, 1, n)
        assert float(v[t] - v[f]) * d.final_scale == pytest.approx(float(d.neuron_value[1][n]), abs=ATOL)
    vr = value_readout(pmodel, 1, 3, k=5)
    v = value_logits(pmodel, 1, 3)
    prom = vr[vr.side == "promoted"]
    assert prom["token_id"].tolist() == v.topk(5).indices.tolist()
    neg = value_readout(pmodel, 1, 3, k=5, sign=-1)
    assert neg[neg.side == "promoted"]["token_id"].tolist() == vr[vr.side == "suppressed"]["token_id"].tolist()


def _corpus(tmp_path):
    lines = [f"Record {i}: the {w} of {c} was noted in {1900 + 7 * i} by a careful observer."
             for i, (w, c) in enumerate(zip(["river", "capital", "mountain", "forest", "harbour", "bridge"] * 3,
                                             ["Spain", "Peru", "Kenya", "Norway", "Chile", "Japan", "Egypt", "Laos", "Fiji"] * 2))]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"body": s}) for s in lines))
    return str(path)


def test_key_readout_batched_equals_one_by_one(tiny_model, tmp_path):
    corpus = _corpus(tmp_path)
    neurons = [(0, 1), (1, 2), "1.5"]  # layers 0-1 only: the forward pass stops after block 1
    kw = dict(top_n=4, seq_len=12, max_tokens=None, jsonl_field="body", progress=False, signs=[1, -1, 1])
    a = key_readout(tiny_model, neurons, corpus, batch_size=8, **kw)
    b = key_readout(tiny_model, neurons, corpus, batch_size=1, **kw)
    assert a.n_tokens == b.n_tokens > 100
    assert len(a.contexts) == 3 * 4
    cols = ["layer", "neuron", "rank", "window", "position", "token", "context"]
    assert a.contexts[cols].equals(b.contexts[cols])
    torch.testing.assert_close(torch.tensor(a.contexts["activation"].values),
                               torch.tensor(b.contexts["activation"].values), atol=1e-5, rtol=0)
    for k in a.means:
        assert a.means[k] == pytest.approx(b.means[k], abs=1e-6)
    # ranks are by activation in the requested direction
    for (L, n), s in zip([(0, 1), (1, 2), (1, 5)], [1, -1, 1]):
        acts = a.contexts[(a.contexts.layer == L) & (a.contexts.neuron == n)]["activation"].to_numpy() * s
        assert (acts[:-1] >= acts[1:]).all()
    assert all("[[" in c for c in a.contexts["context"])


def test_default_corpus_streams_and_is_bounded(tiny_gpt2):
    from tracekit.corpus import iter_documents, token_windows

    docs = iter_documents()
    first = [next(docs) for _ in range(4)]
    assert all(len(t.split()) >= 8 for _, t in first)
    wins = list(token_windows(tiny_gpt2, iter_documents(), seq_len=32, max_tokens=500))
    assert sum(len(w.ids) - w.n_prefix for w in wins) == 500
    assert all(len(w.ids) <= 32 for w in wins)


def test_bad_inputs_name_the_field(tiny_gpt2, tmp_path):
    m = tiny_gpt2
    with pytest.raises(TokenizationError, match="target"):
        direct_logit_attribution(m, "The capital of France is", " Parisian-ish")
    with pytest.raises(TokenizationError, match="foil"):
        direct_logit_attribution(m, "The capital of France is", " Paris", foil=" Sacramento-ville")
    with pytest.raises(AttributionError, match="foil"):
        direct_logit_attribution(m, "x", " Paris", foil=" Paris")
    with pytest.raises(AttributionError, match="neuron_layers: layer 5"):
        direct_logit_attribution(m, "x", " Paris", neuron_layers=[5])
    with pytest.raises(AttributionError, match="position"):
        direct_logit_attribution(m, "The capital", " Paris", position=10)
    with pytest.raises(AttributionError, match="neurons: neuron 999999"):
        parse_neuron(m, "1.999999")
    with pytest.raises(AttributionError, match="layer.neuron"):
        parse_neuron(m, "abc")
    with pytest.raises(AttributionError, match="means"):
        neuron_intervention(m, "x y", " Paris", [(0, 1)], "mean")
    from tracekit.corpus import CorpusError

    with pytest.raises(CorpusError, match="corpus"):
        key_readout(m, [(0, 1)], str(tmp_path / "missing.txt"), progress=False)


def test_random_control_matches_layers():
    class M:  # minimal stand-in: only cfg is read
        class cfg:
            d_mlp = 50

    top = [(1, 3), (1, 4), (2, 9)]
    r = random_neurons(M, top, seed=3)
    assert sorted(L for L, _ in r) == [1, 1, 2]
    assert not set(r) & set(top)
    assert r == random_neurons(M, top, seed=3)


def test_neuron_attribution_experiment_roundtrip(tiny_llama, tmp_path):
    import tracekit as tk

    exp = tk.NeuronAttribution(prompts="The capital of France is", target=" Paris", foil=" London", layers=[1, 2],
                               top_k=3, value_tokens=4,
                               contexts={"corpus": _corpus(tmp_path), "jsonl_field": "body", "top_n": 2,
                                         "max_tokens": 200, "seq_len": 16},
                               ablation={"n_random": 1, "amplify": 3.0})
    res = exp.run(tiny_llama, progress=False)
    s = res.summary()
    assert s["max_additivity_error"] < ATOL
    assert len(s["top_neurons"]) == 3 and len(s["top_neurons"][0]["promotes"]) == 4
    assert len(s["top_neurons"][0]["top_contexts"]) == 2
    assert set(s["interventions"]) == {"zero", "mean", "amplify_x3"}
    contribs = [t["contribution"] for t in s["top_neurons"]]
    assert contribs == sorted(contribs, reverse=True)
    assert "neuron attribution" in res.report()
    res.save(tmp_path / "out")
    back = tk.experiments.Result.load(tmp_path / "out")
    assert back.summary() == s
    dla = tk.DirectLogitAttribution(prompts=PROMPTS, target=" Paris", foil=" London").run(tiny_llama)
    ds = dla.summary()
    assert ds["abs_error"] < ATOL and ds["sum_of_parts"] == pytest.approx(ds["logit"], abs=ATOL)
    dla.save(tmp_path / "dla")
    assert tk.experiments.Result.load(tmp_path / "dla").summary() == ds


@pytest.mark.slow
def test_embedded_model_additivity_and_direct_path(embedded_model):
    m = embedded_model
    prompt = "The capital of China is Beijing. The capital of France is"
    d = direct_logit_attribution(m, prompt, " Paris", " Beijing", neuron_layers=[27, 29])[0]
    assert d.total() == pytest.approx(d.logit, abs=1e-3)  # 30 layers of O(10) logits: float32 margin
    torch.testing.assert_close(d.heads.sum(1) + d.attn_bias, d.attn, atol=1e-3, rtol=0)
    for L in (27, 29):
        assert float(d.neuron_contrib[L].sum() + d.mlp_bias[L]) == pytest.approx(float(d.mlp[L]), abs=1e-3)
    nf = d.neurons_frame()
    top = nf.loc[nf["contribution"].idxmax()]
    r = neuron_intervention(m, prompt, " Paris", [(int(top.layer), int(top.neuron))], "zero", foil=" Beijing",
                            freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx(-float(top.contribution), abs=1e-3)
