"""Every upstream node's write and every downstream node's input gradient, stacked in graph order.

``writes``: ``[g, pos, n_up, d_model]`` (``input``, then per block each head's ``z_H W_O^H`` and the
MLP's output); ``reads``: the same layout over downstream nodes (per block the q inputs of every
head, the k and v inputs of every key/value head, the MLP input; then the final residual).
"""

from __future__ import annotations

import torch
from jaxtyping import Float

from ..core.sites import hook
from ..model.info import HookedModel
from .graph import Graph, check_head_writes, head_writes

__all__ = ["stack_writes", "stack_reads", "check_writes"]


def stack_writes(model: HookedModel, graph: Graph, acts: dict[str, torch.Tensor]) -> Float[torch.Tensor, "g pos n_up d_model"]:
    """Upstream writes from a run's recorded activations (:func:`tracekit.circuits.graph.upstream_hooks`)."""
    parts = [acts[hook("resid_pre", 0)].float()[:, :, None]]
    for L in range(graph.n_layers):
        parts.append(head_writes(model, L, acts[hook("head_out", L)]))
        parts.append(acts[hook("mlp_out", L)].float()[:, :, None])
    return torch.cat(parts, 2)


def stack_reads(graph: Graph, tensors: dict[str, torch.Tensor]) -> Float[torch.Tensor, "g pos n_down d_model"]:
    """Downstream input gradients from gradients at :func:`tracekit.circuits.graph.downstream_hooks`
    (an MLP's: ``grad(resid_mid) - grad(resid_post)``)."""
    parts = []
    for L in range(graph.n_layers):
        for w in ("q", "k", "v"):
            parts.append(tensors[hook(f"head_{w}_input", L)].float())
        mlp = tensors[hook("resid_mid", L)].float() - tensors[hook("resid_post", L)].float()
        parts.append(mlp[:, :, None])
    parts.append(tensors[hook("resid_post", graph.n_layers - 1)].float()[:, :, None])
    return torch.cat(parts, 2)


def check_writes(model: HookedModel, graph: Graph, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], method: str) -> None:
    """:func:`tracekit.circuits.graph.check_head_writes` at every block between runs ``a`` and ``b``."""
    for L in range(graph.n_layers):
        z, out = hook("head_out", L), hook("attn_out", L)
        dz = a[z].float() - b[z].float()
        dout = a[out].float() - b[out].float()
        check_head_writes(model, L, dz, dout, method)
