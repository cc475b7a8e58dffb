# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
# Over 600 lines (reason): the kind's config, its result class (per-row tables, scope-named summary, report, figures) and the loader of lens results saved before datasets (#21); the result class is the piece to move to logit_lens_tables.py, as patching_tables.py did for patching.
"""``kind: logit_lens`` -- at which layer does the answer appear in the residual stream?

The method and its numbering live in :mod:`tracekit.logit_lens` (notebook-callable); this module
validates the config, prepares the rows once (:mod:`tracekit.dataset`), calls the engine on their
token ids and shapes tables, summary, report and figures.

Rows: ``prompts`` (+ ``target``/``foil``: a string is every prompt's, a list one per prompt) or a
``dataset`` whose rows carry their own target, foil and named positions. ``track`` lists tokens
followed on every row.

Tables (``vocab_rank``: 1 = the top token of the vocabulary distribution; it was ``rank``):

* ``main``: one row per dataset row x position x hidden state: ``prompt_idx`` (index in this run),
  ``row_id`` (the dataset's id), ``prompt``, ``position``, ``token``, ``is_last``,
  ``hidden_state`` (the lens axis), ``layer`` (block index), ``site``, ``hook``, ``entropy``,
  ``top1``, ``top1_id``, ``top1_prob``, and the **row's own** ``target``, ``target_id``, ``prob``,
  ``log_prob``, ``vocab_rank`` (-1 / NaN on rows without a target); with foils also ``foil``,
  ``foil_id``, ``foil_prob``, ``foil_log_prob``, ``logit_diff`` (``log_prob - foil_log_prob`` =
  the target's logit minus the foil's);
* ``tracked`` (with ``track``): one row per row x position x hidden state x tracked token:
  ``tracked_token``, ``tracked_id``, ``prob``, ``log_prob``, ``vocab_rank``;
* ``rows``: one row per dataset row (:meth:`tracekit.dataset.PreparedDataset.frame` columns:
  ``row_id``, ``prompt``, ``target``, ``foil``, ``corrupted``, ``group``, ``pos_<NAME>``, extras)
  plus ``prompt_idx``, ``position`` / ``token`` (the read the row's numbers come from: the row's
  read position, or its last token with ``position: all``), ``target_id``, ``final_top1``,
  ``final_top1_prob``, ``target_prob_final``, ``target_log_prob_final``,
  ``target_vocab_rank_final`` (the model's own output), ``emergence_hidden_state``,
  ``emergence_layer``, ``jump_layer``, ``jump_from_hidden_state``, ``jump_to_hidden_state``,
  ``jump_from_prob``, ``jump_to_prob``, ``jump_gain``; with foils ``foil_id``,
  ``foil_prob_final``, ``logit_diff_final``;
* ``topk``: row x position x hidden state x k; ``tokens``: every row's tokenization (BOS included
  when prepended); ``final``: the model's own output distribution (top-k, the row's target, the
  tracked tokens) at each read position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import numpy as np
import pandas as pd
from pydantic import Field, field_validator, model_validator

from .. import plotting
from ..dataset import DatasetSpec, PreparedDataset
from ..lenses.train import TunedLensSpec, load_or_train_tuned_lens
from ..logit_lens import LENS_POSITIONS, LayerConvention, LensPoint, landmarks, lens_points, logit_lens
from ..results import round_sig
from ..tokens import parse_position, single_token_id, str_tokens
from . import onepass
from .base import Experiment, OptionalPrompts, Result, check_dataset_fields, kind_dataset, register

__all__ = ["LogitLens", "LogitLensInputs", "LogitLensResult"]

_HS_LABEL = "hidden state (0 = embeddings, h = output of block h-1)"
#: Rows listed one by one in the report (beyond: the first ones and a pointer to ``rows.parquet``).
_REPORT_ROWS = 30


@dataclass(frozen=True)
class LogitLensInputs:
    """What :meth:`LogitLens.prepare` builds once: the prepared rows (ids with BOS when prepended,
    per-row target/foil ids, named positions), per row the positions read and the one its summary
    numbers come from, the tracked tokens' ids, the hidden states read."""

    data: PreparedDataset
    ids: tuple[tuple[int, ...], ...]
    positions: tuple[tuple[int, ...], ...]
    summary_positions: tuple[int, ...]
    track_ids: tuple[int, ...]
    points: tuple[LensPoint, ...]


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
        hs = sorted(at["hidden_state"].unique().tolist())
        first = at[at["prompt_idx"] == rows["prompt_idx"].iloc[0]].sort_values("hidden_state")
        n = len(rows)
        out: dict[str, Any] = {
            "layer_convention": cfg.layer_convention,
            "hidden_states": hs,
            "hooks": first["hook"].tolist(),
            "n_rows": n,
            "n_prompts": n,
            "final_top1_by_row": rows["final_top1"].tolist(),
            "mean_entropy_by_hidden_state": self._by_hidden_state(
                at.groupby("hidden_state")["entropy"].mean().astype(float).to_dict()),
        }
        if self.has_targets:
            t = rows[rows["target_id"] >= 0]
            tat = at[at["target_id"] >= 0]
            em_layer = t["emergence_layer"].dropna()
            out.update({
                "target_by_row": [None if tid < 0 else tg for tg, tid in zip(rows["target"], rows["target_id"])],
                "target_prob_final_by_row": [_none_float(v) for v in rows["target_prob_final"]],
                "mean_target_prob_final": float(t["target_prob_final"].mean()),
                "emergence_hidden_state_by_row": [_none_int(v) for v in rows["emergence_hidden_state"]],
                "emergence_layer_by_row": [_none_int(v) for v in rows["emergence_layer"]],
                "jump_layer_by_row": [_none_int(v) for v in rows["jump_layer"]],
                "median_emergence_layer": float(em_layer.median()) if len(em_layer) else None,
                "share_rows_emerged": float(t["emergence_hidden_state"].notna().mean()),
                "mean_target_prob_by_hidden_state": self._by_hidden_state(
                    tat.groupby("hidden_state")["prob"].mean().astype(float).to_dict()),
                "median_target_rank_by_hidden_state": self._by_hidden_state(
                    {h: float(v) for h, v in tat.groupby("hidden_state")["vocab_rank"].median().items()}),
                "top1_accuracy_final": float((t["target_vocab_rank_final"] == 1).mean()),
            })
            if self.has_foils:
                f = rows[(rows["target_id"] >= 0) & (rows["foil_id"] >= 0)]
                fat = tat[tat["foil_id"] >= 0]
                out.update({
                    "logit_diff_final_by_row": [_none_float(v) for v in rows["logit_diff_final"]],
                    "mean_logit_diff_final": float(f["logit_diff_final"].mean()),
                    "mean_logit_diff_by_hidden_state": self._by_hidden_state(
                        fat.groupby("hidden_state")["logit_diff"].mean().astype(float).to_dict()),
                })
        if "tracked" in self.tables:
            tr = self._at_read("tracked")
            fin = self._final_at_read()
            names = list(cfg.track)
            out["tracked"] = names
            out["mean_tracked_prob_final"] = {
                tok: float(np.mean([p[j] for p in fin["tracked_probs"]])) for j, tok in enumerate(names)}
            out["mean_tracked_prob_by_hidden_state"] = {
                tok: self._by_hidden_state(g.groupby("hidden_state")["prob"].mean().astype(float).to_dict())
                for tok, g in tr.groupby("tracked_token", sort=False)}
        if n == 1:
            out.update(self._single_row(rows.iloc[0], first))
        return round_sig(out)  # significant digits, never decimals (a 4e-06 stays 4e-06)

    def _final_at_read(self) -> pd.DataFrame:
        fin = self.tables["final"]
        keys = self.tables["rows"][["prompt_idx", "position"]]
        return fin.merge(keys, on=["prompt_idx", "position"], how="inner").sort_values("prompt_idx")

    def _single_row(self, row: pd.Series, g: pd.DataFrame) -> dict:
        """The single-row keys (documented as such): exactly that row's values."""
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
        for r in rows.head(_REPORT_ROWS).itertuples():
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

    def _report_one(self, head: str, row: pd.Series) -> str:
        g = self._at_read().sort_values("hidden_state")
        has_t = int(row["target_id"]) >= 0
        table = []
        for r in g.itertuples():
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
        for r in rows.itertuples():
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
        at = at[at["target_id"] >= 0]
        x = sorted(at["hidden_state"].unique().tolist())
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
            groups = rows.set_index("prompt_idx")["group"].reindex(prob.index)
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
        t = rows[rows["target_id"] >= 0]
        n_layers = int(self.meta.get("n_layers", 0))
        em = t["emergence_hidden_state"]
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
        x = sorted(tr["hidden_state"].unique().tolist())
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
        ax.set_title(f"{self.lens_name}: tracked tokens" + (" (10-90% band over rows)" if tr["prompt_idx"].nunique() > 1
                                                     else ""))
        ax.grid(alpha=.3); ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    def _grid_figure(self, rows: pd.DataFrame):
        m = self.tables["main"]
        p0 = int(rows["prompt_idx"].iloc[0])
        m0 = m[m["prompt_idx"] == p0]
        pos = sorted(m0["position"].unique().tolist())
        hs = sorted(m0["hidden_state"].unique().tolist())
        grid = np.full((len(hs), len(pos)), np.nan)
        labels = [["" for _ in pos] for _ in hs]
        hi = {h: i for i, h in enumerate(hs)}
        pj = {p: j for j, p in enumerate(pos)}
        for r in m0.itertuples():
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


