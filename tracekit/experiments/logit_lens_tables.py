"""Tables, summary, report and figures of the logit lens (``kind: logit_lens``): the result class
:class:`LogitLensResult` (tables and summary keys described in :mod:`tracekit.experiments.logit_lens`)
and the loader of lens results saved before per-row tables (#21).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np
import pandas as pd

from .. import plotting
from ..logit_lens import landmarks
from ..results import round_sig
from .base import Result, column, subset

if TYPE_CHECKING:
    from .logit_lens import LogitLens

__all__ = ["LogitLensResult"]


def _tuples(df: pd.DataFrame) -> Iterator[Any]:
    """``df.itertuples()``: one named tuple per row, a field per column (typed for those fields)."""
    return iter(df.itertuples())


def _cells(row: pd.Series) -> dict[str, Any]:
    """A table row's cells by column name (the same values, not converted)."""
    return {str(k): v for k, v in row.items()}

_HS_LABEL = "hidden state (0 = embeddings, h = output of block h-1)"
#: Rows listed one by one in the report (beyond: the first ones and a pointer to ``rows.parquet``).
_REPORT_ROWS = 30


def _none_int(v) -> Optional[int]:
    return None if v is None or pd.isna(v) else int(v)


def _none_float(v) -> Optional[float]:
    return None if v is None or pd.isna(v) else float(v)


def _pct(p: float) -> str:
    """A probability as a percentage that stays readable when tiny (``3.1e-05``)."""
    return f"{p:.2%}" if p >= 1e-4 else f"{p:.1e}"


