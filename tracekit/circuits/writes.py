"""Every upstream node's write and every downstream node's input gradient, stacked in graph order.

``writes``: ``[g, pos, n_up, d_model]`` (``input``, then per block each head's ``z_H W_O^H`` and the
MLP's output); ``reads``: the same layout over downstream nodes (per block the q inputs of every
head, the k and v inputs of every key/value head, the MLP input; then the final residual).
"""

from __future__ import annotations

import torch
from jaxtyping import Float

from .graph import Graph, check_head_writes, head_writes

__all__ = ["stack_writes", "stack_reads", "check_writes"]


def stack_writes(model, graph: Graph, acts: dict[str, torch.Tensor]) -> Float[torch.Tensor, "g pos n_up d_model"]:
    """Upstream writes from a run's recorded activations (:func:`tracekit.circuits.graph.upstream_hooks`)."""
    parts = [acts["blocks.0.hook_resid_pre"].float()[:, :, None]]
    for L in range(graph.n_layers):
        parts.append(head_writes(model, L, acts[f"blocks.{L}.attn.hook_z"]))
        parts.append(acts[f"blocks.{L}.hook_mlp_out"].float()[:, :, None])
    return torch.cat(parts, 2)


def stack_reads(graph: Graph, tensors: dict[str, torch.Tensor]) -> Float[torch.Tensor, "g pos n_down d_model"]:
    """Downstream input gradients from gradients at :func:`tracekit.circuits.graph.downstream_hooks`
    (an MLP's: ``grad(resid_mid) - grad(resid_post)``)."""
    parts = []
    for L in range(graph.n_layers):
        for w in ("q", "k", "v"):
            parts.append(tensors[f"blocks.{L}.attn.hook_{w}_input"].float())
        mlp = tensors[f"blocks.{L}.hook_resid_mid"].float() - tensors[f"blocks.{L}.hook_resid_post"].float()
        parts.append(mlp[:, :, None])
    parts.append(tensors[f"blocks.{graph.n_layers - 1}.hook_resid_post"].float()[:, :, None])
    return torch.cat(parts, 2)


def check_writes(model, graph: Graph, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], method: str) -> None:
    """:func:`tracekit.circuits.graph.check_head_writes` at every block between runs ``a`` and ``b``."""
    for L in range(graph.n_layers):
        dz = a[f"blocks.{L}.attn.hook_z"].float() - b[f"blocks.{L}.attn.hook_z"].float()
        dout = a[f"blocks.{L}.hook_attn_out"].float() - b[f"blocks.{L}.hook_attn_out"].float()
        check_head_writes(model, L, dz, dout, method)