@register
class LogitLens(Experiment):
    """Logit lens over rows: per hidden state, each row's own target probability / log-prob / vocab
    rank, entropy, top-k; where each row's target emerges; tokens tracked on every row.

    Method: nostalgebraist 2020; tuned-lens ``LogitLens``. Engine: :func:`tracekit.logit_lens.logit_lens`
    (one batched pass per ``batch_size`` rows; each row's target gathered from the same
    log-softmax).

    Fields:
        prompts: one string or a list (batched with padding; each prompt's own tokens are read);
            or ``dataset`` instead.
        dataset: rows with their own ``target``, ``foil``, named ``positions``, ``group`` and extra
            columns (:class:`tracekit.dataset.DatasetSpec`: inline ``rows``, a file ``path`` or a
            ``generator`` such as ``capitals``); no ``target``/``foil`` beside it.
        target: with ``prompts``: a token string = every prompt's answer; a list = **one answer per
            prompt** (same length as ``prompts``). Each exactly one token, leading space included.
            Optional.
        foil: with ``prompts``: each prompt's contrasting token, like ``target`` (adds ``foil_prob``
            and ``logit_diff``). Optional.
        track: tokens followed on every row (the old "list of targets"): table ``tracked``.
        position: ``last`` (each row's last token), ``all`` (the classic grid picture), a token
            index (BOS counted; negative from the end) or a dataset's named position (``END``,
            ``SUBJ``...: resolved per row, after BOS and padding). The summary and the ``rows``
            table read each row at this position (its last token with ``all``).
        layer_convention: which hidden states are read: ``hidden_states`` (0 = embeddings ..
            n_layers = the output; default), ``resid_post`` (block outputs 1..n_layers) or
            ``resid_pre`` (block inputs 0..n_layers-1). Tables always carry ``hidden_state``,
            ``layer`` (block index) and ``hook``.
        top_k: number of top tokens kept per read.
        batch_size: rows per forward pass.
        lens: ``logit`` (default) or ``tuned``: the tuned lens (Belrose et al. 2023,
            :mod:`tracekit.lenses.tuned`): each hidden state's residual goes through its learned
            affine translator before the readout; same tables, figures and summary keys.
        tuned: with ``lens: tuned``, the tuned lens (:class:`tracekit.lenses.train.TunedLensSpec`):
            ``{path: folder}`` loads a saved lens (tracekit's or the tuned-lens package's layout),
            otherwise a training config (default: train on the stdlib corpus once per model, then
            load from the cache).

    Summary keys (every one states its scope; lists ``*_by_row`` follow the ``rows`` table's
    order; ``*_by_hidden_state`` lists are indexed by hidden state, null where none is read; the
    numbers are read at each row's summary position):
        layer_convention, hidden_states, hooks: what was read.
        n_rows (= n_prompts, kept for old configs): rows run.
        final_top1_by_row: the model's own top-1 next token per row.
        mean_entropy_by_hidden_state: mean over rows of the lens entropy (nats).
        With targets (means, medians and shares over the rows that have one):
        target_by_row, target_prob_final_by_row: each row's target and its probability in the
        model's output; mean_target_prob_final: their mean; top1_accuracy_final: share of rows
        whose target is the model's top-1; emergence_hidden_state_by_row, emergence_layer_by_row,
        jump_layer_by_row: each row's landmarks (:func:`tracekit.logit_lens.landmarks`; null where
        none); share_rows_emerged: share of rows whose target is top-1 for good from some hidden
        state; median_emergence_layer: median emergence layer over the rows that emerge (null when
        none does); mean_target_prob_by_hidden_state: mean over rows of each row's own target
        probability; median_target_rank_by_hidden_state: median over rows of its vocab rank.
        With foils: logit_diff_final_by_row, mean_logit_diff_final, mean_logit_diff_by_hidden_state
        (target logit minus foil logit).
        With track: tracked (the tokens), mean_tracked_prob_final ({token: mean over rows}),
        mean_tracked_prob_by_hidden_state ({token: [mean by hidden state]}).
        Single-row results only (present only when the run has exactly one row, and then exactly
        that row's; with several rows use the keys above): final_top1, top1_by_hidden_state,
        top1_prob_by_hidden_state, entropy_by_hidden_state, and with a target: target,
        target_prob_final, target_prob_by_hidden_state, target_rank_by_hidden_state,
        target_log_prob_by_hidden_state, emergence_hidden_state, emergence_layer, jump, jump_layer.

    Raises (from :meth:`check`):
        TokenizationError: a target/foil/tracked token is not exactly one token (the message shows
            its tokenization), a position out of range, a prompt longer than the model's context.
        DatasetError: a dataset row that cannot be used (naming it), a named position a row lacks.
    """

    kind: Literal["logit_lens"] = "logit_lens"
    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    target: Optional[Union[str, list[str]]] = None
    foil: Optional[Union[str, list[str]]] = None
    track: list[str] = Field(default_factory=list)
    position: Union[int, str] = "last"
    layer_convention: LayerConvention = "hidden_states"
    top_k: int = Field(default=10, ge=1, le=1000)
    batch_size: int = Field(default=8, ge=1)
    lens: Literal["logit", "tuned"] = "logit"
    tuned: Optional[TunedLensSpec] = None

    result_class = LogitLensResult
    retired = {"positions": "position", "layers": "layer_convention; layers now always means block indices"}

    @field_validator("position")
    @classmethod
    def _position(cls, v, info):  # info: pydantic ValidationInfo (unannotated: a Protocol beartype cannot check)
        try:
            pos = parse_position(v, LENS_POSITIONS)
        except Exception as e:  # noqa: BLE001 - reported with the field's path by pydantic
            raise ValueError(str(e).removeprefix("position: ")) from None
        if pos.kind == "name" and info.data.get("dataset") is None:
            raise ValueError(f"unknown position {v!r}: use last, all or a token index (BOS counted; -1 = the last); "
                             "a name (END, IO, SUBJ...) is a dataset's named position and needs a dataset whose rows "
                             "name it")
        return v

    @model_validator(mode="after")
    def _rows_fit(self):
        check_dataset_fields(self.prompts, self.dataset, self.target, self.foil)
        if self.tuned is not None and self.lens != "tuned":
            raise ValueError("tuned: a tuned lens spec is only read with lens: tuned (set lens: tuned, or drop tuned)")
        for name in ("target", "foil"):
            v = getattr(self, name)
            if isinstance(v, list) and len(v) != len(self.prompts):
                raise ValueError(f"{name}: {len(v)} tokens for {len(self.prompts)} prompt(s); a {name} list gives "
                                 f"each prompt its own answer (one per prompt). To follow the same tokens on every "
                                 f"prompt use track: {v!r}")
        pos = parse_position(self.position, LENS_POSITIONS)
        if pos.kind == "name" and self.dataset is not None and self.dataset.rows is not None:
            for i, r in enumerate(self.dataset.rows):  # inline rows: a missing name is known before any model
                if pos.text not in r.positions:
                    raise ValueError(f"position: {pos.text!r} is not a named position of dataset.rows[{i}] (its "
                                     f"positions: {sorted(r.positions) or 'none'}); name one the rows have or use "
                                     "last / all / an index")
        return self

    @property
    def targets(self) -> list[str]:
        """The ``target`` field as a list (one per prompt, or the one string)."""
        if self.target is None:
            return []
        return [self.target] if isinstance(self.target, str) else list(self.target)

    def prepare(self, model) -> LogitLensInputs:
        """Prepare the rows once (tokenized with BOS as the model spec says; per-row target/foil
        ids; named positions), resolve the read positions per row and the tracked tokens' ids
        (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`).

        Raises:
            TokenizationError / DatasetError: see the class docstring.
            ConfigError: a tuned lens to train with ``tuned.seq_len`` longer than the model's context.
        """
        if self.dataset is None:  # the prompts' target/foil: TokenizationError naming the field, as before
            for name in ("target", "foil"):
                v = getattr(self, name)
                for j, t in enumerate([v] if isinstance(v, str) else (v or [])):
                    single_token_id(model, t, field=name if isinstance(v, str) else f"{name}[{j}]")
        data = kind_dataset(model, self.prompts, self.dataset, self.target, self.foil, batch_size=self.batch_size)
        track_ids = tuple(single_token_id(model, t, field=f"track[{j}]") for j, t in enumerate(self.track))
        pos = parse_position(self.position, LENS_POSITIONS)
        ids = tuple(tuple(e.ids) for e in data.examples)
        if pos.kind == "name":
            positions = tuple((i,) for i in data.position(str(pos.text), field="position"))
        else:
            positions = tuple(tuple(pos.resolve(model, e.prompt, e.ids, field="position", skip_bos=False))
                              for e in data.examples)
        summary_positions = tuple(p[0] if pos.single else len(seq) - 1 for p, seq in zip(positions, ids))
        points = tuple(lens_points(int(model.cfg.n_layers), self.layer_convention))
        if self.lens == "tuned":
            (self.tuned or TunedLensSpec()).check_context(model, "tuned")
        return LogitLensInputs(data, ids, positions, summary_positions, track_ids, points)

    def _run(self, model, inputs: LogitLensInputs, progress: bool = True) -> LogitLensResult:
        # the engine reads the prepared ids, targets and positions: nothing is tokenized again
        from tqdm.auto import tqdm

        data = inputs.data
        tuned = load_or_train_tuned_lens(model, self.tuned, progress, "tuned") if self.lens == "tuned" else None
        bar = tqdm(total=len(data), desc=f"{self.lens} lens", disable=not progress, leave=False)

        def engine(track: list[int]) -> list:
            return logit_lens(model, data, position=self.position, layer_convention=self.layer_convention,
                              top_k=self.top_k, batch_size=self.batch_size, progress=bar.update,
                              track=track, reads=[list(p) for p in inputs.positions],
                              translator=None if tuned is None else tuned.transform)

        try:  # in a sweep, steps differing only in target share one pass (tracekit.experiments.onepass)
            shared = onepass.current() if tuned is None else None
            got = shared.lens(model, self, len(data), list(inputs.track_ids), engine) if shared else None
            lens = engine(list(inputs.track_ids)) if got is None else onepass.split_lens(
                got[0], got[1], len(inputs.track_ids), [e.target_id for e in data.examples])
        finally:
            bar.close()
        decode = _Decoder(model)
        has_t, has_f = data.has_targets, data.has_foils
        main, topk, toks, final, tracked, per_row = [], [], [], [], [], []
        for pi, (ex, pl) in enumerate(zip(data.examples, lens)):
            main.append(self._main_rows(pi, ex, pl, decode, has_t, has_f))
            topk.append(self._topk_rows(pi, pl, decode))
            toks.append({"prompt_idx": np.full(len(pl.ids), pi), "position": np.arange(len(pl.ids)),
                         "token": _obj(pl.tokens), "token_id": np.asarray(pl.ids, dtype=np.int64)})
            final.append(self._final_rows(pi, ex, pl, decode))
            if pl.track_ids:
                tracked.append(self._tracked_rows(pi, ex, pl))
            per_row.append(self._row_record(pi, ex, pl, inputs.summary_positions[pi], decode, has_f))
        # one DataFrame per table from concatenated columns (a frame per prompt and pd.concat cost
        # ~1 s per 256 prompts)
        rec = pd.DataFrame(per_row).drop(columns=["row_id"])
        frame = data.frame()
        frame = frame.rename(columns={c: f"extra_{c}" for c in frame.columns if c in rec.columns})
        rows = pd.concat([frame.reset_index(drop=True),
                          rec.reset_index(drop=True)], axis=1)
        for c in ("emergence_hidden_state", "emergence_layer", "jump_layer", "jump_from_hidden_state",
                  "jump_to_hidden_state"):
            rows[c] = rows[c].astype("Int64")
        tables = {"main": _frame(main), "rows": rows, "topk": _frame(topk), "tokens": _frame(toks),
                  "final": pd.DataFrame([r for part in final for r in part])}
        if tracked:
            tables["tracked"] = _frame(tracked)
        points = inputs.points
        meta = {"n_layers": int(model.cfg.n_layers), "hooks": [p.hook for p in points],
                "hidden_states": [p.hidden_state for p in points], "d_vocab": int(model.cfg.d_vocab),
                "source": data.source, "dropped": dict(data.dropped), "lens": self.lens}
        if tuned is not None:
            meta["tuned"] = {**tuned.source, "record": tuned.record, "config": tuned.config.to_dict()}
        return LogitLensResult(self, tables, meta)

    # ---- table shaping ------------------------------------------------------------------------
    def _main_rows(self, pi: int, ex, pl, decode, has_t: bool, has_f: bool) -> dict[str, np.ndarray]:
        """Columns of the ``main`` rows of one row (hidden state x position)."""
        H, P = pl.entropy.shape
        n = H * P
        n_real = len(pl.ids)
        out = {
            "prompt_idx": np.full(n, pi, dtype=np.int64), "row_id": np.full(n, ex.row_id, dtype=np.int64),
            "prompt": _obj([pl.prompt] * n),
            "position": np.tile(np.asarray(pl.positions, dtype=np.int64), H),
            "token": _obj([pl.tokens[p] for p in pl.positions] * H),
            "is_last": np.tile(np.asarray([p == n_real - 1 for p in pl.positions], dtype=bool), H),
            "hidden_state": np.repeat(np.asarray([p.hidden_state for p in pl.points], dtype=np.int64), P),
            "layer": np.repeat(np.asarray([p.layer for p in pl.points], dtype=np.int64), P),
            "site": np.repeat(_obj([p.site for p in pl.points]), P),
            "hook": np.repeat(_obj([p.hook for p in pl.points]), P),
            "entropy": pl.entropy.reshape(-1).numpy(),
            "top1": _obj(decode(pl.topk_ids[..., 0].reshape(-1))),
            "top1_id": pl.topk_ids[..., 0].reshape(-1).numpy(),
            "top1_prob": pl.topk_probs[..., 0].reshape(-1).numpy(),
            "target": np.full(n, ex.row.target if pl.target_ids else None, dtype=object),
        }
        if not has_t:
            return out
        if pl.target_ids:
            lp = pl.target_log_prob[..., 0].reshape(-1).numpy()
            rank = pl.target_rank[..., 0].reshape(-1).numpy().astype(np.int64)
        else:
            lp, rank = np.full(n, np.nan, dtype=np.float32), np.full(n, -1, dtype=np.int64)
        out.update({"target_id": np.full(n, pl.target_id if pl.target_ids else -1, dtype=np.int64),
                    "prob": np.exp(lp), "log_prob": lp, "vocab_rank": rank})
        if has_f:
            flp = (pl.foil_log_prob[..., 0].reshape(-1).numpy() if pl.foil_ids
                   else np.full(n, np.nan, dtype=np.float32))
            out.update({"foil": np.full(n, ex.row.foil if pl.foil_ids else None, dtype=object),
                        "foil_id": np.full(n, pl.foil_ids[0] if pl.foil_ids else -1, dtype=np.int64),
                        "foil_prob": np.exp(flp), "foil_log_prob": flp, "logit_diff": lp - flp})
        return out

    def _tracked_rows(self, pi: int, ex, pl) -> dict[str, np.ndarray]:
        """Columns of the ``tracked`` rows of one row (hidden state x position x tracked token)."""
        H, P, K = pl.track_log_prob.shape
        n = H * P * K
        n_real = len(pl.ids)
        lp = pl.track_log_prob.reshape(-1).numpy()
        return {
            "prompt_idx": np.full(n, pi, dtype=np.int64), "row_id": np.full(n, ex.row_id, dtype=np.int64),
            "position": np.tile(np.repeat(np.asarray(pl.positions, dtype=np.int64), K), H),
            "is_last": np.tile(np.repeat(np.asarray([p == n_real - 1 for p in pl.positions], dtype=bool), K), H),
            "hidden_state": np.repeat(np.asarray([p.hidden_state for p in pl.points], dtype=np.int64), P * K),
            "layer": np.repeat(np.asarray([p.layer for p in pl.points], dtype=np.int64), P * K),
            "hook": np.repeat(_obj([p.hook for p in pl.points]), P * K),
            "tracked_token": np.tile(_obj(list(self.track)), H * P),
            "tracked_id": np.tile(np.asarray(pl.track_ids, dtype=np.int64), H * P),
            "prob": np.exp(lp), "log_prob": lp,
            "vocab_rank": pl.track_rank.reshape(-1).numpy().astype(np.int64),
        }

    def _topk_rows(self, pi: int, pl, decode) -> dict[str, np.ndarray]:
        """Columns of the ``topk`` rows of one prompt (hidden state x position x k)."""
        H, P, K = pl.topk_ids.shape
        return {
            "prompt_idx": np.full(H * P * K, pi, dtype=np.int64),
            "position": np.tile(np.repeat(np.asarray(pl.positions, dtype=np.int64), K), H),
            "hidden_state": np.repeat(np.asarray([p.hidden_state for p in pl.points], dtype=np.int64), P * K),
            "k": np.tile(np.arange(1, K + 1), H * P),
            "token": _obj(decode(pl.topk_ids.reshape(-1))),
            "token_id": pl.topk_ids.reshape(-1).numpy(),
            "prob": pl.topk_probs.reshape(-1).numpy(),
        }

    def _final_rows(self, pi: int, ex, pl, decode) -> list[dict]:
        """The ``final`` rows of one row: the model's own output at each read position."""
        n_real = len(pl.ids)
        out = []
        for j, p in enumerate(pl.positions):
            row = {"prompt_idx": pi, "row_id": ex.row_id, "position": p, "is_last": p == n_real - 1,
                   "top1": decode(pl.final_topk_ids[j, :1])[0], "top1_prob": float(pl.final_topk_probs[j, 0]),
                   "topk_tokens": decode(pl.final_topk_ids[j]), "topk_probs": pl.final_topk_probs[j].tolist(),
                   "target": ex.row.target if pl.target_ids else None,
                   "target_prob": float(pl.final_log_prob[j, 0].exp()) if pl.target_ids else float("nan"),
                   "target_vocab_rank": int(pl.final_rank[j, 0]) if pl.target_ids else -1}
            if self.track:
                row["tracked_tokens"] = list(self.track)
                row["tracked_probs"] = pl.final_track_log_prob[j].exp().tolist()
            out.append(row)
        return out

    def _row_record(self, pi: int, ex, pl, at: int, decode, has_f: bool) -> dict:
        """The ``rows`` table's numbers for one row, read at its summary position ``at``."""
        j = pl.positions.index(at)
        hs = [p.hidden_state for p in pl.points]
        rec: dict[str, Any] = {
            "row_id": ex.row_id, "prompt_idx": pi, "position": at, "token": pl.tokens[at],
            "target_id": pl.target_id if pl.target_ids else -1,
            "final_top1": decode(pl.final_topk_ids[j, :1])[0], "final_top1_prob": float(pl.final_topk_probs[j, 0]),
            "target_prob_final": np.nan, "target_log_prob_final": np.nan, "target_vocab_rank_final": -1,
            "emergence_hidden_state": None, "emergence_layer": None, "jump_layer": None,
            "jump_from_hidden_state": None, "jump_to_hidden_state": None, "jump_from_prob": np.nan,
            "jump_to_prob": np.nan, "jump_gain": np.nan,
        }
        if pl.target_ids:
            lp_final = float(pl.final_log_prob[j, 0])
            probs = pl.target_log_prob[:, j, 0].exp().tolist()
            ranks = [int(r) for r in pl.target_rank[:, j, 0].tolist()]
            lm = landmarks(hs, probs, ranks)
            rec.update({"target_prob_final": float(np.exp(lp_final)), "target_log_prob_final": lp_final,
                        "target_vocab_rank_final": int(pl.final_rank[j, 0]),
                        "emergence_hidden_state": lm["emergence_hidden_state"],
                        "emergence_layer": lm["emergence_layer"], "jump_layer": lm["jump_layer"]})
            if lm["jump"]:
                jp = lm["jump"]
                rec.update({"jump_from_hidden_state": jp["from_hidden_state"], "jump_to_hidden_state": jp["to_hidden_state"],
                            "jump_from_prob": jp["from_prob"], "jump_to_prob": jp["to_prob"], "jump_gain": jp["gain"]})
        if has_f:
            rec["foil_id"] = pl.foil_ids[0] if pl.foil_ids else -1
            flp = float(pl.final_foil_log_prob[j, 0]) if pl.foil_ids else np.nan
            rec["foil_prob_final"] = float(np.exp(flp))
            rec["logit_diff_final"] = rec["target_log_prob_final"] - flp
        return rec


