"""How each block's attention and MLP outputs reach the residual stream.

In a GPT-2/Llama block the attention output is added to the residual stream as it is:
``resid_mid = resid_pre + attn_out``. Other families put something in between, and a method that
decomposes ``attn_out`` into heads (or ``mlp_out`` into neurons) must go through it or its parts
will not add up:

* **post-norms** (sandwich norms; Gemma 2/3, GLM-4, EXAONE 4) and **post-only norms** (OLMo 2/3,
  FlexOlmo): ``resid_mid = resid_pre + norm(attn(...))``. With the norm's scale ``1/sigma_post``
  frozen at the run's value (as the final norm's is in direct logit attribution) the norm is
  linear, so a head's write ``r_h = z_h W_O^h`` reaches the stream as ``w * centre(r_h) / sigma_post``.
* **residual multipliers** (Granite's ``residual_multiplier``): ``resid + m * attn(...)``.

A :class:`WritePath` is that map for one (block, attention|MLP): the hook whose value is the
component's *raw* output (``sum of parts + bias``: ``attn.hook_out`` / the norm's input), the hook
added to the stream (``hook_attn_out`` / ``hook_mlp_out``), the measured post-norm
(:func:`tracekit.model.norms.measure_norm`) and the multiplier. :meth:`WritePath.direction` is the
adjoint that carries a residual direction back to the raw output, so

    contribution(part) = (part . direction(u_eff)) / (sigma_post * sigma_final)

for every part of the raw output (heads, ``b_O``, neurons, ``b_out``), plus
:meth:`WritePath.bias_logit` for the norm's own bias. The paths are read from the bridge's own hook
aliases (``hook_attn_out -> ln1_post.hook_out`` on post-norm blocks), not from a list of families,
and the sum identities are checked on every run by the methods that use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from jaxtyping import Float

from ..core.sites import hook
from .norms import AffineNorm, measure_norm, run_sigma
from .state import state_of

if TYPE_CHECKING:  # only for the annotations: model.info imports the loader (a cycle at run time)
    from .info import HookedModel

__all__ = ["WritePath", "write_path", "write_paths"]


@dataclass(frozen=True)
class WritePath:
    """The map from a component's raw output to its residual-stream write (module docstring).

    Attributes:
        layer: block index. kind: ``attn`` or ``mlp``.
        raw_hook: hook holding the raw output (sum of its parts plus its bias).
        write_hook: hook holding what is added to the residual stream.
        norm: the post-norm in between (None when there is none).
        norm_name: its module path inside the block (``ln1_post``), for messages.
        multiplier: the constant the write is scaled by (Granite ``residual_multiplier``; else 1).
    """

    layer: int
    kind: str
    raw_hook: str
    write_hook: str
    norm: Optional[AffineNorm]
    norm_name: Optional[str]
    multiplier: float

    @property
    def identity(self) -> bool:
        """True when the raw output is the write (no norm, multiplier 1)."""
        return self.norm is None and self.multiplier == 1.0

    def hooks(self) -> list[str]:
        """The hooks a decomposition must cache (raw and write; one name when they coincide)."""
        return [self.write_hook] if self.raw_hook == self.write_hook else [self.raw_hook, self.write_hook]

    def direction(self, u: Float[torch.Tensor, " d_model"]) -> Float[torch.Tensor, " d_model"]:
        """The direction in raw-output space read by residual direction ``u``, per unit
        ``1/sigma_post`` (``m * centre(w * u)``; ``u`` itself for an identity path)."""
        d = self.norm.adjoint(u) if self.norm is not None else u
        return d * self.multiplier

    def bias_logit(self, u: Float[torch.Tensor, " d_model"]) -> float:
        """The post-norm's bias read by ``u`` (``m * b . u``; 0 without a norm or bias)."""
        if self.norm is None:
            return 0.0
        return float(self.norm.bias.to(u.device) @ u) * self.multiplier

    def sigma(self, raw: Float[torch.Tensor, "... d_model"], write: Float[torch.Tensor, "... d_model"]
              ) -> Float[torch.Tensor, "..."]:
        """``sigma_post`` of a run from the raw output and the write (ones without a norm)."""
        if self.norm is None:
            return torch.ones(raw.shape[:-1], device=raw.device)
        return run_sigma(self.norm, raw, write.float() / self.multiplier)

    def describe(self) -> str:
        parts = []
        if self.norm is not None:
            parts.append(f"post-norm blocks.{self.layer}.{self.norm_name}")
        if self.multiplier != 1.0:
            parts.append(f"residual multiplier {self.multiplier:g}")
        return " and ".join(parts) or "added as is"


def _is_norm(module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name and hasattr(module, "hook_in") and hasattr(module, "hook_out")


def write_path(model: HookedModel, layer: int, kind: str) -> Optional[WritePath]:
    """The :class:`WritePath` of block ``layer``'s ``kind`` (``attn``/``mlp``), or None when the
    block has no such write (an SSM mixer layer, a block without an MLP). Cached on the model."""
    st = state_of(model)
    key = (int(layer), kind)
    if key in st.write_paths:
        return st.write_paths[key]
    st.write_paths[key] = wp = _build(model, int(layer), kind)
    return wp


def write_paths(model: HookedModel, kind: str) -> list[Optional[WritePath]]:
    """Write paths of every block for ``kind`` (``attn`` or ``mlp``)."""
    return [write_path(model, L, kind) for L in range(int(model.cfg.n_layers))]


def _build(model: HookedModel, L: int, kind: str) -> Optional[WritePath]:
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return None
    blk = blocks[L]
    prefix = f"blocks.{L}."  # the block's own module paths (post-norms, scaled submodules) hang below it
    write = hook(f"{kind}_out", L)
    if write not in model.hook_dict:
        return None
    aliases = getattr(blk, "hook_aliases", None) or {}
    target = aliases.get(f"hook_{kind}_out")
    scale = getattr(blk, "residual_contribution_scale", None)
    if target is None and scale is not None:
        sub = getattr(blk, "scaled_attn_submodule" if kind == "attn" else "scaled_mlp_submodule", kind) or kind
        return WritePath(L, kind, f"{prefix}{sub}.hook_out", write, None, None, float(scale))
    if target is None:  # HookedTransformer: hook_attn_out is its own hook point, added as is
        return WritePath(L, kind, write, write, None, None, 1.0)
    if isinstance(target, (list, tuple)):
        target = target[0]
    mod_path = target.rsplit(".", 1)[0] if target.endswith(".hook_out") else None
    module = None
    if mod_path:
        try:
            module = blk.get_submodule(mod_path)
        except AttributeError:
            module = None
    if module is not None and _is_norm(module):
        norm = measure_norm(module, int(model.cfg.d_model))
        return WritePath(L, kind, f"{prefix}{mod_path}.hook_in", write, norm, mod_path, 1.0)
    return WritePath(L, kind, write, write, None, None, 1.0)
