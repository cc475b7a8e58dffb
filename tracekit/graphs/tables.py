"""An attribution graph as two tables: its nodes and its edges (Parquet/CSV-friendly columns).

Every node gets circuit-tracer's node id (``circuit_tracer/frontend/graph_models.py``, ``Node``), so
a row of these tables, a node of the Neuronpedia JSON (:mod:`tracekit.graphs.export`) and a node of
the HTML page (:mod:`tracekit.graphs.view`) name the same thing:

* feature: ``"{layer}_{feature}_{pos}"``;
* error (the transcoder's miss at a layer and position): ``"0_{layer}_{pos}"``;
* token embedding: ``"E_{token_id}_{pos}"``;
* logit: ``"{n_layers + 1}_{token_id}_{last_pos}"``.

circuit-tracer's scheme can give a layer-0 feature and an error node the same id (feature ``f`` at
layer 0 and the error of layer ``f``, same position); :func:`node_ids` then appends ``"_e"`` to the
error node's id (and only then) so every id stays unique.

Pruning is an input: anything with ``node_mask [n_nodes]``, ``edge_mask [n_nodes, n_nodes]``
(``[target, source]``), ``cumulative_scores [n_nodes]`` and ``node_influence [n_nodes]``
(:class:`tracekit.graphs.prune.PruneResult`; circuit-tracer's ``prune_graph``). Without one, every
node and every non-zero edge is kept and the influence columns are NaN.

Source: circuit-tracer ``circuit_tracer/utils/create_graph_files.py`` (``create_nodes``,
``create_used_nodes_and_edges``); Ameisen et al. 2025, "Circuit Tracing".
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float

from ..core.errors import AttributionError
from .graph import AttributionGraph

__all__ = ["PruneLike", "NODE_COLUMNS", "EDGE_COLUMNS", "node_ids", "node_layers", "graph_masks", "graph_tables"]

#: Columns of the nodes table, in order (sentinels: ``-1`` for a missing integer, NaN for a
#: missing number, ``""`` for a missing string, so every column has one dtype).
NODE_COLUMNS = ("node", "node_id", "type", "layer", "position", "token", "token_id", "feature", "activation",
                "influence", "cumulative_influence", "kept", "error_norm", "logit_token", "logit_id", "logit_prob",
                "is_target_logit")
#: Columns of the edges table, in order.
EDGE_COLUMNS = ("source", "target", "source_id", "target_id", "weight", "kept")


@runtime_checkable
class PruneLike(Protocol):
    """What the tables, the JSON and the page read of a pruning (``PruneResult``)."""

    @property
    def node_mask(self) -> Bool[torch.Tensor, " n_nodes"]:
        """Nodes kept."""
        ...

    @property
    def edge_mask(self) -> Bool[torch.Tensor, "n_nodes n_nodes"]:
        """Edges kept, ``[target, source]``."""
        ...

    @property
    def cumulative_scores(self) -> Float[torch.Tensor, " n_nodes"]:
        """Share of total influence of the nodes ranked at or above each node."""
        ...

    @property
    def node_influence(self) -> Float[torch.Tensor, " n_nodes"]:
        """Each node's total influence on the logits."""
        ...


def node_layers(graph: AttributionGraph) -> np.ndarray:
    """``[n_nodes]`` int64 layer of each node: the feature's or error's block, ``-1`` for a token
    embedding, ``n_layers`` for a logit (drawn above the last block). Raises nothing."""
    out = np.empty(graph.n_nodes, dtype=np.int64)
    nf, npos, L = graph.n_features, graph.n_pos, graph.n_layers
    out[:nf] = graph.features[:, 0].cpu().numpy()
    out[nf:graph.token_offset] = np.repeat(np.arange(L), npos)
    out[graph.token_offset:graph.logit_offset] = -1
    out[graph.logit_offset:] = L
    return out


