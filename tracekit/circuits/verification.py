"""How far an approximation is from the exact answer, measured on the same rows in the same run.

An approximate method (AtP, AtP*, EAP, EAP-IG) ranks every site or edge. The exact engine then
patches (:func:`tracekit.patching.run_patching`) or path-patches (:func:`tracekit.circuits.paths.path_patch`)
the **top-k** of that ranking and a **seeded random sample** of the rest, on the same rows, and
:func:`compare` reports, over those checked sites:

* ``pearson`` / ``spearman``: correlation of the approximate and exact effects;
* ``top_k_recall``: of the ``k`` checked sites with the largest exact |effect|, the share the
  approximation also put in its top ``k`` (the random sample is what lets a site outside the
  approximate top-k show up here);
* ``sign_agreement``: share of checked sites whose effects have the same sign (exact |effect|
  below ``1e-6`` not counted);
* ``worst_false_negatives``: checked sites outside the approximate top-k, by exact |effect|:
  what the approximation would have made you miss;
* ``largest_errors``: checked sites by |exact - approx| (e.g. a site in the top-k whose effect the
  approximation under-rates several-fold: an indirect effect through a saturated softmax), and
  ``max_abs_error``.

The numbers describe the checked sites only (a sample, not the whole ranking), and say so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import pandas as pd

from ..patching.run import JobResult, PatchingRun

#: Names a position across runs: ``(job, pos value of an index row) -> key``.
PosKey = Callable[[JobResult, int], Any]

__all__ = ["choose_checked", "compare", "site_means"]


def site_means(runs: Sequence[tuple[PatchingRun, PosKey]], metric: str) -> pd.DataFrame:
    """Per (intervention, site, index) the mean over rows of :class:`tracekit.patching.PatchingRun` s'
    metric ``metric``, normalised by the same rows' mean clean and corrupted scores (a ratio of means).

    Args:
        runs: ``[(run, pos_key)]``: exact or estimated runs (e.g. one per length group) with
            ``pos_key(job, pos value) -> key`` naming a position across them (a named position, a
            position from the end, or the token index).
        metric: the metric's name (a column of each ``run.metrics``).

    Returns:
        Columns ``intervention, site, layer, pos_key, head_idx, neuron, value, clean, corrupted,
        normalized, effect`` (``effect`` = ``normalized`` for denoising, ``1 - normalized`` otherwise).
    """
    recs = []
    for run, pos_key in runs:
        recs += _records(run, run.metrics.index(metric), pos_key)
    df = pd.DataFrame(recs, columns=["intervention", "site", "layer", "pos_key", "head_idx", "neuron", "value",
                                     "clean", "corrupted", "n"])
    keys = ["intervention", "site", "layer", "pos_key", "head_idx", "neuron"]
    df = cast(pd.DataFrame, df.groupby(keys, dropna=False, sort=False).sum()).reset_index()
    for c in ("value", "clean", "corrupted"):
        df[c] = df[c] / df["n"]
    gap = df["clean"] - df["corrupted"]
    df["normalized"] = np.where(gap.abs() >= 1e-6, (df["value"] - df["corrupted"]) / gap.where(gap != 0, 1), np.nan)
    df["effect"] = np.where(df["intervention"] == "denoising", df["normalized"], 1 - df["normalized"])
    return df


def _records(run: PatchingRun, metric: int, pos_key: PosKey) -> list[tuple]:
    recs = []
    for job in run.jobs:
        g = len(job.pairs)
        vals = job.values[:, metric].reshape(len(job.index), g).numpy()
        clean = run.clean[job.pairs, metric].numpy()
        corr = run.corrupted[job.pairs, metric].numpy()
        idf = job.index
        for r in range(len(idf)):
            row = idf.iloc[r]
            pk = pos_key(job, int(row["pos"])) if "pos" in idf else None
            recs.append((job.mode, job.site.name, int(row["layer"]), pk,
                         int(row["head"]) if "head" in idf else None, int(row["neuron"]) if "neuron" in idf else None,
                         vals[r].sum(), clean.sum(), corr.sum(), g))
    return recs


def choose_checked(effects: np.ndarray, top_k: int, n_random: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the top-``top_k`` |effects| and of a seeded random sample of ``n_random`` others
    (fewer when there are not enough)."""
    order = np.argsort(-np.abs(np.nan_to_num(effects, nan=0.0)), kind="stable")
    top = order[:top_k]
    rest = order[top_k:]
    rng = np.random.default_rng(seed)
    sample = rng.choice(rest, size=min(n_random, len(rest)), replace=False) if len(rest) else rest
    return top, np.sort(sample)


def _ranks(x: np.ndarray) -> np.ndarray:
    return pd.Series(x).rank(method="average").to_numpy()


def compare(approx: np.ndarray, exact: np.ndarray, labels: Sequence[str], in_top: np.ndarray,
            approx_rank: np.ndarray, top_k: int, n_worst: int = 5) -> dict:
    """Agreement of approximate and exact effects over the checked sites (module docstring).

    Args:
        approx: ``[checked]`` approximate effects (e.g. normalised effects).
        exact: ``[checked]`` exact effects in the same units.
        labels: ``[checked]`` site names.
        in_top: ``[checked]`` bool, in the approximate top-k.
        approx_rank: ``[checked]`` 1-based rank of each site in the full approximate ranking.
        top_k: k.

    Returns:
        ``{n_checked, n_top, n_random, pearson, spearman, top_k_recall, sign_agreement,
        worst_false_negatives: [{site, exact, approx, approx_rank}], largest_errors (the same
        records), max_abs_error, top_k_floor (the smallest |estimate| in the top-k), note}``.
    """
    a, e = np.asarray(approx, float), np.asarray(exact, float)
    ok = np.isfinite(a) & np.isfinite(e)
    a, e, labels = a[ok], e[ok], [lab for lab, k in zip(labels, ok) if k]
    in_top, approx_rank = np.asarray(in_top)[ok], np.asarray(approx_rank)[ok]

    def corr(x, y):
        return float(np.corrcoef(x, y)[0, 1]) if len(x) > 2 and x.std() > 0 and y.std() > 0 else None

    k = min(top_k, len(e))
    exact_top = np.argsort(-np.abs(e), kind="stable")[:k]
    recall = float(np.mean(in_top[exact_top])) if k else None
    big = np.abs(e) >= 1e-6
    sign = float(np.mean(np.sign(a[big]) == np.sign(e[big]))) if big.any() else None
    miss = [i for i in np.argsort(-np.abs(e), kind="stable") if not in_top[i]][:n_worst]
    err = np.argsort(-np.abs(e - a), kind="stable")[:n_worst]
    return {
        "n_checked": int(len(e)), "n_top": int(in_top.sum()), "n_random": int((~in_top).sum()),
        "pearson": corr(a, e), "spearman": corr(_ranks(a), _ranks(e)) if len(e) > 2 else None,
        "top_k_recall": recall, "sign_agreement": sign,
        "worst_false_negatives": [{"site": labels[i], "exact": round(float(e[i]), 6), "approx": round(float(a[i]), 6),
                                   "approx_rank": int(approx_rank[i])} for i in miss],
        "largest_errors": [{"site": labels[i], "exact": round(float(e[i]), 6), "approx": round(float(a[i]), 6),
                            "approx_rank": int(approx_rank[i])} for i in err],
        "max_abs_error": float(np.max(np.abs(e - a))) if len(e) else None,
        "top_k_floor": float(np.min(np.abs(a[in_top]))) if in_top.any() else None,
        "note": "over the checked sites only: the approximate top-k and a seeded random sample of the rest",
    }