def _legacy_tables(tables: dict[str, pd.DataFrame], config) -> dict[str, pd.DataFrame]:
    """``main`` (with ``row_id``) and a ``rows`` table for a result saved before per-row targets
    (one target per prompt, or none), so its summary, report and figures work as today's.

    Raises:
        ResultLoadError: the result tracked several targets on every prompt (today's ``track``).
    """
    from ..core.errors import ResultLoadError

    main, fin = tables["main"].copy(), tables["final"]
    has_t = "target_id" in main.columns and main["target"].notna().any()
    if has_t and main.groupby("prompt_idx")["target"].nunique().max() > 1:
        raise ResultLoadError("this logit-lens result was saved when a target list meant tokens tracked on every "
                              "prompt (now the field track); its summary cannot be rebuilt: rerun the step")
    main.insert(1, "row_id", main["prompt_idx"])
    reads_output = getattr(config, "layer_convention", "hidden_states") != "resid_pre"
    recs = []
    for pi, g in main[main["is_last"]].groupby("prompt_idx", sort=True):
        g = g.sort_values("hidden_state")
        f = fin[(fin["prompt_idx"] == pi) & fin["is_last"]].iloc[0]
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


def _obj(items) -> np.ndarray:
    """A 1-D object array of ``items`` (strings stay Python strings, as in a DataFrame column)."""
    out = np.empty(len(items), dtype=object)
    out[:] = list(items)
    return out


def _frame(parts: list[dict[str, np.ndarray]]) -> pd.DataFrame:
    """One DataFrame from per-prompt column dicts (same keys), columns concatenated once."""
    return pd.DataFrame({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


class _Decoder:
    """Token id -> string, memoised (the same ids recur across hidden states)."""

    def __init__(self, model):
        self.model = model
        self.memo: dict[int, str] = {}

    def __call__(self, ids) -> list[str]:
        out = []
        for i in (int(x) for x in ids.reshape(-1).tolist()):
            s = self.memo.get(i)
            if s is None:
                s = self.memo[i] = str_tokens(self.model, [i])[0]
            out.append(s)
        return out
