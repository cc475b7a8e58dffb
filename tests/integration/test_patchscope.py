"""Invariants of Patchscopes (:mod:`tracekit.lenses.patchscope`) and its kind, on the tiny perturbed
GPT-2 / Llama (GQA) / tied Llama models, weight processing on and off:

* source = target prompt, same hidden state, same position: the patch is a no-op, so the readout is
  the source run's own output, for every hidden state 0..n_layers;
* the batched replay equals an unbatched reference (one plain forward and one hook per patch), also
  with another target prompt, position and a fixed target hidden state; greedy generation with the
  patch in place equals a reference generation loop token for token;
* target hidden state n_layers (at the target's last token) is the logit lens of the source state;
* hooks are removed after an error raised mid-run; bad inputs are refused naming the argument.

Tolerances are absolute: 1e-5 nats on log-probabilities of O(1)-logit float32 models (replayed blocks
and a full forward sum in different orders; observed differences ~2e-6).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from pydantic import ValidationError

import tracekit.lenses.patchscope as ps
from helpers import make_perturbed
from tracekit.core.errors import ConfigError, MethodRefused, PatchingError, TokenizationError
from tracekit.experiments.patchscope import Patchscope
from tracekit.lenses.patchscope import IDENTITY_PROMPT, patchscope, patchscope_lens_log_probs
from tracekit.model.readout import Readout
from tracekit.patching.engine import CachedRun
from tracekit.tokens import encode

ATOL = 1e-5
SOURCE = "The capital of France is Paris and"


def _states(model, ids):
    """Every hidden state of ``ids`` ``[n_layers + 1, pos, d]``, from one plain run_with_cache."""
    n = model.cfg.n_layers
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{L}.hook_resid_post" for L in range(n)]
    _, cache = model.run_with_cache(torch.tensor([ids]), names_filter=lambda nm: nm in names)
    return torch.stack([cache[nm][0] for nm in names])


def _ref_generate(model, target, th, tp, vec, g):
    """Reference: a token-by-token greedy loop, one plain forward per token with one torch forward hook
    writing ``vec`` at hidden state ``th``, position ``tp`` (>= 0). Returns (first-step log-probs, tokens)."""
    n = model.cfg.n_layers
    name = f"blocks.{n - 1}.hook_resid_post" if th == n else f"blocks.{th}.hook_resid_pre"

    def fn(mod, inputs, out):
        out = out.clone()
        out[:, tp] = vec
        return out

    handle = model.hook_dict[name].register_forward_hook(fn)
    toks, first = list(target), None
    try:
        for _ in range(max(g, 1)):
            lp = torch.log_softmax(model(torch.tensor([toks]))[0, -1].float(), -1)
            first = lp if first is None else first
            toks.append(int(lp.argmax()))
    finally:
        handle.remove()
    assert first is not None
    return first, toks[len(target):len(target) + g]


def test_same_prompt_reproduces_source_run(perturbed_model):
    m = perturbed_model
    n = m.cfg.n_layers
    ids = encode(m, SOURCE)
    own = torch.log_softmax(m(torch.tensor([ids]))[0, -1].float(), -1)
    hs = list(range(n + 1))
    for p in (-1, 3):  # the last token (the patched token is read) and an earlier one (a no-op run too)
        out = patchscope(m, ids, [p], hs, target_ids=ids, target_position=p, n_generate=0, log_probs=True)
        assert out.log_probs is not None
        err = (out.log_probs[:, 0] - own).abs().max().item()
        assert err < ATOL, (p, err)
        assert out.topk_probs[:, 0, 0].sub(own.exp().max()).abs().max() < ATOL
    # not vacuous: another prompt's state does change the output
    other = patchscope_lens_log_probs(m, encode(m, "Hello world"), [-1], [n], target=ids)
    assert (other[0, 0] - own).abs().max() > 1e-2


def test_batched_equals_unbatched_reference(perturbed_model):
    """Every hidden state into the identity prompt's last token (the default Patchscope)."""
    _check_against_reference(perturbed_model, None, -1, None, list(range(perturbed_model.cfg.n_layers + 1)), [-1])


def test_other_target_position_and_fixed_hidden_state():
    """Another target text, an earlier target position, one target hidden state for all (GQA Llama)."""
    m = make_perturbed("llama", process_weights=False)
    n = m.cfg.n_layers
    _check_against_reference(m, "A B C D E F", 3, 1, [n, 0, 2], [1, -2])


