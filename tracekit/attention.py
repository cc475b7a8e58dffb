"""Attention heads: who attends to what, and what kind of head it is.

Engine of the ``attention_pattern`` and ``head_scan`` kinds (:mod:`tracekit.experiments.attention`).

* :func:`attention_pattern`: for a prompt and a layer (block index), every head's raw attention scores
  (``blocks.L.attn.hook_attn_scores``: ``q.k / sqrt(d_head)`` after the causal mask, future keys
  ``-inf``) and softmax weights (``blocks.L.attn.hook_pattern``, each query row sums to 1, future
  keys get 0). This is the seed article's "Layer 0 Head 6, query ' is'" view (GPT-2:
  France 35%, capital 35%, The 22%). With grouped-query attention (SmolLM2: 9 query heads share
  3 key/value heads) heads are indexed by *query* head, as in ``hook_pattern``.
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

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from .core.sites import check_heads, check_layer, hook
from .errors import AttentionError
from .tokens import Position, PositionSpec, encode, pad_ids, parse_position, run_with_cache, str_tokens, tokenize

__all__ = ["AttentionError", "LayerAttention", "attention_pattern", "resolve_position", "classify_heads",
           "repeated_random_tokens", "head_scores", "pattern_scores", "check_heads", "check_layer", "HEAD_LABELS",
           "POSITION_FORMS"]

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
        """One row per (head, key position <= query): ``score`` (pre-softmax) and ``weight``
        (probability)."""
        heads = list(range(self.weights.shape[0])) if heads is None else heads
        rows = []
        for h in heads:
            for k in range(query + 1):
                rows.append({"layer": self.layer, "head": h, "query_pos": query, "query_token": self.tokens[query],
                             "key_pos": k, "key_token": self.tokens[k], "score": float(self.scores[h, query, k]),
                             "weight": float(self.weights[h, query, k])})
        return pd.DataFrame(rows)

    def frame(self, heads: Optional[Sequence[int]] = None) -> pd.DataFrame:
        """Full causal pattern of some heads: one row per (head, query, key <= query)."""
        heads = list(range(self.weights.shape[0])) if heads is None else heads
        n = len(self.tokens)
        q, k = np.tril_indices(n)
        frames = []
        for h in heads:
            frames.append(pd.DataFrame({"layer": self.layer, "head": h, "query_pos": q, "key_pos": k,
                                        "score": self.scores[h].numpy()[q, k], "weight": self.weights[h].numpy()[q, k]}))
        return pd.concat(frames, ignore_index=True)


def resolve_position(model, prompt: str, position: Union[PositionSpec, Position] = "last",
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
def attention_pattern(model, prompt: str, layer: int) -> LayerAttention:
    """Scores and weights of every head of ``layer`` on ``prompt`` (one forward pass; caches only
    ``hook_attn_scores`` and ``hook_pattern`` of that layer).

    Raises:
        AttentionError: unknown layer.
    """
    L = check_layer(model, layer)
    names = [hook("head_scores", L), hook("head_pattern", L)]
    batch = tokenize(model, [prompt])
    _, cache = run_with_cache(model, batch, names)
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


def repeated_random_tokens(model, seq_len: int = 40, n_seqs: int = 4, seed: int = 0):
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
def head_scores(model, seq_len: int = 40, n_seqs: int = 4, seed: int = 0,
                layers: Optional[Sequence[int]] = None) -> pd.DataFrame:
    """Previous-token and induction scores of every head on repeated random tokens.

    Args:
        seq_len: random tokens per half (sequences are ``2 * seq_len`` (+ BOS) long).
        n_seqs: sequences averaged over. seed: random seed.
        layers: which layers (default all).

    Returns:
        DataFrame ``layer, head, prev_token_score, induction_score, tl_prev_token_score,
        tl_induction_score`` (attention probabilities in [0, 1]).

    Raises:
        AttentionError: sequences longer than the model's context, or an unknown layer.
    """
    n_ctx = int(getattr(model.cfg, "n_ctx", 1 << 30) or (1 << 30))
    if 2 * seq_len + 1 > n_ctx:
        raise AttentionError(f"seq_len: 2 x {seq_len} + 1 tokens exceed the model's context of {n_ctx}; lower seq_len")
    layers = list(range(int(model.cfg.n_layers))) if layers is None else [check_layer(model, L, "layers") for L in layers]
    batch, half = repeated_random_tokens(model, seq_len, n_seqs, seed)
    names = [hook("head_pattern", L) for L in layers]
    _, cache = run_with_cache(model, batch, names)
    rows = []
    acc: dict = {}
    for b in range(batch.size):
        toks = batch.tokens[b].cpu()
        for L in layers:
            sc = pattern_scores(cache[hook("head_pattern", L)][b].float().cpu(), toks, half)
            for h in range(sc.shape[0]):
                acc.setdefault((L, h), np.zeros(4))
                acc[(L, h)] += sc[h]
    for (L, h), a in sorted(acc.items()):
        a = a / batch.size
        rows.append({"layer": L, "head": h, "prev_token_score": a[0], "induction_score": a[1],
                     "tl_prev_token_score": a[2], "tl_induction_score": a[3]})
    return pd.DataFrame(rows)