def node_positions(graph: AttributionGraph) -> np.ndarray:
    """``[n_nodes]`` int64 token position of each node (a logit node: the last position). Raises nothing."""
    out = np.empty(graph.n_nodes, dtype=np.int64)
    nf, npos, L = graph.n_features, graph.n_pos, graph.n_layers
    out[:nf] = graph.features[:, 1].cpu().numpy()
    out[nf:graph.token_offset] = np.tile(np.arange(npos), L)
    out[graph.token_offset:graph.logit_offset] = np.arange(npos)
    out[graph.logit_offset:] = npos - 1
    return out


def node_ids(graph: AttributionGraph) -> list[str]:
    """circuit-tracer's node id of every node, in adjacency order (module docstring; an error id
    that would repeat a layer-0 feature's id gets the suffix ``_e``). Raises nothing."""
    ids: list[str] = [f"{int(layer)}_{int(f)}_{int(p)}" for layer, p, f in graph.features.tolist()]
    feats = set(ids)
    for layer in range(graph.n_layers):
        for p in range(graph.n_pos):
            e = f"0_{layer}_{p}"
            ids.append(e + "_e" if e in feats else e)
    tok = graph.token_ids.tolist()
    ids += [f"E_{int(tok[p])}_{p}" for p in range(graph.n_pos)]
    ids += [f"{graph.n_layers + 1}_{int(t)}_{graph.n_pos - 1}" for t in graph.logit_ids.tolist()]
    return ids


def target_logit_index(graph: AttributionGraph) -> int:
    """Which logit node (0-based among the logits) is the target: the one whose id is
    ``graph.target["id"]`` when it is a logit node, else the first (circuit-tracer marks the first,
    the most probable). Raises nothing."""
    tid = graph.target.get("id") if graph.target else None
    if tid is not None:
        hit = (graph.logit_ids == int(tid)).nonzero().flatten()
        if hit.numel():
            return int(hit[0])
    return 0


def graph_masks(graph: AttributionGraph, prune: Optional[PruneLike]
                ) -> tuple[Bool[torch.Tensor, " n_nodes"], Bool[torch.Tensor, "n_nodes n_nodes"],
                           Float[torch.Tensor, " n_nodes"], Float[torch.Tensor, " n_nodes"]]:
    """``(node_mask, edge_mask, influence, cumulative)`` on the CPU: the pruning's, an edge kept only
    when both its ends are kept; without a pruning every node, every non-zero edge, NaN scores.

    Raises:
        AttributionError: a mask or score whose shape is not the graph's (a pruning of another graph).
    """
    n = graph.n_nodes
    adj = graph.adjacency
    if prune is None:
        nm = torch.ones(n, dtype=torch.bool)
        em = adj.detach().cpu() != 0
        nan = torch.full((n,), float("nan"))
        return nm, em, nan, nan.clone()
    for name, want in (("node_mask", (n,)), ("edge_mask", (n, n)), ("cumulative_scores", (n,)),
                       ("node_influence", (n,))):
        got = tuple(getattr(prune, name).shape)
        if got != want:
            raise AttributionError(f"prune.{name} has shape {got}, the graph needs {want} ({n} nodes): pass the "
                                   "pruning of this graph (prune_graph(graph))")
    nm = prune.node_mask.detach().cpu().bool()
    em = prune.edge_mask.detach().cpu().bool() & nm[:, None] & nm[None, :]
    return (nm, em, prune.node_influence.detach().cpu().float(),
            prune.cumulative_scores.detach().cpu().float())


