# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""Attention heads as experiment kinds.

* ``kind: attention_pattern`` (:class:`AttentionPattern`): for each prompt, a layer and a query
  ``position`` (an index, ``last`` or ``token:<text>``, e.g. ``"token: is"``), every head's raw
  scores and softmax weights
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

from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
from pydantic import Field, field_validator

from .. import plotting
from ..attention import (
    POSITION_FORMS,
    attention_pattern,
    check_heads,
    check_layer,
    classify_heads,
    head_scores,
    resolve_position,
)
from ..core.errors import AttentionError
from ..core.sites import hook
from ..tokens import PositionSpec, context_length, pad_ids, parse_position, run_with_cache
from .base import Experiment, Indices, OptionalPrompts, Prompts, Result, encode_prompts, register

__all__ = ["AttentionPattern", "AttentionPatternInputs", "AttentionPatternResult", "HeadScan", "HeadScanInputs",
           "HeadScanResult"]


@dataclass(frozen=True)
class AttentionPatternInputs:
    """What :meth:`AttentionPattern.prepare` builds once: the layer, the heads listed (the shown
    head first), per prompt its token ids and the query position."""

    layer: int
    heads: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]
    query_positions: tuple[int, ...]


@dataclass(frozen=True)
class HeadScanInputs:
    """What :meth:`HeadScan.prepare` builds once: the layers scanned and each prompt's token ids."""

    layers: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]

#: Retired config keys of ``attention_pattern`` and the key that replaced each.
RETIRED = {"prompt": "prompts", "query": "position; a token string is written 'token: is'"}


class AttentionPatternResult(Result):
    """Tables (one block of rows per prompt, ``prompt_idx``): ``query`` (head x key <= query
    position: score, weight), ``pattern`` (the shown head's full causal pattern), ``heads`` (label
    per head at the query position: self/first/previous mass, entropy), ``tokens``. The summary,
    report and figures show prompt 0."""

    config: "AttentionPattern"
    main_table = "query"

    def _p0(self, name: str) -> pd.DataFrame:
        t = self.tables[name]
        return t[t["prompt_idx"] == 0] if "prompt_idx" in t else t

    def summary(self) -> dict:
        q = self._p0("query")
        h = self.config.head if self.config.head is not None else int(q["head"].min())
        qh = q[q["head"] == h].sort_values("key_pos")
        by_tok: dict = {}
        for t, w in zip(qh["key_token"], qh["weight"]):
            by_tok[t] = round(by_tok.get(t, 0.0) + float(w), 6)
        top = qh.sort_values("weight", ascending=False).iloc[0]
        lab = self._p0("heads")
        out = {
            "layer": int(self.meta["layer"]), "head": int(h), "query_pos": int(qh["query_pos"].iloc[0]),
            "query_token": qh["query_token"].iloc[0], "tokens": self._p0("tokens")["token"].tolist(),
            "weights": qh["weight"].round(6).tolist(), "scores": qh["score"].round(4).tolist(),
            "weight_by_token": by_tok, "top_key": top["key_token"], "top_key_weight": round(float(top["weight"]), 6),
            "row_sum": round(float(qh["weight"].sum()), 6),
            "head_labels": {int(r.head): r.label for r in lab.itertuples()},
            "n_prompts": int(self.tables["tokens"]["prompt_idx"].nunique()) if "prompt_idx" in self.tables["tokens"] else 1,
        }
        return out

    def report(self) -> str:
        s = self.summary()
        q = self._p0("query")
        qh = q[q["head"] == s["head"]].sort_values("key_pos")
        lines = [f"attention [{self.config.step_name}] layer {s['layer']} head {s['head']}, query {s['query_token']!r} "
                 f"(position {s['query_pos']}) of prompt 0",
                 plotting.text_table([(r.key_pos, repr(r.key_token), f"{r.score:.3f}", f"{r.weight:.2%}")
                                      for r in qh.itertuples()], ["pos", "key token", "score", "weight"])]
        lab = self._p0("heads")
        lines.append(f"all heads of layer {s['layer']} at this query position (label: self / first / previous mass):")
        lines.append(plotting.text_table(
            [(r.head, r.label, f"{r.self:.2f}", f"{r.first:.2f}", f"{r.previous:.2f}", f"{r.entropy_norm:.2f}",
              f"{r.top_key!r} ({r.top_weight:.0%})") for r in lab.itertuples()],
            ["head", "label", "self", "first", "previous", "entropy", "top key"], ">><<<<<"))
        return "\n".join(lines)

    def figures(self) -> dict:
        s = self.summary()
        toks = [repr(t)[1:-1][:12] for t in s["tokens"]]
        figs = {}
        q = self._p0("query")
        qh = q[q["head"] == s["head"]].sort_values("key_pos")
        fig, ax = plotting.plt().subplots(figsize=(max(4, 0.6 * len(qh) + 2), 3.2))
        ax.bar(range(len(qh)), qh["weight"], color="tab:blue")
        for i, (w, sc) in enumerate(zip(qh["weight"], qh["score"])):
            ax.text(i, w + 0.01, f"{w:.0%}\n({sc:.2f})", ha="center", fontsize=7)
        ax.set_xticks(range(len(qh)), toks[: len(qh)], rotation=45, fontsize=8)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("attention weight (score in brackets)")
        ax.set_title(f"L{s['layer']}H{s['head']}: query {s['query_token']!r} -> keys")
        fig.tight_layout()
        figs["query_row"] = fig

        pat = self._p0("pattern")
        ph = pat[pat["head"] == s["head"]]
        n = len(s["tokens"])
        grid = np.full((n, n), np.nan)
        grid[ph["query_pos"].to_numpy(), ph["key_pos"].to_numpy()] = ph["weight"].to_numpy()
        figs["pattern"] = plotting.heatmap(grid, toks, toks, vmin=0, vmax=1, xlabel="key", ylabel="query",
                                           title=f"L{s['layer']}H{s['head']} attention weights",
                                           colorbar_label="weight")

        heads = sorted(q["head"].unique().tolist())
        grid = q.pivot(index="head", columns="key_pos", values="weight").reindex(heads).to_numpy()
        lab = self._p0("heads").set_index("head")["label"]
        figs["all_heads"] = plotting.heatmap(grid, toks[: grid.shape[1]], [f"H{h} {lab.get(h, '')}" for h in heads],
                                             vmin=0, vmax=1, xlabel="key", ylabel="head",
                                             title=f"layer {s['layer']}, query {s['query_token']!r}: every head",
                                             colorbar_label="weight")
        return figs


