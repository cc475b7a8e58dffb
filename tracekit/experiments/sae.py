# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""SAE feature kinds over :mod:`tracekit.sae` (SAELens SAEs).

* ``kind: sae_features`` (:class:`SAEFeatures`): decompose prompts into SAE features at the SAE's
  hook, attribute the target logit (difference) to them (direct and total), with the
  reconstruction error, decoder bias and special tokens as their own terms; optional
  interventions (the verbs of :mod:`tracekit.units`: zero / mean / clamp / scale / steer, against
  random-feature controls) and per-feature HTML
  dashboards (top-activating corpus contexts, decoder vocabulary readout, activation density).
* ``kind: sae_eval`` (:class:`SAEEval`): the SAE spliced into the model on corpus windows (the
  held-out tokens of an SAE trained here): MSE, explained variance, L0, dead / dense features,
  CE loss recovered against zero and mean ablation, KL to the clean run.
* ``kind: sae_train`` (:class:`SAETrain`): train (or find in the cache) the SAE of a ``sae.train``
  block with SAELens' runner and evaluate it on held-out text.

``sae_eval`` and ``sae_train`` are defined in :mod:`tracekit.experiments.sae_quality` and re-exported here.

Every kind takes the same ``sae:`` block (:class:`tracekit.sae.SAESpec`). Units: activations in
the SAE's input units; ``direct``/``total``/``contribution`` in logits; losses in nats.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from .. import plotting
from ..dla import LogitTarget, resolve_target
from ..errors import SAEError
from ..sae import (
    SAEInfo,
    SAESpec,
    check_sae,
    decoder_vocab,
    eval_windows,
    feature_dashboard_html,
    feature_decomposition,
    feature_intervention,
    random_features,
    sae_info,
    top_activating_contexts,
)
from ..tokens import check_length, encode
from ..units import InterventionVerbs, Verb, intervention_row, intervention_summary, intervention_text
from .base import Experiment, Indices, Prompts, Result, StrictModel, register
from .sae_quality import SAEEval, SAEEvalResult, SAETrain, SAETrainResult, load_handle, rounded


def _worse(a: float, b: float) -> float:
    """The larger error, NaN when either is NaN (Python's max keeps the first of a NaN pair: a silent 0)."""
    return float("nan") if math.isnan(a) or math.isnan(b) else max(a, b)


# SAEEval / SAETrain live in .sae_quality and are re-exported here (one import path for the SAE kinds).
__all__ = [
    "SAEDashboardConfig",
    "SAEEval",
    "SAEEvalResult",
    "SAEFeatures",
    "SAEFeaturesInputs",
    "SAEFeaturesResult",
    "SAEInterventionConfig",
    "SAETrain",
    "SAETrainResult",
]


# =============================================================================================
# sae_features


class SAEInterventionConfig(InterventionVerbs):
    """Interventions on the top features (error term kept, so only the edited features move), with
    the verbs of :mod:`tracekit.units` (:class:`tracekit.units.InterventionVerbs`, the same
    vocabulary as ``neuron_attribution.ablation``).

    Fields:
        features: ``top`` (the step's top ``k`` features of each prompt by |contribution|) or a list
            of feature indices.
        k: how many top features.
        modes: any of ``zero`` (activation -> 0), ``mean`` (-> the feature's mean activation over
            the prompt's non-special tokens), ``clamp`` (-> ``clamp_value``), ``scale`` (x each of
            ``scale_factors``), ``steer`` (add each of ``steer_values`` x the decoder row); default
            ``[zero, steer]``. Retired: ``ablate`` (now ``zero``), ``amplify`` (now ``scale``).
        intervene_at: where the edit applies: ``all`` (every non-special token), ``position`` (the
            step's read position), or a list of token indices.
        n_random: random control sets of the same size (features active on the prompt for
            zero / mean / clamp / scale; any feature for steer).
        seed: the random control sets' seed (set ``i`` is drawn with ``seed + i``).
    """

    features: Literal["top"] | Indices = "top"
    k: int = Field(default=3, ge=1)
    modes: list[Verb] = Field(default_factory=lambda: ["zero", "steer"])
    intervene_at: Literal["all", "position"] | list[int] = "all"
    n_random: int = Field(default=3, ge=0)
    seed: int = 0

    retired = {**InterventionVerbs.retired, "positions": "intervene_at; all | position | token indices"}


