# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""FFN neuron attribution as an experiment kind.

``kind: neuron_attribution`` (:class:`NeuronAttribution`): per-neuron direct contributions of
chosen MLP blocks, read as key-value memories (Geva et al. 2021; 2022): top-k neurons per layer
and overall, the tokens their value vectors promote/suppress, their top-activating corpus contexts
(key readout), and a check by intervention (the verbs of :mod:`tracekit.units`: zero, mean, clamp, scale,
steer, on the top-k against k random neurons of the same layers).

The computations are in :mod:`tracekit.neurons` (notebook-usable); this module validates, calls
them and shapes tables, summaries, reports and figures. Units: ``contribution``/``logit_diff`` in
logits, ``*_prob`` in probabilities.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
import torch
from pydantic import Field, field_validator
from tqdm.auto import tqdm

from .. import plotting
from ..dla import POSITION_FORMS, LogitTarget, check_layers, resolve_target
from ..neurons import (
    key_readout,
    neuron_contributions,
    neuron_intervention,
    prompt_means,
    random_neurons,
    value_readout,
)
from ..tokens import PositionSpec, parse_position
from ..units import InterventionVerbs, Verb, intervention_row, intervention_summary, intervention_text
from .base import Experiment, Indices, Prompts, Result, StrictModel, register
from .dla import check_prompt_positions

__all__ = ["NeuronAttribution", "NeuronAttributionInputs", "NeuronAttributionResult", "KeyReadoutConfig",
           "AblationConfig"]


# =============================================================================================
# neuron attribution


class KeyReadoutConfig(StrictModel):
    """Key readout (Geva et al. 2021): top-activating corpus contexts of the top neurons.

    Fields:
        corpus: ``stdlib`` (offline default: Python's reference-manual topics and stdlib
            docstrings), a ``.txt``/``.jsonl`` file, a directory, or a list of them.
        jsonl_field: the text key in JSONL records.
        neurons: how many of the overall top neurons to read (default: the step's ``top_k``).
        top_n: contexts per neuron.
        max_tokens: text tokens read (bounds the time: ~12k tokens is < 1 min for SmolLM2 on 2 CPU cores).
        seq_len / batch_size: window length (BOS included) and windows per forward pass.
        sign: ``auto`` ranks by activation in the direction the neuron has on the prompt
            (SwiGLU activations can be negative), ``positive`` / ``negative`` force it.
    """

    corpus: Union[str, list[str]] = "stdlib"
    jsonl_field: str = "text"
    neurons: Optional[int] = Field(default=None, ge=1)
    top_n: int = Field(default=5, ge=1)
    max_tokens: Optional[int] = Field(default=12288, ge=1)
    seq_len: int = Field(default=64, ge=2)
    batch_size: int = Field(default=16, ge=1)
    sign: Literal["auto", "positive", "negative"] = "auto"


class AblationConfig(InterventionVerbs):
    """Check by intervention: edit the top-k neurons and k random neurons of the same layers (the
    control) with the verbs of :mod:`tracekit.units` (:class:`tracekit.units.InterventionVerbs`,
    the same vocabulary as ``sae_features.interventions``), at the step's read position
    (``intervene_at: position``) or at every position (``all``).

    Fields:
        k: how many of the overall top neurons (default: the step's ``top_k``).
        modes: any of ``zero`` (activation := 0), ``mean`` (:= the corpus mean from the key readout
            when it runs, else the mean over the prompt's tokens), ``clamp`` (:= ``clamp_value``),
            ``scale`` (x each of ``scale_factors``), ``steer`` (activation += each of
            ``steer_values``, i.e. that multiple of the neuron's ``W_out`` row added to the MLP's
            output); default ``[zero, mean, scale]``. Retired: ``ablate`` (now ``zero``),
            ``amplify`` (now ``scale``).
        n_random: random control sets drawn.
        seed: seed of the random control sets (set ``i`` is drawn with ``seed + i``; default 0).
        intervene_at: ``position`` (default) or ``all``. Retired: ``positions`` (``last`` is now
            ``position``).
    """

    k: Optional[int] = Field(default=None, ge=1)
    modes: list[Verb] = Field(default_factory=lambda: ["zero", "mean", "scale"])
    n_random: int = Field(default=5, ge=0)
    intervene_at: Literal["position", "all"] = "position"
    seed: int = 0

    retired = {**InterventionVerbs.retired, "positions": "intervene_at; position | all; 'last' is now 'position'"}


