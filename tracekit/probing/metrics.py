"""Probe metrics and the bootstrap over the held-out units.

Metrics are computed under bootstrap *weights* (how often each test example is drawn), vectorised
over resamples; a weight row of ones is the plain metric. The resampling unit is what the split
holds out (:func:`split_bootstrap_weights`): entities for ``group_by: entity``, templates for
``template``, and entities and templates independently for ``both`` (a two-way cluster bootstrap,
weight = entity count x template count; Owen 2007, "The pigeonhole bootstrap"). The same weights
serve every layer and control, so differences between them are paired.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import numpy as np

__all__ = ["bootstrap_weights", "split_bootstrap_weights", "bootstrap_metrics", "probe_metrics", "percentile_ci"]


def bootstrap_weights(units: np.ndarray, n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """Resampling weights ``[n_boot, n]``: how often each example is drawn in each bootstrap resample.

    ``units`` names the resampling unit of each example: pass the example's group for a cluster
    bootstrap (whole groups drawn with replacement), or ``np.arange(n)`` for a row bootstrap.
    The same ``(units, n_boot, seed)`` give the same weights, so every layer is resampled identically
    (paired differences between layers and controls).
    """
    units = np.asarray(units)
    uniq, inv = np.unique(units.astype(str), return_inverse=True)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(len(uniq), np.full(len(uniq), 1.0 / len(uniq)), size=n_boot)  # [B, G]
    return counts[:, inv].astype(np.float64)


def _auroc_weighted(scores: np.ndarray, pos: np.ndarray, W: np.ndarray) -> np.ndarray:
    """Weighted Mann-Whitney AUROC for each weight row; NaN where a side has no weight."""
    sp, sn = scores[pos], scores[~pos]
    if len(sp) == 0 or len(sn) == 0:
        return np.full(W.shape[0], np.nan)
    M = (sp[:, None] > sn[None, :]).astype(np.float64) + 0.5 * (sp[:, None] == sn[None, :])
    Wp, Wn = W[:, pos], W[:, ~pos]
    num = ((Wp @ M) * Wn).sum(1)
    den = Wp.sum(1) * Wn.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / den, np.nan)


def bootstrap_metrics(y: np.ndarray, pred: np.ndarray, proba: Optional[np.ndarray], W: np.ndarray,
                      task: str = "classification", n_classes: Optional[int] = None) -> dict[str, np.ndarray]:
    """Metrics under each weight row of ``W`` (``[n_boot, n]``; a row of ones = the plain metric).

    Classification: ``accuracy``, ``balanced_accuracy`` (mean recall over classes present),
    ``macro_f1`` (over classes in truth or predictions, as scikit-learn), ``auroc`` (binary; one-vs-rest
    macro average for multiclass, over classes with both positives and negatives; needs ``proba``).
    Regression: ``r2``, ``pearson``, ``mse``. Each value is an array ``[n_boot]``; all are in [0, 1]
    except ``pearson`` ([-1, 1]), ``r2`` (<= 1) and ``mse`` (squared target units).
    """
    W = np.atleast_2d(np.asarray(W, dtype=np.float64))
    tot = W.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        if task == "regression":
            y = y.astype(np.float64)
            p = pred.astype(np.float64)
            my = (W @ y) / tot
            mp = (W @ p) / tot
            sse = W @ (y ** 2) - 2 * (W @ (y * p)) + W @ (p ** 2)
            sst = W @ (y ** 2) - tot * my ** 2
            cov = W @ (y * p) - tot * my * mp
            vp = W @ (p ** 2) - tot * mp ** 2
            return {"r2": 1 - sse / sst, "pearson": cov / np.sqrt(sst * vp), "mse": sse / tot}
        K = n_classes or int(max(y.max(), pred.max())) + 1
        out = {"accuracy": (W @ (y == pred).astype(np.float64)) / tot}
        rec, f1 = [], []
        for k in range(K):
            yk, pk = y == k, pred == k
            tp = W @ (yk & pk).astype(np.float64)
            fp = W @ (~yk & pk).astype(np.float64)
            fn = W @ (yk & ~pk).astype(np.float64)
            sup = W @ yk.astype(np.float64)
            rec.append(np.where(sup > 0, tp / sup, np.nan))
            den = 2 * tp + fp + fn
            f1.append(np.where(den > 0, 2 * tp / den, np.nan))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            out["balanced_accuracy"] = np.nanmean(np.stack(rec), 0)
            out["macro_f1"] = np.nanmean(np.stack(f1), 0)
            if proba is not None:
                if K == 2:
                    out["auroc"] = _auroc_weighted(proba[:, 1], y == 1, W)
                else:
                    aucs = np.stack([_auroc_weighted(proba[:, k], y == k, W) for k in range(K)])
                    out["auroc"] = np.nanmean(aucs, 0) if np.isfinite(aucs).any() else np.full(len(W), np.nan)
        return out


def probe_metrics(y: np.ndarray, pred: np.ndarray, proba: Optional[np.ndarray] = None,
                  task: str = "classification", n_classes: Optional[int] = None) -> dict[str, float]:
    """Point metrics on the test rows (see :func:`bootstrap_metrics` for definitions)."""
    m = bootstrap_metrics(y, pred, proba, np.ones((1, len(y))), task, n_classes)
    return {k: float(v[0]) for k, v in m.items()}


def percentile_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval (NaN-aware); ``(nan, nan)`` when every value is NaN."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return float("nan"), float("nan")
    a = (1 - level) / 2
    return float(np.quantile(v, a)), float(np.quantile(v, 1 - a))


# --------------------------------------------------------------------------------------------


def split_bootstrap_weights(units: Sequence[np.ndarray], n_boot: int = 1000, seed: int = 0) -> np.ndarray:
    """Bootstrap weights ``[n_boot, n]`` resampling each of ``units`` (per-example unit labels)
    independently and multiplying the counts: one array = a cluster bootstrap over that unit; two
    (entity, template) = the two-way "pigeonhole" bootstrap of a crossed design (Owen 2007), the
    right one when both entities and templates are held out.
    """
    units = [np.asarray(u) for u in units]
    if not units:
        raise ValueError("units: need at least one unit array")
    W = bootstrap_weights(units[0], n_boot, seed)
    for j, u in enumerate(units[1:], 1):
        W = W * bootstrap_weights(u, n_boot, seed + 104729 * j)
    return W
