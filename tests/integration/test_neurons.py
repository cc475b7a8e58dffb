"""FFN neurons (tracekit.neurons): contributions, value / key readout, interventions, and the
neuron_attribution kind.

Invariants run on ``perturbed_model`` (6 variants: GPT-2 / Llama (GQA) / tied-embedding Llama with
perturbed norms and biases, weight processing on and off). Tolerance 1e-4 absolute (float32 sums
round at ~1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch

from tracekit.neurons import (
    AttributionError,
    key_readout,
    neuron_contributions,
    neuron_intervention,
    parse_neuron,
    random_neurons,
    value_logits,
    value_readout,
)
from tracekit.tokens import TokenizationError

ATOL = 1e-4
PROMPTS = ["The capital of France is", "Hello, my name is John and I live in"]


def test_neurons_plus_b_out_equal_the_mlp(perturbed_model):
    for d in neuron_contributions(perturbed_model, PROMPTS, " Paris", " London", layers="all"):
        assert sorted(d.neuron_contrib) == list(range(perturbed_model.cfg.n_layers))
        for L, c in d.neuron_contrib.items():
            assert float(c.sum() + d.mlp_bias[L]) == pytest.approx(float(d.mlp[L]), abs=ATOL)
        nf = d.neurons_frame()
        torch.testing.assert_close(torch.tensor(nf["contribution"].values),
                                   torch.tensor((nf["activation"] * nf["logit_per_activation"]).values),
                                   atol=1e-6, rtol=0)


def test_frozen_direct_path_ablation_equals_contribution(perturbed_model):
    m = perturbed_model
    d = neuron_contributions(m, PROMPTS[0], " Paris", " London", layers="all")[0]
    nf = d.neurons_frame()
    top = nf.loc[nf["contribution"].abs().idxmax()]
    one = [(int(top.layer), int(top.neuron))]
    r = neuron_intervention(m, PROMPTS[0], " Paris", one, "zero", foil=" London", freeze_downstream=True)
    assert abs(top.contribution) > 1e-3
    assert r["delta"]["logit_diff"] == pytest.approx(-float(top.contribution), abs=ATOL)
    # several neurons in two layers: effects add on the direct path
    two = list(dict.fromkeys(one + [(0, 5), (2, 7)]))
    want = -sum(float(nf[(nf.layer == L) & (nf.neuron == n)]["contribution"].iloc[0]) for L, n in two)
    r = neuron_intervention(m, PROMPTS[0], " Paris", two, "zero", foil=" London", freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx(want, abs=ATOL)
    # amplification by 2 on the direct path adds the contribution once more
    r = neuron_intervention(m, PROMPTS[0], " Paris", one, "scale", foil=" London", factor=2.0,
                            freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx(float(top.contribution), abs=ATOL)
    # a mean ablation to the value v moves it by (v - a) x logit_per_activation
    v = 0.37
    r = neuron_intervention(m, PROMPTS[0], " Paris", one, "mean", foil=" London", means={one[0]: v},
                            freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx((v - top.activation) * top.logit_per_activation, abs=ATOL)


def test_frozen_ablation_at_a_token_position(perturbed_model):
    m = perturbed_model
    prompt = "The capital of France is a city"
    d = neuron_contributions(m, prompt, " Paris", " London", position="token: is", layers=[1])[0]
    nf = d.neurons_frame()
    top = nf.loc[nf["contribution"].abs().idxmax()]
    r = neuron_intervention(m, prompt, " Paris", [(1, int(top.neuron))], "zero", foil=" London",
                            position="token: is", freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx(-float(top.contribution), abs=ATOL)


def test_intervention_metrics_are_the_metrics_module(tiny_gpt2):
    from tracekit.metrics import logit_diff, target_prob
    from tracekit.tokens import single_token_id, tokenize

    m = tiny_gpt2
    r = neuron_intervention(m, PROMPTS[0], " Paris", [(1, 3)], "zero", foil=" London")
    batch = tokenize(m, PROMPTS[0])
    lg = m(batch.tokens)[:, -1]
    t, f = single_token_id(m, " Paris"), single_token_id(m, " London")
    assert r["clean"]["target_prob"] == pytest.approx(float(target_prob(lg, torch.tensor([[t]]))[0]), abs=1e-7)
    assert r["clean"]["logit_diff"] == pytest.approx(
        float(logit_diff(lg, torch.tensor([[t]]), torch.tensor([[f]]))[0]), abs=1e-6)


def test_value_logits_match_attribution(perturbed_model):
    from tracekit.tokens import single_token_id

    m = perturbed_model
    d = neuron_contributions(m, PROMPTS[0], " Paris", " London", layers=[1])[0]
    t, f = single_token_id(m, " Paris"), single_token_id(m, " London")
    for n in (0, 3, 17):
        v = value_logits(m, 1, n)
        assert float(v[t] - v[f]) * d.final_scale == pytest.approx(float(d.neuron_value[1][n]), abs=ATOL)
    vr = value_readout(m, 1, 3, k=5)
    v = value_logits(m, 1, 3)
    prom = vr[vr.side == "promoted"]
    assert prom["token_id"].tolist() == v.topk(5).indices.tolist()
    neg = value_readout(m, 1, 3, k=5, sign=-1)
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
    cols = ["layer", "neuron", "rank", "window", "position", "token", "context"]  # the engine's frame
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
    with pytest.raises(AttributionError, match=r"layers\[0\]: layer 5"):
        neuron_contributions(m, "x", " Paris", layers=[5])
    with pytest.raises(TokenizationError, match="position"):
        neuron_intervention(m, "The capital", " Paris", [(0, 1)], position=10)
    with pytest.raises(AttributionError, match="intervene_at"):
        neuron_intervention(m, "x y", " Paris", [(0, 1)], intervene_at="last")
    with pytest.raises(AttributionError, match="factor"):
        neuron_intervention(m, "x y", " Paris", [(0, 1)], "scale", factor=float("inf"))
    with pytest.raises(AttributionError, match="means"):
        neuron_intervention(m, "x y", " Paris", [(0, 1)], "mean", means={(0, 1): float("nan")})
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
    class M:  # minimal stand-in: only cfg is read (the rest: what a HookedModel has, checked at run time)
        class cfg:
            d_mlp = 50
        tokenizer = None
        hook_dict: dict = {}

        def run_with_cache(self, *a, **k): ...

        run_with_hooks = hooks = run_with_cache

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
                               ablation={"n_random": 1, "scale_factors": 3.0, "intervene_at": "all"})
    res = exp.run(tiny_llama, progress=False)
    s = res.summary()
    assert s["max_additivity_error"] < ATOL
    assert len(s["top_neurons_mean"]) == 3 and len(s["top_neurons_mean"][0]["promotes"]) == 4
    assert len(s["top_neurons_mean"][0]["top_contexts"]) == 2
    assert set(s["interventions"]) == {"zero", "mean", "scale_x3"}
    contribs = [t["mean_contribution"] for t in s["top_neurons_mean"]]
    assert contribs == sorted(contribs, reverse=True)
    assert s["n_rows"] == 1 and s["top_neuron_by_row"] == [s["top_neurons_mean"][0]["neuron"]]
    assert "neuron attribution" in res.report()
    res.save(tmp_path / "out")
    back = tk.experiments.Result.load(tmp_path / "out")
    assert back.summary() == s


@pytest.mark.slow
def test_embedded_model_direct_path(embedded_model):
    m = embedded_model
    prompt = "The capital of China is Beijing. The capital of France is"
    d = neuron_contributions(m, prompt, " Paris", " Beijing", layers=[29])[0]
    nf = d.neurons_frame()
    top = nf.loc[nf["contribution"].idxmax()]
    r = neuron_intervention(m, prompt, " Paris", [(int(top.layer), int(top.neuron))], "zero", foil=" Beijing",
                            freeze_downstream=True)
    assert r["delta"]["logit_diff"] == pytest.approx(-float(top.contribution), abs=1e-3)


def _hook_count(model) -> int:
    """Hooks on TransformerLens hook points (what tracekit adds). Hugging Face's own inert
    output-capturing hooks, installed once on a model's first forward pass, are not counted."""
    from transformer_lens.hook_points import HookPoint

    n = 0
    for mod in model.modules():
        if isinstance(mod, HookPoint):
            n += len(mod._forward_hooks) + len(mod._forward_pre_hooks) + len(mod.fwd_hooks)
    return n


