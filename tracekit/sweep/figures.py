"""Comparison figures: one summary metric over the points of a sweep."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..plotting import bars, curves, plt
from .index import FIXED_COLUMNS, load_results

__all__ = ["compare"]

_COLUMN = re.compile(r"^(?:(?P<step>[^/]+)/)?(?P<key>.+?)(?:\[(?P<i>\d+)\])?$")


def _safe(s: str) -> str:
    """``s`` as a file-name part (``compare-<metric>.png``)."""
    return re.sub(r"[^\w.-]+", "_", s).strip("_")


def _metric_columns(step_cols: list[str], metric: str) -> dict[str, tuple[str, int | None]]:
    """The index columns holding ``metric`` (``step/key`` or a bare ``key`` of any step):
    column -> ``(step, list index or None)``.

    Raises:
        KeyError: no column holds it (the message lists the summary metrics there are).
    """
    want = metric if "/" in metric else None

    def matches(c: str) -> tuple[str, int | None] | None:
        m = _COLUMN.match(c)
        if not m or m.group("step") is None:
            return None
        if want is not None:
            if f"{m.group('step')}/{m.group('key')}" != want:
                return None
        elif m.group("key") != metric:
            return None
        return m.group("step"), (int(m.group("i")) if m.group("i") is not None else None)

    hits = {c: matches(c) for c in step_cols}
    hits = {c: h for c, h in hits.items() if h is not None}
    if not hits:
        keys = sorted({re.sub(r"\[\d+\]$", "", c) for c in step_cols})
        raise KeyError(f"no point has the summary metric {metric!r}; metrics: {keys[:40]}")
    return hits


def _series_columns(df, step_cols: list[str], by: str | list[str] | None) -> list[str]:
    """The columns naming each series: ``by``, or every swept parameter.

    Raises:
        KeyError: a ``by`` column the index does not have.
    """
    swept = [c for c in df.columns if c not in step_cols and not c.startswith("env/") and c not in FIXED_COLUMNS]
    by_cols = [by] if isinstance(by, str) else (by or swept)
    for b in by_cols:
        if b not in df.columns:
            raise KeyError(f"by: {b!r} is not a column of the index; swept parameters: {swept}")
    return by_cols


def _curves_figure(df, hits: dict, name, metric: str, title: str | None):
    """One curve per point over the list index of a list-valued metric."""
    series: dict = {}
    n = 1 + max(i for _, i in hits.values() if i is not None)
    for _, r in df.iterrows():
        y = np.full(n, np.nan)
        for c, (_, i) in hits.items():
            if i is not None and r.get(c) is not None and not (isinstance(r[c], float) and np.isnan(r[c])):
                y[i] = float(r[c])
        if np.isfinite(y).any():
            series[name(r)] = y
    fig, ax = plt().subplots(figsize=(7, 4))
    curves(ax, np.arange(n), series)
    ax.set_xlabel("index (e.g. layer / hidden state)")
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric} per point")
    fig.tight_layout()
    return fig


def _bars_figure(df, hits: dict, name, metric: str, title: str | None):
    """One bar per point of a scalar metric.

    Raises:
        ValueError: no point has a finite number for it.
    """
    vals = {}
    for _, r in df.iterrows():
        for c in hits:
            v = r.get(c)
            if v is not None and isinstance(v, (int, float, np.number)) and np.isfinite(float(v)):
                vals[name(r)] = float(v)
    if not vals:
        raise ValueError(f"{metric!r} has no numeric value in any point")
    return bars(vals, title=title or f"{metric} per point", ylabel=metric)


def compare(index, metric: str, by: str | list[str] | None = None, title: str | None = None):
    """One metric over the points of a sweep, in one figure.

    A list-valued summary metric (``lens/target_prob_by_hidden_state`` or just ``target_prob_by_hidden_state``:
    every step with that key) is drawn as one curve per point over the list index (e.g. the lens
    curve of ' Paris' per model); a scalar one as bars. ``by``: the swept path(s) naming the
    series (default: every swept parameter).

    Args:
        index: the sweep folder (or its ``index.parquet``), or the index DataFrame.

    Returns:
        A matplotlib figure.

    Raises:
        KeyError: no point has the metric (the message lists the summary metrics there are), or
            ``by`` names a column the index does not have.
        ValueError: a scalar metric with no numeric value in any point.
        ResultLoadError: ``index`` is a folder without a sweep index.
    """
    df = load_results(index) if isinstance(index, (str, Path)) else index
    step_cols = [c for c in df.columns if "/" in c and not c.startswith("env/")]
    hits = _metric_columns(step_cols, metric)
    by_cols = _series_columns(df, step_cols, by)

    def name(r) -> str:
        return ", ".join(str(r[b]) for b in by_cols) if by_cols else f"point {r['point']}"

    if any(i is not None for _, i in hits.values()):
        return _curves_figure(df, hits, name, metric, title)
    return _bars_figure(df, hits, name, metric, title)
