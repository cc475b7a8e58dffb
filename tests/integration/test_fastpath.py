"""tracekit.fastpath: residual reads narrowed to the read positions, ending the forward pass early,
and the batched lens readout; same numbers as run_with_cache + Readout (perturbed models)."""

from __future__ import annotations

import pytest
import torch

import tracekit as tk
from tracekit.errors import HookError
from tracekit.fastpath import lens_readout, residual_stream
from tracekit.model.readout import Readout
from tracekit.tokens import run_with_cache, tokenize

PROMPTS = ["The capital of China is Beijing. The capital of France is", "The capital of Italy is", "Hello"]
TARGETS = [" Paris", " Rome"]


def _names(model) -> list[str]:
    L = model.cfg.n_layers
    return ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(L)]


def _n_hooks(model) -> int:
    return sum(len(getattr(m, "fwd_hooks", []) or []) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("which", ["all", "last", "two"])
def test_residual_stream_is_run_with_cache_at_the_read_positions(perturbed_model, which):
    model = perturbed_model
    names = _names(model)
    batch = tokenize(model, PROMPTS)  # padded: prompts of different lengths
    _, cache = run_with_cache(model, batch, names)
    full = torch.stack([cache[n] for n in names])  # [hook, batch, pos, d]
    rows = torch.arange(batch.size)
    before = _n_hooks(model)
    if which == "all":
        got = residual_stream(model, batch, names)
        want = full
    elif which == "last":
        got = residual_stream(model, batch, names, positions=batch.last)
        want = full[:, rows, batch.last]
    else:
        pos = torch.stack([torch.zeros_like(batch.last), batch.last], 1)  # [batch, 2]
        got = residual_stream(model, batch, names, positions=pos)
        want = full[:, rows[:, None], pos]
    assert got.shape == want.shape
    assert torch.equal(got, want)  # the same tensors, bit for bit
    assert _n_hooks(model) == before, "hooks left on the model"
    # a subset, in the caller's order, without stopping early: identical too
    sub = [names[-1], names[1]]
    assert torch.equal(residual_stream(model, batch, sub, positions=batch.last, stop_early=False),
                       full[[len(names) - 1, 1]][:, rows, batch.last])


def test_residual_stream_refuses_unknown_hooks(tiny_gpt2):
    batch = tokenize(tiny_gpt2, PROMPTS)
    with pytest.raises(HookError):
        residual_stream(tiny_gpt2, batch, ["blocks.0.hook_resid_mid_typo"])


def test_lens_readout_matches_readout_and_the_lens(perturbed_model):
    model = perturbed_model
    names = _names(model)
    batch = tokenize(model, PROMPTS)
    resid = residual_stream(model, batch, names, positions=batch.last)  # [L+1, b, d]
    tids = [tk.tokens.single_token_id(model, t) for t in TARGETS]
    r = lens_readout(model, resid, target_ids=tids, top_k=5, chunk_rows=4)  # several chunks
    lp = Readout(model).log_probs(resid)
    assert torch.equal(r["target_log_prob"], lp[..., tids])
    assert torch.equal(r["target_rank"], (lp.unsqueeze(-1) > lp[..., tids].unsqueeze(-2)).sum(-2) + 1)
    torch.testing.assert_close(r["entropy"], -(lp.exp() * lp).sum(-1), atol=1e-5, rtol=0)
    tp, ti = lp.exp().topk(5, -1)
    assert torch.equal(r["top_prob"], tp) and torch.equal(r["top_id"], ti)
    # the logit lens' own table (last position, hidden_states): same numbers
    res = tk.LogitLens(prompts=PROMPTS, track=TARGETS, top_k=5).run(model, progress=False)
    m = res.tables["tracked"].sort_values(["row_id", "hidden_state", "tracked_token"], key=lambda s: s.map(
        {t: i for i, t in enumerate(TARGETS)}) if s.name == "tracked_token" else s)
    lens_lp = torch.tensor(m["log_prob"].to_numpy(), dtype=torch.float32).reshape(len(PROMPTS), len(names), 2)
    torch.testing.assert_close(lens_lp, r["target_log_prob"].permute(1, 0, 2), atol=1e-5, rtol=0)
    lens_rank = torch.tensor(m["vocab_rank"].to_numpy()).reshape(len(PROMPTS), len(names), 2)
    assert torch.equal(lens_rank, r["target_rank"].permute(1, 0, 2))
    # the last hidden state's readout is the model's output distribution
    with torch.no_grad():
        out = model(batch.tokens, **tk.tokens.forward_kwargs(batch)).float().log_softmax(-1)
    final = out[torch.arange(batch.size), batch.last][:, tids]
    torch.testing.assert_close(r["target_log_prob"][-1], final, atol=1e-5, rtol=0)
