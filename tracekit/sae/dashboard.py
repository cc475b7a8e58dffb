"""Feature readouts and dashboards: the tokens a feature's decoder row promotes / suppresses, the
corpus contexts it is most active on, the feature's activation on each token of the user's own
rows, the SAE's identity, and one self-contained HTML page per feature (no network, no scripts).

The page follows the layout sae-vis (McDougall 2024) and Neuronpedia (Lin & Bloom 2023) made
familiar: the feature's activations on the prompt first, then the activation density (the
prompt's read-position activations marked on it), the top-activating corpus contexts and the
decoder row read in vocabulary space. Any token text is escaped, and whitespace / control
characters are shown visibly (``\\n``, ``\\t``, ``\\x07``) so a newline never breaks a row.
"""

from __future__ import annotations

import html
import json
import math
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pandas as pd
import torch

from ..activations.chunking import forward_chunk_size, forward_row_bytes, row_slice
from ..model.info import HookedModel
from ..tokens import pad_ids, str_tokens
from ..units import top_contexts, vocab_readout
from .decompose import FeatureDecomposition, _direct_ok
from .interventions import SAEBasis
from .load import LoadedSAE, saelens_architecture
from .windows import special_token_ids

__all__ = ["activation_svg", "decoder_vocab", "feature_dashboard_html", "feature_dashboards", "prompt_activations",
           "sae_identity", "top_activating_contexts", "visible_text"]


@torch.no_grad()
def decoder_vocab(model: HookedModel, handle: LoadedSAE, features: Sequence[int], k: int = 10) -> pd.DataFrame:
    """Tokens each feature's decoder row promotes / suppresses, read through the final norm and
    unembedding at scale 1 (:func:`tracekit.units.vocab_readout` over :class:`SAEBasis`:
    :meth:`tracekit.Readout.vocab_projection`, centred over the vocabulary; logits per unit of
    activation). Only for SAEs whose decoder writes the residual stream (width d_model); else an
    empty table.

    Returns:
        rows ``feature, side (promoted|suppressed), rank, token, token_id, logit``.
    """
    cols = ["feature", "side", "rank", "token", "token_id", "logit"]
    if handle.d_in != int(model.cfg.d_model) or not _direct_ok(handle.hook):
        return pd.DataFrame(columns=cols)
    df = vocab_readout(model, SAEBasis(handle), [int(f) for f in features], k)
    return cast(pd.DataFrame, df.rename(columns={"unit": "feature", "score": "logit"})[cols])  # a column list: a DataFrame


