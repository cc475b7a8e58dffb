# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
# Over 600 lines (reason): the sae_train/sae_eval/sae_features kinds' configs, the features result (per-row tables, interventions, dashboards); the features result class is the piece to move out next.
"""SAE feature kinds over :mod:`tracekit.sae` (SAELens SAEs).

* ``kind: sae_features`` (:class:`SAEFeatures`): decompose each row (``prompts`` or a ``dataset``)
  into SAE features at the SAE's hook, attribute the row's own target logit (difference) at its own
  read position to them (direct and total; batched, one forward+backward pass per ``batch_size``
  rows), with the reconstruction error, decoder bias and special tokens as their own terms; per-row
  tables and aggregates over rows; optional
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

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from .. import plotting
from ..dataset import PreparedDataset, rows_from_prompts
from ..dla import row_positions
from ..errors import SAEError
from ..model.context import check_window
from ..sae import (
    SAEInfo,
    SAESpec,
    check_sae,
    decoder_vocab,
    eval_windows,
    random_features,
    sae_info,
    top_activating_contexts,
)
from ..sae.dashboard import feature_dashboards, prompt_activations, sae_identity
from ..sae.decompose import feature_decompositions
from ..sae.interventions import feature_interventions
from ..tokens import PositionSpec, check_length, encode
from ..units import InterventionVerbs, Verb, intervention_row, intervention_summary, intervention_text
from .base import (
    Indices,
    Result,
    RowInputs,
    RowTargetsExperiment,
    StrictModel,
    check_row_targets,
    dataset_meta,
    kind_dataset,
    prompt_rows,
    register,
    row_frame,
)
from .neurons import ROW_INTERVENTION_COLUMNS
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
        features: ``top`` (each row's own top ``k`` features by |contribution|) or a list of feature
            indices (the same on every row).
        k: how many top features.
        modes: any of ``zero`` (activation -> 0), ``mean`` (-> the feature's mean activation over
            the row's non-special tokens), ``clamp`` (-> ``clamp_value``), ``scale`` (x each of
            ``scale_factors``), ``steer`` (add each of ``steer_values`` x the decoder row); default
            ``[zero, steer]``. Retired: ``ablate`` (now ``zero``), ``amplify`` (now ``scale``).
        intervene_at: where the edit applies: ``all`` (every non-special token), ``position`` (each
            row's read position), or a list of token indices (BOS counted; every row).
        n_random: random control sets of the same size, per row (features active on the row for
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
        features: how many of the top features on average over rows (the ``features_mean`` table).
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


@dataclass(frozen=True)
class SAEFeaturesInputs(RowInputs):
    """What :meth:`SAEFeatures.prepare` builds once: the SAE's identity (hook, BOS setting, training
    context; no weights), the rows (token ids with the SAE's BOS setting, per-row target and foil
    ids, named positions) and each row's read position (an index into its own ids, BOS counted)."""

    info: SAEInfo
    data: PreparedDataset
    read_at: tuple[int, ...]


def _with_bos(model, data: PreparedDataset, prepend_bos: bool | None) -> PreparedDataset:
    """``data`` tokenized with the SAE's BOS setting: rows whose BOS count differs are encoded again
    and their named positions shifted by the difference (positions count the text's tokens after
    the BOS, so they name the same tokens)."""
    if prepend_bos is None:
        return data
    n_bos = len(encode(model, "", prepend_bos))
    if all(e.n_bos == n_bos for e in data.examples):
        return data
    out = []
    for e in data.examples:
        if e.n_bos == n_bos:
            out.append(e)
            continue
        shift = n_bos - e.n_bos
        cids = tuple(encode(model, str(e.row.corrupted), prepend_bos)) if e.corrupted_ids is not None else None
        out.append(replace(e, ids=tuple(encode(model, e.prompt, prepend_bos)), corrupted_ids=cids, n_bos=n_bos,
                           positions={k: v + shift for k, v in e.positions.items()}))
    return PreparedDataset(tuple(out), data.source, dict(data.dropped))


