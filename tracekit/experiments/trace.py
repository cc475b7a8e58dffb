# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""``kind: token_trace`` -- the "Life of a Token" report: one prompt through every stage.

The engine is :func:`tracekit.trace.token_trace` (it calls the lens, attention, attribution and
neuron engines); this module validates the config, stores the engine's tables, and renders the
report. ``save`` writes the usual tables/figures plus ``report.html`` (self-contained: figures are
inline base64 PNGs, no network) and ``report.md``.

Tables: ``tokens``, ``embedding_norms``, ``nearest``, ``analogies``, ``attention`` (last position,
every layer x head x key), ``head_types``, ``head_scores`` (the picked head's raw scores and
weights), ``neurons``, ``neuron_values``, ``neuron_contexts``, ``components`` (direct logit
attribution, sums to the logit), ``heads_dla``, ``lens``, ``lens_grid``, ``final_topk``,
``sampling``, ``params``, ``kv_cache``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
from pydantic import Field, field_validator, model_validator

from .. import plotting
from ..core.errors import DatasetError
from ..model.load import bos_info, model_spec_of
from ..tokens import single_token_id
from ..trace import (
    ARTICLE,
    SECTIONS,
    TRACE_RENAMES,
    fig_to_data_uri,
    parse_head,
    render_html,
    render_markdown,
    table_rows,
    token_trace,
)
from .base import (
    DatasetSpec,
    Experiment,
    OptionalPrompts,
    Result,
    check_dataset_fields,
    encode_prompts,
    jsonable,
    kind_dataset,
    register,
)

__all__ = ["TokenTrace", "TokenTraceInputs", "TokenTraceResult"]

_HS = "hidden state (0 = embeddings, h = output of block h-1)"


def _pct(x) -> str:
    return "n/a" if x is None else f"{float(x):.2%}"


@dataclass(frozen=True)
class TokenTraceInputs:
    """What :meth:`TokenTrace.prepare` builds once: the prompt's token ids, the target and foil ids
    (None: the model's top-1 / no foil) and the head shown as ``(layer, head)``."""

    ids: tuple[int, ...]
    target_id: Optional[int]
    foil_id: Optional[int]
    head: tuple[int, int]
    prompt: str = ""
    target: Optional[str] = None
    foil: Optional[str] = None
    row_id: Optional[int] = None