def _short(text: str, n: int = 28) -> str:
    """``…of France is``: the end of a prompt (where the question is)."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else "…" + text[-(n - 1):]


class LogitLensResult(Result):
    """Result of :class:`LogitLens`: tables ``main``, ``rows``, ``topk``, ``tokens``, ``final`` and,
    with ``track``, ``tracked`` (module docstring); summary keys in :class:`LogitLens`."""

    config: "LogitLens"
    main_table = "main"
    renamed_columns = {"rank": "vocab_rank"}
    #: Keys of summary() (pipelines check references against them before any model loads).
    summary_keys = (
        # every run
        "layer_convention", "hidden_states", "hooks", "n_rows", "n_prompts", "final_top1_by_row",
        "mean_entropy_by_hidden_state",
        # with targets
        "target_by_row", "target_prob_final_by_row", "mean_target_prob_final", "emergence_hidden_state_by_row",
        "emergence_layer_by_row", "jump_layer_by_row", "median_emergence_layer", "share_rows_emerged",
        "mean_target_prob_by_hidden_state", "median_target_rank_by_hidden_state", "top1_accuracy_final",
        # with foils
        "logit_diff_final_by_row", "mean_logit_diff_final", "mean_logit_diff_by_hidden_state",
        # with track
        "tracked", "mean_tracked_prob_final", "mean_tracked_prob_by_hidden_state",
        # single-row results only (one row: that row's values; absent with several rows)
        "final_top1", "top1_by_hidden_state", "top1_prob_by_hidden_state", "entropy_by_hidden_state", "target",
        "target_prob_final", "target_prob_by_hidden_state", "target_rank_by_hidden_state",
        "target_log_prob_by_hidden_state", "emergence_hidden_state", "emergence_layer", "jump", "jump_layer")
    #: Single-row keys: present only when the run has exactly one row (their meaning is that row's).
    single_row_keys = ("final_top1", "top1_by_hidden_state", "top1_prob_by_hidden_state", "entropy_by_hidden_state",
                       "target", "target_prob_final", "target_prob_by_hidden_state", "target_rank_by_hidden_state",
                       "target_log_prob_by_hidden_state", "emergence_hidden_state", "emergence_layer", "jump",
                       "jump_layer")
    table_names = ("main", "rows", "topk", "tokens", "final", "tracked")
    #: Why a summary value can be null (quoted when a pipeline reference resolves to null).
    null_reasons = {
        "emergence_layer": "the target never stays top-1 through the last hidden state read (or does so only from "
                           "the embeddings), so there is no emergence layer",
        "emergence_hidden_state": "the target never stays top-1 through the last hidden state read",
        "jump_layer": "the largest gain is into the embeddings or only one hidden state was read",
        "jump": "only one hidden state was read",
        "median_emergence_layer": "no row's target stays top-1 through the last hidden state read (see "
                                  "share_rows_emerged)",
        "emergence_layer_by_row": "that row's target never stays top-1 through the last hidden state read",
        "emergence_hidden_state_by_row": "that row's target never stays top-1 through the last hidden state read",
        "jump_layer_by_row": "that row's largest gain is into the embeddings or only one hidden state was read",
        "target_prob_final_by_row": "that row has no target",
        "target_by_row": "that row has no target",
    }

    @property
    def lens_name(self) -> str:
        """``Tuned lens`` for ``lens: tuned``, else ``Logit lens`` (titles and the report)."""
        return "Tuned lens" if getattr(self.config, "lens", "logit") == "tuned" else "Logit lens"

    def __init__(self, config, tables: dict[str, pd.DataFrame], meta: Optional[dict] = None,
                 arrays: Optional[dict] = None):
        super().__init__(config, tables, meta, arrays)
        if "rows" not in self.tables and {"main", "final"} <= set(self.tables):  # saved before per-row tables
            self.tables = {**self.tables, **_legacy_tables(self.tables, config)}

    # ---- helpers ---------------------------------------------------------------------------
    def _by_hidden_state(self, values: dict) -> list:
        """A list indexed by hidden state (0..n_layers), None where the convention reads none."""
        n = int(self.meta.get("n_layers", 0)) + 1
        return [values.get(h) for h in range(n)]

    def _rows(self) -> pd.DataFrame:
        return self.tables["rows"].sort_values("prompt_idx")

    def _at_read(self, name: str = "main") -> pd.DataFrame:
        """Rows of ``main`` (or ``tracked``) at each row's summary read (``rows.position``)."""
        df = self.tables[name]
        keys = self.tables["rows"][["prompt_idx", "position"]]
        return df.merge(keys, on=["prompt_idx", "position"], how="inner")

    @property
    def has_targets(self) -> bool:
        return bool((self.tables["rows"]["target_id"] >= 0).any())

    @property
    def has_foils(self) -> bool:
        rows = self.tables["rows"]
        return "foil_id" in rows.columns and bool((rows["foil_id"] >= 0).any())

    # ---- summary -----------------------------------------------------------------------------
    def summary(self) -> dict:
        cfg = self.config
        rows = self._rows()
        at = self._at_read()
        hs = sorted(column(at, "hidden_state").unique().tolist())
        first = subset(at, at["prompt_idx"] == column(rows, "prompt_idx").iloc[0]).sort_values("hidden_state")
        n = len(rows)
        out: dict[str, Any] = {
            "layer_convention": cfg.layer_convention,
            "hidden_states": hs,
            "hooks": first["hook"].tolist(),
            "n_rows": n,
            "n_prompts": n,
            "final_top1_by_row": rows["final_top1"].tolist(),
            "mean_entropy_by_hidden_state": self._by_hidden_state(
                cast(pd.Series, at.groupby("hidden_state")["entropy"].mean()).astype(float).to_dict()),
        }
        if self.has_targets:
            t = subset(rows, rows["target_id"] >= 0)
            tat = subset(at, at["target_id"] >= 0)
            em_layer = column(t, "emergence_layer").dropna()
            out.update({
                "target_by_row": [None if tid < 0 else tg for tg, tid in zip(rows["target"], rows["target_id"])],
                "target_prob_final_by_row": [_none_float(v) for v in rows["target_prob_final"]],
                "mean_target_prob_final": float(column(t, "target_prob_final").mean()),
                "emergence_hidden_state_by_row": [_none_int(v) for v in rows["emergence_hidden_state"]],
                "emergence_layer_by_row": [_none_int(v) for v in rows["emergence_layer"]],
                "jump_layer_by_row": [_none_int(v) for v in rows["jump_layer"]],
                "median_emergence_layer": float(em_layer.median()) if len(em_layer) else None,
                "share_rows_emerged": float(column(t, "emergence_hidden_state").notna().mean()),
                "mean_target_prob_by_hidden_state": self._by_hidden_state(
                    cast(pd.Series, tat.groupby("hidden_state")["prob"].mean()).astype(float).to_dict()),
                "median_target_rank_by_hidden_state": self._by_hidden_state(
                    {h: float(v) for h, v in cast(pd.Series, tat.groupby("hidden_state")["vocab_rank"].median()).items()}),
                "top1_accuracy_final": float((column(t, "target_vocab_rank_final") == 1).mean()),
            })
            if self.has_foils:
                f = subset(rows, (rows["target_id"] >= 0) & (rows["foil_id"] >= 0))
                fat = subset(tat, tat["foil_id"] >= 0)
                out.update({
                    "logit_diff_final_by_row": [_none_float(v) for v in rows["logit_diff_final"]],
                    "mean_logit_diff_final": float(column(f, "logit_diff_final").mean()),
                    "mean_logit_diff_by_hidden_state": self._by_hidden_state(
                        cast(pd.Series, fat.groupby("hidden_state")["logit_diff"].mean()).astype(float).to_dict()),
                })
        if "tracked" in self.tables:
            tr = self._at_read("tracked")
            fin = self._final_at_read()
            names = list(cfg.track)
            out["tracked"] = names
            out["mean_tracked_prob_final"] = {
                tok: float(np.mean([p[j] for p in fin["tracked_probs"]])) for j, tok in enumerate(names)}
            out["mean_tracked_prob_by_hidden_state"] = {
                tok: self._by_hidden_state(cast(pd.Series, g.groupby("hidden_state")["prob"].mean()).astype(float).to_dict())
                for tok, g in tr.groupby("tracked_token", sort=False)}
        if n == 1:
            out.update(self._single_row(rows.iloc[0], first))
        return round_sig(out)  # significant digits, never decimals (a 4e-06 stays 4e-06)

    def _final_at_read(self) -> pd.DataFrame:
        fin = self.tables["final"]
        keys = self.tables["rows"][["prompt_idx", "position"]]
        return fin.merge(keys, on=["prompt_idx", "position"], how="inner").sort_values("prompt_idx")

    def _single_row(self, series: pd.Series, g: pd.DataFrame) -> dict:
        """The single-row keys (documented as such): exactly that row's values."""
        row = _cells(series)
        out: dict[str, Any] = {
            "final_top1": row["final_top1"],
            "top1_by_hidden_state": self._by_hidden_state(dict(zip(g["hidden_state"], g["top1"]))),
            "top1_prob_by_hidden_state": self._by_hidden_state(dict(zip(g["hidden_state"], g["top1_prob"].astype(float)))),
            "entropy_by_hidden_state": self._by_hidden_state(dict(zip(g["hidden_state"], g["entropy"].astype(float)))),
        }
        if int(row["target_id"]) >= 0:
            jump = None
            if not pd.isna(row["jump_to_hidden_state"]):
                jump = {"from_hidden_state": int(row["jump_from_hidden_state"]),
                        "to_hidden_state": int(row["jump_to_hidden_state"]),
                        "layer": int(row["jump_to_hidden_state"]) - 1, "from_prob": float(row["jump_from_prob"]),
                        "to_prob": float(row["jump_to_prob"]), "gain": float(row["jump_gain"])}
            out.update({
                "target": row["target"],
                "target_prob_final": float(row["target_prob_final"]),
                "target_prob_by_hidden_state": self._by_hidden_state(dict(zip(g["hidden_state"], g["prob"].astype(float)))),
                "target_rank_by_hidden_state": self._by_hidden_state(
                    dict(zip(g["hidden_state"], g["vocab_rank"].astype(int)))),
                "target_log_prob_by_hidden_state": self._by_hidden_state(
                    dict(zip(g["hidden_state"], g["log_prob"].astype(float)))),
                "emergence_hidden_state": _none_int(row["emergence_hidden_state"]),
                "emergence_layer": _none_int(row["emergence_layer"]),
                "jump": jump,
                "jump_layer": _none_int(row["jump_layer"]),
            })
        return out

    # ---- report --------------------------------------------------------------------------------
    def report(self) -> str:
        """One row: its per-hidden-state table and landmarks. Several rows: a per-row table (the
        first rows when there are many) and the aggregates."""
        rows = self._rows()
        cfg = self.config
        head = (f"{self.lens_name.lower()} [{cfg.step_name}] {cfg.layer_convention} (h = hidden state: 0 = embeddings, h = output "
                f"of block h-1)")
        if len(rows) == 1:
            return self._report_one(head, rows.iloc[0])
        s = self.summary()
        has_t = self.has_targets
        lines = [f"{head}; {len(rows)} rows ({self.meta.get('source', 'prompts')}), read at position "
                 f"{cfg.position!s}"]
        table = []
        for r in _tuples(rows.head(_REPORT_ROWS)):
            line = [r.row_id, repr(_short(r.prompt, 34)), repr(r.final_top1)]
            if has_t:
                em = _none_int(r.emergence_hidden_state)
                line += [repr(r.target) if r.target_id >= 0 else "-",
                         _pct(r.target_prob_final) if r.target_id >= 0 else "-",
                         r.target_vocab_rank_final if r.target_id >= 0 else "-",
                         "never" if em is None else f"h{em} (block {em - 1})" if em else "h0",
                         "-" if pd.isna(r.jump_layer) else int(r.jump_layer)]
            table.append(line)
        headers = ["row", "prompt", "model top-1"] + (["target", "p final", "rank", "emergence", "jump block"]
                                                      if has_t else [])
        lines.append(plotting.text_table(table, headers, align=">" + "<<" + ">" * (len(headers) - 3)))
        if len(rows) > _REPORT_ROWS:
            lines.append(f"... {len(rows) - _REPORT_ROWS} more rows (table 'rows', rows.parquet)")
        if has_t:
            med = s["median_emergence_layer"]
            lines.append(f"mean p(target) final {s['mean_target_prob_final']:.2%}; target is the model's top-1 on "
                         f"{s['top1_accuracy_final']:.1%} of rows; emerged (top-1 for good) on "
                         f"{s['share_rows_emerged']:.1%} of rows; median emergence layer "
                         f"{'-' if med is None else f'{med:g}'} (block index, over the rows that emerge)")
            if self.has_foils:
                lines.append(f"mean logit difference target - foil (final): {s['mean_logit_diff_final']:.3f}")
        if "tracked" in s:
            lines.append("tracked tokens, mean p final: " + ", ".join(
                f"{t!r} {p:.2%}" for t, p in s["mean_tracked_prob_final"].items()))
        return "\n".join(lines)

    def _report_one(self, head: str, series: pd.Series) -> str:
        row = _cells(series)
        g = self._at_read().sort_values("hidden_state")
        has_t = int(row["target_id"]) >= 0
        table = []
        for r in _tuples(g):
            line = [r.hidden_state, r.hook, repr(r.top1), f"{r.top1_prob:.4f}"]
            if has_t:
                line += [f"{r.prob:.4%}", r.vocab_rank]
            table.append(line)
        headers = ["h", "hook", "top-1", "p(top-1)"] + ([f"p({row['target']!r})", "vocab rank"] if has_t else [])
        lines = [f"{head} row {row['row_id']}: {row['prompt']!r} (position {row['position']}, {row['token']!r})",
                 plotting.text_table(table, headers, align=">" + "<" + ">" * (len(headers) - 2))]
        line = f"model output top-1: {row['final_top1']!r} ({row['final_top1_prob']:.4%})"
        if has_t:
            em = _none_int(row["emergence_hidden_state"])
            line += f"; p({row['target']!r}) = {row['target_prob_final']:.4%}"
            line += (f"; emergence: hidden state {em} (output of block {em - 1})" if em else "; never top-1 for good")
            if not pd.isna(row["jump_to_hidden_state"]):
                line += (f"; largest jump: h{int(row['jump_from_hidden_state'])} -> h{int(row['jump_to_hidden_state'])} "
                         f"({row['jump_from_prob']:.2%} -> {row['jump_to_prob']:.2%}, block {int(row['jump_layer'])})")
        lines.append(line)
        if "tracked" in self.tables:
            fin = self._final_at_read().iloc[0]
            lines.append("tracked tokens, p final: " + ", ".join(
                f"{t!r} {p:.4%}" for t, p in zip(fin["tracked_tokens"], fin["tracked_probs"])))
        return "\n".join(lines)

    # ---- figures -------------------------------------------------------------------------------
    def _labels(self, rows: pd.DataFrame) -> dict[int, str]:
        """Legend label per prompt_idx: the row's prompt end and target (group when prompts repeat)."""
        out = {}
        for r in _tuples(rows):
            lab = repr(_short(r.prompt))[1:-1]
            if r.target_id >= 0:
                lab += f" → {r.target!r}"
            out[int(r.prompt_idx)] = lab
        if len(set(out.values())) < len(out):
            out = {k: f"{v} (row {rid})" for (k, v), rid in zip(out.items(), rows["row_id"])}
        return out

    def figures(self) -> dict:
        plt = plotting.plt()
        figs = {}
        rows = self._rows()
        if self.has_targets:
            figs["target_by_layer"] = self._target_figure(plt, rows)
            if len(rows) > 1:
                figs["emergence"] = self._emergence_figure(plt, rows)
        if "tracked" in self.tables:
            figs["tracked_by_layer"] = self._tracked_figure(plt)
        figs["top1_grid"] = self._grid_figure(rows)
        return figs

    def _target_figure(self, plt, rows: pd.DataFrame):
        at = self._at_read()
        at = subset(at, at["target_id"] >= 0)
        x = sorted(column(at, "hidden_state").unique().tolist())
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        prob = at.pivot_table(index="prompt_idx", columns="hidden_state", values="prob").reindex(columns=x)
        rank = at.pivot_table(index="prompt_idx", columns="hidden_state", values="vocab_rank").reindex(columns=x)
        if len(prob) <= plotting.MAX_SERIES:
            labels = self._labels(rows)
            for pi, st in zip(prob.index, plotting.series_styles(len(prob))):  # distinct beyond 10 rows
                a1.plot(x, prob.loc[pi].to_numpy(), marker="o", ms=3, label=labels[int(pi)], **st)
                a2.plot(x, rank.loc[pi].to_numpy(dtype=float), marker="o", ms=3, label=labels[int(pi)], **st)
            a1.legend(fontsize=7)
        else:  # many rows: the mean (probability) / median (rank) with a 10-90% band
            for ax, df, stat in ((a1, prob, "mean"), (a2, rank, "median")):
                Y = df.to_numpy(dtype=float)
                mid = np.nanmean(Y, 0) if stat == "mean" else np.nanmedian(Y, 0)
                ax.fill_between(x, np.nanpercentile(Y, 10, 0), np.nanpercentile(Y, 90, 0), alpha=0.25,
                                label=f"{len(df)} rows: 10-90%")
                ax.plot(x, mid, marker="o", ms=3, color="C0", label=f"{stat} over rows")
            groups = column(rows.set_index("prompt_idx"), "group").reindex(prob.index)
            if groups.notna().any() and 1 < groups.nunique() <= 8:
                for j, (gname, idx) in enumerate(groups.groupby(groups).groups.items()):
                    a1.plot(x, prob.loc[idx].mean(0).to_numpy(), lw=1, alpha=.8, color=f"C{j + 1}",
                            label=f"{gname} (mean, {len(idx)})")
            a1.legend(fontsize=7)
            a2.legend(fontsize=7)
        a1.set_xlabel(_HS_LABEL, fontsize=8); a1.set_ylabel("p(row's target)")
        a1.set_title(f"{self.lens_name}: each row's target probability"); a1.set_ylim(-0.02, 1.02)
        a2.set_yscale("log"); a2.invert_yaxis(); a2.set_xlabel(_HS_LABEL, fontsize=8)
        a2.set_ylabel("vocab rank of the target (1 = top)"); a2.set_title("target vocab rank (log scale)")
        a1.grid(alpha=.3); a2.grid(alpha=.3)
        fig.tight_layout()
        return fig

    def _emergence_figure(self, plt, rows: pd.DataFrame):
        """Histogram of the rows' emergence layers (block index), rows that never emerge at the right."""
        t = subset(rows, rows["target_id"] >= 0)
        n_layers = int(self.meta.get("n_layers", 0))
        em = column(t, "emergence_hidden_state")
        counts = {h: int((em == h).sum()) for h in range(n_layers + 1)}
        never = int(em.isna().sum())
        fig, ax = plt.subplots(figsize=(min(14.0, 3 + 0.3 * n_layers), 3.6))
        xs = list(range(n_layers + 1))
        ax.bar(xs, [counts[h] for h in xs], color="C0")
        ax.bar([n_layers + 1.5], [never], color="C7")
        ticks = plotting._thin(len(xs), 40)
        ax.set_xticks([xs[i] for i in ticks] + [n_layers + 1.5],
                      [("emb" if xs[i] == 0 else str(xs[i] - 1)) for i in ticks] + ["never"], fontsize=7)
        med = self.summary().get("median_emergence_layer")
        if med is not None:
            ax.axvline(med + 1, color="C3", ls="--", lw=1, label=f"median emergence layer {med:g}")
            ax.legend(fontsize=7)
        ax.set_xlabel("emergence layer (block whose output first has the target on top for good; emb = embeddings)",
                      fontsize=8)
        ax.set_ylabel("rows")
        ax.set_title(f"{self.lens_name}: where each row's target emerges ({len(t) - never} of {len(t)} rows)")
        fig.tight_layout()
        return fig

    def _tracked_figure(self, plt):
        tr = self._at_read("tracked")
        x = sorted(column(tr, "hidden_state").unique().tolist())
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for tok, g in tr.groupby("tracked_token", sort=False):
            piv = g.pivot_table(index="prompt_idx", columns="hidden_state", values="prob").reindex(columns=x)
            Y = piv.to_numpy(dtype=float)
            line = ax.plot(x, np.nanmean(Y, 0), marker="o", ms=3,
                           label=f"{tok!r}" + (f" (mean over {len(piv)} rows)" if len(piv) > 1 else ""))
            if len(piv) > 1:
                ax.fill_between(x, np.nanpercentile(Y, 10, 0), np.nanpercentile(Y, 90, 0), alpha=0.15,
                                color=line[0].get_color())
        ax.set_xlabel(_HS_LABEL, fontsize=8); ax.set_ylabel("probability"); ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{self.lens_name}: tracked tokens" + (" (10-90% band over rows)" if column(tr, "prompt_idx").nunique() > 1
                                                     else ""))
        ax.grid(alpha=.3); ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    def _grid_figure(self, rows: pd.DataFrame):
        m = self.tables["main"]
        p0 = int(column(rows, "prompt_idx").iloc[0])
        m0 = subset(m, m["prompt_idx"] == p0)
        pos = sorted(column(m0, "position").unique().tolist())
        hs = sorted(column(m0, "hidden_state").unique().tolist())
        grid = np.full((len(hs), len(pos)), np.nan)
        labels = [["" for _ in pos] for _ in hs]
        hi = {h: i for i, h in enumerate(hs)}
        pj = {p: j for j, p in enumerate(pos)}
        for r in _tuples(m0):
            grid[hi[r.hidden_state], pj[r.position]] = r.top1_prob
            labels[hi[r.hidden_state]][pj[r.position]] = r.top1
        toks = self.tables["tokens"]
        toks0 = toks[toks["prompt_idx"] == p0].set_index("position")["token"]
        title = f"{self.lens_name}: top-1 next token (colour = its probability)"
        if len(rows) > 1:
            title += f"; row {rows['row_id'].iloc[0]}: {_short(rows['prompt'].iloc[0], 40)!r}"
        return plotting.heatmap(
            grid, [repr(toks0.get(p, "?"))[1:-1][:12] for p in pos], hs, vmin=0, vmax=1, cell_text=labels,
            title=title, xlabel="input token (position)", ylabel=_HS_LABEL)


