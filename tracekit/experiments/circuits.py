# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportIncompatibleVariableOverride=false, reportOptionalMemberAccess=false, reportReturnType=false, reportOptionalSubscript=false, reportGeneralTypeIssues=false
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
import pandas as pd
import torch
from pydantic import Field, field_validator, model_validator

from ..circuits.edges import EdgeScores, edge_attribution
from ..circuits.faithfulness import (
    circuit_from_edges,
    circuit_from_nodes,
    evaluate_circuits,
    faithfulness_measures,
    top_k_circuits,
)
from ..circuits.graph import build_graph
from ..core.errors import DatasetError
from ..errors import CircuitError
from .base import Result, StrictModel, register
from .circuit_rows import MIB_FRACTIONS, CircuitRowsExperiment, Mode
from .patching import ActivationPatchingInputs

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


class CircuitResult(Result):
    """Result of :class:`Circuit`.

    Tables: ``curve`` (one line per evaluated circuit size: ``circuit_size`` = edges or nodes ranked in,
    ``fraction`` = size / all, ``n_edges`` = edges of the graph in the circuit, ``metric`` = mean
    over rows, ``faithfulness`` = (m(C) - m(empty)) / (m(full) - m(empty)), ``ci_low``/``ci_high``
    = bootstrap interval over rows); ``circuit`` (the chosen circuit's edges, or nodes, with their
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
    ``circuit_edges`` (its first 50 edges by score).
    """

    config: "Circuit"
    main_table = "curve"
    table_names = ("curve", "circuit", "scores", "rows")
    summary_keys = ("level", "method", "ig_rule", "ablation", "n_rows", "n_candidates", "n_graph_edges", "mean_clean",
                    "mean_corrupted", "mean_empty", "full_faithfulness", "cpr", "cmd", "cpr_ci", "cmd_ci", "threshold",
                    "chosen", "circuit_heads", "circuit_mlps", "circuit_edges")
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
        for _, r in self.tables["curve"].iterrows():
            c = "" if pd.isna(r["ci_low"]) else f" [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
            lines.append(f"  {int(r['circuit_size']):5d}  {r['fraction']:.4f}  {int(r['n_edges']):6d}  {r['faithfulness']:+.3f}{c}")
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
        return "\n".join(lines)

    def figures(self) -> dict:
        import matplotlib.pyplot as plt

        c = self.tables["curve"]
        c = c[c["fraction"] > 0]
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        ax.plot(c["fraction"], c["faithfulness"], marker="o", label="circuit")
        if c["ci_low"].notna().any():
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
    def _sizes(cls, v):
        if v is not None:
            if not v:
                raise ValueError("sizes: give at least one size (a count >= 1 or a fraction in (0, 1])")
            bad = [x for x in v if x <= 0 or (x > 1 and float(x) != int(x))]
            if bad:
                raise ValueError(f"sizes: {bad[0]} is neither a count (an integer >= 1) nor a fraction in (0, 1]")
        return v

    @model_validator(mode="after")
    def _hand(self):
        if self.edges is not None and self.nodes is not None:
            raise ValueError("edges and nodes: list one circuit, as edges or as nodes, not both")
        if self.edges is not None and self.level != "edges" or self.nodes is not None and self.level != "nodes":
            raise ValueError("level: a circuit listed by hand sets the level (edges: level edges; nodes: level nodes)")
        return self

    def check(self, model) -> ActivationPatchingInputs:
        inputs = self.prepare(model)
        graph = build_graph(model)
        if self.edges is not None:
            circuit_from_edges(graph, self.edges)
        if self.nodes is not None:
            circuit_from_nodes(graph, self.nodes)
        return inputs

    def _counts(self, n: int) -> list[int]:
        """The evaluated sizes as counts of ``n`` candidates (sorted, unique, 1..n): a value in (0, 1]
        is a fraction (rounded, at least 1), a larger one a count."""
        sizes = self.sizes if self.sizes is not None else (
            list(MIB_FRACTIONS) if self.level == "edges" else [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
        return sorted({max(1, min(n, int(round(x * n)))) if x <= 1 else min(n, int(x)) for x in sizes})

    def _run(self, model, inputs: ActivationPatchingInputs, progress: bool = True) -> CircuitResult:
        clean, corr, tgt, foil = self.ids(inputs)
        graph = build_graph(model)
        hand = self.edges is not None or self.nodes is not None
        es, scores_model = None, None
        if hand:
            circ = (circuit_from_edges(graph, self.edges) if self.edges is not None
                    else circuit_from_nodes(graph, self.nodes))[None]
            counts = [len(self.edges) if self.edges is not None else len(self.nodes)]
            cand = list(self.edges or self.nodes)
            scores_df = pd.DataFrame({"name": cand, "score": np.nan})
        else:
            sp = self.scores
            if sp.edges_file:
                es, scores_model = _read_edges(graph, sp.edges_file, model)
                if scores_model is None:
                    warnings.warn(f"scores.edges_file: {sp.edges_file} records no model (no meta.json with a "
                                  "model_fingerprint beside it); its scores are used as they are, unchecked", stacklevel=2)
            else:
                es = edge_attribution(model, clean, corr, tgt, foil, metric=self.metric, mode=sp.mode,
                                      method="eap_ig" if sp.method == "eap_ig" else "eap", ig_steps=sp.ig_steps,
                                      ig_rule=sp.ig_rule)
            if self.level == "edges":
                mean = es.mean()
                counts = self._counts(graph.n_edges)
                circ = top_k_circuits(graph, mean, counts, sp.rank_by)
                scores_df = es.frame().rename(columns={"edge": "name"})
            else:
                node_s = es.mean().sum(0)  # per upstream node
                names = [u for u in graph.upstream if u != "input"]
                vals = torch.stack([node_s[graph.up_index[u]] for u in names])
                key = vals.abs() if sp.rank_by == "abs" else vals
                order = torch.argsort(key, descending=True, stable=True).tolist()
                counts = self._counts(len(names))
                circ = torch.stack([circuit_from_nodes(graph, [names[i] for i in order[:k]]) for k in counts])
                scores_df = pd.DataFrame({"name": [names[i] for i in order], "score": vals[order].numpy()})
        full, empty = graph.mask.clone(), torch.zeros_like(graph.mask)
        run = evaluate_circuits(model, clean, corr, torch.cat([circ, full[None], empty[None]]), tgt, foil,
                                metrics=[self.metric], ablation=self.ablation, seed=self.seed)
        vals = run.values[:, :, 0].numpy()
        m_full, m_empty, m_c = vals[-2], vals[-1], vals[:-2]
        # candidates: every edge of the graph, or every head and MLP (a hand-listed circuit's fraction too)
        n_cand = graph.n_edges if self.level == "edges" else len(graph.upstream) - 1
        fracs = [k / n_cand for k in counts]
        meas = faithfulness_measures(m_c, m_full, m_empty, fracs, self.bootstrap, self.seed)
        curve = pd.DataFrame({"circuit_size": counts, "fraction": fracs, "n_edges": circ.flatten(1).sum(1).numpy(),
                              "metric": m_c.mean(1), "faithfulness": meas["faithfulness"],
                              "ci_low": meas["ci_low"] or [np.nan] * len(counts),
                              "ci_high": meas["ci_high"] or [np.nan] * len(counts)})
        f = np.asarray(meas["faithfulness"], float)
        reach = np.nonzero(f >= self.threshold)[0]
        j = int(reach[0]) if len(reach) else int(np.nanargmax(f)) if np.isfinite(f).any() else 0
        chosen = circ[j]
        circuit_df = _circuit_frame(graph, chosen, es)
        heads, mlps = _circuit_nodes(circuit_df)
        # the full circuit against the clean run measured separately (cached forward): 1 unless the
        # circuit engine changed something it should not have
        den = float(run.clean[:, 0].mean()) - m_empty.mean()
        summary = {
            "level": self.level, "method": "hand" if hand else self.scores.method,
            "ig_rule": (self.scores.ig_rule if not hand and self.scores.method == "eap_ig" and not self.scores.edges_file
                        else None),
            "ablation": self.ablation,
            "n_rows": len(clean), "n_candidates": int(n_cand), "n_graph_edges": graph.n_edges,
            "mean_clean": float(run.clean[:, 0].mean()), "mean_corrupted": float(run.corrupted[:, 0].mean()),
            "mean_empty": float(m_empty.mean()),
            "full_faithfulness": float((m_full.mean() - m_empty.mean()) / den) if abs(den) > 1e-9 else None,
            # a circuit listed by hand is one point, not a curve over sizes: no areas
            "cpr": None if hand else meas["cpr"], "cmd": None if hand else meas["cmd"],
            "cpr_ci": None if hand else meas["cpr_ci"], "cmd_ci": None if hand else meas["cmd_ci"],
            "threshold": self.threshold,
            "chosen": {"size": int(counts[j]), "fraction": float(fracs[j]), "n_edges": int(chosen.sum()),
                       "faithfulness": float(f[j]),
                       "ci_low": None if meas["ci_low"] is None else float(meas["ci_low"][j]),
                       "ci_high": None if meas["ci_high"] is None else float(meas["ci_high"][j])},
            "circuit_heads": heads, "circuit_mlps": mlps,
            "circuit_edges": list(circuit_df["edge"].head(50)),
        }
        rows = self._rows_table(inputs, run.clean[:, 0].numpy(), run.corrupted[:, 0].numpy())
        rows[f"empty_{self.metric}"] = m_empty
        rows[f"circuit_{self.metric}"] = m_c[j]
        tables = {"curve": curve, "circuit": circuit_df, "scores": scores_df.head(5000).reset_index(drop=True),
                  "rows": rows}
        return CircuitResult(self, tables, {"summary": summary, "n_scores": int(len(scores_df)),
                                            "scores_file_model": scores_model})


def _edges_file_model(path: str) -> Optional[dict]:
    """The model recorded with a saved edges table: ``{name, fingerprint, file}`` from the
    ``meta.json`` of the result folder holding it (what :meth:`Result.save` writes), or None when
    the folder records none (a table saved by hand)."""
    import json
    from pathlib import Path

    meta = Path(path).parent / "meta.json"
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or not m.get("model_fingerprint"):
        return None
    name = m.get("model", {}).get("name") if isinstance(m.get("model"), dict) else None
    return {"name": name, "fingerprint": str(m["model_fingerprint"]), "file": str(meta)}


def _read_edges(graph, path: str, model=None) -> tuple[EdgeScores, Optional[dict]]:
    """Edge scores (one row: their mean) from a saved ``edges`` table, and the model recorded with
    it (:func:`_edges_file_model`; checked against ``model``'s fingerprint).

    Raises:
        DatasetError: the file cannot be read, lacks ``edge``/``score``, has a row without an edge
            name or with a score that is not a finite number (NaN), names an edge twice, names an
            edge this model's graph does not have, or was computed on another model (its result
            folder's ``meta.json`` records another fingerprint).
    """
    from pathlib import Path

    from ..model.load import model_fingerprint, model_spec_of

    p = Path(path)
    try:
        df = pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)
    except Exception as e:  # noqa: BLE001 - re-raised naming the field
        raise DatasetError(f"scores.edges_file: cannot read {path!r} ({type(e).__name__}: {e})") from e
    if not {"edge", "score"} <= set(df.columns):
        raise DatasetError(f"scores.edges_file: {path!r} needs columns 'edge' and 'score' (has {list(df.columns)[:8]})")
    recorded = _edges_file_model(path)
    if model is not None and recorded is not None:
        fp = model_fingerprint(model)
        if recorded["fingerprint"] != fp:
            raise DatasetError(
                f"scores.edges_file: {path!r} holds scores of model {recorded['name']!r} (fingerprint "
                f"{recorded['fingerprint']}, {recorded['file']}), but this run's model is "
                f"{model_spec_of(model).name!r} (fingerprint {fp}); compute the scores on this model (an "
                "edge_attribution step with the same model, or drop scores.edges_file) or run the circuit on "
                "the model the scores came from")
    scores = torch.zeros(1, *graph.mask.shape)
    first: dict[tuple[int, int], int] = {}
    for i, (e, v) in enumerate(zip(df["edge"], df["score"])):
        if not isinstance(e, str) or not e.strip():
            raise DatasetError(f"scores.edges_file: {path!r} row {i} has no edge name ({e!r}); give every row an "
                               "edge 'upstream->downstream' or drop the row")
        try:
            d, u = graph.parse_edge(e, f"scores.edges_file row {i}")
        except CircuitError as err:
            raise DatasetError(f"{err} (scores from another model?)") from None
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = float("nan")
        if not np.isfinite(x):
            raise DatasetError(f"scores.edges_file: {path!r} row {i} ({e}) has score {v!r}, not a finite number; "
                               "recompute the scores (an edge_attribution step) or repair that row")
        if (d, u) in first:
            raise DatasetError(f"scores.edges_file: {path!r} rows {first[(d, u)]} and {i} both score edge {e}; "
                               "keep one row per edge")
        first[(d, u)] = i
        scores[0, d, u] = x
    nan = torch.full((1,), float("nan"))
    return EdgeScores(graph, scores, nan, nan, "file", "denoising", "", 0), recorded


def _circuit_nodes(circuit_df: pd.DataFrame) -> tuple[list[str], list[str]]:
    """The heads and MLPs a circuit's edges touch (a head through its output or its query input; an
    MLP through its output or input), ordered by the summed |score| of their edges in the circuit
    (graph order for a circuit listed by hand)."""
    weight: dict[str, float] = {}
    for _, r in circuit_df.iterrows():
        s = 0.0 if pd.isna(r["score"]) else abs(float(r["score"]))
        for n in (r["upstream"], r["downstream"]):
            if n.startswith("a") and (n.endswith("<q>") or "<" not in n) or n.startswith("m"):
                key = n.split("<")[0]
                weight[key] = weight.get(key, 0.0) + s
    order = sorted(weight, key=lambda n: (-weight[n], _node_key(n)))
    return [n for n in order if n.startswith("a")], [n for n in order if n.startswith("m")]


def _node_key(n: str) -> tuple:
    layer, _, rest = n[1:].partition(".h")
    return (int(layer), 0 if n.startswith("a") else 1, int(rest.split("<")[0]) if rest else 0)


def _circuit_frame(graph, chosen: torch.Tensor, es: Optional[EdgeScores]) -> pd.DataFrame:
    """The chosen circuit's edges with their mean scores (NaN for a circuit listed by hand), by |score|."""
    v, u = chosen.nonzero(as_tuple=True)
    score = es.mean()[v, u].numpy() if es is not None else np.full(len(v), np.nan)
    df = pd.DataFrame({"upstream": [graph.upstream[i] for i in u.tolist()],
                       "downstream": [graph.downstream[i] for i in v.tolist()], "score": score})
    df.insert(0, "edge", df["upstream"] + "->" + df["downstream"])
    return df.assign(_a=df["score"].abs()).sort_values("_a", ascending=False).drop(columns="_a").reset_index(drop=True)