class TokenTraceResult(Result):
    """Result of :class:`TokenTrace`; ``html()`` / ``markdown()`` render the report."""

    renamed_columns = TRACE_RENAMES

    config: "TokenTrace"
    main_table = "lens"

    def summary(self) -> dict:
        m = self.meta
        lens = self.tables["lens"]
        fin = self.tables["final_topk"]
        comp = self.tables["components"].sort_values("contribution", key=abs, ascending=False)
        neu = self.tables["neurons"]
        return jsonable({
            "prompt": m["prompt"], "target": m["target"], "target_id": m["target_id"], "foil": m.get("foil"),
            "n_tokens": len(self.tables["tokens"]),
            "token_ids": self.tables["tokens"]["token_id"].tolist(),
            "target_prob": m["target_prob"], "final_target_rank": m["final_target_rank"],
            "final_top1": fin["token"].iloc[0], "final_top1_prob": float(fin["prob"].iloc[0]),
            "final_topk_mass": m["final_topk_mass"],
            "target_prob_by_hidden_state": lens["prob"].round(6).tolist(),
            "target_rank_by_hidden_state": lens["vocab_rank"].tolist(),
            "jump_layer": m["jump_layer"], "jump": m["jump"], "emergence_hidden_state": m["emergence_hidden_state"],
            "emergence_layer": m["emergence_layer"], "logit": m["logit"], "components_sum": m["components_sum"],
            "attributed_logit": m.get("attributed", m["logit"]),
            "top_components": comp["component"].head(5).tolist(),
            "ffn_layer": m["ffn_layer"], "top_neurons": [f"{r.layer}.{r.neuron}" for r in neu.itertuples()],
            "parameters": m["cost"]["parameters"], "kv_bytes_per_token": m["cost"]["kv_bytes_per_token"],
            "decode_intensity": m["cost"]["decode_intensity"],
        })

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
        plt = plotting.plt()
        t, m = self.tables, self.meta
        figs = {}
        toks = t["tokens"]["token"].tolist()
        en = t["embedding_norms"]
        figs["embedding_norms"] = plotting.bars(
            {f"{i}:{tok!r}"[:18]: v for i, tok, v in zip(en["position"], en["token"], en["embed_norm"])},
            title="Token-embedding norm per position", ylabel="||W_E[token]||")
        att = t["attention"]
        nL, nH = int(m["n_layers"]), int(m["n_heads"])
        grid = np.zeros((nL * nH, len(toks)))
        for r in att.itertuples():
            grid[r.layer * nH + r.head_idx, r.key_pos] = r.weight
        figs["attention_last_position"] = plotting.heatmap(
            grid, [repr(x)[1:-1][:10] for x in toks], [f"L{i // nH}H{i % nH}" for i in range(nL * nH)], vmin=0, vmax=1,
            title=f"Attention of the last token {toks[-1]!r} (every layer x head)", xlabel="key token",
            ylabel="layer / head", colorbar_label="weight")
        hs = t["head_scores"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
        lab = [repr(x)[1:-1][:10] for x in hs["key_token"]]
        sc = hs["score"].to_numpy(dtype=float)
        a1.bar(range(len(sc)), np.where(np.isfinite(sc), sc, 0.0))
        a1.set_xticks(range(len(sc)), lab, rotation=70, fontsize=7)
        a1.set_title(f"{m['head']}: raw scores (pre-softmax)")
        a2.bar(range(len(sc)), hs["weight"])
        a2.set_xticks(range(len(sc)), lab, rotation=70, fontsize=7)
        a2.set_title(f"{m['head']}: weights (softmax)")
        fig.tight_layout()
        figs["head_scores"] = fig
        neu = t["neurons"]
        if len(neu):
            figs["neurons"] = plotting.bars({f"{r.layer}.{r.neuron}": r.contribution for r in neu.itertuples()},
                                            title=f"Top neurons of block {m['ffn_layer']}: direct contribution",
                                            ylabel="logits")
        comp = t["components"]
        palette = {"embed": "C2", "attn": "C0", "mlp": "C1", "bias": "C7"}
        colors = {r.component: palette[r.kind] for r in comp.itertuples()}
        figs["components"] = plotting.bars(
            dict(zip(comp["component"], comp["contribution"])), colors=colors,
            title=f"Direct logit attribution: sum {m['components_sum']:.3f} = logit {m['logit']:.3f}",
            ylabel="logit" + (" difference" if m.get("foil") else ""))
        lens = t["lens"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        x = lens["hidden_state"].tolist()
        a1.plot(x, lens["prob"], marker="o", ms=3)
        a2.plot(x, lens["vocab_rank"], marker="o", ms=3)
        a2.set_yscale("log"); a2.invert_yaxis()
        j = m.get("jump")
        for ax in (a1, a2):
            if j:
                ax.axvspan(j["from_hidden_state"], j["to_hidden_state"], color="C3", alpha=0.15,
                           label=f"jump (block {j['layer']})")
            if m.get("emergence_hidden_state") is not None:
                ax.axvline(m["emergence_hidden_state"], color="C2", ls="--", label="emergence")
            ax.set_xlabel(_HS, fontsize=8); ax.grid(alpha=.3); ax.legend(fontsize=7)
        a1.set_ylabel(f"p({m['target']!r})"); a1.set_ylim(-0.02, 1.02); a1.set_title("Logit lens: target probability")
        a2.set_ylabel("rank (1 = top)"); a2.set_title("target rank (log scale)")
        fig.tight_layout()
        figs["lens"] = fig
        g = t["lens_grid"]
        hsx = sorted(g["hidden_state"].unique().tolist())
        pos = sorted(g["position"].unique().tolist())
        grid = np.full((len(hsx), len(pos)), np.nan)
        cells = [["" for _ in pos] for _ in hsx]
        for r in g.itertuples():
            grid[hsx.index(r.hidden_state), pos.index(r.position)] = r.top1_prob
            cells[hsx.index(r.hidden_state)][pos.index(r.position)] = r.top1
        figs["lens_grid"] = plotting.heatmap(grid, [repr(toks[p])[1:-1][:10] for p in pos], hsx, vmin=0, vmax=1,
                                             cell_text=cells, title="Logit lens: top-1 next token per position",
                                             xlabel="input token", ylabel=_HS)
        fin = t["final_topk"]
        figs["final_topk"] = plotting.bars({repr(a): b for a, b in zip(fin["token"], fin["prob"])},
                                           title="Final next-token distribution (top-k)", ylabel="probability")
        par = t["params"]
        figs["params"] = plotting.bars(dict(zip(par["part"], par["parameters"])), title="Parameters by part",
                                       ylabel="parameters", rotate=False)
        return figs

    # ---- report ------------------------------------------------------------------------------
    def _context(self, fig_ref: dict) -> dict:
        # long: one flat template context, built section by section in the report's order
        """Template context; ``fig_ref``: figure name -> image source (data URI or file name)."""
        # Long (reason): the report's template context, one block per section in report order; each block reads the same tables and meta.
        t, m = self.tables, self.meta
        model = (m.get("model") or {}).get("name", "")
        art = model in ("gpt2", "gpt2-small", "openai-community/gpt2")

        def tab(title, name, max_rows=60, df=None):
            cols, rows = table_rows(t[name] if df is None else df, max_rows)
            return {"title": title, "name": name, "cols": cols, "rows": rows}

        def fig(name, title):
            return {"name": name, "title": title, "src": fig_ref[name]} if name in fig_ref else None

        toks = t["tokens"]
        bos = m.get("tokenization") or {}
        s = self.summary()
        j = m.get("jump") or {}
        comp = t["components"].sort_values("contribution", key=abs, ascending=False)
        sec = {k: {"id": k, "title": v, "text": [], "tables": [], "figures": [], "article": []} for k, v in SECTIONS}

        st = sec["tokenization"]
        st["text"].append(f"The prompt is {len(toks)} tokens. A BOS token was "
                          + (f"prepended: {bos.get('bos_token')!r} (id {bos.get('bos_token_id')})."
                             if bos.get("prepend_bos") else "not prepended.")
                          + " A leading space belongs to the token that follows it (shown in the token's repr).")
        st["tables"].append(tab("Tokens", "tokens"))
        if art:
            ids = ARTICLE["prompt_ids"]["The capital of France is"]
            st["article"].append(f"article (GPT-2 Small): 'The capital of France is' -> ids {ids}")

        se = sec["embedding"]
        last = toks["token"].iloc[-1]
        se["text"].append(f"Each token id selects a row of the embedding matrix W_E. Nearest tokens to {last!r} by "
                          "cosine similarity of embedding rows; analogies add and subtract unit embedding vectors "
                          "and rank the expected token among all tokens except the three inputs.")
        se["figures"].append(fig("embedding_norms", "Embedding norms"))
        se["tables"] += [tab(f"Nearest tokens to {last!r}", "nearest"), tab("Analogies", "analogies")]
        if art:
            se["article"].append("article: king - man + woman ~ queen; France + (Tokyo - Japan) ~ Paris in the top few")

        sa = sec["attention"]
        ht = t["head_types"]
        counts = ht["type"].value_counts().to_dict()
        kinds = ", ".join(f"{k} {v}" for k, v in counts.items())
        sa["text"].append(f"Attention of the last token {last!r} over the prompt, every layer and head. Head types "
                          f"at this position: {kinds}. Raw scores are shown for "
                          f"{m['head']} (pre-softmax, scaled by 1/sqrt(d_head); the weights are their softmax).")
        sa["text"].append("Interactive view: circuitsvis is not used (it loads its JavaScript bundle from a CDN, so "
                          "it would not work offline); the figures are static PNGs.")
        sa["figures"] += [fig("attention_last_position", "Attention, last position"), fig("head_scores", m["head"])]
        sa["tables"] += [tab(f"{m['head']}: scores and weights", "head_scores"),
                         tab("Head types (layer 0 and the jump block)", "head_types", 200,
                             ht[ht["layer"].isin([0, m["ffn_layer"]])][["layer", "head_idx", "type", "self_weight",
                                                                           "first_weight", "previous_weight",
                                                                           "entropy_norm"]])]
        if art:
            sa["article"].append("article L0H6 at ' is': scores France -5.20, capital -5.34, of -24.02; weights France "
                                 "35%, capital 35%, The 22%")

        sf = sec["ffn"]
        sf["text"].append(f"The MLP of block {m['ffn_layer']} (the lens jump block) read as key-value memory "
                          "(Geva et al. 2021): each neuron's key fires on some contexts (top-activating corpus "
                          f"contexts, first {m.get('key_max_tokens')} tokens of the offline corpus) and its value "
                          "vector promotes tokens (value readout, Geva et al. 2022). Neurons are ranked by direct "
                          "contribution to the target logit (largest positive first: the neurons that write it).")
        sf["figures"].append(fig("neurons", "Top neurons"))
        sf["tables"] += [tab("Top neurons", "neurons"), tab("Top-activating contexts", "neuron_contexts")]

        sr = sec["residual"]
        top = ", ".join(f"{r.component} ({r.contribution:+.3f})" for r in comp.head(5).itertuples())
        what = f"logit{' difference' if m.get('foil') else ''}"
        transform = m.get("output_transform", "none")
        nonlinear = transform not in ("none", "") and not str(transform).startswith("logits x")
        tail = (f"; the model's {what} is {m['logit']:.4f}." if not nonlinear else
                f", the {what} before the model's {transform} ({m.get('attributed', m['logit']):.4f}); after it "
                f"the model's {what} is {m['logit']:.4f}.")
        sr["text"].append(f"The final residual stream is the sum of the embeddings and every attention and MLP output; "
                          f"through the final norm's scale each part contributes to the logit. The parts sum to "
                          f"{m['components_sum']:.4f}{tail} Largest: {top}.")
        sr["figures"].append(fig("components", "Direct logit attribution"))
        sr["tables"].append(tab("Components", "components"))

        sl = sec["lens"]
        sl["text"].append(f"Final norm + unembedding applied to every hidden state at the last position. Jump: block "
                          f"{m['jump_layer']} ({_pct(j.get('from_prob'))} -> {_pct(j.get('to_prob'))}); emergence "
                          f"(top-1 from there on): hidden state {m['emergence_hidden_state']}.")
        sl["figures"] += [fig("lens", "Lens curve"), fig("lens_grid", "Top-1 grid")]
        sl["tables"].append(tab("Target per hidden state", "lens"))
        if art:
            sl["article"].append("article: layer 8 is the jump: 0.55% -> 88.35% (rank 28,383 -> 1)")

        sec["sae"]["text"].append("No SAE is configured for this trace; this section is left out.")

        so = sec["output"]
        so["text"].append(f"Final distribution: {s['final_top1']!r} {_pct(s['final_top1_prob'])}; the target "
                          f"{m['target']!r} has p = {_pct(m['target_prob'])} (rank {m['final_target_rank']}); the "
                          f"top-{len(t['final_topk'])} hold {_pct(m['final_topk_mass'])}. Temperature divides the "
                          "logits; top-k keeps the k largest, top-p the smallest set reaching p; the kept tokens are "
                          "renormalised (Hugging Face logits warpers). Samples use a fixed seed.")
        so["figures"].append(fig("final_topk", "Top-k"))
        so["tables"] += [tab("Final top-k", "final_topk"), tab("Sampling", "sampling")]
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
        sc["figures"].append(fig("params", "Parameters"))
        sc["tables"] += [tab("Parameters by part", "params"), tab("KV cache", "kv_cache")]
        if art:
            sc["article"].append("article: Llama-3.1-8B fp16: 128 KiB per token; decode ~1 FLOP/byte vs A100 "
                                 "ridge ~156")
        for v in sec.values():
            v["figures"] = [f for f in v["figures"] if f]
        timings = ", ".join(f"{k} {v:.1f} s" for k, v in (m.get("timings_s") or {}).items())
        return {"title": "Life of a Token", "prompt": m["prompt"], "target": m["target"], "model": model,
                "summary": s, "sections": [sec[k] for k, _ in SECTIONS], "timings": timings}

    def _inline_figures(self) -> dict:
        return {k: fig_to_data_uri(f) for k, f in self.figures().items()}

    def html(self) -> str:
        """The self-contained HTML report (figures inline as base64 PNG)."""
        return render_html(self._context(self._inline_figures()))

    def markdown(self, figure_files: Optional[dict] = None) -> str:
        """The Markdown report; figures are referenced as ``<name>.png`` (the files :meth:`save` writes)."""
        if figure_files is None:
            import matplotlib.pyplot as plt

            figs = self.figures()
            figure_files = {k: f"{k}.png" for k in figs}
            for f in figs.values():
                plt.close(f)
        return render_markdown(self._context(figure_files))

    def save(self, directory, figures: bool = True) -> Path:
        """:meth:`Result.save` plus ``report.html`` (self-contained) and ``report.md`` in the same folder."""
        d = super().save(directory, figures=figures)
        if figures:
            pngs = sorted(d.glob("*.png"))
            src = {p.stem: "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode("ascii") for p in pngs}
            files = {p.stem: p.name for p in pngs}
        else:
            src = self._inline_figures()
            files = {}
        (d / "report.html").write_text(render_html(self._context(src)), encoding="utf-8")
        (d / "report.md").write_text(self.markdown(files), encoding="utf-8")
        return d


@register
class TokenTrace(Experiment):
    """The "Life of a Token" trace of one prompt: every stage in one report.

    Engine: :func:`tracekit.trace.token_trace`.

    Fields:
        prompts: the text traced (one prompt; a string or a list of one); or
        dataset / row: a dataset (:mod:`tracekit.dataset`) and the index of the row traced (default 0,
            after ``filter``): its prompt, its own target and foil.
        target: the next token followed (exactly one token, leading space included); default: the
            model's top-1 prediction.
        foil: optional second token; the attribution splits ``logit[target] - logit[foil]``.
        head: head whose raw scores are shown, ``"L0H6"`` (default when it exists, else ``"L0H0"``).
        top_neurons, value_tokens, key_contexts, key_max_tokens: FFN section sizes (``key_max_tokens``
            0 skips the corpus key readout).
        top_k: final tokens listed; seed, n_samples: sampling draws.
    """

    kind: Literal["token_trace"] = "token_trace"
    prompts: OptionalPrompts = Field(default_factory=list, description="The text traced through the model: one prompt (a string, or a list "
                             "of one; sweep it to trace several).")
    target: Optional[str] = Field(default=None, description="Next token followed (one token, leading space "
                                  "included); default: the model's top-1 prediction.")
    foil: Optional[str] = Field(default=None, description="Optional second token: attribution of "
                                "logit[target] - logit[foil].")
    head: Optional[Union[str, list[int]]] = Field(default=None, description="Head whose raw attention scores are "
                                                  "shown, e.g. 'L0H6' (default L0H6 when it exists, else L0H0).")
    top_neurons: int = Field(default=5, ge=1, le=100, description="Neurons shown at the lens jump block.")
    value_tokens: int = Field(default=5, ge=1, le=100, description="Promoted tokens listed per neuron.")
    key_contexts: int = Field(default=3, ge=1, le=50, description="Top-activating corpus contexts per neuron.")
    key_max_tokens: int = Field(default=1024, ge=0, description="Corpus text tokens read for the key readout "
                                "(0 skips it).")
    dataset: Optional[DatasetSpec] = Field(default=None, description="Rows to trace one of (instead of prompts); "
                                           "the row's own target and foil are followed.")
    row: int = Field(default=0, ge=0, description="Index of the dataset row traced (after the dataset's filter).")
    top_k: int = Field(default=10, ge=1, le=1000, description="Final tokens listed.")
    seed: int = Field(default=0, description="Seed of the sampling draws.")
    n_samples: int = Field(default=5, ge=1, le=100, description="Draws per sampling setting.")

    result_class = TokenTraceResult
    retired = {"answer": "target", "wrong": "foil", "prompt": "prompts"}

    @field_validator("prompts")
    @classmethod
    def _one_prompt(cls, v):
        if len(v) > 1:
            raise ValueError(f"a token trace follows one prompt, got {len(v)}; use one step per prompt (or a sweep)")
        return v

    @model_validator(mode="after")
    def _rows(self):
        check_dataset_fields(self.prompts, self.dataset, self.target if self.dataset is not None else None,
                             self.foil if self.dataset is not None else None)
        if self.dataset is None and self.row:
            raise ValueError("row selects a dataset row; give dataset (or drop row)")
        return self

    @field_validator("head")
    @classmethod
    def _head(cls, v):
        if isinstance(v, list) and len(v) != 2:
            raise ValueError("give a head as 'L0H6' or [layer, head]")
        return v

    def prepare(self, model) -> TokenTraceInputs:
        """Tokenize the prompt, resolve the target/foil ids and the head shown (tokenizer and config
        only: works on a :class:`tracekit.model.ModelInfo`)."""
        if self.dataset is None:
            ids = encode_prompts(model, self.prompts)[0]
            target_id = single_token_id(model, self.target, field="target") if self.target is not None else None
            foil_id = single_token_id(model, self.foil, field="foil") if self.foil is not None else None
            return TokenTraceInputs(ids, target_id, foil_id, parse_head(self.head, model), self.prompts[0],
                                    self.target, self.foil)
        data = kind_dataset(model, None, self.dataset)
        if self.row >= len(data):
            raise DatasetError(f"row: {self.row} is out of range for a dataset of {len(data)} rows "
                               f"(after {dict(data.dropped) or 'no drops'}); use 0..{len(data) - 1}")
        e = data.examples[self.row]
        return TokenTraceInputs(e.ids, e.target_id, e.foil_id, parse_head(self.head, model), e.prompt,
                                e.row.target, e.row.foil, e.row_id)

    def _run(self, model, inputs: TokenTraceInputs, progress: bool = True) -> TokenTraceResult:
        # The engine (tracekit.trace.token_trace) takes the prompt string and tokenizes it in each of
        # its stages (lens, attribution, attention; no ids parameter yet).
        tr = token_trace(model, inputs.prompt, inputs.target, inputs.foil, self.head, self.top_neurons, self.value_tokens,
                         self.key_contexts, self.key_max_tokens, top_k=self.top_k, seed=self.seed,
                         n_samples=self.n_samples)
        meta = {**tr.meta, "row_id": inputs.row_id, "model": model_spec_of(model).model_dump(mode="json"), "tokenization": bos_info(model)}
        return TokenTraceResult(self, tr.tables, meta)
