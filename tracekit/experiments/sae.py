"""SAE feature kinds over :mod:`tracekit.sae` (SAELens SAEs).

* ``kind: sae_features`` (:class:`SAEFeatures`): decompose prompts into SAE features at the SAE's
  hook, attribute the target logit (difference) to them (direct and total), with the
  reconstruction error, decoder bias and special tokens as their own terms; optional
  interventions (ablate / clamp / steer against random-feature controls) and per-feature HTML
  dashboards (top-activating corpus contexts, decoder vocabulary readout, activation density).
* ``kind: sae_eval`` (:class:`SAEEval`): the SAE spliced into the model on corpus windows (the
  held-out tokens of an SAE trained here): MSE, explained variance, L0, dead / dense features,
  CE loss recovered against zero and mean ablation, KL to the clean run.
* ``kind: sae_train`` (:class:`SAETrain`): train (or find in the cache) the SAE of a ``sae.train``
  block with SAELens' runner and evaluate it on held-out text.

Every kind takes the same ``sae:`` block (:class:`tracekit.sae.SAESpec`). Units: activations in
the SAE's input units; ``direct``/``total``/``contribution`` in logits; losses in nats.
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from pydantic import Field, field_validator

from ..errors import SAEError
from ..sae import (
    SAESpec,
    check_sae,
    decoder_vocab,
    eval_windows,
    feature_dashboard_html,
    feature_decomposition,
    feature_intervention,
    load_sae,
    random_features,
    sae_info,
    sae_quality,
    top_activating_contexts,
)
from .base import Experiment, Indices, Prompts, Result, StrictModel, register


def _worse(a: float, b: float) -> float:
    """The larger error, NaN when either is NaN (Python's max keeps the first of a NaN pair: a silent 0)."""
    return float("nan") if math.isnan(a) or math.isnan(b) else max(a, b)


__all__ = [
    "SAEDashboardConfig",
    "SAEEval",
    "SAEEvalResult",
    "SAEFeatures",
    "SAEFeaturesResult",
    "SAEInterventionConfig",
    "SAETrain",
    "SAETrainResult",
]


def _check_common(exp, model) -> None:
    info = sae_info(exp.sae, model, "sae")
    check_sae(model, info, "sae")


def _load(exp, model, progress):
    return load_sae(exp.sae, model, "sae", progress=progress)


# =============================================================================================
# sae_features


class SAEInterventionConfig(StrictModel):
    """Interventions on the top features (error term kept, so only the edited features move).

    Fields:
        features: ``top`` (the step's top ``k`` features of each prompt by |contribution|) or a list
            of feature indices.
        k: how many top features.
        modes: ``ablate`` (activation -> 0), ``clamp`` (-> ``clamp_value``), ``steer`` (add
            ``steer_values`` x the decoder row).
        clamp_value: the activation ``clamp`` sets.
        steer_values: the multiples of the decoder row ``steer`` adds.
        intervene_at: where the edit applies: ``all`` (every non-special token), ``position`` (the
            step's read position), or a list of token indices.
        n_random: random control sets of the same size (features active on the prompt for
            ablate/clamp; any feature for steer).
        seed: the random control sets' seed.
    """

    features: Literal["top"] | Indices = "top"
    k: int = Field(default=3, ge=1)
    modes: list[Literal["ablate", "clamp", "steer"]] = Field(default_factory=lambda: ["ablate", "steer"])
    clamp_value: float = 0.0
    steer_values: list[float] = Field(default_factory=lambda: [10.0])
    intervene_at: Literal["all", "position"] | list[int] = "all"
    n_random: int = Field(default=3, ge=0)
    seed: int = 0

    retired = {"positions": "intervene_at; all | position | token indices"}


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
    from ..plotting import plt

    p = plt()
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


class SAEFeaturesResult(Result):
    """Tables: ``features`` (per prompt, each feature active on the prompt: activation at the read
    position, direct contribution there, total attribution over positions, rank by |direct| (or
    |total| where direct is undefined)), ``terms`` (per prompt: features / error / bias /
    special_tokens / activation, direct and total; the parts sum to the activation), ``tokens``
    (per prompt and position: token, special, L0, ||x||, ||error||, top features), and, when asked,
    ``interventions``, ``vocab``, ``contexts`` and ``density`` (activation histograms)."""

    main_table = "features"

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
            "direct": {k: _r(t0.loc[k, "direct"]) for k in t0.index},
            "total": {k: _r(t0.loc[k, "total"]) for k in t0.index},
            "max_sum_error": float(self.meta.get("max_sum_error", float("nan"))),
            "l0_mean": round(float(tk0["l0"].mean()), 4) if len(tk0) else None,
            "relative_error_norm": round(float((tk0["error_norm"] / tk0["x_norm"]).mean()), 5) if len(tk0) else None,
            "n_prompts": int(terms["prompt_idx"].nunique()),
        }
        iv = self.tables.get("interventions", pd.DataFrame())
        if len(iv):
            agg = {}
            for (mode, value), g in iv.groupby(["mode", "value"], dropna=False):
                key = mode if mode != "steer" else f"steer_x{value:g}"
                top = g[g["set"] == "top"]
                rnd = g[g["set"] == "random"]
                agg[key] = {"top_delta_prob": _r(top["delta_prob"].mean(), 6),
                            "top_delta_logit": _r(top["delta_logit"].mean()),
                            "random_delta_prob_mean": _r(rnd["delta_prob"].mean(), 6) if len(rnd) else None,
                            "random_delta_logit_mean": _r(rnd["delta_logit"].mean()) if len(rnd) else None,
                            "clean_prob": _r(top["clean_prob"].mean(), 6), "prob": _r(top["prob"].mean(), 6)}
            out["interventions"] = agg
        return out

    def report(self) -> str:
        from ..plotting import text_table

        s = self.summary()
        lines = [(f"SAE features [{self.config.step_name}] {s['sae']} at {s['hook']} (d_sae {s['d_sae']}); "
                  f"{s['metric']} = {s['logit']:.4f} at position {s['position']}; ranked by |{s['rank_by']}|")]
        rows = [[t["feature"], f"{t['activation']:.3f}", "-" if t["direct"] is None else f"{t['direct']:+.4f}",
                 f"{t['total']:+.4f}", " ".join(repr(x) for x in t.get("promotes", [])[:5])] for t in s["top_features"]]
        lines.append(text_table(rows, ["feature", "activation", "direct", "total", "promotes"], "><>><"))
        lines.append("terms (direct | total): " + ", ".join(
            f"{k} {s['direct'][k] if s['direct'][k] is not None else float('nan'):+.4f} | {s['total'][k]:+.4f}"
            for k in s["total"]))
        if "interventions" in s:
            for k, v in s["interventions"].items():
                lines.append(f"{k}: top d_prob {v['top_delta_prob']:+.5f} d_logit {v['top_delta_logit']:+.4f}; random "
                             f"d_prob {v['random_delta_prob_mean']} d_logit {v['random_delta_logit_mean']}")
        return "\n".join(lines)

    def figures(self) -> dict:
        from ..plotting import bars

        col = self._rank_col()
        top = self.top(0)
        figs = {"top_features": bars({f"f{int(r.feature)}": float(getattr(r, col)) for r in top.itertuples()},
                                     title=f"Top SAE features ({col} attribution), prompt 0",
                                     ylabel=f"{col} attribution (logits)", xlabel="feature")}
        t = self.tables["terms"]
        t0 = t[(t["prompt_idx"] == 0) & (t["term"] != "activation")]
        figs["terms"] = bars({r.term: float(r.total) for r in t0.itertuples()},
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
                     "activation on prompt 0 (read position)": _r(row["activation"].iloc[0]) if len(row) else None,
                     "direct contribution (logits)": _r(row["direct"].iloc[0]) if len(row) else None,
                     "total attribution (logits)": _r(row["total"].iloc[0]) if len(row) else None,
                     "corpus tokens scanned": n_tok,
                     "activation density": _r(len(vals) / n_tok, 6) if n_tok else None}
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