def features_mean(features: pd.DataFrame, n_rows: int) -> pd.DataFrame:
    """Per feature over all ``n_rows`` rows (a row where the feature is inactive counts 0, as its
    activation, direct and total attribution there are 0): ``feature``, ``mean_activation`` (at the
    read position), ``mean_direct`` (NaN when direct is undefined), ``mean_total``, ``n_rows_active``,
    ``top_rank`` (by ``|mean_direct|``, or ``|mean_total|`` where direct is undefined; ties: feature)."""
    cols = ["feature", "mean_activation", "mean_direct", "mean_total", "n_rows_active", "top_rank"]
    if not len(features):
        return pd.DataFrame(columns=cols)
    g = features.groupby("feature", sort=True)
    n = max(1, int(n_rows))
    out = pd.DataFrame({"mean_activation": g["activation"].sum() / n,
                        "mean_direct": g["direct"].sum(min_count=1) / n,
                        "mean_total": g["total"].sum() / n, "n_rows_active": g.size()}).reset_index()
    col = "mean_direct" if out["mean_direct"].notna().any() else "mean_total"
    out = out.assign(_k=out[col].abs()).sort_values(["_k", "feature"], ascending=[False, True], kind="stable")
    out = out.drop(columns="_k").reset_index(drop=True)
    out["top_rank"] = np.arange(1, len(out) + 1)
    return out[cols]


def _row_numbers(tokens: pd.DataFrame, terms: pd.DataFrame, feats: pd.DataFrame, row_ids: list) -> list[dict]:
    """Per row: ``sum_error`` (the worse of the total and direct sum identities), ``l0`` and
    ``relative_error_norm`` (means over the row's non-special tokens), ``n_active_features`` and the
    row's own top feature."""
    recs = []
    for rid in row_ids:
        t = terms[terms["row_id"] == rid].set_index("term")
        err = abs(t.loc["features", "total"] + t.loc["error", "total"] + t.loc["bias", "total"]
                  + t.loc["special_tokens", "total"] - t.loc["activation", "total"])
        if pd.notna(t.loc["features", "direct"]):
            err = _worse(float(err), abs(float(t.loc["features", "direct"] + t.loc["error", "direct"]
                                               + t.loc["bias", "direct"] - t.loc["activation", "direct"])))
        tk = tokens[(tokens["row_id"] == rid) & (~tokens["special"].astype(bool))]
        f = feats[feats["row_id"] == rid].sort_values("top_rank")
        top = f.iloc[0] if len(f) else None
        recs.append({"sum_error": float(err),
                     "l0": float(tk["l0"].mean()) if len(tk) else float("nan"),
                     "relative_error_norm": float((tk["error_norm"] / tk["x_norm"]).mean()) if len(tk) else float("nan"),
                     "n_active_features": int(len(f)),
                     "top_feature": None if top is None else int(top["feature"]),
                     "top_feature_activation": float("nan") if top is None else float(top["activation"]),
                     "top_feature_direct": float("nan") if top is None else float(top["direct"]),
                     "top_feature_total": float("nan") if top is None else float(top["total"])})
    return recs


