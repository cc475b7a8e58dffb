"""tracekit.units on tiny models: the verbs over NeuronBasis and SAEBasis, intervene, the readouts.

Invariants: ``zero`` on a last-layer neuron (final-norm scale frozen) moves the logit difference by
exactly minus its direct contribution; ``scale`` by 1, ``steer`` by 0 and ``clamp`` to the current
activation change nothing; ``steer`` by v on a neuron equals ``clamp`` to a + v; the engines' public
wrappers equal :func:`tracekit.units.intervene`; hooks are removed whatever is raised.
"""

from __future__ import annotations

import pytest
import torch
from test_sae import PROMPT, make_sae_dir

import tracekit.units as U
from tracekit.core.sites import hook
from tracekit.dla import resolve_target
from tracekit.neurons import NeuronBasis, neuron_contributions, neuron_intervention, value_readout
from tracekit.sae import SAEBasis, SAESpec, decoder_vocab, feature_intervention, load_sae, top_activating_contexts
from tracekit.tokens import encode, pad_ids, run_with_cache, tokenize
from tracekit.units import UnitEdit, intervene, top_contexts, vocab_readout

ATOL = 1e-4
NOOP_ATOL = 1e-5
PROMPTS = ["The capital of France is", "Hello, my name is John and I live in"]


def _setup(m, prompt=PROMPTS[0]):
    batch = tokenize(m, [prompt])
    return batch, int(batch.lengths[0]) - 1, resolve_target(m, " Paris", " London")


def _at(batch, p):
    w = torch.zeros(batch.tokens.shape[1], dtype=torch.bool)
    w[p] = True
    return w


def test_zero_on_a_last_layer_neuron_is_minus_its_direct_contribution(perturbed_model):
    m = perturbed_model
    last = int(m.cfg.n_layers) - 1
    nf = neuron_contributions(m, PROMPTS[0], " Paris", " London", layers=[last])[0].neurons_frame()
    batch, p, tgt = _setup(m)
    for n in nf["contribution"].abs().nlargest(3).index:
        row = nf.loc[n]
        assert abs(row.contribution) > 1e-4
        e = UnitEdit(NeuronBasis(m, last), [int(row.neuron)], "zero")
        for where in (_at(batch, p), None):  # at the read position, or everywhere (later positions cannot reach it)
            r = intervene(m, e, batch, p, tgt, where=where, freeze=[hook("final_norm_scale")])
            assert r["delta"]["logit_diff"] == pytest.approx(-float(row.contribution), abs=ATOL)
        # steering by v adds v x the neuron's decoder row: v x logit_per_activation on the direct path
        r = intervene(m, UnitEdit(NeuronBasis(m, last), [int(row.neuron)], "steer", value=0.7), batch, p, tgt,
                      where=_at(batch, p), freeze=[hook("final_norm_scale")])
        assert r["delta"]["logit_diff"] == pytest.approx(0.7 * float(row.logit_per_activation), abs=ATOL)


@pytest.mark.parametrize("where_kind", ["position", "all"])
def test_neuron_noop_verbs_change_nothing(perturbed_model, where_kind):
    m = perturbed_model
    batch, p, tgt = _setup(m)
    where = _at(batch, p) if where_kind == "position" else None
    _, cache = run_with_cache(m, batch, [hook("neuron", 1)])
    a = float(cache[hook("neuron", 1)][0, p, 3])
    basis = NeuronBasis(m, 1)
    edits = [UnitEdit(basis, [3, 7], "scale", value=1.0), UnitEdit(basis, [3, 7], "steer", value=0.0)]
    if where_kind == "position":
        edits.append(UnitEdit(basis, [3], "clamp", value=a))
        edits.append(UnitEdit(basis, [3], "mean", means=[a]))
    for e in edits:
        r = intervene(m, e, batch, p, tgt, where=where)
        for k, v in r["delta"].items():
            assert abs(v) < NOOP_ATOL, (e.verb, k, v)
    # steer by v == clamp to a + v
    s = intervene(m, UnitEdit(basis, [3], "steer", value=0.9), batch, p, tgt, where=_at(batch, p))
    c = intervene(m, UnitEdit(basis, [3], "clamp", value=a + 0.9), batch, p, tgt, where=_at(batch, p))
    assert s["patched"]["logit_diff"] == pytest.approx(c["patched"]["logit_diff"], abs=ATOL)


