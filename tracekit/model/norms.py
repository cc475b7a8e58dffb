"""What a normalisation layer does, measured rather than assumed.

LayerNorm, RMSNorm, Gemma's ``(1 + w)`` RMSNorm, Nemotron's ``LayerNorm1P``, OLMo's
parameter-free LayerNorm, Cohere's bias-free LayerNorm, and the same layers after TransformerLens'
weight processing (weights folded away) all compute

    y = w * centre(x) / sigma(x) + b         sigma(x) = sqrt(mean(centre(x)^2) + eps)

with ``centre`` the mean subtraction (LayerNorm) or nothing (RMSNorm). Which ``w`` and ``b`` a
given module applies depends on conventions that live in each family's code (``w`` or ``1 + w``,
an offset flag, folded or not). Reading the wrong attribute gives wrong attributions with no error
(Nemotron's ``1 + w`` read as ``w``). So :func:`measure_norm` *asks the module*: it calls it on
probe vectors whose ``sigma`` is known and solves for ``w``, ``b`` and whether it centres, then
checks the affine form on a random vector. A module that is not of this form is reported as such
and every method that needs the frozen-scale linearisation refuses it.

:func:`run_sigma` recovers ``sigma`` of a run from the module's own input and output (least
squares over ``d_model``, eps-free), so frozen-scale attributions use exactly the scale the
forward pass applied.

Used by :class:`tracekit.model.readout.Readout` (the final norm) and :mod:`tracekit.model.writepath` (post-
attention / post-MLP norms of sandwich-norm blocks: Gemma 2/3, OLMo 2, GLM-4, EXAONE 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from jaxtyping import Float

__all__ = ["AffineNorm", "measure_norm", "run_sigma"]


@dataclass(frozen=True)
class AffineNorm:
    """A normalisation layer's affine form ``y = w * centre(x) / sigma + b`` (float32, on the
    module's device).

    Attributes:
        weight: ``[d]`` the weight the forward pass multiplies by (``1 + w`` for Gemma/Nemotron).
        bias: ``[d]`` the bias it adds (zeros for RMSNorm and bias-free LayerNorms).
        centred: True for LayerNorm (subtracts the mean), False for RMSNorm.
        exact: the module matched the affine form on a random vector (to ``max_error``).
        max_error: largest deviation seen in that check, in output units.
    """

    weight: Float[torch.Tensor, " d"]
    bias: Float[torch.Tensor, " d"]
    centred: bool
    exact: bool
    max_error: float

    def centre(self, x: Float[torch.Tensor, "... d"]) -> Float[torch.Tensor, "... d"]:
        """``x`` minus its mean over the last axis for LayerNorm; ``x`` for RMSNorm."""
        return x - x.mean(-1, keepdim=True) if self.centred else x

    def adjoint(self, u: Float[torch.Tensor, " d"]) -> Float[torch.Tensor, " d"]:
        """The direction read through the norm at scale 1: ``centre(w * u)``, so that
        ``(w * centre(x)) . u == x . centre(w * u)`` for every ``x``."""
        return self.centre(self.weight.to(u.device) * u)


def _eps(module, default: float = 1e-5) -> float:
    for obj in (module, getattr(module, "original_component", None)):
        if obj is None:
            continue
        for name in ("eps", "variance_epsilon", "epsilon", "layer_norm_eps"):
            v = getattr(obj, name, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    return default


def _device_dtype(module) -> tuple[torch.device, torch.dtype]:
    for p in module.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.float32


@torch.no_grad()
def measure_norm(module, d_model: int, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> AffineNorm:
    """Measure a norm module's ``(weight, bias, centred)`` by calling it on probe vectors.

    Probes: ``x = c * s`` with ``s`` alternating +1/-1 (mean 0, RMS ``c``), its negation, and
    ``c * 1`` (a constant vector, which a centring norm maps to its bias). With ``c = 64``,
    ``sigma = sqrt(c^2 + eps) = c (1 + eps / 2c^2)``, a relative error below 2e-9 for eps <= 1e-5,
    under float32 rounding. The affine form is then checked on a seeded random vector.

    Args:
        module: the normalisation module (a TransformerLens bridge component or a torch module).
        d_model: its width (even: the alternating probe needs mean 0).
        device: where to probe (default: the module's parameters' device).
        dtype: the dtype of the probe vectors (default: the module's parameters' dtype).

    Returns:
        An :class:`AffineNorm` (float32).
    """
    dev, dt = _device_dtype(module)
    dev = device or dev
    dt = dtype or dt
    d = int(d_model)
    c = 64.0
    s = torch.ones(d, device=dev, dtype=torch.float32)
    s[1::2] = -1.0
    if d % 2:
        s[-1] = 0.0  # odd width: mean stays 0; sigma becomes c * sqrt((d-1)/d)
    rms = float(s.pow(2).mean().sqrt())
    eps = _eps(module)
    sigma = (c * c * rms * rms + eps) ** 0.5

    def call(x):
        out = module(x.to(dt)[None, None, :])
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(d).float()

    y_pos, y_neg = call(c * s), call(-c * s)
    bias = (y_pos + y_neg) / 2
    scale = (y_pos - y_neg) / 2  # = w * c * s / sigma
    weight = torch.where(s != 0, scale * sigma / (c * torch.where(s != 0, s, torch.ones_like(s))), torch.zeros_like(s))
    if d % 2:  # the last coordinate was not probed: probe it alone with a shifted pattern
        s2 = torch.roll(s, 1)
        y2p, y2n = call(c * s2), call(-c * s2)
        weight[-1] = float((y2p - y2n)[-1] / 2 * sigma / (c * s2[-1]))
    const = call(c * torch.ones(d, device=dev))
    centred = bool((const - bias).abs().max() < (weight.abs().max() * 1e-3 + 1e-6))
    norm = AffineNorm(weight, bias, centred, True, 0.0)
    # check the affine form on a random vector
    g = torch.Generator(device="cpu").manual_seed(1234)
    r = (torch.randn(d, generator=g) * 3.0 + 0.5).to(dev)
    r = r.to(dt).float()
    cr = norm.centre(r)
    expect = weight * cr / torch.sqrt(cr.pow(2).mean() + eps) + bias
    got = call(r)
    err = float((got - expect).abs().max())
    tol = 1e-4 * max(1.0, float(expect.abs().max())) if dt == torch.float32 else 2e-2 * max(1.0, float(expect.abs().max()))
    return AffineNorm(weight, bias, centred, err <= tol, err)


@torch.no_grad()
def run_sigma(norm: AffineNorm, x_in: Float[torch.Tensor, "... d"], x_out: Float[torch.Tensor, "... d"]
              ) -> Float[torch.Tensor, "..."]:
    """The scale ``sigma`` a norm applied in a run, from its input and output (float32).

    ``x_out - b = w * centre(x_in) / sigma``, solved for ``sigma`` by least squares over the last
    axis: ``sigma = |w c|^2 / <w c, x_out - b>`` with ``c = centre(x_in)``. Independent of eps and
    of whether the model upcasts inside the norm; equals the model's ``hook_scale`` where it has one.
    """
    a = norm.weight.to(x_in.device) * norm.centre(x_in.float())
    y = x_out.float() - norm.bias.to(x_in.device)
    den = (a * y).sum(-1)
    return a.pow(2).sum(-1) / torch.where(den == 0, torch.ones_like(den), den)
