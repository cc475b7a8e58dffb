"""The load-time checks every model passes (forward vs transformers, the readout vs the output),
the verification probe and the tolerance table; :mod:`tracekit.verify` builds the full report on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from jaxtyping import Int

from ..core.sites import hook
from .readout import Readout

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


def _dtype(model) -> torch.dtype:
    try:
        return next(model.parameters()).dtype
    except StopIteration:  # pragma: no cover
        return torch.float32


def _max(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


@torch.no_grad()
def load_checks(model, ids: Int[torch.Tensor, "b p"], ref_logits: Optional[torch.Tensor]) -> list[Check]:
    """The load-time subset: ``forward`` (against logits the Hugging Face model gave on ``ids``
    before the bridge wrapped it) and ``lens_final``."""

    dt = _dtype(model)
    dev = next(model.parameters()).device
    last = hook("resid_post", int(model.cfg.n_layers) - 1)
    logits, cache = model.run_with_cache(ids.to(dev), names_filter=lambda n: n == last)
    lp = torch.log_softmax(logits.float(), -1)
    out = []
    if ref_logits is not None:
        err = _max(lp - torch.log_softmax(ref_logits.float().to(lp.device), -1))
        tol = tolerance(dt)
        out.append(Check("forward", "load", err, tol, "pass" if err <= tol else "fail",
                         "bridge vs transformers log-probs, every position of the probe"))
    if last in cache:
        err = _max(Readout(model).log_probs(cache[last]) - lp)
        tol = tolerance(dt)
        out.append(Check("lens_final", "logit_lens", err, tol, "pass" if err <= tol else "fail",
                         "readout of the last block's output vs the model's output"))
    else:
        out.append(Check("lens_final", "logit_lens", None, None, "fail",
                         f"the last block's output ({last}) never fired: the residual stream is not visible"))
    return out