class _Boom(RuntimeError):
    pass


def _raise(*a, **k):
    raise _Boom("forced failure inside a hook")


@pytest.mark.parametrize("where", ["edit_hook", "freeze_hook", "forward"])
def test_intervention_hooks_are_removed_whatever_is_raised(perturbed_model, monkeypatch, where):
    """A failure inside an intervention's hook (or anywhere in its forward pass) leaves no hook:
    afterwards a plain forward pass equals the one before, bit for bit."""
    import tracekit.units as U  # the edit and freeze hooks of neuron_intervention (tracekit.units.intervene)
    from tracekit.tokens import tokenize

    m = perturbed_model
    toks = tokenize(m, PROMPTS[0]).tokens
    before, n_hooks = m(toks).clone(), _hook_count(m)
    with monkeypatch.context() as mp:
        if where == "edit_hook":
            mp.setattr(U, "new_activations", _raise)
        elif where == "freeze_hook":
            mp.setattr(U, "_frozen", _raise)
        else:
            mp.setattr(m.blocks[2].hook_resid_mid, "forward", _raise)
        with pytest.raises(_Boom):
            neuron_intervention(m, PROMPTS[0], " Paris", [(1, 3), (2, 4)], "zero", foil=" London",
                                freeze_downstream=where != "edit_hook")
    assert _hook_count(m) == n_hooks
    assert torch.equal(m(toks), before)