class SAEFeaturesResult(Result):
    """Tables (``row_id`` = the dataset row's id; ``direct`` / ``total`` in logits):

    * ``features``: per row, each feature active on the row (at any token): ``row_id``, ``feature``,
      ``activation`` (at the row's read position), ``direct`` (its direct contribution there; NaN
      when the hook is not a residual write), ``total`` (activation x gradient, summed over the
      row's non-special positions), ``top_rank`` (the row's own ranking by ``|direct|``, or
      ``|total|`` where direct is undefined).
    * ``features_mean``: per feature over rows (0 where inactive): ``mean_activation``,
      ``mean_direct``, ``mean_total``, ``n_rows_active``, ``top_rank`` (by ``|mean_direct|`` or
      ``|mean_total|``).
    * ``terms``: per row: ``term`` (features / error / bias / special_tokens / activation),
      ``direct``, ``total``; the parts sum to the activation's.
    * ``tokens``: per row and position: ``token``, ``token_id``, ``special``, ``l0``, ``x_norm``,
      ``error_norm``, ``top_features`` (JSON ``[[feature, activation], ...]``).
    * ``rows``: one line per row: ``row_id``, the row's fields (``prompt``, ``target``, ``foil``,
      ``corrupted``, ``group``, ``pos_<NAME>``, extra columns; ``pos_<NAME>`` counted in the SAE's
      tokens), ``position`` (read index, BOS counted), ``token``, ``metric``, ``logit_diff`` (the
      model's logit difference there, or target logit without a foil), ``final_scale``,
      ``sum_error``, ``l0`` / ``relative_error_norm`` (means over the row's non-special tokens),
      ``n_active_features``, ``top_feature``, ``top_feature_activation``, ``top_feature_direct``,
      ``top_feature_total``.
    * when asked: ``interventions``, ``vocab`` (``feature``, ``side``, ``top_rank``, ``token``,
      ``token_id``, ``logit``), ``contexts`` (``feature``, ``top_rank``, ``activation``, ``window``,
      ``position``, ``token``, ``context``, ``tokens``, ``token_acts``), ``density`` (activation
      histograms) and ``prompt_acts`` (the dashboard features' activation on every token of every
      row: ``row_id``, ``feature``, ``position``, ``token``, ``special``, ``read``, ``activation``;
      :func:`tracekit.sae.dashboard.prompt_activations`).

    ``interventions``: one row per dataset row x (verb, value) x set; :data:`ROW_INTERVENTION_COLUMNS`,
    shared with ``neuron_attribution``: ``row_id``, ``set`` (top | random), ``draw`` (0 top,
    1..n_random), ``verb``, ``value`` (clamp value / scale factor / steer value; NaN for zero, mean),
    ``k``, ``units`` (JSON list of feature indices: the row's own top features, or its random set),
    ``clean_target_prob``, ``patched_target_prob``, ``delta_target_prob``, ``clean_logit_diff``,
    ``patched_logit_diff``, ``delta_logit_diff``, ``delta_target_log_prob`` (each row with its own
    target/foil, read at its own read position).

    Summary keys (``*_by_row`` lists follow the ``rows`` table):

    * ``hook``, ``sae``, ``d_sae``; ``n_rows``, ``row_id_by_row``, ``dataset_source``, ``rows_dropped``,
      ``metric`` (``logit(target) - logit(foil)`` or ``logit(target)``), ``target_by_row``,
      ``foil_by_row``, ``position_by_row``, ``rank_by`` (``direct`` or ``total``).
    * ``logit_diff_by_row`` / ``mean_logit_diff``: the model's metric per row / its mean over rows.
    * ``top_features_mean``: the ``top_k`` features by mean attribution over rows, each ``{feature,
      mean_activation, mean_direct, mean_total, n_rows_active, promotes, suppresses, top_contexts}``
      (readouts when they ran); ``top_features_by_row``: each row's own top ``top_k`` feature ids;
      ``top_feature_by_row``: each row's first.
    * ``mean_direct_by_term`` / ``mean_total_by_term``: ``{term: mean over rows}`` of the ``terms``
      table.
    * ``max_sum_error``: the worst row's sum-identity error.
    * ``l0_by_row`` / ``mean_l0`` and ``relative_error_norm_by_row`` / ``mean_relative_error_norm``:
      per row (mean over its non-special tokens) / the mean over rows.
    * ``interventions``: :func:`tracekit.units.intervention_summary` of the ``interventions`` table
      (top vs random sets; each entry's numbers averaged over rows, random ones also over draws), keyed
      ``zero``, ``mean``, ``clamp_x{value:g}``, ``scale_x{factor:g}``, ``steer_x{value:g}``; ``{}``
      when no intervention ran.
    """

    config: "SAEFeatures"
    main_table = "features"
    #: results saved before the interventions columns were shared with ``neuron_attribution``, before
    #: datasets (``prompt_idx`` -> ``row_id``) and before ``rank`` stopped shadowing ``DataFrame.rank``
    renamed_columns = {"interventions.features": "units", "interventions.clean_prob": "clean_target_prob",
                       "interventions.prob": "patched_target_prob", "interventions.delta_prob": "delta_target_prob",
                       "interventions.clean_logit": "clean_logit_diff", "interventions.logit": "patched_logit_diff",
                       "interventions.delta_logit": "delta_logit_diff", "rank": "top_rank", "prompt_idx": "row_id"}
    table_names = ("features", "features_mean", "terms", "tokens", "rows", "interventions", "vocab", "contexts",
                   "density", "prompt_acts")
    summary_keys = ("hook", "sae", "d_sae", "n_rows", "row_id_by_row", "dataset_source", "rows_dropped", "metric",
                    "target_by_row", "foil_by_row", "position_by_row", "rank_by", "logit_diff_by_row",
                    "mean_logit_diff", "top_features_mean", "top_features_by_row", "top_feature_by_row",
                    "mean_direct_by_term", "mean_total_by_term", "max_sum_error", "l0_by_row", "mean_l0",
                    "relative_error_norm_by_row", "mean_relative_error_norm", "interventions")

    @classmethod
    def _rename_old_columns(cls, tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
        """Today's tables from a result saved before datasets: ``rows`` (the model's metric per prompt
        was in the meta, not a table: ``logit_diff`` is NaN; target / foil come from the saved config)
        and ``features_mean`` derived from ``terms``, ``tokens`` and ``features``."""
        tables = super()._rename_old_columns(tables)
        if "rows" in tables or not {"terms", "tokens", "features"} <= set(tables):
            return tables
        out = dict(tables)
        ids = [int(x) for x in dict.fromkeys(tables["terms"]["row_id"])]
        recs = _row_numbers(tables["tokens"], tables["terms"], tables["features"], ids)
        out["rows"] = pd.DataFrame([{"row_id": i, "logit_diff": float("nan"), **r} for i, r in zip(ids, recs)])
        out["features_mean"] = features_mean(tables["features"], len(ids))
        return out

    def _rows(self) -> pd.DataFrame:
        """The ``rows`` table (a result saved before datasets: the fields from its config)."""
        rows = self.tables["rows"]
        cfg = self.config
        if "target" not in rows:
            by = dict(enumerate(rows_from_prompts(cfg.prompts, cfg.target, cfg.foil))) if cfg.prompts else {}
            rows = rows.assign(**{k: [getattr(by[int(i)], k) if int(i) in by else None for i in rows["row_id"]]
                                  for k in ("prompt", "target", "foil")})
        if "position" not in rows:
            pos = self.meta.get("positions") or []
            rows = rows.assign(position=[pos[j] if j < len(pos) else None for j in range(len(rows))])
        if rows["logit_diff"].isna().all() and self.meta.get("logits"):
            lg = self.meta["logits"]
            rows = rows.assign(logit_diff=[lg[j] if j < len(lg) else float("nan") for j in range(len(rows))])
        return rows

    def _rank_col(self) -> str:
        f = self.tables["features"]
        return "direct" if f["direct"].notna().any() else "total"

    def top(self, row_id: int | None = None, k: int | None = None) -> pd.DataFrame:
        """The top features: of row ``row_id`` (the ``features`` table, the row's own ranking), or on
        average over rows (``row_id=None``: the ``features_mean`` table); ``k`` (default ``top_k``)."""
        if row_id is None:
            return self.tables["features_mean"].sort_values("top_rank").head(k or self.config.top_k)
        f = self.tables["features"]
        f = f[f["row_id"] == row_id].sort_values("top_rank")
        return f.head(k or self.config.top_k)

    def summary(self) -> dict:
        cfg = self.config
        rows = self._rows()
        terms = self.tables["terms"]
        feats = self.tables["features"]
        vocab = self.tables.get("vocab", pd.DataFrame())
        ctx = self.tables.get("contexts", pd.DataFrame())
        dmeta = self.meta.get("dataset", {})
        has_foil = bool(rows["foil"].notna().all()) if "foil" in rows else False
        tops = []
        for r in self.top().itertuples():
            item = {"feature": int(r.feature), "mean_activation": round(float(r.mean_activation), 5),
                    "mean_direct": rounded(r.mean_direct), "mean_total": round(float(r.mean_total), 5),
                    "n_rows_active": int(r.n_rows_active)}
            if len(vocab):
                v = vocab[vocab["feature"] == r.feature]
                if len(v):
                    item["promotes"] = v[v["side"] == "promoted"].sort_values("top_rank")["token"].tolist()
                    item["suppresses"] = v[v["side"] == "suppressed"].sort_values("top_rank")["token"].tolist()
            if len(ctx):
                c = ctx[ctx["feature"] == r.feature].sort_values("top_rank")
                if len(c):
                    item["top_contexts"] = c["context"].head(3).tolist()
            tops.append(item)
        by_row = [[int(x) for x in feats[feats["row_id"] == rid].sort_values("top_rank")["feature"].head(cfg.top_k)]
                  for rid in rows["row_id"]]
        mean_term = terms.groupby("term", sort=False)[["direct", "total"]].mean()
        iv = self.tables.get("interventions", pd.DataFrame())
        return {
            "hook": self.meta.get("hook"), "sae": self.meta.get("sae"), "d_sae": self.meta.get("d_sae"),
            "n_rows": int(len(rows)),
            "row_id_by_row": [int(x) for x in rows["row_id"]],
            "dataset_source": dmeta.get("source"),
            "rows_dropped": dict(dmeta.get("dropped", {})),
            "metric": "logit(target) - logit(foil)" if has_foil else "logit(target)",
            "target_by_row": [None if pd.isna(x) else str(x) for x in rows["target"]],
            "foil_by_row": [None if pd.isna(x) else str(x) for x in rows["foil"]],
            "position_by_row": [None if pd.isna(x) else int(x) for x in rows["position"]],
            "rank_by": self._rank_col(),
            "logit_diff_by_row": [rounded(x, 6) for x in rows["logit_diff"]],
            "mean_logit_diff": rounded(rows["logit_diff"].mean(), 6),
            "top_features_mean": tops,
            "top_features_by_row": by_row,
            "top_feature_by_row": [f[0] if f else None for f in by_row],
            "mean_direct_by_term": {str(k): rounded(v) for k, v in mean_term["direct"].items()},
            "mean_total_by_term": {str(k): rounded(v) for k, v in mean_term["total"].items()},
            "max_sum_error": float(rows["sum_error"].max()),
            "l0_by_row": [rounded(x, 4) for x in rows["l0"]],
            "mean_l0": rounded(rows["l0"].mean(), 4),
            "relative_error_norm_by_row": [rounded(x) for x in rows["relative_error_norm"]],
            "mean_relative_error_norm": rounded(rows["relative_error_norm"].mean()),
            "interventions": intervention_summary(iv) if len(iv) else {},
        }

    def report(self) -> str:
        s = self.summary()
        over = f" (mean over {s['n_rows']} rows)" if s["n_rows"] > 1 else ""
        src = f" from {s['dataset_source']}" if s["dataset_source"] else ""
        ml = s["mean_logit_diff"]
        lines = [(f"SAE features [{self.config.step_name}] {s['sae']} at {s['hook']} (d_sae {s['d_sae']}); "
                  f"{s['n_rows']} row(s){src}; {s['metric']} = {'-' if ml is None else f'{ml:.4f}'}{over} at "
                  f"position {self.config.position}; ranked by |{s['rank_by']}|")]
        dropped = {k: v for k, v in s["rows_dropped"].items() if v}
        if dropped:
            lines.append("  rows dropped: " + ", ".join(f"{k}: {v}" for k, v in dropped.items()))

        def fmt(x, f):
            return "-" if x is None else format(x, f)
        rows = [[t["feature"], fmt(t["mean_activation"], ".3f"), fmt(t["mean_direct"], "+.4f"),
                 fmt(t["mean_total"], "+.4f"), t["n_rows_active"], " ".join(repr(x) for x in t.get("promotes", [])[:5])]
                for t in s["top_features_mean"]]
        lines.append(f"top features{over}:")
        lines.append(plotting.text_table(rows, ["feature", "activation", "direct", "total", "rows active", "promotes"],
                                         "><>>><"))
        lines.append(f"terms (direct | total){over}: " + ", ".join(
            f"{k} {fmt(s['mean_direct_by_term'].get(k), '+.4f')} | {fmt(v, '+.4f')}"
            for k, v in s["mean_total_by_term"].items()))
        if s["n_rows"] > 1:
            r = self._rows().head(20)
            lines.append(f"each row's own top feature ({len(r)} of {s['n_rows']} rows):")
            lines.append(plotting.text_table(
                [(int(x["row_id"]), repr(x["target"]), fmt(rounded(x["logit_diff"]), "+.4f"),
                  "-" if x["top_feature"] is None or pd.isna(x["top_feature"]) else int(x["top_feature"]))
                 for _, x in r.iterrows()], ["row_id", "target", "metric", "top feature"]))
        if s["interventions"]:
            lines.append(f"interventions on each row's top features vs random features (error term kept){over}:")
            lines.append(intervention_text(s["interventions"]))
        return "\n".join(lines)

    def figures(self) -> dict:
        col = self._rank_col()
        top = self.top()
        n = int(len(self.tables["rows"]))
        over = f" (mean over {n} rows)" if n > 1 else ""
        figs = {"top_features": plotting.bars({f"f{int(r.feature)}": float(getattr(r, f"mean_{col}"))
                                               for r in top.itertuples()},
                                              title=f"Top SAE features ({col} attribution){over}",
                                              ylabel=f"{col} attribution (logits)", xlabel="feature")}
        t = self.tables["terms"]
        t = t[t["term"] != "activation"].groupby("term", sort=False)["total"].mean()
        figs["terms"] = plotting.bars({str(k): float(v) for k, v in t.items()},
                                      title=f"Total attribution by term{over}", ylabel="logits", rotate=False)
        return figs

    def dashboards(self) -> dict[int, str]:
        """feature -> self-contained HTML page (from the ``contexts``, ``vocab``, ``density`` and
        ``prompt_acts`` tables; :func:`tracekit.sae.dashboard.feature_dashboards`)."""
        return feature_dashboards(self.tables, self.meta)

    def save(self, directory, figures: bool = True):
        """:meth:`Result.save`, then the dashboards as ``dashboard_feature_<f>.html`` next to it."""
        d = super().save(directory, figures=figures)
        for f, html in self.dashboards().items():
            (Path(d) / f"dashboard_feature_{f}.html").write_text(html, encoding="utf-8")
        return d


@register
class SAEFeatures(RowTargetsExperiment):
    """Decompose each row's activation at the SAE's hook into SAE features and attribute the row's
    target logit (difference) to them (direct, Elhage et al. 2021; total, attribution patching,
    Marks et al. 2024), in batched passes, each row with its own target/foil at its own position.

    Fields:
        sae: the SAE (:class:`tracekit.sae.SAESpec`: ``release``+``id``, ``path`` or ``train``).
        prompts: one string or a list (one row each); or
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`), each with its own target and foil.
        target: with ``prompts``: the one-token string whose logit is attributed (e.g. ``" Paris"``),
            for every prompt, or a list with one per prompt. Not given with a ``dataset``.
        foil: optional, the same forms; with it the metric is the logit difference
            ``logit[target] - logit[foil]`` (default none: the target's logit alone). Every row has a
            foil or none does.
        position: the read position, resolved per row in the row's tokens as the SAE reads them (with
            its BOS setting): an int (token index, BOS counted; -1 = last, the default), ``last``,
            ``token:<text>``, or a named position of the dataset's rows (``END``, ``IO``...).
        top_k: features listed / ranked per row and on average.
        batch_size: rows per forward(+backward) pass (default 8).
        interventions: optional :class:`SAEInterventionConfig` (each row's own top features).
        dashboards: optional :class:`SAEDashboardConfig`: per-feature HTML dashboards of the top
            features on average over rows (default none: no dashboards, no corpus scan).

    Tables and summary keys: :class:`SAEFeaturesResult`.

    Raises:
        SAEError: (from :meth:`check`, before any forward pass) SAE source, hook, width, model,
            basis; a row longer than the SAE's training context.
        TokenizationError: target/foil not one token; prompt too long; position not in a row.
        DatasetError: a row without a target, rows with and without foils, a named position a row
            does not have.
    """

    kind: Literal["sae_features"] = "sae_features"
    sae: SAESpec
    position: PositionSpec = -1
    top_k: int = Field(default=10, ge=1)
    batch_size: int = Field(default=8, ge=1)
    interventions: SAEInterventionConfig | None = None
    dashboards: SAEDashboardConfig | None = None

    result_class = SAEFeaturesResult

    retired = {"answer": "target", "wrong": "foil", "prompt": "prompts"}

    target_role = "the token whose logit is attributed"

    def prepare(self, model) -> SAEFeaturesInputs:
        """The SAE's identity (no weights), the rows prepared once with the SAE's BOS setting
        (prompts tokenized, per-row target/foil ids, named positions), each row checked against the
        model's and the SAE's context, and each row's read position (works on a
        :class:`tracekit.model.ModelInfo`)."""
        info = sae_info(self.sae, model, "sae")
        where = "dataset" if self.dataset is not None else "prompts"
        if self.dataset is None:
            data = prompt_rows(model, self.prompts, self.target, self.foil, prepend_bos=info.prepend_bos)
        else:
            data = _with_bos(model, kind_dataset(model, None, self.dataset, batch_size=self.batch_size),
                             info.prepend_bos)
        check_row_targets(data, where, "sae_features")
        for i, e in enumerate(data.examples):
            check_length(model, e.ids, f"{where}[{i}]", e.prompt)
            if info.context_size and len(e.ids) > int(info.context_size):
                raise SAEError(f"{where}[{i}] is {len(e.ids)} tokens, longer than the SAE's training context "
                               f"({info.context_size})")
        if self.dashboards is not None:
            check_window(model, self.dashboards.seq_len, "dashboards.seq_len")
        return SAEFeaturesInputs(info, data, tuple(row_positions(model, data, self.position)))

    def check(self, model) -> SAEFeaturesInputs:
        """:meth:`prepare`, then the SAE against the model (:func:`tracekit.sae.check_sae`: hook,
        width, model, activation basis)."""
        inputs = self.prepare(model)
        check_sae(model, inputs.info, "sae")
        return inputs

    def _run(self, model, inputs: SAEFeaturesInputs, progress: bool = True) -> SAEFeaturesResult:
        # the engines read the prepared ids, targets and positions: nothing is tokenized again
        h = load_handle(self, model, progress)
        data = inputs.data
        decs = feature_decompositions(model, h, [list(e.ids) for e in data.examples], list(inputs.targets),
                                      list(inputs.read_at), batch_size=self.batch_size, prompts=data.prompts)
        feats, terms, toks, recs = [], [], [], []
        for e, d in zip(data.examples, decs):
            rid = e.row_id
            active = (d.acts != 0).any(0) | (d.total != 0)
            idx = active.nonzero().flatten().tolist()
            df = pd.DataFrame({"row_id": rid, "feature": idx,
                               "activation": d.acts[d.position, idx].numpy(),
                               "direct": d.direct[idx].numpy() if d.direct is not None else np.nan,
                               "total": d.total[idx].numpy()})
            key = df["direct"].abs() if d.direct is not None else df["total"].abs()
            df = df.assign(_k=key.to_numpy()).sort_values(["_k", "feature"], ascending=[False, True]).drop(columns="_k")
            df["top_rank"] = np.arange(1, len(df) + 1)
            feats.append(df)
            dsum = float(d.direct.sum()) if d.direct is not None else float("nan")
            parts = {"features": (dsum, float(d.total.sum())), "error": (d.direct_error, d.total_error),
                     "bias": (d.direct_bias, d.total_bias), "special_tokens": (0.0 if d.direct is not None else np.nan,
                                                                            d.total_special),
                     "activation": (d.direct_total, d.total_activation)}
            for k, (a, b) in parts.items():
                terms.append({"row_id": rid, "term": k, "direct": a, "total": b})
            for p in range(len(d.ids)):
                a = d.acts[p]
                top = torch_topk(a, min(self.top_k, a.numel()))
                toks.append({"row_id": rid, "position": p, "token": d.tokens[p], "token_id": d.ids[p],
                             "special": bool(d.special[p]), "l0": int((a != 0).sum()), "x_norm": float(d.x_norm[p]),
                             "error_norm": float(d.error_norm[p]),
                             "top_features": json.dumps([[int(f), round(float(v), 5)] for f, v in top if v != 0])})
            recs.append({"position": d.position, "token": d.tokens[d.position], "metric": d.label,
                         "logit_diff": d.metric, "final_scale": d.final_scale})
        features = pd.concat(feats, ignore_index=True)
        tables = {"features": features, "features_mean": features_mean(features, len(data)),
                  "terms": pd.DataFrame(terms), "tokens": pd.DataFrame(toks)}
        nums = _row_numbers(tables["tokens"], tables["terms"], features, [e.row_id for e in data.examples])
        tables["rows"] = row_frame(data, [{**r, **x} for r, x in zip(recs, nums)])
        meta = {"hook": h.hook, "sae": h.info.source, "d_sae": h.d_sae, "d_in": h.d_in,
                "max_sum_error": float(tables["rows"]["sum_error"].max()),
                "sae_path": h.path, "sae_cache_hit": h.cache_hit, "sae_prepend_bos": h.info.prepend_bos,
                "sae_identity": sae_identity(h),
                "dataset": dataset_meta(data),
                "attribution": "direct: activation x decoder row . u_eff / sigma (frozen final-norm scale); total: "
                               "activation x decoder row . d metric / d activation, summed over non-special positions"}
        if self.interventions is not None:
            tables["interventions"] = self._interventions(model, h, inputs, features, decs)
        fm = tables["features_mean"]
        if self.dashboards is not None:
            self._dashboards(model, h, tables, meta, decs, [e.row_id for e in data.examples])
        elif len(fm):
            tables["vocab"] = decoder_vocab(model, h, fm["feature"].head(self.top_k).tolist(), 10).rename(
                columns={"rank": "top_rank"})
        return SAEFeaturesResult(self, tables, meta)

    def _interventions(self, model, h, inputs: SAEFeaturesInputs, feats: pd.DataFrame, decs) -> pd.DataFrame:
        """One row per dataset row x (verb, value) x set: each row's own top features (or the listed
        ones) and its random control sets, edited on every row in batched passes, each row with its
        own target/foil at its own read position."""
        cfg = self.interventions
        assert cfg is not None
        data = inputs.data
        if cfg.features != "top":
            bad = [f for f in cfg.features if not 0 <= f < h.d_sae]
            if bad:
                raise SAEError(f"interventions.features: {bad} out of range 0..{h.d_sae - 1}")
        plan_rows = []  # per dataset row: (index, sets, where, per-feature means)
        for i, (e, d) in enumerate(zip(data.examples, decs)):
            if cfg.features == "top":
                chosen = feats[feats["row_id"] == e.row_id].sort_values("top_rank")["feature"].head(cfg.k).tolist()
            else:
                chosen = list(cfg.features)
            if not chosen:
                continue
            n = len(d.ids)
            where = torch.zeros(n, dtype=torch.bool)
            if cfg.intervene_at == "all":
                where[:] = True
            elif cfg.intervene_at == "position":
                where[d.position] = True
            else:
                for q in cfg.intervene_at:
                    if not -n <= int(q) < n:
                        raise SAEError(f"interventions.intervene_at: {q} is out of range for row {e.row_id}'s {n} "
                                       "tokens")
                    where[int(q) % n] = True
            pool = (d.acts != 0).any(0).nonzero().flatten().tolist()
            # random set r (draw r + 1) is drawn with seed + r: among the features active on the
            # row, or among all features for steer (steering an inactive feature is meaningful)
            sets = [("top", 0, chosen, chosen)]
            for r in range(cfg.n_random):
                sets.append(("random", r + 1, random_features(h.d_sae, len(chosen), chosen, pool, cfg.seed + r),
                             random_features(h.d_sae, len(chosen), chosen, None, cfg.seed + r)))
            fmeans = None
            if "mean" in cfg.modes:  # each feature's mean activation over the row's non-special tokens
                keep = ~torch.tensor([bool(x) for x in d.special], dtype=torch.bool)
                fmeans = d.acts[keep].float().mean(0)
            plan_rows.append((i, sets, where.tolist(), fmeans))
        if not plan_rows:
            return pd.DataFrame(columns=ROW_INTERVENTION_COLUMNS)
        idx = [i for i, *_ in plan_rows]
        ids = [list(data.examples[i].ids) for i in idx]
        tgts = [inputs.targets[i] for i in idx]
        read = [inputs.read_at[i] for i in idx]
        wh = [w for _, _, w, _ in plan_rows]
        out = []
        clean = None
        for j, (mode, v) in enumerate(cfg.plans()):
            for s in range(1 + cfg.n_random):
                use = [sets[s][3] if mode == "steer" else sets[s][2] for _, sets, _, _ in plan_rows]
                means = ([[float(fm[f]) for f in u] for u, (_, _, _, fm) in zip(use, plan_rows)]
                         if mode == "mean" else None)
                res = feature_interventions(model, h, ids, tgts, read, use, mode, 0.0 if math.isnan(v) else v,
                                            where=wh, means=means, batch_size=self.batch_size, clean_metrics=clean)
                clean = [r["clean"] for r in res]
                for q, (i, sets, _, _), u, r in zip(range(len(idx)), plan_rows, use, res):
                    name, draw = sets[s][0], sets[s][1]
                    out.append(((q, j, s), {"row_id": data.examples[i].row_id, "set": name, "draw": draw, "verb": mode,
                                            "value": v, "k": len(u), "units": json.dumps([int(f) for f in u]),
                                            **intervention_row(r)}))
        out.sort(key=lambda t: t[0])  # per row, then (verb, value), then set
        return pd.DataFrame([r for _, r in out], columns=ROW_INTERVENTION_COLUMNS)

    def _dashboards(self, model, h, tables: dict, meta: dict, decs, row_ids: list) -> None:
        cfg = self.dashboards
        assert cfg is not None
        fm = tables["features_mean"].sort_values("top_rank")
        chosen = fm["feature"].head(cfg.features).tolist()
        wins = eval_windows(model, h, cfg.corpus, cfg.max_tokens, cfg.seq_len, field="dashboards.corpus",
                            seq_field="dashboards.seq_len")
        ctx, hist = top_activating_contexts(model, h, chosen, wins, cfg.top_n, cfg.batch_size)
        top = fm["feature"].head(max(self.top_k, cfg.features)).tolist()
        tables["vocab"] = decoder_vocab(model, h, top, cfg.vocab_k).rename(columns={"rank": "top_rank"})
        tables["contexts"] = ctx.rename(columns={"rank": "top_rank"})
        tables["density"] = pd.DataFrame([{"feature": int(f), "activation": float(v)}
                                          for f, vals in hist.items() for v in vals],
                                         columns=["feature", "activation"])
        tables["prompt_acts"] = prompt_activations(decs, row_ids, chosen)
        meta["dashboard_features"] = [int(f) for f in chosen]
        meta["dashboard_tokens"] = int(sum(len(w) for w in wins))
        meta["dashboard_windows"] = len(wins)


def torch_topk(a, k: int):
    import torch

    v, i = torch.topk(a, k)
    return list(zip(i.tolist(), v.tolist()))
