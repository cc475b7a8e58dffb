"""A circuit's candidates and its faithfulness curve: what the ``circuit`` kind
(:class:`tracekit.experiments.circuits.Circuit`) runs, usable on its own.

* :func:`size_counts`: circuit sizes (fractions and counts) as counts of the candidates.
* :func:`hand_candidates` / :func:`ranked_candidates`: the circuits to evaluate, from a circuit
  listed by hand or from edge scores ranked (edges, or nodes: a node's score is the sum of its
  outgoing edges' scores).
* :func:`read_edge_scores`: edge scores from a saved ``edges`` table (checked against the model).
* :func:`faithfulness_curve`: every candidate circuit, the full and the empty circuit run
  (:func:`tracekit.circuits.faithfulness.evaluate_circuits`), the MIB measures and the chosen one.
* :func:`circuit_frame` / :func:`circuit_nodes`: the chosen circuit's edges and the heads and MLPs
  they touch.
* :func:`curve_drops`: where the curve is non-monotone (faithfulness falls when edges are added)
  and which of the added edges have negative scores.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool

from ..core.errors import DatasetError
from ..errors import CircuitError
from ..model.info import HookedModel
from .edges import EdgeScores
from .faithfulness import (
    CircuitRun,
    circuit_from_edges,
    circuit_from_nodes,
    evaluate_circuits,
    faithfulness_measures,
    top_k_circuits,
)
from .graph import Graph

__all__ = ["Candidates", "FaithfulnessCurve", "size_counts", "hand_candidates", "ranked_candidates",
           "read_edge_scores", "edges_file_model", "faithfulness_curve", "circuit_frame", "circuit_nodes",
           "NODE_FRACTIONS", "curve_drops", "drop_text"]

#: The default node-circuit sizes (fractions of the heads and MLPs).
NODE_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class Candidates:
    """The circuits to evaluate.

    Attributes:
        circuits: ``[sizes, n_down, n_up]`` bool, one circuit per size.
        counts: per circuit its size (edges or nodes ranked in).
        scores: every candidate's ``name`` and ``score``, ranked (NaN scores for a hand-listed circuit).
        edge_scores: the edge scores ranked (None for a circuit listed by hand).
    """

    circuits: Bool[torch.Tensor, "sizes n_down n_up"]
    counts: list[int]
    scores: pd.DataFrame
    edge_scores: Optional[EdgeScores]


def size_counts(sizes: Optional[Sequence[float]], default: Sequence[float], n: int) -> list[int]:
    """Sizes as counts of ``n`` candidates (sorted, unique, 1..n): a value in (0, 1] is a fraction
    (rounded, at least 1), a larger one a count; ``sizes`` None takes ``default``."""
    use = sizes if sizes is not None else list(default)
    return sorted({max(1, min(n, int(round(x * n)))) if x <= 1 else min(n, int(x)) for x in use})


def hand_candidates(graph: Graph, edges: Optional[Sequence[str]], nodes: Optional[Sequence[str]]) -> Candidates:
    """The one circuit listed by hand (``edges`` or else ``nodes``).

    Raises:
        CircuitError: an edge or node the graph does not have.
    """
    if edges is not None:
        circ = circuit_from_edges(graph, edges)[None]
        cand = list(edges)
    else:
        assert nodes is not None
        circ = circuit_from_nodes(graph, nodes)[None]
        cand = list(nodes)
    return Candidates(circ, [len(cand)], pd.DataFrame({"name": cand, "score": np.nan}), None)


def ranked_candidates(graph: Graph, es: EdgeScores, level: str, sizes: Optional[Sequence[float]],
                      edge_default: Sequence[float], rank_by: str) -> Candidates:
    """The top-k circuits of the edges (``level`` ``edges``) or of the nodes (``nodes``: heads and
    MLPs by the sum of their outgoing edges' mean scores) ranked by ``rank_by`` (``abs`` or ``signed``),
    one per size of ``sizes`` (default ``edge_default`` for edges, :data:`NODE_FRACTIONS` for nodes)."""
    if level == "edges":
        mean = es.mean()
        counts = size_counts(sizes, edge_default, graph.n_edges)
        circ = top_k_circuits(graph, mean, counts, rank_by)
        return Candidates(circ, counts, es.frame().rename(columns={"edge": "name"}), es)
    node_s = es.mean().sum(0)  # per upstream node
    names = [u for u in graph.upstream if u != "input"]
    vals = torch.stack([node_s[graph.up_index[u]] for u in names])
    key = vals.abs() if rank_by == "abs" else vals
    order = torch.argsort(key, descending=True, stable=True).tolist()
    counts = size_counts(sizes, NODE_FRACTIONS, len(names))
    circ = torch.stack([circuit_from_nodes(graph, [names[i] for i in order[:k]]) for k in counts])
    scores = pd.DataFrame({"name": [names[i] for i in order], "score": vals[order].numpy()})
    return Candidates(circ, counts, scores, es)


@dataclass(frozen=True)
class FaithfulnessCurve:
    """What :func:`faithfulness_curve` returns.

    Attributes:
        curve: one line per size: ``circuit_size``, ``fraction``, ``n_edges``, ``metric`` (mean over
            rows), ``faithfulness``, ``ci_low``/``ci_high``.
        run: the circuits' run (:class:`tracekit.circuits.faithfulness.CircuitRun`; the last two
            circuits are the full and the empty one).
        measures: :func:`tracekit.circuits.faithfulness.faithfulness_measures`'s dict.
        chosen: the index of the chosen circuit (the smallest reaching ``threshold``, else the most
            faithful).
        fractions: per size its fraction of the candidates; faithfulness: per size (float64).
        full / empty / circuits: ``[rows]``, ``[rows]``, ``[sizes, rows]`` the metric of the full,
            the empty and each candidate circuit.
        n_candidates: edges of the graph, or heads and MLPs.
    """

    curve: pd.DataFrame
    run: CircuitRun
    measures: dict
    chosen: int
    fractions: list[float]
    faithfulness: np.ndarray
    full: np.ndarray
    empty: np.ndarray
    circuits: np.ndarray
    n_candidates: int


def faithfulness_curve(model: HookedModel, graph: Graph, clean: Sequence[Sequence[int]],
                       corrupted: Sequence[Sequence[int]], target: Sequence[int], foil: Optional[Sequence[int]],
                       cand: Candidates, level: str, metric: str, ablation: str, seed: int, bootstrap: int,
                       threshold: float) -> FaithfulnessCurve:
    """Run every candidate circuit with the full and the empty one, and their faithfulness over
    sizes (fractions of the candidates: every edge of the graph for ``level`` ``edges``, every head
    and MLP for ``nodes``) with ``bootstrap`` intervals over rows.

    Args:
        model: the model.
        graph: its :class:`Graph`.
        clean: per row the clean token ids.
        corrupted: per row the corrupted token ids (as long as the clean ones).
        target: per row one target id.
        foil: per row one foil id, or None.
        cand: :class:`Candidates`.
        level: ``edges`` or ``nodes`` (what the fractions count).
        metric: one metric name.
        ablation: ``corrupted``, ``mean``, ``zero`` or ``resample``
            (:func:`tracekit.circuits.faithfulness.evaluate_circuits`).
        seed: the bootstrap's and the ``resample`` ablation's seed.
        bootstrap: resamples of the rows for the intervals (0: none).
        threshold: the faithfulness the chosen circuit reaches.

    Raises:
        CircuitError / MethodRefused / PatchingError: as :func:`tracekit.circuits.faithfulness.evaluate_circuits`.
    """
    full, empty = graph.mask.clone(), torch.zeros_like(graph.mask)
    circ, counts = cand.circuits, cand.counts
    run = evaluate_circuits(model, clean, corrupted, torch.cat([circ, full[None], empty[None]]), target, foil,
                            metrics=[metric], ablation=ablation, seed=seed)
    vals = run.values[:, :, 0].numpy()
    m_full, m_empty, m_c = vals[-2], vals[-1], vals[:-2]
    # candidates: every edge of the graph, or every head and MLP (a hand-listed circuit's fraction too)
    n_cand = graph.n_edges if level == "edges" else len(graph.upstream) - 1
    fracs = [k / n_cand for k in counts]
    meas = faithfulness_measures(m_c, m_full, m_empty, fracs, bootstrap, seed)
    curve = pd.DataFrame({"circuit_size": counts, "fraction": fracs, "n_edges": circ.flatten(1).sum(1).numpy(),
                          "metric": m_c.mean(1), "faithfulness": meas["faithfulness"],
                          "ci_low": meas["ci_low"] or [np.nan] * len(counts),
                          "ci_high": meas["ci_high"] or [np.nan] * len(counts)})
    f = np.asarray(meas["faithfulness"], float)
    reach = np.nonzero(f >= threshold)[0]
    j = int(reach[0]) if len(reach) else int(np.nanargmax(f)) if np.isfinite(f).any() else 0
    return FaithfulnessCurve(curve, run, meas, j, fracs, f, m_full, m_empty, m_c, int(n_cand))


def edges_file_model(path: str) -> Optional[dict]:
    """The model recorded with a saved edges table: ``{name, fingerprint, file}`` from the
    ``meta.json`` of the result folder holding it (what ``Result.save`` writes), or None when
    the folder records none (a table saved by hand)."""
    meta = Path(path).parent / "meta.json"
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or not m.get("model_fingerprint"):
        return None
    name = m.get("model", {}).get("name") if isinstance(m.get("model"), dict) else None
    return {"name": name, "fingerprint": str(m["model_fingerprint"]), "file": str(meta)}


def read_edge_scores(graph: Graph, path: str, model: Optional[HookedModel] = None
                     ) -> tuple[EdgeScores, Optional[dict]]:
    """Edge scores (one row: their mean) from a saved ``edges`` table, and the model recorded with
    it (:func:`edges_file_model`; checked against ``model``'s fingerprint).

    Raises:
        DatasetError: the file cannot be read, lacks ``edge``/``score``, has a row without an edge
            name or with a score that is not a finite number (NaN), names an edge twice, names an
            edge this model's graph does not have, or was computed on another model (its result
            folder's ``meta.json`` records another fingerprint).
    """
    from ..model.load import model_fingerprint, model_spec_of

    p = Path(path)
    try:
        df = pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)
    except Exception as e:  # noqa: BLE001 - re-raised naming the field
        raise DatasetError(f"scores.edges_file: cannot read {path!r} ({type(e).__name__}: {e})") from e
    if not {"edge", "score"} <= set(df.columns):
        raise DatasetError(f"scores.edges_file: {path!r} needs columns 'edge' and 'score' (has {list(df.columns)[:8]})")
    recorded = edges_file_model(path)
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


def circuit_nodes(circuit_df: pd.DataFrame) -> tuple[list[str], list[str]]:
    """The heads and MLPs a circuit's edges touch (a head through its output or its query input; an
    MLP through its output or input), ordered by the summed |score| of their edges in the circuit
    (graph order for a circuit listed by hand): ``(heads, mlps)``."""
    weight: dict[str, float] = {}
    for up, down, score in zip(circuit_df["upstream"], circuit_df["downstream"], circuit_df["score"]):
        s = 0.0 if pd.isna(score) else abs(float(score))
        for n in (up, down):
            if n.startswith("a") and (n.endswith("<q>") or "<" not in n) or n.startswith("m"):
                key = n.split("<")[0]
                weight[key] = weight.get(key, 0.0) + s
    order = sorted(weight, key=lambda n: (-weight[n], _node_key(n)))
    return [n for n in order if n.startswith("a")], [n for n in order if n.startswith("m")]


def _node_key(n: str) -> tuple[int, int, int]:
    layer, _, rest = n[1:].partition(".h")
    return (int(layer), 0 if n.startswith("a") else 1, int(rest.split("<")[0]) if rest else 0)


def circuit_frame(graph: Graph, chosen: Bool[torch.Tensor, "n_down n_up"], es: Optional[EdgeScores]) -> pd.DataFrame:
    """The chosen circuit's edges (``edge``, ``upstream``, ``downstream``, ``score``: the mean
    score, NaN for a circuit listed by hand), by |score|."""
    v, u = chosen.nonzero(as_tuple=True)
    score = es.mean()[v, u].numpy() if es is not None else np.full(len(v), np.nan)
    df = pd.DataFrame({"upstream": [graph.upstream[i] for i in u.tolist()],
                       "downstream": [graph.downstream[i] for i in v.tolist()], "score": score})
    df.insert(0, "edge", df["upstream"] + "->" + df["downstream"])
    return df.assign(_a=df["score"].abs()).sort_values("_a", ascending=False).drop(columns="_a").reset_index(drop=True)


def curve_drops(curve: pd.DataFrame, cand: Candidates, graph: Graph, n_named: int = 5, sign: float = 1.0) -> list[dict]:
    """Where faithfulness falls as the circuit grows, and the added edges that push it down.

    Between two consecutive evaluated sizes ``k_i < k_j`` a larger circuit holds every edge of the
    smaller one (top-k of one ranking), so a drop ``f(k_j) < f(k_i)`` comes from the edges added
    between them. With ``rank_by: abs`` those include edges of negative effect: ``score x sign <
    0``, they push the metric away from the full model (a denoising score is the metric change of
    keeping the edge; ``sign`` turns it towards the full model: ``sign(m(full) - m(empty))``,
    negated for noising scores). Each drop lists the added edges, their summed effect and the
    negative ones, most negative first (the scores are the measured attributions of the ranking,
    e.g. EAP-IG; the drop itself is the measured faithfulness difference).

    Args:
        curve: the ``curve`` table (``circuit_size``, ``fraction``, ``faithfulness``, ``ci_low``,
            ``ci_high``), one line per size of ``cand``, increasing.
        cand: the candidates evaluated (their circuits and edge scores).
        graph: the graph (edge names).
        n_named: negative edges named per drop at most.
        sign: +1 or -1, what turns a score into its push towards the full model.

    Returns:
        One dict per drop: ``from_size``, ``to_size``, ``from_fraction``, ``to_fraction``,
        ``from_faithfulness``, ``to_faithfulness``, ``drop`` (> 0), ``within_ci`` (the two sizes'
        bootstrap intervals overlap: the drop may be noise; None without intervals), ``n_added``
        (edges), ``added_score_sum``, ``n_negative``, ``negative_score_sum``, ``negative_edges``
        (``[{edge, score}]``, the ``n_named`` most negative); sums and scores are ``score x sign``
        (metric units, positive = towards the full model); empty for a monotone curve or a
        circuit listed by hand (no scores).
    """
    if cand.edge_scores is None or len(curve) < 2:
        return []
    mean = cand.edge_scores.mean()
    f = curve["faithfulness"].to_numpy(dtype=float)
    lo, hi = curve["ci_low"].to_numpy(dtype=float), curve["ci_high"].to_numpy(dtype=float)
    out = []
    for i in range(len(f) - 1):
        j = i + 1
        if not (np.isfinite(f[i]) and np.isfinite(f[j]) and f[j] < f[i]):
            continue
        added = cand.circuits[j] & ~cand.circuits[i]
        v, u = added.nonzero(as_tuple=True)
        sc = mean[v, u].double().numpy() * float(sign)
        order = np.argsort(sc, kind="stable")
        neg = [int(k) for k in order if sc[k] < 0]
        within = None
        if np.isfinite(lo[i]) and np.isfinite(lo[j]):
            within = bool(lo[i] <= hi[j] and lo[j] <= hi[i])
        out.append({
            "from_size": int(curve["circuit_size"].iloc[i]), "to_size": int(curve["circuit_size"].iloc[j]),
            "from_fraction": float(curve["fraction"].iloc[i]), "to_fraction": float(curve["fraction"].iloc[j]),
            "from_faithfulness": float(f[i]), "to_faithfulness": float(f[j]), "drop": float(f[i] - f[j]),
            "within_ci": within, "n_added": int(len(sc)), "added_score_sum": float(sc.sum()),
            "n_negative": len(neg), "negative_score_sum": float(sc[neg].sum()) if neg else 0.0,
            "negative_edges": [{"edge": f"{graph.upstream[int(u[k])]}->{graph.downstream[int(v[k])]}",
                                "score": float(sc[k])} for k in neg[:n_named]],
        })
    return out


def drop_text(d: dict) -> str:
    """One line explaining a drop of :func:`curve_drops`."""
    names = ", ".join(f"{e['edge']} ({e['score']:+.3g})" for e in d["negative_edges"])
    why = (f"{d['n_negative']} of the {d['n_added']} edges added push away from the full model (scores summed "
           f"{d['negative_score_sum']:+.4g}; all added: {d['added_score_sum']:+.4g})"
           + (f", most negative: {names}" if names else "")
           if d["n_negative"] else
           f"none of the {d['n_added']} edges added pushes away from the full model (summed {d['added_score_sum']:+.4g}): "
           "the scores' linear estimate misses an interaction")
    noise = {True: " (within the bootstrap intervals: may be noise)", False: "", None: ""}[d["within_ci"]]
    return (f"NON-MONOTONE: faithfulness falls {d['from_faithfulness']:.3f} -> {d['to_faithfulness']:.3f} from "
            f"{d['from_fraction']:.4g} to {d['to_fraction']:.4g} of the candidates{noise}: {why}")