def _legacy_tables(tables: dict[str, pd.DataFrame], config) -> dict[str, pd.DataFrame]:
    """``main`` (with ``row_id``) and a ``rows`` table for a result saved before per-row targets
    (one target per prompt, or none), so its summary, report and figures work as today's.

    Raises:
        ResultLoadError: the result tracked several targets on every prompt (today's ``track``).
    """
    from ..core.errors import ResultLoadError

    main, fin = tables["main"].copy(), tables["final"]
    has_t = "target_id" in main.columns and bool(column(main, "target").notna().any())
    if has_t and int(cast(pd.Series, main.groupby("prompt_idx")["target"].nunique()).max()) > 1:
        raise ResultLoadError("this logit-lens result was saved when a target list meant tokens tracked on every "
                              "prompt (now the field track); its summary cannot be rebuilt: rerun the step")
    main.insert(1, "row_id", main["prompt_idx"])
    reads_output = getattr(config, "layer_convention", "hidden_states") != "resid_pre"
    recs = []
    for pi, g in subset(main, main["is_last"]).groupby("prompt_idx", sort=True):
        g = g.sort_values("hidden_state")
        f = _cells(subset(fin, (fin["prompt_idx"] == pi) & fin["is_last"]).iloc[0])
        pi = int(cast(int, pi))
        rec: dict[str, Any] = {"row_id": int(pi), "prompt": g["prompt"].iloc[0], "target": None, "foil": None,
                               "corrupted": None, "group": None, "prompt_idx": int(pi),
                               "position": int(g["position"].iloc[0]), "token": g["token"].iloc[0], "target_id": -1,
                               "final_top1": f["top1"], "final_top1_prob": float(f["top1_prob"]),
                               "target_prob_final": np.nan, "target_log_prob_final": np.nan,
                               "target_vocab_rank_final": -1}
        lm: dict[str, Any] = {"emergence_hidden_state": None, "emergence_layer": None, "jump_layer": None, "jump": None}
        if has_t:
            ranks = g["vocab_rank"].astype(int).tolist()
            lm = landmarks(g["hidden_state"].tolist(), g["prob"].tolist(), ranks)
            rec.update({"target": g["target"].iloc[0], "target_id": int(g["target_id"].iloc[0]),
                        "target_prob_final": float(f["target_prob"]),
                        "target_log_prob_final": float(np.log(f["target_prob"])),
                        "target_vocab_rank_final": ranks[-1] if reads_output else int(f["top1"] == g["target"].iloc[0])})
        jp = lm["jump"] or {}
        rec.update({"emergence_hidden_state": lm["emergence_hidden_state"], "emergence_layer": lm["emergence_layer"],
                    "jump_layer": lm["jump_layer"], "jump_from_hidden_state": jp.get("from_hidden_state"),
                    "jump_to_hidden_state": jp.get("to_hidden_state"), "jump_from_prob": jp.get("from_prob", np.nan),
                    "jump_to_prob": jp.get("to_prob", np.nan), "jump_gain": jp.get("gain", np.nan)})
        recs.append(rec)
    rows = pd.DataFrame(recs)
    for c in ("emergence_hidden_state", "emergence_layer", "jump_layer", "jump_from_hidden_state",
              "jump_to_hidden_state"):
        rows[c] = rows[c].astype("Int64")
    return {"main": main, "rows": rows}