@register
class AttentionPattern(Experiment):
    """Attention scores and weights of a layer's heads at one query position.

    Fields:
        prompts: one text or a list (tokenized with the model's BOS setting; each gets its rows,
            the summary shows prompt 0).
        layer: block index (negative from the end).
        head: the head shown in the summary and the heatmap (default: the first of ``heads``).
        heads: heads tabulated (``all`` or a list of query-head indices).
        position: the query position (:class:`tracekit.tokens.Position`): an int (BOS counted when
            prepended; negative from the end), ``last`` (default) or ``token:<text>`` (e.g.
            ``"token: is"``: the token holding the last character of the last `` is``).
        dominance / spread_entropy: thresholds of the head labels (see
            :func:`tracekit.attention.classify_heads`).

    Retired keys: ``prompt`` (now ``prompts``), ``query`` (now ``position``).

    Raises:
        AttentionError: unknown layer/head. TokenizationError: a position not in a prompt.
    """

    kind: Literal["attention_pattern"] = "attention_pattern"
    prompts: Prompts
    layer: int
    head: Optional[int] = None
    heads: Union[Literal["all"], Indices] = "all"
    position: PositionSpec = "last"
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = AttentionPatternResult

    retired = RETIRED

    @field_validator("position")
    @classmethod
    def _position(cls, v):
        parse_position(v, POSITION_FORMS, "position")
        return v

    def prepare(self, model) -> AttentionPatternInputs:
        """Check the layer and heads, tokenize the prompts and resolve the query position in each
        (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`)."""
        layer = check_layer(model, self.layer)
        heads = check_heads(model, self.heads)
        if self.head is not None:
            check_heads(model, [self.head], "head")
            if self.head not in heads:
                heads = [self.head] + heads
        ids = encode_prompts(model, self.prompts)
        qpos = tuple(resolve_position(model, p, self.position, seq) for p, seq in zip(self.prompts, ids))
        return AttentionPatternInputs(layer, tuple(heads), ids, qpos)

    def _run(self, model, inputs: AttentionPatternInputs, progress: bool = True) -> AttentionPatternResult:
        # The engine (tracekit.attention.attention_pattern) takes the prompt string and tokenizes it
        # itself (no ids parameter yet): each prompt is tokenized once more there.
        heads = list(inputs.heads)
        show = [self.head if self.head is not None else heads[0]]
        parts: dict = {"query": [], "pattern": [], "heads": [], "tokens": []}
        qpos0, layer = None, None
        for pi, prompt in enumerate(self.prompts):
            ap = attention_pattern(model, prompt, inputs.layer)
            layer = ap.layer
            qpos = inputs.query_positions[pi]
            qpos0 = qpos if qpos0 is None else qpos0
            lab = classify_heads(ap.weights, [qpos], self.dominance, self.spread_entropy)
            lab = lab[lab["head"].isin(heads)].copy()
            row = ap.weights[:, qpos, : qpos + 1]
            lab["top_key"] = [ap.tokens[int(row[h].argmax())] for h in lab["head"]]
            lab["top_weight"] = [float(row[h].max()) for h in lab["head"]]
            parts["query"].append(ap.query_frame(qpos, heads).assign(prompt_idx=pi))
            parts["pattern"].append(ap.frame(show).assign(prompt_idx=pi))
            parts["heads"].append(lab.assign(prompt_idx=pi))
            parts["tokens"].append(pd.DataFrame({"prompt_idx": pi, "position": range(len(ap.tokens)),
                                                 "token": ap.tokens}))
        tables = {k: pd.concat(v, ignore_index=True) for k, v in parts.items()}
        return AttentionPatternResult(self, tables, {"layer": layer, "query_pos": qpos0})


