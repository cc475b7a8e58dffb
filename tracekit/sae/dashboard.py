"""Feature readouts and dashboards: the tokens a feature's decoder row promotes / suppresses, the
corpus contexts it is most active on, and one self-contained HTML page per feature (no network)."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import cast

import numpy as np
import pandas as pd
import torch

from ..model.info import HookedModel
from ..tokens import pad_ids, str_tokens
from ..units import top_contexts, vocab_readout
from .decompose import _direct_ok
from .interventions import SAEBasis
from .load import LoadedSAE
from .windows import special_token_ids

__all__ = ["decoder_vocab", "feature_dashboard_html", "top_activating_contexts"]


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
            yield batch, list(range(s, s + batch.size)), ok

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
                         "token": toks[p - lo], "context": ctx.replace("\n", " "),
                         "tokens": json.dumps(toks), "token_acts": json.dumps([round(float(x), 5) for x in col[lo:hi]])})
    df = pd.DataFrame(rows, columns=cols)
    return df, {f: (np.concatenate(v) if v else np.zeros(0)) for f, v in hist.items()}


# =============================================================================================
# dashboards (self-contained HTML, no network)


def _esc(s) -> str:
    """HTML-escaped text, newlines kept as character references."""
    return html.escape(str(s)).replace("\n", "&#10;")


def feature_dashboard_html(feature: int, title: str, stats: dict, contexts: pd.DataFrame, vocab: pd.DataFrame,
                           density_png_b64: str | None = None) -> str:
    """One feature's self-contained HTML page (inline CSS, the density figure as an inline PNG):
    its statistics, top-activating contexts with each token shaded by the feature's activation,
    and the tokens its decoder row promotes / suppresses."""
    rows = []
    for r in contexts.sort_values("rank").to_dict("records"):
        toks = json.loads(r["tokens"])
        vals = json.loads(r["token_acts"])
        mx = max([abs(v) for v in vals] + [1e-9])
        spans = []
        for t, v in zip(toks, vals):
            a = min(1.0, abs(v) / mx)
            spans.append(f'<span title="{v:.3f}" style="background: rgba(255,120,0,{a:.2f})">{_esc(t)}</span>')
        rows.append(f"<tr><td>{r['rank']}</td><td>{r['activation']:.3f}</td><td class=ctx>{''.join(spans)}</td></tr>")
    voc = []
    for side in ("promoted", "suppressed"):
        v = cast(pd.DataFrame, vocab[vocab["side"] == side]).sort_values("rank") if len(vocab) else vocab  # a row mask: a DataFrame
        items = "".join(f"<li><code>{_esc(repr(t))}</code> {lg:+.3f}</li>" for t, lg in zip(v["token"], v["logit"]))
        voc.append(f"<div class=col><h3>{side}</h3><ol>{items or '<li>(not a residual-stream SAE)</li>'}</ol></div>")
    st = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in stats.items())
    img = f'<img alt="activation density" src="data:image/png;base64,{density_png_b64}">' if density_png_b64 else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} td.ctx{{font-family:monospace;white-space:pre-wrap}}
table{{border-collapse:collapse}} td,th{{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}}
.col{{display:inline-block;vertical-align:top;width:45%}}</style></head>
<body><h1>{_esc(title)}</h1>
<table>{st}</table>
<h2>Top-activating contexts</h2><p>Token shading: this feature's activation (darker = larger).</p>
<table><tr><th>rank</th><th>activation</th><th>context</th></tr>{''.join(rows) or '<tr><td colspan=3>never active</td></tr>'}</table>
<h2>Decoder row read in vocabulary space (logits per unit activation)</h2>{''.join(voc)}
<h2>Activation density</h2>{img}
</body></html>"""
