"""The memory budget on the lens engines (``run.memory_budget``, :mod:`tracekit.core.budget`): under
a budget far below the naive ``[hidden states x positions x vocabulary]`` readout, the logit lens and
the lens-quality table read out in many chunks and give exactly the numbers of the unbudgeted run;
a budget below one unit is refused before the forward pass, naming the setting to change."""

from __future__ import annotations

import pytest
import torch

import tracekit
from tracekit.core.errors import MemoryBudgetError
from tracekit.lenses import quality as Q
from tracekit.lenses.train import split_windows
from tracekit.lenses.tuned import TunedLens
from tracekit.logit_lens import logit_lens
from tracekit.model.readout import MIN_READOUT_ROWS, Readout, readout_bytes

from helpers import make_perturbed, make_tiny

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
    kw = dict(targets=" Paris", foils=" Rome", track=[" the", " of"], position="all", top_k=5, batch_size=8)
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