@dataclass(frozen=True)
class NeuronAttributionInputs:
    """What :meth:`NeuronAttribution.prepare` builds once: the target (and foil) token ids, the MLP
    blocks attributed, per prompt its token ids and the index of the read position."""

    target: LogitTarget
    layers: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]
    positions: tuple[int, ...]


class NeuronAttributionResult(Result):
    """Tables: ``neurons`` (every neuron of the chosen layers per prompt: activation,
    logit_per_activation, contribution), ``layers`` (per prompt and layer: the MLP's direct
    attribution, its ``b_out`` term, the neuron sum), ``top`` (top-k per layer and overall, ranked
    by mean contribution over prompts), ``values`` (value readout of the overall top neurons),
    ``contexts`` (key readout), ``interventions`` (one row per (verb, value) x set x prompt; the
    columns of :data:`tracekit.units.INTERVENTION_COLUMNS`, shared with ``sae_features``:
    ``prompt_idx``, ``set`` (top | random), ``draw`` (0 top, 1..n_random), ``verb``, ``value``
    (clamp value / scale factor / steer value; NaN for zero, mean), ``k``, ``units`` (JSON list of
    ``"L.N"``), ``clean_target_prob``, ``patched_target_prob``, ``delta_target_prob``,
    ``clean_logit_diff``, ``patched_logit_diff``, ``delta_logit_diff``, ``delta_target_log_prob``).

    Summary ``interventions``: :func:`tracekit.units.intervention_summary`, keyed ``zero``,
    ``mean``, ``clamp_x{value:g}``, ``scale_x{factor:g}``, ``steer_x{value:g}``."""

    config: "NeuronAttribution"
    main_table = "top"
    #: results saved before the one verb set: the scale factor column, the neuron list
    renamed_columns = {"interventions.factor": "value", "interventions.neurons": "units"}

    def _top(self, scope="overall"):
        t = self.tables["top"]
        return t[t["scope"] == scope].sort_values("rank")

    def summary(self) -> dict:
        cfg = self.config
        lay = self.tables["layers"]
        l0 = lay[lay["prompt_idx"] == 0].sort_values("layer")
        out: dict = {"target": cfg.target, "foil": cfg.foil, "metric": self.meta.get("metric"),
                     "logit": self.meta.get("logit"), "layers": l0["layer"].tolist(),
                     "mlp_attribution_by_layer": l0["mlp"].round(5).tolist(),
                     "max_additivity_error": float((lay["neuron_sum"] + lay["mlp_bias"] - lay["mlp"]).abs().max())}
        vals = self.tables.get("values", pd.DataFrame())
        ctx = self.tables.get("contexts", pd.DataFrame())
        tops = []
        for r in self._top().itertuples():
            item = {"neuron": f"{r.layer}.{r.neuron}", "layer": int(r.layer), "index": int(r.neuron),
                    "activation": round(float(r.activation), 5), "contribution": round(float(r.contribution), 5)}
            if len(vals):
                v = vals[(vals["layer"] == r.layer) & (vals["neuron"] == r.neuron)]
                item["promotes"] = v[v["side"] == "promoted"].sort_values("rank")["token"].tolist()
                item["suppresses"] = v[v["side"] == "suppressed"].sort_values("rank")["token"].tolist()
            if len(ctx):
                c = ctx[(ctx["layer"] == r.layer) & (ctx["neuron"] == r.neuron)].sort_values("rank")
                item["top_contexts"] = c["context"].tolist()
            tops.append(item)
        out["top_neurons"] = tops
        out["top_contribution_sum"] = round(float(self._top()["contribution"].sum()), 5)
        per_layer = {}
        for L, g in self._top("layer").groupby("layer"):
            per_layer[str(int(L))] = [f"{int(L)}.{int(n)}" for n in g.sort_values("rank")["neuron"]]
        out["top_by_layer"] = per_layer
        iv = self.tables.get("interventions", pd.DataFrame())
        if len(iv):
            out["interventions"] = intervention_summary(iv)
        return out

    def report(self) -> str:
        s = self.summary()
        lines = [f"neuron attribution [{self.config.step_name}] metric {s['metric']} = {s['logit']:.4f} logits; "
                 f"layers {s['layers'] if len(s['layers']) <= 8 else str(len(s['layers'])) + ' layers'}",
                 "MLP direct attribution by layer: " + ", ".join(
                     f"{L}: {v:+.3f}" for L, v in zip(s["layers"], s["mlp_attribution_by_layer"])
                     if len(s["layers"]) <= 8 or abs(v) > 0.2),
                 f"neurons + b_out = MLP attribution, max |error| {s['max_additivity_error']:.2e}",
                 f"top {len(s['top_neurons'])} neurons overall (sum {s['top_contribution_sum']:+.3f} logits):"]
        for t in s["top_neurons"]:
            lines.append(f"  {t['neuron']:>8}  act {t['activation']:+8.3f}  contribution {t['contribution']:+.4f}")
            if "promotes" in t:
                lines.append(f"           promotes {t['promotes'][:8]}")
                lines.append(f"           suppresses {t['suppresses'][:5]}")
            for c in t.get("top_contexts", [])[:3]:
                lines.append(f"           context: {c!r}")
        iv = s.get("interventions", {})
        if iv:
            k = max((v["k"] or 0) for v in iv.values())
            lines.append(f"interventions on the top-{k} neurons vs random k of the same layers:")
            lines.append(intervention_text(iv))
        return "\n".join(lines)

    def figures(self) -> dict:
        figs = {}
        top = self._top()
        if len(top):
            values = {f"{int(r.layer)}.{int(r.neuron)}": float(r.contribution) for r in top.itertuples()}
            figs["top_neurons"] = plotting.bars(values, title="Top neurons (layer.neuron)",
                                                ylabel=f"direct contribution to {self.meta.get('metric')} (logits)")
        iv = self.tables.get("interventions", pd.DataFrame())
        if len(iv):
            summ = intervention_summary(iv, decimals=None)
            keys = list(summ)
            fig, ax = plotting.plt().subplots(figsize=(6, 3.5))
            x = np.arange(len(keys))
            for j, (st, col, name) in enumerate((("top", "tab:red", "top_delta_target_prob"),
                                                 ("random", "tab:gray", "random_delta_target_prob_mean"))):
                ys = [summ[key][name] or 0.0 for key in keys]
                ax.bar(x + (j - 0.5) * 0.38, ys, width=0.38, color=col, label=f"{st} k")
            ax.set_xticks(x, keys)
            ax.axhline(0, color="k", lw=0.5)
            ax.set_ylabel("change in target probability"); ax.legend(fontsize=8)
            ax.set_title("Intervention: top-k neurons vs random control")
            fig.tight_layout()
            figs["interventions"] = fig
        return figs