@pytest.mark.parametrize("mode,kw", [("zero", {}), ("ablate", {}), ("scale", {"factor": 3.0}), ("clamp", {"value": 0.4}),
                                     ("steer", {"value": -1.5}), ("mean", {"means": {(1, 3): 0.2, (2, 4): -0.1}})])
@pytest.mark.parametrize("freeze", [False, True])
def test_neuron_intervention_is_intervene(tiny_model, mode, kw, freeze):
    m = tiny_model
    batch, p, tgt = _setup(m)
    got = neuron_intervention(m, PROMPTS[0], " Paris", [(1, 3), (2, 4)], mode, foil=" London",
                              freeze_downstream=freeze, **kw)
    verb = U.canonical_verb(mode)
    val = kw.get("factor", kw.get("value", 0.0))
    edits = [UnitEdit(NeuronBasis(m, L), [n], verb, value=val,
                      means=[kw["means"][(L, n)]] if verb == "mean" else None) for L, n in [(1, 3), (2, 4)]]
    from tracekit.neurons import _direct_path_freeze

    want = intervene(m, edits, batch, p, tgt, where=_at(batch, p),
                     freeze=_direct_path_freeze(m, [1, 2]) if freeze else ())
    assert got == want


def test_neuron_bad_verbs_name_the_field(tiny_gpt2):
    from tracekit.errors import AttributionError

    m = tiny_gpt2
    with pytest.raises(AttributionError, match="mode: 'erase' is not one of"):
        neuron_intervention(m, PROMPTS[0], " Paris", [(1, 3)], "erase")
    with pytest.raises(AttributionError, match="value: inf"):
        neuron_intervention(m, PROMPTS[0], " Paris", [(1, 3)], "clamp", value=float("inf"))
    with pytest.raises(AttributionError, match="units: give one edit per hook"):
        b = NeuronBasis(m, 1)
        batch, p, tgt = _setup(m)
        intervene(m, [UnitEdit(b, [1], "zero"), UnitEdit(b, [2], "zero")], batch, p, tgt)


@pytest.fixture(scope="module")
def sae_handle(tmp_path_factory, tiny_gpt2):
    d = make_sae_dir(tmp_path_factory.mktemp("sae"), tiny_gpt2, "blocks.1.hook_resid_pre")
    return load_sae(SAESpec(path=str(d)), tiny_gpt2)


def test_sae_noop_verbs_change_nothing(tiny_gpt2, sae_handle):
    m, h = tiny_gpt2, sae_handle
    basis = SAEBasis(h)
    ids = encode(m, PROMPT, prepend_bos=h.info.prepend_bos)
    batch = pad_ids(m, [ids])
    p = len(ids) - 1
    tgt = resolve_target(m, " Paris", " London")
    _, cache = run_with_cache(m, batch, [h.hook])
    acts = basis.activations(cache[h.hook])[0, p]
    f = int(acts.argmax())
    assert float(acts[f]) > 0
    for e in (UnitEdit(basis, [f, 2], "scale", value=1.0), UnitEdit(basis, [f, 2], "steer", value=0.0),
              UnitEdit(basis, [f], "clamp", value=float(acts[f])), UnitEdit(basis, [f], "mean", means=[float(acts[f])])):
        r = intervene(m, e, batch, p, tgt, where=_at(batch, p))
        for k, v in r["delta"].items():
            assert abs(v) < NOOP_ATOL, (e.verb, k, v)
    # zeroing an active feature moves the output; the wrapper routes 'ablate' to 'zero' and equals intervene
    z = intervene(m, UnitEdit(basis, [f], "zero"), batch, p, tgt, where=_at(batch, p))
    assert abs(z["delta"]["logit_diff"]) > 1e-6
    w = feature_intervention(m, h, PROMPT, " Paris", " London", [f], "ablate", intervene_at=[p])
    assert w["delta_logit"] == z["delta"]["logit_diff"] and w["delta_prob"] == z["delta"]["target_prob"]


def test_sae_bad_inputs_name_the_field(tiny_gpt2, sae_handle):
    from tracekit.errors import SAEError

    m, h = tiny_gpt2, sae_handle
    with pytest.raises(SAEError, match="features: feature 4800 out of range"):
        feature_intervention(m, h, PROMPT, " Paris", None, [4800], "zero")
    with pytest.raises(SAEError, match="mode: 'erase' is not one of"):
        feature_intervention(m, h, PROMPT, " Paris", None, [1], "erase")
    with pytest.raises(SAEError, match="means: verb 'mean' needs"):
        feature_intervention(m, h, PROMPT, " Paris", None, [1], "mean")