def test_key_readout_hooks_are_removed_whatever_is_raised(tiny_gpt2, monkeypatch, tmp_path):
    from tracekit.tokens import tokenize

    m = tiny_gpt2
    toks = tokenize(m, PROMPTS[0]).tokens
    before, n_hooks = m(toks).clone(), _hook_count(m)
    with monkeypatch.context() as mp:
        mp.setattr(m.blocks[0].hook_resid_mid, "forward", _raise)
        with pytest.raises(_Boom):
            key_readout(m, [(1, 2)], _corpus(tmp_path), jsonl_field="body", seq_len=12, progress=False)
    assert _hook_count(m) == n_hooks
    assert torch.equal(m(toks), before)
    key_readout(m, [(1, 2)], _corpus(tmp_path), jsonl_field="body", seq_len=12, progress=False)  # stops early
    assert _hook_count(m) == n_hooks and torch.equal(m(toks), before)


def test_key_readout_stopped_forward_equals_full_forward(tiny_model, tmp_path):
    """Activations read from the forward pass stopped after block 0 equal a full run's."""
    from tracekit.corpus import iter_documents, token_windows, window_batches
    from tracekit.tokens import run_with_cache
    from tracekit.units import hook_values as _activations  # key_readout's stopped forward pass

    m = tiny_model
    wins = token_windows(m, iter_documents(_corpus(tmp_path), jsonl_field="body"), seq_len=12, max_tokens=60)
    batch, _ = next(iter(window_batches(m, wins, 4)))
    stopped = _activations(m, batch, ["blocks.0.mlp.hook_post"], 1)["blocks.0.mlp.hook_post"]
    _, full = run_with_cache(m, batch, ["blocks.0.mlp.hook_post"])
    mask = batch.attention_mask.bool()
    torch.testing.assert_close(stopped[mask], full["blocks.0.mlp.hook_post"][mask], atol=1e-6, rtol=0)


@pytest.mark.parametrize("bad", [{"scale_factors": float("nan")}, {"scale_factors": float("inf")},
                                 {"scale_factors": [2.0, float("-inf")]}])
def test_non_finite_ablation_values_are_config_errors(bad):
    from pydantic import ValidationError

    import tracekit as tk

    with pytest.raises(ValidationError, match="scale_factors"):
        tk.NeuronAttribution(prompts="a b", target=" Paris", ablation=bad)


