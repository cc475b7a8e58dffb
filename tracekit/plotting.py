"""Shared presentation: every figure and console table of every kind is drawn here.

Figures are matplotlib (Agg backend, set once here, so nothing needs a display) and stay readable
at any size: heatmaps cap their tick labels, curves over many series are drawn as a median line
with a 10-90% band instead of one legend entry per series (:func:`curves`), and figure sizes are
bounded. Series keep distinct styles beyond matplotlib's 10 default colours (:func:`series_styles`:
``tab10``, then ``tab20``, then the 20 colours again with dashed, dotted and dash-dot lines), and a
legend names a prompt by its shortened text (:func:`short_text`), not by its index. Anchor:
tuned-lens ``tuned_lens/plotting/``.

Functions return a ``Figure``; the caller (``Result.figures``) owns it and closes it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["plt", "heatmap", "paper_heatmap", "curves", "bars", "text_table", "series_styles", "short_text", "fig_to_html",
           "format_value", "html_card", "MAX_SERIES", "MAX_TICKS", "LINE_STYLES", "PAPER_DPI", "PAPER_FONT",
           "PAPER_WIDTH"]

#: Above this many series, :func:`curves` draws a median and a band instead of one line each.
MAX_SERIES = 12
#: Tick labels shown per axis at most (evenly thinned beyond).
MAX_TICKS = 60
#: Resolution (dots per inch) a :func:`paper_heatmap` asks to be saved at (its ``Figure.dpi``; a
#: saved result writes each figure at ``max(110, fig.dpi)``).
PAPER_DPI = 200
#: Smallest font size (points) of any text of a :func:`paper_heatmap` (a paper's figure text: 8-10 pt).
PAPER_FONT = 9
#: Width (inches) of a :func:`paper_heatmap`: a two-column paper's full text width (~6.5-7 in).
PAPER_WIDTH = 6.5


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


#: Line styles cycled (with the 20 ``tab20`` colours) once more than 20 series are drawn.
LINE_STYLES = ("-", "--", ":", "-.")


def series_styles(n: int) -> list[dict]:
    """``n`` distinct line styles for ``n`` series, as ``ax.plot`` keyword arguments.

    Up to 10 series: the ``tab10`` colours (matplotlib's default cycle); 11-20: the ``tab20``
    colours; beyond 20: the ``tab20`` colours again, each pass with the next of
    :data:`LINE_STYLES`, so 80 series stay distinct (colour, line style) pairs; past 80 the pairs
    repeat (a plot of that many lines is unreadable anyway: :func:`curves` draws a band instead).

    Args:
        n: number of series (>= 0).

    Returns:
        One ``{"color": (r, g, b, a), "linestyle": str}`` per series.
    """
    import matplotlib

    if n <= 10:
        cols = list(matplotlib.colormaps["tab10"].colors)  # type: ignore[attr-defined]
    else:
        cols = list(matplotlib.colormaps["tab20"].colors)  # type: ignore[attr-defined]
    out = []
    for i in range(n):
        style = LINE_STYLES[(i // len(cols)) % len(LINE_STYLES)]
        out.append({"color": tuple(cols[i % len(cols)]), "linestyle": style})
    return out


def short_text(text: str, width: int = 32) -> str:
    """A prompt shortened for a legend or tick: its last ``width`` characters (the end is where the
    prediction is read), whitespace runs collapsed, a leading ``…`` when cut.

    Args:
        text: the prompt (any string; newlines and tabs become spaces).
        width: maximum length of the result in characters (>= 4).

    Returns:
        The shortened text (``text`` itself, whitespace collapsed, when it fits).
    """
    t = " ".join(str(text).split())
    width = max(4, int(width))
    return t if len(t) <= width else "…" + t[-(width - 1):]


def fig_to_html(fig, dpi: int = 72, max_px: int = 900) -> str:
    """A figure as a self-contained ``<img>`` (base64 PNG, no external file), width capped at
    ``max_px`` CSS pixels. The figure is not closed (the caller owns it).

    Args:
        fig: a matplotlib ``Figure``.
        dpi: resolution of the PNG in dots per inch.
        max_px: the image's maximum displayed width in CSS pixels.

    Returns:
        An ``<img src="data:image/png;base64,...">`` tag.
    """
    import base64
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img style="max-width:{int(max_px)}px;width:100%" src="data:image/png;base64,{data}"/>'


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
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    cb = fig.colorbar(im, ax=ax, fraction=0.03)
    if colorbar_label:
        cb.set_label(colorbar_label)
    fig.tight_layout()  # before the cell texts: they sit inside the axes, and laying out hundreds costs seconds
    if cell_text is not None and g.shape[0] * g.shape[1] <= 1500:
        top = vmax if vmax is not None else (finite.max() if finite.size else 1.0)
        for i in range(g.shape[0]):
            for j in range(g.shape[1]):
                txt = cell_text[i][j]
                if txt:
                    dark = np.isfinite(g[i, j]) and g[i, j] > 0.6 * top
                    ax.text(j, i, str(txt)[:10], ha="center", va="center", fontsize=6,
                            color="white" if dark else "black", clip_on=True)
    return fig


def paper_heatmap(grid, x_labels: Sequence, y_labels: Sequence, *, title: str = "", xlabel: str = "",
                  ylabel: str = "", colorbar_label: str = "", cmap: str = "Purples", vmin: Optional[float] = None,
                  vmax: Optional[float] = None, width: float = PAPER_WIDTH, max_x_ticks: int = 16):
    """A heatmap sized for a paper: :data:`PAPER_WIDTH` inches wide, ~0.3 inch per row, every text
    at least :data:`PAPER_FONT` points, saved at :data:`PAPER_DPI` (``Figure.dpi``): a 6-row,
    30-column grid is ~1300 x 650 pixels with 9-10 pt (25-28 px) text, not a 20-inch strip. The
    layout of ROME's causal-tracing heatmaps (Meng et al. 2022, Fig. 1): rows = tokens or token
    categories (first row on top), columns = layers.

    Args:
        grid: ``[rows, cols]`` numbers (NaN drawn blank); row 0 is drawn on top.
        x_labels: one label per column (every ``ceil(cols / max_x_ticks)``-th shown, from the first).
        y_labels: one label per row (every row labelled; cut at 32 characters).
        title: the title (wrapped at 85 characters).
        xlabel: the x-axis label.
        ylabel: the y-axis label.
        colorbar_label: what the colour measures, with its unit.
        cmap: a matplotlib colormap name.
        vmin: the colour range's low end (default the data's minimum).
        vmax: the colour range's high end (default the data's maximum).
        width: figure width in inches.
        max_x_ticks: column labels shown at most.

    Returns:
        The ``Figure`` (``fig.dpi`` = :data:`PAPER_DPI`).
    """
    import textwrap

    p = plt()
    g = np.asarray(grid, dtype=float)
    n_rows, n_cols = g.shape
    fs = PAPER_FONT
    wrapped = textwrap.fill(title, 85) if title else ""
    n_title = wrapped.count("\n") + 1 if wrapped else 0
    height = min(11.0, 1.3 + 0.22 * n_title + 0.3 * max(n_rows, 2))
    fig, ax = p.subplots(figsize=(width, height), layout="constrained")
    fig.set_dpi(PAPER_DPI)
    im = ax.imshow(g, aspect="auto", origin="upper", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    step = max(1, int(np.ceil(n_cols / max(1, max_x_ticks))))
    xt = list(range(0, n_cols, step))
    ax.set_xticks(xt, [str(x_labels[i]) for i in xt], fontsize=fs)
    ax.set_yticks(range(n_rows), [short_text(str(y), 32) for y in y_labels], fontsize=fs)
    ax.set_xlabel(xlabel, fontsize=fs + 1)
    ax.set_ylabel(ylabel, fontsize=fs + 1)
    if wrapped:
        ax.set_title(wrapped, fontsize=fs + 1)
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.ax.tick_params(labelsize=fs)
    from matplotlib.ticker import FuncFormatter

    cb.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))  # no offset text over the title
    if colorbar_label:
        cb.set_label(colorbar_label, fontsize=fs)
    return fig


def curves(ax, x, series: dict, *, marker: str = "o", band_label: str = "median, 10-90% band",
           max_series: int = MAX_SERIES) -> None:
    """Draw one line per series, or, above ``max_series`` series, their median with a 10-90% band
    (so a plot over 512 prompts stays one readable line and one legend entry).

    Args:
        ax: a matplotlib ``Axes``.
        x: shared x values.
        series: label -> y values (same length as ``x``; NaN allowed).
        marker: the matplotlib marker of each line.
        band_label: the legend text of the median line (the part before the first comma).
        max_series: above this many series, draw the median and band instead.

    Lines take :func:`series_styles` (distinct beyond 10 series).
    """
    if len(series) <= max_series:
        for (lab, y), st in zip(series.items(), series_styles(len(series))):
            ax.plot(x, y, marker=marker, ms=3, label=str(lab), **st)
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


def format_value(v, max_items: int = 6, max_chars: int = 160) -> str:
    """A summary value as short text: numbers to 4 significant digits (``4.128e-06``, ``0.9621``),
    lists as their first ``max_items`` items and their length, dicts as ``key: value`` pairs;
    the whole cut at ``max_chars`` characters.

    Args:
        v: a JSON-able value (number, string, bool, None, list, dict; numpy scalars too).
        max_items: items of a list or dict shown before ``…``.
        max_chars: maximum length of the text.

    Returns:
        The text (``null`` for None).
    """
    if isinstance(v, bool) or v is None:
        txt = "null" if v is None else str(v).lower()
    elif isinstance(v, (int, np.integer)):
        txt = str(int(v))
    elif isinstance(v, (float, np.floating)):
        txt = f"{float(v):.4g}"
    elif isinstance(v, str):
        txt = repr(v) if (v != v.strip() or not v) else v
    elif isinstance(v, dict):
        items = [f"{k}: {format_value(x, 3, 40)}" for k, x in list(v.items())[:max_items]]
        more = f", … ({len(v)} keys)" if len(v) > max_items else ""
        txt = "{" + ", ".join(items) + more + "}"
    elif isinstance(v, (list, tuple, np.ndarray)):
        seq = list(v)
        items = [format_value(x, 3, 40) for x in seq[:max_items]]
        more = f", … ({len(seq)} items)" if len(seq) > max_items else ""
        txt = "[" + ", ".join(items) + more + "]"
    else:
        txt = str(v)
    return txt if len(txt) <= max_chars else txt[:max_chars - 1] + "…"


def html_card(title: str, rows: Sequence[tuple[str, str]], figure_html: str = "", notes: Sequence[str] = ()) -> str:
    """A small self-contained HTML block (inline styles only; no script, stylesheet or external
    file): a title, a two-column table of ``(name, value)`` rows, a figure and notes. Every text is
    HTML-escaped; ``figure_html`` is inserted as is (an ``<img>`` from :func:`fig_to_html`).

    Args:
        title: the heading.
        rows: ``(name, value text)`` pairs of the table.
        figure_html: markup of the figure, or ``""``.
        notes: lines shown under the table (escaped).

    Returns:
        The HTML (one ``<div>``).
    """
    from html import escape

    td = 'style="text-align:left;padding:1px 8px;vertical-align:top;font-family:monospace"'
    body = "".join(f"<tr><td {td}>{escape(k)}</td><td {td}>{escape(v)}</td></tr>" for k, v in rows)
    note = "".join(f'<div style="color:#555;font-size:90%">{escape(n)}</div>' for n in notes)
    return (f'<div class="tracekit-result"><div style="font-weight:bold;margin-bottom:4px">{escape(title)}</div>'
            f'<table style="border-collapse:collapse;font-size:90%">{body}</table>{note}{figure_html}</div>')