def _check_against_reference(m, target, tp, th, hs, pos):
    g = 3
    src = encode(m, SOURCE)
    states = _states(m, src)
    out = patchscope(m, src, pos, hs, target_ids=target, target_hidden_state=th, target_position=tp, top_k=5,
                     n_generate=g, batch_size=3, log_probs=True)
    assert out.log_probs is not None
    tgt = encode(m, IDENTITY_PROMPT if target is None else target)
    tp = tp % len(tgt)  # the patched token stays where it is while generated tokens are appended
    assert out.target_ids == tgt and out.target_position == tp
    plain = torch.log_softmax(m(torch.tensor([tgt]))[0, -1].float(), -1)
    moved = 0.0
    for i, h in enumerate(hs):
        for j, p in enumerate(pos):
            ref, gen = _ref_generate(m, tgt, h if th is None else th, tp, states[h, p], g)
            assert (out.log_probs[i, j] - ref).abs().max().item() < ATOL, (h, p)
            assert torch.equal(out.topk_ids[i, j], ref.topk(5).indices)
            assert out.generated[i, j].tolist() == gen, (h, p)
            moved = max(moved, (ref - plain).abs().max().item())
    assert moved > 1e-2  # the patches change the target's output (the comparison is not of unpatched runs)


def test_last_hidden_state_is_the_logit_lens(perturbed_model):
    m = perturbed_model
    n = m.cfg.n_layers
    src = encode(m, SOURCE)
    hs, pos = list(range(n + 1)), [-1, 1]
    out = patchscope(m, src, pos, hs, target_hidden_state=n, n_generate=0, log_probs=True)
    assert out.log_probs is not None
    readout = Readout(m)
    states = _states(m, src)
    for i, h in enumerate(hs):
        for j, p in enumerate(pos):
            lens = readout.log_probs(states[h, p]).float()
            assert (out.log_probs[i, j] - lens).abs().max().item() < ATOL, (h, p)


def _hooks(model):
    out = []
    for mod in model.modules():
        out.append((len(mod._forward_hooks), len(mod._forward_pre_hooks), len(getattr(mod, "fwd_hooks", []) or [])))
    return out