def _r(x, nd: int = 5):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if not np.isfinite(v) else round(v, nd)


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

    def check(self, model) -> None:
        from ..dla import resolve_target
        from ..tokens import check_length, encode

        resolve_target(model, self.target, self.foil)
        info = sae_info(self.sae, model, "sae")
        check_sae(model, info, "sae")
        for i, p in enumerate(self.prompts):
            ids = encode(model, p, prepend_bos=info.prepend_bos)
            check_length(model, ids, f"prompts[{i}]", p)
            if info.context_size and len(ids) > int(info.context_size):
                raise SAEError(f"prompts[{i}] is {len(ids)} tokens, longer than the SAE's training context "
                               f"({info.context_size})")

    def _run(self, model, progress: bool = True) -> SAEFeaturesResult:
        h = _load(self, model, progress)
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
            sets = [("top", 0, chosen)]
            for r in range(cfg.n_random):
                sets.append(("random", r, random_features(h.d_sae, len(chosen), chosen, pool, cfg.seed + r)))
            for mode in cfg.modes:
                values = cfg.steer_values if mode == "steer" else [cfg.clamp_value if mode == "clamp" else 0.0]
                for v in values:
                    for name, draw, fs in sets:
                        use = fs
                        if mode == "steer" and name == "random":
                            use = random_features(h.d_sae, len(chosen), chosen, None, cfg.seed + draw)
                        res = feature_intervention(model, h, prompt, self.target, self.foil, use, mode, v, pos)
                        rows.append({"prompt_idx": i, "mode": mode, "value": float(v), "set": name, "draw": draw,
                                     "features": json.dumps(use), **res})
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


