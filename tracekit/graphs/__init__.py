"""Attribution graphs over transcoders (Ameisen et al. 2025, "Circuit Tracing"; circuit-tracer).

* :class:`AttributionGraph` (:mod:`.graph`): nodes and the adjacency of direct effects.
* :class:`LocalReplacementModel` (:mod:`.replacement`): one prompt's model with frozen attention
  patterns and norm scales, MLPs replaced by transcoders plus error nodes.
* :func:`build_graph` (:mod:`.attribution`): the adjacency by batched backward passes, verified.
"""

from .attribution import backward_row_bytes, build_graph, partial_influences, salient_logits
from .graph import NODE_TYPES, AttributionGraph
from .replacement import LocalReplacementModel

__all__ = ["NODE_TYPES", "AttributionGraph", "LocalReplacementModel", "backward_row_bytes", "build_graph",
           "partial_influences", "salient_logits"]
