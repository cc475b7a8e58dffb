"""The result of ``kind: token_trace`` (:class:`TokenTraceResult`): summary, figures and the
"Life of a Token" report (HTML and Markdown, section by section) rendered from the tables and meta
of :func:`tracekit.trace.token_trace` (the kind is :class:`tracekit.experiments.trace.TokenTrace`).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import pandas as pd

from .. import plotting
from ..results import round_sig
from ..tokens import show_token
from ..trace import (
    ARTICLE,
    SECTIONS,
    TRACE_RENAMES,
    TYPE_DOMINANCE,
    fig_to_data_uri,
    render_html,
    render_markdown,
    table_rows,
)
from .base import (
    MANIFEST,
    Result,
    jsonable,
)
from .typed_frames import column, records, values, where

if TYPE_CHECKING:
    from .trace import TokenTrace

__all__ = ["TokenTraceResult", "TOP_COMPONENTS", "MAX_TABLE_ROWS", "HEAD_RANK_FONT", "contexts_from"]

_HS = "hidden state (0 = embeddings, h = output of block h-1)"


#: Components drawn and listed in the DLA section (the full table is the linked CSV).
TOP_COMPONENTS = 20
#: Rows of a table shown in the report before it is cut (the rest: the linked CSV file).
MAX_TABLE_ROWS = 20
#: Font size (points) of the rank numbers of the top heads on the DLA head grid.
HEAD_RANK_FONT = 10


def _pct(x) -> str:
    return "n/a" if x is None else f"{float(x):.2%}"


def _metric(meta: dict) -> str:
    """What the attribution numbers measure: ``logit(' Paris') - logit(' Beijing')`` with a foil,
    else ``logit(' Paris')``."""
    t = f"logit({meta['target']!r})"
    return f"{t} - logit({meta['foil']!r})" if meta.get("foil") else t


def _attributed_values(meta: dict) -> dict:
    """The summary's attributed number under its own name: ``logit_diff`` / ``attributed_logit_diff``
    (``logit(target) - logit(foil)``) with a foil, ``logit`` / ``attributed_logit`` without one. The
    meta keeps ``logit`` / ``attributed`` either way (so a result saved before the rename loads and
    summarises the same)."""
    suffix = "_diff" if meta.get("foil") else ""
    return {f"logit{suffix}": meta["logit"], f"attributed_logit{suffix}": meta.get("attributed", meta["logit"])}


def _tick(tok) -> str:
    """A token as an axis label: its repr without the quotes (spaces visible), at most 10 characters."""
    shown = show_token(str(tok))
    return (shown if shown == str(tok) else shown[1:-1])[:10]


def contexts_from(meta: dict) -> str:
    """Where the FFN section's top-activating contexts come from, in words: ``"<corpus name>, N
    tokens"`` (``meta["key_corpus"]`` of :func:`tracekit.trace.token_trace`; a result saved before
    it: the offline corpus, up to ``key_max_tokens`` tokens)."""
    kc = meta.get("key_corpus")
    if not kc:
        return f"the offline stdlib corpus (Python's documentation), up to {meta.get('key_max_tokens')} tokens"
    return f"{kc['name']}, {int(kc.get('n_tokens') or 0):,} tokens"


def _component_label(c: str) -> str:
    """``attn.23`` -> ``attention L23``, ``mlp.4`` -> ``MLP L4``, ``bias`` -> ``final biases``."""
    kind, _, layer = str(c).partition(".")
    return {"attn": f"attention L{layer}", "mlp": f"MLP L{layer}"}.get(kind, {"bias": "final biases"}.get(c, c))


class TokenTraceResult(Result):
    """Result of :class:`TokenTrace`; ``html()`` / ``markdown()`` render the report."""

    renamed_columns = TRACE_RENAMES

    config: "TokenTrace"
    main_table = "lens"
    #: what ``tracekit show`` lists first (without them it listed six floats: no jump, rank or components)
    headline_keys = ("target", "target_prob", "final_target_rank", "jump_layer", "top_components", "top_neurons")

    def summary(self) -> dict:
        m = self.meta
        lens = self.tables["lens"]
        fin = self.tables["final_topk"]
        comp = self.tables["components"].sort_values("contribution", key=abs, ascending=False)
        neu = self.tables["neurons"]
        return round_sig(jsonable({
            "prompt": m["prompt"], "target": m["target"], "target_id": m["target_id"], "foil": m.get("foil"),
            "n_tokens": len(self.tables["tokens"]),
            "token_ids": self.tables["tokens"]["token_id"].tolist(),
            "target_prob": m["target_prob"], "final_target_rank": m["final_target_rank"],
            "final_top1": fin["token"].iloc[0], "final_top1_prob": float(fin["prob"].iloc[0]),
            "final_topk_mass": m["final_topk_mass"],
            "target_prob_by_hidden_state": lens["prob"].astype(float).tolist(),
            "target_rank_by_hidden_state": lens["vocab_rank"].tolist(),
            "jump_layer": m["jump_layer"], "jump": m["jump"], "emergence_hidden_state": m["emergence_hidden_state"],
            "emergence_layer": m["emergence_layer"], "metric": _metric(m), **_attributed_values(m),
            "components_sum": m["components_sum"],
            "top_components": comp["component"].head(5).tolist(),
            "ffn_layer": m["ffn_layer"], "top_neurons": [f"{r.layer}.{r.neuron}" for r in records(neu)],
            "parameters": m["cost"]["parameters"], "kv_bytes_per_token": m["cost"]["kv_bytes_per_token"],
            "decode_intensity": m["cost"]["decode_intensity"],
            "neuron_contexts_from": contexts_from(m),
        }))

    def report(self) -> str:
        s = self.summary()
        j = s["jump"] or {}
        return (f"token trace: {s['prompt']!r} -> target {s['target']!r}: p = {_pct(s['target_prob'])} "
                f"(rank {s['final_target_rank']}); lens jump at block {s['jump_layer']} "
                f"({_pct(j.get('from_prob'))} -> {_pct(j.get('to_prob'))}); emergence hidden state "
                f"{s['emergence_hidden_state']}; top components {s['top_components'][:3]}; "
                f"top neurons {s['top_neurons'][:3]}")

    # ---- figures (from tables only) --------------------------------------------------------
    def figures(self) -> dict:
        """The report's figures (matplotlib; the caller closes them), drawn from the tables and meta
        only, so a loaded result draws the same ones."""
        t = self.tables
        figs = {}
        en = t["embedding_norms"]
        figs["embedding_norms"] = plotting.bars(
            {f"{i}:{show_token(tok)}"[:18]: v for i, tok, v in zip(en["position"], en["token"], en["embed_norm"])},
            title="Token-embedding norm per position", ylabel="||W_E[token]||")
        if "head_patterns" in t and len(t["top_heads"]):
            figs["attention_heads"] = self._fig_head_patterns()
        if len(t["heads_dla"]):
            figs["heads_dla"] = self._fig_heads_grid()
        figs["head_scores"] = self._fig_head_scores()
        if len(t["neurons"]):
            figs["neurons"] = self._fig_neurons()
        figs["components"] = self._fig_components()
        figs["lens"] = self._fig_lens()
        figs["lens_grid"] = self._fig_lens_grid()
        fin = t["final_topk"]
        figs["final_topk"] = plotting.bars({show_token(a): b for a, b in zip(fin["token"], fin["prob"])},
                                           title="Final next-token distribution (top-k)", ylabel="probability")
        par = t["params"]
        figs["params"] = plotting.bars(dict(zip(par["part"], par["parameters"])), title="Parameters by part",
                                       ylabel="parameters", rotate=False)
        return figs

    def _fig_head_patterns(self):
        """Small multiples: each top head's query x key pattern, tokens on both axes."""
        plt = plotting.plt()
        hp, top = self.tables["head_patterns"], self.tables["top_heads"]
        pos = sorted(set(hp["query_pos"].tolist()) | set(hp["key_pos"].tolist()))
        tok_at = dict(zip(hp["key_pos"], hp["key_token"]))
        labels = [_tick(tok_at.get(q, "")) for q in pos]
        n, size, p0 = len(top), len(pos), pos[0]
        cols = min(3, n)
        rows = -(-n // cols)
        cell = max(3.4, min(6.0, 0.17 * size + 1.6))
        fs = 7 if size <= 16 else 5 if size <= 32 else 4
        fig, axes = plt.subplots(rows, cols, figsize=(cols * cell + 1.0, rows * cell + 0.6), squeeze=False,
                                 layout="constrained")
        im = None
        for ax, r in zip(axes.flat, records(top)):
            sub = where(hp, hp["component"] == r.component)
            g = np.full((size, size), np.nan)
            g[values(sub, "query_pos") - p0, values(sub, "key_pos") - p0] = values(sub, "weight", dtype=float)
            im = ax.imshow(g, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks(range(size), labels, rotation=90, fontsize=fs)
            ax.set_yticks(range(size), labels, fontsize=fs)
            ax.set_title(f"#{r.top_rank} {r.component} ({r.type}), DLA {r.dla:+.3f}", fontsize=9)
            ax.set_xlabel("key token", fontsize=7)
            ax.set_ylabel("query token", fontsize=7)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        if im is not None:
            fig.colorbar(im, ax=list(axes.flat), shrink=0.6, label="attention weight")
        fig.suptitle(f"Top {n} heads by |direct logit attribution| to {_metric(self.meta)}: attention patterns")
        return fig

    def _fig_heads_grid(self):
        """The all-heads summary: layers x heads grid of each head's DLA, the top heads boxed."""
        from matplotlib import patheffects
        from matplotlib.patches import Rectangle

        plt = plotting.plt()
        hd, m = self.tables["heads_dla"], self.meta
        nL, nH = int(m["n_layers"]), int(m["n_heads"])
        g = np.zeros((nH, nL))
        g[hd["head_idx"].to_numpy(), hd["layer"].to_numpy()] = hd["contribution"].to_numpy(dtype=float)
        lim = max(float(np.abs(g).max()), 1e-9)
        fig, ax = plt.subplots(figsize=(min(14.0, 3.0 + 0.32 * nL), min(9.0, 1.6 + 0.28 * nH)), layout="constrained")
        im = ax.imshow(g, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto", origin="lower", interpolation="nearest")
        step = 1 if nL <= 40 else 2
        ax.set_xticks(range(0, nL, step), [str(i) for i in range(0, nL, step)], fontsize=8)
        ax.set_yticks(range(nH), [str(i) for i in range(nH)], fontsize=8)
        for r in records(self.tables.get("top_heads", pd.DataFrame())):
            ax.add_patch(Rectangle((r.layer - 0.5, r.head_idx - 0.5), 1, 1, fill=False, ec="k", lw=1.4))
            # only the top heads are numbered, at a readable size, in the colour that contrasts with the
            # cell (white on dark, black on light; an outline of the other colour on mid tones)
            rgb = np.asarray(im.cmap(im.norm(g[r.head_idx, r.layer]))[:3])
            dark = float(rgb @ np.array([0.2126, 0.7152, 0.0722])) < 0.5
            ink, halo = ("white", "black") if dark else ("black", "white")
            ax.text(r.layer, r.head_idx, str(r.top_rank), ha="center", va="center", fontsize=HEAD_RANK_FONT,
                    fontweight="bold", color=ink, path_effects=[patheffects.withStroke(linewidth=2, foreground=halo)])
        ax.set_xlabel("layer")
        ax.set_ylabel("head")
        ax.set_title(f"Direct logit attribution of every head to {_metric(m)} (numbered boxes: the top heads)",
                     fontsize=10)
        fig.colorbar(im, ax=ax, label="logits", shrink=0.9)
        return fig

    def _fig_head_scores(self):
        plt = plotting.plt()
        hs, m = self.tables["head_scores"], self.meta
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
        lab = [_tick(x) for x in hs["key_token"]]
        sc = hs["score"].to_numpy(dtype=float)
        a1.bar(range(len(sc)), np.where(np.isfinite(sc), sc, 0.0))
        a1.set_xticks(range(len(sc)), lab, rotation=70, fontsize=7)
        a1.set_title(f"{m['head']}: raw scores (pre-softmax) of the last token")
        a2.bar(range(len(sc)), hs["weight"])
        a2.set_xticks(range(len(sc)), lab, rotation=70, fontsize=7)
        a2.set_title(f"{m['head']}: weights (softmax) of the last token")
        fig.tight_layout()
        return fig

    def _fig_neurons(self):
        plt = plotting.plt()
        neu, m = self.tables["neurons"], self.meta
        labels = [f"L{r.layer} N{r.neuron}" for r in records(neu)]
        x = np.arange(len(labels))
        fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 3.6))
        if "contribution_target" in neu:
            ax.bar(x - 0.2, neu["contribution"], 0.4, label=_metric(m), color="C0")
            ax.bar(x + 0.2, neu["contribution_target"], 0.4, label=f"logit({m['target']!r}) alone", color="C1")
            ax.legend(fontsize=8)
        else:
            ax.bar(x, neu["contribution"], color="C0")
        ax.set_xticks(x, labels, fontsize=8)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xlabel("neuron (block L, index N)")
        ax.set_ylabel("logits")
        ax.set_title(f"Top neurons of block {m['ffn_layer']}: direct contribution to {_metric(m)}", fontsize=10)
        fig.tight_layout()
        return fig

    def _fig_components(self):
        plt = plotting.plt()
        comp, m = self.tables["components"], self.meta
        top = comp.reindex(column(comp, "contribution").abs().sort_values(ascending=False).index).head(TOP_COMPONENTS)
        palette = {"embed": "C2", "attn": "C0", "mlp": "C1", "bias": "C7"}
        fig, ax = plt.subplots(figsize=(8.5, 0.3 * len(top) + 1.4))
        y = np.arange(len(top))[::-1]
        ax.barh(y, top["contribution"], color=[palette.get(k, "C7") for k in top["kind"]])
        ax.set_yticks(y, [_component_label(c) for c in top["component"]], fontsize=9)
        ax.axvline(0, color="k", lw=0.5)
        ax.set_xlabel(f"direct contribution to {_metric(m)} (logits)")
        rest = len(comp) - len(top)
        ax.set_title(f"Top {len(top)} of {len(comp)} components (all sum to {m['components_sum']:.3f}; the other "
                     f"{rest} sum to {comp['contribution'].sum() - top['contribution'].sum():+.3f})", fontsize=9)
        fig.tight_layout()
        return fig

    def _fig_lens(self):
        plt = plotting.plt()
        lens, m = self.tables["lens"], self.meta
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        x = lens["hidden_state"].tolist()
        a1.plot(x, lens["prob"], marker="o", ms=3)
        a2.plot(x, lens["vocab_rank"], marker="o", ms=3)
        a2.set_yscale("log")
        a2.invert_yaxis()
        j = m.get("jump")
        for ax in (a1, a2):
            if j:
                ax.axvspan(j["from_hidden_state"], j["to_hidden_state"], color="C3", alpha=0.15,
                           label=f"jump (block {j['layer']})")
            if m.get("emergence_hidden_state") is not None:
                ax.axvline(m["emergence_hidden_state"], color="C2", ls="--", label="emergence")
            ax.set_xlabel(_HS, fontsize=8)
            ax.grid(alpha=.3)
            ax.legend(fontsize=7)
        a1.set_ylabel(f"p({m['target']!r})")
        a1.set_ylim(-0.02, 1.02)
        a1.set_title(f"Logit lens: probability of the target {m['target']!r}")
        a2.set_ylabel("rank (1 = top)")
        a2.set_title(f"rank of the target {m['target']!r} (log scale)")
        fig.tight_layout()
        return fig

    def _fig_lens_grid(self):
        g, toks = self.tables["lens_grid"], self.tables["tokens"]["token"].tolist()
        hsx = sorted(g["hidden_state"].unique().tolist())
        pos = sorted(g["position"].unique().tolist())
        grid = np.full((len(hsx), len(pos)), np.nan)
        cells = [["" for _ in pos] for _ in hsx]
        for r in records(g):
            grid[hsx.index(r.hidden_state), pos.index(r.position)] = r.top1_prob
            cells[hsx.index(r.hidden_state)][pos.index(r.position)] = r.top1
        return plotting.heatmap(grid, [_tick(toks[p]) for p in pos], hsx, vmin=0, vmax=1, cell_text=cells,
                                title="Logit lens: top-1 next token per position (colour: its probability)",
                                xlabel="input token", ylabel=_HS)

    # ---- report ------------------------------------------------------------------------------
    def _context(self, fig_ref: dict, linked: Optional[list] = None) -> dict:
        """Template context; ``fig_ref``: figure name -> image source (data URI or file name);
        ``linked``: when given, a long table is cut to its top rows and linked as ``<name>.csv``
        (the names are appended to ``linked``; :meth:`save` writes those files), else its rest is
        named as ``result.tables[...]``."""
        t, m = self.tables, self.meta
        model = (m.get("model") or {}).get("name", "")
        art = model in ("gpt2", "gpt2-small", "openai-community/gpt2")

        def tab(title, name, max_rows=MAX_TABLE_ROWS, df=None, note="", link=None):
            full = t[name] if df is None else df
            cols, rows = table_rows(full, max_rows)
            more = None
            if len(full) > max_rows or df is not None or link:
                src = link or name
                n_all = len(t[src])
                if linked is not None:
                    linked.append(src)
                    more = {"href": f"{src}.csv", "text": f"{src}.csv ({n_all} rows)"}
                else:
                    more = {"href": None, "text": f"result.tables[{src!r}] ({n_all} rows)"}
            head = f"{title} (top {len(rows)} of {len(full)})" if len(full) > max_rows else title
            return {"title": head, "name": name, "cols": cols, "rows": rows, "more": more, "note": note}

        def fig(name, title):
            return {"name": name, "title": title, "src": fig_ref[name]} if name in fig_ref else None

        sec = {k: {"id": k, "title": v, "text": [], "tables": [], "figures": [], "article": []} for k, v in SECTIONS}
        s = self.summary()
        self._ctx_input(sec, tab, fig, art)
        self._ctx_attention(sec["attention"], tab, fig, art)
        self._ctx_attribution(sec, tab, fig)
        self._ctx_output(sec, tab, fig, art, s)
        for v in sec.values():
            v["figures"] = [f for f in v["figures"] if f]
        timings = ", ".join(f"{k} {v:.1f} s" for k, v in (m.get("timings_s") or {}).items())
        return {"title": "Life of a Token", "prompt": m["prompt"], "target": m["target"], "foil": m.get("foil"),
                "metric": _metric(m), "model": model, "summary": s, "sections": [sec[k] for k, _ in SECTIONS],
                "timings": timings}

    def _ctx_input(self, sec, tab, fig, art) -> None:
        """Sections 1-2: tokenization and embedding."""
        t, m = self.tables, self.meta
        toks = t["tokens"]
        bos = m.get("tokenization") or {}
        st = sec["tokenization"]
        st["text"].append(f"The prompt is {len(toks)} tokens. A BOS token was "
                          + (f"prepended: {bos.get('bos_token')!r} (id {bos.get('bos_token_id')})."
                             if bos.get("prepend_bos") else "not prepended.")
                          + " A leading space belongs to the token that follows it (shown in the token's repr).")
        st["tables"].append(tab("Tokens", "tokens", 64))
        if art:
            ids = ARTICLE["prompt_ids"]["The capital of France is"]
            st["article"].append(f"article (GPT-2 Small): 'The capital of France is' -> ids {ids}")
        se = sec["embedding"]
        last = toks["token"].iloc[-1]
        se["text"].append(f"Each token id selects a row of the embedding matrix W_E. Nearest tokens to {show_token(last)} by "
                          "cosine similarity of embedding rows; analogies add and subtract unit embedding vectors "
                          "and rank the expected token among all tokens except the three inputs.")
        se["figures"].append(fig("embedding_norms", "Euclidean norm of each prompt token's embedding row W_E[token]."))
        se["tables"] += [tab(f"Nearest tokens to {show_token(last)} (cosine of embedding rows)", "nearest"),
                         tab("Analogies (vocab_rank: rank of the expected token, 1 = nearest)", "analogies")]
        if art:
            se["article"].append("article: king - man + woman ~ queen; France + (Tokyo - Japan) ~ Paris in the top few")

    def _ctx_attention(self, sa, tab, fig, art) -> None:
        """Section 3: the prompt's top heads (small multiples), the all-heads grid, one head's raw scores."""
        t, m = self.tables, self.meta
        last = t["tokens"]["token"].iloc[-1]
        metric = _metric(m)
        counts = t["head_types"]["type"].value_counts().to_dict()
        kinds = ", ".join(f"{k} {v}" for k, v in counts.items())
        ht = t["head_types"]
        on = (", ".join(f"{k}: {v}" for k, v in ht["measured_on"].value_counts().to_dict().items())
              if "measured_on" in ht else "this prompt (last token)")
        top = t.get("top_heads")
        if top is not None and len(top):
            sa["text"].append(
                f"The heads that matter for this prompt, ranked by |direct logit attribution| to {metric}: what each "
                "head writes straight into that logit (difference) at the last position, through the final norm at this "
                "run's scale (section 5). Direct effects only: a head that matters through later layers ranks low here; "
                "for a causal ranking run the activation_patching kind on a clean/corrupted pair.")
            sa["figures"].append(fig("attention_heads", f"Top {len(top)} heads by |DLA| to {metric}: attention weight of "
                                     "each query token (rows) over the key tokens (columns), last "
                                     f"{m.get('pattern_window', '')} positions at most; the title gives the head's "
                                     "type (table below: what it was measured on) and its DLA (logits)."))
            sa["tables"].append(tab(f"Top heads by |DLA| to {metric}; type (measured_on: what the type was measured "
                                    f"on) and strongest key of the last token {show_token(last)}", "top_heads",
                                    link="heads_dla"))
        sa["figures"].append(fig("heads_dla", f"Every head's direct logit attribution to {metric} (logits; blue "
                                 "positive, red negative), layers x heads; numbered boxes: the top heads above."))
        why = {"given": "as configured", "article (GPT-2)": "the GPT-2 article's head",
               "top head by DLA": "the prompt's top head by |DLA|"}.get(m.get("head_source", ""), "")
        sa["text"].append(f"Head types of the last token {show_token(last)} over all heads: {kinds} (measured on {on}). "
                          "One prompt cannot tell a previous-token head from a head that seeks the token sitting "
                          "before the last one, so a head is previous-token only if it also attends the previous "
                          "token on repeated random tokens (Olsson et al. 2022: prev_token_score_random >= "
                          f"{TYPE_DOMINANCE}), else content; where the traced row has named positions, a head whose "
                          "strongest key is one is typed by it (attends SUBJ). Raw scores are shown for "
                          f"{m['head']} ({why}): pre-softmax q.k / sqrt(d_head) of the last token; the weights are "
                          "their softmax.")
        sa["figures"].append(fig("head_scores", f"{m['head']}: raw attention scores (left) and weights (right) of the "
                                 f"last token {show_token(last)} over the prompt."))
        sa["tables"].append(tab(f"{m['head']}: scores and weights of the last token", "head_scores", 64))
        if art and m["head"] == "L0H6":
            sa["article"].append("article L0H6 at ' is': scores France -5.20, capital -5.34, of -24.02; weights France "
                                 "35%, capital 35%, The 22%")

    def _ctx_attribution(self, sec, tab, fig) -> None:
        """Sections 4-6: FFN neurons, direct logit attribution, logit lens."""
        t, m = self.tables, self.meta
        metric = _metric(m)
        j = m.get("jump") or {}
        sf = sec["ffn"]
        both = ("; contribution_target is the same neuron's contribution to "
                f"logit({m['target']!r}) alone" if m.get("foil") else "")
        src = contexts_from(m)
        sf["text"].append(f"The MLP of block {m['ffn_layer']} (the lens jump block) read as key-value memory "
                          "(Geva et al. 2021): each neuron's key fires on some contexts (its top-activating contexts; "
                          f"contexts from: {src}) and its value "
                          "vector promotes tokens (value readout, Geva et al. 2022). Neurons are ranked by their direct "
                          f"contribution to {metric} (largest positive first): contribution = activation x "
                          f"logit_per_activation, both in logits of {metric}{both}.")
        sf["figures"].append(fig("neurons", f"Direct contribution of the top neurons of block {m['ffn_layer']} to "
                                 f"{metric}" + (f", beside their contribution to logit({m['target']!r}) alone."
                                                if m.get("foil") else ".")))
        sf["tables"] += [tab(f"Top neurons by direct contribution to {metric}", "neurons"),
                         tab("Top-activating contexts ([[ ]] marks the token)", "neuron_contexts",
                             note=f"contexts from: {src}")]
        sr = sec["residual"]
        comp = t["components"]
        top = ", ".join(f"{_component_label(r.component)} ({r.contribution:+.3f})" for r in
                        records(comp.reindex(column(comp, "contribution").abs().sort_values(ascending=False).index).head(5)))
        transform = m.get("output_transform", "none")
        nonlinear = transform not in ("none", "") and not str(transform).startswith("logits x")
        tail = (f"; the model's {metric} is {m['logit']:.4f}." if not nonlinear else
                f", the {metric} before the model's {transform} ({m.get('attributed', m['logit']):.4f}); after it "
                f"it is {m['logit']:.4f}.")
        sr["text"].append(f"The final residual stream is the sum of the embeddings and every attention and MLP output; "
                          f"through the final norm's scale each part contributes to {metric}. The parts sum to "
                          f"{m['components_sum']:.4f}{tail} Largest: {top}.")
        sr["figures"].append(fig("components", f"Direct logit attribution to {metric}: the {TOP_COMPONENTS} largest "
                                 "components by |contribution| (green embeddings, blue attention, orange MLP, grey "
                                 "biases); every component is in the linked table."))
        by_abs = comp.reindex(column(comp, "contribution").abs().sort_values(ascending=False).index)
        sr["tables"].append(tab(f"Components by |direct contribution| to {metric} (logits)", "components",
                                TOP_COMPONENTS, df=by_abs))
        sl = sec["lens"]
        sl["text"].append(f"Final norm + unembedding applied to every hidden state at the last position: the probability "
                          f"and rank of the target {m['target']!r} (not a difference: the lens reads the target alone). "
                          f"Jump: block {m['jump_layer']} ({_pct(j.get('from_prob'))} -> {_pct(j.get('to_prob'))}); "
                          f"emergence (top-1 from there on): hidden state {m['emergence_hidden_state']}.")
        sl["figures"] += [fig("lens", f"Logit lens at the last position: p({m['target']!r}) and its rank per hidden "
                              "state; shaded: the jump block, dashed: emergence."),
                          fig("lens_grid", "Logit lens: the top-1 next token of each hidden state (rows) at each of "
                              "the last input positions (columns); colour: its probability.")]
        sl["tables"].append(tab(f"Target {m['target']!r} per hidden state", "lens", 64))
        if m.get("model", {}).get("name", "") in ("gpt2", "gpt2-small", "openai-community/gpt2"):
            sl["article"].append("article: layer 8 is the jump: 0.55% -> 88.35% (rank 28,383 -> 1)")

    def _ctx_output(self, sec, tab, fig, art, s) -> None:
        """Sections 7-9: SAE placeholder, output and sampling, cost."""
        t, m = self.tables, self.meta
        sec["sae"]["text"].append("No SAE is configured for this trace; this section is left out.")
        so = sec["output"]
        so["text"].append(f"Final distribution: {show_token(s['final_top1'])} {_pct(s['final_top1_prob'])}; the target "
                          f"{m['target']!r} has p = {_pct(m['target_prob'])} (rank {m['final_target_rank']}); the "
                          f"top-{len(t['final_topk'])} hold {_pct(m['final_topk_mass'])}. Temperature divides the "
                          "logits; top-k keeps the k largest, top-p the smallest set reaching p; the kept tokens are "
                          "renormalised (Hugging Face logits warpers). Samples use a fixed seed.")
        so["figures"].append(fig("final_topk", "Probabilities of the final top-k next tokens."))
        so["tables"] += [tab("Final top-k", "final_topk"),
                         tab(f"Sampling settings: target_prob = p({m['target']!r}) after the warpers; top3 = the most "
                             "likely kept tokens (a setting that keeps fewer lists fewer)", "sampling")]
        if art:
            so["article"].append("article: ' Paris' 74.67%; greedy and top-k=10 both pick ' Paris' (id 6342)")
        sc = sec["cost"]
        c = m["cost"]
        ridge = (f"the device's ridge point is {c['ridge_point']:.0f} FLOP/byte, so decoding is memory-bound"
                 if c.get("ridge_point") else "the device's ridge point is not known (CPU or unlisted GPU; an A100's "
                 "is ~156 FLOP/byte)")
        tied = " (embedding and unembedding tied: counted once)" if c.get("tied_embeddings") else ""
        sc["text"].append(f"{c['parameters']:,} parameters{tied} at {c['dtype']} ({c['bytes_per_value']} bytes). "
                          f"KV cache = 2 x layers x kv_heads ({c['kv_heads']}) x d_head x bytes = "
                          f"{c['kv_bytes_per_token']:,} bytes per token. A batch-1 decode step does ~2 FLOPs per "
                          "parameter and reads every weight once: "
                          f"arithmetic intensity {c['decode_intensity']:.2f} FLOP/byte; {ridge}.")
        sc["figures"].append(fig("params", "Parameters by part of the model."))
        sc["tables"] += [tab("Parameters by part", "params"), tab("KV cache", "kv_cache")]
        if art:
            sc["article"].append("article: Llama-3.1-8B fp16: 128 KiB per token; decode ~1 FLOP/byte vs A100 "
                                 "ridge ~156")

    def _inline_figures(self) -> dict:
        return {k: fig_to_data_uri(f) for k, f in self.figures().items()}

    def html(self) -> str:
        """The self-contained HTML report (figures inline as base64 PNG; long tables cut to their top
        rows, the rest named as ``result.tables[...]``)."""
        return render_html(self._context(self._inline_figures()))

    def markdown(self, figure_files: Optional[dict] = None, linked: Optional[list] = None) -> str:
        """The Markdown report; figures are referenced as ``<name>.png`` (the files :meth:`save` writes);
        ``linked``: as in :meth:`_context` (long tables linked as CSV files)."""
        if figure_files is None:
            import matplotlib.pyplot as plt

            figs = self.figures()
            figure_files = {k: f"{k}.png" for k in figs}
            for f in figs.values():
                plt.close(f)
        return render_markdown(self._context(figure_files, linked))

    def _write(self, tmp: Path, figures: bool) -> None:
        """:meth:`Result._write` plus ``report.html`` (self-contained), ``report.md`` and the CSV file
        of every table the report cuts to its top rows (linked from both), listed in the manifest."""
        super()._write(tmp, figures)
        if figures:
            pngs = sorted(tmp.glob("*.png"))
            src = {p.stem: "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode("ascii") for p in pngs}
            files = {p.stem: p.name for p in pngs}
        else:
            src = self._inline_figures()
            files = {}
        linked: list = []
        (tmp / "report.html").write_text(render_html(self._context(src, linked)), encoding="utf-8")
        (tmp / "report.md").write_text(self.markdown(files, []), encoding="utf-8")
        for name in dict.fromkeys(linked):
            self.tables[name].to_csv(tmp / f"{name}.csv", index=False)
        man = json.loads((tmp / MANIFEST).read_text())
        man["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
        (tmp / MANIFEST).write_text(json.dumps(man, indent=2))