class HeadScanResult(Result):
    """Tables: ``scores`` (per layer x head: prev_token_score, induction_score and TransformerLens'
    ``tl_*`` scores on repeated random tokens), ``labels`` (per prompt x layer x head, averaged over
    query positions >= 1)."""

    config: "HeadScan"
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
        sc = self.tables["scores"]
        fig, axes = plotting.plt().subplots(1, 2, figsize=(10, max(3, 0.22 * sc["layer"].nunique() + 1.5)))
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
        seq_len: random tokens per half of the repeated sequence.
        n_seqs: repeated random-token sequences the previous-token / induction scores are averaged
            over (default 4).
        seed: seed of the random tokens of the repeated sequences (default 0).
        layers: ``all`` or a list.
        prompts: optional prompts on which each head is labelled (self/first/previous/spread/content),
            averaged over query positions >= 1.
        top_k: heads listed in the summary.
        induction_threshold: induction score (attention probability, in [0, 1]; default 0.3) at or
            above which a head is counted in the summary's ``n_induction_heads``.
        dominance: head labelling on ``prompts``: a head is labelled ``self``/``first``/``previous``
            when its mean attention mass on that key is >= this (in (0, 1]; default 0.4).
        spread_entropy: head labelling: otherwise a head is ``spread`` when its normalised attention
            entropy ``H / log(q+1)`` is >= this (in (0, 1]; default 0.9), else ``content``.

    Raises:
        AttentionError: unknown layer, or sequences longer than the context.
    """

    kind: Literal["head_scan"] = "head_scan"
    seq_len: int = Field(default=40, ge=2)
    n_seqs: int = Field(default=4, ge=1)
    seed: int = 0
    layers: Union[Literal["all"], Indices] = "all"
    prompts: OptionalPrompts = Field(default_factory=list)
    top_k: int = Field(default=5, ge=1)
    induction_threshold: float = Field(default=0.3, ge=0, le=1)
    dominance: float = Field(default=0.4, gt=0, le=1)
    spread_entropy: float = Field(default=0.9, gt=0, le=1)

    result_class = HeadScanResult

    def _layers(self, model):
        if self.layers == "all":
            return list(range(int(model.cfg.n_layers)))
        return [check_layer(model, L, f"layers[{i}]") for i, L in enumerate(self.layers)]

    def prepare(self, model) -> HeadScanInputs:
        """Check the layers and the sequence length against the context, tokenize the prompts
        (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`)."""
        layers = tuple(self._layers(model))
        n_ctx = context_length(model)
        if n_ctx is not None and 2 * self.seq_len + 1 > n_ctx:
            raise AttentionError(f"seq_len: 2 x {self.seq_len} + 1 tokens exceed the model's context of {n_ctx}; "
                                 "lower seq_len")
        return HeadScanInputs(layers, encode_prompts(model, self.prompts))

    def _run(self, model, inputs: HeadScanInputs, progress: bool = True) -> HeadScanResult:
        layers = list(inputs.layers)
        tables = {"scores": head_scores(model, self.seq_len, self.n_seqs, self.seed, layers)}
        if self.prompts:
            rows = []
            for pi, ids in enumerate(inputs.ids):
                batch = pad_ids(model, [ids])  # one prompt: no padding
                _, cache = run_with_cache(model, batch, [hook("head_pattern", L) for L in layers])
                for L in layers:
                    lab = classify_heads(cache[hook("head_pattern", L)][0].float().cpu(), None,
                                         self.dominance, self.spread_entropy)
                    rows.append(lab.assign(prompt_idx=pi, layer=L))
            tables["labels"] = pd.concat(rows, ignore_index=True)
        return HeadScanResult(self, tables, {"layers": layers})
