"""The memory budget on the lens engines (``run.memory_budget``, :mod:`tracekit.core.budget`): under
a budget far below the naive ``[hidden states x positions x vocabulary]`` readout, the logit lens and
the lens-quality table read out in many chunks and give exactly the numbers of the unbudgeted run;
a budget below one unit is refused before the forward pass, naming the setting to change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tracekit
from helpers import make_perturbed, make_tiny
from tracekit.core.errors import MemoryBudgetError
from tracekit.lenses import quality as Q
from tracekit.lenses.train import split_windows
from tracekit.lenses.tuned import TunedLens
from tracekit.logit_lens import logit_lens
from tracekit.model.readout import MIN_READOUT_ROWS, Readout, readout_bytes

PROMPTS = ["The capital of France is", "The capital of Italy was", "A quick brown fox jumps over", "Hello there my"]
FIELDS = ["target_log_prob", "target_rank", "entropy", "topk_ids", "topk_probs", "final_log_prob", "final_rank",
          "final_topk_ids", "final_topk_probs", "foil_log_prob", "final_foil_log_prob", "track_log_prob",
          "track_rank", "final_track_log_prob"]


@pytest.fixture
def readout_calls(monkeypatch):
    """The number of vectors of each ``Readout.log_probs`` call."""
    calls: list[int] = []
    orig = Readout.log_probs

    def spy(self, resid):
        calls.append(int(resid.shape[0]))
        return orig(self, resid)

    monkeypatch.setattr(Readout, "log_probs", spy)
    return calls


@pytest.mark.parametrize("which", ["gpt2", "llama-perturbed-raw"])
def test_logit_lens_chunked_equals_unchunked(which, readout_calls):
    model = make_tiny("gpt2") if which == "gpt2" else make_perturbed("llama", process_weights=False)
    kw: dict[str, Any] = dict(targets=" Paris", foils=" Rome", track=[" the", " of"], position="all", top_k=5,
                              batch_size=8)
    full = logit_lens(model, PROMPTS, **kw)
    n_vectors = max(readout_calls)  # unbudgeted: one readout of every (hidden state, position)
    naive = n_vectors * readout_bytes(model)
    readout_calls.clear()
    with tracekit.memory_budget("8MiB"):  # ~ one group of 4 vectors; the naive readout is ~17x more
        small = logit_lens(model, PROMPTS, **kw)
    assert naive > 16 * 8 * 1024**2
    assert len(readout_calls) >= 20 and max(readout_calls) == MIN_READOUT_ROWS
    for a, b in zip(full, small):
        for f in FIELDS:
            x, y = getattr(a, f), getattr(b, f)
            assert torch.equal(x, y) or (x.isnan() == y.isnan()).all() and torch.equal(x.nan_to_num(), y.nan_to_num()), f


def test_logit_lens_remainder_chunk_is_exact(readout_calls):
    """A last chunk shorter than MIN_READOUT_ROWS is padded: 4 hidden states x 7 positions = 28
    vectors, and a 1-vector remainder under a cap of 27."""
    from tracekit import logit_lens as L

    model = make_perturbed("gpt2", process_weights=True)
    full = L.logit_lens(model, PROMPTS[2:3], targets=" Paris", position="all")
    resid = torch.randn(29, int(model.cfg.d_model))
    tgt = torch.full((29,), 5)
    a = L._readout(model, resid, tgt, tgt, [7], 3)
    b = L._readout(model, resid, tgt, tgt, [7], 3, chunk_rows=4)  # 7 chunks of 4 and a remainder of 1
    for k in a:
        assert torch.equal(a[k].nan_to_num(), b[k].nan_to_num()), k
    assert full[0].target_log_prob.shape[1] == 7


def test_logit_lens_batch_cap_under_budget():
    """A budget below the forward pass of the whole batch runs smaller batches. Rows padded less
    are a different float32 computation (another matmul shape and padding), so the numbers agree to
    rounding, not bits: atol 1e-5 on log-probabilities of O(10) magnitude."""
    model = make_perturbed("llama", process_weights=False)
    from tracekit.logit_lens import lens_batch_size

    ids = [[1] * 40] * 4
    with tracekit.memory_budget("5MiB"):
        assert lens_batch_size(model, ids, [list(range(40))] * 4, 4, 8) < 4
    full = logit_lens(model, PROMPTS, targets=" Paris", position="all", batch_size=8)
    with tracekit.memory_budget("4800KiB"):
        small = logit_lens(model, PROMPTS, targets=" Paris", position="all", batch_size=8)
    for a, b in zip(full, small):
        torch.testing.assert_close(a.target_log_prob, b.target_log_prob, atol=1e-5, rtol=0)


def test_refusal_names_the_setting_before_the_forward(monkeypatch):
    model = make_tiny("gpt2")
    import tracekit.fastpath as fp

    def boom(*a, **k):
        raise AssertionError("the forward pass ran")

    monkeypatch.setattr(fp, "residual_stream", boom)
    with tracekit.memory_budget("64KiB"), pytest.raises(MemoryBudgetError) as e:
        logit_lens(model, PROMPTS, targets=" Paris", position="all")
    msg = str(e.value)
    assert "logit lens" in msg and "run.memory_budget" in msg and "64KiB" in msg and "positions" in msg


def test_quality_table_chunked_equals_unchunked(readout_calls):
    model = make_perturbed("llama", process_weights=False)
    wins = split_windows(model, "stdlib", "held_out", 120, 24)
    torch.manual_seed(3)
    tl = TunedLens.from_model(model)
    with torch.no_grad():
        for p in tl.parameters():
            p.add_(0.01 * torch.randn_like(p))
    full = Q.quality_table(model, wins, ["logit", "tuned"], tl, batch_size=2)
    big = max(readout_calls)
    readout_calls.clear()
    with tracekit.memory_budget("10MiB"):
        assert Q.quality_batch_size(model, wins, 4, 2) == 2  # the forward batches are those of the full run
        small = Q.quality_table(model, wins, ["logit", "tuned"], tl, batch_size=2)
    assert big > 4 * MIN_READOUT_ROWS and max(readout_calls) == MIN_READOUT_ROWS
    assert full.equals(small)
    with tracekit.memory_budget("1MiB"), pytest.raises(MemoryBudgetError, match="lens quality"):
        Q.quality_table(model, wins, ["logit"], batch_size=2)


# ---- attention over all layers: [layers x heads x T x T] patterns, a chunk of layers at a time


@pytest.fixture
def forwards(monkeypatch):
    """Counts the forward passes of read_layers."""
    from tracekit import attention as A

    calls: list[int] = []
    orig = A.layer_chunk

    def spy(*a, **k):
        c = orig(*a, **k)
        calls.append(c)
        return c

    monkeypatch.setattr(A, "layer_chunk", spy)
    return calls


def test_head_scores_chunked_over_layers_equals_one_pass(forwards):
    from tracekit.attention import head_scores

    model = make_perturbed("llama", process_weights=False, n_layers=4)
    full = head_scores(model, seq_len=24, n_seqs=3)
    assert forwards == [4]  # every layer in one pass
    forwards.clear()
    with tracekit.memory_budget("1MiB"):  # one layer's [3, 4, 49, 49] patterns (+ copy) ~ 0.2 MiB
        small = head_scores(model, seq_len=24, n_seqs=3)
    assert forwards and forwards[0] < 4
    assert full.equals(small)
    with tracekit.memory_budget("64KiB"), pytest.raises(MemoryBudgetError, match="head scores.*seq_len"):
        head_scores(model, seq_len=24, n_seqs=3)


def test_head_scan_labels_and_attention_pattern_under_budget(forwards):
    from tracekit.attention import attention_pattern
    from tracekit.experiments.attention import HeadScan

    model = make_tiny("gpt2")
    cfg = HeadScan(seq_len=10, n_seqs=2, prompts=["The capital of France is a city in Europe"])
    full = cfg._run(model, cfg.prepare(model), progress=False)
    ap = attention_pattern(model, "The capital of France is a city", layer=2)
    forwards.clear()
    with tracekit.memory_budget("270KiB"):  # head scores: one layer (2 x 21 tokens) per pass
        small = cfg._run(model, cfg.prepare(model), progress=False)
        ap2 = attention_pattern(model, "The capital of France is a city", layer=2)
    assert min(forwards) == 1 and len(forwards) >= 3
    for k in full.tables:
        assert full.tables[k].equals(small.tables[k]), k
    assert torch.equal(ap.weights, ap2.weights) and torch.equal(ap.scores, ap2.scores)


def test_query_attention_and_full_patterns_batches_capped():
    """Smaller padded batches are another float32 computation: atol 1e-6 on probabilities."""
    from tracekit.attention import attention_batch_size, full_patterns, query_attention

    model = make_tiny("llama")
    ids = [[1] + list(range(100, 100 + n)) for n in (5, 9, 7, 12, 6)]
    q = [len(x) - 1 for x in ids]
    full = query_attention(model, ids, q, batch_size=16)
    fp = full_patterns(model, ids, [(0, 1), (2, 3)], batch_size=16)
    with tracekit.memory_budget("150KiB"):
        assert attention_batch_size(model, ids, 16) < 5
        small = query_attention(model, ids, q, batch_size=16)
        fp2 = full_patterns(model, ids, [(0, 1), (2, 3)], batch_size=16)
    torch.testing.assert_close(full.weights, small.weights, atol=1e-6, rtol=0, equal_nan=True)
    for p in fp:
        for a, b in zip(fp[p], fp2[p]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with tracekit.memory_budget("16KiB"), pytest.raises(MemoryBudgetError, match="query attention"):
        query_attention(model, ids, q)


# ---- direct logit attribution, patchscope, the trace report


def test_dla_batches_capped_and_refused():
    from tracekit.dla import dla_batch_size, logit_attribution

    model = make_perturbed("gpt2", process_weights=True)
    prompts = ["The capital of France is", "The capital of Italy was", "Hello there my friend"]
    full = logit_attribution(model, prompts, " Paris", " Rome", batch_size=8)
    from tracekit.model.readout import forward_row_bytes
    from tracekit.tokens import encode_prompts

    T = max(len(x) for x in encode_prompts(model, prompts))
    budget = 2 * readout_bytes(model) + int(1.5 * forward_row_bytes(model, T)) + 40_000  # ~ one row at a time
    with tracekit.memory_budget(budget):
        assert dla_batch_size(model, [[1] * T] * 3, 60, 8) < 3
        small = logit_attribution(model, prompts, " Paris", " Rome", batch_size=8)
    for a, b in zip(full, small):  # padded less: float32 rounding (atol 1e-5 on O(1) logits)
        torch.testing.assert_close(a.heads, b.heads, atol=1e-5, rtol=0)
        assert abs(a.logit - b.logit) < 1e-5
    with tracekit.memory_budget("64KiB"), pytest.raises(MemoryBudgetError, match="direct logit attribution"):
        logit_attribution(model, prompts, " Paris", " Rome")


def test_patchscope_batches_capped_exactly():
    from tracekit.lenses.patchscope import patchscope, patchscope_batch_size, target_tokens

    IDENTITY = target_tokens(make_perturbed("llama", process_weights=False), None, "t") + [0]  # + 1 generated

    model = make_perturbed("llama", process_weights=False)
    ids = [1] + list(range(200, 208))
    full = patchscope(model, ids, [-1, -3, 4], [0, 1, 2, 3], top_k=3, n_generate=2, batch_size=16, log_probs=True)
    with tracekit.memory_budget("40MiB"):  # 4 of the 12 patches per batch (the target prompt's logits, readout)
        small = patchscope(model, ids, [-1, -3, 4], [0, 1, 2, 3], top_k=3, n_generate=2, batch_size=16, log_probs=True)
        assert patchscope_batch_size(model, len(IDENTITY), 16, True) == 4
    # every patch runs the same target prompt (no padding), so smaller batches give the same bits
    assert full.log_probs is not None and small.log_probs is not None
    assert torch.equal(full.log_probs, small.log_probs) and torch.equal(full.generated, small.generated)
    assert torch.equal(full.topk_probs, small.topk_probs)
    # refused before any forward pass, by the first engine whose unit does not fit (the replay's variant)
    with tracekit.memory_budget("64KiB"), pytest.raises(MemoryBudgetError, match="(patchscope|patching replay): one"):
        patchscope(model, ids, [-1], [1])


def test_trace_attention_stops_before_the_logits():
    """The trace report's attention sections keep one query row and end the pass before the
    unembedding (no [pos, vocab] logits); a prompt whose forward pass does not fit is refused."""
    from tracekit import trace as T

    model = make_tiny("gpt2")
    seen: list = []
    handle = model.unembed.register_forward_hook(lambda *a: seen.append(1))
    try:
        rows = T._attention(model, "The capital of France is", range(3))
        T._head_patterns(model, "The capital of France is", [(1, 0)])
        assert len(rows) == 3 and not seen
        model(torch.tensor([[1, 2, 3]]))
        assert seen  # the spy sees a full forward pass
    finally:
        handle.remove()
    with tracekit.memory_budget("16KiB"), pytest.raises(MemoryBudgetError, match="trace report"):
        T._attention(model, "The capital of France is", range(3))
