"""Shared presentation: every figure and console table of every kind is drawn here.

Figures are matplotlib (Agg backend, set once here, so nothing needs a display) and stay readable
at any size: heatmaps cap their tick labels, curves over many series are drawn as a median line
with a 10-90% band instead of one legend entry per series (:func:`curves`), and figure sizes are
bounded. Anchor: tuned-lens ``tuned_lens/plotting/``.

Functions return a ``Figure``; the caller (``Result.figures``) owns it and closes it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["plt", "heatmap", "curves", "bars", "text_table", "MAX_SERIES", "MAX_TICKS"]

#: Above this many series, :func:`curves` draws a median and a band instead of one line each.
MAX_SERIES = 12
#: Tick labels shown per axis at most (evenly thinned beyond).
MAX_TICKS = 60


def plt():
    """``matplotlib.pyplot`` with the Agg backend (no display needed)."""
    import matplotlib

    if matplotlib.get_backend().lower() != "agg":
        try:
            matplotlib.use("Agg", force=False)
        except Exception:  # noqa: BLE001 - a notebook's inline backend is fine too
            pass
    import matplotlib.pyplot as pyplot

    return pyplot


def _thin(n: int, k: int = MAX_TICKS) -> list[int]:
    if n <= k:
        return list(range(n))
    step = int(np.ceil(n / k))
    return list(range(0, n, step))


def heatmap(grid, x_labels: Optional[Sequence] = None, y_labels: Optional[Sequence] = None, *,
            diverging: bool = False, title: str = "", xlabel: str = "", ylabel: str = "",
            vmin: Optional[float] = None, vmax: Optional[float] = None, cmap: Optional[str] = None,
            cell_text: Optional[Sequence[Sequence[str]]] = None, colorbar_label: str = ""):
    """A 2-D heatmap (rows = y, origin at the bottom).

    Args:
        grid: ``[rows, cols]`` numbers (NaN drawn blank).
        x_labels: column tick labels (thinned to :data:`MAX_TICKS`).
        y_labels: row tick labels (thinned likewise).
        diverging: symmetric colour scale around 0 (``RdBu``), else sequential (``Blues``).
        cell_text: optional text per cell (shown when the grid is small enough to read).
    """
    p = plt()
    g = np.asarray(grid, dtype=float)
    if g.ndim != 2:
        g = g.reshape(g.shape[0], -1)
    finite = g[np.isfinite(g)]
    if diverging:
        lim = float(np.abs(finite).max()) if finite.size else 1.0
        lim = max(lim, 1e-9)
        vmin, vmax = (-lim if vmin is None else vmin), (lim if vmax is None else vmax)
    w = min(40.0, 3.5 + 0.55 * min(g.shape[1], 60))
    h = min(30.0, 2.0 + 0.25 * min(g.shape[0], 100))
    fig, ax = p.subplots(figsize=(w, h))
    im = ax.imshow(g, aspect="auto", origin="lower", cmap=cmap or ("RdBu" if diverging else "Blues"),
                   vmin=vmin, vmax=vmax, interpolation="nearest")
    if x_labels is not None:
        idx = _thin(len(x_labels))
        ax.set_xticks(idx, [str(x_labels[i]) for i in idx], rotation=70 if len(idx) > 8 else 0, fontsize=7)
    if y_labels is not None:
        idx = _thin(len(y_labels))
        ax.set_yticks(idx, [str(y_labels[i]) for i in idx], fontsize=6)
    if cell_text is not None and g.shape[0] * g.shape[1] <= 1500:
        top = vmax if vmax is not None else (finite.max() if finite.size else 1.0)
        for i in range(g.shape[0]):
            for j in range(g.shape[1]):
                txt = cell_text[i][j]
                if txt:
                    dark = np.isfinite(g[i, j]) and g[i, j] > 0.6 * top
                    ax.text(j, i, str(txt)[:10], ha="center", va="center", fontsize=6,
                            color="white" if dark else "black")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    cb = fig.colorbar(im, ax=ax, fraction=0.03)
    if colorbar_label:
        cb.set_label(colorbar_label)
    fig.tight_layout()
    return fig


def curves(ax, x, series: dict, *, marker: str = "o", band_label: str = "median, 10-90% band",
           max_series: int = MAX_SERIES) -> None:
    """Draw one line per series, or, above ``max_series`` series, their median with a 10-90% band
    (so a plot over 512 prompts stays one readable line and one legend entry).

    Args:
        ax: a matplotlib ``Axes``.
        x: shared x values.
        series: label -> y values (same length as ``x``; NaN allowed).
    """
    if len(series) <= max_series:
        for lab, y in series.items():
            ax.plot(x, y, marker=marker, ms=3, label=str(lab))
    else:
        Y = np.asarray(list(series.values()), dtype=float)
        med = np.nanmedian(Y, 0)
        lo, hi = np.nanpercentile(Y, 10, 0), np.nanpercentile(Y, 90, 0)
        ax.fill_between(x, lo, hi, alpha=0.25, label=f"{len(series)} series: 10-90%")
        ax.plot(x, med, marker=marker, ms=3, label=band_label.split(",")[0])
    ax.legend(fontsize=7)


def bars(values: dict, *, title: str = "", ylabel: str = "", xlabel: str = "", colors: Optional[dict] = None,
         rotate: bool = True):
    """A bar chart of ``label -> value`` in the given order (long label lists are thinned)."""
    p = plt()
    labels = list(values)
    vals = [float(values[k]) for k in labels]
    fig, ax = p.subplots(figsize=(min(30.0, max(6.0, 0.28 * len(labels) + 2)), 3.8))
    cols = [colors.get(k, "C0") for k in labels] if colors else None
    ax.bar(range(len(labels)), vals, color=cols)
    idx = _thin(len(labels), 80)
    ax.set_xticks(idx, [labels[i] for i in idx], rotation=70 if rotate else 0, fontsize=7)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    return fig


def text_table(rows: Sequence[Sequence], headers: Sequence[str], align: Optional[str] = None) -> str:
    """A plain-text table for console reports (``align``: one of ``<>`` per column)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ">" * len(headers)
    out = []
    for r in cells:
        out.append(" ".join(f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)))
    return "\n".join(out)
