"""Circuit experiment (``kind: circuit``): a circuit (edges or nodes, ranked by a score, read from a
saved ``edge_attribution`` table, or listed by hand) run with everything outside it ablated; its
faithfulness over circuit sizes with the MIB measures (CPR, CMD) and bootstrap intervals. The method:
:mod:`tracekit.circuits.faithfulness`; rows: :class:`tracekit.experiments.circuit_rows.CircuitRowsExperiment`::

    from tracekit import Circuit, load_model
    rows = {"generator": {"name": "ioi", "n": 12}, "filter": "correct"}
    Circuit(dataset=rows, scores={"method": "eap_ig"}).run(load_model()).summary()["cpr"]
"""

from __future__ import annotations

import warnings
from typing import Literal, Optional

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..circuits.curves import (
    Candidates,
    circuit_frame,
    circuit_nodes,
    curve_drops,
    faithfulness_curve,
    hand_candidates,
    ranked_candidates,
    read_edge_scores,
)
from ..circuits.edges import edge_attribution
from ..circuits.faithfulness import circuit_from_edges, circuit_from_nodes
from ..circuits.graph import Graph, build_graph
from ..dataset.paired import PairedRows
from ..model.info import HookedModel
from .base import StrictModel, register
from .circuit_rows import MIB_FRACTIONS, CircuitRowsExperiment, Mode
from .circuits_tables import CircuitResult

__all__ = ["Circuit", "CircuitResult", "ScoreSpec"]


class ScoreSpec(StrictModel):
    """How a circuit's candidate edges (or nodes) are ranked when they are not listed by hand.

    Fields:
        method: ``eap_ig`` (default), ``eap``, or ``atp`` (node level: a node's score is the sum of
            its outgoing EAP edges, which equals attribution patching of its write).
        ig_steps: interpolation steps of ``eap_ig``.
        ig_rule: interpolation points of ``eap_ig``: ``left`` (default, the ``eap`` package's
            ``k / m``), ``right`` or ``midpoint`` (:func:`tracekit.circuits.edges.ig_alphas`).
        mode: ``denoising`` (default) or ``noising``.
        rank_by: ``abs`` (largest |score|, default) or ``signed`` (largest score).
        edges_file: or read the scores from a saved ``edges`` table (Parquet or CSV with columns
            ``edge`` and ``score``, e.g. an ``edge_attribution`` step's ``edges.parquet`` through a
            pipeline reference ``{from: eap_ig, path: edges.parquet}``) instead of computing them;
            ``method`` then only names them. The rows should be the same (the file does not say).
            One row per edge, every score a finite number; when the file sits in a saved result
            folder, the model recorded there (``meta.json``'s ``model_fingerprint``) must be this
            run's model (else refused, naming both); a file without one is used unchecked (a warning).
    """

    method: Literal["eap", "eap_ig", "atp"] = "eap_ig"
    ig_steps: int = Field(default=5, ge=1, le=512)
    ig_rule: Literal["left", "right", "midpoint"] = "left"
    mode: Mode = "denoising"
    rank_by: Literal["abs", "signed"] = "abs"
    edges_file: Optional[str] = None