@torch.no_grad()
def top_activating_contexts(model: HookedModel, handle: LoadedSAE, features: Sequence[int], windows: Sequence[Sequence[int]],
                            top_n: int = 5, batch_size: int = 8, before: int = 12, after: int = 3
                            ) -> tuple[pd.DataFrame, dict]:
    """The corpus tokens on which each feature is most active (padding and special tokens excluded;
    :func:`tracekit.units.top_contexts` over :class:`SAEBasis`, ties by window then position).

    Memory budget (``run.memory_budget``): each batch of ``batch_size`` windows is read in chunks of
    windows the budget allows (padded to the batch's width, so the activations, the ranking and the
    histograms do not depend on it); per window: its forward pass with logits
    (:func:`tracekit.activations.chunking.forward_row_bytes`) plus ``3 x [pos, d_sae]`` float32.

    Raises:
        MemoryBudgetError: one window does not fit the budget, before its forward pass.

    Returns:
        ``(contexts, hist)``: ``contexts`` rows ``feature, rank, activation, window, position,
        token, context`` plus ``tokens`` / ``token_acts`` (JSON lists: the context's tokens and the
        feature's activation on each, for shading); ``hist[feature]`` = activations > 0 seen
        (numpy array) for density plots.
    """
    cols = ["feature", "rank", "activation", "window", "position", "token", "context", "tokens", "token_acts"]
    feats = [int(f) for f in features]
    if not feats:
        return pd.DataFrame(columns=cols), {}
    special = torch.tensor(special_token_ids(model))
    hist: dict[int, list] = {f: [] for f in feats}
    step = max(1, batch_size)

    def batches():
        for s in range(0, len(windows), step):
            batch = pad_ids(model, [list(w) for w in windows[s:s + batch_size]])
            ok = batch.attention_mask.bool().cpu() & ~torch.isin(batch.tokens.cpu(), special)
            T = int(batch.tokens.shape[1])
            per_row = forward_row_bytes(model, T) + 3 * 4 * T * int(handle.d_sae)  # + [pos, d_sae] acts, masked
            chunk = forward_chunk_size(model, batch.size, per_row, what="SAE feature contexts",
                                       fix="lower dashboards.seq_len")
            for c in range(0, batch.size, chunk):  # rows padded to the batch's width: same activations
                sl = slice(c, min(batch.size, c + chunk))
                yield row_slice(batch, sl), list(range(s + sl.start, s + sl.stop)), ok[sl]

    def density(found, masked, valid):
        for j, f in enumerate(feats):
            col = masked[..., j]
            hist[f].append(col[col > 0].numpy())

    basis = SAEBasis(handle)
    found = top_contexts(model, [(basis, f) for f in feats], batches(), top_n=top_n, positive_only=True,
                         keep_rows=True, on_batch=density, field="features")
    rows = []
    for j, f in enumerate(feats):
        for r, (val, w, p) in enumerate(found.ranked(j)):
            ids = list(windows[w])
            lo, hi = max(0, p - before), min(len(ids), p + after + 1)
            toks = str_tokens(model, ids[lo:hi])
            col = found.rows[(j, w)]
            ctx = "".join(toks[: p - lo]) + "[[" + toks[p - lo] + "]]" + "".join(toks[p - lo + 1:])
            rows.append({"feature": f, "rank": r + 1, "activation": float(val), "window": int(w), "position": int(p),
                         "token": toks[p - lo], "context": visible_text(ctx),
                         "tokens": json.dumps(toks), "token_acts": json.dumps([round(float(x), 5) for x in col[lo:hi]])})
    df = pd.DataFrame(rows, columns=cols)
    return df, {f: (np.concatenate(v) if v else np.zeros(0)) for f, v in hist.items()}


# =============================================================================================
# text, identity, the prompt's activations