class SAEDashboardConfig(StrictModel):
    """Per-feature dashboards of the top features (self-contained HTML pages, saved with the result).

    Fields:
        features: how many of prompt 0's top features.
        corpus: the text scanned for each feature's top-activating contexts: ``stdlib`` (default,
            offline), a text/JSONL file or directory path, or a list of such paths.
        max_tokens / seq_len / batch_size: the corpus scan.
        top_n: top-activating corpus contexts shown per feature (default 8).
        vocab_k: promoted / suppressed tokens listed.
    """

    features: int = Field(default=5, ge=1)
    corpus: str | list[str] = "stdlib"
    max_tokens: int = Field(default=8192, ge=16)
    seq_len: int = Field(default=64, ge=4)
    batch_size: int = Field(default=8, ge=1)
    top_n: int = Field(default=8, ge=1)
    vocab_k: int = Field(default=10, ge=1)


def _density_png(values: np.ndarray, feature: int) -> str:
    p = plotting.plt()
    fig, ax = p.subplots(figsize=(5, 2.4))
    if len(values):
        ax.hist(values, bins=30, color="C1")
    ax.set_xlabel("activation (> 0)")
    ax.set_ylabel("tokens")
    ax.set_title(f"feature {feature}: activation histogram")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    p.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class SAEFeaturesInputs:
    """What :meth:`SAEFeatures.prepare` builds once: the target (and foil) token ids, the SAE's
    identity (hook, BOS setting, training context; no weights) and each prompt's token ids."""

    target: LogitTarget
    info: SAEInfo
    ids: tuple[tuple[int, ...], ...]


