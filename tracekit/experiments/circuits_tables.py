"""Result tables and figures of the circuit kinds: :class:`CircuitResult` (``kind: circuit``,
:class:`tracekit.experiments.circuits.Circuit`) and the bar chart of the edge attribution and path
patching figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..circuits.curves import drop_text
from .base import Result
from .patching_tables import column, is_missing, records, where

if TYPE_CHECKING:
    from .circuits import Circuit

__all__ = ["CircuitResult", "bar_chart"]


class CircuitResult(Result):
    """Result of :class:`Circuit`.

    Tables: ``curve`` (one line per evaluated circuit size: ``circuit_size`` = edges or nodes ranked in,
    ``fraction`` = size / all, ``n_edges`` = edges of the graph in the circuit, ``metric`` = mean
    over rows, ``faithfulness`` = (m(C) - m(empty)) / (m(full) - m(empty)), ``ci_low``/``ci_high``
    = bootstrap interval over rows, ``falls`` = faithfulness below the previous size's); ``circuit`` (the chosen circuit's edges, or nodes, with their
    scores); ``scores`` (every edge's or node's score, ranked); ``rows`` (per row clean, corrupted,
    empty-circuit and chosen-circuit metric).

    Summary keys: ``level``, ``method``, ``ig_rule`` (``eap_ig`` scores computed here: their
    interpolation rule), ``ablation``, ``n_rows``, ``n_candidates`` (edges or
    nodes ranked), ``n_graph_edges``, ``mean_clean``, ``mean_corrupted``, ``mean_empty``,
    ``full_faithfulness`` (the full circuit's mean metric relative to the clean run's, measured in a
    separate forward pass: 1 unless the circuit engine is wrong), ``cpr``, ``cmd`` (MIB areas over
    fractions 0..1) with ``cpr_ci``/``cmd_ci``, ``threshold``, ``chosen`` (``{size, fraction,
    n_edges, faithfulness, ci_low, ci_high}``: the smallest evaluated circuit reaching
    ``threshold``, else the most faithful), ``circuit_heads`` / ``circuit_mlps`` (the nodes its
    edges touch, by the summed |score| of their edges in it),
    ``circuit_edges`` (its first 50 edges by score); ``non_monotone`` (the curve falls somewhere as
    edges are added) and ``curve_drops`` (per fall, :func:`tracekit.circuits.curves.curve_drops`:
    the sizes, the drop, whether the bootstrap intervals overlap, the edges added between the two
    sizes, their summed score and the negative-score edges that explain it, most negative first).
    """

    config: "Circuit"
    main_table = "curve"
    table_names = ("curve", "circuit", "scores", "rows")
    summary_keys = ("level", "method", "ig_rule", "ablation", "n_rows", "n_candidates", "n_graph_edges", "mean_clean",
                    "mean_corrupted", "mean_empty", "full_faithfulness", "cpr", "cmd", "cpr_ci", "cmd_ci", "threshold",
                    "chosen", "circuit_heads", "circuit_mlps", "circuit_edges", "non_monotone", "curve_drops", "chunks")
    null_reasons = {"ig_rule": "the scores were not computed with eap_ig in this step (method eap or atp, a circuit "
                               "listed by hand, or scores.edges_file: that step's summary has its ig_rule)",
                    "cpr_ci": "one row, bootstrap: 0, or a circuit listed by hand",
                    "cmd_ci": "one row, bootstrap: 0, or a circuit listed by hand",
                    "cpr": "a circuit listed by hand is one size, not a curve", "cmd": "a circuit listed by hand is one size, not a curve",
                    "full_faithfulness": "the full model and the empty circuit score the same"}

    def summary(self) -> dict:
        out = dict(self.meta["summary"])
        return out

    def report(self) -> str:
        s = self.summary()
        ch = s["chosen"]

        def ci(v):
            return "" if v is None else f" [{v[0]:.3f}, {v[1]:.3f}]"
        lines = [f"circuit ({s['level']}, {s['method']}, ablation {s['ablation']}) [{self.config.step_name}]: "
                 f"{s['n_rows']} row(s), {s['n_candidates']} candidate {s['level']}",
                 f"  {self.config.metric}: clean {s['mean_clean']:+.4f}, corrupted {s['mean_corrupted']:+.4f}, empty "
                 f"circuit {s['mean_empty']:+.4f}; full model faithfulness {s['full_faithfulness']:.4f}",
                 (f"  CPR {s['cpr']:.3f}{ci(s['cpr_ci'])} (area under faithfulness; higher is better), "
                  f"CMD {s['cmd']:.3f}{ci(s['cmd_ci'])} (area under |1 - faithfulness|; lower is better)"
                  if s["cpr"] is not None else "  (a circuit listed by hand: faithfulness of that circuit only)"),
                 "  size  fraction  edges  faithfulness [95% CI]"]
        for r in records(self.tables["curve"]):
            c = "" if is_missing(r["ci_low"]) else f" [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
            falls = "  <- falls (non-monotone)" if r.get("falls") is True else ""
            lines.append(f"  {int(r['circuit_size']):5d}  {r['fraction']:.4f}  {int(r['n_edges']):6d}  {r['faithfulness']:+.3f}{c}"
                         f"{falls}")
        size = f"{ch['size']} {s['level']}" + (f" ({ch['n_edges']} edges)" if s["level"] == "nodes" else "")
        reached = ch["faithfulness"] >= s["threshold"]
        lines.append(f"  chosen circuit: {size}, faithfulness {ch['faithfulness']:+.3f} "
                     + (f"(the smallest reaching the threshold {s['threshold']})" if reached else
                        f"(NO evaluated circuit reaches the threshold {s['threshold']}: the most faithful one)"))
        heads, mlps = s["circuit_heads"], s["circuit_mlps"]
        if heads:
            lines.append(f"  its {len(heads)} heads, by the summed |score| of their edges in it: {', '.join(heads[:25])}"
                         f"{' ...' if len(heads) > 25 else ''}")
        if mlps:
            lines.append(f"  its {len(mlps)} MLPs: {', '.join(mlps[:15])}{' ...' if len(mlps) > 15 else ''}")
        lines.append("  (every edge of it: the circuit table)")
        for d in s.get("curve_drops") or []:
            lines.append("  " + drop_text(d))
        return "\n".join(lines)

    def figures(self) -> dict:
        import matplotlib.pyplot as plt

        c = self.tables["curve"]
        c = where(c, c["fraction"] > 0)
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        ax.plot(c["fraction"], c["faithfulness"], marker="o", label="circuit")
        if column(c, "ci_low").notna().any():
            ax.fill_between(c["fraction"], c["ci_low"], c["ci_high"], alpha=0.25, label="95% bootstrap over rows")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.axhline(self.config.threshold, color="tab:green", lw=0.8, ls=":", label=f"threshold {self.config.threshold}")
        ax.set_xscale("log")
        ax.set_xlabel(f"fraction of {self.meta['summary']['level']} in the circuit")
        ax.set_ylabel("faithfulness (1 = full model, 0 = empty circuit)")
        s = self.summary()
        areas = f": CPR {s['cpr']:.3f}, CMD {s['cmd']:.3f}" if s["cpr"] is not None else ""
        ax.set_title(f"{s['method']} circuit, ablation {s['ablation']}{areas}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return {"faithfulness": fig}


def bar_chart(ax: Any, labels: Sequence[str], values: Sequence[float] | np.ndarray, title: str, xlabel: str) -> None:
    """Horizontal bars of ``values`` (positive blue, negative red) labelled by ``labels``, first on top,
    on the matplotlib axes ``ax``."""
    ax.barh(range(len(values)), values, color=["tab:blue" if v >= 0 else "tab:red" for v in values])
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
