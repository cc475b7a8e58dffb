"""Output metrics, defined once for every method that scores a forward pass.

All are vectorised over rows (one row = one prompt or one patched variant) and read the logits at
one position (the answer position). Tokens: ``target`` is the token being explained, ``foil`` the
contrasting token (docs/glossary.md); several target/foil pairs per row are averaged.

=============  ==============================================  =======================
name           definition                                      units
=============  ==============================================  =======================
``logit_diff`` mean_k logit(target_k) - logit(foil_k)           logits
``prob``       mean_k p(target_k)                              probability in [0, 1]
``log_prob``   mean_k log p(target_k)                          nats (natural log)
``kl``         KL(P_clean || P_run)                            nats
=============  ==============================================  =======================

Zhang & Nanda 2023 ("Towards Best Practices of Activation Patching") recommend the logit
difference; :func:`normalize` maps a metric so the clean run scores 1 and the corrupted run 0.

Precision: every metric is computed in float32 whatever the model's dtype. The logits (and the
clean run's log-probabilities of ``kl``) are upcast *before* any subtraction, log-softmax or sum,
so a bfloat16 model's metric is the exact float32 computation on its bfloat16 logits: it is not
quantised again by bfloat16's 8-bit mantissa (a logit of 14 is stored to steps of 0.0625; two
bfloat16 logits subtracted in bfloat16 would round the difference to that step).
Converting bfloat16 or float16 to float32 is exact, so gathering before upcasting (``logit_diff``)
gives the same numbers as upcasting the whole ``[rows, d_vocab]`` tensor.
docs/precision.md states what a low-precision run of each kind keeps (tolerances, measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float, Int

__all__ = ["logit_diff", "target_prob", "target_log_prob", "kl_div", "normalize", "MetricInputs", "METRICS",
           "METRIC_UNITS", "compute_metrics"]


def logit_diff(logits: Float[torch.Tensor, "rows d_vocab"], target: Int[torch.Tensor, "rows k"],
               foil: Int[torch.Tensor, "rows k"]) -> Float[torch.Tensor, " rows"]:
    """Mean over the k target/foil pairs of logit(target) - logit(foil) (units: logits), in float32:
    the gathered logits are upcast before they are subtracted (a float32 ``[rows]`` tensor)."""
    return (logits.gather(-1, target).float() - logits.gather(-1, foil).float()).mean(-1)


def target_prob(logits: Float[torch.Tensor, "rows d_vocab"], target: Int[torch.Tensor, "rows k"]
                ) -> Float[torch.Tensor, " rows"]:
    """Mean over targets of the target's probability (in [0, 1]; log-softmax in float32)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, target).exp().mean(-1)


def target_log_prob(logits: Float[torch.Tensor, "rows d_vocab"], target: Int[torch.Tensor, "rows k"]
                    ) -> Float[torch.Tensor, " rows"]:
    """Mean over targets of the target's natural-log probability (nats; log-softmax in float32)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, target).mean(-1)


def kl_div(logits: Float[torch.Tensor, "rows d_vocab"], ref_log_probs: Float[torch.Tensor, "rows d_vocab"]
           ) -> Float[torch.Tensor, " rows"]:
    """KL(P_ref || P_logits) in nats, ``P_ref`` given as natural-log probabilities (the clean run).

    Both are upcast to float32 before the log-softmax, the subtraction and the sum over the
    vocabulary (a ``[rows]`` float32 tensor), whatever dtype they come in.
    """
    lp = torch.log_softmax(logits.float(), -1)
    ref = ref_log_probs.float()
    return (ref.exp() * (ref - lp)).sum(-1)


@dataclass
class MetricInputs:
    """What the metrics of a batch of rows need besides the logits.

    Attributes:
        target: ``[rows, k]`` target token ids.
        foil: ``[rows, k]`` foil token ids (``logit_diff`` only).
        clean_log_probs: ``[rows, d_vocab]`` the clean run's log-probabilities (``kl`` only).
    """

    target: Int[torch.Tensor, "rows k"]
    foil: Optional[Int[torch.Tensor, "rows k"]] = None
    clean_log_probs: Optional[Float[torch.Tensor, "rows d_vocab"]] = None

    def rows(self, idx: torch.Tensor) -> "MetricInputs":
        """The inputs of the rows ``idx``."""
        return MetricInputs(self.target[idx], None if self.foil is None else self.foil[idx],
                            None if self.clean_log_probs is None else self.clean_log_probs[idx])


def _needs(x, what: str, name: str):
    if x is None:
        raise ValueError(f"metric {name!r} needs {what}")
    return x


#: name -> function ``(logits [rows, d_vocab], MetricInputs) -> [rows]``.
METRICS: dict[str, Callable[[torch.Tensor, MetricInputs], torch.Tensor]] = {
    "logit_diff": lambda lg, m: logit_diff(lg, m.target, _needs(m.foil, "a foil token", "logit_diff")),
    "prob": lambda lg, m: target_prob(lg, m.target),
    "log_prob": lambda lg, m: target_log_prob(lg, m.target),
    "kl": lambda lg, m: kl_div(lg, _needs(m.clean_log_probs, "the clean run's log-probabilities", "kl")),
}

#: Units of each metric, for tables and axis labels.
METRIC_UNITS = {"logit_diff": "logits", "prob": "probability", "log_prob": "nats", "kl": "nats"}


def compute_metrics(names: Sequence[str], logits: Float[torch.Tensor, "rows d_vocab"], inputs: MetricInputs
                    ) -> Float[torch.Tensor, "rows n_metrics"]:
    """Every named metric of every row, stacked: ``[rows, len(names)]`` (float32).

    Raises:
        KeyError: an unknown metric name. ValueError: a metric whose inputs are missing.
    """
    return torch.stack([METRICS[n](logits, inputs) for n in names], -1)


def normalize(value, clean, corrupted, min_denominator: float = 1e-3):
    """``(value - corrupted) / (clean - corrupted)``: clean -> exactly 1, corrupted -> exactly 0.

    Works on floats, numpy arrays or tensors (broadcasting). Where ``|clean - corrupted| <
    min_denominator`` the result is NaN (the caller flags the pair): patching cannot be measured
    against a baseline gap of ~0, and dividing by it would amplify noise without bound.
    """
    den = clean - corrupted
    if torch.is_tensor(den):
        ok = den.abs() >= min_denominator
        safe = torch.where(ok, den, torch.ones_like(den))
        return torch.where(ok, (value - corrupted) / safe, torch.full_like(value - corrupted, float("nan")))
    den = np.asarray(den, dtype=float)
    ok = np.abs(den) >= min_denominator
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(ok, (np.asarray(value, dtype=float) - corrupted) / np.where(ok, den, 1.0), np.nan)
    return out.item() if out.ndim == 0 else out
