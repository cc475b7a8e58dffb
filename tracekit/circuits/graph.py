"""The computational graph that edge methods score: nodes that write to the residual stream, nodes
that read it, and the edges between them.

Names follow the EAP-IG library of Hanna et al. (2024), which the MIB benchmark uses:

* **upstream** nodes (each *writes* a vector into the residual stream): ``input`` (the embeddings,
  ``blocks.0.hook_resid_pre``), ``a{L}.h{H}`` (head ``H`` of block ``L``: ``z_H W_O^H``, without
  ``b_O``, which no head owns and which is the same in every run) and ``m{L}`` (the MLP's output,
  ``blocks.L.hook_mlp_out``);
* **downstream** nodes (each *reads* the residual stream): ``a{L}.h{H}<q>``, ``a{L}.h{G}<k>``,
  ``a{L}.h{G}<v>`` (a head's query, key and value inputs, ``attn.hook_{q,k,v}_input``, before the
  block's norm; ``G`` is a key/value head under grouped-query attention: query head ``H`` reads
  key/value head ``H // (n_heads // n_kv_heads)``, :meth:`Graph.kv_head`; a k/v input named by a
  query head that is not also a key/value head is refused naming the right node), ``m{L}``
  (``blocks.L.hook_mlp_in``) and ``logits`` (the final norm's input,
  ``blocks.{n_layers-1}.hook_resid_post``);
* an **edge** ``u->v`` exists when ``u`` writes before ``v`` reads: ``u`` in an earlier block, or
  ``u`` a head and ``v`` the MLP of the same block (sequential blocks only), or ``v`` = ``logits``.

Because the residual stream is a sum, ``input_v = sum_u write_u + constants`` for every downstream
node, which is what makes edges well defined. That holds only where a head's write reaches the
stream unchanged: blocks with a post-norm (Gemma 2/3, OLMo 2, GLM-4) or a residual multiplier are
refused (:func:`check_separable`), and every run checks ``sum_H Delta write_H = Delta attn_out``
(:func:`check_head_writes`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional, cast

import torch
from jaxtyping import Float

from ..core.sites import hook
from ..errors import CircuitError, MethodRefused
from ..model.checks import model_dtype, tolerance
from ..model.info import HookedModel
from ..model.writepath import write_path

#: A downstream head input's name: ``a{L}.h{H}<q|k|v>``.
_HEAD_INPUT = re.compile(r"^a(\d+)\.h(\d+)<([qkv])>$")

__all__ = ["Graph", "build_graph", "check_separable", "check_head_writes", "head_writes", "upstream_hooks",
           "downstream_hooks", "receiver_hooks"]


@dataclass(frozen=True)
class Graph:
    """Nodes and edges of a model's residual-stream graph (module docstring).

    Attributes:
        n_layers, n_heads, n_kv_heads: the model's shape.
        parallel: attention and MLP read the same residual (GPT-J / NeoX parallel blocks).
        upstream: upstream node names in forward order (``input``, then per block heads, MLP).
        downstream: downstream node names in forward order (per block q/k/v inputs, MLP; ``logits``).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool
    upstream: list[str] = field(default_factory=list)
    downstream: list[str] = field(default_factory=list)

    @cached_property
    def up_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.upstream)}

    @cached_property
    def down_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.downstream)}

    def up_time(self, name: str) -> float:
        """When node ``name`` writes: -1 for ``input``, ``L`` for a head, ``L + 0.5`` for an MLP."""
        if name == "input":
            return -1.0
        layer = int(name[1:].split(".")[0])
        return layer + (0.5 if name.startswith("m") else 0.0)

    def down_time(self, name: str) -> float:
        """When node ``name`` reads: ``L`` for heads (and parallel MLPs), ``L + 0.5`` for a
        sequential block's MLP, ``n_layers`` for the logits."""
        if name == "logits":
            return float(self.n_layers)
        layer = int(name[1:].split(".")[0].split("<")[0])
        return layer + (0.5 if name.startswith("m") and not self.parallel else 0.0)

    @cached_property
    def mask(self) -> torch.Tensor:
        """``[n_down, n_up]`` bool: the edge ``upstream[u] -> downstream[v]`` exists."""
        ut = torch.tensor([self.up_time(n) for n in self.upstream])
        dt = torch.tensor([self.down_time(n) for n in self.downstream])
        return ut[None, :] < dt[:, None]

    @property
    def n_edges(self) -> int:
        return int(self.mask.sum())

    def edge_names(self) -> list[str]:
        """Every edge ``u->v`` in (downstream, upstream) row-major order of :attr:`mask`."""
        v, u = self.mask.nonzero(as_tuple=True)
        return [f"{self.upstream[a]}->{self.downstream[b]}" for a, b in zip(u.tolist(), v.tolist())]

    def parse_edge(self, name: str, field: str = "edges") -> tuple[int, int]:
        """``(downstream index, upstream index)`` of an edge name ``u->v``.

        Raises:
            CircuitError: not ``u->v`` with known nodes, or no such edge (``u`` does not write before ``v``).
        """
        if "->" not in name:
            raise CircuitError(f"{field}: {name!r} is not an edge; write 'upstream->downstream', e.g. "
                                "'a0.h1->a2.h3<q>' or 'm1->logits'")
        u, v = (s.strip() for s in name.split("->", 1))
        if u not in self.up_index:
            raise CircuitError(f"{field}: {u!r} is not an upstream node; use 'input', 'a{{L}}.h{{H}}' or 'm{{L}}' "
                                f"(layers 0..{self.n_layers - 1}, heads 0..{self.n_heads - 1})")
        if v not in self.down_index:
            hint = self.kv_name_hint(v, field)
            if hint is not None:
                raise CircuitError(hint)
            raise CircuitError(f"{field}: {v!r} is not a downstream node; use 'a{{L}}.h{{H}}<q>' (heads "
                                f"0..{self.n_heads - 1}), 'a{{L}}.h{{G}}<k|v>' (key/value heads 0..{self.n_kv_heads - 1}), "
                                f"'m{{L}}' or 'logits' (layers 0..{self.n_layers - 1})")
        vi, ui = self.down_index[v], self.up_index[u]
        if not bool(self.mask[vi, ui]):
            raise CircuitError(f"{field}: {name!r} is not an edge: {u} writes after {v} reads")
        return vi, ui

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (``n_heads // n_kv_heads``; 1 without grouped-query attention)."""
        return max(1, self.n_heads // max(1, self.n_kv_heads))

    def kv_head(self, head: int) -> int:
        """The key/value head query head ``head`` reads: ``head // (n_heads // n_kv_heads)`` (the
        grouping of ``repeat_interleave`` in Hugging Face's and TransformerLens' GQA)."""
        return int(head) // self.group_size

    def query_heads(self, kv_head: int) -> list[int]:
        """The query heads sharing key/value head ``kv_head`` (``[kv_head]`` without GQA)."""
        g = self.group_size
        return list(range(int(kv_head) * g, (int(kv_head) + 1) * g))

    def node_query_heads(self, name: str) -> Optional[list[int]]:
        """The query heads a downstream head input feeds: ``[H]`` for ``a{L}.h{H}<q>``, the query
        heads sharing key/value head ``G`` for ``a{L}.h{G}<k|v>``; None for ``m{L}`` / ``logits``."""
        m = _HEAD_INPUT.match(name)
        if m is None:
            return None
        h = int(m.group(2))
        return [h] if m.group(3) == "q" else self.query_heads(h)

    def kv_name_hint(self, name: str, field: str) -> Optional[str]:
        """The refusal of a key/value input named by a *query* head (``a23.h4<v>`` where only key/value
        heads 0..2 exist), naming the right node; None if ``name`` is not such a name.

        Rule: ``<k>`` / ``<v>`` inputs count key/value heads (the tensor a k/v hook holds), ``<q>``
        inputs, senders and every head table count query heads; query head ``H`` reads key/value head
        ``H // (n_heads // n_kv_heads)``. Query-head names are not mapped silently because
        ``a{L}.h{G}<v>`` with ``G < n_kv_heads`` already names key/value head ``G``."""
        m = _HEAD_INPUT.match(name.strip())
        if m is None or m.group(3) == "q" or not self.n_kv_heads <= int(m.group(2)) < self.n_heads:
            return None
        L, h, x = int(m.group(1)), int(m.group(2)), m.group(3)
        g = self.kv_head(h)
        share = ", ".join(str(q) for q in self.query_heads(g))
        return (f"{field}: {name.strip()!r}: query head {h}'s {x} input is key/value head {g}: write 'a{L}.h{g}<{x}>' "
                f"(query heads {share} share it). <k>/<v> inputs count key/value heads (0..{self.n_kv_heads - 1}; "
                f"{self.group_size} query heads each); <q> inputs, senders and head tables count query heads "
                f"(0..{self.n_heads - 1})")

    def receivers_of(self, node: str) -> list[str]:
        """The downstream names of a node given as ``a{L}.h{H}`` (its q, k, v inputs; k/v of its
        key/value head), ``a{L}.h{H}<q>`` (itself), ``m{L}`` or ``logits``.

        Raises:
            CircuitError: not a node of the graph.
        """
        if node in self.down_index:
            return [node]
        if node.startswith("a") and node in self.up_index:
            layer, head = (int(s[1:]) for s in node.split("."))
            g = self.kv_head(head)
            return [f"a{layer}.h{head}<q>", f"a{layer}.h{g}<k>", f"a{layer}.h{g}<v>"]
        hint = self.kv_name_hint(node, "receivers")
        if hint is not None:
            raise CircuitError(hint)
        raise CircuitError(f"receivers: {node!r} is not a node; use 'a{{L}}.h{{H}}' (its q, k and v inputs), "
                            "'a{L}.h{H}<q|k|v>', 'm{L}' or 'logits'")


def build_graph(model: HookedModel) -> Graph:
    """The :class:`Graph` of ``model`` (upstream: input, heads, MLPs; downstream: q/k/v inputs, MLPs, logits)."""
    cfg = model.cfg
    n, H = int(cfg.n_layers), int(cfg.n_heads)
    Hkv = int(getattr(cfg, "n_key_value_heads", None) or H)
    up, down = ["input"], []
    for L in range(n):
        up += [f"a{L}.h{h}" for h in range(H)] + [f"m{L}"]
        down += [f"a{L}.h{h}<q>" for h in range(H)] + [f"a{L}.h{g}<k>" for g in range(Hkv)]
        down += [f"a{L}.h{g}<v>" for g in range(Hkv)] + [f"m{L}"]
    down.append("logits")
    return Graph(n, H, Hkv, bool(getattr(cfg, "parallel_attn_mlp", False)), up, down)


def check_separable(model: HookedModel, method: str) -> None:
    """Refuse ``method`` where a head's or MLP's write does not reach the residual stream as it is.

    Raises:
        MethodRefused: a block with a post-norm or a residual multiplier (the write passes a norm
            or a scale, so edges ``u -> v`` are not terms of a sum), or without per-head outputs.
    """
    from ..model.architectures import require

    require(model, method, need=("heads", "mlp"))
    if getattr(model.cfg, "parallel_attn_mlp", False):
        raise MethodRefused(f"{method}: this model's blocks run attention and MLP in parallel on the same input; "
                            "edge methods support sequential blocks only; use node-level attribution_patching")
    for L in range(int(model.cfg.n_layers)):
        for kind in ("attn", "mlp"):
            wp = write_path(model, L, kind)
            if wp is not None and (wp.norm is not None or float(wp.multiplier) != 1.0):
                why = f"a post-norm ({wp.norm_name})" if wp.norm is not None else f"a residual multiplier {wp.multiplier}"
                raise MethodRefused(f"{method}: block {L}'s {kind} output reaches the residual stream through {why}, "
                                    "so the stream is not a sum of head and MLP writes and edges are not defined; "
                                    "use node-level attribution_patching or activation_patching on this model")


def head_writes(model: HookedModel, layer: int, z: Float[torch.Tensor, "n pos head d_head"]
                ) -> Float[torch.Tensor, "n pos head d_model"]:
    """Each head's write into the residual stream, ``z_H W_O^H`` (no ``b_O``), float32."""
    W_O = cast(Any, model).blocks[layer].attn.W_O.float()  # a loaded bridge's module
    return torch.einsum("nphd,hdm->nphm", z.float(), W_O.to(z.device))


def check_head_writes(model: HookedModel, layer: int, dz: torch.Tensor, d_attn_out: torch.Tensor, method: str,
                      atol: Optional[float] = None) -> None:
    """Check that the heads' write differences add up to the attention output's difference between
    two runs (``b_O`` cancels): the identity edges rely on.

    Args:
        dz: ``[n, pos, head, d_head]`` difference of ``hook_z``; d_attn_out: ``[n, pos, d_model]``
            difference of ``hook_attn_out`` (both computed by the model in its dtype).
        atol: relative tolerance; default :func:`tracekit.model.checks.tolerance` of the model's
            dtype (1e-3 in float32; float16 / bfloat16 round the model's attention output, which the
            float32 recomputation here does not).

    Raises:
        MethodRefused: they differ by more than ``atol`` (relative to the scale of ``d_attn_out``).
    """
    dt = model_dtype(model)
    tol = tolerance(dt) if atol is None else atol
    total = head_writes(model, layer, dz).sum(2)
    err = float((total - d_attn_out.float()).abs().max())
    scale = float(d_attn_out.float().abs().max()) + 1.0
    if err > tol * scale:
        raise MethodRefused(f"{method}: block {layer}'s head writes (z W_O) do not add up to its attention "
                            f"output (max difference {err:.3g} > {tol * scale:.3g}, the tolerance of "
                            f"{str(dt).replace('torch.', '')}); this architecture's heads are not separable")


def upstream_hooks(graph: Graph) -> list[str]:
    """Hook names whose activations give every upstream node's write (plus ``hook_attn_out`` for
    :func:`check_head_writes`)."""
    out = [hook("resid_pre", 0)]
    for L in range(graph.n_layers):
        out += [hook("head_out", L), hook("attn_out", L), hook("mlp_out", L)]
    return out


def downstream_hooks(graph: Graph) -> list[str]:
    """Hook names whose gradients give every downstream node's input gradient: the split q/k/v
    inputs, and ``hook_resid_mid`` / ``hook_resid_post`` of every block (an MLP's input gradient is
    ``grad(resid_mid) - grad(resid_post)``: the residual stream carries ``resid_mid`` to
    ``resid_post`` unchanged and the MLP path adds the rest, whatever the bridge does with
    ``hook_mlp_in``; the logits' is ``grad(resid_post)`` of the last block)."""
    out = []
    for L in range(graph.n_layers):
        out += [hook("head_q_input", L), hook("head_k_input", L), hook("head_v_input", L),
                hook("resid_mid", L), hook("resid_post", L)]
    return out


def receiver_hooks(graph: Graph) -> list[str]:
    """Hook names path patching writes to: the split q/k/v inputs and ``hook_mlp_in`` of every block."""
    out = []
    for L in range(graph.n_layers):
        out += [hook("head_q_input", L), hook("head_k_input", L), hook("head_v_input", L), hook("mlp_in", L)]
    return out
