"""Invariants of causal tracing (:mod:`tracekit.causal_tracing`, kind ``causal_tracing``), on tiny
perturbed models (GPT-2 / GQA Llama / tied Llama, weight processing on and off):

* the batched, layer-skipping replays equal an unbatched reference (one plain forward pass per
  (kind, layer, position, noise draw) with a noise hook on ``blocks.0.hook_resid_pre`` and restore
  hooks on ``hook_resid_post`` / ``hook_mlp_out`` / ``hook_attn_out``), windows included;
* zero noise gives zero indirect effect; restoring the residual stream at every position of any
  layer, or at the last position of the last layer, gives the clean run;
* the same seed gives the same numbers; positions before the subject are exactly the corrupted run;
* hooks are removed when a run raises; bad inputs give errors naming the field.

Tolerances are absolute. The tiny models spread their next-token distribution over 50k tokens
(``p ~ 1e-4``), so probabilities are compared as natural-log probabilities (``log p``; float32
logits of O(1) round at ~1e-6, batched rows differ from unbatched ones by ~1e-6), and every
comparison first checks that the compared effects are far larger than the tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from helpers import hook_keys, make_perturbed
from tracekit.causal_tracing import (
    CATEGORIES,
    Restoration,
    causal_trace,
    embedding_std,
    noise_scale,
    subject_noise,
    subject_span,
    table_subjects,
    token_categories,
    trace_restorations,
    window_layers,
)
from tracekit.core.errors import ConfigError, TokenizationError
from tracekit.experiments.causal_tracing import CausalTracing
from tracekit.hooks import fwd_hooks
from tracekit.tokens import encode

PROMPT = "The capital of France is in the"
SUBJECT = " capital of France"  # three tokens: first, middle and last subject tokens
#: log-probability tolerance (nats): batched vs unbatched float32 rounding is ~1e-6.
LOG_ATOL = 2e-5
SITE = {"resid": "hook_resid_post", "mlp": "hook_mlp_out", "attn": "hook_attn_out"}


def _setup(model):
    ids = encode(model, PROMPT)
    return ids, subject_span(model, PROMPT, SUBJECT, ids)


def _reference(model, ids, subj, target, kind, layers, positions, noise_row, clean):
    """p(target) of one plain forward pass: noise on blocks.0.hook_resid_pre, clean states (from the
    clean run's cache ``clean``) restored at ``layers`` x ``positions``."""
    toks = torch.tensor([ids])

    def add_noise(act, hook):
        act = act.clone()
        act[0, list(subj)] += noise_row.to(act.dtype)
        return act

    hooks = [("blocks.0.hook_resid_pre", add_noise)]
    for L in layers:
        name = f"blocks.{L}.{SITE[kind]}"

        def restore(act, hook, name=name):
            act = act.clone()
            act[0, list(positions)] = clean[name][0, list(positions)]
            return act

        hooks.append((name, restore))
    with fwd_hooks(model, hooks):
        logits = model(toks)[0, -1]
    return float(torch.softmax(logits.float(), -1)[target])


def test_window_layers_is_romes():
    # ROME: range(max(0, layer - window // 2), min(num_layers, layer - (-window // 2)))
    assert window_layers(12, 10, 30) == tuple(range(7, 17))
    assert window_layers(0, 10, 30) == tuple(range(0, 5))
    assert window_layers(29, 10, 30) == tuple(range(24, 30))
    assert window_layers(5, 1, 30) == (5,)
    assert window_layers(5, 2, 30) == (4, 5)
    assert window_layers(5, 3, 30) == (4, 5, 6)
    with pytest.raises(ConfigError, match="window"):
        window_layers(3, 0, 30)


def test_subject_span_and_categories(tiny_gpt2):
    ids, subj = _setup(tiny_gpt2)
    toks = tiny_gpt2.to_str_tokens(torch.tensor(ids))
    assert "".join(toks[p] for p in subj) == SUBJECT
    assert subject_span(tiny_gpt2, PROMPT, "France", ids) == (max(subj),)  # part of a token: that token
    cats = token_categories(len(ids), subj)
    assert list(cats) == list(CATEGORIES)
    first, last = min(subj), max(subj)
    assert cats["first subject token"] == [first] and cats["last subject token"] == [last]
    assert cats["middle subject tokens"] == list(range(first + 1, last))
    assert cats["first subsequent token"] == [last + 1] and cats["last token"] == [len(ids) - 1]
    assert cats["further tokens"] == list(range(last + 2, len(ids) - 1))
    with pytest.raises(TokenizationError, match="subject.*Italy"):
        subject_span(tiny_gpt2, PROMPT, "Italy", ids)


#: GPT-2 with processed weights, GQA Llama raw, tied-embedding Llama processed (a third of the fixture's grid, for time).
REFERENCE_MODELS = [("gpt2", False, True), ("llama", False, False), ("llama", True, True)]


@pytest.mark.parametrize("arch,tied,pw", REFERENCE_MODELS, ids=["gpt2-processed", "llama-raw", "llama-tied-processed"])
def test_matches_unbatched_reference(arch, tied, pw):
    model = make_perturbed(arch, process_weights=pw, tied=tied)
    ids, subj = _setup(model)
    n_samples, std, window = 2, 1.0, 2
    tr = causal_trace(model, ids, subj, window=window, noise_std=std, n_samples=n_samples, seed=3, batch_size=16)
    noise = subject_noise(n_samples, len(subj), model.cfg.d_model, std, 3)
    _, clean = model.run_with_cache(torch.tensor([ids]))
    n_layers = model.cfg.n_layers
    got, want = [], []
    # one position before the subject (not replayed), the first subject token, the last token; the
    # noise draw alternates over the grid (both draws are checked, each cell once, for time)
    positions = sorted({min(subj) - 1, min(subj), len(ids) - 1})
    for ki, kind in enumerate(tr.kinds):
        for L in range(n_layers):
            layers = (L,) if kind == "resid" else window_layers(L, window, n_layers)
            for j, p in enumerate(positions):
                s = (ki + L + j) % n_samples
                want.append(_reference(model, ids, subj, tr.target_id, kind, layers, [p], noise[s], clean))
                got.append(float(tr.p_restored_by_sample[ki, L, p, s]))
    got_t, want_t = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    assert float((got_t.log() - want_t.log()).abs().max()) <= LOG_ATOL
    assert float((got_t - want_t).abs().max()) <= 1e-5
    # the effects compared are real: restorations move log p by far more than the tolerance
    assert float(want_t.log().max() - want_t.log().min()) > 100 * LOG_ATOL
    # p_corrupted is the reference with nothing restored, p_clean the clean run
    for s in range(n_samples):
        ref = _reference(model, ids, subj, tr.target_id, "resid", (), [], noise[s], clean)
        assert abs(float(tr.p_corrupted_by_sample[s].double().log()) - torch.tensor(ref).double().log()) <= LOG_ATOL
    ref_clean = float(torch.softmax(model(torch.tensor([ids]))[0, -1].float(), -1)[tr.target_id])
    assert abs(torch.tensor(tr.p_clean).double().log() - torch.tensor(ref_clean).double().log()) <= LOG_ATOL


def test_zero_noise_gives_zero_effect(tiny_llama):
    ids, subj = _setup(tiny_llama)
    for skip in (True, False):
        tr = causal_trace(tiny_llama, ids, subj, window=2, noise_std=0.0, n_samples=2, skip_prefix=skip)
        assert float(tr.indirect_effect.abs().max()) <= 1e-6
        # relative to the scale of p: log p restored = log p corrupted = log p clean
        assert float((tr.p_restored_by_sample.log() - tr.p_corrupted_by_sample.log()).abs().max()) <= LOG_ATOL
        assert abs(tr.total_effect) <= 1e-6 and abs(torch.tensor(tr.p_clean).log() - torch.tensor(tr.p_corrupted).log()) <= LOG_ATOL


def test_restoring_everything_gives_the_clean_run(perturbed_model):
    model = perturbed_model
    ids, subj = _setup(model)
    n = model.cfg.n_layers
    everywhere = tuple(range(len(ids)))
    rests = [Restoration("resid", (L,), everywhere) for L in range(n)]
    rests += [Restoration("resid", (n - 1,), (len(ids) - 1,))]  # the last layer at the read position
    rp = trace_restorations(model, ids, subj, rests, noise_std=2.0, n_samples=3, seed=1)
    clean = torch.tensor(rp.p_clean, dtype=torch.float64).log()
    assert float((rp.p_corrupted.double().log() - clean).abs().max()) > 100 * LOG_ATOL  # the noise matters
    assert float((rp.p_restored.double().log() - clean).abs().max()) <= LOG_ATOL
    assert float((rp.p_restored - rp.p_clean).abs().max()) <= 1e-5
    # and through causal_trace: the residual stream at the last layer and the last position
    tr = causal_trace(model, ids, subj, kinds=("resid",), noise_std=2.0, n_samples=2)
    assert abs(float(tr.p_restored[0, n - 1, len(ids) - 1]) - tr.p_clean) <= 1e-5 * max(tr.p_clean, 1e-3)


def test_seeds_and_prefix(tiny_gpt2):
    ids, subj = _setup(tiny_gpt2)
    kw: dict[str, Any] = dict(kinds=("resid", "mlp"), window=2, noise_std=1.0, n_samples=2, seed=5)
    a = causal_trace(tiny_gpt2, ids, subj, batch_size=5, **kw)
    b = causal_trace(tiny_gpt2, ids, subj, batch_size=64, **kw)
    assert torch.allclose(a.p_restored_by_sample, b.p_restored_by_sample, rtol=1e-5, atol=0)  # batching: rounding only
    assert torch.equal(a.p_corrupted_by_sample, b.p_corrupted_by_sample)
    again = trace_restorations(tiny_gpt2, ids, subj, [], noise_std=1.0, n_samples=2, seed=5)
    other = trace_restorations(tiny_gpt2, ids, subj, [], noise_std=1.0, n_samples=2, seed=6)
    assert torch.equal(again.p_corrupted, a.p_corrupted_by_sample)
    assert not torch.equal(other.p_corrupted, a.p_corrupted_by_sample)
    # positions before the subject: not replayed, exactly the corrupted run; replaying them agrees
    first = min(subj)
    assert not bool(a.replayed[:, :, :first].any()) and bool(a.replayed[:, :, first:].all())
    assert torch.equal(a.p_restored_by_sample[:, :, :first], a.p_corrupted_by_sample.expand_as(
        a.p_restored_by_sample[:, :, :first]))
    full = causal_trace(tiny_gpt2, ids, subj, batch_size=64, skip_prefix=False, **kw)
    assert bool(full.replayed.all())
    assert float((full.p_restored_by_sample.log() - a.p_restored_by_sample.log()).abs().max()) <= LOG_ATOL


def test_embedding_std_is_the_token_embedding(tiny_gpt2):
    ids, subj = _setup(tiny_gpt2)
    _, cache = tiny_gpt2.run_with_cache(torch.tensor([ids]))
    want = float(cache["hook_embed"][0, list(subj)].float().std())  # GPT-2: position embedding excluded (ROME's wte)
    assert abs(embedding_std(tiny_gpt2, [ids], [subj]) - want) <= 1e-6
    tr = causal_trace(tiny_gpt2, ids, subj, kinds=("resid",), noise=2.0, n_samples=1, noise_calibration="row_subjects")
    assert abs(tr.noise_std - 2.0 * want) <= 1e-6


def test_default_noise_does_not_depend_on_the_prompt(tiny_model):
    """ROME's noise is 3 x the embedding std over a fixed population of subjects (its facts dataset);
    by default tracekit's is over the shipped capitals table's 50 subjects, so one-prompt runs with
    different subjects get the same noise std; ``row_subjects`` pools the step's own subject tokens."""
    model = tiny_model
    base = {"kinds": ["resid"], "n_samples": 1, "window": 1}
    runs = {c: CausalTracing(prompts=[f"The capital of {c} is"], subject=c, **base).run(model, progress=False).summary()
            for c in ("France", "Germany")}
    sf, sg = runs["France"], runs["Germany"]
    assert sf["noise_std"] == sg["noise_std"] and sf["embedding_std"] == sg["embedding_std"]
    assert sf["noise_calibration"] == "subjects_table" and "50 subjects" in sf["embedding_std_over"]
    assert sf["noise"] == 3.0 and abs(sf["noise_std"] - 3.0 * sf["embedding_std"]) <= 1e-12
    # by hand: the token embeddings (as they enter the stream) of ' ' + each table subject, pooled
    names = table_subjects()
    assert len(names) == 50 and names[0] == "France"
    toks = [t for n in names for t in model.tokenizer(" " + n, add_special_tokens=False)["input_ids"]]
    want = float(model.W_E[toks].float().std())  # the token embedding is the stream's start (GPT-2: + positions)
    assert sf["embedding_std_n_tokens"] == len(toks)
    assert abs(sf["embedding_std"] - want) <= 1e-6
    # the step's own subjects: the std of that subject's tokens, another number per subject
    rows = {c: CausalTracing(prompts=[f"The capital of {c} is"], subject=c, noise_calibration="row_subjects",
                             **base).run(model, progress=False).summary() for c in ("France", "Germany")}
    for c, r in rows.items():
        ids = encode(model, f"The capital of {c} is")
        assert abs(r["embedding_std"] - embedding_std(model, [ids], [subject_span(model, f"The capital of {c} is", c, ids)])) <= 1e-7
        assert r["noise_calibration"] == "row_subjects" and "1 prompt" in r["embedding_std_over"]
    assert abs(rows["France"]["noise_std"] - rows["Germany"]["noise_std"]) > 1e-3
    assert noise_scale(model).embedding_std == sf["embedding_std"]
    with pytest.raises(ConfigError, match="noise_calibration"):
        noise_scale(model, "embedding")
    with pytest.raises(ValidationError, match="noise_calibration and noise_std"):
        CausalTracing(prompts=["The capital of France is"], subject="France", noise_calibration="row_subjects",
                      noise_std=0.1)
    absolute = CausalTracing(prompts=["The capital of France is"], subject="France", noise_std=0.25,
                             **base).run(model, progress=False).summary()
    assert absolute["noise_calibration"] == "absolute" and absolute["noise_std"] == 0.25
    assert absolute["embedding_std"] is None and absolute["embedding_std_over"] is None


def test_hooks_removed_after_an_exception():
    model = make_perturbed("llama")
    ids, subj = _setup(model)
    model(torch.tensor([ids]))  # the bridge wires its own capture hooks on a first forward
    before = hook_keys(model)
    logits = model(torch.tensor([ids]))
    calls = []

    def boom(n):
        calls.append(n)
        if len(calls) >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        causal_trace(model, ids, subj, window=2, noise_std=1.0, n_samples=2, batch_size=3, progress=boom)
    assert hook_keys(model) == before
    assert torch.equal(model(torch.tensor([ids])), logits)


def test_bad_inputs(tiny_gpt2):
    ids, subj = _setup(tiny_gpt2)
    with pytest.raises(ConfigError, match="window"):
        causal_trace(tiny_gpt2, ids, subj, window=0)
    with pytest.raises(ConfigError, match="n_samples"):
        causal_trace(tiny_gpt2, ids, subj, n_samples=0)
    with pytest.raises(ConfigError, match="kinds"):
        causal_trace(tiny_gpt2, ids, subj, kinds=("mlp_out",))
    with pytest.raises(ConfigError, match="subject"):
        causal_trace(tiny_gpt2, ids, (len(ids),))
    base = {"prompts": [PROMPT], "subject": "France"}
    for bad, field in (({"window": 0}, "window"), ({"n_samples": 0}, "n_samples"), ({"noise": -1.0}, "noise"),
                       ({"noise": 2.0, "noise_std": 0.1}, "noise_std"), ({"subject": None}, "subject"),
                       ({"subject": ["France", "Paris"]}, "subject"), ({"kinds": ["resid", "resid"]}, "kinds"),
                       ({"target": [" Paris", " Rome"]}, "target")):
        with pytest.raises(ValidationError, match=field):
            CausalTracing(**{**base, **bad})
    with pytest.raises(TokenizationError, match="subject.*'Italy' does not occur"):
        CausalTracing(**{**base, "subject": "Italy"}).check(tiny_gpt2)
    with pytest.raises(ValueError, match="subject.field"):
        CausalTracing(dataset={"generator": {"name": "capitals", "n": 2}}, subject={"field": "capital_city"}).check(
            tiny_gpt2)


def test_kind_tables(tiny_gpt2, tmp_path):
    from tracekit.results import Result

    exp = CausalTracing(dataset={"generator": {"name": "capitals", "n": 3, "few_shot": True}},
                        subject={"field": "country"}, window=2, noise=3.0, n_samples=2, seed=1)
    res = exp.run(tiny_gpt2, progress=False)
    eff, rows, cats = res.tables["effects"], res.tables["rows"], res.tables["categories"]
    n_layers = tiny_gpt2.cfg.n_layers
    assert len(eff) == sum(3 * n_layers * n for n in rows["n_tokens"])
    assert (rows["target_source"] == "given").all()
    # the rows' numbers are the engine's, per row (same seed, same noise std)
    s = res.summary()
    r0 = rows.iloc[0]
    tr = causal_trace(tiny_gpt2, encode(tiny_gpt2, r0["prompt"]), tuple(r0["subject_positions"]), int(r0["target_id"]),
                      window=2, noise_std=s["noise_std"], n_samples=2, seed=1)
    assert abs(tr.p_corrupted - s["p_corrupted_by_row"][0]) <= 1e-7
    e0 = eff[(eff["row_id"] == r0["row_id"]) & (eff["kind"] == "mlp")].sort_values(["layer", "position"])
    assert torch.allclose(torch.tensor(e0["indirect_effect"].to_numpy()), tr.indirect_effect[1].flatten().double(),
                          atol=1e-9)
    # a category cell is the mean over the pooled (row, token) pairs of the effects table
    for cat in ("last subject token", "first subsequent token"):
        want = []
        for _, r in rows.iterrows():
            pos = token_categories(int(r["n_tokens"]), tuple(r["subject_positions"]))[cat]
            e = eff[(eff["row_id"] == r["row_id"]) & (eff["kind"] == "resid") & (eff["layer"] == 1)]
            want += e[e["position"].isin(pos)]["indirect_effect"].tolist()
        got = cats[(cats["kind"] == "resid") & (cats["category"] == cat) & (cats["layer"] == 1)].iloc[0]
        assert int(got["n"]) == len(want) and abs(float(got["mean_indirect_effect"]) - sum(want) / len(want)) <= 1e-12
    assert s["peak_mlp_layer_by_row"][0] == int(r0["peak_mlp_layer"])
    res.save(tmp_path / "r")
    back = Result.load(tmp_path / "r")
    assert back.summary() == s and set(back.figures()) == {"resid", "mlp", "attn"}
    # one row: the per-token heatmaps; a named position with a span equals the subject's text
    one = CausalTracing(prompts=[PROMPT], subject=SUBJECT, kinds=["resid"], n_samples=1).run(tiny_gpt2, progress=False)
    assert one.summary()["target_source_by_row"] == ["top1"]
    ids, subj = _setup(tiny_gpt2)
    spec = CausalTracing(dataset={"rows": [{"prompt": PROMPT, "positions": {"SUBJ": " France"}}]},
                         subject={"position": "SUBJ", "span": len(subj)}, kinds=["resid"], n_samples=1)
    assert spec.check(tiny_gpt2).subjects == (subj,)
    assert set(one.figures()) == {"resid"}
