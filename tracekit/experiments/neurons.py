# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
# Over 600 lines (reason): the neuron kind's config (attribution, key readout, interventions) and its result class with per-row and mean tables; the result class is the piece to move out next.
"""FFN neuron attribution as an experiment kind, per dataset row.

``kind: neuron_attribution`` (:class:`NeuronAttribution`): per-neuron direct contributions of
chosen MLP blocks to each row's target logit (difference) at its read position, read as key-value
memories (Geva et al. 2021; 2022): top neurons per row and on average over rows (per layer and
overall), the tokens the average top neurons' value vectors promote/suppress, their top-activating
corpus contexts (key readout), and a check by intervention (the verbs of :mod:`tracekit.units`:
zero, mean, clamp, scale, steer, on the top-k against k random neurons of the same layers, on every
row with its own target/foil).

Rows come from ``prompts`` (with ``target``/``foil``: a string for every prompt, a list for one per
prompt) or a ``dataset`` (each row its own target and foil). The computations are in
:mod:`tracekit.neurons` (notebook-usable; one batched forward pass per ``batch_size`` rows on the
ids prepared here); this module validates, calls them and shapes tables, summaries, reports and
figures. Units: ``contribution``/``logit_diff`` in logits, ``*_prob`` in probabilities.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
import torch
from pydantic import Field
from tqdm.auto import tqdm

from .. import plotting
from ..dataset import PreparedDataset, rows_from_prompts
from ..dla import check_layers, row_positions
from ..model.context import check_window
from ..model.info import HookedModel
from ..neurons import (
    key_readout,
    neuron_contributions,
    neuron_interventions,
    prompt_means,
    random_neurons,
    value_readout,
)
from ..units import (
    INTERVENTION_COLUMNS,
    InterventionVerbs,
    Verb,
    intervention_row,
    intervention_summary,
    intervention_text,
)
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

__all__ = ["NeuronAttribution", "NeuronAttributionInputs", "NeuronAttributionResult", "KeyReadoutConfig",
           "AblationConfig", "ROW_INTERVENTION_COLUMNS"]

#: The columns of the unit kinds' ``interventions`` tables: :data:`tracekit.units.INTERVENTION_COLUMNS`
#: with the row named by its dataset ``row_id`` (``prompt_idx`` before datasets).
ROW_INTERVENTION_COLUMNS = ["row_id" if c == "prompt_idx" else c for c in INTERVENTION_COLUMNS]
if "row_id" not in ROW_INTERVENTION_COLUMNS:
    ROW_INTERVENTION_COLUMNS.insert(0, "row_id")


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
            when it runs, else the mean over the rows' tokens, BOS excluded), ``clamp`` (:= ``clamp_value``),
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
class NeuronAttributionInputs(RowInputs):
    """What :meth:`NeuronAttribution.prepare` builds once: the rows (token ids, per-row target and
    foil ids, named positions), the MLP blocks attributed, and each row's read position (an index
    into its own ids, BOS counted)."""

    data: PreparedDataset
    layers: tuple[int, ...]
    read_at: tuple[int, ...]


def _ranked(df: pd.DataFrame, col: str, rank_by: str) -> pd.DataFrame:
    """``df`` ordered by ``col`` (``rank_by='contribution'``: largest first) or by ``|col|`` (``abs``);
    ties keep table order."""
    key = df[col] if rank_by == "contribution" else df[col].abs()
    return df.loc[key.sort_values(ascending=False, kind="stable").index]


def mean_over_rows(neurons: pd.DataFrame) -> pd.DataFrame:
    """Per neuron over rows (the ``neurons`` table): ``mean_activation``, ``mean_logit_per_activation``,
    ``mean_contribution``, ``std_contribution`` (sample std, ddof 1; NaN for one row), ``n_rows``."""
    g = neurons.groupby(["layer", "neuron"], sort=True)
    out = pd.DataFrame({"mean_activation": g["activation"].mean(),
                        "mean_logit_per_activation": g["logit_per_activation"].mean(),
                        "mean_contribution": g["contribution"].mean(),
                        "std_contribution": g["contribution"].std(ddof=1), "n_rows": g.size()})
    return out.reset_index()


def top_by_row(neurons: pd.DataFrame, k: int, rank_by: str) -> pd.DataFrame:
    """Each row's own top ``k`` neurons (over every chosen layer): ``row_id``, ``top_rank``,
    ``layer``, ``neuron``, ``activation``, ``logit_per_activation``, ``contribution``."""
    parts = []
    for _, g in neurons.groupby("row_id", sort=False):
        t = _ranked(g, "contribution", rank_by).head(k)
        parts.append(t.assign(top_rank=np.arange(1, len(t) + 1)))
    cols = ["row_id", "top_rank", "layer", "neuron", "activation", "logit_per_activation", "contribution"]
    return pd.concat(parts, ignore_index=True)[cols] if parts else pd.DataFrame(columns=cols)


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
            t = tb[tb["row_id"] == rid].iloc[0]
            recs.append({"row_id": int(rid), "logit_diff": float("nan"), "mlp_total": float(g["mlp"].sum()),
                         "neuron_sum": float(g["neuron_sum"].sum()),
                         "max_additivity_error": float(g["additivity_error"].max()),
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
        return t[t["scope"] == scope].sort_values("top_rank")

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
            "mean_logit_diff": float(rows["logit_diff"].mean()),
            "max_additivity_error": float((lay["neuron_sum"] + lay["mlp_bias"] - lay["mlp"]).abs().max()),
            "mean_mlp_attribution_by_layer": [round(float(lay[lay["layer"] == L]["mlp"].mean()), 5) for L in layers],
        }
        vals = self.tables.get("values", pd.DataFrame())
        ctx = self.tables.get("contexts", pd.DataFrame())
        tops = []
        for r in self._top().itertuples():
            item = {"neuron": f"{r.layer}.{r.neuron}", "layer": int(r.layer), "index": int(r.neuron),
                    "mean_activation": round(float(r.mean_activation), 5),
                    "mean_contribution": round(float(r.mean_contribution), 5),
                    "std_contribution": (None if "std_contribution" not in self.tables["top"]
                                         or pd.isna(r.std_contribution) else round(float(r.std_contribution), 5))}
            if len(vals):
                v = vals[(vals["layer"] == r.layer) & (vals["neuron"] == r.neuron)]
                item["promotes"] = v[v["side"] == "promoted"].sort_values("top_rank")["token"].tolist()
                item["suppresses"] = v[v["side"] == "suppressed"].sort_values("top_rank")["token"].tolist()
            if len(ctx):
                c = ctx[(ctx["layer"] == r.layer) & (ctx["neuron"] == r.neuron)].sort_values("top_rank")
                item["top_contexts"] = c["context"].tolist()
            tops.append(item)
        out["top_neurons_mean"] = tops
        out["top_mean_contribution_sum"] = round(float(self._top()["mean_contribution"].sum()), 5)
        per_layer = {}
        for L, g in self._top("layer").groupby("layer"):
            per_layer[str(int(L))] = [f"{int(L)}.{int(n)}" for n in g.sort_values("top_rank")["neuron"]]
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
                [(int(r["row_id"]), repr(r["target"]), f"{r['logit_diff']:+.4f}", r["top_neuron"],
                  f"{r['top_neuron_contribution']:+.4f}") for _, r in shown.iterrows()],
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
            values = {f"{int(r.layer)}.{int(r.neuron)}": float(r.mean_contribution) for r in top.itertuples()}
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


@register
class NeuronAttribution(RowTargetsExperiment):
    """Which FFN neurons write each row's target into the residual stream, what they promote, when
    they fire, and whether removing them matters (Geva et al. 2021; 2022; DLA per Elhage et al. 2021).

    Fields:
        prompts: one string or a list (one row each); or
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`: inline ``rows``, a file ``path``, or
            a ``generator``), each with its own ``target`` and ``foil``.
        target: with ``prompts``: a one-token string for every prompt, or a list with one per prompt
            (each row's own answer). Not given with a ``dataset``.
        foil: optional, the same forms; the metric is ``logit[target]`` (- ``logit[foil]``). Every row
            has a foil or none does.
        position: the read position (:class:`tracekit.tokens.Position`), resolved per row: an int (an
            index into the row's tokens, BOS counted when prepended; negative from the end), ``last``
            (default), ``token:<text>``, or a named position of the dataset's rows (``END``, ``IO``...;
            counted in the row's own tokens after BOS, whatever the padding).
        layers: MLP blocks (block indices; negative from the end) to attribute, or ``all``.
        top_k: neurons listed per row, per layer and overall.
        rank_by: ``contribution`` (most positive first: neurons that push the target) or ``abs``.
        value_tokens: promoted/suppressed tokens per top neuron (0: skip the value readout).
        contexts: key readout settings, or null to skip (see :class:`KeyReadoutConfig`).
        ablation: intervention settings, or null to skip (see :class:`AblationConfig`).
        batch_size: rows per forward pass (attribution and interventions; default 8; lower it on
            out-of-memory).

    Tables and summary keys: :class:`NeuronAttributionResult`. The top neurons read out, read by key
    and intervened on are the top by mean contribution over rows; each row's own top neurons are in
    the ``top_by_row`` table.

    Raises:
        TokenizationError: target/foil not one token, position not in a prompt.
        DatasetError: a row without a target, rows with and without foils, a named position a row
            does not have.
        AttributionError: unknown layer. CorpusError: unreadable corpus.
    """

    kind: Literal["neuron_attribution"] = "neuron_attribution"
    layers: Union[Literal["all"], Indices, int] = "all"
    top_k: int = Field(default=10, ge=1)
    rank_by: Literal["contribution", "abs"] = "contribution"
    value_tokens: int = Field(default=10, ge=0)
    contexts: Optional[KeyReadoutConfig] = Field(default_factory=KeyReadoutConfig)
    ablation: Optional[AblationConfig] = Field(default_factory=AblationConfig)
    batch_size: int = Field(default=8, ge=1)

    result_class = NeuronAttributionResult

    target_role = "the token whose logit the neurons write"

    def prepare(self, model: HookedModel) -> NeuronAttributionInputs:
        """The rows prepared once (prompts tokenized, per-row target/foil ids, named positions), the
        layers and each row's read position (tokenizer and config only: works on a
        :class:`tracekit.model.ModelInfo`; ``filter: correct`` runs the model where it can).

        Raises:
            TokenizationError / DatasetError / AttributionError: see the class docstring.
            ConfigError: ``contexts.seq_len`` longer than the model's context.
        """
        if self.dataset is None:
            data = prompt_rows(model, self.prompts, self.target, self.foil)
        else:
            data = kind_dataset(model, None, self.dataset, batch_size=self.batch_size)
        check_row_targets(data, "dataset" if self.dataset is not None else "prompts", "neuron attribution")
        layers = tuple(check_layers(model, self.layers, "layers"))
        if self.contexts is not None:
            check_window(model, self.contexts.seq_len, "contexts.seq_len")
        return NeuronAttributionInputs(data, layers, tuple(row_positions(model, data, self.position)))

    @torch.no_grad()
    def _run(self, model: HookedModel, inputs: NeuronAttributionInputs, progress: bool = True) -> NeuronAttributionResult:
        # the engines read the prepared ids, targets and positions: nothing is tokenized again
        data = inputs.data
        layers = list(inputs.layers)
        das = neuron_contributions(model, data, layers=layers, batch_size=self.batch_size, read_at=inputs.read_at)
        frames, lay_rows = [], []
        for d in das:
            f = d.neurons_frame().drop(columns=["prompt_idx"])
            f.insert(0, "row_id", d.row_id)
            frames.append(f)
            for L in layers:
                ns = float(d.neuron_contrib[L].sum())
                lay_rows.append({"row_id": d.row_id, "layer": L, "mlp": float(d.mlp[L]),
                                 "mlp_bias": float(d.mlp_bias[L]), "neuron_sum": ns,
                                 "additivity_error": abs(ns + float(d.mlp_bias[L]) - float(d.mlp[L]))})
        neurons = pd.concat(frames, ignore_index=True)
        lay = pd.DataFrame(lay_rows)
        tb = top_by_row(neurons, self.top_k, self.rank_by)
        recs = []
        for d in das:
            t = tb[tb["row_id"] == d.row_id].iloc[0]
            g = lay[lay["row_id"] == d.row_id]
            recs.append({"position": d.position, "token": d.tokens[d.position], "metric": d.target.label,
                         "logit_diff": d.logit, "attributed_logit_diff": d.attributed, "final_scale": d.final_scale,
                         "mlp_total": float(g["mlp"].sum()), "neuron_sum": float(g["neuron_sum"].sum()),
                         "max_additivity_error": float(g["additivity_error"].max()),
                         "top_neuron": f"{int(t['layer'])}.{int(t['neuron'])}", "top_neuron_layer": int(t["layer"]),
                         "top_neuron_idx": int(t["neuron"]), "top_neuron_activation": float(t["activation"]),
                         "top_neuron_contribution": float(t["contribution"])})
        top_rows, overall = self._top_rows(neurons)
        tables = {"neurons": neurons, "layers": lay, "rows": row_frame(data, recs), "top": pd.DataFrame(top_rows),
                  "top_by_row": tb}

        if self.value_tokens:
            tables["values"] = pd.concat([
                value_readout(model, L, n, k=self.value_tokens, sign=1.0 if a >= 0 else -1.0).assign(
                    activation_sign=1 if a >= 0 else -1) for L, n, a in overall], ignore_index=True).rename(
                columns={"rank": "top_rank"})

        abl = self.ablation
        k_abl = min(abl.k or self.top_k, len(overall)) if abl else 0
        top_set = [(L, n) for L, n, _ in overall[:k_abl]]
        rand_sets = [random_neurons(model, top_set, seed=abl.seed + i, exclude=top_set) for i in range(abl.n_random)] if abl else []

        means = None
        meta = {"process_weights": bool(getattr(getattr(model, "tracekit_spec", None), "process_weights", True)),
                "dataset": dataset_meta(data), "ranking": "top / values / contexts / interventions: the top neurons "
                "by mean contribution over rows; top_by_row: each row's own"}
        if self.contexts is not None:
            means = self._contexts(model, overall, top_set, rand_sets, tables, meta, progress)
        if abl is not None and top_set:
            if means is None and "mean" in abl.modes:
                means = prompt_means(model, data, top_set + [x for s in rand_sets for x in s],
                                     batch_size=self.batch_size)
                meta["mean_source"] = "the rows' tokens (BOS excluded)"
            tables["interventions"] = self._interventions(model, inputs, top_set, rand_sets, means, progress)
        return NeuronAttributionResult(self, tables, meta)

    def _top_rows(self, neurons: pd.DataFrame) -> tuple[list[dict], list[tuple[int, int, float]]]:
        """Rows of the ``top`` table (per layer and overall, ranked by mean contribution over rows)
        and the overall top neurons as ``(layer, neuron, mean activation)``."""
        mean = mean_over_rows(neurons)
        cols = ["layer", "neuron", "mean_activation", "mean_logit_per_activation", "mean_contribution",
                "std_contribution", "n_rows"]
        top_rows = []
        for _, g in mean.groupby("layer"):
            g = _ranked(g, "mean_contribution", self.rank_by).head(self.top_k)
            for r, row in enumerate(g[cols].to_dict("records")):
                top_rows.append({"scope": "layer", "top_rank": r + 1, **row})
        g = _ranked(mean, "mean_contribution", self.rank_by).head(self.top_k)
        overall = []
        for r, row in enumerate(g[cols].to_dict("records")):
            top_rows.append({"scope": "overall", "top_rank": r + 1, **row})
            overall.append((int(row["layer"]), int(row["neuron"]), float(row["mean_activation"])))
        for row in top_rows:
            row["layer"], row["neuron"], row["n_rows"] = int(row["layer"]), int(row["neuron"]), int(row["n_rows"])
        return top_rows, overall

    def _contexts(self, model: HookedModel, overall, top_set, rand_sets, tables: dict, meta: dict, progress: bool):
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
        c = kr.contexts.rename(columns={"rank": "top_rank"})
        keep = set(read)
        tables["contexts"] = c[[(int(a), int(b)) in keep for a, b in zip(c["layer"], c["neuron"])]].reset_index(drop=True)
        meta.update(corpus=cx.corpus, corpus_tokens=kr.n_tokens, corpus_windows=kr.n_windows, mean_source="corpus")
        return kr.means

    def _interventions(self, model: HookedModel, inputs: NeuronAttributionInputs, top_set, rand_sets, means,
                       progress: bool) -> pd.DataFrame:
        """One row per (verb, value) x set x dataset row: the top neurons and each random control set
        edited on every row in batched passes, each row with its own target/foil at its own position
        (table ``interventions``, columns :data:`ROW_INTERVENTION_COLUMNS`)."""
        abl = self.ablation
        assert abl is not None
        data = inputs.data
        rows = []
        clean: Optional[list] = None
        plans = abl.plans()
        sets = [("top", 0, top_set)] + [("random", i + 1, s) for i, s in enumerate(rand_sets)]
        bar = tqdm(total=len(plans) * len(sets), desc="interventions", disable=not progress, leave=False)
        for mode, value in plans:
            for set_name, draw, nset in sets:
                rs = neuron_interventions(model, data, None, nset, mode=mode, means=means,
                                          factor=value if mode == "scale" else 1.0,
                                          value=value if mode in ("clamp", "steer") else 0.0,
                                          intervene_at=abl.intervene_at, clean_metrics=clean,
                                          read_at=inputs.read_at, batch_size=self.batch_size)
                clean = [r["clean"] for r in rs]
                units = json.dumps([f"{L}.{n}" for L, n in nset])
                for e, r in zip(data.examples, rs):
                    rows.append({"row_id": e.row_id, "set": set_name, "draw": draw, "verb": mode, "value": value,
                                 "k": len(nset), "units": units, **intervention_row(r)})
                bar.update(1)
        bar.close()
        return pd.DataFrame(rows, columns=ROW_INTERVENTION_COLUMNS)
