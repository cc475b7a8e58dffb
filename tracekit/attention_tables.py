"""The tables of the ``attention_pattern`` kind, built from one :class:`tracekit.attention.QueryAttention`.

Engine side of :class:`tracekit.experiments.attention.AttentionPattern` (its result class, summary
and figures are in :mod:`tracekit.experiments.attention_tables`): :func:`query_tables` turns the
batched read of :func:`tracekit.attention.query_attention` into the tidy ``pattern``, ``rows``,
``heads``, ``labels`` and ``tokens`` tables, picks the shown heads and (on request) tabulates their
full causal patterns (one more forward pass of the first rows). Columns are described in
:class:`tracekit.experiments.attention_tables.AttentionPatternResult`.

Units: ``weight`` is a probability (each query row sums to 1 over its real keys), ``score`` the
pre-softmax attention score (``q.k / sqrt(d_head)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional, cast

import numpy as np
import pandas as pd
import torch

from .attention import HEAD_LABELS, QueryAttention, full_patterns, head_stats, label_query_rows
from .dataset import PreparedDataset
from .model.info import HookedModel

__all__ = ["QueryTables", "object_array", "query_tables"]


def object_array(items: Iterable[object]) -> np.ndarray:
    """A 1-d ``dtype=object`` array of ``items`` (strings kept as Python objects, so fancy indexing
    by position keeps them whole)."""
    seq = list(items)
    out = np.empty(len(seq), dtype=object)
    out[:] = seq
    return out


@dataclass(frozen=True)
class QueryTables:
    """What :func:`query_tables` builds.

    Attributes:
        tables: ``pattern``, ``rows``, ``heads``, ``labels``, ``tokens`` (and ``full_pattern`` when asked).
        key_names: the key names (the named keys, or the positions ``"0".."K-1"`` for ``keys: all``).
        shown: the shown ``[layer, head]`` pairs.
        row_ids: each row's dataset ``row_id``.
        query_pos: each row's query index (into its own ids, BOS counted).
        query_tokens: the token at each row's query.
        layers / heads: the layers and heads read, in the order of the tables' axes.
        max_abs_row_sum_error: max over rows, layers and heads of ``|sum of the query's weights - 1|``.
    """

    tables: dict[str, pd.DataFrame]
    key_names: list[str]
    shown: list[list[int]]
    row_ids: list[int]
    query_pos: list[int]
    query_tokens: list[str]
    layers: list[int]
    heads: list[int]
    max_abs_row_sum_error: float


def _names_at(data: PreparedDataset, query_pos) -> list[dict[int, list[str]]]:
    """Per row: token index -> the row's named positions there (the query's own position left out)."""
    out = []
    for e, q in zip(data.examples, query_pos):
        at: dict[int, list[str]] = {}
        for name, p in e.positions.items():
            if int(p) != int(q):
                at.setdefault(int(p), []).append(str(name))
        out.append(at)
    return out


def query_tables(model: HookedModel, data: PreparedDataset, ids: Sequence[Sequence[int]], qa: QueryAttention,
                 key_names: Optional[Sequence[str]], key_pos: Sequence[Sequence[int]],
                 plot_heads: Optional[Sequence[tuple[int, int]]], *, dominance: float = 0.4,
                 spread_entropy: float = 0.9, n_plot_heads: int = 3, full_pattern: bool = False,
                 plot_rows: int = 6, batch_size: int = 16) -> QueryTables:
    """The tables of one attention read (``qa``, from :func:`tracekit.attention.query_attention` on
    ``ids``, the rows of ``data`` in order).

    Args:
        model: the model read (its tokenizer decodes the tokens; ``full_pattern`` runs it again).
        data: the prepared rows (``row_id`` and fields of each row).
        ids: each row's token ids (BOS counted), as read into ``qa``.
        qa: weights ``[row, layer, head, key]`` (and scores) at each row's query.
        key_names: the named keys, or None for every key ``<= query`` (``keys: all``).
        key_pos: ``[row][key]`` each named key's index in the row's ids (unused with ``key_names=None``).
        plot_heads: the shown ``(layer, head)`` pairs, or None: the ``n_plot_heads`` heads with the
            largest mean weight on the first key (``keys: all``: on one key other than the first token).
        dominance: threshold of the self / first / previous head labels (:func:`tracekit.attention.label_query_rows`).
        spread_entropy: threshold of the ``spread`` head label (normalised entropy).
        n_plot_heads: heads shown by default.
        full_pattern: also tabulate the shown heads' full causal patterns on the first ``plot_rows`` rows.
        plot_rows: rows of the full pattern.
        batch_size: rows per forward pass of the full pattern.

    Returns:
        :class:`QueryTables` (weights are probabilities, scores logits of the softmax).
    """
    Ls, Hs = np.asarray(qa.layers), np.asarray(qa.heads)
    W = qa.weights.numpy()
    S = qa.scores.numpy() if qa.scores is not None else None
    R, nL, nH, K = W.shape
    row_ids = np.asarray([e.row_id for e in data.examples], dtype=np.int64)
    qp = qa.query_pos.numpy()
    vocab: dict[int, str] = {}
    tok = model.tokenizer

    def dec(i: int) -> str:
        if i not in vocab:
            vocab[i] = tok.decode([int(i)])
        return vocab[i]

    toks = [[dec(i) for i in row] for row in ids]
    width = max(len(t) for t in toks)
    T = np.full((R, width), "", dtype=object)
    for r, t in enumerate(toks):
        T[r, : len(t)] = t
    qtok = T[np.arange(R), qp]

    # pattern: every key <= query
    mask = np.broadcast_to(qa.key_mask().numpy()[:, None, None, :], W.shape)
    r, li, hi, k = np.nonzero(mask)
    pattern = {"row_id": row_ids[r], "layer": Ls[li], "head_idx": Hs[hi], "query_pos": qp[r], "query_token": qtok[r],
               "key_pos": k, "key_token": T[r, k], "weight": W[r, li, hi, k].astype(np.float64)}
    if S is not None:
        pattern["score"] = S[r, li, hi, k].astype(np.float64)
    tables = {"pattern": pd.DataFrame(pattern)}

    # the per-key array [row, layer, head, key] behind the rows and heads tables
    if key_names is not None:
        names = list(key_names)
        KP = torch.tensor(key_pos, dtype=torch.long).reshape(R, len(names))
        Wk = qa.at(KP).numpy()
        Sk = qa.at(KP, scores=True).numpy() if S is not None else None
        KPn = KP.numpy()
        r, li, hi, j = (a.reshape(-1) for a in np.indices(Wk.shape))
        kpos = KPn[r, j]
        rows = {"row_id": row_ids[r], "layer": Ls[li], "head_idx": Hs[hi], "key": object_array(names)[j],
                "key_pos": kpos, "key_token": T[r, kpos], "query_pos": qp[r], "query_token": qtok[r],
                "weight": Wk[r, li, hi, j].astype(np.float64)}
        if Sk is not None:
            rows["score"] = Sk[r, li, hi, j].astype(np.float64)
    else:
        names = [str(x) for x in range(K)]
        Wk, Sk = W, S
        rows = {"row_id": pattern["row_id"], "layer": pattern["layer"], "head_idx": pattern["head_idx"],
                "key": object_array(names)[pattern["key_pos"]], "key_pos": pattern["key_pos"],
                "key_token": pattern["key_token"], "query_pos": pattern["query_pos"],
                "query_token": pattern["query_token"], "weight": pattern["weight"]}
        if S is not None:
            rows["score"] = pattern["score"]
        r = np.nonzero(mask)[0]
    rows_df = pd.DataFrame(rows)
    frame = data.frame().drop(columns=["row_id"])
    frame = frame.rename(columns={c: f"extra_{c}" for c in frame.columns if c in rows_df.columns})
    tables["rows"] = pd.concat([rows_df, frame.iloc[r].reset_index(drop=True)], axis=1)

    # per-head aggregates over rows
    st = head_stats(Wk)
    li, hi, j = (a.reshape(-1) for a in np.indices(st["mean"].shape))
    heads = {"layer": Ls[li], "head_idx": Hs[hi], "key": object_array(names)[j], "n_rows": st["n_rows"][li, hi, j],
             "mean_weight": st["mean"][li, hi, j], "std_weight": st["std"][li, hi, j],
             "q1_weight": st["q1"][li, hi, j], "median_weight": st["median"][li, hi, j],
             "q3_weight": st["q3"][li, hi, j], "iqr_weight": st["iqr"][li, hi, j]}
    if Sk is not None:
        with np.errstate(invalid="ignore"):
            heads["mean_score"] = np.nanmean(Sk.astype(np.float64), 0)[li, hi, j]
    hdf = pd.DataFrame(heads)
    tables["heads"] = cast(pd.DataFrame, hdf[hdf["n_rows"] > 0]).reset_index(drop=True)  # a row mask: a table

    # labels per (row, layer, head)
    lab = label_query_rows(qa.weights, qa.query_pos, dominance, spread_entropy)
    r, li, hi = (a.reshape(-1) for a in np.indices((R, nL, nH)))
    top = lab["top_key_pos"].numpy()[r, li, hi]
    label = object_array(HEAD_LABELS)[lab["label"].numpy()[r, li, hi]]
    names_at = _names_at(data, qp)
    key_role = object_array("/".join(names_at[int(a)].get(int(b), [])) for a, b in zip(r, top))
    strong = lab["max_key_weight"].numpy()[r, li, hi] >= dominance
    tables["labels"] = pd.DataFrame({
        "row_id": row_ids[r], "layer": Ls[li], "head_idx": Hs[hi],
        **{c: lab[c].numpy()[r, li, hi] for c in ("self_weight", "first_weight", "previous_weight",
                                                     "entropy_norm", "max_key_weight")},
        "top_key_pos": top, "top_key_token": T[r, top], "top_key_role": key_role,
        "label": label,
        "role": object_array(f"attends {k}" if k and st_ else str(lb) for k, st_, lb in zip(key_role, strong, label)),
        "measured_on": "this row, one query"})
    tables["tokens"] = pd.DataFrame({"row_id": np.repeat(row_ids, [len(t) for t in toks]),
                                     "position": np.concatenate([np.arange(len(t)) for t in toks]),
                                     "token": object_array([x for t in toks for x in t])})

    # the shown heads
    if plot_heads is not None:
        shown = [list(p) for p in plot_heads]
    else:
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            rank = (st["mean"][:, :, 0] if key_names is not None
                    else np.nanmean(np.nanmax(np.where(np.isnan(W[..., 1:]), -np.inf, W[..., 1:]), -1)
                                    if K > 1 else W[..., 0], 0))
        rank = np.nan_to_num(np.where(np.isfinite(rank), rank, np.nan), nan=-1.0)
        order = np.lexsort((np.arange(rank.size), -rank.reshape(-1)))[:n_plot_heads]
        shown = [[int(Ls[o // nH]), int(Hs[o % nH])] for o in order]
    if full_pattern:
        n_show = min(len(data), plot_rows)
        fp = full_patterns(model, ids[:n_show], [(p[0], p[1]) for p in shown], batch_size)
        parts = []
        for (L, H), mats in fp.items():
            for i, mat in enumerate(mats):
                qq, kk = np.tril_indices(mat.shape[0])
                parts.append(pd.DataFrame({"row_id": row_ids[i], "layer": L, "head_idx": H, "query_pos": qq,
                                           "key_pos": kk, "weight": mat.numpy()[qq, kk].astype(np.float64)}))
        tables["full_pattern"] = pd.concat(parts, ignore_index=True)

    sums = np.nansum(W, -1)
    return QueryTables(tables, names, shown, row_ids.tolist(), qp.tolist(), [str(x) for x in qtok],
                       [int(x) for x in Ls], [int(x) for x in Hs], float(np.abs(sums - 1).max()))