# =============================================================================================
# sae_eval


class SAEEvalResult(Result):
    """Tables: ``metrics`` (one row: every quality number, SAELens' definitions), ``features``
    (per feature: density, max activation, dead, dense)."""

    main_table = "metrics"

    def summary(self) -> dict:
        m = self.tables["metrics"].to_dict("records")[0]  # per-column types (counts stay ints)
        counts = {"n_dead", "n_dense", "n_tokens", "n_ce_tokens", "n_windows"}
        out = {k: (int(v) if k in counts and v == v else _r(v, 6) if isinstance(v, (float, np.floating))
                   else (int(v) if isinstance(v, (np.integer,)) else v))
               for k, v in m.items()}
        f = self.tables["features"]
        out["dead_features"] = f[f["dead"]]["feature"].head(50).tolist()
        out["dense_features"] = f[f["dense"]]["feature"].head(50).tolist()
        out["hook"] = self.meta.get("hook")
        out["sae"] = self.meta.get("sae")
        return out

    def report(self) -> str:
        s = self.summary()
        return (f"SAE eval [{self.config.step_name}] {s['sae']} at {s['hook']} on {s['n_tokens']} tokens: "
                f"explained variance {s['explained_variance']}, L0 {s['l0']}, MSE {s['mse']}, CE loss recovered "
                f"{s['ce_loss_recovered']} (zero abl.) / {s['ce_loss_recovered_mean']} (mean abl.), KL {s['kl']} nats, "
                f"dead {s['n_dead']}, dense {s['n_dense']} (> {s['dense_threshold']})\n"
                f"CE loss: clean {s['ce_loss_clean']}, SAE {s['ce_loss_sae']}, zero {s['ce_loss_zero']}, "
                f"mean {s['ce_loss_mean']} nats")

    def figures(self) -> dict:
        from ..plotting import plt

        p = plt()
        f = self.tables["features"]
        dens = f["density"].to_numpy()
        fig, ax = p.subplots(figsize=(6, 3.2))
        live = dens[dens > 0]
        if len(live):
            ax.hist(np.log10(live), bins=40)
        ax.set_xlabel("log10 feature density (dead features omitted)")
        ax.set_ylabel("features")
        ax.set_title(f"Feature density ({int((dens == 0).sum())} dead of {len(dens)})")
        fig.tight_layout()
        return {"density": fig}


@register
class SAEEval(Experiment):
    """Splice the SAE in and measure its quality on corpus windows (SAELens' metrics).

    Fields:
        sae: the SAE.
        corpus: text to evaluate on: ``stdlib``, a text/JSONL file or directory path, or a list of
            paths (default: an SAE trained here is evaluated on its held-out tokens, any other on ``stdlib``).
        max_tokens: corpus tokens evaluated (the first ``max_tokens``; default 4096; for an SAE trained
            here, at most its ``eval_tokens``).
        seq_len: window length (default: the SAE's context size, else 64).
        batch_size: token windows per forward pass (default 8).
        dense_threshold: a feature active on more than this fraction of tokens is ``dense``.
    """

    kind: Literal["sae_eval"] = "sae_eval"
    sae: SAESpec
    corpus: str | list[str] | None = None
    max_tokens: int = Field(default=4096, ge=16)
    seq_len: int | None = Field(default=None, ge=4)
    batch_size: int = Field(default=8, ge=1)
    dense_threshold: float = Field(default=0.1, gt=0, le=1)

    result_class = SAEEvalResult

    def check(self, model) -> None:
        _check_common(self, model)

    def _run(self, model, progress: bool = True) -> SAEEvalResult:
        h = _load(self, model, progress)
        wins = eval_windows(model, h, self.corpus, self.max_tokens, self.seq_len)
        q = sae_quality(model, h, wins, self.batch_size, self.dense_threshold, progress)
        return _eval_result(self, h, q, wins)


