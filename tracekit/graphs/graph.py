"""The attribution graph as data: nodes, the adjacency of direct effects, and their tables.

Node order (circuit-tracer's ``Graph``, so its pruning and Neuronpedia JSON map one to one):

    [features (n_features)] [errors (n_layers x n_pos, layer-major)] [tokens (n_pos)] [logits (n_logits)]

``adjacency[target, source]`` is the direct effect of the source node on the target node's input in the
local replacement model (frozen attention patterns and normalisation scales, MLPs replaced by
transcoders plus error nodes), in the target's units (feature pre-activation, or logit minus mean
logit for a logit node), already multiplied by the source's activation (features) or made of the
source's whole vector (errors, token embeddings). Feature and logit rows are filled; error and token
rows are zero (they have no inputs in the graph).

Source: Ameisen et al. 2025, "Circuit Tracing" (methods); circuit-tracer ``circuit_tracer/graph.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from jaxtyping import Float, Int

__all__ = ["AttributionGraph", "NODE_TYPES"]

#: The node types, in adjacency order.
NODE_TYPES = ("feature", "error", "token", "logit")


@dataclass
class AttributionGraph:
    """One prompt's attribution graph (unpruned: every attributed feature).

    Attributes:
        prompt: the prompt text.
        token_ids: ``[n_pos]`` the prompt's token ids (BOS included when the model prepends one).
        tokens: ``n_pos`` token strings.
        n_layers: blocks of the model (error nodes per position).
        features: ``[n_features, 3]`` (layer, position, feature index) of each feature node, sorted by
            layer, then position, then feature index.
        activations: ``[n_features]`` each feature node's activation.
        logit_ids: ``[n_logits]`` vocabulary ids of the logit nodes.
        logit_probs: ``[n_logits]`` their softmax probabilities at the last position.
        logit_tokens: ``n_logits`` their token strings.
        adjacency: ``[n_nodes, n_nodes]`` float32, ``[target, source]`` direct effects (module docstring).
        error_norms: ``[n_layers, n_pos]`` L2 norm of each error vector (the transcoder's miss).
        target: the token whose logit (or logit difference) the verification follows: a dict with
            ``id``, ``token`` and, when a foil is given, ``foil_id`` / ``foil_token``.
        model: model identity (name, fingerprint) the graph was built on.
        dictionaries: identity of the transcoder set (its content key / path, hooks).
        settings: every option the graph was built with (desired_logit_prob, max_n_logits,
            max_feature_nodes, zero_bos, batch size, chunks, ...).
        verification: filled by :mod:`tracekit.graphs.verify` (logit reproduction, completeness,
            intervention table, replacement and completeness scores).
        node_bias: ``[n_nodes]`` each row's bias term: its input in the local replacement model with
            every source node zeroed (``b_enc``, ``b_dec``, norm/attention biases, positional
            embeddings, features that are not nodes); 0 for error and token nodes. None when unknown.
        node_input: ``[n_nodes]`` each row's input in the clean run (feature pre-activation, or
            pre-transform logit minus its vocabulary mean); 0 for error and token nodes. Completeness:
            ``node_input == adjacency.sum(1) + node_bias`` on feature and logit rows.
    """

    prompt: str
    token_ids: Int[torch.Tensor, " n_pos"]
    tokens: list[str]
    n_layers: int
    features: Int[torch.Tensor, "n_features 3"]
    activations: Float[torch.Tensor, " n_features"]
    logit_ids: Int[torch.Tensor, " n_logits"]
    logit_probs: Float[torch.Tensor, " n_logits"]
    logit_tokens: list[str]
    adjacency: Float[torch.Tensor, "n_nodes n_nodes"]
    error_norms: Float[torch.Tensor, "n_layers n_pos"]
    target: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    dictionaries: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    node_bias: Optional[Float[torch.Tensor, " n_nodes"]] = None
    node_input: Optional[Float[torch.Tensor, " n_nodes"]] = None

    # -- sizes and offsets ---------------------------------------------------------------------
    @property
    def n_pos(self) -> int:
        """Prompt length in tokens."""
        return int(self.token_ids.shape[0])

    @property
    def n_features(self) -> int:
        """Number of feature nodes."""
        return int(self.features.shape[0])

    @property
    def n_logits(self) -> int:
        """Number of logit nodes."""
        return int(self.logit_ids.shape[0])

    @property
    def n_nodes(self) -> int:
        """All nodes: features + errors + tokens + logits."""
        return self.n_features + self.n_layers * self.n_pos + self.n_pos + self.n_logits

    @property
    def error_offset(self) -> int:
        """Index of the first error node."""
        return self.n_features

    @property
    def token_offset(self) -> int:
        """Index of the first token node."""
        return self.n_features + self.n_layers * self.n_pos

    @property
    def logit_offset(self) -> int:
        """Index of the first logit node."""
        return self.token_offset + self.n_pos

    def error_index(self, layer: int, pos: int) -> int:
        """Node index of the error node of ``layer`` at ``pos``. Raises IndexError: out of range."""
        if not (0 <= layer < self.n_layers and 0 <= pos < self.n_pos):
            raise IndexError(f"error node (layer {layer}, position {pos}) outside {self.n_layers} x {self.n_pos}")
        return self.error_offset + layer * self.n_pos + pos

    def token_index(self, pos: int) -> int:
        """Node index of the token-embedding node at ``pos``. Raises IndexError: out of range."""
        if not 0 <= pos < self.n_pos:
            raise IndexError(f"token position {pos} outside 0..{self.n_pos - 1}")
        return self.token_offset + pos

    def logit_index(self, i: int) -> int:
        """Node index of the ``i``-th logit node. Raises IndexError: out of range."""
        if not 0 <= i < self.n_logits:
            raise IndexError(f"logit node {i} outside 0..{self.n_logits - 1}")
        return self.logit_offset + i

    def node_type(self, index: int) -> str:
        """``feature`` | ``error`` | ``token`` | ``logit`` of a node index. Raises IndexError."""
        if not 0 <= index < self.n_nodes:
            raise IndexError(f"node {index} outside 0..{self.n_nodes - 1}")
        for name, end in zip(NODE_TYPES, (self.error_offset, self.token_offset, self.logit_offset, self.n_nodes)):
            if index < end:
                return name
        raise AssertionError("unreachable")

    def logit_weights(self) -> Float[torch.Tensor, " n_nodes"]:
        """``[n_nodes]`` zeros except the logit nodes' probabilities (the influence seed). Raises nothing."""
        w = torch.zeros(self.n_nodes, dtype=torch.float32)
        w[self.logit_offset:] = self.logit_probs.float()
        return w

    def feature_node(self, layer: int, pos: int, feature: int) -> Optional[int]:
        """Node index of an active feature, or ``None`` when it is not a node. Raises nothing."""
        hit = ((self.features[:, 0] == layer) & (self.features[:, 1] == pos) & (self.features[:, 2] == feature))
        idx = torch.nonzero(hit).flatten()
        return int(idx[0]) if idx.numel() else None
