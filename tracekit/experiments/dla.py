# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""Direct logit attribution as an experiment kind.

``kind: direct_logit_attribution`` (:class:`DirectLogitAttribution`): the target logit (or
target - foil logit difference) at a position split into embeddings, every attention head and
every MLP (Elhage et al. 2021), through the run's final-norm scale; parts + bias terms = the
model's logit. The computation is :func:`tracekit.dla.logit_attribution` (notebook-usable); this
module validates, calls it and shapes tables, summaries, reports and figures. Units:
``contribution`` and ``logit`` in logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import pandas as pd
from pydantic import Field, field_validator

from .. import plotting
from ..dla import POSITION_FORMS, LogitTarget, as_position, logit_attribution, resolve_target
from ..tokens import PositionSpec, parse_position
from .base import Experiment, Prompts, Result, encode_prompts, register

__all__ = ["DirectLogitAttribution", "DirectLogitAttributionInputs", "DirectLogitAttributionResult",
           "check_prompt_positions"]


def check_prompt_positions(model, prompts, position) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Tokenize every prompt and resolve ``position`` in it, with the tokenizer only (works on a
    ``ModelInfo``).

    Returns:
        ``(ids, positions)``: per prompt its token ids and the index of the read position.

    Raises:
        TokenizationError: a prompt too long, or a position not in a prompt (naming the field).
    """
    pos = as_position(position)
    ids = encode_prompts(model, prompts)
    return ids, tuple(pos.resolve(model, p, seq, field="position")[0] for p, seq in zip(prompts, ids))


@dataclass(frozen=True)
class DirectLogitAttributionInputs:
    """What :meth:`DirectLogitAttribution.prepare` builds once: the target (and foil) token ids, per
    prompt its token ids and the index of the read position."""

    target: LogitTarget
    ids: tuple[tuple[int, ...], ...]
    positions: tuple[int, ...]


class DirectLogitAttributionResult(Result):
    """Tables: ``components`` (embed, pos_embed, attn.L, mlp.L, bias per prompt; they sum to
    ``attributed_logit``), ``heads`` (per head plus ``b_O`` rows with head -1), ``prompts`` (per
    prompt: the model's logit (difference) ``logit``, the ``attributed_logit`` the parts add up to
    (equal to ``logit`` unless the model has a nonlinear ``output_transform`` such as Gemma 2's
    soft-cap, where it is the pre-transform value), the sum of parts, the final-norm scale, tokens)."""

    config: "DirectLogitAttribution"
    main_table = "components"

    def summary(self) -> dict:
        comp = self.tables["components"]
        pr = self.tables["prompts"]
        c0 = comp[comp["prompt_idx"] == 0]
        h0 = self.tables["heads"]
        h0 = h0[(h0["prompt_idx"] == 0) & (h0["head"] >= 0)]
        k = self.config.top_k
        top = c0.reindex(c0["contribution"].abs().sort_values(ascending=False).index).head(k)
        toph = h0.reindex(h0["contribution"].abs().sort_values(ascending=False).index).head(k)
        p0 = pr.iloc[0]
        out = {
            "target": self.config.target, "foil": self.config.foil, "metric": p0["metric"],
            "logit": float(p0["logit"]), "attributed_logit": float(p0["attributed_logit"]),
            "sum_of_parts": float(p0["sum_of_parts"]),
            "abs_error": float(abs(p0["attributed_logit"] - p0["sum_of_parts"])),
            "output_transform": str(p0["output_transform"]),
            "final_scale": float(p0["final_scale"]),
            "embed": float(c0[c0["kind"] == "embed"]["contribution"].sum()),
            "attn_total": float(c0[c0["kind"] == "attn"]["contribution"].sum()),
            "mlp_total": float(c0[c0["kind"] == "mlp"]["contribution"].sum()),
            "bias": float(c0[c0["kind"] == "bias"]["contribution"].sum()),
            "attn_by_layer": c0[c0["kind"] == "attn"].sort_values("layer")["contribution"].round(5).tolist(),
            "mlp_by_layer": c0[c0["kind"] == "mlp"].sort_values("layer")["contribution"].round(5).tolist(),
            "top_components": {r.component: round(float(r.contribution), 5) for r in top.itertuples()},
            "top_heads": {r.component: round(float(r.contribution), 5) for r in toph.itertuples()},
            "n_prompts": int(len(pr)),
        }
        if len(pr) > 1:
            out["logit_by_prompt"] = pr["logit"].round(5).tolist()
        return out

    def report(self) -> str:
        s = self.summary()
        pr = self.tables["prompts"].iloc[0]
        if s["output_transform"] in ("none", "") or s["output_transform"].startswith("logits x"):
            what = f"model: {s['logit']:.4f} logits; sum of parts {s['sum_of_parts']:.4f}"
        else:  # a nonlinear output transform: the parts add up to the pre-transform logit (difference)
            what = (f"model: {s['logit']:.4f} logits after its {s['output_transform']}; the parts add up to the "
                    f"pre-transform value {s['attributed_logit']:.4f}: sum of parts {s['sum_of_parts']:.4f}")
        lines = [f"direct logit attribution [{self.config.step_name}] prompt 0: {pr['prompt']!r} at position "
                 f"{pr['position']} ({pr['token']!r}); metric {s['metric']}",
                 f"{what} (|error| {s['abs_error']:.2e}); "
                 f"final-norm scale 1/sigma = {s['final_scale']:.4g} (the run's, frozen)",
                 f"embeddings {s['embed']:+.4f}  attention {s['attn_total']:+.4f}  MLPs {s['mlp_total']:+.4f}  "
                 f"bias {s['bias']:+.4f}", "top components (logits):"]
        lines.append(plotting.text_table([(k, f"{v:+.4f}") for k, v in s["top_components"].items()],
                                         ["component", "contribution"]))
        lines.append("top heads (logits):")
        lines.append(plotting.text_table([(k, f"{v:+.4f}") for k, v in s["top_heads"].items()],
                                         ["head", "contribution"]))
        return "\n".join(lines)

    def figures(self) -> dict:
        comp = self.tables["components"]
        c0 = comp[comp["prompt_idx"] == 0]
        metric = self.tables["prompts"]["metric"].iloc[0]
        att = c0[c0["kind"] == "attn"].sort_values("layer")
        mlp = c0[c0["kind"] == "mlp"].sort_values("layer")
        values = {"embed": float(c0[c0["kind"] == "embed"]["contribution"].sum())}
        colors = {"embed": "gray"}
        for (L, a), m in zip(zip(att["layer"], att["contribution"]), mlp["contribution"]):
            values[f"attn.{L}"], values[f"mlp.{L}"] = float(a), float(m)
            colors[f"attn.{L}"], colors[f"mlp.{L}"] = "tab:blue", "tab:orange"
        figs = {"components": plotting.bars(values, colors=colors, title=f"Direct logit attribution: {metric}",
                                            ylabel="direct contribution (logits)",
                                            xlabel="component (attn / mlp by block index)")}
        h = self.tables["heads"]
        h = h[(h["prompt_idx"] == 0) & (h["head"] >= 0)]
        grid = h.pivot(index="layer", columns="head", values="contribution").sort_index()
        figs["heads"] = plotting.heatmap(grid.to_numpy(), grid.columns.tolist(), grid.index.tolist(), diverging=True,
                                         title="Per-head direct contribution (logits)", xlabel="head",
                                         ylabel="layer", colorbar_label="logits")
        return figs


@register
class DirectLogitAttribution(Experiment):
    """Direct logit attribution (Elhage et al. 2021) of a target (minus a foil) at a position.

    Fields:
        prompts: one string or a list (each attributed separately; summary shows prompt 0).
        target: one-token string, e.g. ``" Paris"``.
        foil: optional one-token string; with it the metric becomes the logit difference
            ``logit[target] - logit[foil]`` (default none: the target's logit alone).
        position: the read position (:class:`tracekit.tokens.Position`): an int (BOS counted when
            prepended; negative from the end), ``last`` (default) or ``token:<text>``.
        top_k: components / heads listed in the summary.
        batch_size: prompts per forward pass.

    Raises:
        TokenizationError: target/foil not one token, position not in a prompt.
        AttributionError: an architecture whose residual stream is not the sum of the parts read.
    """

    kind: Literal["direct_logit_attribution"] = "direct_logit_attribution"
    prompts: Prompts
    target: str
    foil: Optional[str] = Field(default=None, json_schema_extra={"null_from_reference": True})
    position: PositionSpec = "last"
    top_k: int = Field(default=10, ge=1)
    batch_size: int = Field(default=8, ge=1)

    result_class = DirectLogitAttributionResult

    @field_validator("position")
    @classmethod
    def _position(cls, v):
        parse_position(v, POSITION_FORMS, "position")
        return v

    def prepare(self, model) -> DirectLogitAttributionInputs:
        """Resolve target/foil ids, tokenize the prompts and resolve the read position (tokenizer
        only: works on a :class:`tracekit.model.ModelInfo`)."""
        target = resolve_target(model, self.target, self.foil)
        ids, positions = check_prompt_positions(model, self.prompts, self.position)
        return DirectLogitAttributionInputs(target, ids, positions)

    def _run(self, model, inputs: DirectLogitAttributionInputs, progress: bool = True
             ) -> DirectLogitAttributionResult:
        # The engine (tracekit.dla.logit_attribution) takes the prompt strings and tokenizes each
        # batch itself (it has no ids parameter yet), so each prompt is tokenized once more there.
        das = logit_attribution(model, self.prompts, self.target, self.foil, self.position,
                                batch_size=self.batch_size)
        comps, heads, prompts = [], [], []
        for d in das:
            comps.append(d.components_frame())
            heads.append(d.heads_frame())
            prompts.append({"prompt_idx": d.prompt_idx, "prompt": d.prompt, "position": d.position,
                            "token": d.tokens[d.position], "metric": d.target.label, "logit": d.logit,
                            "attributed_logit": d.attributed, "output_transform": d.transform,
                            "sum_of_parts": d.total(), "final_scale": d.final_scale, "tokens": d.tokens})
        tables = {"components": pd.concat(comps, ignore_index=True), "heads": pd.concat(heads, ignore_index=True),
                  "prompts": pd.DataFrame(prompts)}
        meta = {"n_layers": int(model.cfg.n_layers), "n_heads": int(model.cfg.n_heads),
                "process_weights": bool(getattr(getattr(model, "tracekit_spec", None), "process_weights", True)),
                "scale": "final-norm scale of this run, frozen (post-attention/MLP norms too, where a block has them)",
                "attributed": "the logit (difference) the parts add up to: the model's own, or the pre-transform "
                              "value under a nonlinear output transform (e.g. Gemma 2's final soft-cap)"}
        return DirectLogitAttributionResult(self, tables, meta)
