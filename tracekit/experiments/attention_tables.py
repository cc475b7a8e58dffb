"""Result classes of the attention kinds (:mod:`tracekit.experiments.attention`): tables, summaries,
reports and figures of ``kind: attention_pattern`` (:class:`AttentionPatternResult`; its tables are
built by :func:`tracekit.attention_tables.query_tables`) and ``kind: head_scan`` (:class:`HeadScanResult`).

Units: ``score`` is the pre-softmax attention score (``q.k / sqrt(d_head)``, logits of the
softmax); ``weight`` is a probability (each query row sums to 1; future keys get 0).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import pandas as pd

from .. import plotting
from ..attention import HEAD_LABELS
from .base import Result
from .typed_frames import column, records, values, where

if TYPE_CHECKING:
    from .attention import AttentionPattern, HeadScan

__all__ = ["AttentionPatternResult", "HeadScanResult", "head_name"]


def head_name(L: int, h: int) -> str:
    """A head's name: ``L<layer>H<head>``."""
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
      (:func:`tracekit.attention.label_query_rows`), ``top_key_role`` (the row's named positions
      at the top key, ``/``-joined; ``""`` if none), ``role`` (``attends SUBJ`` when the top key is
      a named position with weight >= ``dominance``, else ``label``) and ``measured_on`` (``this
      row, one query``; the summary's ``labels_measured_on`` says over how many rows and at which
      query the modal labels ``modal_label_by_head`` / ``modal_role_by_head`` were taken).
    * ``tokens``: ``row_id, position, token`` (each row's tokens, BOS included when prepended).
    * ``full_pattern`` (``full_pattern: true``): ``row_id, layer, head_idx, query_pos, key_pos,
      weight``, every query and key ``<= query`` of the shown heads on the first ``plot_rows`` rows.
    """

    config: "AttentionPattern"
    main_table = "rows"
    table_names = ("pattern", "rows", "heads", "labels", "tokens", "full_pattern")
    summary_keys = ("n_rows", "layers", "heads", "query", "keys", "query_pos_by_row", "query_token_by_row",
                    "shown_heads", "top_heads_by_key", "mean_attention_by_key", "mean_score_by_key",
                    "modal_label_by_head", "modal_role_by_head", "labels_measured_on", "max_abs_row_sum_error")
    renamed_columns = {"labels.self": "self_weight", "labels.first": "first_weight",
                       "labels.previous": "previous_weight", "prompt_idx": "row_id"}

    def summary(self) -> dict:
        m = self.meta
        h = self.tables["heads"]
        keys = list(m["keys"])
        top_k = int(self.config.top_k)
        top: dict = {}
        for key in keys:
            sub = where(h, h["key"] == key).sort_values(["mean_weight", "layer", "head_idx"],
                                                         ascending=[False, True, True])
            top[key] = [[int(r.layer), int(r.head_idx), round(float(r.mean_weight), 6)] for r in records(sub.head(top_k))]
        shown = [tuple(p) for p in m["shown_heads"]]
        hs = h.set_index(["layer", "head_idx", "key"])
        mean_by_key = {key: {head_name(L, H): round(float(hs.loc[(L, H, key), "mean_weight"]), 6)
                             for L, H in shown if (L, H, key) in hs.index} for key in keys}
        lab = self.tables["labels"]
        modal = {}
        for L, H in shown:
            sub = column(where(lab, (lab["layer"] == L) & (lab["head_idx"] == H)), "label")
            counts = sub.value_counts()
            modal[head_name(L, H)] = (min(counts.index, key=lambda x: (-counts[x], HEAD_LABELS.index(x)))
                                       if len(counts) else None)
        out = {"n_rows": int(m["n_rows"]), "layers": list(m["layers"]), "heads": list(m["heads"]),
               "query": m["query"], "keys": keys, "query_pos_by_row": list(m["query_pos_by_row"]),
               "query_token_by_row": list(m["query_token_by_row"]), "shown_heads": [list(p) for p in shown],
               "top_heads_by_key": top, "mean_attention_by_key": mean_by_key}
        if "mean_score" in h:
            out["mean_score_by_key"] = {key: {head_name(L, H): round(float(hs.loc[(L, H, key), "mean_score"]), 6)
                                              for L, H in shown if (L, H, key) in hs.index} for key in keys}
        out["modal_label_by_head"] = modal
        if "role" in lab:
            roles = {}
            for L, H in shown:
                counts = column(where(lab, (lab["layer"] == L) & (lab["head_idx"] == H)), "role").value_counts()
                roles[head_name(L, H)] = min(counts.index, key=lambda x: (-counts[x], str(x))) if len(counts) else None
            out["modal_role_by_head"] = roles
        out["labels_measured_on"] = (f"{int(m['n_rows'])} row(s), query {m['query']} (one query per row; the modal "
                                     "label over rows)")
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
            by = s.get("modal_role_by_head") or s["modal_label_by_head"]
            rows = [[head_name(L, H), by.get(head_name(L, H)) or ""] +
                    [f"{s['mean_attention_by_key'][k].get(head_name(L, H), float('nan')):.3f}" for k in keys]
                    for L, H in s["shown_heads"]]
            lines.append(f"shown heads: mean weight over rows; label measured on {s['labels_measured_on']}")
            lines.append(plotting.text_table(rows, ["head", "label", *keys]))
            if any(str(v) == "previous" for v in by.values()):
                lines.append("  'previous' at one query position per row is not a previous-token score: a head that "
                             "seeks the token sitting there looks the same; name the position in the rows (attends "
                             "SUBJ) or score heads on repeated random tokens (kind head_scan)")
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
            panels = [(f"{m['query']} -> {k}", where(h, h["key"] == k), "mean_weight") for k in list(m["keys"])[:8]]
        else:
            lab = self.tables["labels"]
            g = cast(pd.DataFrame, lab.groupby(["layer", "head_idx"], as_index=False)[
                ["self_weight", "first_weight", "previous_weight"]].mean())  # a list of columns: a table
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
            first = where(r, (r["layer"] == r["layer"].iloc[0]) & (r["head_idx"] == r["head_idx"].iloc[0]))
            for x in records(first):
                named.setdefault(int(x.row_id), {}).setdefault(int(x.key_pos), []).append(str(x.key))
        K = int(column(where(pat, pat["row_id"].isin(row_ids)), "key_pos").max()) + 1 if len(pat) else 1
        p = plotting.plt()
        w = min(9.0, 1.2 + 0.2 * K)
        fig, axes = p.subplots(len(row_ids), max(1, len(shown)), figsize=(min(40.0, w * max(1, len(shown))),
                                                                         min(40.0, 2.4 * len(row_ids) + 0.6)),
                               squeeze=False)
        by = {k: g for k, g in where(pat, pat["row_id"].isin(row_ids)).groupby(["row_id", "layer", "head_idx"])}
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
        n = int(column(full, "query_pos").max()) + 1
        side = min(7.0, 1.2 + 0.2 * n)
        fig, axes = p.subplots(len(row_ids), len(shown), figsize=(min(40.0, side * len(shown)),
                                                                  min(40.0, side * len(row_ids))), squeeze=False)
        for i, rid in enumerate(row_ids):
            toks = [_tick(t) for t in column(where(tok, tok["row_id"] == rid).sort_values("position"), "token")]
            for j, (L, H) in enumerate(shown):
                ax = axes[i][j]
                g = where(full, (full["row_id"] == rid) & (full["layer"] == L) & (full["head_idx"] == H))
                m = int(column(g, "query_pos").max()) + 1 if len(g) else 0
                grid = np.full((m, m), np.nan)
                grid[values(g, "query_pos"), values(g, "key_pos")] = values(g, "weight")
                ax.imshow(grid, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
                step = max(1, int(np.ceil(m / plotting.MAX_TICKS)))
                ax.set_xticks(range(0, m, step), toks[:m:step], rotation=90, fontsize=6)
                ax.set_yticks(range(0, m, step), toks[:m:step], fontsize=6)
                ax.set_title(f"row {rid}, L{L}H{H}", fontsize=7)
        fig.tight_layout()
        return fig


class HeadScanResult(Result):
    """Tables: ``scores`` (per layer x head_idx: prev_token_score, induction_score and
    TransformerLens' ``tl_*`` scores on repeated random tokens; ``type``: ``previous-token`` when
    prev_token_score >= ``dominance``, ``induction`` when induction_score >= ``induction_threshold``
    (both joined by ``, ``; ``""`` if neither), ``measured_on``: the random tokens), ``labels`` (per
    prompt x layer x head_idx, averaged over query positions >= 1: ``self_weight, first_weight,
    previous_weight, entropy_norm, max_key_weight, label``, ``measured_on``).

    Summary: ``top_induction_heads``, ``top_prev_token_heads``, ``n_induction_heads``,
    ``max_induction_score``, ``random_tokens`` (what the scores were measured on),
    ``previous_token_heads`` (score >= ``dominance``), ``label_counts`` (with prompts / dataset:
    the first row's labels) and ``labels_measured_on`` (what they were measured on; None without
    prompts / dataset)."""

    config: "HeadScan"
    main_table = "scores"
    renamed_columns = {"labels.self": "self_weight", "labels.first": "first_weight",
                       "labels.previous": "previous_weight"}

    def summary(self) -> dict:
        sc = self.tables["scores"]
        k = self.config.top_k
        ind = sc.sort_values("induction_score", ascending=False).head(k)
        prev = sc.sort_values("prev_token_score", ascending=False).head(k)
        out = {"top_induction_heads": {f"L{r.layer}H{r.head_idx}": round(float(r.induction_score), 4) for r in records(ind)},
               "top_prev_token_heads": {f"L{r.layer}H{r.head_idx}": round(float(r.prev_token_score), 4) for r in records(prev)},
               "n_induction_heads": int((column(sc, "induction_score") >= self.config.induction_threshold).sum()),
               "max_induction_score": round(float(column(sc, "induction_score").max()), 4)}
        c = self.config
        out["random_tokens"] = f"{c.n_seqs} sequences of 2 x {c.seq_len} random tokens (seed {c.seed})"
        out["previous_token_heads"] = [f"L{r.layer}H{r.head_idx}" for r in records(sc.sort_values(
            ["prev_token_score", "layer", "head_idx"], ascending=[False, True, True])) if r.prev_token_score >= c.dominance]
        lab = self.tables.get("labels", pd.DataFrame())
        out["labels_measured_on"] = None
        if len(lab):
            first = column(lab, "prompt_idx").iloc[0]
            l0 = where(lab, lab["prompt_idx"] == first)
            out["label_counts"] = {k: int(v) for k, v in column(l0, "label").value_counts().items()}
            out["labels_measured_on"] = (f"row {first}: every query position >= 1 (mean attention mass; "
                                         "previous = the previous position across the row's positions)")
        return out

    def report(self) -> str:
        s = self.summary()
        lines = [f"head scan [{self.config.step_name}]: scores measured on {s['random_tokens']}",
                 "top induction heads: " + ", ".join(f"{k} {v:.2f}" for k, v in s["top_induction_heads"].items()),
                 "top previous-token heads: " + ", ".join(f"{k} {v:.2f}" for k, v in s["top_prev_token_heads"].items())]
        lines.append(f"previous-token heads (score >= {self.config.dominance} on random tokens): "
                     f"{', '.join(s['previous_token_heads'][:20]) or 'none'}")
        if "label_counts" in s:
            lines.append(f"labels measured on {s['labels_measured_on']}: {s['label_counts']}")
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