class SAEFeaturesResult(Result):
    """Tables: ``features`` (per prompt, each feature active on the prompt: activation at the read
    position, direct contribution there, total attribution over positions, rank by |direct| (or
    |total| where direct is undefined)), ``terms`` (per prompt: features / error / bias /
    special_tokens / activation, direct and total; the parts sum to the activation), ``tokens``
    (per prompt and position: token, special, L0, ||x||, ||error||, top features), and, when asked,
    ``interventions``, ``vocab``, ``contexts`` and ``density`` (activation histograms).

    ``interventions``: one row per prompt x (verb, value) x set; the columns of
    :data:`tracekit.units.INTERVENTION_COLUMNS`, shared with ``neuron_attribution``: ``prompt_idx``,
    ``set`` (top | random), ``draw`` (0 top, 1..n_random), ``verb``, ``value`` (clamp value / scale
    factor / steer value; NaN for zero, mean), ``k``, ``units`` (JSON list of feature indices),
    ``clean_target_prob``, ``patched_target_prob``, ``delta_target_prob``, ``clean_logit_diff``,
    ``patched_logit_diff``, ``delta_logit_diff``, ``delta_target_log_prob`` (read at the prompt's
    last token). Summary ``interventions``: :func:`tracekit.units.intervention_summary`, keyed
    ``zero``, ``mean``, ``clamp_x{value:g}``, ``scale_x{factor:g}``, ``steer_x{value:g}``."""

    config: "SAEFeatures"
    main_table = "features"
    #: results saved before the interventions columns were shared with ``neuron_attribution``
    renamed_columns = {"interventions.features": "units", "interventions.clean_prob": "clean_target_prob",
                       "interventions.prob": "patched_target_prob", "interventions.delta_prob": "delta_target_prob",
                       "interventions.clean_logit": "clean_logit_diff", "interventions.logit": "patched_logit_diff",
                       "interventions.delta_logit": "delta_logit_diff"}

    def _rank_col(self) -> str:
        f = self.tables["features"]
        return "direct" if f["direct"].notna().any() else "total"

    def top(self, prompt_idx: int = 0, k: int | None = None) -> pd.DataFrame:
        f = self.tables["features"]
        f = f[f["prompt_idx"] == prompt_idx].sort_values("rank")
        return f.head(k or self.config.top_k)

    def summary(self) -> dict:
        cfg = self.config
        terms = self.tables["terms"]
        t0 = terms[terms["prompt_idx"] == 0].set_index("term")
        vocab = self.tables.get("vocab", pd.DataFrame())
        ctx = self.tables.get("contexts", pd.DataFrame())
        tops = []
        for r in self.top(0).itertuples():
            item = {"feature": int(r.feature), "activation": round(float(r.activation), 5),
                    "direct": None if pd.isna(r.direct) else round(float(r.direct), 5),
                    "total": round(float(r.total), 5)}
            if len(vocab):
                v = vocab[vocab["feature"] == r.feature]
                if len(v):
                    item["promotes"] = v[v["side"] == "promoted"].sort_values("rank")["token"].tolist()
                    item["suppresses"] = v[v["side"] == "suppressed"].sort_values("rank")["token"].tolist()
            if len(ctx):
                c = ctx[ctx["feature"] == r.feature].sort_values("rank")
                if len(c):
                    item["top_contexts"] = c["context"].head(3).tolist()
            tops.append(item)
        tok = self.tables["tokens"]
        tk0 = tok[(tok["prompt_idx"] == 0) & (~tok["special"])]
        out = {
            "hook": self.meta.get("hook"), "sae": self.meta.get("sae"), "d_sae": self.meta.get("d_sae"),
            "target": cfg.target, "foil": cfg.foil, "metric": self.meta.get("metrics", [None])[0],
            "logit": self.meta.get("logits", [None])[0], "position": self.meta.get("positions", [None])[0],
            "rank_by": self._rank_col(), "top_features": tops,
            "direct": {k: rounded(t0.loc[k, "direct"]) for k in t0.index},
            "total": {k: rounded(t0.loc[k, "total"]) for k in t0.index},
            "max_sum_error": float(self.meta.get("max_sum_error", float("nan"))),
            "l0_mean": round(float(tk0["l0"].mean()), 4) if len(tk0) else None,
            "relative_error_norm": round(float((tk0["error_norm"] / tk0["x_norm"]).mean()), 5) if len(tk0) else None,
            "n_prompts": int(terms["prompt_idx"].nunique()),
        }
        iv = self.tables.get("interventions", pd.DataFrame())
        if len(iv):
            out["interventions"] = intervention_summary(iv)
        return out

    def report(self) -> str:
        s = self.summary()
        lines = [(f"SAE features [{self.config.step_name}] {s['sae']} at {s['hook']} (d_sae {s['d_sae']}); "
                  f"{s['metric']} = {s['logit']:.4f} at position {s['position']}; ranked by |{s['rank_by']}|")]
        rows = [[t["feature"], f"{t['activation']:.3f}", "-" if t["direct"] is None else f"{t['direct']:+.4f}",
                 f"{t['total']:+.4f}", " ".join(repr(x) for x in t.get("promotes", [])[:5])] for t in s["top_features"]]
        lines.append(plotting.text_table(rows, ["feature", "activation", "direct", "total", "promotes"], "><>><"))
        lines.append("terms (direct | total): " + ", ".join(
            f"{k} {s['direct'][k] if s['direct'][k] is not None else float('nan'):+.4f} | {s['total'][k]:+.4f}"
            for k in s["total"]))
        if s.get("interventions"):
            lines.append("interventions on the top features vs random features (error term kept):")
            lines.append(intervention_text(s["interventions"]))
        return "\n".join(lines)

    def figures(self) -> dict:
        col = self._rank_col()
        top = self.top(0)
        figs = {"top_features": plotting.bars({f"f{int(r.feature)}": float(getattr(r, col)) for r in top.itertuples()},
                                     title=f"Top SAE features ({col} attribution), prompt 0",
                                     ylabel=f"{col} attribution (logits)", xlabel="feature")}
        t = self.tables["terms"]
        t0 = t[(t["prompt_idx"] == 0) & (t["term"] != "activation")]
        figs["terms"] = plotting.bars({r.term: float(r.total) for r in t0.itertuples()},
                             title="Total attribution by term (prompt 0)", ylabel="logits", rotate=False)
        return figs

    def dashboards(self) -> dict[int, str]:
        """feature -> self-contained HTML page (from the ``contexts``, ``vocab`` and ``density`` tables)."""
        ctx = self.tables.get("contexts")
        if ctx is None:
            return {}
        vocab = self.tables.get("vocab", pd.DataFrame(columns=["feature", "side", "rank", "token", "logit"]))
        dens = self.tables.get("density", pd.DataFrame(columns=["feature", "activation"]))
        feats = self.tables["features"]
        out = {}
        for f in self.meta.get("dashboard_features", []):
            row = feats[(feats["prompt_idx"] == 0) & (feats["feature"] == f)]
            vals = dens[dens["feature"] == f]["activation"].to_numpy()
            n_tok = int(self.meta.get("dashboard_tokens", 0))
            stats = {"hook": self.meta.get("hook"), "SAE": self.meta.get("sae"),
                     "activation on prompt 0 (read position)": rounded(row["activation"].iloc[0]) if len(row) else None,
                     "direct contribution (logits)": rounded(row["direct"].iloc[0]) if len(row) else None,
                     "total attribution (logits)": rounded(row["total"].iloc[0]) if len(row) else None,
                     "corpus tokens scanned": n_tok,
                     "activation density": rounded(len(vals) / n_tok, 6) if n_tok else None}
            out[int(f)] = feature_dashboard_html(
                int(f), f"Feature {f} of {self.meta.get('sae')} ({self.meta.get('hook')})", stats,
                ctx[ctx["feature"] == f], vocab[vocab["feature"] == f], _density_png(vals, int(f)))
        return out

    def save(self, directory, figures: bool = True):
        """:meth:`Result.save`, then the dashboards as ``dashboard_feature_<f>.html`` next to it."""
        d = super().save(directory, figures=figures)
        for f, html in self.dashboards().items():
            (Path(d) / f"dashboard_feature_{f}.html").write_text(html, encoding="utf-8")
        return d


