"""One sparse dictionary module for SAEs and transcoders (SAELens' and circuit-tracer's conventions).

``encode(x) = act(pre(x))`` with ``pre(x) = (x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc``;
``decode(a) = a @ W_dec + b_dec``; ``forward(x) = decode(encode(x)) + x @ W_skip.T`` (the skip term
only when ``W_skip`` is set: skip transcoders, Paulo et al. 2025). An SAE reconstructs its own
input (``hook_in == hook_out``, ``d_in == d_out``); a transcoder reads one hook and predicts another
(``blocks.L.mlp.hook_in`` -> ``blocks.L.hook_mlp_out``: Dunefsky et al. 2024; Ameisen et al. 2025).

Activations (the names SAELens' ``cfg.architecture`` uses):

* ``relu`` (SAELens ``standard``): ``relu(pre)``.
* ``topk`` (Gao et al. 2024): the ``k`` largest pre-activations of each vector, ReLU'd, the rest 0
  (SAELens ``TopK``: ``topk(pre).values.relu()`` scattered back).
* ``jumprelu`` (Rajamanoharan et al. 2024; Gemma Scope): ``pre * (pre > threshold)``.
* ``gated`` (Rajamanoharan et al. 2024): gate ``pre > 0`` (``pre`` with ``b_gate`` as the encoder
  bias), magnitude ``relu(x' @ (W_enc * exp(r_mag)) + b_mag)``.

Source: SAELens ``sae_lens/saes/*.py`` (v6), circuit-tracer
``circuit_tracer/transcoder/single_layer_transcoder.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from jaxtyping import Float
from torch import nn

from ..core.errors import SAEError

__all__ = ["ACTIVATIONS", "Dictionary", "DictionarySet"]

#: Activation functions a :class:`Dictionary` implements.
ACTIVATIONS = ("relu", "topk", "jumprelu", "gated")


class Dictionary(nn.Module):
    """A sparse dictionary: an SAE (``hook_in == hook_out``) or a (skip) transcoder.

    Args:
        d_in: input width (the width of ``hook_in``).
        d_sae: number of features.
        d_out: output width (``hook_out``; ``d_in`` for an SAE).
        activation: one of :data:`ACTIVATIONS`.
        k: active features per vector (``topk`` only).
        skip: give the dictionary a skip matrix ``W_skip [d_out, d_in]`` (zeros until trained or loaded).
        hook_in: TransformerLens hook name it reads.
        hook_out: hook name it predicts (``hook_in`` when not given: an SAE).
        layer: the block it belongs to (``None`` for a non-block hook).
        apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding (SAELens' standard
            SAEs; never for transcoders, where ``d_in != d_out`` in general).
        metadata: free-form identity (model name, training settings, content key) kept with the files.
        dtype: parameter dtype.
        device: parameter device.

    Raises:
        SAEError: an unknown activation, ``topk`` without ``k >= 1``, non-positive widths.
    """

    def __init__(self, d_in: int, d_sae: int, d_out: Optional[int] = None, *, activation: str = "relu",
                 k: Optional[int] = None, skip: bool = False, hook_in: str = "", hook_out: Optional[str] = None,
                 layer: Optional[int] = None, apply_b_dec_to_input: bool = False,
                 metadata: Optional[dict[str, Any]] = None, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device | str] = None):
        super().__init__()
        d_out = d_in if d_out is None else d_out
        if activation not in ACTIVATIONS:
            raise SAEError(f"dictionary activation {activation!r} is not one of {list(ACTIVATIONS)}")
        if min(d_in, d_sae, d_out) < 1:
            raise SAEError(f"dictionary widths must be >= 1 (d_in {d_in}, d_sae {d_sae}, d_out {d_out})")
        if activation == "topk" and (k is None or k < 1):
            raise SAEError("a topk dictionary needs k >= 1 (active features per vector)")
        if apply_b_dec_to_input and d_in != d_out:
            raise SAEError("apply_b_dec_to_input needs d_in == d_out (an SAE); a transcoder never applies it")
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.d_in, self.d_sae, self.d_out = int(d_in), int(d_sae), int(d_out)
        self.activation, self.k = activation, (int(k) if k is not None else None)
        self.hook_in = hook_in
        self.hook_out = hook_in if hook_out is None else hook_out
        self.layer = layer
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.W_enc = nn.Parameter(torch.zeros(d_in, d_sae, **kw))
        self.b_enc = nn.Parameter(torch.zeros(d_sae, **kw))
        self.W_dec = nn.Parameter(torch.zeros(d_sae, d_out, **kw))
        self.b_dec = nn.Parameter(torch.zeros(d_out, **kw))
        self.W_skip: Optional[nn.Parameter] = nn.Parameter(torch.zeros(d_out, d_in, **kw)) if skip else None
        self.threshold: Optional[nn.Parameter] = (nn.Parameter(torch.zeros(d_sae, **kw))
                                                  if activation == "jumprelu" else None)
        if activation == "gated":
            self.b_gate = nn.Parameter(torch.zeros(d_sae, **kw))
            self.r_mag = nn.Parameter(torch.zeros(d_sae, **kw))
            self.b_mag = nn.Parameter(torch.zeros(d_sae, **kw))

    # -- identity -------------------------------------------------------------------------------
    @property
    def is_transcoder(self) -> bool:
        """Whether it predicts another hook than it reads (or has a skip matrix)."""
        return self.hook_out != self.hook_in or self.W_skip is not None

    def extra_repr(self) -> str:
        return (f"{self.hook_in} -> {self.hook_out}, d_in={self.d_in}, d_sae={self.d_sae}, d_out={self.d_out}, "
                f"activation={self.activation}" + (f", k={self.k}" if self.k else "")
                + (", skip" if self.W_skip is not None else ""))

    # -- maths ----------------------------------------------------------------------------------
    def _sae_in(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.W_enc.dtype)
        return x - self.b_dec if self.apply_b_dec_to_input else x

    def pre_acts(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """Encoder pre-activations ``(x - b_dec?) @ W_enc + b_enc`` (for ``gated``: the gate's, with
        ``b_gate``). Units: the dictionary's feature units. Raises nothing."""
        sae_in = self._sae_in(x)
        if self.activation == "gated":
            return sae_in @ self.W_enc + self.b_gate
        return sae_in @ self.W_enc + self.b_enc

    def activate(self, pre: Float[torch.Tensor, "*batch d_sae"],
                 x: Optional[Float[torch.Tensor, "*batch d_in"]] = None) -> Float[torch.Tensor, "*batch d_sae"]:
        """The activation function applied to pre-activations (``gated`` also needs ``x`` for its
        magnitude path). Raises SAEError: ``gated`` without ``x``."""
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "topk":
            assert self.k is not None
            vals, idx = torch.topk(pre, k=min(self.k, pre.shape[-1]), dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, idx, vals.relu())
        if self.activation == "jumprelu":
            assert self.threshold is not None
            return pre * (pre > self.threshold)
        if x is None:
            raise SAEError("a gated dictionary's activation needs the input x (its magnitude path)")
        sae_in = self._sae_in(x)
        mag = torch.relu(sae_in @ (self.W_enc * torch.exp(self.r_mag)) + self.b_mag)
        return (pre > 0).to(mag) * mag

    def encode(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_sae"]:
        """Feature activations of ``x`` (``hook_in`` vectors). Raises nothing."""
        return self.activate(self.pre_acts(x), x)

    def decode(self, acts: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_out"]:
        """``acts @ W_dec + b_dec`` (no skip term). Raises nothing."""
        return acts.to(self.W_dec.dtype) @ self.W_dec + self.b_dec

    def skip_out(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_out"]:
        """The skip term ``x @ W_skip.T`` (zeros without a skip matrix). Raises nothing."""
        if self.W_skip is None:
            return torch.zeros(*x.shape[:-1], self.d_out, dtype=self.W_dec.dtype, device=x.device)
        return x.to(self.W_skip.dtype) @ self.W_skip.T

    def forward(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_out"]:
        """The reconstruction (SAE) or prediction (transcoder) of ``hook_out`` from ``x``. Raises nothing."""
        out = self.decode(self.encode(x))
        return out + self.skip_out(x) if self.W_skip is not None else out


@dataclass
class DictionarySet:
    """One dictionary per layer, all reading the same hook site and writing the same one (a transcoder
    set: ``blocks.L.mlp.hook_in`` -> ``blocks.L.hook_mlp_out`` for every ``L``).

    Attributes:
        dictionaries: ``layer -> Dictionary``.
        metadata: identity of the set (model, content key, training settings).
    """

    dictionaries: dict[int, Dictionary]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, layer: int) -> Dictionary:
        return self.dictionaries[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.dictionaries))

    def __len__(self) -> int:
        return len(self.dictionaries)

    @property
    def layers(self) -> list[int]:
        """The layers covered, ascending."""
        return sorted(self.dictionaries)

    def to(self, device: torch.device | str | None = None, dtype: Optional[torch.dtype] = None) -> "DictionarySet":
        """Move every dictionary (in place); returns self. Raises nothing."""
        for d in self.dictionaries.values():
            d.to(device=device, dtype=dtype)
        return self
