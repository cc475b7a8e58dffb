"""Comparison figures: one summary metric over the points of a sweep, on a linear, log or rank axis."""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from ..plotting import bars, curves, plt
from .index import FIXED_COLUMNS, build_metrics, load_results

__all__ = ["SCALES", "axis_scale", "compare"]

#: ``scale`` values of :func:`compare`.
SCALES = ("auto", "linear", "log", "rank")


def _safe(s: str) -> str:
    """``s`` as a file-name part (``compare-<metric>.png``)."""
    return re.sub(r"[^\w.-]+", "_", s).strip("_")


def _swept(df: pd.DataFrame) -> list[str]:
    swept = df.attrs.get("swept")
    if swept:
        return [c for c in swept if c in df.columns]
    return [c for c in df.columns if "/" not in c and c not in FIXED_COLUMNS]


def _metric_rows(long: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The long table's rows of ``metric`` (``step/key``, or a bare ``key`` of any step).

    Raises:
        KeyError: no point has it (the message lists the metrics there are).
    """
    step, _, key = metric.rpartition("/")
    mask = long["metric"] == key
    if step:
        mask &= long["step"] == step
    hit = cast(pd.DataFrame, long[mask])
    if hit.empty or not bool(hit["value"].notna().any()):
        have = sorted({f"{s}/{m}" for s, m in zip(long["step"], long["metric"])})
        raise KeyError(f"no point has the summary metric {metric!r} (as a number); metrics: {have[:40]}")
    return hit


def axis_scale(metric: str, values, scale: str = "auto") -> str:
    """The y-axis scale of a comparison: ``rank`` (log, rank 1 on top) for a metric whose name
    says rank, ``log`` for non-negative values whose positive ones span more than two decades
    (probabilities from 1e-5 to 1; zeros, e.g. probabilities rounded to 0, are not drawn on it),
    else ``linear``; an explicit ``scale`` is returned as given.

    Args:
        metric: the metric's name (``step/key`` or ``key``).
        values: its values (NaN ignored).
        scale: ``auto`` or one of :data:`SCALES` to force.

    Returns:
        ``linear``, ``log`` or ``rank``.

    Raises:
        ValueError: an unknown ``scale``, or ``log`` / ``rank`` for values with a negative one or
            no positive one.
    """
    if scale not in SCALES:
        raise ValueError(f"scale: {scale!r} is not one of {list(SCALES)}")
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    pos = v[v > 0]
    positive = pos.size > 0 and bool((v >= 0).all())
    if scale == "auto":
        if "rank" in metric.rpartition("/")[2] and positive:
            return "rank"
        return "log" if positive and pos.max() / pos.min() > 100 else "linear"
    if scale in ("log", "rank") and not positive:
        raise ValueError(f"scale: {scale} needs non-negative values with a positive one; {metric!r} has none")
    return scale


def _apply_scale(ax, scale: str) -> None:
    if scale in ("log", "rank"):
        ax.set_yscale("log", nonpositive="mask")
    if scale == "rank":
        ax.invert_yaxis()  # rank 1 (the top token) at the top


def _curves_figure(hit: pd.DataFrame, name, metric: str, title: str | None, scale: str):
    """One curve per point (and element) over the list index of a list-valued metric."""
    n = int(np.nanmax(hit["index"].to_numpy(dtype=float))) + 1
    series: dict = {}
    for key, g in hit.groupby(["point", "element"], sort=False):
        point, element = cast(tuple, key)
        y = np.full(n, np.nan)
        y[g["index"].to_numpy(dtype=int)] = g["value"].to_numpy(dtype=float)
        if np.isfinite(y).any():
            series[name(point) + (f" {element}" if element else "")] = y
    sc = axis_scale(metric, np.concatenate(list(series.values())), scale)
    fig, ax = plt().subplots(figsize=(7, 4))
    curves(ax, np.arange(n), series)
    _apply_scale(ax, sc)
    ax.set_xlabel("index (e.g. layer / hidden state)")
    ax.set_ylabel(metric + ("" if sc == "linear" else f" ({sc} axis)"))
    ax.set_title(title or f"{metric} per point")
    fig.tight_layout()
    return fig


def _bars_figure(hit: pd.DataFrame, name, metric: str, title: str | None, scale: str):
    """One bar per point (and element) of a scalar metric."""
    vals = {name(p) + (f" {e}" if e else ""): float(v) for p, e, v in zip(hit["point"], hit["element"], hit["value"])
            if np.isfinite(v)}
    sc = axis_scale(metric, list(vals.values()), scale)
    fig = bars(vals, title=title or f"{metric} per point", ylabel=metric + ("" if sc == "linear" else f" ({sc} axis)"))
    _apply_scale(fig.axes[0], sc)
    return fig


def compare(index, metric: str, by: str | list[str] | None = None, title: str | None = None, scale: str = "auto"):
    """One metric over the points of a sweep, in one figure.

    A list-valued summary metric (``lens/target_prob_by_hidden_state`` or just ``target_prob_by_hidden_state``:
    every step with that key) is drawn as one curve per point over the list index (e.g. the lens
    curve of ' Paris' per model); a scalar one as bars. A mapping's entries (e.g. one list per
    tracked token) are separate curves.

    Args:
        index: the sweep folder (or its ``index.parquet``), or the index DataFrame.
        metric: ``step/key`` or a bare summary ``key``.
        by: the swept path(s) naming the series (default: every swept parameter).
        title: the figure title (default: ``<metric> per point``).
        scale: the y axis: ``auto`` (default: :func:`axis_scale`: rank axis for ranks, log axis for
            positive values spanning more than two decades, else linear), ``linear``, ``log`` or
            ``rank`` (log, inverted: rank 1 on top).

    Returns:
        A matplotlib figure.

    Raises:
        KeyError: no point has the metric (the message lists the summary metrics there are), or
            ``by`` names a column the index does not have.
        ValueError: an unknown scale, or a log / rank axis for values that are not all positive.
        ResultLoadError: ``index`` is a folder without a sweep index.
    """
    df = load_results(index) if isinstance(index, (str, Path)) else index
    swept = _swept(df)
    by_cols = [by] if isinstance(by, str) else (by or swept)
    for b in by_cols:
        if b not in df.columns:
            raise KeyError(f"by: {b!r} is not a column of the index; swept parameters: {swept}")
    hit = _metric_rows(build_metrics(df, swept), metric)
    names = {r["point"]: ", ".join(repr(r[b]) if isinstance(r[b], str) and r[b][:1].isspace() else str(r[b])
                                   for b in by_cols) if by_cols else f"point {r['point']}"
             for r in df.to_dict("records")}

    def name(point) -> str:
        return names.get(point, f"point {point}")

    listed = hit["index"].notna()
    if bool(listed.any()):
        return _curves_figure(cast(pd.DataFrame, hit[listed]), name, metric, title, scale)
    return _bars_figure(hit, name, metric, title, scale)
