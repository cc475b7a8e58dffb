# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
# Over 600 lines (reason): two kinds (attention_pattern, head_scan) and their result classes; attention_pattern's per-row tables and figures (#21) are the piece to split into attention_tables.py.
"""Attention heads as experiment kinds.

* ``kind: attention_pattern`` (:class:`AttentionPattern`): over a dataset (or prompts), the
  attention *from one query position per row* (``query: END``, ``last``, an index or
  ``token:<text>``) to named key positions (``keys: [IO, S1, S2]``, or ``all``), at any set of
  layers and heads, in one batched forward pass per ``batch_size`` rows
  (:func:`tracekit.attention.query_attention`). Tables per row and per head (mean, spread), a
  label per (row, layer, head) (self / first / previous / spread / content), small multiples of
  the chosen heads' patterns and a layer x head heatmap per key.
* ``kind: head_scan`` (:class:`HeadScan`): every head of every layer: previous-token and induction
  scores on repeated random tokens (Olsson et al. 2022; TransformerLens' head-detector patterns)
  and, for given prompts, the head labels averaged over query positions.

Units: ``score`` is the pre-softmax attention score (``q.k / sqrt(d_head)``, logits of the
softmax); ``weight`` is a probability (each query row sums to 1; future keys get 0).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
from pydantic import Field, field_validator, model_validator

from .. import plotting
from ..attention import (
    HEAD_LABELS,
    check_layer,
    check_repeated_length,
    classify_heads,
    full_patterns,
    head_scores,
    head_stats,
    label_query_rows,
    query_attention,
)
from ..core.errors import AttentionError, DatasetError, TokenizationError
from ..core.sites import check_heads, check_layers, hook
from ..dataset import DatasetSpec, PreparedDataset
from ..tokens import Position, PositionSpec, pad_ids, parse_position, run_with_cache
from .base import (
    Experiment,
    Indices,
    OptionalPrompts,
    Result,
    check_dataset_fields,
    encode_prompts,
    kind_dataset,
    register,
)

__all__ = ["AttentionPattern", "AttentionPatternInputs", "AttentionPatternResult", "HeadScan", "HeadScanInputs",
           "HeadScanResult", "QUERY_FORMS"]

#: The position forms ``query`` and each of ``keys`` accept.
QUERY_FORMS = ("int", "last", "token:<text>", "name")
#: Columns of the labels tables renamed so none shadows a DataFrame attribute (``df.first`` is a method).
LABEL_RENAMES = {"head": "head_idx", "self": "self_weight", "first": "first_weight", "previous": "previous_weight"}


@dataclass(frozen=True)
class AttentionPatternInputs:
    """What :meth:`AttentionPattern.prepare` builds once.

    Attributes:
        data: the prepared rows (ids, named positions, row fields).
        layers / heads: the layers and heads read (sorted, unique).
        query_pos: per row, the query's index into the row's ids (BOS counted).
        key_names: the key names (``None`` for ``keys: all``).
        key_pos: per row, each key's index into the row's ids (``()`` for ``keys: all``).
        plot_heads: the shown ``(layer, head)`` pairs (None: the top heads, chosen after the run).
    """

    data: PreparedDataset
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    query_pos: tuple[int, ...]
    key_names: Optional[tuple[str, ...]]
    key_pos: tuple[tuple[int, ...], ...]
    plot_heads: Optional[tuple[tuple[int, int], ...]]

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(i) for i in self.data.ids)


@dataclass(frozen=True)
class HeadScanInputs:
    """What :meth:`HeadScan.prepare` builds once: the layers scanned and each prompt's token ids."""

    layers: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]
    row_ids: tuple[int, ...] = ()


#: Retired config keys of ``attention_pattern`` and the key that replaced each.
RETIRED = {"prompt": "prompts"}


def _obj(items) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out


def _head_name(L: int, h: int) -> str:
    return f"L{int(L)}H{int(h)}"


def _tick(t: str) -> str:
    return repr(t)[1:-1][:10]


