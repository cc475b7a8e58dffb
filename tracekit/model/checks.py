"""The load-time checks every model passes (forward vs transformers, the readout vs the output),
the verification probe and the tolerance table; :mod:`tracekit.verify` builds the full report on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from jaxtyping import Float, Int

from ..core.sites import hook
from .readout import Readout

if TYPE_CHECKING:  # only for the annotations: model.info imports the loader (a cycle at run time)
    from .info import HookedModel

#: Built-in prompts (short: every check runs in seconds on a laptop).
PROMPTS = ("The capital of France is Paris, and the capital of Italy is",
           "When Mary and John went to the store, John gave a drink to",
           "The quick brown fox")  # of another length: batching pads


#: Log-probability tolerance (nats) per dtype: float32 op-order differences between the bridge and
#: transformers stay below 1e-4 on every tiny conformance model and the embedded model; half
#: precision rounds each activation to 11 / 8 bits.
_TOL = {torch.float32: 1e-3, torch.float64: 1e-6, torch.float16: 5e-2, torch.bfloat16: 2.5e-1}


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> float:
    """Absolute tolerance of a comparison in ``dtype`` for values of magnitude ``scale`` (>= 1)."""
    return _TOL.get(dtype, 1e-3) * max(1.0, float(scale))


@dataclass
class Check:
    """One verified identity.

    Attributes:
        name: the check (module docstring table). method: what it guards (``load``, ``logit_lens``,
            ``dla``, ``neurons``, ``patching``, ``attention``, ``batching``).
        value: the largest deviation measured (nats or logits; None when not measured).
        tolerance: the bound it must stay within.
        status: ``pass`` | ``fail`` | ``refused`` | ``skipped``.
        detail: what was compared, or the refusal's reason.
    """

    name: str
    method: str
    value: Optional[float]
    tolerance: Optional[float]
    status: str
    detail: str = ""


def probe_ids(tokenizer, vocab: int, n: int = 10) -> Int[torch.Tensor, "prompt n"]:
    """One row of ``n`` token ids per built-in prompt (plain ids, no special tokens), or
    ids counted from 10 when the tokenizer gives too few."""
    rows = []
    for text in PROMPTS:
        try:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        except Exception:  # noqa: BLE001 - unusual tokenizers: fall back to plain ids
            ids = []
        ids = [i for i in ids if 0 <= i < vocab]
        if len(ids) < n:
            ids = ids + [(10 + 7 * k) % vocab for k in range(n - len(ids))]
        rows.append(ids[:n])
    return torch.tensor(rows, dtype=torch.long)


def model_dtype(model: HookedModel) -> torch.dtype:
    """The dtype of ``model``'s first parameter (float32 for a model without parameters).

    Args:
        model: a ``torch.nn.Module`` (a TransformerLens bridge or a Hugging Face model).

    Returns:
        Its parameters' ``torch.dtype``.
    """
    try:
        return next(cast(Any, model).parameters()).dtype  # a loaded bridge's module
    except StopIteration:  # pragma: no cover
        return torch.float32


def max_abs(x: torch.Tensor) -> float:
    """Largest absolute value of ``x`` (any shape; 0.0 when empty), as a Python float in ``x``'s units
    (log-probabilities: nats)."""
    return float(x.abs().max()) if x.numel() else 0.0


#: Half-precision dtypes: the ``forward`` check compares them with a float32 run of the same weights.
HALF = (torch.float16, torch.bfloat16)

#: The half-precision rule of the load-time ``forward`` checks: the bridge's log-probability error
#: against a float32 run of the same weights may be at most a factor times transformers' own error
#: in that dtype on the same probe, plus the float32 tolerance, for two statistics: the largest
#: error (``forward``: catches a few wrong tokens or one wrong position) and the mean error over
#: every position and token (``forward_mean``: stable, so its factor is tight; catches a small error
#: everywhere).
#: Ratios measured (bridge / transformers, processed weights): SmolLM2-135M float16 1.07 (max),
#: bfloat16 0.84; 3-block random GPT-2 / Llama with weights of std 0.3 and 1.0 (logit ranges 23-73
#: nats), float16 and bfloat16: max up to 2.93, mean up to 1.49; raw weights: 1.00 (the bridge runs
#: transformers' arithmetic). A fixed table value cannot hold for every depth and logit scale
#: (transformers' own bfloat16 error on those models: 0.005 to 13 nats).
HALF_FACTOR = {"max": 4.0, "mean": 2.0}


def _mean(x: torch.Tensor) -> float:
    return float(x.abs().mean()) if x.numel() else 0.0


def forward_checks(bridge_log_probs: Float[torch.Tensor, "b p vocab"], ref_logits: torch.Tensor,
                   ref32_logits: Optional[torch.Tensor], dtype: torch.dtype) -> list[Check]:
    """The ``forward`` check(s): the bridge's log-probabilities against transformers' on the same ids.

    In float32 (or when no float32 reference could be run) one check, ``forward``: the bridge vs
    ``ref_logits`` (transformers in the model's dtype) within :func:`tolerance`. In float16 /
    bfloat16 both the bridge and transformers round every activation, each in its own order, so two
    half-precision runs differ by about the dtype's rounding error however correct both are. The
    bridge is then compared with ``ref32_logits`` (transformers on the same weights upcast to
    float32: the half-precision model computed without rounding), within
    ``HALF_FACTOR[s] x s(transformers(dtype) - transformers(float32)) + tolerance(float32)`` for two
    statistics ``s``: ``forward`` the largest absolute difference, ``forward_mean`` the mean absolute
    difference over every position and token. The bridge may lose a little more
    precision than transformers (its processed weights are rounded once more), and a wiring error
    larger than the rounding (a wrong weight, norm, mask) is still refused.

    Args:
        bridge_log_probs: the bridge's log-softmax (float32), ``[b, p, vocab]``.
        ref_logits: transformers' logits in the model's dtype, ``[b, p, vocab]``.
        ref32_logits: transformers' logits with the weights upcast to float32, or None.
        dtype: the model's dtype.

    Returns:
        :class:`Check` ``forward`` (and ``forward_mean`` in half precision): values and tolerances
        in nats; ``detail`` states the rule and the reference's own error.
    """
    dev = bridge_log_probs.device
    ref = torch.log_softmax(ref_logits.float().to(dev), -1)
    floor = tolerance(torch.float32)
    if dtype in HALF and ref32_logits is not None:
        name = str(dtype).replace("torch.", "")
        ref32 = torch.log_softmax(ref32_logits.float().to(dev), -1)
        out = []
        for check, stat, what, key in (("forward", max_abs, "largest |difference|", "max"),
                                       ("forward_mean", _mean, "mean |difference|", "mean")):
            own, err = stat(ref - ref32), stat(bridge_log_probs - ref32)
            tol = HALF_FACTOR[key] * own + floor
            out.append(Check(check, "load", err, tol, "pass" if err <= tol else "fail",
                             f"bridge ({name}) vs transformers on the same weights in float32, {what} over the "
                             f"probe; tolerance {HALF_FACTOR[key]:g} x transformers' own {name} error ({own:.3g}) "
                             f"+ {floor:g}"))
        return out
    err = max_abs(bridge_log_probs - ref)
    tol = tolerance(dtype)
    return [Check("forward", "load", err, tol, "pass" if err <= tol else "fail",
                  "bridge vs transformers log-probs, every position of the probe")]


@torch.no_grad()
def load_checks(model: HookedModel, ids: Int[torch.Tensor, "b p"], ref_logits: Optional[torch.Tensor],
                ref32_logits: Optional[torch.Tensor] = None) -> list[Check]:
    """The load-time subset: ``forward`` (against logits the Hugging Face model gave on ``ids``
    before the bridge wrapped it; in half precision against its float32 run ``ref32_logits``, see
    :func:`forward_checks`) and ``lens_final``."""

    dt = model_dtype(model)
    dev = next(cast(Any, model).parameters()).device  # a loaded bridge's module
    last = hook("resid_post", int(model.cfg.n_layers) - 1)
    logits, cache = model.run_with_cache(ids.to(dev), names_filter=lambda n: n == last)
    lp = torch.log_softmax(logits.float(), -1)
    out = []
    if ref_logits is not None:
        out += forward_checks(lp, ref_logits, ref32_logits, dt)
    if last in cache:
        err = max_abs(Readout(model).log_probs(cache[last]) - lp)
        tol = tolerance(dt)
        out.append(Check("lens_final", "logit_lens", err, tol, "pass" if err <= tol else "fail",
                         "readout of the last block's output vs the model's output"))
    else:
        out.append(Check("lens_final", "logit_lens", None, None, "fail",
                         f"the last block's output ({last}) never fired: the residual stream is not visible"))
    return out