def graph_tables(graph: AttributionGraph, prune: Optional[PruneLike] = None, *,
                 edges: str = "kept") -> tuple[pd.DataFrame, pd.DataFrame]:
    """The graph's nodes and edges as tables.

    Args:
        graph: the attribution graph (``adjacency [n_nodes, n_nodes]``, ``[target, source]``).
        prune: its pruning (``PruneResult``: node/edge masks and influence scores); None keeps
            everything (influence NaN).
        edges: ``kept`` (default): the edges the pruning keeps (both ends kept, weight non-zero);
            ``nonzero``: every non-zero adjacency entry, with its ``kept`` flag.

    Returns:
        ``(nodes, edges)``. ``nodes``: one row per node in adjacency order, columns
        :data:`NODE_COLUMNS`: ``node`` (index), ``node_id`` (circuit-tracer's), ``type`` (feature |
        error | token | logit), ``layer`` (-1 token embedding, ``n_layers`` logit), ``position``,
        ``token`` / ``token_id`` (the prompt token at the position), ``feature`` (-1 unless a
        feature), ``activation`` (feature units; NaN unless a feature), ``influence`` (the node's
        total influence on the logits, circuit-tracer's ``compute_node_influence``, unitless),
        ``cumulative_influence`` (share of total influence of the nodes ranked at or above it; the
        JSON's ``influence``), ``kept``, ``error_norm`` (L2 norm of the error vector, residual
        units; NaN unless an error node), ``logit_token`` / ``logit_id`` / ``logit_prob`` (logit
        nodes) and ``is_target_logit``. ``edges``: columns :data:`EDGE_COLUMNS`, ``source`` /
        ``target`` node indices and ids, ``weight`` (the direct effect in the target's units:
        feature pre-activation or logit), ``kept``; sorted by target then source.

    Raises:
        AttributionError: ``prune`` is not this graph's (shapes); an unknown ``edges`` choice.
    """
    if edges not in ("kept", "nonzero"):
        raise AttributionError(f"edges: {edges!r}; use 'kept' or 'nonzero'")
    nm, em, infl, cum = graph_masks(graph, prune)
    n, nf, L, npos = graph.n_nodes, graph.n_features, graph.n_layers, graph.n_pos
    ids = node_ids(graph)
    types = np.array(["feature"] * nf + ["error"] * (L * npos) + ["token"] * npos + ["logit"] * graph.n_logits,
                     dtype=object)
    pos = node_positions(graph)
    tok_ids = graph.token_ids.cpu().numpy().astype(np.int64)
    feature = np.full(n, -1, dtype=np.int64)
    feature[:nf] = graph.features[:, 2].cpu().numpy()
    act = np.full(n, np.nan)
    act[:nf] = graph.activations.detach().cpu().double().numpy()
    err = np.full(n, np.nan)
    err[nf:graph.token_offset] = graph.error_norms.detach().cpu().double().reshape(-1).numpy()
    ltok = np.array([""] * n, dtype=object)
    lid = np.full(n, -1, dtype=np.int64)
    lprob = np.full(n, np.nan)
    is_target = np.zeros(n, dtype=bool)
    if graph.n_logits:
        ltok[graph.logit_offset:] = list(graph.logit_tokens)
        lid[graph.logit_offset:] = graph.logit_ids.cpu().numpy()
        lprob[graph.logit_offset:] = graph.logit_probs.detach().cpu().double().numpy()
        is_target[graph.logit_offset + target_logit_index(graph)] = True
    nodes = pd.DataFrame({
        "node": np.arange(n, dtype=np.int64), "node_id": ids, "type": types, "layer": node_layers(graph),
        "position": pos, "token": [graph.tokens[int(p)] for p in pos], "token_id": tok_ids[pos], "feature": feature,
        "activation": act, "influence": infl.double().numpy(), "cumulative_influence": cum.double().numpy(),
        "kept": nm.numpy().astype(bool), "error_norm": err, "logit_token": ltok, "logit_id": lid, "logit_prob": lprob,
        "is_target_logit": is_target,
    }, columns=list(NODE_COLUMNS))
    adj = graph.adjacency.detach().cpu()
    nonzero = adj != 0
    pick = (em & nonzero) if edges == "kept" else nonzero
    tgt, src = torch.nonzero(pick, as_tuple=True)  # row-major: sorted by target, then source
    id_arr = np.array(ids, dtype=object)
    s, t = src.numpy().astype(np.int64), tgt.numpy().astype(np.int64)
    edge_df = pd.DataFrame({
        "source": s, "target": t, "source_id": id_arr[s] if len(s) else np.array([], dtype=object),
        "target_id": id_arr[t] if len(t) else np.array([], dtype=object),
        "weight": adj[tgt, src].double().numpy(), "kept": em[tgt, src].numpy().astype(bool),
    }, columns=list(EDGE_COLUMNS))
    return nodes, edge_df