@register
class SAEFeatures(Experiment):
    """Decompose prompts into SAE features and attribute the target logit (difference) to them.

    Fields:
        sae: the SAE (:class:`tracekit.sae.SAESpec`: ``release``+``id``, ``path`` or ``train``).
        prompts: one string or a list.
        target: the one-token string whose logit is attributed to the features (e.g. ``" Paris"``).
        foil: optional one-token string; with it the metric is the logit difference
            ``logit[target] - logit[foil]`` (default none: the target's logit alone).
        position: the read position (token index, BOS counted; -1 = last).
        top_k: features listed / ranked per prompt.
        interventions: optional :class:`SAEInterventionConfig`.
        dashboards: optional :class:`SAEDashboardConfig`: per-feature HTML dashboards of prompt 0's
            top features (default none: no dashboards, no corpus scan).

    Raises:
        SAEError (from :meth:`check`, before any forward pass): SAE source, hook, width, model,
        basis. TokenizationError: target/foil not one token; prompt too long.
    """

    kind: Literal["sae_features"] = "sae_features"
    sae: SAESpec
    prompts: Prompts
    target: str
    foil: str | None = Field(default=None, json_schema_extra={"null_from_reference": True})
    position: int = -1
    top_k: int = Field(default=10, ge=1)
    interventions: SAEInterventionConfig | None = None
    dashboards: SAEDashboardConfig | None = None

    result_class = SAEFeaturesResult

    retired = {"answer": "target", "wrong": "foil", "prompt": "prompts"}

    def prepare(self, model) -> SAEFeaturesInputs:
        """Resolve target/foil ids and the SAE's identity (no weights), tokenize the prompts with
        the SAE's BOS setting and check them against the model's and the SAE's context (works on a
        :class:`tracekit.model.ModelInfo`)."""
        target = resolve_target(model, self.target, self.foil)
        info = sae_info(self.sae, model, "sae")
        ids = []
        for i, p in enumerate(self.prompts):
            seq = encode(model, p, prepend_bos=info.prepend_bos)
            check_length(model, seq, f"prompts[{i}]", p)
            if info.context_size and len(seq) > int(info.context_size):
                raise SAEError(f"prompts[{i}] is {len(seq)} tokens, longer than the SAE's training context "
                               f"({info.context_size})")
            ids.append(tuple(seq))
        return SAEFeaturesInputs(target, info, tuple(ids))

    def check(self, model) -> SAEFeaturesInputs:
        """:meth:`prepare`, then the SAE against the model (:func:`tracekit.sae.check_sae`: hook,
        width, model, activation basis)."""
        inputs = self.prepare(model)
        check_sae(model, inputs.info, "sae")
        return inputs

    def _run(self, model, inputs: SAEFeaturesInputs, progress: bool = True) -> SAEFeaturesResult:
        # The engines (tracekit.sae.feature_decomposition, feature_intervention) take the prompt
        # strings and tokenize them themselves (no ids parameter yet): each prompt is tokenized
        # again by its decomposition and by every intervention.
        h = load_handle(self, model, progress)
        feats, terms, toks, metas = [], [], [], {"logits": [], "metrics": [], "positions": []}
        max_err = 0.0
        decs = []
        for i, prompt in enumerate(self.prompts):
            d = feature_decomposition(model, h, prompt, self.target, self.foil, self.position, field=f"prompts[{i}]")
            decs.append(d)
            metas["logits"].append(d.metric)
            metas["metrics"].append(d.label)
            metas["positions"].append(d.position)
            active = (d.acts != 0).any(0) | (d.total != 0)
            idx = active.nonzero().flatten().tolist()
            df = pd.DataFrame({"prompt_idx": i, "feature": idx,
                               "activation": d.acts[d.position, idx].numpy(),
                               "direct": d.direct[idx].numpy() if d.direct is not None else np.nan,
                               "total": d.total[idx].numpy()})
            key = df["direct"].abs() if d.direct is not None else df["total"].abs()
            df = df.assign(_k=key.to_numpy()).sort_values(["_k", "feature"], ascending=[False, True]).drop(columns="_k")
            df["rank"] = np.arange(1, len(df) + 1)
            feats.append(df)
            dsum = float(d.direct.sum()) if d.direct is not None else float("nan")
            parts = {"features": (dsum, float(d.total.sum())), "error": (d.direct_error, d.total_error),
                     "bias": (d.direct_bias, d.total_bias), "special_tokens": (0.0 if d.direct is not None else np.nan,
                                                                            d.total_special),
                     "activation": (d.direct_total, d.total_activation)}
            for k, (a, b) in parts.items():
                terms.append({"prompt_idx": i, "term": k, "direct": a, "total": b})
            max_err = _worse(max_err, abs(float(d.total.sum()) + d.total_error + d.total_bias + d.total_special
                                          - d.total_activation))
            if d.direct is not None:
                max_err = _worse(max_err, abs(dsum + d.direct_error + d.direct_bias - d.direct_total))
            for p in range(len(d.ids)):
                a = d.acts[p]
                nz = int((a != 0).sum())
                top = torch_topk(a, min(self.top_k, a.numel()))
                toks.append({"prompt_idx": i, "position": p, "token": d.tokens[p], "token_id": d.ids[p],
                             "special": bool(d.special[p]), "l0": nz, "x_norm": float(d.x_norm[p]),
                             "error_norm": float(d.error_norm[p]),
                             "top_features": json.dumps([[int(f), round(float(v), 5)] for f, v in top if v != 0])})
        tables = {"features": pd.concat(feats, ignore_index=True), "terms": pd.DataFrame(terms),
                  "tokens": pd.DataFrame(toks)}
        meta = {"hook": h.hook, "sae": h.info.source, "d_sae": h.d_sae, "d_in": h.d_in, "max_sum_error": max_err,
                "sae_path": h.path, "sae_cache_hit": h.cache_hit, "sae_prepend_bos": h.info.prepend_bos, **metas,
                "attribution": "direct: activation x decoder row . u_eff / sigma (frozen final-norm scale); total: "
                               "activation x decoder row . d metric / d activation, summed over non-special positions"}
        if self.interventions is not None:
            tables["interventions"] = self._interventions(model, h, tables["features"], decs)
        if self.dashboards is not None:
            self._dashboards(model, h, tables, meta)
        elif len(tables["features"]):
            top = tables["features"][tables["features"]["prompt_idx"] == 0].sort_values("rank").head(self.top_k)
            tables["vocab"] = decoder_vocab(model, h, top["feature"].tolist(), 10)
        return SAEFeaturesResult(self, tables, meta)

    def _interventions(self, model, h, feats: pd.DataFrame, decs) -> pd.DataFrame:
        cfg = self.interventions
        assert cfg is not None
        rows = []
        for i, prompt in enumerate(self.prompts):
            if cfg.features == "top":
                chosen = feats[feats["prompt_idx"] == i].sort_values("rank")["feature"].head(cfg.k).tolist()
            else:
                bad = [f for f in cfg.features if not 0 <= f < h.d_sae]
                if bad:
                    raise SAEError(f"interventions.features: {bad} out of range 0..{h.d_sae - 1}")
                chosen = list(cfg.features)
            if not chosen:
                continue
            d = decs[i]
            pos = ("all" if cfg.intervene_at == "all" else [d.position] if cfg.intervene_at == "position"
                   else cfg.intervene_at)
            pool = (d.acts != 0).any(0).nonzero().flatten().tolist()
            # random set i (draw i + 1) is drawn with seed + i: among the features active on the
            # prompt, or among all features for steer (steering an inactive feature is meaningful)
            sets = [("top", 0, chosen, chosen)]
            for r in range(cfg.n_random):
                sets.append(("random", r + 1, random_features(h.d_sae, len(chosen), chosen, pool, cfg.seed + r),
                             random_features(h.d_sae, len(chosen), chosen, None, cfg.seed + r)))
            fmeans = None
            if "mean" in cfg.modes:  # each feature's mean activation over the prompt's non-special tokens
                keep = ~torch.tensor([bool(x) for x in d.special], dtype=torch.bool)
                fmeans = d.acts[keep].float().mean(0)
            for mode, v in cfg.plans():
                for name, draw, active_set, any_set in sets:
                    use = any_set if mode == "steer" else active_set
                    means = [float(fmeans[f]) for f in use] if mode == "mean" and fmeans is not None else None
                    res = feature_intervention(model, h, prompt, self.target, self.foil, use, mode,
                                               0.0 if math.isnan(v) else v, pos, means=means, full=True)
                    rows.append({"prompt_idx": i, "set": name, "draw": draw, "verb": mode, "value": v,
                                 "k": len(use), "units": json.dumps([int(f) for f in use]), **intervention_row(res)})
        return pd.DataFrame(rows)

    def _dashboards(self, model, h, tables: dict, meta: dict) -> None:
        cfg = self.dashboards
        assert cfg is not None
        f0 = tables["features"]
        chosen = f0[f0["prompt_idx"] == 0].sort_values("rank")["feature"].head(cfg.features).tolist()
        wins = eval_windows(model, h, cfg.corpus, cfg.max_tokens, cfg.seq_len, field="dashboards.corpus")
        ctx, hist = top_activating_contexts(model, h, chosen, wins, cfg.top_n, cfg.batch_size)
        top = f0[f0["prompt_idx"] == 0].sort_values("rank").head(max(self.top_k, cfg.features))["feature"].tolist()
        tables["vocab"] = decoder_vocab(model, h, top, cfg.vocab_k)
        tables["contexts"] = ctx
        tables["density"] = pd.DataFrame([{"feature": int(f), "activation": float(v)}
                                          for f, vals in hist.items() for v in vals],
                                         columns=["feature", "activation"])
        meta["dashboard_features"] = [int(f) for f in chosen]
        meta["dashboard_tokens"] = int(sum(len(w) for w in wins))


def torch_topk(a, k: int):
    import torch

    v, i = torch.topk(a, k)
    return list(zip(i.tolist(), v.tolist()))
