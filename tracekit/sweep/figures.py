"""Comparison figures: one summary metric over the points of a sweep, on a linear, log or rank axis."""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from ..plotting import bars, curves, plt, series_styles
from .index import FIXED_COLUMNS, build_metrics, load_results

__all__ = ["AXIS_KEYS", "SCALES", "axis_scale", "compare", "curve_data", "metric_axis"]

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


#: Summary keys tried, in order, for the x values of a list-valued metric ``<name>_by_<axis>``
#: (``{a}`` is the axis): ``alphas`` for ``mean_target_prob_by_alpha``, ``hidden_states`` for
#: ``target_prob_by_hidden_state``, ``layers`` for ``fvu_by_layer``, ``row_id_by_row`` for rows.
AXIS_KEYS = ("{a}s", "{a}_values", "{a}_ids", "{a}_id_by_{a}")


def metric_axis(metric: str, keys) -> tuple[str, str | None]:
    """The x axis of a list-valued summary metric, by the summaries' naming convention: a key
    ``<name>_by_<axis>`` is a list aligned with the summary list named by the first of
    :data:`AXIS_KEYS` that exists (``mean_target_prob_by_alpha`` with ``alphas``,
    ``target_prob_by_hidden_state`` with ``hidden_states``).

    Args:
        metric: the summary key (``step/key`` or ``key``).
        keys: the summary keys there are (of the step holding the metric).

    Returns:
        ``(axis name, summary key of its values)``: e.g. ``("alpha", "alphas")``; the key is None
        when the summary holds no values for the axis; the name is ``""`` when the metric's key
        names no axis (no ``_by_<axis>`` suffix).
    """
    m = re.search(r"_by_([a-z0-9_]+)$", metric.rpartition("/")[2])
    if not m:
        return "", None
    axis = m.group(1)
    for pat in AXIS_KEYS:
        k = pat.format(a=axis)
        if k in keys and k != metric.rpartition("/")[2]:
            return axis, k
    return axis, None


def _axis_values(long: pd.DataFrame, point, step: str, key: str, n: int) -> list | None:
    """The values of summary list ``key`` of ``point``'s ``step`` (numbers or text), or None when
    it is not a list of ``n`` items."""
    rows = cast(pd.DataFrame, long[(long["point"] == point) & (long["step"] == step) & (long["metric"] == key)
                                   & (long["element"] == "") & long["index"].notna()])
    if len(rows) != n:
        return None
    order = np.argsort(rows["index"].to_numpy(dtype=float), kind="stable")
    vals = rows["value"].to_numpy(dtype=float)[order]
    texts = rows["text"].to_numpy(dtype=object)[order]
    return [t if v != v else float(v) for v, t in zip(vals, texts)]


def curve_data(long: pd.DataFrame, hit: pd.DataFrame, name) -> tuple[str, dict[str, tuple[list, np.ndarray]]]:
    """The x label and, per series (point and element), ``(x values, y values)`` of a list-valued
    metric: x from the summary list the metric is aligned with (:func:`metric_axis`), else the
    list position (and the label says so).

    Args:
        long: the long table of every summary key (:func:`tracekit.sweep.index.build_metrics`).
        hit: its rows of the metric.
        name: ``point -> series name``.

    Returns:
        ``(xlabel, {series name: (x values, y values)})``.
    """
    series: dict[str, tuple[list, np.ndarray]] = {}
    axes: set[tuple[str, str | None]] = set()
    for key, g in hit.groupby(["point", "step", "metric", "element"], sort=False):
        point, step, metric, element = cast(tuple, key)
        g = g.sort_values("index")
        idx = g["index"].to_numpy(dtype=int)
        y = np.full(int(idx.max()) + 1, np.nan)
        y[idx] = g["value"].to_numpy(dtype=float)
        if not np.isfinite(y).any():
            continue
        keys = set(long[(long["point"] == point) & (long["step"] == step)]["metric"])
        axis, akey = metric_axis(str(metric), keys)
        x = _axis_values(long, point, str(step), akey, len(y)) if akey else None
        axes.add((axis, akey if x is not None else None))
        series[name(point) + (f" {element}" if element else "")] = (x if x is not None else list(range(len(y))), y)
    named = {(a, k) for a, k in axes if k}
    if len(named) == 1 and len(axes) == 1:
        axis, akey = next(iter(named))
        return axis.replace("_", " "), series
    if len({a for a, _ in axes}) == 1 and next(iter(axes))[0]:
        axis = next(iter(axes))[0].replace("_", " ")
        return f"{axis}: list position (the summary has no {axis} values)", series
    return "list position (the metric names no axis)", series


def _curves_figure(long: pd.DataFrame, hit: pd.DataFrame, name, metric: str, title: str | None, scale: str):
    """One curve per point (and element) of a list-valued metric over its x axis (:func:`curve_data`)."""
    xlabel, data = curve_data(long, hit, name)
    sc = axis_scale(metric, np.concatenate([y for _, y in data.values()]), scale)
    fig, ax = plt().subplots(figsize=(7, 4))
    xs = [list(x) for x, _ in data.values()]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for x in xs for v in x)
    if numeric and all(x == xs[0] for x in xs):
        curves(ax, np.asarray(xs[0], dtype=float), {k: y for k, (_, y) in data.items()})
    elif numeric:  # points with different x values (e.g. a sweep over the alphas themselves)
        for (lab, (x, y)), st in zip(data.items(), series_styles(len(data))):
            ax.plot(np.asarray(x, dtype=float), y, marker="o", ms=3, label=str(lab), **st)
        ax.legend(fontsize=7)
    else:  # text values (keys, terms): one position each, labelled
        cats = list(dict.fromkeys(str(v) for x in xs for v in x))
        for (lab, (x, y)), st in zip(data.items(), series_styles(len(data))):
            ax.plot([cats.index(str(v)) for v in x], y, marker="o", ms=3, label=str(lab), **st)
        ax.set_xticks(range(len(cats)), cats, rotation=45 if len(cats) > 6 else 0, ha="right" if len(cats) > 6 else "center")
        ax.legend(fontsize=7)
    _apply_scale(ax, sc)
    ax.set_xlabel(xlabel)
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
    every step with that key) is drawn as one curve per point (e.g. the lens curve of ' Paris' per
    model) over the values the metric is indexed by (:func:`metric_axis`: ``alphas`` for
    ``..._by_alpha``, ``hidden_states`` for ``..._by_hidden_state``, ...; the list position, said in
    the axis label, when the summary names none); a scalar one as bars. A mapping's entries (e.g. one list per
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
    long = build_metrics(df, swept)
    hit = _metric_rows(long, metric)
    names = {r["point"]: ", ".join(repr(r[b]) if isinstance(r[b], str) and r[b][:1].isspace() else str(r[b])
                                   for b in by_cols) if by_cols else f"point {r['point']}"
             for r in df.to_dict("records")}

    def name(point) -> str:
        return names.get(point, f"point {point}")

    listed = hit["index"].notna()
    if bool(listed.any()):
        return _curves_figure(long, cast(pd.DataFrame, hit[listed]), name, metric, title, scale)
    return _bars_figure(hit, name, metric, title, scale)