def test_non_finite_yaml_values_are_config_errors(tmp_path):
    from tracekit.config import load_config

    for text in ("      scale_factors: .nan", "      scale_factors: [.inf]"):
        p = tmp_path / "c.yaml"
        p.write_text("model: {name: gpt2}\nexperiments:\n  - kind: neuron_attribution\n    prompts: a b\n"
                     f"    target: ' Paris'\n    ablation:\n{text}\n")
        with pytest.raises(Exception, match="scale_factors") as e:
            load_config(p)
        assert isinstance(e.value, ValueError)


def test_retired_ablation_key_names_the_new_one():
    from pydantic import ValidationError

    import tracekit as tk

    with pytest.raises(ValidationError, match="renamed to 'intervene_at'"):
        tk.NeuronAttribution(prompts="a b", target=" Paris", ablation={"positions": "last"})
    assert tk.AblationConfig(intervene_at="all").intervene_at == "all"


def test_check_works_on_model_info(tiny_gpt2):
    import tracekit as tk
    from tracekit.model.info import ModelInfo

    m = tiny_gpt2
    info = ModelInfo(m.tracekit_spec, m.tokenizer, m.cfg, list(m.hook_dict), m._gated_hook_reason)
    tk.NeuronAttribution(prompts=PROMPTS, target=" Paris", foil=" London", layers=[-1], position="token: is").check(info)
    with pytest.raises(AttributionError, match=r"layers\[0\]: layer 7"):
        tk.NeuronAttribution(prompts=PROMPTS, target=" Paris", layers=[7]).check(info)
    with pytest.raises(TokenizationError, match="position"):
        tk.NeuronAttribution(prompts=PROMPTS, target=" Paris", position="token: Rome").check(info)


def test_prompt_means_exclude_bos_and_padding(tiny_gpt2):
    from tracekit.neurons import prompt_means
    from tracekit.tokens import run_with_cache, tokenize

    m = tiny_gpt2  # prepends BOS, pads on the right
    got = prompt_means(m, PROMPTS, [(1, 3), "2.5"])
    acts = []
    for p in PROMPTS:  # one by one: no padding; drop BOS
        _, c = run_with_cache(m, tokenize(m, [p]), ["blocks.1.mlp.hook_post", "blocks.2.mlp.hook_post"])
        acts.append((c["blocks.1.mlp.hook_post"][0, 1:, 3], c["blocks.2.mlp.hook_post"][0, 1:, 5]))
    assert got[(1, 3)] == pytest.approx(float(torch.cat([a for a, _ in acts]).mean()), abs=1e-6)
    assert got[(2, 5)] == pytest.approx(float(torch.cat([b for _, b in acts]).mean()), abs=1e-6)


def test_key_readout_seq_len_past_the_context_is_refused_at_check(tiny_gpt2):
    """``contexts.seq_len`` above the model's context is refused at config check time (on the model's
    tokenizer and config alone, a ModelInfo), not when the key readout starts after the attribution
    has run; key_readout itself refuses it when called."""
    import tracekit as tk
    from tracekit.errors import ConfigError
    from tracekit.model.info import ModelInfo

    m = tiny_gpt2
    info = ModelInfo(m.tracekit_spec, m.tokenizer, m.cfg, list(m.hook_dict), m._gated_hook_reason)
    cfg = {"prompts": "The capital of France is", "target": " Paris", "layers": [1]}
    tk.NeuronAttribution(**cfg, contexts={"seq_len": 128}).check(info)
    tk.NeuronAttribution(**cfg, contexts=None).check(info)
    with pytest.raises(ConfigError, match=r"^contexts\.seq_len: windows of 129 tokens need 129 positions, more than "
                                          r"model 'gpt2''s context of 128 tokens .*at most 128$"):
        tk.NeuronAttribution(**cfg, contexts={"seq_len": 129}).check(info)
    with pytest.raises(ConfigError, match=r"^seq_len: windows of 129"):
        key_readout(m, ["1.0"], seq_len=129, max_tokens=64, progress=False)