@register
class NeuronAttribution(Experiment):
    """Which FFN neurons write the target into the residual stream, what they promote, when they
    fire, and whether removing them matters (Geva et al. 2021; 2022; DLA per Elhage et al. 2021).

    Fields:
        prompts: one string or a list (neurons are ranked by mean contribution over prompts).
        target / foil: one-token strings; metric ``logit[target]`` (- ``logit[foil]``).
        position: the read position (:class:`tracekit.tokens.Position`): an int (BOS counted when
            prepended; negative from the end), ``last`` (default) or ``token:<text>``.
        layers: MLP blocks (block indices; negative from the end) to attribute, or ``all``.
        top_k: neurons listed per layer and overall.
        rank_by: ``contribution`` (most positive first: neurons that push the target) or ``abs``.
        value_tokens: promoted/suppressed tokens per top neuron (0: skip the value readout).
        contexts: key readout settings, or null to skip (see :class:`KeyReadoutConfig`).
        ablation: intervention settings, or null to skip (see :class:`AblationConfig`).
        batch_size: prompts per forward pass of the neuron attribution (default 8; lower it on
            out-of-memory).

    Raises:
        TokenizationError: target/foil not one token. AttributionError: unknown layer, position
        out of range. CorpusError: unreadable corpus.
    """

    kind: Literal["neuron_attribution"] = "neuron_attribution"
    prompts: Prompts
    target: str
    foil: Optional[str] = Field(default=None, json_schema_extra={"null_from_reference": True})
    position: PositionSpec = "last"
    layers: Union[Literal["all"], Indices, int] = "all"
    top_k: int = Field(default=10, ge=1)
    rank_by: Literal["contribution", "abs"] = "contribution"
    value_tokens: int = Field(default=10, ge=0)
    contexts: Optional[KeyReadoutConfig] = Field(default_factory=KeyReadoutConfig)
    ablation: Optional[AblationConfig] = Field(default_factory=AblationConfig)
    batch_size: int = Field(default=8, ge=1)

    result_class = NeuronAttributionResult

    @field_validator("position")
    @classmethod
    def _position(cls, v):
        parse_position(v, POSITION_FORMS, "position")
        return v

    def prepare(self, model) -> NeuronAttributionInputs:
        """Resolve target/foil ids and the layers, tokenize the prompts and resolve the read
        position (tokenizer and config only: works on a :class:`tracekit.model.ModelInfo`)."""
        target = resolve_target(model, self.target, self.foil)
        layers = tuple(check_layers(model, self.layers, "layers"))
        ids, positions = check_prompt_positions(model, self.prompts, self.position)
        return NeuronAttributionInputs(target, layers, ids, positions)

    @torch.no_grad()
    def _run(self, model, inputs: NeuronAttributionInputs, progress: bool = True) -> NeuronAttributionResult:
        # The engines (tracekit.neurons.neuron_contributions, prompt_means, neuron_intervention)
        # take the prompt strings and tokenize them themselves (no ids parameter yet): each prompt
        # is tokenized again by the attribution pass and by every intervention.
        layers = list(inputs.layers)
        das = neuron_contributions(model, self.prompts, self.target, self.foil, self.position, layers,
                                   batch_size=self.batch_size)
        neurons = pd.concat([d.neurons_frame() for d in das], ignore_index=True)
        lay_rows = [{"prompt_idx": d.prompt_idx, "layer": L, "mlp": float(d.mlp[L]), "mlp_bias": float(d.mlp_bias[L]),
                     "neuron_sum": float(d.neuron_contrib[L].sum())} for d in das for L in layers]
        top_rows, overall = self._top_rows(neurons)
        tables = {"neurons": neurons, "layers": pd.DataFrame(lay_rows), "top": pd.DataFrame(top_rows)}

        if self.value_tokens:
            tables["values"] = pd.concat([
                value_readout(model, L, n, k=self.value_tokens, sign=1.0 if a >= 0 else -1.0).assign(
                    activation_sign=1 if a >= 0 else -1) for L, n, a in overall], ignore_index=True)

        abl = self.ablation
        k_abl = min(abl.k or self.top_k, len(overall)) if abl else 0
        top_set = [(L, n) for L, n, _ in overall[:k_abl]]
        rand_sets = [random_neurons(model, top_set, seed=abl.seed + i, exclude=top_set) for i in range(abl.n_random)] if abl else []

        means = None
        meta = {"metric": das[0].target.label, "logit": das[0].logit, "final_scale": das[0].final_scale,
                "process_weights": bool(getattr(getattr(model, "tracekit_spec", None), "process_weights", True))}
        if self.contexts is not None:
            means = self._contexts(model, overall, top_set, rand_sets, tables, meta, progress)
        if abl is not None and top_set:
            if means is None and "mean" in abl.modes:
                means = prompt_means(model, self.prompts, top_set + [x for s in rand_sets for x in s])
                meta["mean_source"] = "prompt tokens (BOS excluded)"
            tables["interventions"] = self._interventions(model, top_set, rand_sets, means, progress)
        return NeuronAttributionResult(self, tables, meta)

    def _top_rows(self, neurons: pd.DataFrame) -> tuple[list[dict], list[tuple[int, int, float]]]:
        """Rows of the ``top`` table (per layer and overall, ranked by mean contribution over
        prompts) and the overall top neurons as ``(layer, neuron, mean activation)``."""
        mean = neurons.groupby(["layer", "neuron"], as_index=False)[["activation", "contribution", "logit_per_activation"]].mean()
        key = mean["contribution"] if self.rank_by == "contribution" else mean["contribution"].abs()
        mean = mean.assign(_key=key)
        top_rows = []
        for L, g in mean.groupby("layer"):
            g = g.sort_values("_key", ascending=False).head(self.top_k)
            for r, row in enumerate(g.itertuples()):
                top_rows.append({"scope": "layer", "rank": r + 1, "layer": int(L), "neuron": int(row.neuron),
                                 "activation": row.activation, "logit_per_activation": row.logit_per_activation,
                                 "contribution": row.contribution})
        g = mean.sort_values("_key", ascending=False).head(self.top_k)
        overall = []
        for r, row in enumerate(g.itertuples()):
            top_rows.append({"scope": "overall", "rank": r + 1, "layer": int(row.layer), "neuron": int(row.neuron),
                             "activation": row.activation, "logit_per_activation": row.logit_per_activation,
                             "contribution": row.contribution})
            overall.append((int(row.layer), int(row.neuron), float(row.activation)))
        return top_rows, overall

    def _contexts(self, model, overall, top_set, rand_sets, tables: dict, meta: dict, progress: bool):
        """Key readout of the top neurons (table ``contexts``); returns the corpus means of every
        neuron read (the baselines of a ``mean`` ablation)."""
        cx = self.contexts
        assert cx is not None
        n_ctx = min(cx.neurons or self.top_k, len(overall))
        read = [(L, n) for L, n, _ in overall[:n_ctx]]
        sgn = {(L, n): (1.0 if a >= 0 else -1.0) for L, n, a in overall}
        if cx.sign == "positive":
            sgn = {k: 1.0 for k in sgn}
        elif cx.sign == "negative":
            sgn = {k: -1.0 for k in sgn}
        extra = [x for s in rand_sets for x in s if x not in read] + [x for x in top_set if x not in read]
        extra = list(dict.fromkeys(extra))
        kr = key_readout(model, read + extra, cx.corpus, top_n=cx.top_n, seq_len=cx.seq_len,
                         batch_size=cx.batch_size, max_tokens=cx.max_tokens,
                         signs=[sgn.get(x, 1.0) for x in read] + [1.0] * len(extra),
                         jsonl_field=cx.jsonl_field, progress=progress)
        c = kr.contexts
        keep = set(read)
        tables["contexts"] = c[[(int(a), int(b)) in keep for a, b in zip(c["layer"], c["neuron"])]].reset_index(drop=True)
        meta.update(corpus=cx.corpus, corpus_tokens=kr.n_tokens, corpus_windows=kr.n_windows, mean_source="corpus")
        return kr.means

    def _interventions(self, model, top_set, rand_sets, means, progress: bool) -> pd.DataFrame:
        """One row per (verb, value) x set x prompt: the top neurons and each random control set
        edited (table ``interventions``, columns :data:`tracekit.units.INTERVENTION_COLUMNS`)."""
        abl = self.ablation
        assert abl is not None
        rows = []
        clean_by_prompt: dict = {}
        plans = abl.plans()
        sets = [("top", 0, top_set)] + [("random", i + 1, s) for i, s in enumerate(rand_sets)]
        bar = tqdm(total=len(plans) * len(sets) * len(self.prompts), desc="interventions",
                   disable=not progress, leave=False)
        for mode, value in plans:
            for set_name, draw, nset in sets:
                for pi, prompt in enumerate(self.prompts):
                    r = neuron_intervention(model, prompt, self.target, nset, mode=mode, foil=self.foil,
                                            means=means, factor=value if mode == "scale" else 1.0,
                                            value=value if mode in ("clamp", "steer") else 0.0,
                                            intervene_at=abl.intervene_at, position=self.position,
                                            clean_metrics=clean_by_prompt.get(pi))
                    clean_by_prompt[pi] = r["clean"]
                    rows.append({"prompt_idx": pi, "set": set_name, "draw": draw, "verb": mode, "value": value,
                                 "k": len(nset), "units": json.dumps([f"{L}.{n}" for L, n in nset]),
                                 **intervention_row(r)})
                    bar.update(1)
        bar.close()
        return pd.DataFrame(rows)

