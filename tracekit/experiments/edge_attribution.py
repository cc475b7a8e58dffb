"""Edge attribution experiment (``kind: edge_attribution``): EAP / EAP-IG scores of every edge of
the model's graph, verified against exact path patching of single edges. The method:
:mod:`tracekit.circuits.edges`; rows: :class:`tracekit.experiments.circuit_rows.CircuitRowsExperiment`::

    from tracekit import EdgeAttribution, load_model
    rows = {"generator": {"name": "ioi", "n": 12}, "filter": "correct"}
    EdgeAttribution(dataset=rows, method="eap_ig").run(load_model()).tables["edges"]
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pandas as pd
from pydantic import Field

from ..circuits.edges import SIGN_CONVENTION, EdgeScores, edge_attribution
from ..circuits.paths import path_patch
from ..circuits.verification import choose_checked, compare
from ..dataset.paired import PairedRows
from ..model.info import HookedModel
from .attribution import VerifySpec, verification_lines
from .base import Result, register
from .circuit_rows import CircuitRowsExperiment, Mode
from .circuits_tables import bar_chart
from .patching_tables import column, is_missing, records

__all__ = ["EdgeAttribution", "EdgeAttributionResult"]


class EdgeAttributionResult(Result):
    """Result of :class:`EdgeAttribution`.

    Tables: ``edges`` (one line per edge of the graph: ``edge``, ``upstream``, ``downstream``,
    ``score`` = mean over rows in metric units, ``normalized`` = score / (mean clean - mean
    corrupted), ``abs_rank``); ``nodes`` (per upstream node the sum of its edges' scores = its
    node-level attribution, ``abs_rank``); ``rows``; ``verification`` (per checked edge
    ``approx_score``, ``exact_score`` from exact path patching of that one edge, ``approx_rank``,
    ``checked``).

    Summary keys: ``method``, ``mode``, ``metric``, ``ig_steps``, ``ig_rule`` (the interpolation
    points of ``eap_ig``: ``left`` = the ``eap`` package's ``k / m``, ``right``, ``midpoint``),
    ``sign_convention`` (the score's sign, and how it relates to the ``eap`` package's), ``n_rows``, ``n_edges``,
    ``mean_clean``, ``mean_corrupted``, ``top_edges`` (``{edge, score, normalized}``),
    ``top_nodes``, ``verification`` (as :class:`tracekit.experiments.attribution.AttributionPatchingResult`'s).
    """

    config: "EdgeAttribution"
    main_table = "edges"
    table_names = ("edges", "nodes", "rows", "verification")
    summary_keys = ("method", "mode", "metric", "ig_steps", "ig_rule", "sign_convention", "n_rows", "n_edges", "mean_clean", "mean_corrupted",
                    "top_edges", "top_nodes", "verification")
    null_reasons = {"verification": "verify.enabled is false: the scores were not checked against exact path patching",
                    "ig_steps": "method eap takes the gradient at the base run only",
                    "ig_rule": "method eap takes the gradient at the base run only"}

    def summary(self) -> dict:
        e, n = self.tables["edges"], self.tables["nodes"]
        rows = self.tables["rows"]
        m = self.config.metric
        k = self.config.top_n
        return {
            "method": self.config.method, "mode": self.config.mode, "metric": m,
            "ig_steps": self.config.ig_steps if self.config.method == "eap_ig" else None,
            "ig_rule": self.config.ig_rule if self.config.method == "eap_ig" else None,
            "sign_convention": SIGN_CONVENTION,
            "n_rows": int(len(rows)), "n_edges": int(len(e)),
            "mean_clean": float(column(rows, f"clean_{m}").mean()),
                "mean_corrupted": float(column(rows, f"corrupted_{m}").mean()),
            "top_edges": [{"edge": r["edge"], "score": round(float(r["score"]), 6),
                           "normalized": None if is_missing(r["normalized"]) else round(float(r["normalized"]), 6)}
                          for r in records(e.head(k))],
            "top_nodes": [{"node": r["node"], "score": round(float(r["score"]), 6)} for r in records(n.head(k))],
            "verification": self.meta.get("verification"),
        }

    def report(self) -> str:
        s = self.summary()
        lines = [f"edge attribution ({s['method']}{', ' + str(s['ig_steps']) + ' steps' if s['ig_steps'] else ''}, "
                 f"{s['mode']}) [{self.config.step_name}]: {s['n_rows']} row(s), {s['n_edges']} edges; "
                 f"{s['metric']} clean {s['mean_clean']:+.4f} corrupted {s['mean_corrupted']:+.4f}",
                 "  top edges by |score| (score: estimated change of the metric when only this edge is patched):"]
        for t in s["top_edges"][:15]:
            lines.append(f"    {t['score']:+.4f}  {t['edge']}")
        v = s["verification"]
        if v:
            lines += verification_lines(v, "exact path patching of each edge", "edges")
        else:
            lines.append("  NOT verified against exact path patching (verify.enabled: false)")
        return "\n".join(lines)

    def figures(self) -> dict:
        import matplotlib.pyplot as plt

        e = self.tables["edges"].head(25)
        fig, ax = plt.subplots(figsize=(6.5, 0.25 * len(e) + 1.2))
        bar_chart(ax, list(e["edge"]), e["score"].to_numpy(float),
             f"top edges, {self.config.method} ({self.config.mode})", f"score ({self.config.metric})")
        fig.tight_layout()
        figs = {"top_edges": fig}
        ver = self.tables.get("verification")
        if ver is not None and len(ver):
            fig, ax = plt.subplots(figsize=(4.6, 4.2))
            for kind, marker in (("top", "o"), ("random", "x")):
                h = ver[ver["checked"] == kind]
                ax.scatter(h["exact_score"], h["approx_score"], marker=marker, s=18, label=f"{kind} ({len(h)})")
            lim = float(np.nanmax(np.abs(ver[["exact_score", "approx_score"]].to_numpy(float)))) or 1.0
            ax.plot([-lim, lim], [-lim, lim], color="grey", lw=0.8, ls="--")
            ax.set_xlabel("exact (path patching of the edge)")
            ax.set_ylabel(f"{self.config.method} score")
            ax.legend(fontsize=7)
            fig.tight_layout()
            figs["verification"] = fig
        return figs


@register
class EdgeAttribution(CircuitRowsExperiment):
    """Edge attribution patching (EAP) or EAP with integrated gradients (EAP-IG) over every edge of
    the model's graph, verified against exact path patching of single edges.

    Fields:
        pairs / pairs_file / dataset: the rows (as :class:`tracekit.experiments.patching.ActivationPatching`).
        metric: ``logit_diff`` (default), ``prob``, ``log_prob`` or ``kl``.
        method: ``eap`` (gradient at the base run) or ``eap_ig`` (default; gradients averaged over
            ``ig_steps`` inputs interpolated from the base run's embeddings to the source run's).
        ig_steps: interpolation steps of ``eap_ig`` (default 5, as the MIB baseline).
        ig_rule: where the ``ig_steps`` points lie on the line (:func:`tracekit.circuits.edges.ig_alphas`):
            ``left`` (default: ``alpha = k / m``, ``k = 0..m-1``, the ``eap`` package's EAP-IG-inputs,
            so MIB's numbers reproduce), ``right`` (``k = 1..m``) or ``midpoint`` (``(k - 1/2) / m``).
        mode: ``denoising`` (default; base = corrupted run) or ``noising``.
        top_n: edges and nodes listed in the summary.
        verify: :class:`tracekit.experiments.attribution.VerifySpec`: the top edges and a random
            sample of the others are path-patched exactly on the same rows.

    Raises:
        MethodRefused: a model whose blocks have post-norms, residual multipliers or parallel
            attention/MLP (edges are not terms of a sum there).
    """

    kind: Literal["edge_attribution"] = "edge_attribution"
    method: Literal["eap", "eap_ig"] = "eap_ig"
    ig_steps: int = Field(default=5, ge=1, le=512)
    ig_rule: Literal["left", "right", "midpoint"] = "left"
    mode: Mode = "denoising"
    top_n: int = Field(default=20, ge=1)
    verify: VerifySpec = Field(default_factory=VerifySpec)

    result_class = EdgeAttributionResult

    def _run(self, model: HookedModel, inputs: PairedRows, progress: bool = True) -> EdgeAttributionResult:
        clean, corr, tgt, foil = self.ids(inputs)
        es = edge_attribution(model, clean, corr, tgt, foil, metric=self.metric, mode=self.mode,
                              method=self.method, ig_steps=self.ig_steps, ig_rule=self.ig_rule)
        edges = es.frame()
        nodes = _node_frame(es)
        tables = {"edges": edges, "nodes": nodes, "rows": self._rows_table(inputs, es.clean, es.corrupted)}
        meta: dict = {"verification": None, "graph": {"n_upstream": len(es.graph.upstream),
                                                      "n_downstream": len(es.graph.downstream)}}
        if self.verify.enabled:
            tables["verification"], meta["verification"] = _verify_edges(model, self, es, edges, clean, corr, tgt, foil)
        else:
            tables["verification"] = pd.DataFrame(columns=["edge", "approx_score", "exact_score", "approx_rank",
                                                           "checked"])
        return EdgeAttributionResult(self, tables, meta)


def _node_frame(es: EdgeScores) -> pd.DataFrame:
    """Per upstream node (heads, MLPs, input) the sum of its outgoing edges' mean scores."""
    s = es.mean().sum(0).numpy()
    df = pd.DataFrame({"node": es.graph.upstream, "score": s})
    df["abs_rank"] = df["score"].abs().rank(ascending=False, method="first").astype(int)
    return df.sort_values("abs_rank").reset_index(drop=True)


def _verify_edges(model: HookedModel, cfg: "EdgeAttribution", es: EdgeScores, edges: pd.DataFrame, clean, corr, tgt, foil) -> tuple[pd.DataFrame, dict]:
    """Exact path patching of the top edges and a random sample of the rest (one edge per variant)."""
    top, sample = choose_checked(edges["score"].to_numpy(float), cfg.verify.top_k, cfg.verify.n_random, cfg.verify.seed)
    idx = np.r_[top, sample]
    chk = edges.iloc[idx].reset_index(drop=True)
    run = path_patch(model, clean, corr, [[u] for u in chk["upstream"]], [[v] for v in chk["downstream"]], tgt, foil,
                     metrics=[cfg.metric], mode=cfg.mode)
    base = run.corrupted[:, 0] if cfg.mode == "denoising" else run.clean[:, 0]
    exact = (run.values[:, :, 0] - base[None]).mean(1).numpy()
    table = pd.DataFrame({"edge": chk["edge"], "approx_score": chk["score"].to_numpy(float), "exact_score": exact,
                          "approx_rank": chk["abs_rank"].to_numpy(int),
                          "checked": ["top"] * len(top) + ["random"] * len(sample)})
    stats = compare(table["approx_score"].to_numpy(float), exact, list(table["edge"]),
                    (table["checked"] == "top").to_numpy(), table["approx_rank"].to_numpy(), cfg.verify.top_k)
    return table, stats
