# Over 600 lines (reason): one engine for every attention reading (patterns, head scores, query rows, full patterns) and the memory-budgeted layer reads they share; the head-scoring half can move to attention_scores.py.
"""Attention heads: who attends to what, and what kind of head it is.

Engine of the ``attention_pattern`` and ``head_scan`` kinds (:mod:`tracekit.experiments.attention`).

* :func:`attention_pattern`: for a prompt and a layer (block index), every head's raw attention scores
  (``blocks.L.attn.hook_attn_scores``: ``q.k / sqrt(d_head)`` after the causal mask, future keys
  ``-inf``) and softmax weights (``blocks.L.attn.hook_pattern``, each query row sums to 1, future
  keys get 0). This is the seed article's "Layer 0 Head 6, query ' is'" view (GPT-2:
  France 35%, capital 35%, The 22%). With grouped-query attention (SmolLM2: 9 query heads share
  3 key/value heads) heads are indexed by *query* head, as in ``hook_pattern``.
* :func:`query_attention`: attention *from one query position per row* of a dataset, at any set of
  layers and heads, in ONE batched forward pass per ``batch_size`` rows: a hook on each needed
  ``blocks.L.attn.hook_pattern`` keeps only the query's row of the chosen heads (``[batch, head,
  key]``, not the ``[batch, head, pos, pos]`` pattern), read at the row's own real tokens (the pad
  offset added, as :meth:`tracekit.dataset.PreparedDataset.padded_index` does), and the pass stops
  after the last layer read. :func:`label_query_rows` labels every (row, layer, head) at once and
  :func:`head_stats` aggregates per head over rows (mean, std, quartiles).
* :func:`classify_heads`: label each head by what dominates its attention at the chosen query
  positions: ``self`` (the query token), ``first`` (position 0: BOS when the model prepends one),
  ``previous`` (the token before), ``spread`` (close to uniform: normalised entropy >=
  ``spread_entropy``) or ``content`` (none of those: the head picks tokens by what they are).
* :func:`head_scores`: previous-token and induction scores on repeated random tokens (Olsson et
  al. 2022, "In-context Learning and Induction Heads"), using TransformerLens' head-detector
  patterns (``transformer_lens.head_detector``). ``induction_score`` is the mean attention, over
  queries in the repeated half, to the token *after* the query token's earlier occurrence;
  ``prev_token_score`` the mean attention to the previous token; ``tl_*`` columns are
  TransformerLens' ``compute_head_attention_similarity_score`` ("mul") for the same patterns,
  which divides by *all* query rows (so its induction score is at most about 0.5).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int

from .core.sites import check_heads, check_layer, check_layers, hook
from .errors import AttentionError, HookError
from .model.context import check_context, context_length
from .model.info import HookedModel
from .tokens import (
    Batch,
    Position,
    PositionSpec,
    chunks,
    encode,
    pad_ids,
    pad_rows,
    parse_position,
    str_tokens,
    tokenize,
)

__all__ = ["AttentionError", "LayerAttention", "attention_pattern", "resolve_position", "classify_heads",
           "repeated_random_tokens", "check_repeated_length", "head_scores", "pattern_scores", "check_heads", "check_layer", "HEAD_LABELS",
           "POSITION_FORMS", "QueryAttention", "query_attention", "label_query_rows", "head_stats",
           "full_patterns", "read_layers", "layer_chunk", "attention_batch_size"]

HEAD_LABELS = ("self", "first", "previous", "spread", "content")
#: The position forms attention accepts for the query position.
POSITION_FORMS = ("int", "last", "token:<text>")


@dataclass
class LayerAttention:
    """Attention of every head of one layer on one prompt.

    Attributes:
        tokens: the prompt's tokens (BOS included when prepended).
        layer: the layer.
        scores: ``[n_heads, q_pos, k_pos]`` pre-softmax scores (scaled by 1/sqrt(d_head) as the
            model does; future keys ``-inf``).
        weights: ``[n_heads, q_pos, k_pos]`` softmax weights (probabilities; rows sum to 1).
    """

    tokens: list[str]
    layer: int
    scores: Float[torch.Tensor, "head q k"]
    weights: Float[torch.Tensor, "head q k"]

    def query_frame(self, query: int, heads: Optional[Sequence[int]] = None) -> pd.DataFrame:
        """One row per (head, key position <= query): ``layer, head_idx, query_pos, query_token,
        key_pos, key_token, score`` (pre-softmax) and ``weight`` (probability)."""
        heads = list(range(self.weights.shape[0])) if heads is None else heads
        rows = []
        for h in heads:
            for k in range(query + 1):
                rows.append({"layer": self.layer, "head_idx": h, "query_pos": query, "query_token": self.tokens[query],
                             "key_pos": k, "key_token": self.tokens[k], "score": float(self.scores[h, query, k]),
                             "weight": float(self.weights[h, query, k])})
        return pd.DataFrame(rows)

    def frame(self, heads: Optional[Sequence[int]] = None) -> pd.DataFrame:
        """Full causal pattern of some heads: one row per (head, query, key <= query): ``layer,
        head_idx, query_pos, key_pos, score, weight``."""
        heads = list(range(self.weights.shape[0])) if heads is None else heads
        n = len(self.tokens)
        q, k = np.tril_indices(n)
        frames = []
        for h in heads:
            frames.append(pd.DataFrame({"layer": self.layer, "head_idx": h, "query_pos": q, "key_pos": k,
                                        "score": self.scores[h].numpy()[q, k], "weight": self.weights[h].numpy()[q, k]}))
        return pd.concat(frames, ignore_index=True)


def resolve_position(model: HookedModel, prompt: str, position: Union[PositionSpec, Position] = "last",
                     ids: Optional[Sequence[int]] = None, field: str = "position") -> int:
    """The query position (index into the tokenized prompt, BOS included) of ``position``: an int
    (negative from the end), ``last`` or ``token:<text>`` (the token holding the last character of
    the last occurrence of ``<text>``). Needs only the tokenizer (works on a ``ModelInfo``).

    Raises:
        TokenizationError: another form (a bare token string such as ``" is"`` is refused with the
            hint ``token: is``), an index out of range, or a text not in the prompt.
    """
    pos = position if isinstance(position, Position) else parse_position(position, POSITION_FORMS, field)
    if pos.kind not in ("index", "last", "token"):
        parse_position(str(pos), POSITION_FORMS, field)  # raises, listing the accepted forms
    ids = list(ids) if ids is not None else encode(model, prompt)
    return pos.resolve(model, prompt, ids, field=field)[0]


@torch.no_grad()
def attention_pattern(model: HookedModel, prompt: str, layer: int) -> LayerAttention:
    """Scores and weights of every head of ``layer`` on ``prompt`` (one forward pass that keeps only
    ``hook_attn_scores`` and ``hook_pattern`` of that layer and stops after it: no ``[pos, vocab]``
    logits).

    Raises:
        AttentionError: unknown layer.
        MemoryBudgetError: the layer's ``[head, pos, pos]`` patterns and the forward pass do not fit
            ``run.memory_budget`` (:func:`read_layers`).
    """
    L = check_layer(model, layer)
    names = [hook("head_scores", L), hook("head_pattern", L)]
    batch = tokenize(model, [prompt])
    cache: dict[str, torch.Tensor] = {}
    read_layers(model, batch, [L], ("head_scores", "head_pattern"), cache.update, what="attention pattern")
    return LayerAttention(str_tokens(model, batch.ids[0]), L, cache[names[0]][0].float().cpu(),
                            cache[names[1]][0].float().cpu())


def classify_heads(weights: Float[torch.Tensor, "head q k"], queries: Optional[Sequence[int]] = None,
                   dominance: float = 0.4, spread_entropy: float = 0.9,
                   rows: Optional[Sequence[int]] = None) -> pd.DataFrame:
    """Label each head by what dominates its attention at the given query positions.

    For each head, average over the queries (default: every query position >= 1, where self,
    first and previous differ at least partly) the attention mass on ``self``, ``first`` (key 0)
    and ``previous`` (key q-1), and the normalised entropy ``H / log(q+1)`` (1 = uniform over the
    visible keys). Label: the largest of self/first/previous if it is >= ``dominance``; else
    ``spread`` if the normalised entropy >= ``spread_entropy``; else ``content``.

    ``rows``: when ``weights`` holds only some query rows (e.g. ``[head, 1, k]``: the last
    position's row of a long prompt), ``rows[i]`` is the row of ``weights`` holding query
    ``queries[i]``; by default row ``q`` holds query ``q``.

    Returns:
        DataFrame ``head, self, first, previous, entropy_norm, max_key_weight, label``.
    """
    H, Q, K = weights.shape
    queries = list(range(1, Q)) if queries is None else list(queries)
    if not queries:
        queries = [0]
    row_of = dict(zip(queries, rows)) if rows is not None else {q: q for q in queries}
    table: list[dict] = []
    for h in range(H):
        s = f = pv = ent = mx = 0.0
        for q in queries:
            w = weights[h, row_of[q], : q + 1].double()
            s += float(w[q]); f += float(w[0]); pv += float(w[q - 1]) if q >= 1 else 0.0
            e = float(-(w.clamp_min(1e-30) * w.clamp_min(1e-30).log()).sum())
            ent += e / np.log(q + 1) if q >= 1 else 0.0
            mx += float(w.max())
        n = len(queries)
        s, f, pv, ent, mx = s / n, f / n, pv / n, ent / n, mx / n
        cands = {"self": s, "first": f, "previous": pv}
        best = max(cands, key=cands.__getitem__)
        if cands[best] >= dominance:
            label = best
        elif ent >= spread_entropy:
            label = "spread"
        else:
            label = "content"
        table.append({"head": h, "self": s, "first": f, "previous": pv, "entropy_norm": ent,
                      "max_key_weight": mx, "label": label})
    return pd.DataFrame(table)


def check_repeated_length(model: HookedModel, seq_len: int, field: str = "seq_len") -> None:
    """Refuse a :func:`repeated_random_tokens` sequence (BOS + ``r`` + ``r``, ``2 x seq_len + 1``
    tokens, counted with the BOS either way) longer than the model's context
    (:func:`tracekit.model.context.check_context`).

    Args:
        model: a hooked model or :class:`~tracekit.model.ModelInfo`.
        seq_len: random tokens per copy.
        field: the config field that sets it.

    Raises:
        AttentionError: ``2 x seq_len + 1`` > the model's context, naming ``field`` and its largest value.
    """
    n_ctx = context_length(model)
    check_context(model, 2 * int(seq_len) + 1, field, f"a BOS and two copies of {int(seq_len)} random tokens",
                  f"set {field} to at most {((n_ctx or 1) - 1) // 2}", AttentionError)


def repeated_random_tokens(model: HookedModel, seq_len: int = 40, n_seqs: int = 4, seed: int = 0):
    """A batch of ``n_seqs`` sequences: [BOS?] + r + r with ``r`` ``seq_len`` random tokens
    (drawn from ids 100..d_vocab-1, avoiding special tokens), as in Olsson et al. 2022.

    Returns:
        (Batch, half_start) where ``half_start`` is the position of the second copy's first token.
    """
    g = torch.Generator().manual_seed(int(seed))
    vocab = int(getattr(model.tokenizer, "vocab_size", model.cfg.d_vocab) or model.cfg.d_vocab)
    vocab = min(vocab, int(model.cfg.d_vocab))
    special = set(getattr(model.tokenizer, "all_special_ids", []) or [])
    lo = min(100, vocab // 2)
    bos = encode(model, "", prepend_bos=None)
    seqs = []
    for _ in range(n_seqs):
        r = torch.randint(lo, vocab, (seq_len,), generator=g).tolist()
        r = [t if t not in special else lo for t in r]
        seqs.append(bos + r + r)
    return pad_ids(model, seqs), len(bos) + seq_len


def pattern_scores(pattern: Float[torch.Tensor, "head pos pos"], tokens: torch.Tensor, half: int) -> np.ndarray:
    """Previous-token and induction scores of each head from its pattern on one sequence.

    Args:
        pattern: ``[n_heads, pos, pos]`` attention weights. tokens: ``[pos]`` the sequence.
        half: first position of the repeated half (induction is scored on queries >= half).

    Returns:
        ``[n_heads, 4]``: prev_token_score, induction_score, and TransformerLens'
        ``compute_head_attention_similarity_score`` ("mul") for the previous-token and induction
        detection patterns (``transformer_lens.head_detector``).
    """
    from transformer_lens.head_detector import (
        compute_head_attention_similarity_score,
        get_induction_head_detection_pattern,
        get_previous_token_head_detection_pattern,
    )

    toks = tokens.reshape(1, -1).cpu()
    prev_pat = get_previous_token_head_detection_pattern(toks)
    ind_pat = get_induction_head_detection_pattern(toks)
    q_ind = torch.zeros(toks.shape[1], dtype=torch.bool)
    q_ind[half:] = True
    q_ind &= ind_pat.sum(-1) > 0
    out = np.zeros((pattern.shape[0], 4))
    for h in range(pattern.shape[0]):
        p = pattern[h]
        out[h, 0] = float((p * prev_pat).sum(-1)[1:].mean())
        out[h, 1] = float((p * ind_pat).sum(-1)[q_ind].mean()) if q_ind.any() else float("nan")
        out[h, 2] = compute_head_attention_similarity_score(p, prev_pat, exclude_bos=False,
                                                            exclude_current_token=False, error_measure="mul")
        out[h, 3] = compute_head_attention_similarity_score(p, ind_pat, exclude_bos=False,
                                                            exclude_current_token=False, error_measure="mul")
    return out


@torch.no_grad()
def head_scores(model: HookedModel, seq_len: int = 40, n_seqs: int = 4, seed: int = 0,
                layers: Optional[Sequence[int]] = None) -> pd.DataFrame:
    """Previous-token and induction scores of every head on repeated random tokens.

    Args:
        seq_len: random tokens per half (sequences are ``2 * seq_len`` (+ BOS) long).
        n_seqs: sequences averaged over. seed: random seed.
        layers: which layers (default all).

    Returns:
        DataFrame ``layer, head_idx, prev_token_score, induction_score, tl_prev_token_score,
        tl_induction_score`` (attention probabilities in [0, 1]).

    Memory: the ``[rows, head, pos, pos]`` patterns are read a chunk of layers at a time under the
    memory budget (:func:`read_layers`); the scores do not depend on the chunk.

    Raises:
        AttentionError: sequences longer than the model's context, or an unknown layer.
        MemoryBudgetError: one layer's patterns and the forward pass do not fit ``run.memory_budget``.
    """
    check_repeated_length(model, seq_len)
    layers = list(range(int(model.cfg.n_layers))) if layers is None else [check_layer(model, L, "layers") for L in layers]
    batch, half = repeated_random_tokens(model, seq_len, n_seqs, seed)
    per: dict[tuple[int, int], np.ndarray] = {}  # (row, layer) -> [head, 4]; a retried chunk overwrites

    def consume(cache: dict[str, torch.Tensor]) -> None:
        for name, pat in cache.items():
            L = int(name.split(".")[1])
            for b in range(batch.size):
                per[(b, L)] = pattern_scores(pat[b].float().cpu(), batch.tokens[b].cpu(), half)

    read_layers(model, batch, layers, ("head_pattern",), consume, what="head scores",
                fix="lower seq_len or n_seqs")
    rows = []
    acc: dict = {}
    for b in range(batch.size):  # summed over rows in row order, as one pass over every layer did
        for L in layers:
            sc = per[(b, L)]
            for h in range(sc.shape[0]):
                acc.setdefault((L, h), np.zeros(4))
                acc[(L, h)] += sc[h]
    for (L, h), a in sorted(acc.items()):
        a = a / batch.size
        rows.append({"layer": L, "head_idx": h, "prev_token_score": a[0], "induction_score": a[1],
                     "tl_prev_token_score": a[2], "tl_induction_score": a[3]})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# attention from one query position per row, at many layers, in one batched pass


class _AllRead(Exception):
    """Raised by the last pattern hook of a batch to end the forward pass early."""


@dataclass
class QueryAttention:
    """Attention *from one query position per row*, at several layers and heads.

    Positions are the row's own: index ``k`` is token ``k`` of the row's ids (BOS counted when the
    model prepends one), whatever padding the batch had.

    Attributes:
        layers: the layers read (block indices), in the order of the ``layer`` axis.
        heads: the (query) heads read, in the order of the ``head`` axis.
        query_pos: ``[row]`` index of the query token in each row's ids.
        lengths: ``[row]`` number of tokens of each row.
        weights: ``[row, layer, head, key]`` softmax weights (probabilities) of the query over keys
            ``0..query_pos[row]``; NaN for ``key > query_pos[row]`` (float32).
        scores: the same for the pre-softmax scores (``q.k / sqrt(d_head)``), or None when not read.
    """

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    query_pos: Int[torch.Tensor, " row"]
    lengths: Int[torch.Tensor, " row"]
    weights: Float[torch.Tensor, "row layer head key"]
    scores: Optional[Float[torch.Tensor, "row layer head key"]] = None

    def key_mask(self) -> torch.Tensor:
        """``[row, key]`` True where key ``k <= query_pos[row]`` (a key the query sees)."""
        k = torch.arange(self.weights.shape[-1])
        return k[None, :] <= self.query_pos[:, None]

    def at(self, key_pos: Int[torch.Tensor, "row n_keys"], scores: bool = False
           ) -> Float[torch.Tensor, "row layer head n_keys"]:
        """``[row, layer, head, n_keys]`` weights (or scores) at ``key_pos`` (``[row, n_keys]``,
        indices into each row's ids). A key after the query is masked by causality: weight 0
        (score ``-inf``).

        Raises:
            AttentionError: ``scores=True`` when the scores were not read.
        """
        src = self.scores if scores else self.weights
        if src is None:
            raise AttentionError("scores were not read; pass scores=True")
        kp = torch.as_tensor(key_pos, dtype=torch.long)
        R, nL, nH, K = src.shape
        idx = kp.clamp(0, K - 1)[:, None, None, :].expand(R, nL, nH, kp.shape[1])
        out = src.gather(3, idx)
        future = (kp > self.query_pos[:, None])[:, None, None, :].expand_as(out)
        return out.masked_fill(future, float("-inf") if scores else 0.0)


def _check_heads_of(model: HookedModel, heads, layers: Sequence[int], field: str = "heads") -> list[int]:
    out: list[int] = []
    for L in layers:
        out = check_heads(model, heads, field, layer=L)
    return out


def _forward_until_read(model: HookedModel, batch: Batch, hooks: list, names: list[str]) -> None:
    """Forward ``batch`` with ``hooks`` (gated ones enabled); a hook raising :class:`_AllRead`
    ends the pass early."""
    from .hooks import enabled_hooks, fwd_hooks

    with enabled_hooks(model, names), fwd_hooks(model, hooks):
        try:
            model(batch.tokens, **({"attention_mask": batch.attention_mask} if batch.needs_mask else {}))
        except _AllRead:
            pass


def layer_chunk(model: HookedModel, batch: Batch, n_layers_read: int, n_kinds: int = 1, what: str = "attention patterns",
                fix: str = "shorten the prompts or read fewer layers") -> int:
    """How many layers' ``[batch, head, pos, pos]`` attention tensors to keep from one forward pass.

    One layer costs ``n_kinds`` tensors of ``[batch, n_heads, pos, pos]`` in the model's dtype plus
    a float32 copy each (what the callers read); the forward pass of the batch
    (:func:`tracekit.model.readout.forward_row_bytes` per row, stopped after the last layer read, so
    without logits) is held besides.

    Raises:
        MemoryBudgetError: one layer (plus the forward pass) does not fit ``run.memory_budget``.
    """
    from .core.budget import bytes_of, chunk_rows
    from .model.load import model_device
    from .model.readout import forward_row_bytes

    b, T = int(batch.tokens.shape[0]), int(batch.tokens.shape[1])
    heads = int(model.cfg.n_heads)
    dt = getattr(model.cfg, "dtype", None)
    dt = dt if isinstance(dt, torch.dtype) else torch.float32
    per_layer = n_kinds * (bytes_of(b, heads, T, T, dtype=dt) + bytes_of(b, heads, T, T))
    return chunk_rows(per_layer, max(1, n_layers_read), what=what, device=model_device(model),
                      fixed=b * forward_row_bytes(model, T), unit=f"layer ({b} rows x {T} tokens)", fix=fix)


def read_layers(model: HookedModel, batch: Batch, layers: Sequence[int], kinds: Sequence[str],
                consume: Callable[[dict[str, torch.Tensor]], None], what: str = "attention patterns",
                fix: str = "shorten the prompts or read fewer layers") -> int:
    """Read whole ``[batch, head, q, k]`` attention tensors of ``layers`` a chunk of layers at a time.

    Each chunk is one forward pass of ``batch`` that keeps the hooks ``kinds`` (e.g.
    ``head_pattern``, ``head_scores``) of its layers and stops after the last of them (no logits);
    ``consume`` gets ``{hook name: tensor}`` per chunk (the model's dtype, its device). Chunks come
    from :func:`layer_chunk` under the memory budget and run through
    :func:`tracekit.core.budget.run_chunked` (an out-of-memory error halves the chunk and retries
    it, so ``consume`` must overwrite, not add). A layer's tensors are those of one forward pass over
    every layer (the same operations).

    Returns:
        The chunk size used (layers per forward pass).

    Raises:
        MemoryBudgetError: one layer does not fit ``run.memory_budget`` (before any forward pass).
        HookError: a hook missing on this architecture, or one that never fired.
    """
    from .core.budget import run_chunked
    from .hooks import check_hooks, enabled_hooks, fwd_hooks
    from .tokens import forward_kwargs

    layers = list(layers)
    check_hooks(model, [hook(k, L) for L in layers for k in kinds], "hooks")
    chunk = layer_chunk(model, batch, len(layers), len(kinds), what, fix)

    def one(sl: slice) -> None:
        names = [hook(k, L) for L in layers[sl] for k in kinds]
        got: dict[str, torch.Tensor] = {}

        def keep(act, hook):
            got[hook.name] = act.detach()
            if len(got) == len(names):
                raise _AllRead

        with enabled_hooks(model, names), fwd_hooks(model, [(n, keep) for n in names]):
            try:
                model(batch.tokens, **forward_kwargs(batch))
            except _AllRead:
                pass
        missing = [n for n in names if n not in got]
        if missing:
            raise HookError(f"hooks: {missing} never fired in the forward pass")
        consume(got)

    return run_chunked(one, len(layers), chunk, what=what)


def attention_batch_size(model: HookedModel, ids: Sequence[Sequence[int]], batch_size: int, keep_per_row: int = 0,
                         what: str = "attention rows", fix: str = "shorten the prompts") -> int:
    """Rows per forward pass: ``batch_size`` capped by the memory budget. One row costs its forward
    pass at the longest row's length (:func:`tracekit.model.readout.forward_row_bytes`, stopped
    before the logits) plus ``keep_per_row`` bytes kept from it. Under a budget the rows run in
    smaller padded batches (padded less, so the numbers can differ in float32 rounding).

    Raises:
        MemoryBudgetError: one row does not fit ``run.memory_budget`` (before any forward pass).
    """
    from .core.budget import chunk_rows
    from .model.load import model_device
    from .model.readout import forward_row_bytes

    T = max((len(x) for x in ids), default=1)
    return chunk_rows(forward_row_bytes(model, T) + int(keep_per_row), max(1, int(batch_size)), what=what,
                      device=model_device(model), unit=f"row ({T} tokens)", fix=fix)


def _read_query_rows(model: HookedModel, batch: Batch, names: list[str], qpad: torch.Tensor, kidx: torch.Tensor,
                     head_t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{hook name: [b, head, kb]}``: each pattern/score hook's query row (padded index ``qpad``)
    of the heads ``head_t`` at the padded key indices ``kidx`` (``[b, kb]``), on the CPU."""
    ar = torch.arange(batch.size, device=batch.tokens.device)
    got: dict[str, torch.Tensor] = {}

    def make_hook(name: str):
        def fn(act, hook=None):
            x = act[ar, :, qpad]  # [b, head, width]: the query's row in each prompt
            x = x.index_select(1, head_t)
            got[name] = x.gather(2, kidx[:, None, :].expand(-1, x.shape[1], -1)).float().cpu()  # [b, head, kb]
            if len(got) == len(names):
                raise _AllRead

        return fn

    _forward_until_read(model, batch, [(nm, make_hook(nm)) for nm in names], names)
    return got


def _read_full(model: HookedModel, batch: Batch, pairs: Sequence[tuple[int, int]], names: list[str]
               ) -> dict[tuple[int, int], torch.Tensor]:
    """``{(layer, head): [b, pos, pos]}`` full padded patterns of the pairs, on the CPU."""
    got: dict[tuple[int, int], torch.Tensor] = {}
    fired: set[int] = set()
    layers = sorted({L for L, _ in pairs})

    def make_hook(L: int):
        def fn(act, hook=None):
            for LL, h in pairs:
                if LL == L:
                    got[(L, h)] = act[:, h].float().cpu()
            fired.add(L)
            if len(fired) == len(layers):
                raise _AllRead

        return fn

    _forward_until_read(model, batch, [(hook("head_pattern", L), make_hook(L)) for L in layers], names)
    return got


@torch.no_grad()
def query_attention(model: HookedModel, ids: Sequence[Sequence[int]], query_pos: Sequence[int],
                    layers: Union[str, Sequence[int], None] = None, heads: Union[str, Sequence[int], None] = None,
                    batch_size: int = 16, scores: bool = False, progress: Optional[Callable[[int], None]] = None,
                    field: str = "prompts") -> QueryAttention:
    """Attention from one query position per row at every chosen layer and head, in one batched
    forward pass per ``batch_size`` rows.

    A forward hook on each ``blocks.L.attn.hook_pattern`` (``[batch, head, query, key]``) keeps the
    query's row of the chosen heads at the row's real tokens only (index ``offset + k`` where
    ``offset`` is the row's left-pad count, 0 under right padding), so memory is
    ``rows x layers x heads x keys`` however long the prompts, and the pass ends once the last
    layer read has fired (no later block, final norm or unembedding). Rows are batched in order of
    length (less padding) and returned in the given order. Padded rows get the attention mask, so
    no real query attends to a pad.

    Args:
        model: a hooked model (TransformerBridge).
        ids: each row's token ids (BOS included as the model prepends it; e.g.
            :attr:`tracekit.dataset.PreparedDataset.ids`).
        query_pos: each row's query position, an index into its own ids (0 <= q < len).
        layers: block indices (``all``/None: every block; negative from the end).
        heads: query-head indices (``all``/None: every head).
        batch_size: rows per forward pass (capped by the memory budget: :func:`attention_batch_size`).
        scores: also read ``hook_attn_scores`` (pre-softmax scores, ``q.k / sqrt(d_head)``).
        progress: called with the number of rows done after each batch.
        field: config field quoted in errors.

    Returns:
        :class:`QueryAttention` (CPU tensors; ``weights``: ``[row, layer, head, key]``, probabilities).

    Raises:
        AttentionError: an unknown layer or head, a query position outside its row, or lengths
            that do not match. HookError: a pattern hook missing on this architecture.
        TokenizationError: rows of different lengths on an architecture that cannot batch them
            (run with ``batch_size: 1``).
        MemoryBudgetError: one row's forward pass does not fit ``run.memory_budget``.

    Source: TransformerLens ``run_with_cache(names_filter=...)`` of ``hook_pattern`` narrowed to
    the query row (as :func:`tracekit.fastpath.residual_stream` narrows residual reads); the
    END -> IO / S attention reading of Wang et al. 2022, "Interpretability in the Wild" (IOI).
    """
    # Long (reason): one batched pass with hooks that keep only the query rows of the chosen heads; setup, hooks and early stop must share the batch and the per-row query indices.
    from .hooks import check_hooks

    n = len(ids)
    if n == 0:
        raise AttentionError(f"{field}: no rows")
    if len(query_pos) != n:
        raise AttentionError(f"query: {len(query_pos)} query positions for {n} rows")
    for i, (seq, q) in enumerate(zip(ids, query_pos)):
        if not 0 <= int(q) < len(seq):
            raise AttentionError(f"query: position {q} is outside row {i} ({len(seq)} tokens)")
    Ls = check_layers(model, layers, "layers")
    Hs = _check_heads_of(model, heads, Ls)
    kinds = ["head_pattern"] + (["head_scores"] if scores else [])
    names = [hook(k, L) for L in Ls for k in kinds]
    check_hooks(model, names, "hooks")
    qs = torch.tensor([int(q) for q in query_pos], dtype=torch.long)
    lengths = torch.tensor([len(s) for s in ids], dtype=torch.long)
    K = int(qs.max()) + 1
    out = {k: torch.full((n, len(Ls), len(Hs), K), float("nan")) for k in kinds}
    order = sorted(range(n), key=lambda i: (len(ids[i]), i))
    batch_size = attention_batch_size(model, ids, batch_size, 8 * len(names) * len(Hs) * K, "query attention")
    for sl in chunks(n, batch_size):
        rows = order[sl]
        batch = pad_rows(model, [ids[i] for i in rows], field)
        dev = batch.tokens.device
        b = len(rows)
        off = torch.tensor(batch.offsets, dtype=torch.long, device=dev)
        q = qs[rows].to(dev)
        kb = int(q.max()) + 1
        kk = torch.arange(kb, device=dev)
        kidx = (off[:, None] + kk[None, :]).clamp(max=batch.tokens.shape[1] - 1)  # [b, kb]: the row's own keys
        invalid = (kk[None, :] > q[:, None]).cpu()
        got = _read_query_rows(model, batch, names, off + q, kidx, torch.tensor(Hs, dtype=torch.long, device=dev))
        missing = [nm for nm in names if nm not in got]
        if missing:
            raise HookError(f"hooks: {missing} never fired in the forward pass")
        ridx = torch.tensor(rows, dtype=torch.long)
        for k in kinds:
            for li, L in enumerate(Ls):
                x = got[hook(k, L)].masked_fill(invalid[:, None, :], float("nan"))
                out[k][ridx, li, :, :kb] = x
        if progress is not None:
            progress(b)
    return QueryAttention(tuple(Ls), tuple(Hs), qs, lengths, out["head_pattern"], out.get("head_scores"))


@torch.no_grad()
def full_patterns(model: HookedModel, ids: Sequence[Sequence[int]], pairs: Sequence[tuple[int, int]], batch_size: int = 16,
                  field: str = "prompts") -> dict[tuple[int, int], list[Float[torch.Tensor, "q k"]]]:
    """The full causal pattern ``[len, len]`` (query x key, the row's own positions) of some
    ``(layer, head)`` pairs on each row, in one batched forward pass per ``batch_size`` rows that
    stops after the last layer read (``batch_size`` capped by the memory budget:
    :func:`attention_batch_size`, counting the ``[pos, pos]`` patterns kept per row and pair).

    Raises:
        AttentionError: an unknown layer or head. TokenizationError: as :func:`tracekit.tokens.pad_rows`.
        MemoryBudgetError: one row does not fit ``run.memory_budget``.
    """
    from .hooks import check_hooks

    pairs = [(check_layer(model, L, "plot_heads"), int(h)) for L, h in pairs]
    for L, h in pairs:
        check_heads(model, [h], "plot_heads", layer=L)
    layers = sorted({L for L, _ in pairs})
    names = [hook("head_pattern", L) for L in layers]
    check_hooks(model, names, "hooks")
    out: dict[tuple[int, int], list] = {p: [None] * len(ids) for p in pairs}
    T = max((len(x) for x in ids), default=1)
    batch_size = attention_batch_size(model, ids, batch_size, 8 * len(pairs) * T * T, "full attention patterns",
                                      "shorten the prompts or show fewer heads")
    for sl in chunks(len(ids), batch_size):
        rows = list(range(len(ids)))[sl]
        batch = pad_rows(model, [ids[i] for i in rows], field)
        got = _read_full(model, batch, pairs, names)
        for j, i in enumerate(rows):
            o, m = batch.offsets[j], batch.lengths[j]
            for p in pairs:
                out[p][i] = got[p][j, o:o + m, o:o + m]
    return out


def label_query_rows(weights: Float[torch.Tensor, "row layer head key"], query_pos: Int[torch.Tensor, " row"],
                     dominance: float = 0.4, spread_entropy: float = 0.9) -> dict[str, torch.Tensor]:
    """:func:`classify_heads` at one query per row, for every (row, layer, head) at once.

    Args:
        weights: ``[row, layer, head, key]`` the query's attention weights over keys
            ``0..query_pos[row]`` (anything beyond is ignored; :attr:`QueryAttention.weights`).
        query_pos: ``[row]`` the query position of each row.

    Returns:
        ``[row, layer, head]`` tensors (float64 masses, probabilities): ``self_weight`` (on the
        query token), ``first_weight`` (key 0: BOS when prepended), ``previous_weight`` (key
        ``q-1``; 0 at ``q = 0``), ``entropy_norm`` (``H / log(q+1)``, 0 at ``q = 0``),
        ``max_key_weight``, ``top_key_pos`` (int) and ``label`` (int index into
        :data:`HEAD_LABELS`: the largest of self/first/previous if >= ``dominance``, else
        ``spread`` if ``entropy_norm >= spread_entropy``, else ``content``).

    Raises nothing (NaN beyond each row's query is ignored). Source: the self / previous-token /
    first-token (BOS) / broad head categories of Clark et al. 2019, "What Does BERT Look At?",
    as thresholds of :func:`classify_heads` (same numbers, tested).
    """
    w = weights.double()
    R, nL, nH, K = w.shape
    q = torch.as_tensor(query_pos, dtype=torch.long)
    valid = (torch.arange(K)[None, :] <= q[:, None])[:, None, None, :].expand_as(w)
    w = torch.where(valid, w.nan_to_num(0.0), torch.zeros_like(w))
    qi = q[:, None, None, None].expand(R, nL, nH, 1)
    self_w = w.gather(3, qi)[..., 0]
    first = w[..., 0]
    prev = w.gather(3, (qi - 1).clamp(min=0))[..., 0] * (q >= 1)[:, None, None].double()
    c = w.clamp_min(1e-30)
    ent = torch.where(valid, -(c * c.log()), torch.zeros_like(w)).sum(-1)
    logn = torch.log((q + 1).double())[:, None, None]
    ent = torch.where(q[:, None, None] >= 1, ent / logn.clamp_min(1e-30), torch.zeros_like(ent))
    mx, arg = torch.where(valid, w, torch.full_like(w, -1.0)).max(-1)
    cands = torch.stack([self_w, first, prev], -1)
    best_v, best = cands.max(-1)  # first maximal value on ties: self, first, previous (as classify_heads)
    label = torch.where(best_v >= dominance, best,
                        torch.where(ent >= spread_entropy, torch.full_like(best, 3), torch.full_like(best, 4)))
    return {"self_weight": self_w, "first_weight": first, "previous_weight": prev, "entropy_norm": ent,
            "max_key_weight": mx, "top_key_pos": arg, "label": label}


def head_stats(values: Float[np.ndarray, "row layer head key"]) -> dict[str, np.ndarray]:
    """Per (layer, head, key) statistics over rows, NaN entries (a row without that key) left out.

    Returns:
        ``[layer, head, key]`` arrays: ``n_rows`` (rows with a value), ``mean``, ``std`` (sample
        standard deviation, ``ddof=1``: NaN with one row), ``q1`` / ``median`` / ``q3`` (linear
        interpolation, as ``pandas.Series.quantile``) and ``iqr = q3 - q1``, in the units of
        ``values`` (attention probabilities for weights). Raises nothing (all-NaN cells give NaN).
    """
    v = np.asarray(values, dtype=np.float64)
    n = (~np.isnan(v)).sum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(v, 0)
        std = np.where(n > 1, np.nanstd(v, 0, ddof=1), np.nan)
        q1, med, q3 = np.nanquantile(v, [0.25, 0.5, 0.75], axis=0)
    return {"n_rows": n, "mean": mean, "std": std, "q1": q1, "median": med, "q3": q3, "iqr": q3 - q1}
