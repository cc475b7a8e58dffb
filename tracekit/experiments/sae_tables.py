"""Tables of ``kind: sae_features`` (:class:`tracekit.experiments.sae.SAEFeatures`): the per-row
decompositions of :func:`tracekit.sae.decompose.feature_decompositions` shaped into the ``features``,
``terms``, ``tokens`` and ``rows`` tables, the ``features_mean`` aggregate, and the result class
(:class:`SAEFeaturesResult`: summary, report, figures, dashboards). Units: activations in the SAE's
input units; ``direct`` / ``total`` / ``contribution`` in logits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pandas as pd
import torch

from .. import plotting
from ..dataset import rows_from_prompts
from ..sae.dashboard import feature_dashboards
from ..sae.decompose import FeatureDecomposition
from ..units import intervention_summary, intervention_text
from .base import Result
from .frames import column, select, tuples
from .sae_quality import rounded

if TYPE_CHECKING:
    from .sae import SAEFeatures

__all__ = ["SAEFeaturesResult", "features_mean", "row_numbers", "decomposition_tables", "top_features"]


def _worse(a: float, b: float) -> float:
    """The larger error, NaN when either is NaN (Python's max keeps the first of a NaN pair: a silent 0)."""
    return float("nan") if math.isnan(a) or math.isnan(b) else max(a, b)


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
    sums = {c: cast(pd.Series, g[c].sum()) for c in ("activation", "total")}
    out = pd.DataFrame({"mean_activation": sums["activation"] / n,
                        "mean_direct": cast(pd.Series, g["direct"].sum(min_count=1)) / n,
                        "mean_total": sums["total"] / n, "n_rows_active": g.size()}).reset_index()
    col = "mean_direct" if column(out, "mean_direct").notna().any() else "mean_total"
    out = out.assign(_k=column(out, col).abs()).sort_values(["_k", "feature"], ascending=[False, True], kind="stable")
    out = out.drop(columns="_k").reset_index(drop=True)
    out["top_rank"] = np.arange(1, len(out) + 1)
    return out.loc[:, cols]


def row_numbers(tokens: pd.DataFrame, terms: pd.DataFrame, feats: pd.DataFrame,
                row_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Per row (``row_ids``, in order; from the ``tokens``, ``terms`` and ``features`` tables):
    ``sum_error`` (the worse of the total and direct sum identities, logits), ``l0`` and
    ``relative_error_norm`` (means over the row's non-special tokens), ``n_active_features`` and the
    row's own top feature."""
    recs = []
    for rid in row_ids:
        t = select(terms, column(terms, "row_id") == rid).set_index("term")
        err = abs(t.loc["features", "total"] + t.loc["error", "total"] + t.loc["bias", "total"]
                  + t.loc["special_tokens", "total"] - t.loc["activation", "total"])
        if pd.notna(t.loc["features", "direct"]):
            err = _worse(float(err), abs(float(t.loc["features", "direct"] + t.loc["error", "direct"]
                                               + t.loc["bias", "direct"] - t.loc["activation", "direct"])))
        tk = select(tokens, (column(tokens, "row_id") == rid) & (~column(tokens, "special").astype(bool)))
        f = select(feats, column(feats, "row_id") == rid).sort_values("top_rank")
        top = f.iloc[0] if len(f) else None
        recs.append({"sum_error": float(err),
                     "l0": float(column(tk, "l0").mean()) if len(tk) else float("nan"),
                     "relative_error_norm": float((column(tk, "error_norm") / column(tk, "x_norm")).mean())
                     if len(tk) else float("nan"),
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
        recs = row_numbers(tables["tokens"], tables["terms"], tables["features"], ids)
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
        if column(rows, "logit_diff").isna().all() and self.meta.get("logits"):
            lg = self.meta["logits"]
            rows = rows.assign(logit_diff=[lg[j] if j < len(lg) else float("nan") for j in range(len(rows))])
        return rows

    def _rank_col(self) -> str:
        return "direct" if column(self.tables["features"], "direct").notna().any() else "total"

    def top(self, row_id: int | None = None, k: int | None = None) -> pd.DataFrame:
        """The top features: of row ``row_id`` (the ``features`` table, the row's own ranking), or on
        average over rows (``row_id=None``: the ``features_mean`` table); ``k`` (default ``top_k``)."""
        if row_id is None:
            return self.tables["features_mean"].sort_values("top_rank").head(k or self.config.top_k)
        f = self.tables["features"]
        f = select(f, column(f, "row_id") == row_id).sort_values("top_rank")
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
        for r in tuples(self.top()):
            item = {"feature": int(r.feature), "mean_activation": round(float(r.mean_activation), 5),
                    "mean_direct": rounded(r.mean_direct), "mean_total": round(float(r.mean_total), 5),
                    "n_rows_active": int(r.n_rows_active)}
            if len(vocab):
                v = select(vocab, column(vocab, "feature") == r.feature)
                if len(v):
                    side = column(v, "side")
                    item["promotes"] = column(select(v, side == "promoted").sort_values("top_rank"), "token").tolist()
                    item["suppresses"] = column(select(v, side == "suppressed").sort_values("top_rank"),
                                                "token").tolist()
            if len(ctx):
                c = select(ctx, column(ctx, "feature") == r.feature).sort_values("top_rank")
                if len(c):
                    item["top_contexts"] = column(c, "context").head(3).tolist()
            tops.append(item)
        by_row = [[int(x) for x in column(select(feats, column(feats, "row_id") == rid).sort_values("top_rank"),
                                          "feature").head(cfg.top_k)]
                  for rid in rows["row_id"]]
        mean_term = cast(pd.DataFrame, terms.groupby("term", sort=False)[["direct", "total"]].mean())
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
            "max_sum_error": float(column(rows, "sum_error").max()),
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
                [(int(x.row_id), repr(x.target), fmt(rounded(x.logit_diff), "+.4f"),
                  "-" if x.top_feature is None or pd.isna(x.top_feature) else int(x.top_feature))
                 for x in tuples(r)], ["row_id", "target", "metric", "top feature"]))
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
                                               for r in tuples(top)},
                                              title=f"Top SAE features ({col} attribution){over}",
                                              ylabel=f"{col} attribution (logits)", xlabel="feature")}
        t = self.tables["terms"]
        t = cast(pd.Series, select(t, column(t, "term") != "activation").groupby("term", sort=False)["total"].mean())
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


