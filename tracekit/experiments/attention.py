"""Attention heads as experiment kinds.

* ``kind: attention_pattern`` (:class:`AttentionPatterns`): for a prompt, a layer and a query
  position (index or token string, e.g. ``" is"``), every head's raw scores and softmax weights
  over the key tokens (the seed article's "Layer 0 Head 6, query ' is'" view), the full pattern of
  the chosen head as a heatmap, all heads of the layer at once, and each head's label
  (self / first / previous / spread / content) at that query.
* ``kind: head_scan`` (:class:`HeadScan`): every head of every layer: previous-token and induction
  scores on repeated random tokens (Olsson et al. 2022; TransformerLens' head-detector patterns)
  and, for given prompts, the head labels averaged over query positions.

Units: ``score`` is the pre-softmax attention score (``q.k / sqrt(d_head)``, logits of the
softmax); ``weight`` is a probability (each query row sums to 1; future keys get 0).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
from pydantic import Field

from ..heads import attention_pattern, check_heads, classify_heads, head_scores, resolve_query, _check_layer
from .base import Experiment, OptionalPrompts, Prompts, Result, register

__all__ = ["AttentionPatterns", "AttentionPatternResult", "HeadScan", "HeadScanResult"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


class AttentionPatternResult(Result):
    """Tables: ``query`` (head x key <= query: score, weight), ``pattern`` (the shown heads' full
    causal patterns), ``heads`` (label per head at the query: self/first/previous mass, entropy),
    ``tokens``."""

    main_table = "query"

    def summary(self) -> dict:
        q = self.tables["query"]
        h = self.config.head if self.config.head is not None else int(q["head"].min())
        qh = q[q["head"] == h].sort_values("key_pos")
        by_tok: dict = {}
        for t, w in zip(qh["key_token"], qh["weight"]):
            by_tok[t] = round(by_tok.get(t, 0.0) + float(w), 6)
        top = qh.sort_values("weight", ascending=False).iloc[0]
        lab = self.tables["heads"]
        return {
            "layer": int(self.meta["layer"]), "head": int(h), "query_pos": int(qh["query_pos"].iloc[0]),
            "query_token": qh["query_token"].iloc[0], "tokens": self.tables["tokens"]["token"].tolist(),
            "weights": qh["weight"].round(6).tolist(), "scores": qh["score"].round(4).tolist(),
            "weight_by_token": by_tok, "top_key": top["key_token"], "top_key_weight": round(float(top["weight"]), 6),
            "row_sum": round(float(qh["weight"].sum()), 6),
            "head_labels": {int(r.head): r.label for r in lab.itertuples()},
        }

    def report(self) -> str:
        s = self.summary()
        q = self.tables["query"]
        qh = q[q["head"] == s["head"]].sort_values("key_pos")
        lines = [f"attention [{self.config.step_name}] layer {s['layer']} head {s['head']}, query {s['query_token']!r} "
                 f"(position {s['query_pos']})", f"{'pos':>4} {'key token':>14} {'score':>9} {'weight':>8}"]
        for r in qh.itertuples():
            lines.append(f"{r.key_pos:>4} {r.key_token!r:>14} {r.score:9.3f} {r.weight:8.2%}")
        lab = self.tables["heads"]
        lines.append(f"all heads of layer {s['layer']} at this query (label: self / first / previous mass):")
        for r in lab.itertuples():
            lines.append(f"  head {r.head:>2}: {r.label:>8}  self {r.self:.2f} first {r.first:.2f} "
                         f"previous {r.previous:.2f} entropy {r.entropy_norm:.2f}  top key {r.top_key!r} ({r.top_weight:.0%})")
        return "\n".join(lines)

    def figures(self) -> dict:
        plt = _plt()
        s = self.summary()
        toks = [repr(t)[1:-1][:12] for t in s["tokens"]]
        figs = {}
        q = self.tables["query"]
        qh = q[q["head"] == s["head"]].sort_values("key_pos")
        fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(qh) + 2), 3.2))
        ax.bar(range(len(qh)), qh["weight"], color="tab:blue")
        for i, (w, sc) in enumerate(zip(qh["weight"], qh["score"])):
            ax.text(i, w + 0.01, f"{w:.0%}\n({sc:.2f})", ha="center", fontsize=7)
        ax.set_xticks(range(len(qh)), toks[: len(qh)], rotation=45, fontsize=8)
        ax.set_ylim(0, 1.1); ax.set_ylabel("attention weight (score in brackets)")
        ax.set_title(f"L{s['layer']}H{s['head']}: query {s['query_token']!r} -> keys")
        fig.tight_layout(); figs["query_row"] = fig

        pat = self.tables["pattern"]
        ph = pat[pat["head"] == s["head"]]
        n = len(s["tokens"])
        grid = np.full((n, n), np.nan)
        grid[ph["query_pos"].to_numpy(), ph["key_pos"].to_numpy()] = ph["weight"].to_numpy()
        fig, ax = plt.subplots(figsize=(max(4, 0.45 * n + 2), max(3.5, 0.45 * n + 1.5)))
        im = ax.imshow(grid, cmap="Blues", vmin=0, vmax=1)
        ax.set_xticks(range(n), toks, rotation=60, fontsize=7); ax.set_yticks(range(n), toks, fontsize=7)
        ax.set_xlabel("key"); ax.set_ylabel("query"); ax.set_title(f"L{s['layer']}H{s['head']} attention weights")
        fig.colorbar(im, ax=ax, fraction=0.04); fig.tight_layout(); figs["pattern"] = fig

        heads = sorted(q["head"].unique().tolist())
        grid = q.pivot(index="head", columns="key_pos", values="weight").reindex(heads).to_numpy()
        fig, ax = plt.subplots(figsize=(max(4, 0.5 * grid.shape[1] + 2), max(3, 0.35 * len(heads) + 1.5)))
        im = ax.imshow(grid, cmap="Blues", vmin=0, vmax=1, aspect="auto")
        lab = self.tables["heads"].set_index("head")["label"]
        ax.set_yticks(range(len(heads)), [f"H{h} {lab.get(h, '')}" for h in heads], fontsize=7)
        ax.set_xticks(range(grid.shape[1]), toks[: grid.shape[1]], rotation=60, fontsize=7)
        ax.set_title(f"layer {s['layer']}, query {s['query_token']!r}: every head")
        fig.colorbar(im, ax=ax, fraction=0.04); fig.tight_layout(); figs["all_heads"] = fig
        return figs


@register
class AttentionPatterns(Experiment):
    """Attention scores and weights of a layer's heads for one query position.

    Fields:
        prompt: the text (tokenized with the model's BOS setting).
        layer: block index.
        head: the head shown in the summary and the heatmap (default: the first of ``heads``).
        heads: heads tabulated (``all`` or a list of query-head indices).
        query: position index (BOS counts; -1 = last) or a token string such as ``" is"``
            (its last occurrence).
        dominance / spread_entropy: thresholds of the head labels (see :func:`tracekit.heads.classify_heads`).

    Raises:
        HeadError: unknown layer/head, or a query that is not in the prompt (message lists tokens).
    """

    kind: Literal["attention_pattern"] = "attention_pattern"
    prompt: str
    layer: int
    head: Optional[int] = None
    heads: Union[Literal["all"], list[int]] = "all"
    query: Union[int, str] = -1
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = AttentionPatternResult

    def check(self, model) -> None:
        from ..tokens import encode, str_tokens

        _check_layer(model, self.layer)
        check_heads(model, self.heads)
        if self.head is not None:
            check_heads(model, [self.head], "head")
        resolve_query(str_tokens(model, encode(model, self.prompt)), self.query)

    def _run(self, model, progress: bool = True) -> AttentionPatternResult:
        ap = attention_pattern(model, self.prompt, self.layer)
        heads = check_heads(model, self.heads)
        if self.head is not None and self.head not in heads:
            heads = [self.head] + heads
        qpos = resolve_query(ap.tokens, self.query)
        show = [self.head if self.head is not None else heads[0]]
        lab = classify_heads(ap.weights, [qpos], self.dominance, self.spread_entropy)
        lab = lab[lab["head"].isin(heads)].copy()
        row = ap.weights[:, qpos, : qpos + 1]
        lab["top_key"] = [ap.tokens[int(row[h].argmax())] for h in lab["head"]]
        lab["top_weight"] = [float(row[h].max()) for h in lab["head"]]
        tables = {"query": ap.query_frame(qpos, heads), "pattern": ap.frame(show), "heads": lab.reset_index(drop=True),
                  "tokens": pd.DataFrame({"position": range(len(ap.tokens)), "token": ap.tokens})}
        return AttentionPatternResult(self, tables, {"layer": ap.layer, "query_pos": qpos})


class HeadScanResult(Result):
    """Tables: ``scores`` (per layer x head: prev_token_score, induction_score and TransformerLens'
    ``tl_*`` scores on repeated random tokens), ``labels`` (per prompt x layer x head, averaged over
    query positions >= 1)."""

    main_table = "scores"

    def summary(self) -> dict:
        sc = self.tables["scores"]
        k = self.config.top_k
        ind = sc.sort_values("induction_score", ascending=False).head(k)
        prev = sc.sort_values("prev_token_score", ascending=False).head(k)
        out = {"top_induction_heads": {f"L{r.layer}H{r.head}": round(float(r.induction_score), 4) for r in ind.itertuples()},
               "top_prev_token_heads": {f"L{r.layer}H{r.head}": round(float(r.prev_token_score), 4) for r in prev.itertuples()},
               "n_induction_heads": int((sc["induction_score"] >= self.config.induction_threshold).sum()),
               "max_induction_score": round(float(sc["induction_score"].max()), 4)}
        lab = self.tables.get("labels", pd.DataFrame())
        if len(lab):
            l0 = lab[lab["prompt_idx"] == 0]
            out["label_counts"] = {k: int(v) for k, v in l0["label"].value_counts().items()}
        return out

    def report(self) -> str:
        s = self.summary()
        lines = [f"head scan [{self.config.step_name}]: repeated random tokens (seq_len {self.config.seq_len} x2, "
                 f"{self.config.n_seqs} sequences)",
                 "top induction heads: " + ", ".join(f"{k} {v:.2f}" for k, v in s["top_induction_heads"].items()),
                 "top previous-token heads: " + ", ".join(f"{k} {v:.2f}" for k, v in s["top_prev_token_heads"].items())]
        if "label_counts" in s:
            lines.append(f"labels on prompt 0: {s['label_counts']}")
        return "\n".join(lines)

    def figures(self) -> dict:
        plt = _plt()
        sc = self.tables["scores"]
        fig, axes = plt.subplots(1, 2, figsize=(10, max(3, 0.22 * sc["layer"].nunique() + 1.5)))
        for ax, col, title in ((axes[0], "prev_token_score", "previous-token score"),
                               (axes[1], "induction_score", "induction score")):
            g = sc.pivot(index="layer", columns="head", values=col).sort_index()
            im = ax.imshow(g.to_numpy(), cmap="Blues", vmin=0, vmax=1, aspect="auto", origin="lower")
            ax.set_xlabel("head"); ax.set_ylabel("layer"); ax.set_title(title)
            fig.colorbar(im, ax=ax, fraction=0.04)
        fig.tight_layout()
        return {"head_scores": fig}


@register
class HeadScan(Experiment):
    """Previous-token / induction scores of every head (Olsson et al. 2022) and head labels.

    Fields:
        seq_len: random tokens per half of the repeated sequence. n_seqs: sequences. seed.
        layers: ``all`` or a list.
        prompts: optional prompts on which each head is labelled (self/first/previous/spread/content),
            averaged over query positions >= 1.
        top_k: heads listed in the summary. induction_threshold: score counted as an induction head.

    Raises:
        HeadError: unknown layer, or sequences longer than the context.
    """

    kind: Literal["head_scan"] = "head_scan"
    seq_len: int = Field(default=40, ge=2)
    n_seqs: int = Field(default=4, ge=1)
    seed: int = 0
    layers: Union[Literal["all"], list[int]] = "all"
    prompts: OptionalPrompts = Field(default_factory=list)
    top_k: int = Field(default=5, ge=1)
    induction_threshold: float = 0.3
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = HeadScanResult

    def _layers(self, model):
        return list(range(int(model.cfg.n_layers))) if self.layers == "all" else [_check_layer(model, L, "layers") for L in self.layers]

    def check(self, model) -> None:
        self._layers(model)

    def _run(self, model, progress: bool = True) -> HeadScanResult:
        layers = self._layers(model)
        tables = {"scores": head_scores(model, self.seq_len, self.n_seqs, self.seed, layers)}
        if self.prompts:
            from ..tokens import run_with_cache, tokenize

            rows = []
            for pi, prompt in enumerate(self.prompts):
                batch = tokenize(model, [prompt])
                _, cache = run_with_cache(model, batch, [f"blocks.{L}.attn.hook_pattern" for L in layers])
                for L in layers:
                    lab = classify_heads(cache[f"blocks.{L}.attn.hook_pattern"][0].float().cpu(), None,
                                         self.dominance, self.spread_entropy)
                    rows.append(lab.assign(prompt_idx=pi, layer=L))
            tables["labels"] = pd.concat(rows, ignore_index=True)
        return HeadScanResult(self, tables, {"layers": layers})
