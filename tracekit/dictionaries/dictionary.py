"""One sparse dictionary module for SAEs and transcoders (SAELens' and circuit-tracer's conventions).

``encode(x) = act(pre(x))`` with ``pre(x) = (x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc``;
``decode(a) = a @ W_dec + b_dec``; ``forward(x) = decode(encode(x)) + x @ W_skip.T`` (the skip term
only when ``W_skip`` is set: skip transcoders, Paulo et al. 2025). An SAE reconstructs its own
input (``hook_in == hook_out``, ``d_in == d_out``); a transcoder reads one hook and predicts another
(``blocks.L.mlp.hook_in`` -> ``blocks.L.hook_mlp_out``: Dunefsky et al. 2024; Ameisen et al. 2025).

Activations (the names SAELens' ``cfg.architecture`` uses):

* ``relu`` (SAELens ``standard`` / ``transcoder``): ``relu(pre)``.
* ``topk`` (Gao et al. 2024): the ``k`` largest pre-activations of each vector, ReLU'd, the rest 0
  (SAELens ``TopK``: ``topk(pre).values.relu()`` scattered back). With
  ``rescale_acts_by_decoder_norm`` (SAELens ``TopKSAEConfig``), ``pre`` is multiplied by the decoder
  row norms before the selection and the activations divided by them before decoding.
* ``abstopk`` (SAELens ``abstopk``): the ``k`` pre-activations of largest magnitude, signed, no ReLU.
* ``jumprelu`` (Rajamanoharan et al. 2024; Gemma Scope): ``relu(pre) * (pre > threshold)`` (SAELens;
  ``nonneg=False`` gives circuit-tracer's ``pre * (pre > threshold)``, which differs only where a
  threshold is negative).
* ``gated`` (Rajamanoharan et al. 2024): gate ``pre > 0`` (``pre`` with ``b_gate`` as the encoder
  bias), magnitude ``relu(x' @ (W_enc * exp(r_mag)) + b_mag)``.

``nonneg=False`` also gives circuit-tracer's ``TopK`` (``pre`` times the top-k mask, no ReLU).

SAELens' input handling, reproduced exactly (``sae_lens/saes/sae.py``, v6.54):

* ``reshape_activations="hook_z"`` (SAEs only; SAELens' transcoders skip it): ``encode`` flattens
  ``[..., n_heads, d_head]`` to ``[..., n_heads * d_head]`` and remembers ``d_head``; ``decode``
  reshapes back.
* ``normalize_activations``: ``"none"``, ``"expected_average_only_in"`` and ``"covariance_whitening"``
  are the identity at inference (SAELens folds those into the weights when it saves);
  ``"constant_norm_rescale"`` (``x * sqrt(d_in) / |x|``) and ``"layer_norm"`` (``(x - mu) / (std + 1e-5)``,
  unbiased std) rescale the input in ``encode`` and undo it in ``decode`` with the input's own
  coefficients (SAEs only: SAELens' transcoders normalise the input and never undo it).
  ``decode`` after ``encode`` uses the coefficients ``encode`` kept (as SAELens does);
  :meth:`Dictionary.forward` passes them directly and keeps nothing.

Source: SAELens ``sae_lens/saes/*.py`` (v6.54), circuit-tracer
``circuit_tracer/transcoder/single_layer_transcoder.py`` and ``activation_functions.py``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from jaxtyping import Float
from torch import nn

from ..core.errors import SAEError

__all__ = ["ACTIVATIONS", "NORMALIZATIONS", "Dictionary", "DictionarySet", "weights_sha256"]

#: Activation functions a :class:`Dictionary` implements.
ACTIVATIONS = ("relu", "topk", "jumprelu", "gated", "abstopk")

#: SAELens ``normalize_activations`` values a :class:`Dictionary` implements (all SAELens 6.54 has).
NORMALIZATIONS = ("none", "expected_average_only_in", "covariance_whitening", "constant_norm_rescale",
                  "layer_norm")
_RUNTIME_NORMS = ("constant_norm_rescale", "layer_norm")
#: What encode keeps for decode: the normalisation coefficients and the hook_z ``d_head`` (or None).
_State = tuple[Optional[tuple[torch.Tensor, ...]], Optional[int]]


class Dictionary(nn.Module):
    """A sparse dictionary: an SAE (``hook_in == hook_out``) or a (skip) transcoder.

    Args:
        d_in: input width (the width of ``hook_in``).
        d_sae: number of features.
        d_out: output width (``hook_out``; ``d_in`` for an SAE).
        activation: one of :data:`ACTIVATIONS`.
        k: active features per vector (``topk`` / ``abstopk`` only).
        skip: give the dictionary a skip matrix ``W_skip [d_out, d_in]`` (zeros until trained or loaded).
        hook_in: TransformerLens hook name it reads.
        hook_out: hook name it predicts (``hook_in`` when not given: an SAE).
        layer: the block it belongs to (``None`` for a non-block hook).
        apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding (SAELens' standard
            SAEs; never for transcoders, where ``d_in != d_out`` in general).
        metadata: free-form identity (model name, training settings, content key) kept with the files.
        dtype: parameter dtype.
        device: parameter device.
        rescale_acts_by_decoder_norm: ``topk``/``abstopk``: select on ``pre * |W_dec row|`` and divide
            the activations by ``|W_dec row|`` before decoding (SAELens' option of that name).
        normalize_activations: one of :data:`NORMALIZATIONS` (SAELens' option; see the module text).
        reshape_activations: ``"none"`` or ``"hook_z"`` (SAELens' option: flatten ``[..., n_heads,
            d_head]`` inputs; SAEs only).
        nonneg: ``jumprelu``/``topk``: ReLU the kept pre-activations (SAELens); ``False`` keeps a
            negative value that passes the threshold / the top-k (circuit-tracer).
        transcoder: whether it is a transcoder in SAELens' sense (no output normalisation, no hook_z
            reshaping); default: ``hook_out != hook_in`` or a skip matrix.

    Raises:
        SAEError: an unknown activation or option, ``topk`` without ``k >= 1``, non-positive widths,
            ``apply_b_dec_to_input`` with ``d_in != d_out``.
    """

    def __init__(self, d_in: int, d_sae: int, d_out: Optional[int] = None, *, activation: str = "relu",
                 k: Optional[int] = None, skip: bool = False, hook_in: str = "", hook_out: Optional[str] = None,
                 layer: Optional[int] = None, apply_b_dec_to_input: bool = False,
                 metadata: Optional[dict[str, Any]] = None, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device | str] = None, rescale_acts_by_decoder_norm: bool = False,
                 normalize_activations: str = "none", reshape_activations: str = "none", nonneg: bool = True,
                 transcoder: Optional[bool] = None):
        super().__init__()
        d_out = d_in if d_out is None else d_out
        if activation not in ACTIVATIONS:
            raise SAEError(f"dictionary activation {activation!r} is not one of {list(ACTIVATIONS)}")
        if min(d_in, d_sae, d_out) < 1:
            raise SAEError(f"dictionary widths must be >= 1 (d_in {d_in}, d_sae {d_sae}, d_out {d_out})")
        if activation in ("topk", "abstopk") and (k is None or k < 1):
            raise SAEError(f"a {activation} dictionary needs k >= 1 (active features per vector)")
        if apply_b_dec_to_input and d_in != d_out:
            raise SAEError("apply_b_dec_to_input needs d_in == d_out (an SAE); a transcoder never applies it")
        if normalize_activations not in NORMALIZATIONS:
            raise SAEError(f"normalize_activations {normalize_activations!r} is not one of {list(NORMALIZATIONS)}")
        if reshape_activations not in ("none", "hook_z"):
            raise SAEError(f"reshape_activations {reshape_activations!r} is not 'none' or 'hook_z'")
        if rescale_acts_by_decoder_norm and activation not in ("topk", "abstopk"):
            raise SAEError("rescale_acts_by_decoder_norm is a topk/abstopk option; "
                           f"this dictionary's activation is {activation!r}")
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.d_in, self.d_sae, self.d_out = int(d_in), int(d_sae), int(d_out)
        self.activation, self.k = activation, (int(k) if k is not None else None)
        self.hook_in = hook_in
        self.hook_out = hook_in if hook_out is None else hook_out
        self.layer = layer
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
        self.normalize_activations = normalize_activations
        self.reshape_activations = reshape_activations
        self.nonneg = bool(nonneg)
        self._transcoder = transcoder
        self.d_head: Optional[int] = None
        self._norm_state: Optional[_State] = None
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
        """Whether it predicts another hook than it reads (or has a skip matrix), or was declared one."""
        if self._transcoder is not None:
            return self._transcoder
        return self.hook_out != self.hook_in or self.W_skip is not None

    def extra_repr(self) -> str:
        return (f"{self.hook_in} -> {self.hook_out}, d_in={self.d_in}, d_sae={self.d_sae}, d_out={self.d_out}, "
                f"activation={self.activation}" + (f", k={self.k}" if self.k else "")
                + (", skip" if self.W_skip is not None else ""))

    def config(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this dictionary's shape and maths (no weights).
        Raises nothing."""
        return {"d_in": self.d_in, "d_sae": self.d_sae, "d_out": self.d_out, "activation": self.activation,
                "k": self.k, "skip": self.W_skip is not None, "hook_in": self.hook_in, "hook_out": self.hook_out,
                "layer": self.layer, "apply_b_dec_to_input": self.apply_b_dec_to_input,
                "rescale_acts_by_decoder_norm": self.rescale_acts_by_decoder_norm,
                "normalize_activations": self.normalize_activations,
                "reshape_activations": self.reshape_activations, "nonneg": self.nonneg,
                "transcoder": self._transcoder}

    # -- input handling (SAELens' process_sae_in) -----------------------------------------------
    def _reshape_in(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[int]]:
        if self.reshape_activations != "hook_z" or self.is_transcoder or x.shape[-1] == self.d_in:
            return x, None  # nothing to reshape, or already flat
        if x.ndim < 2 or x.shape[-2] * x.shape[-1] != self.d_in:
            raise SAEError(f"a hook_z dictionary reads [..., n_heads, d_head] with n_heads * d_head = {self.d_in}; "
                           f"got shape {tuple(x.shape)}")
        self.d_head = int(x.shape[-1])
        return x.reshape(*x.shape[:-2], self.d_in), self.d_head

    def _reshape_out(self, out: torch.Tensor, d_head: Optional[int]) -> torch.Tensor:
        if self.reshape_activations != "hook_z" or self.is_transcoder or d_head is None:
            return out
        return out.reshape(*out.shape[:-1], self.d_out // d_head, d_head)

    def _norm_in(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, ...]]]:
        if self.normalize_activations == "constant_norm_rescale":
            coeff = (self.d_in ** 0.5) / x.norm(dim=-1, keepdim=True)
            return x * coeff, (coeff,)
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            xc = x - mu
            std = xc.std(dim=-1, keepdim=True)
            return xc / (std + 1e-5), (mu, std)
        return x, None

    def _norm_out(self, out: torch.Tensor, state: Optional[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        if self.normalize_activations not in _RUNTIME_NORMS or self.is_transcoder:
            return out
        if state is None:
            raise SAEError(f"decode of a dictionary with normalize_activations={self.normalize_activations!r} "
                           "needs the input's scale: call encode first, or forward(x)")
        if self.normalize_activations == "constant_norm_rescale":
            return out / state[0]
        return out * state[1] + state[0]

    def _prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, _State]:
        x, d_head = self._reshape_in(x.to(self.W_enc.dtype))
        x, norm = self._norm_in(x)
        return (x - self.b_dec if self.apply_b_dec_to_input else x), (norm, d_head)

    def _sae_in(self, x: torch.Tensor) -> torch.Tensor:
        return self._prepare(x)[0]

    # -- maths ----------------------------------------------------------------------------------
    def _pre(self, sae_in: torch.Tensor) -> torch.Tensor:
        if self.activation == "gated":
            return sae_in @ self.W_enc + self.b_gate
        pre = sae_in @ self.W_enc + self.b_enc
        if self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        return pre

    def _act(self, pre: torch.Tensor, sae_in: Optional[torch.Tensor]) -> torch.Tensor:
        if self.activation == "relu":
            return torch.relu(pre)
        if self.activation == "topk":
            assert self.k is not None
            vals, idx = torch.topk(pre, k=min(self.k, pre.shape[-1]), dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, idx, vals.relu() if self.nonneg else vals)
        if self.activation == "abstopk":
            assert self.k is not None
            idx = torch.topk(pre.abs(), k=min(self.k, pre.shape[-1]), dim=-1, sorted=False).indices
            return torch.zeros_like(pre).scatter_(-1, idx, pre.gather(-1, idx))
        if self.activation == "jumprelu":
            assert self.threshold is not None
            kept = torch.relu(pre) if self.nonneg else pre
            return kept * (pre > self.threshold).to(pre.dtype)
        if sae_in is None:
            raise SAEError("a gated dictionary's activation needs the input x (its magnitude path)")
        mag = torch.relu(sae_in @ (self.W_enc * torch.exp(self.r_mag)) + self.b_mag)
        return (pre > 0).to(mag.dtype) * mag

    def pre_acts(self, x: Float[torch.Tensor, "..."]) -> Float[torch.Tensor, "*batch d_sae"]:
        """Encoder pre-activations ``(x' - b_dec?) @ W_enc + b_enc`` (``x'``: ``x`` reshaped/normalised as
        SAELens does; for ``gated``: the gate's, with ``b_gate``; with ``rescale_acts_by_decoder_norm``:
        times the decoder row norms, what the top-k selects on). Units: the dictionary's feature
        units. Raises SAEError: a ``hook_z`` input of the wrong shape."""
        return self._pre(self._prepare(x)[0])

    def activate(self, pre: Float[torch.Tensor, "*batch d_sae"],
                 x: Optional[Float[torch.Tensor, "..."]] = None) -> Float[torch.Tensor, "*batch d_sae"]:
        """The activation function applied to pre-activations (``gated`` also needs ``x`` for its
        magnitude path). Raises SAEError: ``gated`` without ``x``."""
        return self._act(pre, None if x is None else self._prepare(x)[0])

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, _State]:
        sae_in, state = self._prepare(x)
        return self._act(self._pre(sae_in), sae_in), state

    def encode(self, x: Float[torch.Tensor, "..."]) -> Float[torch.Tensor, "*batch d_sae"]:
        """Feature activations ``[*batch, d_sae]`` of ``x`` (``hook_in`` vectors ``[*batch, d_in]``;
        ``[*batch, n_heads, d_head]`` for a ``hook_z`` SAE). With a runtime ``normalize_activations`` it keeps the input's scale for the next
        :meth:`decode`, as SAELens does. Raises SAEError: a ``hook_z`` input of the wrong shape."""
        acts, state = self._encode(x)
        self._norm_state = state
        return acts

    def _decode(self, acts: torch.Tensor, state: Optional[_State]) -> torch.Tensor:
        norm, d_head = state if state is not None else (None, self.d_head)
        return self._reshape_out(self._norm_out(self.decode_linear(acts), norm), d_head)

    def decode(self, acts: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "..."]:
        """``acts @ W_dec + b_dec`` ``[*batch, d_out]`` (``[*batch, n_heads, d_head]`` for ``hook_z``; no skip term; activations divided by the decoder row norms first
        with ``rescale_acts_by_decoder_norm``; the input's normalisation undone and the ``hook_z``
        shape restored as SAELens does). Raises SAEError: a runtime ``normalize_activations``
        without a preceding :meth:`encode`."""
        state, self._norm_state = self._norm_state, None
        return self._decode(acts, state)

    def decode_linear(self, acts: Float[torch.Tensor, "*batch d_sae"]) -> Float[torch.Tensor, "*batch d_out"]:
        """The decoder as a linear map of the activations with its bias, ``acts' @ W_dec + b_dec``
        (``acts'`` divided by the row norms with ``rescale_acts_by_decoder_norm``), without any
        input-dependent normalisation or reshaping: what a feature writes. Raises nothing."""
        acts = acts.to(self.W_dec.dtype)
        if self.rescale_acts_by_decoder_norm:
            acts = acts * (1 / self.W_dec.norm(dim=-1))
        return acts @ self.W_dec + self.b_dec

    def skip_out(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_out"]:
        """The skip term ``x @ W_skip.T`` (zeros without a skip matrix). Raises nothing."""
        if self.W_skip is None:
            return torch.zeros(*x.shape[:-1], self.d_out, dtype=self.W_dec.dtype, device=x.device)
        return x.to(self.W_skip.dtype) @ self.W_skip.T

    def forward(self, x: Float[torch.Tensor, "..."]) -> Float[torch.Tensor, "..."]:
        """The reconstruction (SAE) or prediction (transcoder) of ``hook_out`` from ``x``
        (``[*batch, d_in]`` -> ``[*batch, d_out]``; ``hook_z`` SAEs keep ``[*batch, n_heads, d_head]``); keeps no
        state. Raises SAEError: a ``hook_z`` input of the wrong shape."""
        acts, state = self._encode(x)
        out = self._decode(acts, state)
        return out + self.skip_out(x) if self.W_skip is not None else out


def weights_sha256(d: Dictionary) -> str:
    """sha256 of a dictionary's parameters (names, dtypes, shapes and bytes, in name order): a content
    key that does not depend on the file format. Raises nothing."""
    h = hashlib.sha256()
    for name, p in sorted(d.state_dict().items()):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


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