_VISIBLE = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _pieces(s: str) -> list[tuple[str, bool]]:
    """``s`` as ``(text, is_escape)`` pieces: newline / tab / carriage return and every other
    control or format character (Unicode category C*, e.g. NUL, BEL, zero-width joiner) become
    a visible escape (``\\n``, ``\\t``, ``\\x07``, ``\\u200d``)."""
    out: list[tuple[str, bool]] = []
    for ch in str(s):
        if ch in _VISIBLE:
            out.append((_VISIBLE[ch], True))
        elif unicodedata.category(ch).startswith("C"):
            out.append((f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}", True))
        elif out and not out[-1][1]:
            out[-1] = (out[-1][0] + ch, False)
        else:
            out.append((ch, False))
    return out


def visible_text(s: Any) -> str:
    """Plain text with newlines, tabs and other control characters written as visible escapes
    (``"a\\nb"`` -> ``"a\\\\nb"``): one line whatever the text holds.

    Args:
        s: any text (converted with ``str``).

    Returns:
        The text, one line.
    """
    return "".join(t for t, _ in _pieces(str(s)))


def _tok_html(s: Any) -> str:
    """HTML of a token: escaped, whitespace and control characters as visible grey escapes."""
    return "".join(f'<span class=ws>{html.escape(t)}</span>' if esc else html.escape(t) for t, esc in _pieces(str(s)))


def _esc(s: Any) -> str:
    """HTML-escaped text (quotes included), one line (control characters as visible escapes)."""
    return html.escape(visible_text(s), quote=True)


def prompt_activations(decs: Sequence[FeatureDecomposition], row_ids: Sequence[int], features: Sequence[int]
                       ) -> pd.DataFrame:
    """Each feature's activation on every token of each row (the decomposition's ``acts``, exactly).

    Args:
        decs: the rows' decompositions (:func:`tracekit.sae.decompose.feature_decompositions`).
        row_ids: each row's id, in the order of ``decs``.
        features: the features (SAE latent indices).

    Returns:
        One row per (row, feature, position): ``row_id, feature, position`` (BOS counted),
        ``token`` (decoded), ``special`` (BOS / special token), ``read`` (the row's read position),
        ``activation`` (the SAE's input units).

    Raises:
        ValueError: ``decs`` and ``row_ids`` differ in length.
    """
    cols = ["row_id", "feature", "position", "token", "special", "read", "activation"]
    if len(decs) != len(row_ids):
        raise ValueError(f"{len(decs)} decompositions but {len(row_ids)} row ids")
    recs = []
    for rid, d in zip(row_ids, decs):
        acts = d.acts.detach().float().cpu()
        for f in features:
            col = acts[:, int(f)].tolist()
            for p, v in enumerate(col):
                recs.append((int(rid), int(f), p, d.tokens[p], bool(d.special[p]), p == d.position, float(v)))
    return pd.DataFrame(recs, columns=cols)


def sae_identity(handle: LoadedSAE) -> dict:
    """What names an SAE for a reader: its source (a SAELens release and id, a SAELens directory, or
    a training by tracekit with its cache hash and training config), hook, architecture, widths and
    the model it was trained on (SAELens ``cfg.json``'s ``model_name``).

    Args:
        handle: the loaded SAE (:func:`tracekit.sae.load_sae`).

    Returns:
        A JSON-able dict: ``source`` (``release`` | ``directory`` | ``trained``), then ``release`` /
        ``id``, or ``path`` (and ``training_hash`` / ``training_config`` when the directory is a
        tracekit training), ``hook``, ``architecture``, ``d_in``, ``d_sae``, ``model_name``.
    """
    spec = handle.spec
    out: dict[str, Any] = {}
    if spec is not None and spec.release is not None:
        out.update(source="release", release=spec.release, id=spec.id)
    else:
        out.update(source="trained" if spec is not None and spec.train is not None else "directory", path=handle.path)
        stats = dict(handle.train_stats or {})
        rec = Path(handle.path) / "tracekit_train.json" if handle.path else None
        if not stats and rec is not None and rec.is_file():
            try:
                stats = json.loads(rec.read_text())
            except (OSError, ValueError):
                stats = {}
        if stats.get("key"):
            out.update(training_hash=stats["key"], training_config=stats.get("train"))
    out.update(hook=handle.hook, architecture=saelens_architecture(handle.sae),
               d_in=handle.d_in, d_sae=handle.d_sae, model_name=handle.info.model_name)
    return out


def _identity_label(identity: dict | None, sae: Any) -> str:
    """A short name of the SAE for titles (the hook is not repeated: it is in the table)."""
    if not identity:
        s = str(sae or "SAE")
        return "a trained SAE" if s.startswith("trained:") else s
    if identity.get("source") == "release":
        return f"{identity.get('release')}/{identity.get('id')}"
    if identity.get("training_hash"):
        return f"trained SAE {identity['training_hash']}"
    return f"SAE {Path(str(identity.get('path') or 'SAE')).name}"


def _identity_rows(identity: dict) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the identity table (the training config as compact JSON)."""
    names = {"source": "source", "release": "SAELens release", "id": "SAELens id", "path": "directory",
             "training_hash": "training hash (cache key)", "training_config": "training config", "hook": "hook",
             "architecture": "architecture", "d_in": "d_in", "d_sae": "d_sae (features)",
             "model_name": "trained on model"}
    rows = []
    for k, v in identity.items():
        if v is None:
            continue
        rows.append((names.get(k, k), json.dumps(v, sort_keys=True) if isinstance(v, dict) else str(v)))
    return rows


# =============================================================================================
# dashboards (self-contained HTML, no network, no scripts)


def activation_svg(values: Sequence[float] | np.ndarray, marks: Sequence[tuple[str, float]] = (), bins: int = 30,
                   width: int = 560, height: int = 190) -> str:
    """An inline SVG histogram of a feature's positive corpus activations, with vertical markers.

    Args:
        values: the activations (> 0) seen on the corpus, ``[n]``.
        marks: ``(label, activation)`` drawn as red vertical lines (e.g. each row's activation at
            its read position; 0 = inactive, drawn at the left edge).
        bins: histogram bins over ``[0, max(values, marks)]``.
        width: the figure's width in px.
        height: the figure's height in px.

    Returns:
        ``<svg>`` markup (bars ``class="bar"``, markers ``class="prompt-mark"`` with
        ``data-activation``).
    """
    vals = np.asarray(values, dtype=float)
    vals = vals[np.isfinite(vals)]
    hi = max([float(vals.max()) if len(vals) else 0.0] + [float(v) for _, v in marks if math.isfinite(v)] + [1e-9])
    counts, edges = np.histogram(vals, bins=bins, range=(0.0, hi))
    cmax = max(1, int(counts.max()) if len(counts) else 1)
    left, right, top, bottom = 48, 12, 26, 34
    pw, ph = width - left - right, height - top - bottom
    x = lambda v: left + pw * float(v) / hi  # noqa: E731 - a local scale
    parts = [f'<svg width="{width}" height="{height}" role="img" aria-label="activation density">',
             f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#444"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="#444"/>']
    for c, a, b in zip(counts, edges[:-1], edges[1:]):
        if c:
            h = ph * c / cmax
            parts.append(f'<rect class="bar" x="{x(a):.1f}" y="{top + ph - h:.1f}" width="{max(0.5, x(b) - x(a) - 0.5):.1f}" '
                         f'height="{h:.1f}" fill="#f08c00"><title>{a:.3g}-{b:.3g}: {int(c)} tokens</title></rect>')
    for j, (label, v) in enumerate(marks):
        if not math.isfinite(v):
            continue
        xv = x(max(0.0, v))
        parts.append(f'<line class="prompt-mark" data-activation="{v:.6g}" x1="{xv:.1f}" y1="{top - 4}" x2="{xv:.1f}" '
                     f'y2="{top + ph}" stroke="#c00" stroke-width="2"><title>{_esc(label)}: {v:.4g}</title></line>')
        parts.append(f'<text x="{min(xv + 3, left + pw - 60):.1f}" y="{top - 8 + 10 * (j % 2)}" font-size="10" '
                     f'fill="#c00">{_esc(label)}</text>')
    parts.append(f'<text x="{left}" y="{height - 8}" font-size="11">0</text>'
                 f'<text x="{left + pw - 40}" y="{height - 8}" font-size="11">{hi:.3g}</text>'
                 f'<text x="{left + pw / 2 - 60:.0f}" y="{height - 8}" font-size="11">activation (&gt; 0)</text>'
                 f'<text x="4" y="{top + 8}" font-size="11">{cmax}</text>'
                 f'<text x="4" y="{top + ph}" font-size="11">0</text></svg>')
    return "".join(parts)


def _strip(tokens: Sequence[str], vals: Sequence[float], mx: float, read: int | None = None) -> str:
    """Tokens shaded by activation (orange, darker = larger, on the scale ``0..mx``), each with its
    exact value in ``data-activation`` and the tooltip; the read position outlined."""
    spans = []
    for p, (t, v) in enumerate(zip(tokens, vals)):
        a = min(1.0, abs(float(v)) / mx) if mx > 0 else 0.0
        cls = ' class="tok read"' if p == read else ' class="tok"'
        spans.append(f'<span{cls} data-position="{p}" data-activation="{float(v):.6g}" title="position {p}: '
                     f'{float(v):.4g}" style="background: rgba(255,120,0,{a:.2f})">{_tok_html(t)}</span>')
    return "".join(spans)


def _prompt_section(prompts: pd.DataFrame | None, rows: pd.DataFrame | None, mx: float, max_rows: int = 20) -> str:
    """The feature's activation on every token of the user's rows (first ``max_rows``)."""
    if prompts is None or not len(prompts):
        return "<p>(no per-token activations of the rows in this result)</p>"
    out = []
    info = rows.set_index("row_id") if rows is not None and "row_id" in rows else None
    ids = list(dict.fromkeys(int(r) for r in prompts["row_id"]))
    for rid in ids[:max_rows]:
        g = _where(prompts, "row_id", rid).sort_values("position")
        read = cast(pd.DataFrame, g[g["read"].astype(bool)])  # a row mask: a DataFrame
        rp = int(read["position"].iloc[0]) if len(read) else None
        at = float(read["activation"].iloc[0]) if len(read) else float("nan")
        tgt = ""
        if info is not None and rid in info.index and "target" in info:
            t, f = info.loc[rid, "target"], info.loc[rid, "foil"] if "foil" in info else None
            tgt = f" target {_tok_html(repr(t))}" + (f" vs foil {_tok_html(repr(f))}" if f is not None and pd.notna(f) else "")
        out.append(f'<tr><td>{rid}</td><td>{at:.4g}</td><td>{tgt}</td><td class=ctx>'
                   f'{_strip(g["token"].tolist(), g["activation"].tolist(), mx, rp)}</td></tr>')
    more = f"<p>({len(ids) - max_rows} more rows in the result's <code>prompt_acts</code> table)</p>" if len(ids) > max_rows else ""
    return ("<table class=prompts><tr><th>row</th><th>activation at read position</th><th>target / foil</th>"
            "<th>tokens</th></tr>"
            + "".join(out) + "</table>" + more)


_CSS = """body{font-family:sans-serif;margin:2em;max-width:1150px}
td.ctx{font-family:monospace;white-space:pre-wrap;overflow-wrap:anywhere;word-break:break-all}
span.tok{border-right:1px solid #eee}span.read{outline:2px solid #1a5fb4}
span.ws{color:#555;font-size:85%}table{border-collapse:collapse}
td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{overflow-wrap:anywhere}.col{display:inline-block;vertical-align:top;width:45%}
code{overflow-wrap:anywhere}table.identity th{white-space:nowrap;overflow-wrap:normal}"""


def feature_dashboard_html(feature: int, title: str, stats: dict, contexts: pd.DataFrame, vocab: pd.DataFrame,
                           density_png_b64: str | None = None, *, identity: dict | None = None,
                           prompts: pd.DataFrame | None = None, rows: pd.DataFrame | None = None,
                           density_svg: str | None = None) -> str:
    """One feature's self-contained HTML page (inline CSS and SVG, no scripts, no network).

    Sections: the feature's activation on each token of the user's rows (read position outlined),
    its statistics and the SAE's identity, the activation density (``density_svg``, or an inline
    PNG), the top-activating corpus contexts, and the tokens its decoder row promotes / suppresses.
    Every text is escaped; newlines, tabs and control characters are shown as visible escapes.

    Args:
        feature: the feature index.
        title: the page title (escaped).
        stats: ``{label: value}`` rows of the statistics table.
        contexts: the feature's rows of :func:`top_activating_contexts` (``rank, activation,
            tokens, token_acts``).
        vocab: the feature's rows of :func:`decoder_vocab` (``side, rank, token, logit``).
        density_png_b64: optional base64 PNG of the density (older callers).
        identity: optional :func:`sae_identity` dict.
        prompts: optional rows of :func:`prompt_activations` for this feature.
        rows: optional rows table (``row_id``, ``target``, ``foil``) naming each row's target.
        density_svg: optional :func:`activation_svg` markup (preferred over the PNG).

    Returns:
        The page (UTF-8 text).
    """
    ctx_rows, mx = [], 1e-9
    recs = contexts.sort_values("rank").to_dict("records") if len(contexts) else []
    for r in recs:
        mx = max([mx] + [abs(float(v)) for v in json.loads(r["token_acts"])])
    if prompts is not None and len(prompts):  # special tokens (BOS) off the scale: their activation can dwarf the rest
        keep = ~prompts["special"].astype(bool) if "special" in prompts else prompts["activation"].notna()
        a = np.abs(prompts["activation"].to_numpy(dtype=float)[keep.to_numpy()])
        mx = max([mx] + ([float(a.max())] if len(a) else []))
    for r in recs:
        toks, vals = json.loads(r["tokens"]), json.loads(r["token_acts"])
        top = int(np.argmax(np.abs(vals))) if vals else None
        ctx_rows.append(f"<tr><td>{r['rank']}</td><td>{float(r['activation']):.4g}</td>"
                        f"<td class=ctx>{_strip(toks, vals, mx, top)}</td></tr>")
    voc = []
    for side in ("promoted", "suppressed"):
        v = cast(pd.DataFrame, vocab[vocab["side"] == side]).sort_values("rank") if len(vocab) else vocab  # a row mask: a DataFrame
        items = "".join(f"<li><code>{_tok_html(repr(t))}</code> {float(lg):+.3f}</li>" for t, lg in zip(v["token"], v["logit"]))
        voc.append(f"<div class=col><h3>{side}</h3><ol>{items or '<li>(not a residual-stream SAE)</li>'}</ol></div>")
    st = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in stats.items())
    ident = "".join(f"<tr><th>{_esc(k)}</th><td><code>{_esc(v)}</code></td></tr>" for k, v in _identity_rows(identity or {}))
    if density_svg:
        img = density_svg
    elif density_png_b64:
        img = f'<img alt="activation density" src="data:image/png;base64,{density_png_b64}">'
    else:
        img = ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>{_CSS}</style></head>
<body><h1>{_esc(title)}</h1>
<h2>Activation on your rows</h2><p>Each token shaded by feature {int(feature)}'s activation (orange, darker = larger;
scale 0 to {mx:.4g}, shared with the corpus contexts below; special tokens such as BOS are left off the scale); the read
position outlined in blue; hover for values.</p>
{_prompt_section(prompts, rows, mx)}
<h2>Statistics</h2><table>{st}</table>
<h2>SAE</h2><table class=identity>{ident or '<tr><td>(identity not recorded)</td></tr>'}</table>
<h2>Activation density</h2><p>Corpus tokens where the feature is active, by activation; red lines: the
rows' activations at their read positions.</p>{img}
<h2>Top-activating corpus contexts</h2><p>Token shading: this feature's activation; the top token outlined.</p>
<table><tr><th>rank</th><th>activation</th><th>context</th></tr>{''.join(ctx_rows) or '<tr><td colspan=3>never active</td></tr>'}</table>
<h2>Decoder row read in vocabulary space (logits per unit activation)</h2>{''.join(voc)}
</body></html>"""


def _r(x: Any, nd: int = 5) -> float | None:
    """``x`` rounded to ``nd`` digits; None when it is not a finite number."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return round(v, nd) if math.isfinite(v) else None


def _where(df: pd.DataFrame, col: str, value: Any) -> pd.DataFrame:
    """The rows of ``df`` whose ``col`` equals ``value``."""
    return cast(pd.DataFrame, df[df[col] == value])  # a row mask: a DataFrame


def feature_dashboards(tables: dict[str, pd.DataFrame], meta: dict) -> dict[int, str]:
    """The ``sae_features`` result's dashboards, rendered from its tables (so a loaded result
    renders them again): feature -> :func:`feature_dashboard_html` page.

    Args:
        tables: the result's tables: ``contexts``, ``vocab``, ``density``, ``features_mean``,
            ``rows`` and, when recorded, ``prompt_acts`` (:func:`prompt_activations`).
        meta: the result's meta: ``dashboard_features``, ``dashboard_tokens``, ``hook``, ``sae``,
            and, when recorded, ``sae_identity`` (:func:`sae_identity`).

    Returns:
        ``{feature: html}``; ``{}`` when the result has no ``contexts`` table.
    """
    ctx = tables.get("contexts")
    if ctx is None:
        return {}
    vocab = tables.get("vocab", pd.DataFrame(columns=["feature", "side", "top_rank", "token", "logit"]))
    dens = tables.get("density", pd.DataFrame(columns=["feature", "activation"]))
    pa = tables.get("prompt_acts")
    rows = tables.get("rows")
    fm = tables["features_mean"]
    n = int(len(rows)) if rows is not None else 0
    n_tok = int(meta.get("dashboard_tokens", 0))
    identity = meta.get("sae_identity")
    out = {}
    for f in meta.get("dashboard_features", []):
        row = _where(fm, "feature", f)
        vals = _where(dens, "feature", f)["activation"].to_numpy(dtype=float)
        mine = _where(pa, "feature", f) if pa is not None and len(pa) else None
        marks = []
        if mine is not None:
            at = mine[mine["read"].astype(bool)]
            marks = [(f"row {int(r)}", float(a)) for r, a in zip(at["row_id"].tolist(), at["activation"].tolist())][:20]
        m = row.iloc[0].to_dict() if len(row) else {}
        stats = {"hook": meta.get("hook"),
                 f"mean activation at the read position over {n} row(s)": _r(m.get("mean_activation")),
                 "mean direct contribution over rows (logits)": _r(m.get("mean_direct")),
                 "mean total attribution over rows (logits)": _r(m.get("mean_total")),
                 "rows where active": int(m.get("n_rows_active", 0)),
                 "corpus tokens scanned": n_tok,
                 "activation density (fraction of corpus tokens active)": _r(len(vals) / n_tok, 6) if n_tok else None}
        title = f"Feature {int(f)} of {_identity_label(identity, meta.get('sae'))}"
        out[int(f)] = feature_dashboard_html(
            int(f), title, stats, _where(ctx, "feature", f).rename(columns={"top_rank": "rank"}),
            _where(vocab, "feature", f).rename(columns={"top_rank": "rank"}),
            identity=identity or {"SAE": meta.get("sae"), "hook": meta.get("hook")}, prompts=mine, rows=rows,
            density_svg=activation_svg(vals, marks))
    return out
