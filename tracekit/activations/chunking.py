"""The memory budget (:mod:`tracekit.core.budget`) for the engines that run the model to *produce*
activations: the activation store's write, SAE training's activation cache, SAE decomposition,
tuned-lens residual caching and probing extraction.

Each of them runs a batch of rows whose size the user sets (``batch_size``: part of a store's plan,
of the shard boundaries, of what a run records). Under a budget the batch is run as several
forward passes over consecutive rows of it (:func:`forward_chunks`), each padded to the *whole
batch's* width (:func:`row_slice`), so every row sees exactly the tensors it saw in the unchunked
pass (same width, same padding, same positions) and the results are equal byte for byte (tested in
``tests/integration/test_budget_training.py``). One caveat, measured on CPU: a pass of a *single* row can differ from the same row in a batch of
several in the last bits (a tiny GPT-2's residual by up to 7e-9: PyTorch picks other matmul
kernels for one row), while passes of two rows or more matched the whole batch bit for bit in
every test. So chunks hold an even number of rows whenever two fit (:func:`forward_chunk_size`),
and a budget that fits only one row at a time gives results equal to about 1e-8 relative.

Optimiser batches (an SAE's
``train_batch_size_tokens``, a tuned lens' ``batch_tokens``) are never split: a trained SAE or
lens depends on them; the budget only refuses a training step that cannot fit
(:func:`check_fits`).

The estimate of one row's forward pass (:func:`forward_row_bytes`) counts, per row of ``T``
tokens, in float32 (4 bytes, whatever the model's dtype: several ops upcast):

* the residual stream and its norms/temporaries: ``8 T d_model``;
* attention: queries, keys, values and ``z`` ``4 T n_heads d_head`` plus scores, pattern and the
  softmax temporary ``3 n_heads T^2``;
* the MLP: ``3 T d_mlp``;
* the logits when the pass reaches the unembedding: ``2 T d_vocab`` (the logits and a float copy);
* with gradients (``grad_layers``: blocks whose activations autograd keeps), those per-block terms
  once per kept block, plus the logits' gradient.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Optional

from ..core.budget import chunk_rows, run_chunked
from ..model.info import HookedModel
from ..model.load import model_device
from ..tokens import Batch

__all__ = ["forward_row_bytes", "row_slice", "forward_chunk_size", "forward_chunks", "check_fits"]

log = logging.getLogger("tracekit.budget")

#: Bytes per element in the estimates (float32).
F32 = 4


def _block_terms(model: HookedModel, seq_len: int) -> int:
    """Elements one block's forward pass holds for one row of ``seq_len`` tokens."""
    cfg = model.cfg
    d, T = int(cfg.d_model), int(seq_len)
    heads = int(cfg.n_heads)
    d_head = int(getattr(cfg, "d_head", 0) or d // max(1, heads))
    d_mlp = int(getattr(cfg, "d_mlp", 0) or 4 * d)
    return 8 * T * d + 4 * T * heads * d_head + 3 * heads * T * T + 3 * T * d_mlp


def forward_row_bytes(model: HookedModel, seq_len: int, *, logits: bool = True, grad_layers: int = 0) -> int:
    """Estimated peak bytes one row of ``seq_len`` tokens adds to a forward pass (module docstring).

    Args:
        model: a hooked model (its ``cfg``: ``d_model``, ``n_heads``, ``d_head``, ``d_mlp``,
            ``d_vocab``).
        seq_len: the row's padded length (tokens).
        logits: the pass reaches the unembedding (``[seq_len, d_vocab]`` logits); False when it
            stops at a hook before it.
        grad_layers: blocks whose activations autograd keeps for a backward pass (0: none).

    Returns:
        Bytes (int).
    """
    T = int(seq_len)
    vocab = int(getattr(model.cfg, "d_vocab", 0) or 0)
    n = _block_terms(model, T) * (1 + int(grad_layers))
    if logits:
        n += (2 + (1 if grad_layers else 0)) * T * vocab
    return int(n * F32)


def row_slice(batch: Batch, sl: slice) -> Batch:
    """Rows ``sl`` of a padded batch, keeping the batch's width (so each row is run exactly as in
    the whole batch: same padding, same offsets, an attention mask whenever the whole batch had one)."""
    tokens = batch.tokens[sl]
    mask = batch.attention_mask[sl]
    out = replace(batch, tokens=tokens, attention_mask=mask, lengths=list(batch.lengths[sl]),
                  ids=list(batch.ids[sl]) if batch.ids else [])
    return out


def forward_chunk_size(model: HookedModel, n_rows: int, per_row: int, *, what: str, fixed: int = 0,
                       fix: Optional[str] = None) -> int:
    """Rows of a batch of ``n_rows`` to run at once under the memory budget in force
    (:func:`tracekit.core.budget.chunk_rows`), at most ``n_rows`` (the user's batch size caps it).

    Raises:
        MemoryBudgetError: one row (``per_row`` bytes, plus ``fixed``) does not fit the budget; the
            message names the budget setting and ``fix``.
    """
    n = max(1, int(n_rows))
    c = chunk_rows(per_row, n, what=what, device=model_device(model), fixed=fixed, unit="row", fix=fix)
    return c - c % 2 if 1 < c < n else c  # even chunks: no one-row pass while two rows fit (module docstring)


def forward_chunks(fn: Callable[[slice], None], n_rows: int, chunk: int, what: str) -> int:
    """Run ``fn(slice)`` over ``range(n_rows)`` in chunks of ``chunk`` rows
    (:func:`tracekit.core.budget.run_chunked`: an out-of-memory error halves the chunk and retries
    it; ``fn`` must overwrite a retried slice's results). Returns the chunk size used last."""
    if chunk < n_rows:
        log.debug("%s: %d rows in chunks of %d", what, n_rows, chunk)
    return run_chunked(fn, n_rows, chunk, what=what)


def check_fits(model: HookedModel, need: int, *, what: str, unit: str, fix: str) -> None:
    """Refuse a step whose single unit (an optimiser step, whose size the method defines) needs
    more than the budget, before any work.

    Raises:
        MemoryBudgetError: ``need`` bytes exceed the budget in force (the message says how much is
            needed, what the budget allows, and ``fix``).
    """
    chunk_rows(int(need), 1, what=what, device=model_device(model), unit=unit, fix=fix)
