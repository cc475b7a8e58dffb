"""Attribution graphs over transcoders (Ameisen et al. 2025, "Circuit Tracing"; circuit-tracer).

* :class:`AttributionGraph` (:mod:`.graph`): nodes and the adjacency of direct effects.
* :class:`LocalReplacementModel` (:mod:`.replacement`): one prompt's model with frozen attention
  patterns and norm scales, MLPs replaced by transcoders plus error nodes.
* :func:`build_graph` (:mod:`.attribution`): the adjacency by batched backward passes, verified.
* :func:`prune_graph`, :func:`graph_scores` (:mod:`.prune`): influence, pruning, replacement and
  completeness scores; :func:`verify_graph` (:mod:`.verify`): interventions in the model;
  :func:`split_edges_by_head`, :func:`qk_attribution` (:mod:`.heads`): attention in the graph.
* :func:`graph_tables` (:mod:`.tables`), :func:`graph_json` / :func:`write_graph_json` (:mod:`.export`),
  :func:`write_graph_html` (:mod:`.view`), :func:`feature_cards` (:mod:`.cards`): what a graph is saved as.
"""

from .attribution import backward_row_bytes, build_graph, partial_influences, salient_logits
from .cards import feature_cards
from .export import graph_json, write_graph_json
from .graph import NODE_TYPES, AttributionGraph
from .heads import qk_attribution, split_edges_by_head
from .prune import PruneResult, graph_scores, prune_graph
from .replacement import LocalReplacementModel
from .tables import graph_tables
from .verify import verify_graph
from .view import write_graph_html

__all__ = ["NODE_TYPES", "AttributionGraph", "LocalReplacementModel", "backward_row_bytes", "build_graph",
           "partial_influences", "salient_logits", "PruneResult", "prune_graph", "graph_scores", "verify_graph",
           "split_edges_by_head", "qk_attribution", "graph_tables", "graph_json", "write_graph_json",
           "write_graph_html", "feature_cards"]