def test_hooks_removed_after_error(tiny_llama, monkeypatch):
    m = tiny_llama
    ids = encode(m, SOURCE)
    before = _hooks(m)

    def boom(*a, **k):
        raise RuntimeError("boom mid-generation")

    with monkeypatch.context() as mp:  # raised inside a generation forward (hooks on the model)
        mp.setattr(ps, "_patch_hook", boom)
        with pytest.raises(RuntimeError, match="boom"):
            patchscope(m, ids, [-1], [0, 1, 2], n_generate=3)
    assert _hooks(m) == before

    def pre_boom(mod, args):  # raised inside the target run's caching forward (cache_run's hooks on)
        raise RuntimeError("boom in cache_run")

    h = m.blocks[1].register_forward_pre_hook(pre_boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            patchscope(m, ids, [-1], [0, 1], n_generate=0)
    finally:
        h.remove()
    assert _hooks(m) == before
    out = patchscope(m, ids, [-1], [1], n_generate=2)  # the model still works
    assert out.generated.shape == (1, 1, 2)


def test_bad_inputs_are_refused(tiny_gpt2, monkeypatch):
    m = tiny_gpt2
    n = m.cfg.n_layers
    ids = encode(m, SOURCE)
    with pytest.raises(PatchingError, match=r"source_hidden_states\[1\].*out of range"):
        patchscope(m, ids, [-1], [0, n + 1])
    with pytest.raises(PatchingError, match=r"source_hidden_states\[0\]"):
        patchscope(m, ids, [-1], [-1])
    with pytest.raises(PatchingError, match="target_hidden_state"):
        patchscope(m, ids, [-1], [1], target_hidden_state=n + 1)
    with pytest.raises(TokenizationError, match=r"source_positions\[0\].*out of range"):
        patchscope(m, ids, [len(ids)], [1])
    with pytest.raises(TokenizationError, match="target_position"):
        patchscope(m, ids, [-1], [1], target_position=99)
    with pytest.raises(TokenizationError, match="target_ids"):
        patchscope(m, ids, [-1], [1], target_ids=[int(m.cfg.d_vocab)])
    with pytest.raises(PatchingError, match="top_k"):
        patchscope(m, ids, [-1], [1], top_k=0)
    with pytest.raises(PatchingError, match="n_generate"):
        patchscope(m, ids, [-1], [1], n_generate=-1)
    monkeypatch.setattr(CachedRun, "varying_inputs", lambda self, a, b: ["block 0 per_layer_input"])
    with pytest.raises(MethodRefused, match="bypass the residual stream"):
        patchscope(m, ids, [-1], [1])


def test_kind_tables_summary_and_reload(tiny_gpt2, tmp_path):
    m = tiny_gpt2
    n = m.cfg.n_layers
    cfg = {"prompts": ["The capital of France is", "Hello world"], "target": [" Paris", " the"], "n_generate": 2,
           "top_k": 3}
    res = Patchscope(**cfg).run(m, progress=False)
    main = res.tables["main"]
    assert len(main) == 2 * (n + 1) and len(res.tables["top_tokens"]) == 2 * (n + 1) * 3
    for pi, (prompt, tgt) in enumerate(zip(cfg["prompts"], cfg["target"])):  # the kind reports the engine's numbers
        ids = encode(m, prompt)
        lp = patchscope_lens_log_probs(m, ids, [-1], list(range(n + 1)))[:, 0]
        tid = encode(m, tgt, prepend_bos=False)[0]
        g = pd.DataFrame(main[main["prompt_idx"] == pi]).sort_values(by="hidden_state")
        assert abs(g["target_prob"].to_numpy() - lp[:, tid].exp().numpy()).max() < ATOL
        ranks = (lp > lp[:, tid:tid + 1]).sum(-1) + 1
        assert g["target_rank"].tolist() == ranks.tolist()
        top1 = [h for h, r in zip(g["hidden_state"], g["target_rank"]) if r == 1]
        assert res.summary()["first_top1_hidden_state_by_row"][pi] == (top1[0] if top1 else None)
        assert all(len(x) == 2 for x in g["generated_ids"])
    s = res.summary()
    assert s["hidden_states"] == list(range(n + 1)) and len(s["generated_by_row"][1]) == n + 1
    res.save(tmp_path / "r")
    back = type(res).load(tmp_path / "r")
    assert back.summary() == s
    assert {"target_by_hidden_state", "top1_grid"} <= {p.stem for p in (tmp_path / "r").glob("*.png")}


def test_kind_named_position_and_fixed_target_layer(tiny_llama):
    m = tiny_llama
    prompt = "The capital of France is"
    ds = {"rows": [{"prompt": prompt, "target": " France", "positions": {"SUBJ": " France"}}]}
    res = Patchscope.model_validate({"dataset": ds, "position": "SUBJ", "hidden_states": [0, 2], "target_hidden_state": 1,
                                     "n_generate": 0, "target_prompt": "x y z", "target_position": 1}
                                    ).run(m, progress=False)
    row = res.tables["rows"].iloc[0]
    ids = encode(m, prompt)
    assert row["position"] == row["pos_SUBJ"] and row["token"] == " France"
    out = patchscope(m, ids, [int(row["position"])], [0, 2], target_ids="x y z", target_hidden_state=1,
                     target_position=1, n_generate=0, top_k=10)
    assert res.tables["main"]["top1_id"].tolist() == out.topk_ids[:, 0, 0].tolist()
    assert res.tables["main"]["target_hidden_state"].tolist() == [1, 1]
    s = res.summary()
    assert s["target"] == " France" and len(s["target_prob_by_hidden_state"]) == 2
    assert s["generated_by_hidden_state"] == ["", ""]


def test_kind_bad_config(tiny_gpt2):
    m = tiny_gpt2
    n = m.cfg.n_layers
    with pytest.raises(PatchingError, match=r"hidden_states\[1\]"):
        Patchscope(prompts=["a b"], hidden_states=[0, n + 1]).check(m)
    with pytest.raises(PatchingError, match="target_hidden_state"):
        Patchscope(prompts=["a b"], target_hidden_state=n + 1).check(m)
    with pytest.raises(TokenizationError, match="target_position"):
        Patchscope(prompts=["a b"], target_position=50).check(m)
    with pytest.raises(ValidationError, match="hidden_states"):
        Patchscope(prompts=["a b"], hidden_states=[])
    with pytest.raises(ValidationError, match="target/foil beside a dataset"):
        Patchscope.model_validate({"dataset": {"rows": [{"prompt": "a b"}]}, "target": " b"})
    with pytest.raises(ValidationError, match="n_generate"):
        Patchscope(prompts=["a b"], n_generate=-1)


def test_generation_past_the_context_is_refused(tiny_gpt2):
    """Generating g tokens after a target of n runs n + g - 1 positions at the last step: exactly the
    context works, one more is a ConfigError naming n_generate and the largest that fits (before the
    source pass; on GPT-2 it was an IndexError after the distribution was computed)."""
    m = tiny_gpt2
    n_ctx = int(m.cfg.n_ctx)
    ids = encode(m, SOURCE)
    tgt = [int(t) for t in torch.randint(100, 1000, (122,), generator=torch.Generator().manual_seed(0))]
    room = n_ctx - len(tgt) + 1
    out = patchscope(m, ids, [-1], [1], target_ids=tgt, n_generate=room, batch_size=1)
    assert out.generated.shape == (1, 1, room)
    with pytest.raises(ConfigError, match=rf"^n_generate: target_ids \(122 tokens\) then {room + 1} generated tokens "
                                          rf"need {n_ctx + 1} positions, more than model 'gpt2''s context of {n_ctx} "
                                          rf"tokens .*set n_generate to at most {room} or shorten target_ids$"):
        patchscope(m, ids, [-1], [1], target_ids=tgt, n_generate=room + 1)


def test_kind_refuses_generation_past_the_context_at_check(tiny_gpt2):
    m = tiny_gpt2
    target = "cat" + " cat" * 110
    n = len(encode(m, target))
    room = int(m.cfg.n_ctx) - n + 1
    assert 1 <= room < 64
    Patchscope(prompts=["a b"], target_prompt=target, n_generate=room).check(m)
    with pytest.raises(ConfigError, match=rf"^n_generate: target_prompt \({n} tokens\) then {room + 1} generated .*"
                                          rf"at most {room} or shorten target_prompt$"):
        Patchscope(prompts=["a b"], target_prompt=target, n_generate=room + 1).check(m)