@pytest.mark.parametrize("basis_kind", ["neuron", "sae"])
def test_intervene_hooks_are_removed_whatever_is_raised(tiny_gpt2, sae_handle, monkeypatch, basis_kind):
    m = tiny_gpt2
    basis = NeuronBasis(m, 1) if basis_kind == "neuron" else SAEBasis(sae_handle)
    batch, p, tgt = _setup(m)
    before = m(batch.tokens).clone()
    n_hooks = sum(len(hp.fwd_hooks) for hp in m.hook_dict.values())

    def boom(*a, **k):
        raise RuntimeError("forced failure inside a hook")

    for name, freeze in (("new_activations", ()), ("_frozen", [hook("final_norm_scale")])):
        with monkeypatch.context() as mp:
            mp.setattr(U, name, boom)
            with pytest.raises(RuntimeError, match="forced failure"):
                intervene(m, UnitEdit(basis, [1], "zero"), batch, p, tgt, freeze=freeze)
        assert sum(len(hp.fwd_hooks) for hp in m.hook_dict.values()) == n_hooks
        assert torch.equal(m(batch.tokens), before)


def test_readouts_over_bases_equal_the_wrappers(tiny_gpt2, sae_handle):
    m, h = tiny_gpt2, sae_handle
    v = vocab_readout(m, NeuronBasis(m, 2), [5], 6, signs=[-1])
    w = value_readout(m, 2, 5, k=6, sign=-1)
    assert v["token_id"].tolist() == w["token_id"].tolist() and v["score"].tolist() == w["logit_per_activation"].tolist()
    dv = decoder_vocab(m, h, [3, 4], 5)
    sv = vocab_readout(m, SAEBasis(h), [3, 4], 5)
    assert dv["logit"].tolist() == sv["score"].tolist() and dv["feature"].tolist() == sv["unit"].tolist()


def test_top_contexts_mix_bases_and_ignore_batching(tiny_gpt2, sae_handle):
    """One pass over neurons of two layers and SAE features equals separate passes, whatever the batching."""
    from tracekit.sae import eval_windows

    m, h = tiny_gpt2, sae_handle
    wins = eval_windows(m, h, "stdlib", 400, 24)

    def batches(bs):
        for s in range(0, len(wins), bs):
            b = pad_ids(m, wins[s:s + bs])
            valid = b.attention_mask.bool().cpu().clone()
            valid[:, 0] = False
            yield b, list(range(s, s + b.size)), valid

    reads = [(NeuronBasis(m, 0), 4), (SAEBasis(h), 7), (NeuronBasis(m, 2), 1), (SAEBasis(h), 2)]
    both = top_contexts(m, reads, batches(5), top_n=3, signs=[1, 1, -1, 1])
    for j, r in enumerate(reads):
        alone = top_contexts(m, [r], batches(2), top_n=3, signs=[[1, 1, -1, 1][j]])
        assert [x[1:] for x in both.ranked(j)] == [x[1:] for x in alone.ranked(0)]  # windows, positions
        assert [x[0] for x in both.ranked(j)] == pytest.approx([x[0] for x in alone.ranked(0)], abs=1e-5)
        assert float(both.sums[j]) == pytest.approx(float(alone.sums[0]), abs=1e-6)
    assert both.count == alone.count > 100 and both.n_windows == len(wins)


def test_sae_contexts_are_positive_and_ranked(tiny_gpt2, sae_handle):
    from tracekit.sae import eval_windows

    m, h = tiny_gpt2, sae_handle
    wins = eval_windows(m, h, "stdlib", 400, 24)
    a, hist = top_activating_contexts(m, h, [1, 2, 3], wins, top_n=4, batch_size=3)
    b, _ = top_activating_contexts(m, h, [1, 2, 3], wins, top_n=4, batch_size=16)
    cols = ["feature", "rank", "window", "position", "token", "context", "tokens"]
    assert len(a) and a[cols].equals(b[cols])
    assert a["activation"].tolist() == pytest.approx(b["activation"].tolist(), abs=1e-5)
    for f, g in a.groupby("feature"):
        acts = g.sort_values("rank")["activation"].to_numpy()
        assert (acts > 0).all() and (acts[:-1] >= acts[1:]).all()
        assert len(hist[f]) and (hist[f] > 0).all()