def _eval_result(exp, h, q, wins):
    dens = q.density.numpy()
    feats = pd.DataFrame({"feature": np.arange(len(dens)), "density": dens, "max_activation": q.max_act.numpy(),
                          "dead": dens == 0, "dense": dens > q.metrics["dense_threshold"]})
    meta = {"hook": h.hook, "sae": h.info.source, "d_sae": h.d_sae, "sae_path": h.path,
            "eval_text": "held-out corpus tokens" if (h.spec and h.spec.train and exp.corpus is None) else
            str(exp.corpus or "stdlib"),
            "definitions": "sae_lens.evals: mse = mean_t ||x - x_hat||^2; explained_variance = 1 - E||x - x_hat||^2 / "
                           "(E||x||^2 - ||E x||^2); ce_loss_recovered = (ce_zero - ce_sae) / (ce_zero - ce_clean)"}
    return SAEEvalResult(exp, {"metrics": pd.DataFrame([q.metrics]), "features": feats}, meta)


# =============================================================================================
# sae_train


class SAETrainResult(SAEEvalResult):
    """Tables: ``training`` (one row: directory, cache hit, time, tokens), plus ``metrics`` /
    ``features`` on the held-out tokens (as :class:`SAEEvalResult`)."""

    def summary(self) -> dict:
        out = super().summary()
        t = self.tables["training"].iloc[0].to_dict()
        out.update({k: (_r(v, 3) if isinstance(v, float) else v) for k, v in t.items()})
        return out

    def report(self) -> str:
        s = self.summary()
        head = (f"SAE train [{self.config.step_name}] {'cache hit' if s['cache_hit'] else 'trained'} -> {s['path']} "
                f"({s.get('train_tokens')} tokens, {s.get('train_seconds')} s)")
        return head + "\n" + super().report()


@register
class SAETrain(Experiment):
    """Train an SAE with SAELens' runner on this model (or load it from the cache) and evaluate it
    on held-out corpus tokens.

    Fields:
        sae: must be a ``train:`` block.
        max_tokens: held-out corpus tokens the trained SAE is evaluated on (default 4096; at most
            ``sae.train.eval_tokens``).
        batch_size: evaluation token windows per forward pass (default 8).
        dense_threshold: a feature active on more than this fraction of evaluation tokens is
            ``dense`` (in (0, 1]; default 0.1).
    """

    kind: Literal["sae_train"] = "sae_train"
    sae: SAESpec
    max_tokens: int = Field(default=4096, ge=16)
    batch_size: int = Field(default=8, ge=1)
    dense_threshold: float = Field(default=0.1, gt=0, le=1)

    result_class = SAETrainResult

    @field_validator("sae")
    @classmethod
    def _needs_train(cls, v: SAESpec):
        if v.train is None:
            raise ValueError("sae_train needs a train: block (sae: {train: {hook: blocks.L.hook_resid_pre}})")
        return v

    @property
    def corpus(self):
        return None

    def check(self, model) -> None:
        _check_common(self, model)

    def _run(self, model, progress: bool = True) -> SAETrainResult:
        h = _load(self, model, progress)
        wins = eval_windows(model, h, None, self.max_tokens)
        q = sae_quality(model, h, wins, self.batch_size, self.dense_threshold, progress)
        base = _eval_result(self, h, q, wins)
        stats = dict(h.train_stats)
        stats.pop("train", None)
        row = {"path": h.path, "cache_hit": bool(h.cache_hit), **stats}
        tables = {**base.tables, "training": pd.DataFrame([row])}
        return SAETrainResult(self, tables, base.meta)
