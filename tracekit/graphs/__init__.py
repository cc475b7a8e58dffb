"""Attribution graphs over transcoders (Ameisen et al. 2025, "Circuit Tracing"; circuit-tracer).

* :class:`AttributionGraph` (:mod:`.graph`): nodes and the adjacency of direct effects.
"""

from .graph import NODE_TYPES, AttributionGraph

__all__ = ["NODE_TYPES", "AttributionGraph"]
