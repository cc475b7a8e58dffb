"""Influence, pruning and the replacement / completeness scores of an attribution graph.

Pure maths on an :class:`~tracekit.graphs.graph.AttributionGraph`'s adjacency, with circuit-tracer's
rules (``circuit_tracer/graph.py``: ``normalize_matrix``, ``compute_influence``, ``prune_graph``,
``compute_graph_scores``, ``compute_subgraph_scores``; Ameisen et al. 2025, "Circuit Tracing",
sections "Pruning" and "Evaluating graphs"):

* ``normalize_matrix(A) = |A|`` with each row divided by its sum (clamped at ``1e-10``): each target's
  inputs as shares of its total absolute input.
* ``compute_influence(A_n, w) = w @ (A_n + A_n^2 + ...)``: the total (indirect) influence of every
  node on the logits weighted by ``w`` (the logit nodes' probabilities). The graph is a DAG, so the
  series is finite: it stops when a term is exactly zero; a cyclic adjacency raises.
* Node pruning keeps the nodes that carry ``node_threshold`` of the total influence (the smallest
  set of largest influences whose cumulative share reaches it), edge pruning the edges (scored by
  ``A_n[t, s] * (influence[t] + w[t])`` on the node-pruned graph) that carry ``edge_threshold``;
  tokens and logits are always kept; then feature and error nodes without a kept outgoing edge and
  features without a kept incoming edge are dropped, repeatedly, until nothing changes.
* Replacement score: ``token influence / (token influence + error influence)`` (the share of the
  end-to-end influence that reaches the logits from the tokens through features, not errors);
  completeness score: ``sum_n (1 - error share of n's inputs) (influence_n + w_n) / sum_n
  (influence_n + w_n)``. For the pruned graph, circuit-tracer's ``compute_subgraph_scores`` with
  every kept feature pinned: the adjacency restricted to kept nodes and kept edges
  (``pruned``); and, what circuit-tracer's subgraph rule does for unpinned features, every dropped
  feature folded into its (layer, position) error node (``pruned_folded``: dropped features count as
  unexplained, not as absent).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from jaxtyping import Bool, Float

from ..core.budget import bytes_of, chunk_rows
from ..core.errors import ConfigError
from .graph import AttributionGraph

__all__ = ["PruneResult", "compute_influence", "compute_node_influence", "compute_edge_influence",
           "find_threshold", "graph_scores", "normalize_matrix", "prune_graph", "scores_of_adjacency"]


class PruneResult(NamedTuple):
    """What :func:`prune_graph` keeps.

    Attributes:
        node_mask: ``[n_nodes]`` bool, the kept nodes.
        edge_mask: ``[n_nodes, n_nodes]`` bool, the kept edges (``[target, source]``).
        cumulative_scores: ``[n_nodes]`` each node's cumulative share of influence when nodes are
            sorted by influence (its rank as a share: 1.0 for the least influential).
        node_influence: ``[n_nodes]`` each node's influence on the weighted logits.
    """

    node_mask: Bool[torch.Tensor, " n_nodes"]
    edge_mask: Bool[torch.Tensor, "n_nodes n_nodes"]
    cumulative_scores: Float[torch.Tensor, " n_nodes"]
    node_influence: Float[torch.Tensor, " n_nodes"]


def normalize_matrix(matrix: Float[torch.Tensor, "n n"]) -> Float[torch.Tensor, "n n"]:
    """``|matrix|`` with each row divided by its sum (clamped at ``1e-10``; all-zero rows stay zero).

    Source: circuit-tracer ``graph.normalize_matrix``. Raises nothing."""
    a = matrix.abs()
    return a / a.sum(dim=1, keepdim=True).clamp(min=1e-10)


def compute_influence(A: Float[torch.Tensor, "n n"], logit_weights: Float[torch.Tensor, " n"],
                      max_iter: int = 1000) -> Float[torch.Tensor, " n"]:
    """``logit_weights @ (A + A^2 + A^3 + ...)``, summed until a term is exactly zero.

    Args:
        A: ``[n, n]`` non-negative (normalised) adjacency, ``[target, source]``, nilpotent (a DAG).
        logit_weights: ``[n]`` the seed (logit probabilities on the logit nodes, zeros elsewhere).
        max_iter: most terms summed.

    Returns:
        ``[n]`` influence of each node (units: share of the weighted logits).

    Raises:
        ValueError: the series did not end within ``max_iter`` terms (the adjacency has a cycle).

    Source: circuit-tracer ``graph.compute_influence``.
    """
    current = logit_weights @ A
    influence = current.clone()
    iterations = 0
    while current.any():
        if iterations >= max_iter:
            raise ValueError(f"influence did not converge after {iterations} iterations: the adjacency is not "
                             "acyclic (an attribution graph's adjacency is nilpotent; check how it was built)")
        current = current @ A
        influence += current
        iterations += 1
    return influence


def compute_node_influence(adjacency: Float[torch.Tensor, "n n"],
                           logit_weights: Float[torch.Tensor, " n"]) -> Float[torch.Tensor, " n"]:
    """Influence of each node through the normalised adjacency. Raises ValueError: a cycle."""
    return compute_influence(normalize_matrix(adjacency), logit_weights)


def compute_edge_influence(pruned_matrix: Float[torch.Tensor, "n n"],
                           logit_weights: Float[torch.Tensor, " n"]) -> Float[torch.Tensor, "n n"]:
    """``A_n[t, s] * (influence[t] + w[t])``: each edge's share of the weighted logits.
    Raises ValueError: a cycle."""
    normalized = normalize_matrix(pruned_matrix)
    influence = compute_influence(normalized, logit_weights) + logit_weights
    return normalized * influence[:, None]


def find_threshold(scores: Float[torch.Tensor, " n"], threshold: float) -> torch.Tensor:
    """The score of the last item in the smallest prefix of descending scores whose cumulative share
    reaches ``threshold`` (the last score at ``threshold = 1``). Raises nothing."""
    sorted_scores = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(sorted_scores, dim=0) / torch.sum(sorted_scores)
    idx = int(torch.searchsorted(cumulative, float(threshold)))
    return sorted_scores[min(idx, len(cumulative) - 1)]


def _check_memory(n: int, copies: int, device: torch.device, what: str) -> None:
    """Refuse before the work when ``copies`` dense ``[n, n]`` float32 temporaries do not fit the budget."""
    chunk_rows(bytes_of(copies, n, n), 1, what=what, device=device, unit="graph",
               fix="build the graph with fewer feature nodes (max_feature_nodes)")


def _check_threshold(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1] (a share of the total influence); got {value!r}")


def prune_graph(graph: AttributionGraph, node_threshold: float = 0.8,
                edge_threshold: float = 0.98) -> PruneResult:
    """Prune a graph by influence on the logits (circuit-tracer's rules; module docstring).

    Args:
        graph: the unpruned graph.
        node_threshold: keep the nodes carrying this share of the total influence, in [0, 1].
        edge_threshold: keep the edges carrying this share of the node-pruned graph's edge influence.

    Returns:
        :class:`PruneResult` (masks on the graph's node order, float32 on the adjacency's device).

    Raises:
        ConfigError: a threshold outside [0, 1] (the message names it).
        ValueError: the adjacency is not acyclic.
        MemoryBudgetError: the dense temporaries (about five ``[n_nodes, n_nodes]`` float32) do not
            fit the memory budget (raised before the work).

    Source: circuit-tracer ``graph.prune_graph``.
    """
    _check_threshold("node_threshold", node_threshold)
    _check_threshold("edge_threshold", edge_threshold)
    _check_memory(graph.n_nodes, 5, graph.adjacency.device, "graph pruning")
    adj = graph.adjacency.float()
    n_keep_always = graph.n_pos + graph.n_logits  # tokens and logits, the last nodes
    n_features = graph.n_features
    logit_weights = graph.logit_weights().to(adj.device)

    node_influence = compute_node_influence(adj, logit_weights)
    node_mask = node_influence >= find_threshold(node_influence, node_threshold)
    node_mask[-n_keep_always:] = True

    pruned = adj.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    edge_scores = compute_edge_influence(pruned, logit_weights)
    edge_mask = edge_scores >= find_threshold(edge_scores.flatten(), edge_threshold)

    old = node_mask.clone()
    node_mask[:-n_keep_always] &= edge_mask[:, :-n_keep_always].any(0)  # features and errors need an outgoing edge
    node_mask[:n_features] &= edge_mask[:n_features].any(1)  # features need an incoming edge
    while not torch.equal(node_mask, old):
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[:-n_keep_always] &= edge_mask[:, :-n_keep_always].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)

    sorted_scores, sorted_idx = torch.sort(node_influence, descending=True)
    cumulative = torch.cumsum(sorted_scores, dim=0) / torch.sum(sorted_scores)
    final = torch.zeros_like(node_influence)
    final[sorted_idx] = cumulative
    return PruneResult(node_mask, edge_mask, final, node_influence)


def scores_of_adjacency(adjacency: Float[torch.Tensor, "n n"], logit_weights: Float[torch.Tensor, " n"],
                        error_mask: Bool[torch.Tensor, " n"], token_mask: Bool[torch.Tensor, " n"]) -> dict:
    """Replacement and completeness scores of one adjacency (module docstring).

    Returns:
        ``{replacement, completeness}`` (floats in [0, 1]; ``None`` where the denominator is zero).

    Raises:
        ValueError: the adjacency is not acyclic.

    Source: circuit-tracer ``graph.compute_graph_scores``.
    """
    normalized = normalize_matrix(adjacency.float())
    influence = compute_influence(normalized, logit_weights)
    token_inf = influence[token_mask].sum()
    error_inf = influence[error_mask].sum()
    denom = token_inf + error_inf
    replacement = float(token_inf / denom) if float(denom) > 0 else None
    non_error = 1 - normalized[:, error_mask].sum(dim=-1)
    out_inf = influence + logit_weights
    total = out_inf.sum()
    completeness = float((non_error * out_inf).sum() / total) if float(total) > 0 else None
    return {"replacement": replacement, "completeness": completeness}


def graph_scores(graph: AttributionGraph, prune: Optional[PruneResult] = None) -> dict:
    """Replacement and completeness scores of the graph, and of its pruned form when ``prune`` is given.

    Args:
        graph: the unpruned graph.
        prune: a :func:`prune_graph` result of this graph (optional).

    Returns:
        ``{replacement, completeness}`` of the unpruned graph, plus ``pruned: {replacement,
        completeness, n_nodes, n_features, n_edges}`` (kept nodes and edges only: circuit-tracer's
        ``compute_subgraph_scores`` with every kept feature pinned) and ``pruned_folded:
        {replacement, completeness}`` (dropped features folded into their error node) when ``prune``
        is given.

    Raises:
        ValueError: the adjacency is not acyclic, or ``prune``'s masks do not match the graph.
        MemoryBudgetError: the dense temporaries (about four ``[n_nodes, n_nodes]`` float32) do not
            fit the memory budget (raised before the work).

    Source: circuit-tracer ``graph.compute_graph_scores`` / ``compute_subgraph_scores``.
    """
    n = graph.n_nodes
    _check_memory(n, 4, graph.adjacency.device, "graph scores")
    adj = graph.adjacency.float()
    w = graph.logit_weights().to(adj.device)
    error_mask = torch.zeros(n, dtype=torch.bool, device=adj.device)
    error_mask[graph.error_offset:graph.token_offset] = True
    token_mask = torch.zeros(n, dtype=torch.bool, device=adj.device)
    token_mask[graph.token_offset:graph.logit_offset] = True
    out = scores_of_adjacency(adj, w, error_mask, token_mask)
    if prune is None:
        return out
    node_mask = prune.node_mask.to(adj.device)
    edge_mask = prune.edge_mask.to(adj.device)
    if node_mask.shape != (n,) or edge_mask.shape != (n, n):
        raise ValueError(f"prune masks {tuple(node_mask.shape)} / {tuple(edge_mask.shape)} do not match the graph's "
                         f"{n} nodes: prune this graph with prune_graph(graph)")
    kept = adj * node_mask[:, None] * node_mask[None, :] * edge_mask
    out["pruned"] = {**scores_of_adjacency(kept, w, error_mask, token_mask),
                     "n_nodes": int(node_mask.sum()), "n_features": int(node_mask[:graph.n_features].sum()),
                     "n_edges": int(((kept != 0)).sum())}
    folded = adj.clone()
    dropped = torch.nonzero(~node_mask[:graph.n_features]).flatten()
    if len(dropped):
        feats = graph.features.to(adj.device)[dropped]
        err = graph.error_offset + feats[:, 0] * graph.n_pos + feats[:, 1]
        folded.index_add_(1, err, folded[:, dropped])
        folded[dropped, :] = 0
        folded[:, dropped] = 0
    out["pruned_folded"] = scores_of_adjacency(folded, w, error_mask, token_mask)
    return out
