"""The result of ``kind: neuron_attribution`` (:class:`NeuronAttributionResult`): summary, report
and figures from the tables that :mod:`tracekit.neuron_tables` builds (the kind is
:class:`tracekit.experiments.neurons.NeuronAttribution`). Units: ``contribution``/``logit_diff`` in
logits, ``*_prob`` in probabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pandas as pd

from .. import plotting
from ..dataset import rows_from_prompts
from ..neuron_tables import top_by_row
from ..units import (
    intervention_summary,
    intervention_text,
)
from .base import (
    Result,
)
from .typed_frames import column, records, scalar, where

if TYPE_CHECKING:
    from .neurons import NeuronAttribution

__all__ = ["NeuronAttributionResult"]


class NeuronAttributionResult(Result):
    """Tables (``row_id`` = the dataset row's id; contributions in logits):

    * ``neurons``: every neuron of the chosen layers per row: ``row_id``, ``layer``, ``neuron``,
      ``activation`` (``hook_post``), ``logit_per_activation``, ``contribution``.
    * ``layers``: per row and layer: ``mlp`` (the MLP's direct attribution), ``mlp_bias`` (its
      ``b_out`` term), ``neuron_sum``, ``additivity_error`` (``|neuron_sum + mlp_bias - mlp|``).
    * ``rows``: one line per row: ``row_id``, the row's fields (``prompt``, ``target``, ``foil``,
      ``corrupted``, ``group``, ``pos_<NAME>``, extra columns), ``position`` (read index, BOS
      counted), ``token`` (read there), ``metric``, ``logit_diff`` (the model's own logit difference,
      or target logit without a foil), ``attributed_logit_diff``, ``final_scale``, ``mlp_total`` /
      ``neuron_sum`` (over the chosen layers), ``max_additivity_error``, ``top_neuron`` (``"L.N"``,
      the row's own top neuron by ``rank_by``), ``top_neuron_layer``, ``top_neuron_idx``,
      ``top_neuron_activation``, ``top_neuron_contribution``.
    * ``top_by_row``: each row's own top ``top_k`` neurons: ``row_id``, ``top_rank``, ``layer``,
      ``neuron``, ``activation``, ``logit_per_activation``, ``contribution``.
    * ``top``: the top ``top_k`` neurons on average over rows, per layer (``scope`` = ``layer``) and
      over the chosen layers (``overall``), ranked by ``mean_contribution`` (or its ``|.|``):
      ``scope``, ``top_rank``, ``layer``, ``neuron``, ``mean_activation``,
      ``mean_logit_per_activation``, ``mean_contribution``, ``std_contribution`` (ddof 1; NaN for
      one row), ``n_rows``.
    * ``values``: value readout of the overall top neurons (``layer``, ``neuron``, ``side``,
      ``top_rank``, ``token``, ``token_id``, ``logit_per_activation``, ``activation_sign``: the sign
      of the mean activation, by which the readout is flipped).
    * ``contexts``: key readout (``layer``, ``neuron``, ``top_rank``, ``activation``, ``token``,
      ``context``, ``doc_id``, ``window``, ``position``).
    * ``interventions``: one row per (verb, value) x set x row; :data:`ROW_INTERVENTION_COLUMNS`
      (shared with ``sae_features``): ``row_id``, ``set`` (top | random), ``draw`` (0 top,
      1..n_random), ``verb``, ``value`` (clamp value / scale factor / steer value; NaN for zero,
      mean), ``k``, ``units`` (JSON list of ``"L.N"``), ``clean_target_prob``,
      ``patched_target_prob``, ``delta_target_prob``, ``clean_logit_diff``, ``patched_logit_diff``,
      ``delta_logit_diff``, ``delta_target_log_prob`` (each row with its own target/foil, read at its
      own position).

    Summary keys (``*_by_row`` lists follow the ``rows`` table):

    * ``n_rows``, ``row_id_by_row``, ``dataset_source``, ``rows_dropped``, ``metric``
      (``logit(target) - logit(foil)`` or ``logit(target)``, the same form on every row), ``layers``,
      ``target_by_row``, ``foil_by_row``, ``position_by_row``.
    * ``logit_diff_by_row`` / ``mean_logit_diff``: the model's logit difference per row / its mean.
    * ``max_additivity_error``: the worst ``|neurons + b_out - MLP|`` over rows and layers.
    * ``mean_mlp_attribution_by_layer``: per chosen layer (``layers`` order), the MLP's direct
      attribution averaged over rows.
    * ``top_neurons_mean``: the overall top neurons by mean contribution over rows, each
      ``{neuron: "L.N", layer, index, mean_activation, mean_contribution, std_contribution,
      promotes, suppresses, top_contexts}`` (readouts when they ran);
      ``top_mean_contribution_sum``: the sum of their mean contributions; ``top_mean_by_layer``:
      ``{layer: ["L.N", ...]}`` the top neurons of each layer by mean contribution.
    * ``top_neuron_by_row`` / ``top_neuron_contribution_by_row``: each row's own top neuron and its
      contribution.
    * ``interventions``: :func:`tracekit.units.intervention_summary` of the ``interventions`` table
      (top set vs random sets, each entry's numbers averaged over rows, random ones also over draws),
      keyed ``zero``, ``mean``, ``clamp_x{value:g}``, ``scale_x{factor:g}``, ``steer_x{value:g}``;
      ``{}`` when no intervention ran.
    """

    config: "NeuronAttribution"
    main_table = "top"
    #: results saved before the one verb set (the scale factor column, the neuron list), before
    #: datasets (``prompt_idx`` -> ``row_id``; the ``top`` table's columns were already means over
    #: prompts) and before ``rank`` stopped shadowing ``DataFrame.rank``.
    renamed_columns = {"interventions.factor": "value", "interventions.neurons": "units", "rank": "top_rank",
                       "prompt_idx": "row_id", "top.activation": "mean_activation",
                       "top.logit_per_activation": "mean_logit_per_activation",
                       "top.contribution": "mean_contribution"}
    table_names = ("neurons", "layers", "rows", "top", "top_by_row", "values", "contexts", "interventions")
    summary_keys = ("n_rows", "row_id_by_row", "dataset_source", "rows_dropped", "metric", "layers", "target_by_row",
                    "foil_by_row", "position_by_row", "logit_diff_by_row", "mean_logit_diff", "max_additivity_error",
                    "mean_mlp_attribution_by_layer", "top_neurons_mean", "top_mean_contribution_sum",
                    "top_mean_by_layer", "top_neuron_by_row", "top_neuron_contribution_by_row", "interventions")

    @classmethod
    def _rename_old_columns(cls, tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
        """Today's tables from a result saved before datasets: a ``rows`` table and ``top_by_row``
        are derived from ``layers`` and ``neurons`` (the model's logit per prompt was not saved:
        ``logit_diff`` is NaN there; target / foil come from the saved config)."""
        tables = super()._rename_old_columns(tables)
        if "rows" in tables or "layers" not in tables or "neurons" not in tables:
            return tables
        out = dict(tables)
        lay = tables["layers"].copy()
        lay["additivity_error"] = (lay["neuron_sum"] + lay["mlp_bias"] - lay["mlp"]).abs()
        out["layers"] = lay
        tb = top_by_row(tables["neurons"], 10, "contribution")
        recs = []
        for rid, g in lay.groupby("row_id", sort=False):
            t = where(tb, tb["row_id"] == rid).iloc[0]
            recs.append({"row_id": int(cast(Any, rid)), "logit_diff": float("nan"), "mlp_total": scalar(g["mlp"].sum()),
                         "neuron_sum": scalar(g["neuron_sum"].sum()),
                         "max_additivity_error": scalar(g["additivity_error"].max()),
                         "top_neuron": f"{int(t['layer'])}.{int(t['neuron'])}", "top_neuron_layer": int(t["layer"]),
                         "top_neuron_idx": int(t["neuron"]), "top_neuron_activation": float(t["activation"]),
                         "top_neuron_contribution": float(t["contribution"])})
        out["rows"] = pd.DataFrame(recs)
        out["top_by_row"] = tb
        return out

    def _rows(self) -> pd.DataFrame:
        """The ``rows`` table (a result saved before datasets: the fields from its config)."""
        rows = self.tables["rows"]
        cfg = self.config
        if "target" not in rows:
            ts = rows_from_prompts(cfg.prompts, cfg.target, cfg.foil) if cfg.prompts else []
            by = {i: r for i, r in enumerate(ts)}
            rows = rows.assign(prompt=[by[int(i)].prompt if int(i) in by else None for i in rows["row_id"]],
                               target=[by[int(i)].target if int(i) in by else None for i in rows["row_id"]],
                               foil=[by[int(i)].foil if int(i) in by else None for i in rows["row_id"]])
        if "position" not in rows:
            rows = rows.assign(position=-1)
        return rows

    def _top(self, scope="overall"):
        t = self.tables["top"]
        return where(t, t["scope"] == scope).sort_values("top_rank")

    def summary(self) -> dict:
        rows = self._rows()
        lay = self.tables["layers"]
        dmeta = self.meta.get("dataset", {})
        has_foil = bool(rows["foil"].notna().all()) if "foil" in rows else False
        layers = sorted(int(x) for x in lay["layer"].unique())
        out: dict = {
            "n_rows": int(len(rows)),
            "row_id_by_row": [int(x) for x in rows["row_id"]],
            "dataset_source": dmeta.get("source"),
            "rows_dropped": dict(dmeta.get("dropped", {})),
            "metric": "logit(target) - logit(foil)" if has_foil else "logit(target)",
            "layers": layers,
            "target_by_row": [None if pd.isna(x) else str(x) for x in rows["target"]],
            "foil_by_row": [None if pd.isna(x) else str(x) for x in rows["foil"]],
            "position_by_row": [int(x) for x in rows["position"]],
            "logit_diff_by_row": [float(x) for x in rows["logit_diff"]],
            "mean_logit_diff": scalar(rows["logit_diff"].mean()),
            "max_additivity_error": scalar((lay["neuron_sum"] + lay["mlp_bias"] - lay["mlp"]).abs().max()),
            "mean_mlp_attribution_by_layer": [round(scalar(column(where(lay, lay["layer"] == L), "mlp").mean()), 5)
                                              for L in layers],
        }
        vals = self.tables.get("values", pd.DataFrame())
        ctx = self.tables.get("contexts", pd.DataFrame())
        tops = []
        for r in records(self._top()):
            item = {"neuron": f"{r.layer}.{r.neuron}", "layer": int(r.layer), "index": int(r.neuron),
                    "mean_activation": round(float(r.mean_activation), 5),
                    "mean_contribution": round(float(r.mean_contribution), 5),
                    "std_contribution": (None if "std_contribution" not in self.tables["top"]
                                         or pd.isna(r.std_contribution) else round(float(r.std_contribution), 5))}
            if len(vals):
                v = where(vals, (vals["layer"] == r.layer) & (vals["neuron"] == r.neuron))
                item["promotes"] = column(where(v, v["side"] == "promoted").sort_values("top_rank"), "token").tolist()
                item["suppresses"] = column(where(v, v["side"] == "suppressed").sort_values("top_rank"), "token").tolist()
            if len(ctx):
                c = where(ctx, (ctx["layer"] == r.layer) & (ctx["neuron"] == r.neuron)).sort_values("top_rank")
                item["top_contexts"] = c["context"].tolist()
            tops.append(item)
        out["top_neurons_mean"] = tops
        out["top_mean_contribution_sum"] = round(scalar(self._top()["mean_contribution"].sum()), 5)
        per_layer = {}
        for L, g in self._top("layer").groupby("layer"):
            per_layer[str(int(cast(Any, L)))] = [f"{int(cast(Any, L))}.{int(n)}"
                                                 for n in column(g.sort_values("top_rank"), "neuron")]
        out["top_mean_by_layer"] = per_layer
        out["top_neuron_by_row"] = [str(x) for x in rows["top_neuron"]]
        out["top_neuron_contribution_by_row"] = [round(float(x), 5) for x in rows["top_neuron_contribution"]]
        iv = self.tables.get("interventions", pd.DataFrame())
        out["interventions"] = intervention_summary(iv) if len(iv) else {}
        return out

    def report(self) -> str:
        s = self.summary()
        rows = self._rows()
        L = s["layers"]
        src = f" from {s['dataset_source']}" if s["dataset_source"] else ""
        lines = [f"neuron attribution [{self.config.step_name}]: {s['n_rows']} row(s){src}; metric {s['metric']} "
                 f"(mean {s['mean_logit_diff']:.4f} logits over rows); layers "
                 f"{L if len(L) <= 8 else str(len(L)) + ' layers'}"]
        dropped = {k: v for k, v in s["rows_dropped"].items() if v}
        if dropped:
            lines.append("  rows dropped: " + ", ".join(f"{k}: {v}" for k, v in dropped.items()))
        lines += ["MLP direct attribution by layer (mean over rows): " + ", ".join(
                      f"{layer}: {v:+.3f}" for layer, v in zip(L, s["mean_mlp_attribution_by_layer"])
                      if len(L) <= 8 or abs(v) > 0.2),
                  f"neurons + b_out = MLP attribution, max |error| over rows {s['max_additivity_error']:.2e}",
                  f"top {len(s['top_neurons_mean'])} neurons by mean contribution over rows "
                  f"(sum {s['top_mean_contribution_sum']:+.3f} logits):"]
        for t in s["top_neurons_mean"]:
            lines.append(f"  {t['neuron']:>8}  mean act {t['mean_activation']:+8.3f}  mean contribution "
                         f"{t['mean_contribution']:+.4f}")
            if "promotes" in t:
                lines.append(f"           promotes {t['promotes'][:8]}")
                lines.append(f"           suppresses {t['suppresses'][:5]}")
            for c in t.get("top_contexts", [])[:3]:
                lines.append(f"           context: {c!r}")
        if s["n_rows"] > 1:
            shown = rows.head(20)
            lines.append(f"each row's own top neuron ({len(shown)} of {len(rows)} rows):")
            lines.append(plotting.text_table(
                [(int(r.row_id), repr(r.target), f"{r.logit_diff:+.4f}", r.top_neuron,
                  f"{r.top_neuron_contribution:+.4f}") for r in records(shown)],
                ["row_id", "target", "logit_diff", "top neuron", "contribution"]))
        iv = s["interventions"]
        if iv:
            k = max((v["k"] or 0) for v in iv.values())
            lines.append(f"interventions on the top-{k} neurons vs random k of the same layers (mean over rows):")
            lines.append(intervention_text(iv))
        return "\n".join(lines)

    def figures(self) -> dict:
        figs = {}
        top = self._top()
        n = int(len(self.tables["rows"]))
        over = f" (mean over {n} rows)" if n > 1 else ""
        if len(top):
            values = {f"{int(r.layer)}.{int(r.neuron)}": float(r.mean_contribution) for r in records(top)}
            figs["top_neurons"] = plotting.bars(values, title=f"Top neurons (layer.neuron){over}",
                                                ylabel="direct contribution (logits)")
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
            ax.set_ylabel("change in target probability" + (" (mean over rows)" if n > 1 else ""))
            ax.legend(fontsize=8)
            ax.set_title("Intervention: top-k neurons vs random control")
            fig.tight_layout()
            figs["interventions"] = fig
        return figs
