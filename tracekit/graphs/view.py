"""The attribution graph as one self-contained HTML page (inline CSS, SVG and script; nothing fetched).

Layout (as Neuronpedia's and circuit-tracer's graph view): x is the token position (the prompt's
tokens along the bottom), y the layer (token embeddings at the bottom, one row per block, the
output logits at the top). Nodes: features (circles, area ~ influence), error nodes (grey squares:
the transcoders' miss), token embeddings (green) and logits (orange; the target outlined). Edges:
width ~ ``|weight|`` (relative to the largest drawn), blue positive, red negative; only the kept
edges of the pruning are drawn (the strongest :data:`MAX_EDGES` when there are more).

Clicking a node (or focusing it and pressing Enter) highlights its incoming and outgoing edges,
dims the rest and shows, in the side panel, the node's facts, its strongest inputs and outputs
and, for a feature with a card (:func:`tracekit.graphs.cards.feature_cards`), the card: the
activation on the prompt, the top activating contexts with the activating token marked, and the
logit readout (top promoted / suppressed tokens of its decoder row). The side panel also holds the
verification scores, and a table below the graph the verification table, when given.

Every text (tokens may hold ``<``, ``&``, quotes, newlines) is escaped: the page's text by Jinja's
autoescape, the embedded JSON with ``<``, ``>`` and ``&`` as ``\\u`` escapes, and the script writes
text only through ``textContent``.

Source: Ameisen et al. 2025, "Circuit Tracing" (the interactive graph); circuit-tracer's
``frontend`` and Neuronpedia's graph viewer (layout and colour conventions).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, cast

import numpy as np
import pandas as pd
import torch

from ..core.errors import OutputError
from .export import process_token
from .graph import AttributionGraph
from .tables import PruneLike, graph_tables

__all__ = ["write_graph_html", "render_graph_html", "graph_layout", "MAX_EDGES", "COLORS"]

#: At most this many edges are drawn (the strongest by ``|weight|``).
MAX_EDGES = 4000
#: Node and edge colours.
COLORS = {"feature": "#7b4fb3", "error": "#8a8a8a", "token": "#2e9b3a", "logit": "#e8801b",
          "positive": "#2166ac", "negative": "#c8312b"}
_COL_W, _ROW_H, _LEFT, _TOP, _BOTTOM, _RIGHT = 110.0, 44.0, 64.0, 28.0, 36.0, 24.0


def _finite(x: Any) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def graph_layout(nodes: pd.DataFrame, n_pos: int, n_layers: int) -> dict[int, tuple[float, float]]:
    """SVG coordinates of the shown nodes: column = position, row = layer (embeddings bottom,
    logits top); the nodes of one cell side by side (logits spread leftwards from the last column).

    Args:
        nodes: rows of :func:`tracekit.graphs.tables.graph_tables`' nodes table (``node``, ``type``,
            ``layer``, ``position``, ``feature``).
        n_pos: the graph's prompt length.
        n_layers: the graph's blocks.

    Returns:
        ``{node index: (x, y)}``. Raises nothing.
    """
    out: dict[int, tuple[float, float]] = {}
    height = _TOP + (n_layers + 2) * _ROW_H
    keys = sorted({(t == "logit", int(L), int(p)) for t, L, p in zip(nodes["type"], nodes["layer"], nodes["position"])})
    for typ_logit, layer, pos in keys:
        here = ((nodes["type"].to_numpy(str) == "logit") == typ_logit) & (nodes["layer"].to_numpy() == layer) \
            & (nodes["position"].to_numpy() == pos)
        cell = _rows(nodes, here).sort_values(["type", "feature", "node"])
        row = int(layer) + 1  # embeddings (-1) -> row 0
        y = height - (row + 0.5) * _ROW_H
        cx = _LEFT + (int(pos) + 0.5) * _COL_W
        k = len(cell)
        if typ_logit:
            step = min(_COL_W * 0.9 / max(1, k - 1), 26.0) if k > 1 else 0.0
            right = cx + _COL_W * 0.35
            step = min(max(step, 14.0), (right - _LEFT - 8.0) / (k - 1)) if k > 1 else 0.0  # never left of the axis
            xs = [right - i * step for i in range(k)]
        else:
            span = _COL_W * 0.84
            step = min(span / max(1, k - 1), 16.0) if k > 1 else 0.0
            xs = [cx - step * (k - 1) / 2 + i * step for i in range(k)]
        for x, n in zip(xs, cell["node"].tolist()):
            out[int(n)] = (round(float(x), 2), round(float(y), 2))
    return out


def _rows(df: pd.DataFrame, pick: np.ndarray) -> pd.DataFrame:
    """Rows of ``df`` by a boolean mask or positional indices (a DataFrame, index reset)."""
    idx = np.nonzero(pick)[0] if pick.dtype == bool else pick
    return cast(pd.DataFrame, df.iloc[idx]).reset_index(drop=True)


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{str(k): v for k, v in r.items()} for r in df.to_dict("records")]


def _json_script(data: Any) -> str:
    """JSON safe inside ``<script type="application/json">``: ``<``, ``>``, ``&`` and the line
    separators escaped (no ``</script>`` can close it early)."""
    s = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for a, b in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        s = s.replace(a, b)
    return s


def _label(row: dict) -> str:
    t = row["type"]
    if t == "feature":
        return f"L{row['layer']} F{row['feature']} @{row['position']}"
    if t == "error":
        return f"error L{row['layer']} @{row['position']}"
    if t == "token":
        return f"embedding {process_token(row['token'])!r} @{row['position']}"
    return f"logit {process_token(row['logit_token'])!r} (p={row['logit_prob']:.3f})"


def _verification_parts(ver: Optional[dict]) -> tuple[list[tuple[str, str]], list[dict]]:
    """``(scores, tables)``: scalar entries as ``(name, value)`` (nested dicts flattened with dots),
    table-like entries (a DataFrame or a list of dicts) as ``{name, cols, rows}``."""
    scores: list[tuple[str, str]] = []
    tables: list[dict] = []

    def fmt(v: Any) -> str:
        if isinstance(v, bool) or v is None:
            return str(v)
        if isinstance(v, (int, np.integer)):
            return str(int(v))
        if isinstance(v, (float, np.floating)):
            return f"{float(v) + 0.0:.4g}"  # + 0.0: no "-0"
        return str(v)

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, pd.DataFrame):
            tables.append({"name": prefix, "cols": [str(c) for c in v.columns],
                           "rows": [[fmt(x) for x in r] for r in v.head(200).itertuples(index=False)]})
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, dict) for x in v):
            walk(prefix, pd.DataFrame(list(v)))
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            scores.append((prefix, fmt(float(v))))
        elif isinstance(v, (list, tuple)) and len(v) > 12:
            scores.append((prefix, f"[{len(v)} values]"))
        else:
            scores.append((prefix, fmt(v)))

    if ver:
        walk("", ver)
    return scores, tables


def render_graph_html(graph: AttributionGraph, prune: Optional[PruneLike] = None, *,
                      cards: Optional[dict[int, dict]] = None, verification: Optional[dict] = None,
                      title: str = "Attribution graph") -> str:
    """The page's HTML text (:func:`write_graph_html` writes it). Arguments as there.

    Raises:
        AttributionError: ``prune`` of another graph (shapes).
    """
    import jinja2
    from markupsafe import Markup

    nodes, edges = graph_tables(graph, prune, edges="kept")
    linked = set(edges["source"].tolist()) | set(edges["target"].tolist())
    show = nodes["kept"].to_numpy(bool) & (np.isin(nodes["node"].to_numpy(), list(linked))
                                            | np.isin(nodes["type"].to_numpy(str), ["token", "logit"]))
    shown = _rows(nodes, show)
    pos = graph_layout(shown, graph.n_pos, graph.n_layers)
    drawn = list(pos)
    edges = _rows(edges, np.isin(edges["source"].to_numpy(), drawn) & np.isin(edges["target"].to_numpy(), drawn))
    n_edges_kept = len(edges)
    mag = np.abs(edges["weight"].to_numpy(float))
    order = np.argsort(mag, kind="stable")[-MAX_EDGES:]  # the strongest, drawn last (on top)
    edges = _rows(edges, order)
    wmax = float(mag.max()) if len(mag) else 1.0
    cards = cards or {}
    infl = shown["influence"].to_numpy(dtype=float)
    imax = float(np.nanmax(infl)) if np.isfinite(infl).any() else 0.0
    width = _LEFT + graph.n_pos * _COL_W + _RIGHT
    height = _TOP + (graph.n_layers + 2) * _ROW_H + _BOTTOM
    svg_nodes, data_nodes = [], {}
    for r in _records(shown):
        i = int(r["node"])
        x, y = pos[i]
        inf = _finite(r["influence"])
        rad = 4.0 + (6.0 * math.sqrt(inf / imax) if (inf is not None and imax > 0 and r["type"] == "feature") else 1.0)
        svg_nodes.append({"i": i, "x": x, "y": y, "r": round(rad, 2), "type": r["type"], "label": _label(r),
                          "target": bool(r["is_target_logit"]), "card": i in cards})
        data_nodes[str(i)] = {
            "id": r["node_id"], "type": r["type"], "label": _label(r), "layer": int(r["layer"]),
            "position": int(r["position"]), "token": r["token"], "feature": int(r["feature"]),
            "activation": _finite(r["activation"]), "influence": inf,
            "cumulative": _finite(r["cumulative_influence"]), "error_norm": _finite(r["error_norm"]),
            "logit_token": r["logit_token"], "logit_prob": _finite(r["logit_prob"]),
        }
    svg_edges = []
    for s, t, w in zip(edges["source"].tolist(), edges["target"].tolist(), edges["weight"].tolist()):
        (x1, y1), (x2, y2) = pos[int(s)], pos[int(t)]
        dy = (y1 - y2) * 0.45
        d = f"M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 - dy:.1f} {x2:.1f},{y2 + dy:.1f} {x2:.1f},{y2:.1f}"
        svg_edges.append({"s": int(s), "t": int(t), "d": d, "w": round(0.4 + 3.6 * abs(w) / wmax, 2),
                          "c": COLORS["positive"] if w > 0 else COLORS["negative"]})
    data = {"nodes": data_nodes,
            "edges": [[int(s), int(t), float(w)] for s, t, w in zip(edges["source"], edges["target"], edges["weight"])],
            "cards": {str(k): v for k, v in cards.items() if k in pos}}
    axis_y = [{"label": "logits", "y": _TOP + 0.5 * _ROW_H}]
    axis_y += [{"label": f"L{L}", "y": _TOP + (graph.n_layers - L + 0.5) * _ROW_H} for L in range(graph.n_layers)]
    axis_y.append({"label": "embed", "y": _TOP + (graph.n_layers + 1.5) * _ROW_H})
    base = _TOP + (graph.n_layers + 2) * _ROW_H
    axis_x = []
    for p, t in enumerate(graph.tokens):
        shown_t = process_token(t)
        short = shown_t if len(shown_t) <= 12 else shown_t[:11] + "…"
        axis_x.append({"x": _LEFT + (p + 0.5) * _COL_W, "y": base + 18, "label": short, "full": f"{p}: {shown_t!r}"})
    ver = graph.verification if verification is None else verification
    scores, vtables = _verification_parts(ver)
    is_feat = shown["type"].to_numpy(str) == "feature"
    fi = np.nan_to_num(shown["influence"].to_numpy(float), nan=-np.inf)
    feats = _rows(shown, np.nonzero(is_feat)[0][np.argsort(-fi[is_feat], kind="stable")][:40])
    top_rows = [{"node": int(r["node"]), "id": r["node_id"], "layer": int(r["layer"]), "position": int(r["position"]),
                 "token": repr(process_token(r["token"])), "feature": int(r["feature"]),
                 "activation": f"{r['activation']:.4g}",
                 "influence": "" if _finite(r["influence"]) is None else f"{r['influence']:.4g}",
                 "clerp": str(cards.get(int(r["node"]), {}).get("clerp", ""))} for r in _records(feats)]
    env = jinja2.Environment(loader=jinja2.PackageLoader("tracekit", "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    tgt = graph.target or {}
    summary = {"prompt": repr(graph.prompt), "target": repr(tgt.get("token", "")) if tgt.get("token") is not None else "",
               "foil": repr(tgt["foil_token"]) if tgt.get("foil_token") else "", "model": str(graph.model.get("name", "")),
               "n_features": graph.n_features, "n_shown": len(shown), "n_edges": n_edges_kept,
               "n_drawn": len(svg_edges), "n_layers": graph.n_layers, "n_pos": graph.n_pos}
    return env.get_template("graph.html.j2").render(
        title=title, summary=summary, width=round(width, 1), height=round(height, 1), nodes=svg_nodes,
        edges=svg_edges, axis_x=axis_x, axis_y=axis_y, colors=COLORS, scores=scores, vtables=vtables,
        top_rows=top_rows, data_json=Markup(_json_script(data)), left=_LEFT,
        max_edges=MAX_EDGES)


def write_graph_html(graph: AttributionGraph, prune: Optional[PruneLike], path: str | Path, *,
                     cards: Optional[dict[int, dict]] = None, verification: Optional[dict] = None,
                     title: str = "Attribution graph") -> Path:
    """Write the graph page (module docstring): one self-contained HTML file.

    Args:
        graph: the attribution graph.
        prune: its pruning (``PruneResult``); None shows every node with a non-zero edge.
        path: the ``.html`` file (a folder: ``<folder>/graph.html``).
        cards: node index -> feature card (:func:`tracekit.graphs.cards.feature_cards`).
        verification: the verification dict to show (default ``graph.verification``): scalars in
            the side panel, tables (DataFrames or lists of dicts) below the graph.
        title: the page's heading.

    Returns:
        The file's path.

    Raises:
        AttributionError: ``prune`` of another graph. OutputError: the file cannot be written.
    """
    text = render_graph_html(graph, prune, cards=cards, verification=verification, title=title)
    p = Path(path).expanduser()
    out = p if p.suffix in (".html", ".htm") else p / "graph.html"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        raise OutputError(f"graph page: cannot write {out} ({e}); choose a writable folder") from e
    return out