@register
class Circuit(CircuitRowsExperiment):
    """A circuit (edges or nodes, ranked by a score or listed by hand), run with everything outside
    it ablated; its faithfulness over circuit sizes with the MIB measures
    (:mod:`tracekit.circuits.faithfulness`).

    Fields:
        pairs / pairs_file / dataset, metric: as :class:`EdgeAttribution`.
        level: ``edges`` (default: circuits of the top-k edges) or ``nodes`` (top-k heads and MLPs;
            a node circuit is every edge between its nodes).
        scores: :class:`ScoreSpec`, how candidates are ranked (default EAP-IG, 5 steps, by |score|).
        edges / nodes: a circuit listed by hand (``["a0.h1->a2.h3<q>", ...]`` / ``["a20.h0", "m3"]``);
            then only it (plus the full and empty circuits) is evaluated.
        sizes: circuit sizes evaluated: fractions in (0, 1] of the candidates and/or counts (integers
            above 1); default: the MIB fractions for edges (0.1% .. 100%) and 1, 2, 5, 10, 20, 50% and
            100% of the nodes.
        ablation: ``corrupted`` (default: each row's corrupted run), ``mean`` (mean over the clean
            prompts of the rows of the same token length), ``resample`` (another such row's writes,
            drawn with ``seed``) or ``zero``.
        threshold: the chosen circuit is the smallest evaluated one with faithfulness >= this (0.8; in (0, 1]).
        bootstrap: resamples of the rows for the intervals (0: none).
        seed: the bootstrap's seed (and the ``resample`` ablation's).
    """

    kind: Literal["circuit"] = "circuit"
    level: Literal["edges", "nodes"] = "edges"
    scores: ScoreSpec = Field(default_factory=ScoreSpec)
    edges: Optional[list[str]] = None
    nodes: Optional[list[str]] = None
    sizes: Optional[list[float]] = None
    ablation: Literal["corrupted", "mean", "zero", "resample"] = "corrupted"
    threshold: float = Field(default=0.8, gt=0, le=1)
    bootstrap: int = Field(default=1000, ge=0)
    seed: int = 0

    result_class = CircuitResult

    @field_validator("sizes")
    @classmethod
    def _sizes(cls, v: Optional[list[float]]) -> Optional[list[float]]:
        if v is not None:
            if not v:
                raise ValueError("sizes: give at least one size (a count >= 1 or a fraction in (0, 1])")
            bad = [x for x in v if x <= 0 or (x > 1 and float(x) != int(x))]
            if bad:
                raise ValueError(f"sizes: {bad[0]} is neither a count (an integer >= 1) nor a fraction in (0, 1]")
        return v

    @model_validator(mode="after")
    def _hand(self) -> "Circuit":
        if self.edges is not None and self.nodes is not None:
            raise ValueError("edges and nodes: list one circuit, as edges or as nodes, not both")
        if self.edges is not None and self.level != "edges" or self.nodes is not None and self.level != "nodes":
            raise ValueError("level: a circuit listed by hand sets the level (edges: level edges; nodes: level nodes)")
        return self

    def check(self, model: HookedModel) -> PairedRows:
        """:meth:`prepare`, then the circuit listed by hand (its edges or nodes are the graph's)."""
        inputs = self.prepare(model)
        graph = build_graph(model)
        if self.edges is not None:
            circuit_from_edges(graph, self.edges)
        if self.nodes is not None:
            circuit_from_nodes(graph, self.nodes)
        return inputs

    def _candidates(self, model: HookedModel, graph: Graph, ids: tuple) -> tuple[Candidates, Optional[dict]]:
        """The circuits to evaluate (listed by hand, or ranked scores computed here or read from
        ``scores.edges_file``) and the model recorded with a scores file."""
        if self.edges is not None or self.nodes is not None:
            return hand_candidates(graph, self.edges, self.nodes), None
        sp = self.scores
        scores_model = None
        if sp.edges_file:
            es, scores_model = read_edge_scores(graph, sp.edges_file, model)
            if scores_model is None:
                warnings.warn(f"scores.edges_file: {sp.edges_file} records no model (no meta.json with a "
                              "model_fingerprint beside it); its scores are used as they are, unchecked", stacklevel=3)
        else:
            clean, corr, tgt, foil = ids
            es = edge_attribution(model, clean, corr, tgt, foil, metric=self.metric, mode=sp.mode,
                                  method="eap_ig" if sp.method == "eap_ig" else "eap", ig_steps=sp.ig_steps,
                                  ig_rule=sp.ig_rule)
        return ranked_candidates(graph, es, self.level, self.sizes, MIB_FRACTIONS, sp.rank_by), scores_model

    def _run(self, model: HookedModel, inputs: PairedRows, progress: bool = True) -> CircuitResult:
        ids = self.ids(inputs)
        clean, corr, tgt, foil = ids
        graph = build_graph(model)
        hand = self.edges is not None or self.nodes is not None
        cand, scores_model = self._candidates(model, graph, ids)
        fc = faithfulness_curve(model, graph, clean, corr, tgt, foil, cand, self.level, self.metric, self.ablation,
                                self.seed, self.bootstrap, self.threshold)
        run, meas, j, f, m_empty = fc.run, fc.measures, fc.chosen, fc.faithfulness, fc.empty
        chosen = cand.circuits[j]
        circuit_df = circuit_frame(graph, chosen, cand.edge_scores)
        heads, mlps = circuit_nodes(circuit_df)
        # the full circuit against the clean run measured separately (cached forward): 1 unless the
        # circuit engine changed something it should not have
        den = float(run.clean[:, 0].mean()) - m_empty.mean()
        summary = {
            "level": self.level, "method": "hand" if hand else self.scores.method,
            "ig_rule": (self.scores.ig_rule if not hand and self.scores.method == "eap_ig" and not self.scores.edges_file
                        else None),
            "ablation": self.ablation,
            "n_rows": len(clean), "n_candidates": fc.n_candidates, "n_graph_edges": graph.n_edges,
            "mean_clean": float(run.clean[:, 0].mean()), "mean_corrupted": float(run.corrupted[:, 0].mean()),
            "mean_empty": float(m_empty.mean()),
            "full_faithfulness": float((fc.full.mean() - m_empty.mean()) / den) if abs(den) > 1e-9 else None,
            # a circuit listed by hand is one point, not a curve over sizes: no areas
            "cpr": None if hand else meas["cpr"], "cmd": None if hand else meas["cmd"],
            "cpr_ci": None if hand else meas["cpr_ci"], "cmd_ci": None if hand else meas["cmd_ci"],
            "threshold": self.threshold,
            "chosen": {"size": int(cand.counts[j]), "fraction": float(fc.fractions[j]), "n_edges": int(chosen.sum()),
                       "faithfulness": float(f[j]),
                       "ci_low": None if meas["ci_low"] is None else float(meas["ci_low"][j]),
                       "ci_high": None if meas["ci_high"] is None else float(meas["ci_high"][j])},
            "circuit_heads": heads, "circuit_mlps": mlps,
            "circuit_edges": list(circuit_df["edge"].head(50)),
            "chunks": {"circuit evaluation replay": {"circuits": list(run.batch_sizes)}},
        }
        # a score is the metric change of keeping the edge (denoising); towards the full model when
        # it has the sign of m(full) - m(empty)
        towards = float(np.sign(fc.full.mean() - m_empty.mean()) or 1.0) * (-1.0 if self.scores.mode == "noising" else 1.0)
        drops = curve_drops(fc.curve, cand, graph, sign=towards)
        summary["non_monotone"] = bool(drops)
        summary["curve_drops"] = drops
        rows = self._rows_table(inputs, run.clean[:, 0].numpy(), run.corrupted[:, 0].numpy())
        rows[f"empty_{self.metric}"] = m_empty
        rows[f"circuit_{self.metric}"] = fc.circuits[j]
        curve = fc.curve.copy()
        curve["falls"] = [False] + [bool(b < a) for a, b in zip(curve["faithfulness"], curve["faithfulness"].iloc[1:])]
        tables = {"curve": curve, "circuit": circuit_df,
                  "scores": cand.scores.head(5000).reset_index(drop=True), "rows": rows}
        return CircuitResult(self, tables, {"summary": summary, "n_scores": int(len(cand.scores)),
                                            "scores_file_model": scores_model})