def top_features(a: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` largest entries of ``a`` (``[d_sae]`` activations at one token) as ``(feature, activation)``
    pairs, largest first (:func:`torch.topk`)."""
    v, i = torch.topk(a, k)
    return list(zip(i.tolist(), v.tolist()))


def decomposition_tables(decs: Sequence[FeatureDecomposition], row_ids: Sequence[int],
                         top_k: int) -> tuple[dict[str, pd.DataFrame], list[dict[str, Any]]]:
    """The ``features``, ``features_mean``, ``terms`` and ``tokens`` tables of one decomposition per row
    (columns in :class:`SAEFeaturesResult`; ``top_features`` of each token lists its ``top_k``), and per
    row the ``rows`` table's numbers read at the row's read position: ``position``, ``token``,
    ``metric`` (the metric's label), ``logit_diff``, ``final_scale`` (logits; the scale unitless)."""
    feats, terms, toks, recs = [], [], [], []
    for rid, d in zip(row_ids, decs):
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
            top = top_features(a, min(top_k, a.numel()))
            toks.append({"row_id": rid, "position": p, "token": d.tokens[p], "token_id": d.ids[p],
                         "special": bool(d.special[p]), "l0": int((a != 0).sum()), "x_norm": float(d.x_norm[p]),
                         "error_norm": float(d.error_norm[p]),
                         "top_features": json.dumps([[int(f), round(float(v), 5)] for f, v in top if v != 0])})
        recs.append({"position": d.position, "token": d.tokens[d.position], "metric": d.label,
                     "logit_diff": d.metric, "final_scale": d.final_scale})
    features = pd.concat(feats, ignore_index=True)
    tables = {"features": features, "features_mean": features_mean(features, len(row_ids)),
              "terms": pd.DataFrame(terms), "tokens": pd.DataFrame(toks)}
    return tables, recs