class AttentionPatternResult(Result):
    """Tables (the tidy long form; ``row_id`` is the dataset row):

    * ``pattern``: ``row_id, layer, head_idx, query_pos, query_token, key_pos, key_token, weight``
      (``score`` with ``scores: true``): the query's attention over every key ``<= query`` of each
      chosen head and row (the query row only, not the ``[pos x pos]`` pattern).
    * ``rows``: one row per (row, layer, head, key): ``row_id, layer, head_idx, key, key_pos,
      key_token, query_pos, query_token, weight`` (``score``), then the row's fields as in
      :meth:`tracekit.dataset.PreparedDataset.frame` (``prompt, target, foil, corrupted, group,
      pos_<NAME>``, extras; an extra named like one of the columns before gets ``extra_``). A key
      after the query has weight 0 (causal mask). With ``keys: all`` the keys are the positions
      ``0..query`` and ``key`` is the position as text (``"3"``).
    * ``heads``: per (layer, head_idx, key) over rows: ``n_rows, mean_weight, std_weight`` (sample
      std, ddof 1: NaN for one row), ``q1_weight, median_weight, q3_weight, iqr_weight``
      (``mean_score`` with ``scores: true``).
    * ``labels``: per (row, layer, head): ``self_weight, first_weight, previous_weight,
      entropy_norm, max_key_weight, top_key_pos, top_key_token, label``
      (:func:`tracekit.attention.label_query_rows`).
    * ``tokens``: ``row_id, position, token`` (each row's tokens, BOS included when prepended).
    * ``full_pattern`` (``full_pattern: true``): ``row_id, layer, head_idx, query_pos, key_pos,
      weight``, every query and key ``<= query`` of the shown heads on the first ``plot_rows`` rows.
    """

    config: "AttentionPattern"
    main_table = "rows"
    table_names = ("pattern", "rows", "heads", "labels", "tokens", "full_pattern")
    summary_keys = ("n_rows", "layers", "heads", "query", "keys", "query_pos_by_row", "query_token_by_row",
                    "shown_heads", "top_heads_by_key", "mean_attention_by_key", "mean_score_by_key",
                    "modal_label_by_head", "max_abs_row_sum_error")
    renamed_columns = {"labels.self": "self_weight", "labels.first": "first_weight",
                       "labels.previous": "previous_weight", "prompt_idx": "row_id"}

    def summary(self) -> dict:
        m = self.meta
        h = self.tables["heads"]
        keys = list(m["keys"])
        top_k = int(self.config.top_k)
        top: dict = {}
        for key in keys:
            sub = h[h["key"] == key].sort_values(["mean_weight", "layer", "head_idx"], ascending=[False, True, True])
            top[key] = [[int(r.layer), int(r.head_idx), round(float(r.mean_weight), 6)] for r in sub.head(top_k).itertuples()]
        shown = [tuple(p) for p in m["shown_heads"]]
        hs = h.set_index(["layer", "head_idx", "key"])
        mean_by_key = {key: {_head_name(L, H): round(float(hs.loc[(L, H, key), "mean_weight"]), 6)
                             for L, H in shown if (L, H, key) in hs.index} for key in keys}
        lab = self.tables["labels"]
        modal = {}
        for L, H in shown:
            sub = lab[(lab["layer"] == L) & (lab["head_idx"] == H)]["label"]
            counts = sub.value_counts()
            modal[_head_name(L, H)] = (min(counts.index, key=lambda x: (-counts[x], HEAD_LABELS.index(x)))
                                       if len(counts) else None)
        out = {"n_rows": int(m["n_rows"]), "layers": list(m["layers"]), "heads": list(m["heads"]),
               "query": m["query"], "keys": keys, "query_pos_by_row": list(m["query_pos_by_row"]),
               "query_token_by_row": list(m["query_token_by_row"]), "shown_heads": [list(p) for p in shown],
               "top_heads_by_key": top, "mean_attention_by_key": mean_by_key}
        if "mean_score" in h:
            out["mean_score_by_key"] = {key: {_head_name(L, H): round(float(hs.loc[(L, H, key), "mean_score"]), 6)
                                              for L, H in shown if (L, H, key) in hs.index} for key in keys}
        out["modal_label_by_head"] = modal
        out["max_abs_row_sum_error"] = float(m["max_abs_row_sum_error"])
        return out

    def report(self) -> str:
        s = self.summary()
        lay = s["layers"]
        span = f"{lay[0]}..{lay[-1]}" if len(lay) > 1 and lay == list(range(lay[0], lay[-1] + 1)) else str(lay)
        lines = [f"attention [{self.config.step_name}]: {s['n_rows']} row(s), layers {span}, {len(s['heads'])} head(s) "
                 f"each, query {s['query']} -> keys {s['keys'] if len(s['keys']) <= 12 else str(len(s['keys'])) + ' positions'}"]
        for key in s["keys"][:12]:
            lines.append(f"  top heads by mean attention {s['query']} -> {key}: " +
                         ", ".join(f"L{L}H{H} {w:.2f}" for L, H, w in s["top_heads_by_key"][key]))
        if s["shown_heads"]:
            keys = s["keys"][:12]
            rows = [[_head_name(L, H), s["modal_label_by_head"].get(_head_name(L, H)) or ""] +
                    [f"{s['mean_attention_by_key'][k].get(_head_name(L, H), float('nan')):.3f}" for k in keys]
                    for L, H in s["shown_heads"]]
            lines.append("shown heads: mean weight over rows (modal label)")
            lines.append(plotting.text_table(rows, ["head", "label", *keys]))
        return "\n".join(lines)

    def figures(self) -> dict:
        figs = {"mean_attention": self._mean_figure(), "patterns": self._patterns_figure()}
        if "full_pattern" in self.tables and len(self.tables["full_pattern"]):
            figs["full_pattern"] = self._full_figure()
        return figs

    def _mean_figure(self):
        """Layer x head heatmap of the mean attention from the query to each key (``keys: all``:
        the mean self / first / previous weight of the labels table)."""
        m = self.meta
        layers, heads = list(m["layers"]), list(m["heads"])
        if m["key_mode"] == "named":
            h = self.tables["heads"]
            panels = [(f"{m['query']} -> {k}", h[h["key"] == k], "mean_weight") for k in list(m["keys"])[:8]]
        else:
            lab = self.tables["labels"]
            g = lab.groupby(["layer", "head_idx"], as_index=False)[["self_weight", "first_weight",
                                                                    "previous_weight"]].mean()
            panels = [(f"{m['query']} -> {c.split('_')[0]} (mean weight)", g, c)
                      for c in ("self_weight", "first_weight", "previous_weight")]
        p = plotting.plt()
        n = len(panels)
        fig, axes = p.subplots(1, n, figsize=(min(40.0, 1.2 + n * max(2.6, 0.3 * len(heads) + 1.2)),
                                             max(3.0, min(20.0, 0.2 * len(layers) + 1.6))), squeeze=False,
                               layout="constrained")
        grids = [(df.pivot(index="layer", columns="head_idx", values=col)
                  .reindex(index=layers, columns=heads).to_numpy(dtype=float)) for _, df, col in panels]
        top = max([float(np.nanmax(g)) for g in grids if np.isfinite(g).any()] or [1.0])
        for ax, (title, _, _), grid in zip(axes[0], panels, grids):
            im = ax.imshow(grid, cmap="Blues", vmin=0, vmax=max(top, 0.05), aspect="auto", origin="lower",
                           interpolation="nearest")
            ax.set_xticks(range(len(heads)), [str(x) for x in heads], fontsize=7)
            step = max(1, int(np.ceil(len(layers) / 30)))
            ax.set_yticks(range(0, len(layers), step), [str(layers[i]) for i in range(0, len(layers), step)], fontsize=7)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=list(axes[0]), fraction=0.03, label="mean weight over rows (shared scale)")
        return fig

    def _patterns_figure(self):
        """Small multiples: one row of panels per dataset row (the first ``plot_rows``), one column
        per shown head; each panel is the query's attention over the row's keys, labelled with the
        tokens (named keys in orange)."""
        m = self.meta
        pat = self.tables["pattern"]
        shown = [tuple(p) for p in m["shown_heads"]]
        row_ids = list(m["row_ids"])[: int(self.config.plot_rows)]
        named = {}  # row_id -> {key_pos: key name}
        if m["key_mode"] == "named":
            r = self.tables["rows"]
            first = r[(r["layer"] == r["layer"].iloc[0]) & (r["head_idx"] == r["head_idx"].iloc[0])]
            for x in first.itertuples():
                named.setdefault(int(x.row_id), {}).setdefault(int(x.key_pos), []).append(str(x.key))
        K = int(pat[pat["row_id"].isin(row_ids)]["key_pos"].max()) + 1 if len(pat) else 1
        p = plotting.plt()
        w = min(9.0, 1.2 + 0.2 * K)
        fig, axes = p.subplots(len(row_ids), max(1, len(shown)), figsize=(min(40.0, w * max(1, len(shown))),
                                                                         min(40.0, 2.4 * len(row_ids) + 0.6)),
                               squeeze=False)
        by = {k: g for k, g in pat[pat["row_id"].isin(row_ids)].groupby(["row_id", "layer", "head_idx"])}
        for i, rid in enumerate(row_ids):
            for j, (L, H) in enumerate(shown):
                ax = axes[i][j]
                g = by.get((rid, L, H))
                if g is None:
                    ax.set_axis_off()
                    continue
                g = g.sort_values("key_pos")
                names = named.get(int(rid), {})
                colors = ["tab:orange" if int(k) in names else "tab:blue" for k in g["key_pos"]]
                ax.bar(range(len(g)), g["weight"], color=colors)
                labels = [_tick(t) + (f" [{'/'.join(names[int(k)])}]" if int(k) in names else "")
                          for k, t in zip(g["key_pos"], g["key_token"])]
                step = max(1, int(np.ceil(len(labels) / plotting.MAX_TICKS)))
                ax.set_xticks(range(0, len(labels), step), labels[::step], rotation=90, fontsize=6)
                ax.set_ylim(0, 1.05)
                ax.tick_params(axis="y", labelsize=6)
                ax.set_title(f"row {rid}, L{L}H{H}, query {_tick(str(g['query_token'].iloc[0]))!r}", fontsize=7)
        fig.tight_layout()
        return fig

    def _full_figure(self):
        """Small multiples of the full causal pattern (query x key) of the shown heads on the first
        three rows of the ``full_pattern`` table, labelled with the tokens."""
        full = self.tables["full_pattern"]
        tok = self.tables["tokens"]
        shown = [tuple(p) for p in self.meta["shown_heads"]]
        row_ids = sorted(full["row_id"].unique().tolist(), key=list(self.meta["row_ids"]).index)[:3]
        p = plotting.plt()
        n = int(full["query_pos"].max()) + 1
        side = min(7.0, 1.2 + 0.2 * n)
        fig, axes = p.subplots(len(row_ids), len(shown), figsize=(min(40.0, side * len(shown)),
                                                                  min(40.0, side * len(row_ids))), squeeze=False)
        for i, rid in enumerate(row_ids):
            toks = [_tick(t) for t in tok[tok["row_id"] == rid].sort_values("position")["token"]]
            for j, (L, H) in enumerate(shown):
                ax = axes[i][j]
                g = full[(full["row_id"] == rid) & (full["layer"] == L) & (full["head_idx"] == H)]
                m = int(g["query_pos"].max()) + 1 if len(g) else 0
                grid = np.full((m, m), np.nan)
                grid[g["query_pos"].to_numpy(), g["key_pos"].to_numpy()] = g["weight"].to_numpy()
                ax.imshow(grid, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
                step = max(1, int(np.ceil(m / plotting.MAX_TICKS)))
                ax.set_xticks(range(0, m, step), toks[:m:step], rotation=90, fontsize=6)
                ax.set_yticks(range(0, m, step), toks[:m:step], fontsize=6)
                ax.set_title(f"row {rid}, L{L}H{H}", fontsize=7)
        fig.tight_layout()
        return fig


def _parse_query(spec: PositionSpec, field: str) -> Position:
    """:func:`tracekit.tokens.parse_position` in :data:`QUERY_FORMS`; a name written with spaces
    around it (``" is"``) is a token's text, refused with the ``token:`` hint.

    Raises:
        TokenizationError: an unknown form, or a bare token string.
    """
    pos = parse_position(spec, QUERY_FORMS, field)
    if pos.kind == "name" and isinstance(spec, str) and spec != spec.strip():
        raise TokenizationError(f"{field}: {spec!r} looks like a token's text; write it 'token:{spec}' (a name "
                                "such as END has no spaces)")
    return pos


def _resolve_per_row(model, data: PreparedDataset, pos: Position, field: str) -> list[int]:
    """Each row's index (into its own ids, BOS counted) of ``pos``: a dataset name per row
    (:meth:`PreparedDataset.position`), ``last``, an index or ``token:<text>``."""
    if pos.kind == "name":
        if not data.position_names:
            raise DatasetError(f"{field}: {pos.text!r} names a dataset position, but these rows have none ({data.source}); "
                               f"use last, an index, or 'token:{pos.text}' for a token's text")
        return data.position(str(pos.text), field)
    out = []
    for e in data.examples:
        out.append(pos.resolve(model, e.prompt, e.ids, field=field)[0])
    return out


@register
class AttentionPattern(Experiment):
    """Attention from one query position per row to named keys, at any layers and heads, over a
    dataset, in one batched forward pass per ``batch_size`` rows.

    Fields:
        prompts: one text or a list (each a row, without named positions); give prompts or dataset.
        dataset: a :class:`tracekit.dataset.DatasetSpec` (``rows:`` / ``path:`` / ``generator:``)
            whose rows carry named positions (``IO``, ``S1``, ``S2``, ``END``...); give prompts or
            dataset.
        layers: ``all`` (default) or block indices (negative from the end).
        layer: one block (the older single-layer form; same as ``layers: [layer]``).
        heads: ``all`` (default) or query-head indices.
        head: the head shown (the older form, needs ``layer``: same as ``plot_heads: [[layer, head]]``;
            added to ``heads``).
        query: the query position, resolved per row after BOS and padding: a dataset name
            (``END``), ``last`` (default), an int (index into the row's tokens, BOS counted when
            prepended; negative from the end) or ``token:<text>`` (the token holding the last
            character of the last ``<text>``, e.g. ``"token: is"``).
        position: the same as ``query`` (``position`` is the name every kind gives the position it
            reads, and the one the glossary uses; give one of them).
        keys: the key positions, each in the forms of ``query`` (``[IO, S1, S2]``), or ``all``
            (every key ``<= query``). Default: the dataset's named positions other than the query,
            or ``all`` when the rows have none. A key after the query gets weight 0 (causal mask).
        plot_heads: ``[[layer, head], ...]`` the heads shown in the figures and the summary's
            ``mean_attention_by_key`` (default: the ``n_plot_heads`` heads with the largest mean
            attention to the first key; with ``keys: all``, the largest mean weight on one key
            other than the first token).
        n_plot_heads: heads shown by default (3).
        plot_rows: rows shown in the figures (6).
        top_k: heads listed per key in ``top_heads_by_key`` (5).
        scores: also read the pre-softmax scores (``hook_attn_scores``; column ``score``).
        full_pattern: also tabulate the full causal pattern of the shown heads on the first
            ``plot_rows`` rows (one more forward pass of those rows).
        batch_size: rows per forward pass (16).
        dominance / spread_entropy: thresholds of the head labels (see
            :func:`tracekit.attention.classify_heads`).

    Summary (``*_by_row``: lists aligned with the rows; everything else names its aggregate):
        ``n_rows``; ``layers``, ``heads`` (the indices read); ``query`` and ``keys`` (the names);
        ``query_pos_by_row`` / ``query_token_by_row``; ``shown_heads`` (``[[layer, head], ...]``);
        ``top_heads_by_key`` (``{key: [[layer, head, mean weight over rows], ...]}``, ``top_k``
        each, largest first); ``mean_attention_by_key`` (``{key: {"L<l>H<h>": mean weight over
        rows}}`` for the shown heads); ``mean_score_by_key`` (the same for scores; with
        ``scores: true``); ``modal_label_by_head`` (``{"L<l>H<h>": the most frequent label over
        rows}`` for the shown heads); ``max_abs_row_sum_error`` (max over rows, layers and heads of
        ``|sum of the query's weights over the row's real keys - 1|``: 0 up to float error when no
        weight leaks to padding).

    Retired keys: ``prompt`` (now ``prompts``).

    Raises:
        AttentionError: unknown layer/head, a shown head outside ``layers``/``heads``.
        TokenizationError: a position not in a prompt. DatasetError: a name a row does not have.
    """

    kind: Literal["attention_pattern"] = "attention_pattern"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    layers: Union[Literal["all"], Indices] = "all"
    layer: Optional[int] = None
    heads: Union[Literal["all"], Indices] = "all"
    head: Optional[int] = None
    query: Optional[PositionSpec] = None
    position: Optional[PositionSpec] = None
    keys: Union[Literal["all"], list[PositionSpec], None] = None
    plot_heads: Optional[list[tuple[int, int]]] = None
    n_plot_heads: int = Field(default=3, ge=1)
    plot_rows: int = Field(default=6, ge=1)
    top_k: int = Field(default=5, ge=1)
    scores: bool = False
    full_pattern: bool = False
    batch_size: int = Field(default=16, ge=1)
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = AttentionPatternResult

    retired = RETIRED

    @field_validator("query", "position")
    @classmethod
    def _position(cls, v, info):
        if v is not None:
            _parse_query(v, info.field_name)
        return v

    @field_validator("keys")
    @classmethod
    def _keys(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("an empty list selects nothing; list key positions ([IO, S1]) or write all")
            names = [str(_parse_query(k, f"keys[{i}]")) for i, k in enumerate(v)]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"keys: {dup} given more than once")
        return v

    @field_validator("plot_heads")
    @classmethod
    def _plot_heads(cls, v):
        if v is not None and not v:
            raise ValueError("an empty list selects nothing; omit plot_heads to show the top heads")
        return v

    @model_validator(mode="after")
    def _fields(self):
        check_dataset_fields(self.prompts, self.dataset)
        if self.query is not None and self.position is not None:
            raise ValueError("give query or position (the same field under its cross-kind name), not both")
        if self.layer is not None and self.layers != "all":
            raise ValueError("give layers (a list) or layer (one block), not both")
        if self.head is not None and self.layer is None:
            raise ValueError("head needs layer (the shown head of that block); for several blocks use "
                             "plot_heads: [[layer, head], ...]")
        if self.head is not None and self.plot_heads is not None:
            raise ValueError("give head or plot_heads, not both")
        return self

    @property
    def query_field(self) -> str:
        """The field the query position was given in (``query`` or ``position``)."""
        return "position" if self.position is not None else "query"

    @property
    def query_spec(self) -> PositionSpec:
        q = self.query if self.query is not None else self.position
        return "last" if q is None else q

    def prepare(self, model) -> AttentionPatternInputs:
        """Prepare the rows, check the layers and heads, and resolve the query and key positions
        per row (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`)."""
        data = kind_dataset(model, self.prompts or None, self.dataset, batch_size=self.batch_size)
        layers = [check_layer(model, self.layer)] if self.layer is not None else check_layers(model, self.layers)
        heads = check_heads(model, self.heads, layer=layers[0])
        for L in layers[1:]:
            check_heads(model, heads, layer=L)
        plot = None
        if self.head is not None:
            check_heads(model, [self.head], "head", layer=layers[0])
            if self.head not in heads:
                heads = sorted([*heads, self.head])
            plot = ((layers[0], int(self.head)),)
        elif self.plot_heads is not None:
            plot_l = []
            for i, (L, H) in enumerate(self.plot_heads):
                L = check_layer(model, L, f"plot_heads[{i}]")
                check_heads(model, [H], f"plot_heads[{i}]", layer=L)
                if L not in layers or H not in heads:
                    raise AttentionError(f"plot_heads[{i}]: L{L}H{H} is not read (layers {layers}, heads {heads}); "
                                         "add it to layers / heads")
                plot_l.append((L, int(H)))
            plot = tuple(dict.fromkeys(plot_l))
        qpos = _parse_query(self.query_spec, self.query_field)
        query_pos = _resolve_per_row(model, data, qpos, self.query_field)
        keys = self.keys
        if keys is None:
            names = [n for n in data.position_names if not (qpos.kind == "name" and n == qpos.text)]
            keys = names or "all"
        if keys == "all":
            key_names, key_pos = None, ()
        else:
            parsed = [_parse_query(k, f"keys[{i}]") for i, k in enumerate(keys)]
            key_names = tuple(str(p) for p in parsed)
            cols = [_resolve_per_row(model, data, p, f"keys[{i}]") for i, p in enumerate(parsed)]
            key_pos = tuple(tuple(int(c[r]) for c in cols) for r in range(len(data)))
        return AttentionPatternInputs(data, tuple(layers), tuple(heads), tuple(int(q) for q in query_pos), key_names,
                                      key_pos, plot)

    def _run(self, model, inputs: AttentionPatternInputs, progress: bool = True) -> AttentionPatternResult:
        # the engine reads the prepared ids and positions: nothing is tokenized again
        # Long (reason): one batched pass, then the four tables (pattern, rows, heads, labels) built from the same QueryAttention; the table builders are the piece to move to attention_tables.py.
        import torch
        from tqdm.auto import tqdm

        data = inputs.data
        bar = tqdm(total=len(data), desc="attention", disable=not progress, leave=False)
        try:
            qa = query_attention(model, inputs.ids, inputs.query_pos, list(inputs.layers), list(inputs.heads),
                                 self.batch_size, self.scores, progress=bar.update,
                                 field="dataset" if self.dataset is not None else "prompts")
        finally:
            bar.close()
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

        toks = [[dec(i) for i in ids] for ids in inputs.ids]
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
        if inputs.key_names is not None:
            key_names = list(inputs.key_names)
            KP = torch.tensor(inputs.key_pos, dtype=torch.long).reshape(R, len(key_names))
            Wk = qa.at(KP).numpy()
            Sk = qa.at(KP, scores=True).numpy() if S is not None else None
            KPn = KP.numpy()
            r, li, hi, j = (a.reshape(-1) for a in np.indices(Wk.shape))
            kpos = KPn[r, j]
            rows = {"row_id": row_ids[r], "layer": Ls[li], "head_idx": Hs[hi], "key": _obj(key_names)[j],
                    "key_pos": kpos, "key_token": T[r, kpos], "query_pos": qp[r], "query_token": qtok[r],
                    "weight": Wk[r, li, hi, j].astype(np.float64)}
            if Sk is not None:
                rows["score"] = Sk[r, li, hi, j].astype(np.float64)
        else:
            key_names = [str(x) for x in range(K)]
            Wk, Sk = W, S
            rows = {"row_id": pattern["row_id"], "layer": pattern["layer"], "head_idx": pattern["head_idx"],
                    "key": _obj(key_names)[pattern["key_pos"]], "key_pos": pattern["key_pos"],
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
        heads = {"layer": Ls[li], "head_idx": Hs[hi], "key": _obj(key_names)[j], "n_rows": st["n_rows"][li, hi, j],
                 "mean_weight": st["mean"][li, hi, j], "std_weight": st["std"][li, hi, j],
                 "q1_weight": st["q1"][li, hi, j], "median_weight": st["median"][li, hi, j],
                 "q3_weight": st["q3"][li, hi, j], "iqr_weight": st["iqr"][li, hi, j]}
        if Sk is not None:
            with np.errstate(invalid="ignore"):
                heads["mean_score"] = np.nanmean(Sk.astype(np.float64), 0)[li, hi, j]
        hdf = pd.DataFrame(heads)
        tables["heads"] = hdf[hdf["n_rows"] > 0].reset_index(drop=True)

        # labels per (row, layer, head)
        lab = label_query_rows(qa.weights, qa.query_pos, self.dominance, self.spread_entropy)
        r, li, hi = (a.reshape(-1) for a in np.indices((R, nL, nH)))
        top = lab["top_key_pos"].numpy()[r, li, hi]
        tables["labels"] = pd.DataFrame({
            "row_id": row_ids[r], "layer": Ls[li], "head_idx": Hs[hi],
            **{c: lab[c].numpy()[r, li, hi] for c in ("self_weight", "first_weight", "previous_weight",
                                                         "entropy_norm", "max_key_weight")},
            "top_key_pos": top, "top_key_token": T[r, top],
            "label": _obj(HEAD_LABELS)[lab["label"].numpy()[r, li, hi]]})
        tables["tokens"] = pd.DataFrame({"row_id": np.repeat(row_ids, [len(t) for t in toks]),
                                         "position": np.concatenate([np.arange(len(t)) for t in toks]),
                                         "token": _obj([x for t in toks for x in t])})

        # the shown heads
        if inputs.plot_heads is not None:
            shown = [list(p) for p in inputs.plot_heads]
        else:
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                rank = (st["mean"][:, :, 0] if inputs.key_names is not None
                        else np.nanmean(np.nanmax(np.where(np.isnan(W[..., 1:]), -np.inf, W[..., 1:]), -1)
                                        if K > 1 else W[..., 0], 0))
            rank = np.nan_to_num(np.where(np.isfinite(rank), rank, np.nan), nan=-1.0)
            order = np.lexsort((np.arange(rank.size), -rank.reshape(-1)))[: self.n_plot_heads]
            shown = [[int(Ls[o // nH]), int(Hs[o % nH])] for o in order]
        if self.full_pattern:
            n_show = min(len(data), self.plot_rows)
            fp = full_patterns(model, inputs.ids[:n_show], [tuple(p) for p in shown], self.batch_size)
            parts = []
            for (L, H), mats in fp.items():
                for i, mat in enumerate(mats):
                    qq, kk = np.tril_indices(mat.shape[0])
                    parts.append(pd.DataFrame({"row_id": row_ids[i], "layer": L, "head_idx": H, "query_pos": qq,
                                               "key_pos": kk, "weight": mat.numpy()[qq, kk].astype(np.float64)}))
            tables["full_pattern"] = pd.concat(parts, ignore_index=True)

        sums = np.nansum(W, -1)
        meta = {"n_rows": int(R), "row_ids": row_ids.tolist(), "layers": [int(x) for x in Ls],
                "heads": [int(x) for x in Hs], "query": str(_parse_query(self.query_spec, self.query_field)),
                "keys": key_names, "key_mode": "named" if inputs.key_names is not None else "all",
                "query_pos_by_row": qp.tolist(), "query_token_by_row": [str(x) for x in qtok],
                "shown_heads": shown, "max_abs_row_sum_error": float(np.abs(sums - 1).max()),
                "source": data.source, "dropped": dict(data.dropped)}
        return AttentionPatternResult(self, tables, meta)


class HeadScanResult(Result):
    """Tables: ``scores`` (per layer x head_idx: prev_token_score, induction_score and
    TransformerLens' ``tl_*`` scores on repeated random tokens), ``labels`` (per prompt x layer x
    head_idx, averaged over query positions >= 1: ``self_weight, first_weight, previous_weight,
    entropy_norm, max_key_weight, label``)."""

    config: "HeadScan"
    main_table = "scores"
    renamed_columns = {"labels.self": "self_weight", "labels.first": "first_weight",
                       "labels.previous": "previous_weight"}

    def summary(self) -> dict:
        sc = self.tables["scores"]
        k = self.config.top_k
        ind = sc.sort_values("induction_score", ascending=False).head(k)
        prev = sc.sort_values("prev_token_score", ascending=False).head(k)
        out = {"top_induction_heads": {f"L{r.layer}H{r.head_idx}": round(float(r.induction_score), 4) for r in ind.itertuples()},
               "top_prev_token_heads": {f"L{r.layer}H{r.head_idx}": round(float(r.prev_token_score), 4) for r in prev.itertuples()},
               "n_induction_heads": int((sc["induction_score"] >= self.config.induction_threshold).sum()),
               "max_induction_score": round(float(sc["induction_score"].max()), 4)}
        lab = self.tables.get("labels", pd.DataFrame())
        if len(lab):
            l0 = lab[lab["prompt_idx"] == 0]
            out["label_counts"] = {k: int(v) for k, v in l0["label"].value_counts().items()}
        return out

    def report(self) -> str:
        s = self.summary()
        lines = [f"head scan [{self.config.step_name}]: repeated random tokens (seq_len {self.config.seq_len} x2, "
                 f"{self.config.n_seqs} sequences)",
                 "top induction heads: " + ", ".join(f"{k} {v:.2f}" for k, v in s["top_induction_heads"].items()),
                 "top previous-token heads: " + ", ".join(f"{k} {v:.2f}" for k, v in s["top_prev_token_heads"].items())]
        if "label_counts" in s:
            lines.append(f"labels on prompt 0: {s['label_counts']}")
        return "\n".join(lines)

    def figures(self) -> dict:
        sc = self.tables["scores"]
        fig, axes = plotting.plt().subplots(1, 2, figsize=(10, max(3, 0.22 * sc["layer"].nunique() + 1.5)))
        for ax, col, title in ((axes[0], "prev_token_score", "previous-token score"),
                               (axes[1], "induction_score", "induction score")):
            g = sc.pivot(index="layer", columns="head_idx", values=col).sort_index()
            im = ax.imshow(g.to_numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto", origin="lower")
            ax.set_xlabel("head"); ax.set_ylabel("layer"); ax.set_title(title)
            fig.colorbar(im, ax=ax, fraction=0.04)
        fig.tight_layout()
        return {"head_scores": fig}


@register
class HeadScan(Experiment):
    """Previous-token / induction scores of every head (Olsson et al. 2022) and head labels.

    Fields:
        seq_len: random tokens per half of the repeated sequence.
        n_seqs: repeated random-token sequences the previous-token / induction scores are averaged
            over (default 4).
        seed: seed of the random tokens of the repeated sequences (default 0).
        layers: ``all`` or a list.
        dataset: optional dataset rows (:mod:`tracekit.dataset`) on which each head is labelled, instead
            of ``prompts`` (table ``labels`` carries each row's ``row_id``).
        prompts: optional prompts on which each head is labelled (self/first/previous/spread/content),
            averaged over query positions >= 1.
        top_k: heads listed in the summary.
        induction_threshold: induction score (attention probability, in [0, 1]; default 0.3) at or
            above which a head is counted in the summary's ``n_induction_heads``.
        dominance: head labelling on ``prompts``: a head is labelled ``self``/``first``/``previous``
            when its mean attention mass on that key is >= this (in (0, 1]; default 0.4).
        spread_entropy: head labelling: otherwise a head is ``spread`` when its normalised attention
            entropy ``H / log(q+1)`` is >= this (in (0, 1]; default 0.9), else ``content``.

    Raises:
        AttentionError: unknown layer, or sequences longer than the context.
    """

    kind: Literal["head_scan"] = "head_scan"
    seq_len: int = Field(default=40, ge=2)
    n_seqs: int = Field(default=4, ge=1)
    seed: int = 0
    layers: Union[Literal["all"], Indices] = "all"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    top_k: int = Field(default=5, ge=1)
    induction_threshold: float = Field(default=0.3, ge=0, le=1)
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = HeadScanResult

    def _layers(self, model):
        if self.layers == "all":
            return list(range(int(model.cfg.n_layers)))
        return [check_layer(model, L, f"layers[{i}]") for i, L in enumerate(self.layers)]

    def prepare(self, model) -> HeadScanInputs:
        """Check the layers and the sequence length against the context, tokenize the prompts
        (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`)."""
        layers = tuple(self._layers(model))
        check_repeated_length(model, self.seq_len)
        if self.dataset is not None:
            if self.prompts:
                raise AttentionError("prompts / dataset: give one of them (the rows on which heads are labelled)")
            data = kind_dataset(model, None, self.dataset)
            return HeadScanInputs(layers, tuple(data.ids), tuple(e.row_id for e in data.examples))
        ids = encode_prompts(model, self.prompts)
        return HeadScanInputs(layers, ids, tuple(range(len(ids))))

    def _run(self, model, inputs: HeadScanInputs, progress: bool = True) -> HeadScanResult:
        layers = list(inputs.layers)
        tables = {"scores": head_scores(model, self.seq_len, self.n_seqs, self.seed, layers)}
        if inputs.ids:
            rows = []
            for pi, ids in zip(inputs.row_ids, inputs.ids):
                batch = pad_ids(model, [ids])  # one prompt: no padding
                _, cache = run_with_cache(model, batch, [hook("head_pattern", L) for L in layers])
                for L in layers:
                    lab = classify_heads(cache[hook("head_pattern", L)][0].float().cpu(), None,
                                         self.dominance, self.spread_entropy)
                    rows.append(lab.rename(columns=LABEL_RENAMES).assign(prompt_idx=pi, row_id=pi, layer=L))
            tables["labels"] = pd.concat(rows, ignore_index=True)
        return HeadScanResult(self, tables, {"layers": layers})
