"""Logit lens: the next-token distribution each hidden state of the residual stream would give.

Method (nostalgebraist, "interpreting GPT: the logit lens", 2020; tuned-lens' ``LogitLens`` in
``tuned_lens/nn/lenses.py``): take the residual stream before/after each block, apply the model's
final norm -- *recomputed* for that vector (:class:`tracekit.model.readout.Readout`) -- and the
unembedding, and read off a distribution over the vocabulary. It answers "at which layer does
' Paris' appear?".

Rows, targets and tracked tokens: the lens runs over rows (prompts, token ids or a prepared
dataset, :class:`tracekit.dataset.PreparedDataset`). Each row may have its **own target** (and
foil): ``targets=" Paris"`` is every row's, ``targets=[" Paris", " Rome"]`` gives one per row (the
length must equal the number of rows). Tokens followed on *every* row are ``track=[...]``, a
separate argument, so "each row's own answer" and "these tokens everywhere" cannot be confused.
Per-row targets are gathered from the log-softmax the batched pass already computes (no pass per
target, no pass per row).

Numbering (docs/glossary.md): a **hidden state** ``h`` is Hugging Face's ``output_hidden_states``
index: ``h = 0`` is the embedding output (``blocks.0.hook_resid_pre``) and ``h >= 1`` the output of
block ``h-1`` (``blocks.{h-1}.hook_resid_post``); the last one equals the model's own output
distribution. A **layer** is a block index. The ``layer_convention`` picks which hidden states are
read: ``hidden_states`` (all ``n_layers + 1``), ``resid_post`` (``1..n_layers``: block outputs) or
``resid_pre`` (``0..n_layers-1``: block inputs).

Landmarks (:func:`landmarks`): the **emergence** hidden state is the first from which the target stays
top-1 through the last one read; the **jump** is the largest one-step gain of the target's
probability between consecutive hidden states read; the block that produced it is the ``jump_layer``
(block ``h-1`` for a gain into hidden state ``h``), and the block whose output first has the target
on top for good is the ``emergence_layer``.

Speed: only the residual hooks read are kept, only at the positions read, and the forward pass ends
after the last block's output (:mod:`tracekit.fastpath`); the model's own output distribution is the
readout of the last block's output (equal to its logits' softmax, tested to 1e-5).

Units: probabilities in [0, 1]; log-probabilities natural log; a **vocab rank** is 1 for the top
token (1 + the number of tokens with a strictly larger probability); entropy in nats.

Notebook use (a doctest, run on a tiny model)::

    >>> from tracekit.logit_lens import logit_lens
    >>> out = logit_lens(model, ["The capital of France is"], targets=[" Paris"])
    >>> p = out[0].target_prob[:, -1, 0]     # [hidden states] p(' Paris') at the last token
    >>> p.shape[0] == model.cfg.n_layers + 1 and bool(((p >= 0) & (p <= 1)).all())
    True
    >>> rows = logit_lens(model, ["The capital of France is", "The capital of Italy is"],
    ...                   targets=[" Paris", " Rome"], track=[" London"])   # one target per row
    >>> [r.target_prob.shape[-1] for r in rows], [r.track_prob.shape[-1] for r in rows]
    ([1, 1], [1, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional, Sequence, Union

import numpy as np
import torch
from jaxtyping import Float, Int

from .activations.cached import CachedActivations
from .core.budget import bytes_of, chunk_rows, run_chunked
from .core.errors import DatasetError, TokenizationError
from .core.sites import hook
from .dataset import PreparedDataset, per_row_values
from .model.info import HookedModel
from .tokens import (
    Position,
    chunks,
    encode_prompts,
    pad_rows,
    parse_position,
    single_token_id,
    str_tokens,
)

__all__ = ["LayerConvention", "LensPoint", "lens_points", "PromptLens", "logit_lens", "landmarks",
           "emergence_hidden_state", "LENS_POSITIONS", "lens_batch_size"]

LayerConvention = Literal["hidden_states", "resid_post", "resid_pre"]
#: Position forms the lens accepts (``name``: a dataset's named position, e.g. ``END``).
LENS_POSITIONS = ("int", "last", "all", "name")

TokenSpec = Union[str, int]


@dataclass(frozen=True)
class LensPoint:
    """One residual-stream read: its hidden-state index, block index, site and hook name."""

    hidden_state: int
    layer: int
    site: str
    hook: str


def lens_points(n_layers: int, convention: str) -> list[LensPoint]:
    """The residual reads of a layer convention, in order of hidden state.

    Raises:
        ValueError: an unknown convention.
    """
    pre = [LensPoint(L, L, "resid_pre", hook("resid_pre", L)) for L in range(n_layers)]
    post = [LensPoint(L + 1, L, "resid_post", hook("resid_post", L)) for L in range(n_layers)]
    if convention == "hidden_states":
        return pre[:1] + post
    if convention == "resid_post":
        return post
    if convention == "resid_pre":
        return pre
    raise ValueError(f"layer_convention: unknown convention {convention!r}; use hidden_states, resid_post or "
                     "resid_pre")


def _empty(*shape: int) -> torch.Tensor:
    return torch.empty(*shape)


@dataclass
class PromptLens:
    """The lens of one row at its read positions (all tensors on the CPU, float32).

    ``H`` hidden states read, ``P`` positions read, ``T`` = 1 when the row has a target (0 when
    not; kept as a last axis so ``target_prob[:, p, 0]`` reads it), ``F`` = 1 when it has a foil,
    ``K`` tracked tokens, ``k`` top tokens.

    Attributes:
        prompt, ids, tokens: the prompt, its token ids (BOS included when prepended) and strings.
        positions: the token indices read (into ``ids``, BOS counted), ``[P]``.
        points: the residual reads (hidden states), ``[H]``.
        target_ids: ``[]`` or ``[the row's own target id]``.
        target_log_prob, target_rank: ``[H, P, T]`` natural-log probability and vocab rank of the
            row's target (rank 1 = top).
        foil_ids: ``[]`` or ``[the row's foil id]``; foil_log_prob ``[H, P, F]``.
        track_ids: ``[K]`` tracked token ids (the same on every row).
        track_log_prob, track_rank: ``[H, P, K]``.
        entropy: ``[H, P]`` nats. topk_ids, topk_probs: ``[H, P, k]``.
        final_log_prob, final_rank: ``[P, T]`` the model's own output for the target.
        final_foil_log_prob: ``[P, F]``.
        final_track_log_prob: ``[P, K]``.
        final_topk_ids, final_topk_probs: ``[P, k]``.
    """

    prompt: str
    ids: list[int]
    tokens: list[str]
    positions: list[int]
    points: list[LensPoint]
    target_ids: list[int]
    target_log_prob: Float[torch.Tensor, "hidden pos target"]
    target_rank: Int[torch.Tensor, "hidden pos target"]
    entropy: Float[torch.Tensor, "hidden pos"]
    topk_ids: Int[torch.Tensor, "hidden pos k"]
    topk_probs: Float[torch.Tensor, "hidden pos k"]
    final_log_prob: Float[torch.Tensor, "pos target"]
    final_topk_ids: Int[torch.Tensor, "pos k"]
    final_topk_probs: Float[torch.Tensor, "pos k"]
    final_rank: Int[torch.Tensor, "pos target"] = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.long))
    foil_ids: list[int] = field(default_factory=list)
    foil_log_prob: Float[torch.Tensor, "hidden pos foil"] = field(default_factory=lambda: _empty(0, 0, 0))
    final_foil_log_prob: Float[torch.Tensor, "pos foil"] = field(default_factory=lambda: _empty(0, 0))
    track_ids: list[int] = field(default_factory=list)
    track_log_prob: Float[torch.Tensor, "hidden pos track"] = field(default_factory=lambda: _empty(0, 0, 0))
    track_rank: Int[torch.Tensor, "hidden pos track"] = field(
        default_factory=lambda: torch.empty(0, 0, 0, dtype=torch.long))
    final_track_log_prob: Float[torch.Tensor, "pos track"] = field(default_factory=lambda: _empty(0, 0))

    @property
    def target_id(self) -> Optional[int]:
        """The row's own target id (None when it has none)."""
        return self.target_ids[0] if self.target_ids else None

    @property
    def target_prob(self) -> Float[torch.Tensor, "hidden pos target"]:
        return self.target_log_prob.exp()

    @property
    def track_prob(self) -> Float[torch.Tensor, "hidden pos track"]:
        return self.track_log_prob.exp()


def _readout(model: HookedModel, resid: Float[torch.Tensor, "... d_model"], target: Int[torch.Tensor, "..."],
             foil: Int[torch.Tensor, "..."], track_ids: Sequence[int], top_k: int, chunk_rows: Optional[int] = None,
             fixed: int = 0) -> dict[str, torch.Tensor]:
    """Every statistic of the lens for residual vectors, each with its own target / foil id.

    The same formulas as :func:`tracekit.fastpath.lens_readout` (``Readout(model).log_probs`` in
    float32, ``exp``, ``topk`` on the probabilities, rank = 1 + tokens with a strictly larger
    log-prob), plus each vector's own target and foil gathered from the same log-softmax.

    Memory: ``[chunk, d_vocab]`` float32 readouts, ``chunk`` vectors at a time
    (:func:`tracekit.model.readout.readout_chunk`: at most 512 or ``chunk_rows``, fewer when the
    memory budget says so; rows are independent, so any chunk gives the same numbers), run through
    :func:`tracekit.core.budget.run_chunked` (an out-of-memory error halves the chunk).

    Args:
        resid: ``[..., d_model]`` residual vectors.
        target, foil: ``[...]`` each vector's target / foil id (-1: none).
        track_ids: ``[K]`` ids read on every vector.
        chunk_rows: the most vectors read at once (default 512).
        fixed: bytes held anyway while reading (the batch's residuals), for the budget.

    Returns:
        CPU tensors: ``target_log_prob`` / ``foil_log_prob`` ``[...]`` (NaN where the id is -1),
        ``target_rank`` ``[...]`` (0 where -1), ``track_log_prob`` / ``track_rank`` ``[..., K]``,
        ``entropy`` ``[...]``, ``top_prob`` / ``top_id`` ``[..., k]``.

    Raises:
        MemoryBudgetError: one group of vectors' readout does not fit the memory budget.
    """
    from .model.readout import MIN_READOUT_ROWS, Readout, chunked_log_probs, readout_chunk

    readout = Readout(model)
    lead = resid.shape[:-1]
    flat = resid.reshape(-1, resid.shape[-1])
    n = flat.shape[0]
    k = min(int(top_k), int(model.cfg.d_vocab))
    tgt = target.reshape(-1).to(flat.device)
    fl = foil.reshape(-1).to(flat.device)
    t = torch.tensor(list(track_ids), dtype=torch.long, device=flat.device)
    out = {"target_log_prob": torch.full((n,), float("nan")), "target_rank": torch.zeros(n, dtype=torch.long),
           "foil_log_prob": torch.full((n,), float("nan")),
           "track_log_prob": torch.empty(n, len(t)), "track_rank": torch.empty(n, len(t), dtype=torch.long),
           "entropy": torch.empty(n), "top_prob": torch.empty(n, k), "top_id": torch.empty(n, k, dtype=torch.long)}
    has_t, has_f = bool((tgt >= 0).any()), bool((fl >= 0).any())
    step = readout_chunk(model, n, what="logit lens readout", cap=512 if chunk_rows is None else int(chunk_rows),
                         fixed=fixed, fix="read fewer positions (position: last, or a short list) or hidden states")

    def one(sl: slice) -> None:
        s = sl.start
        lp = chunked_log_probs(readout, flat, sl)  # [r, vocab], float32
        r = len(lp)
        probs = lp.exp()
        out["entropy"][s:s + r] = -(probs * lp).sum(-1).cpu()
        tp, ti = probs.topk(k, dim=-1)
        out["top_prob"][s:s + r] = tp.cpu()
        out["top_id"][s:s + r] = ti.cpu()
        if has_t:
            ids = tgt[s:s + r]
            own = lp.gather(1, ids.clamp(min=0)[:, None])  # [r, 1]: each vector's own target
            rank = (lp > own).sum(-1, dtype=torch.int32) + 1
            ok = ids >= 0
            out["target_log_prob"][s:s + r] = torch.where(ok, own[:, 0], torch.nan).cpu()
            out["target_rank"][s:s + r] = torch.where(ok, rank, 0).cpu()
        if has_f:
            ids = fl[s:s + r]
            own = lp.gather(1, ids.clamp(min=0)[:, None])[:, 0]
            out["foil_log_prob"][s:s + r] = torch.where(ids >= 0, own, torch.nan).cpu()
        if len(t):
            t_lp = lp[:, t]  # [r, K]
            out["track_log_prob"][s:s + r] = t_lp.cpu()
            for j in range(len(t)):  # int32 counts: half the time of a bool -> int64 sum over the vocabulary
                out["track_rank"][s:s + r, j] = ((lp > t_lp[:, j:j + 1]).sum(-1, dtype=torch.int32) + 1).cpu()
        del lp, probs

    run_chunked(one, n, step, align=MIN_READOUT_ROWS if step >= MIN_READOUT_ROWS else 1, what="logit lens readout")
    return {key: v.reshape(*lead, *v.shape[1:]) for key, v in out.items()}


def _per_row(value, n: int, name: str, model: HookedModel, rows_word: str = "prompt") -> list[Optional[int]]:
    """``[n]`` token ids from a token (every row's), a list (one per row) or None."""
    def one(v, where: str) -> Optional[int]:
        if v is None:
            return None
        if isinstance(v, bool):
            raise TokenizationError(f"{where}: {v!r} is not a token")
        if isinstance(v, (int, np.integer)):
            if not 0 <= int(v) < int(model.cfg.d_vocab):
                raise TokenizationError(f"{where}: token id {int(v)} is outside the vocabulary (0..{model.cfg.d_vocab - 1})")
            return int(v)
        return single_token_id(model, v, field=where)

    if value is None or isinstance(value, (str, int, np.integer)):
        return [one(value, name)] * n
    return [one(v, f"{name}[{i}]") for i, v in enumerate(per_row_values(value, n, name, rows_word))]


@torch.no_grad()
def logit_lens(
    model: HookedModel,
    prompts: Union[str, Sequence[str], Sequence[Sequence[int]], PreparedDataset],
    targets: Union[TokenSpec, Sequence[Optional[TokenSpec]], None] = None,
    position: Position | int | str | list[int] | tuple[int, ...] | range = "last",
    layer_convention: LayerConvention = "hidden_states",
    top_k: int = 10,
    batch_size: int = 8,
    progress: Optional[Callable[[int], object]] = None,
    *,
    track: Sequence[TokenSpec] = (),
    foils: Union[TokenSpec, Sequence[Optional[TokenSpec]], None] = None,
    reads: Optional[Sequence[Sequence[int]]] = None,
    translator: Optional[Callable[[torch.Tensor, int], torch.Tensor]] = None,
    keep: Optional[CachedActivations] = None,
) -> list[PromptLens]:
    """Run the logit lens over rows, batched with padding; each row is read at its own tokens and
    scored against its own target, in the same forward pass.

    Args:
        model: a hooked model (TransformerBridge in compatibility mode).
        prompts: the rows: texts, token-id sequences (BOS included as the model reads them: the
            kinds pass their prepared ``ids``, so prompts are tokenized once), or a
            :class:`~tracekit.dataset.PreparedDataset` (its ids, targets, foils and named positions).
        targets: each row's answer token: one token string (or id) = every row's; a list = one per
            row (length = the number of rows; None entries for rows without one). A dataset's rows
            carry their own (giving ``targets`` beside a dataset is an error).
        position: ``last`` (default), ``all``, a token index (BOS counted; negative from the end),
            a dataset's named position (``END``: needs a PreparedDataset) or, from a notebook, a
            list of token indices (e.g. ``range(-16, 0)``: the last 16 tokens), so the cost scales
            with the positions read, not the prompt's length.
        layer_convention: which hidden states are read (module docstring).
        top_k: top tokens kept per read.
        batch_size: rows per forward pass (capped by the memory budget: :func:`lens_batch_size`).
        progress: optional callable receiving the number of rows finished.
        track: tokens (strings or ids) read on every row (the old "list of targets").
        foils: each row's contrasting token, like ``targets``.
        reads: per row, the token indices to read (into that row's ids, BOS counted; overrides
            ``position``): how the kind passes positions it resolved once in ``prepare``.
        translator: optional ``translator(resid [..., d_model], hidden_state) -> [..., d_model]``
            applied to each residual before the readout, e.g. a tuned lens
            (:class:`tracekit.lenses.tuned.TunedLens`, Belrose et al. 2023); None (default) is the
            logit lens. Hidden state ``n_layers`` (the model's own output, also ``final_*``) is
            read untranslated.
        keep: optional :class:`~tracekit.activations.cached.CachedActivations` receiving the
            residual stream the lens read, ``[row, read, d_model]`` per hook name (every hidden
            state's hook, plus ``blocks.{n_layers-1}.hook_resid_post``), before any translator.

    Returns:
        One :class:`PromptLens` per row, in order.

    Raises:
        TokenizationError: a target/foil/tracked token that is not one token, a position out of
            range, a prompt longer than the context.
        DatasetError: a ``targets``/``foils`` list of another length than the rows (the message
            names ``track``), targets given beside a dataset, a named position a row lacks.
        MemoryBudgetError: one row's forward pass, or one group of vectors' readout, does not fit
            ``run.memory_budget`` (raised before the forward pass).

    Memory: the ``[hidden states, positions, vocabulary]`` readout is never held whole: vectors are
    read out in chunks under the memory budget (:mod:`tracekit.core.budget`) and only the
    statistics above are kept; a chunked readout equals an unchunked one exactly.
    """
    # Long (reason): input normalisation (strings, ids, a prepared dataset; targets, foils, track) then one batched readout loop; the normalisation is the piece to share with dla.logit_attribution.
    data: Optional[PreparedDataset] = prompts if isinstance(prompts, PreparedDataset) else None
    if data is not None:
        if targets is not None or foils is not None:
            raise DatasetError("targets/foils beside a dataset: its rows carry their own; to follow the same "
                               "tokens on every row use track")
        ids_list = [list(e.ids) for e in data.examples]
        texts = data.prompts
        tgt = [e.target_id for e in data.examples]
        fl = [e.foil_id for e in data.examples]
    else:
        if isinstance(prompts, str):
            prompts = [prompts]
        items = list(prompts)  # type: ignore[arg-type]
        if not items:
            raise TokenizationError("prompts: need at least one prompt")
        if all(isinstance(p, str) for p in items):
            texts = [str(p) for p in items]
            ids_list = [list(seq) for seq in encode_prompts(model, texts)]
        else:
            ids_list = [[int(x) for x in p] for p in items]  # type: ignore[union-attr]
            if any(not s for s in ids_list):
                raise TokenizationError("prompts: a row has no token ids")
            tok = model.tokenizer
            texts = [tok.decode(s) for s in ids_list]
        tgt = _per_row(targets, len(ids_list), "target", model)
        fl = _per_row(foils, len(ids_list), "foil", model)
    track_ids = [int(_per_row(t, 1, f"track[{j}]", model)[0]) for j, t in enumerate(track)]  # type: ignore[arg-type]
    n_rows = len(ids_list)
    if reads is not None:
        if len(reads) != n_rows:
            raise TokenizationError(f"reads: {len(reads)} lists for {n_rows} rows")
        row_reads = []
        for b, r in enumerate(reads):
            n = len(ids_list[b])
            if not r or any(not -n <= int(i) < n for i in r):
                raise TokenizationError(f"reads[{b}]: {list(r)} is empty or out of range for a row of {n} tokens")
            row_reads.append([int(i) % n for i in r])
    elif isinstance(position, (list, tuple, range)):
        explicit = [int(i) for i in position]
        row_reads = [sorted({i % len(s) for i in explicit}) for s in ids_list]
    else:
        pos = position if isinstance(position, Position) else parse_position(position, LENS_POSITIONS)
        if pos.kind == "name":
            if data is None:
                raise TokenizationError(f"position: {pos.text!r} names a dataset position; pass a prepared dataset "
                                        "(tracekit.dataset) or use last / all / an index")
            row_reads = [[i] for i in data.position(str(pos.text))]
        else:
            row_reads = [pos.resolve(model, t, s, field="position", skip_bos=False) for t, s in zip(texts, ids_list)]
    n_layers = int(model.cfg.n_layers)
    points = lens_points(n_layers, layer_convention)
    hooks = [p.hook for p in points]
    last_post = hook("resid_post", n_layers - 1)  # its readout is the model's own output
    read_hooks = hooks + ([] if last_post in hooks else [last_post])
    final_at = read_hooks.index(last_post)
    return _lens_batches(model, ids_list, texts, row_reads, tgt, fl, track_ids, points, read_hooks, final_at,
                         top_k, batch_size, progress, translator, keep)


def lens_batch_size(model: HookedModel, ids_list: Sequence[Sequence[int]], row_reads: Sequence[Sequence[int]],
                    n_hooks: int, batch_size: int, top_k: int = 10) -> int:
    """Rows per forward pass of the lens: ``batch_size``, capped by the memory budget.

    One row costs its forward pass at the longest row's length
    (:func:`tracekit.model.readout.forward_row_bytes`) plus the residuals kept (``[hooks, reads,
    d_model]`` at the most positions any row reads) and its results (top-k ids and probabilities and
    a few statistics per read); one group of readout vectors
    (:func:`tracekit.model.readout.readout_chunk`) is counted as held besides. Under a budget the
    cap lowers ``batch_size``; rows then run in smaller padded batches, which is the only change
    (the same rows, padded less, can differ in the last bits of float32 rounding).

    Raises:
        MemoryBudgetError: one row does not fit (before any forward pass); the message names
            ``run.memory_budget`` and the prompt length / positions read.
    """
    from .model.readout import MIN_READOUT_ROWS, forward_row_bytes, readout_bytes

    T = max(len(x) for x in ids_list)
    n_read = max(len(r) for r in row_reads)
    d = int(model.cfg.d_model)
    dt = getattr(model.cfg, "dtype", None)
    keep = bytes_of(n_hooks, n_read, d, dtype=dt if isinstance(dt, torch.dtype) else torch.float32)
    results = n_hooks * n_read * (12 * max(1, int(top_k)) + 64)
    per_row = forward_row_bytes(model, T) + keep + results
    group = readout_bytes(model) * min(MIN_READOUT_ROWS, n_hooks * n_read)
    from .model.load import model_device

    return chunk_rows(per_row, max(1, int(batch_size)), what="logit lens forward", device=model_device(model),
                      fixed=group, unit=f"row ({T} tokens, {n_read} positions read)",
                      fix="shorten the prompts or read fewer positions (position: last, or a short list)")


def _translate(resid: torch.Tensor, points: Sequence[LensPoint], translator) -> torch.Tensor:
    """``resid`` ``[hooks, ...]`` with ``translator`` applied to each read hidden state but the last
    (``n_layers``: the model's own output, read as it is, as the tuned lens does)."""
    out = resid.clone()
    last = max(p.hidden_state for p in points) if points else 0
    for j, p in enumerate(points):
        if p.hidden_state != last or p.site != "resid_post":
            out[j] = translator(resid[j], p.hidden_state)
    return out


def _lens_batches(model: HookedModel, ids_list, texts, row_reads, tgt, fl, track_ids, points, read_hooks, final_at, top_k,
                  batch_size, progress, translator=None, keep=None) -> list[PromptLens]:
    from .fastpath import residual_stream

    H = len(points)
    out: list[PromptLens] = []
    batch_size = lens_batch_size(model, ids_list, row_reads, len(read_hooks), batch_size, top_k)
    for sl in chunks(len(ids_list), batch_size):
        rows = list(range(len(ids_list)))[sl]
        batch = pad_rows(model, [ids_list[i] for i in rows])
        reads = [row_reads[i] for i in rows]
        width = max(len(r) for r in reads)
        idx = torch.stack([batch.real_index(b)[torch.tensor(r + [r[-1]] * (width - len(r)))]
                           for b, r in enumerate(reads)])  # [b, n_read] padded indices (last repeated)
        resid = residual_stream(model, batch, read_hooks, positions=idx)  # [hooks, b, n_read, d]
        if keep is not None:  # what was read, kept (views: no copy on the CPU)
            keep.add({h: resid[j] for j, h in enumerate(read_hooks)}, reads)
        if translator is not None:
            resid = _translate(resid, points, translator)
        own = torch.tensor([-1 if tgt[i] is None else tgt[i] for i in rows], dtype=torch.long)
        foil = torch.tensor([-1 if fl[i] is None else fl[i] for i in rows], dtype=torch.long)
        shape = resid.shape[:-1]  # [hooks, b, n_read]
        r = _readout(model, resid, own[None, :, None].expand(shape), foil[None, :, None].expand(shape), track_ids,
                     top_k, fixed=resid.element_size() * resid.numel())
        for b, i in enumerate(rows):
            n = len(reads[b])
            lens = {k: v[:H, b, :n] for k, v in r.items()}
            fin = {k: v[final_at, b, :n] for k, v in r.items()}
            has_t, has_f = tgt[i] is not None, fl[i] is not None
            ids = ids_list[i]
            out.append(PromptLens(
                texts[i], list(ids), str_tokens(model, ids), list(reads[b]), list(points),
                [int(tgt[i])] if has_t else [],
                lens["target_log_prob"][..., None][..., : int(has_t)],
                lens["target_rank"][..., None][..., : int(has_t)],
                lens["entropy"], lens["top_id"], lens["top_prob"],
                fin["target_log_prob"][..., None][..., : int(has_t)],
                fin["top_id"], fin["top_prob"],
                final_rank=fin["target_rank"][..., None][..., : int(has_t)],
                foil_ids=[int(fl[i])] if has_f else [],
                foil_log_prob=lens["foil_log_prob"][..., None][..., : int(has_f)],
                final_foil_log_prob=fin["foil_log_prob"][..., None][..., : int(has_f)],
                track_ids=list(track_ids), track_log_prob=lens["track_log_prob"], track_rank=lens["track_rank"],
                final_track_log_prob=fin["track_log_prob"]))
        if progress is not None:
            progress(len(rows))
        del resid, r
    return out


def emergence_hidden_state(hidden_states: Sequence[int], ranks: Sequence[int]) -> Optional[int]:
    """First hidden state from which the target stays top-1 through the last one read (None if never)."""
    out = None
    for h, r in zip(reversed(list(hidden_states)), reversed(list(ranks))):
        if int(r) == 1:
            out = int(h)
        else:
            break
    return out


def landmarks(hidden_states: Sequence[int], probs: Sequence[float], ranks: Sequence[int]) -> dict:
    """The emergence and jump of a target's lens curve (module docstring).

    Returns:
        ``{"emergence_hidden_state", "emergence_layer", "jump": {"from_hidden_state",
        "to_hidden_state", "layer", "from_prob", "to_prob", "gain"}, "jump_layer"}``; the layers are
        block indices (None when the landmark is the embedding or does not exist).
    """
    hs = [int(h) for h in hidden_states]
    em = emergence_hidden_state(hs, ranks)
    out: dict = {"emergence_hidden_state": em, "emergence_layer": (em - 1) if em else None}
    if len(hs) > 1:
        gains = np.diff(np.asarray(probs, dtype=float))
        j = int(np.argmax(gains))
        out["jump"] = {"from_hidden_state": hs[j], "to_hidden_state": hs[j + 1], "layer": hs[j + 1] - 1,
                       "from_prob": float(probs[j]), "to_prob": float(probs[j + 1]), "gain": float(gains[j])}
        out["jump_layer"] = hs[j + 1] - 1
    else:
        out["jump"] = None
        out["jump_layer"] = None
    return out
