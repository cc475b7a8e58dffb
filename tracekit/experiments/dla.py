"""Direct logit attribution as an experiment kind, per dataset row.

``kind: direct_logit_attribution`` (:class:`DirectLogitAttribution`): each row's target logit (or
target - foil logit difference) at its read position split into embeddings, every attention head
and every MLP (Elhage et al. 2021), through the run's final-norm scale; parts + bias terms = the
row's own logit (difference). Rows come from ``prompts`` (with ``target``/``foil``: a string for
every prompt, a list for one per prompt) or a ``dataset`` (each row its own target and foil, e.g.
the IOI generator's indirect object and subject). The computation is
:func:`tracekit.dla.logit_attribution` (notebook-usable; one batched forward pass per
``batch_size`` rows on the ids prepared here); this module validates, calls it and shapes per-row
tables, aggregates over rows ("which heads matter on average"), summaries, reports and figures.
Units: ``contribution`` and every logit in logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import numpy as np
import pandas as pd
from pydantic import Field

from .. import plotting
from ..activations.cached import CachedActivations
from ..dataset import PreparedDataset
from ..dla import POSITION_FORMS, as_position, logit_attribution, row_positions
from ..model.info import HookedModel
from .base import (
    Result,
    RowTargetsExperiment,
    check_row_targets,
    column,
    encode_prompts,
    kind_dataset,
    prompt_rows,
    register,
    subset,
)

__all__ = ["DirectLogitAttribution", "DirectLogitAttributionInputs", "DirectLogitAttributionResult",
           "check_prompt_positions"]


def check_prompt_positions(model: HookedModel, prompts, position) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Tokenize every prompt and resolve ``position`` in it, with the tokenizer only (works on a
    ``ModelInfo``). Used by the ``neuron_attribution`` kind.

    Returns:
        ``(ids, positions)``: per prompt its token ids and the index of the read position.

    Raises:
        TokenizationError: a prompt too long, or a position not in a prompt (naming the field).
    """
    pos = as_position(position, "position", POSITION_FORMS)
    ids = encode_prompts(model, prompts)
    return ids, tuple(pos.resolve(model, p, seq, field="position")[0] for p, seq in zip(prompts, ids))


@dataclass(frozen=True)
class DirectLogitAttributionInputs:
    """What :meth:`DirectLogitAttribution.prepare` builds once: the rows (token ids, per-row target
    and foil ids, named positions) and each row's read position (an index into its own ids, BOS
    counted)."""

    data: PreparedDataset
    read_at: tuple[int, ...]

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(e.ids for e in self.data.examples)


def _top(df: pd.DataFrame, col: str, k: int) -> pd.DataFrame:
    """The ``k`` rows of ``df`` with the largest ``|col|`` (ties: table order)."""
    return df.reindex(column(df, col).abs().sort_values(ascending=False, kind="stable").index).head(k)


def aggregate_components(components: pd.DataFrame) -> pd.DataFrame:
    """Per component over rows: ``mean_contribution``, ``std_contribution`` (sample standard
    deviation, ddof 1; NaN for one row), ``mean_abs_contribution`` and ``n_rows``, in table order."""
    g = components.groupby(["component", "kind", "layer"], sort=False)["contribution"]
    out = pd.DataFrame({"mean_contribution": g.mean(), "std_contribution": g.std(ddof=1),
                        "mean_abs_contribution": g.apply(lambda x: x.abs().mean()), "n_rows": g.size()})
    return out.reset_index()


def aggregate_heads(heads: pd.DataFrame) -> pd.DataFrame:
    """Per head (and ``b_O`` row, ``head_idx`` -1) over rows, as :func:`aggregate_components`."""
    g = heads.groupby(["layer", "head_idx", "component"], sort=False)["contribution"]
    out = pd.DataFrame({"mean_contribution": g.mean(), "std_contribution": g.std(ddof=1),
                        "mean_abs_contribution": g.apply(lambda x: x.abs().mean()), "n_rows": g.size()})
    return out.reset_index()


class DirectLogitAttributionResult(Result):
    """Tables (``row_id`` = the dataset row's id; ``contribution`` in logits):

    * ``components``: components x rows: ``row_id``, ``position``, ``component`` (``embed``,
      ``pos_embed``, ``attn.L``, ``mlp.L``, ``bias``), ``kind``, ``layer``, ``contribution``; per row
      they sum to the row's ``attributed_logit_diff``.
    * ``heads``: heads x rows: ``row_id``, ``layer``, ``head_idx`` (-1: the layer's ``b_O`` row),
      ``component`` (``L{layer}H{head}`` / ``attn_bias.L``), ``contribution``.
    * ``rows``: one line per row: ``row_id``, the row's fields (``prompt``, ``target``, ``foil``,
      ``corrupted``, ``group``, ``pos_<NAME>``, extra columns), ``position`` (read index, BOS counted),
      ``token`` (the token read there), ``metric``, ``logit_diff`` (the model's own logit difference
      ``logit[target] - logit[foil]``, or ``logit[target]`` for rows without a foil),
      ``attributed_logit_diff`` (what the parts add up to: equal to ``logit_diff`` unless the model
      has a nonlinear output transform such as Gemma 2's soft-cap, where it is the pre-transform
      value), ``sum_of_parts``, ``sum_error`` (``|sum_of_parts - attributed_logit_diff|``),
      ``max_identity_error`` (the largest violation of every identity checked on the row),
      ``final_scale`` (1/sigma of the final norm), ``output_transform``, ``top_component`` /
      ``top_component_contribution`` (largest ``|contribution|``), ``top_head_layer`` /
      ``top_head_idx`` / ``top_head_contribution``, ``tokens``.
    * ``components_mean`` / ``heads_mean``: per component / head over rows: ``mean_contribution``,
      ``std_contribution`` (ddof 1; NaN for one row), ``mean_abs_contribution``, ``n_rows``.

    Summary keys (rows in the order of the ``rows`` table; ``*_by_row`` lists are aligned with it):

    * ``n_rows``, ``row_id_by_row``, ``dataset_source``, ``rows_dropped``; ``metric``
      (``logit(target) - logit(foil)`` or ``logit(target)``, the same form on every row);
      ``output_transform``; ``target_by_row``, ``foil_by_row``, ``position_by_row`` (read index, BOS
      counted).
    * ``logit_diff_by_row`` / ``mean_logit_diff``: the model's logit difference per row / its mean
      over rows; ``attributed_logit_diff_by_row`` / ``mean_attributed_logit_diff`` (what the parts add
      up to); ``correct_by_row`` (``logit_diff > 0``) and ``share_rows_correct``: None without foils.
    * ``max_sum_error``: the worst ``|sum of parts - attributed logit diff|`` over rows;
      ``max_identity_error``: the worst violation of any checked identity over rows.
    * ``final_scale_by_row``; ``mean_embed`` (token + position embeddings), ``mean_attn_total``,
      ``mean_mlp_total``, ``mean_bias``: each part's per-row total, averaged over rows;
      ``mean_attn_by_layer`` / ``mean_mlp_by_layer``: per layer, the mean over rows.
    * ``top_component_by_row``: the component with the largest ``|contribution|`` per row;
      ``top_components_mean``: ``[[component, mean contribution], ...]`` (the ``top_k`` largest
      ``|mean over rows|``); ``top_heads_mean``: ``[[layer, head, mean contribution], ...]`` likewise.
    """

    config: "DirectLogitAttribution"
    main_table = "components"
    #: ``prompt_idx`` (index in the prompt list) became ``row_id`` (``head`` -> ``head_idx`` is global);
    #: results saved with the old ``prompts`` table get a ``rows`` table and the aggregates on load.
    renamed_columns = {"prompt_idx": "row_id"}
    table_names = ("components", "heads", "rows", "components_mean", "heads_mean")
    summary_keys = ("n_rows", "row_id_by_row", "dataset_source", "rows_dropped", "metric", "output_transform",
                    "target_by_row", "foil_by_row", "position_by_row", "logit_diff_by_row", "mean_logit_diff",
                    "attributed_logit_diff_by_row", "mean_attributed_logit_diff", "correct_by_row",
                    "share_rows_correct", "max_sum_error", "max_identity_error", "final_scale_by_row", "mean_embed",
                    "mean_attn_total", "mean_mlp_total", "mean_bias", "mean_attn_by_layer", "mean_mlp_by_layer",
                    "top_component_by_row", "top_components_mean", "top_heads_mean")

    @classmethod
    def _rename_old_columns(cls, tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
        """Today's tables from a result saved before per-row datasets: the ``prompts`` table becomes
        ``rows`` (one target and foil on every row, from the saved config), aggregates are computed."""
        tables = super()._rename_old_columns(tables)
        if "rows" in tables or "prompts" not in tables:
            return tables
        out = {k: v for k, v in tables.items() if k != "prompts"}
        old = tables["prompts"].rename(columns={"logit": "logit_diff", "attributed_logit": "attributed_logit_diff"})
        comp, heads = out["components"], out["heads"]
        rows = []
        for rid in (int(x) for x in column(old, "row_id")):
            c = subset(comp, comp["row_id"] == rid)
            h = subset(heads, (heads["row_id"] == rid) & (heads["head_idx"] >= 0))
            top_c, top_h = _top(c, "contribution", 1).iloc[0], _top(h, "contribution", 1).iloc[0]
            rows.append({"top_component": top_c["component"], "top_component_contribution": float(top_c["contribution"]),
                         "top_head_layer": int(top_h["layer"]), "top_head_idx": int(top_h["head_idx"]),
                         "top_head_contribution": float(top_h["contribution"])})
        new = pd.concat([old.reset_index(drop=True), pd.DataFrame(rows)], axis=1)
        new["sum_error"] = (new["sum_of_parts"] - new["attributed_logit_diff"]).abs()
        new["max_identity_error"] = new["sum_error"]  # the old result kept no other identity's error
        out["rows"] = new
        out["components_mean"] = aggregate_components(comp)
        out["heads_mean"] = aggregate_heads(heads)
        return out

    def _rows(self) -> pd.DataFrame:
        """The ``rows`` table (a result saved before per-row targets: target/foil from its config)."""
        rows = self.tables["rows"]
        if "target" not in rows or "foil" not in rows:
            rows = rows.assign(**{k: getattr(self.config, k) for k in ("target", "foil") if k not in rows})
        return rows

    def summary(self) -> dict:
        comp, rows = self.tables["components"], self._rows()
        k = self.config.top_k
        dmeta = self.meta.get("dataset", {})
        n = int(len(rows))
        has_foil = bool(rows["foil"].notna().all()) if "foil" in rows else False

        def kind_mean(kind: str) -> float:
            per_row = cast(pd.Series, subset(comp, comp["kind"] == kind).groupby("row_id")["contribution"].sum())
            return float(per_row.reindex(column(rows, "row_id"), fill_value=0.0).mean())

        def layer_means(kind: str) -> list[float]:
            c = subset(comp, comp["kind"] == kind)
            return [float(x) for x in cast(pd.Series, c.groupby("layer")["contribution"].mean()).sort_index()]

        cm, hm = self.tables["components_mean"], self.tables["heads_mean"]
        hm = subset(hm, hm["head_idx"] >= 0)
        correct = [bool(x > 0) for x in rows["logit_diff"]] if has_foil else None
        return {
            "n_rows": n,
            "row_id_by_row": [int(x) for x in rows["row_id"]],
            "dataset_source": dmeta.get("source"),
            "rows_dropped": dict(dmeta.get("dropped", {})),
            "metric": "logit(target) - logit(foil)" if has_foil else "logit(target)",
            "output_transform": str(rows["output_transform"].iloc[0]),
            "target_by_row": [str(x) for x in rows["target"]],
            "foil_by_row": [None if pd.isna(x) else str(x) for x in rows["foil"]],
            "position_by_row": [int(x) for x in rows["position"]],
            "logit_diff_by_row": [float(x) for x in rows["logit_diff"]],
            "mean_logit_diff": float(column(rows, "logit_diff").mean()),
            "attributed_logit_diff_by_row": [float(x) for x in rows["attributed_logit_diff"]],
            "mean_attributed_logit_diff": float(column(rows, "attributed_logit_diff").mean()),
            "correct_by_row": correct,
            "share_rows_correct": float(np.mean(correct)) if correct is not None else None,
            "max_sum_error": float(column(rows, "sum_error").max()),
            "max_identity_error": float(column(rows, "max_identity_error").max()),
            "final_scale_by_row": [float(x) for x in rows["final_scale"]],
            "mean_embed": kind_mean("embed"),
            "mean_attn_total": kind_mean("attn"),
            "mean_mlp_total": kind_mean("mlp"),
            "mean_bias": kind_mean("bias"),
            "mean_attn_by_layer": layer_means("attn"),
            "mean_mlp_by_layer": layer_means("mlp"),
            "top_component_by_row": [str(x) for x in rows["top_component"]],
            "top_components_mean": [[str(c), float(v)] for c, v in
                                    _top(cm, "mean_contribution", k)[["component", "mean_contribution"]].to_numpy()],
            "top_heads_mean": [[int(L), int(h), float(v)] for L, h, v in
                               _top(hm, "mean_contribution", k)[["layer", "head_idx", "mean_contribution"]].to_numpy()],
        }

    def report(self) -> str:
        s = self.summary()
        rows = self._rows()
        tr = s["output_transform"]
        nonlinear = not (tr in ("none", "") or tr.startswith("logits x"))
        src = f" from {s['dataset_source']}" if s["dataset_source"] else ""
        lines = [f"direct logit attribution [{self.config.step_name}]: {s['n_rows']} row(s){src}; metric "
                 f"{s['metric']} at position {self.config.position}"]
        dropped = {k: v for k, v in s["rows_dropped"].items() if v}
        if dropped:
            lines.append("  rows dropped: " + ", ".join(f"{k}: {v}" for k, v in dropped.items()))
        if s["n_rows"] == 1:
            r = rows.iloc[0]
            lines.append(f"row {int(r['row_id'])}: {r['prompt']!r} at position {int(r['position'])} ({r['token']!r}); "
                         f"target {r['target']!r}" + (f", foil {r['foil']!r}" if s["foil_by_row"][0] else ""))
        what = (f"model: mean {s['mean_logit_diff']:.4f} logits over rows" if not nonlinear else
                f"model: mean {s['mean_logit_diff']:.4f} logits after its {tr}; the parts add up to the "
                f"pre-transform value (mean {s['mean_attributed_logit_diff']:.4f})")
        lines.append(f"{what}; max |sum of parts - attributed| over rows {s['max_sum_error']:.2e}; final-norm scale "
                     "1/sigma frozen at each row's own run")
        if s["share_rows_correct"] is not None:
            lines.append(f"rows with logit difference > 0: {s['share_rows_correct']:.0%}")
        lines.append(f"mean over rows: embeddings {s['mean_embed']:+.4f}  attention {s['mean_attn_total']:+.4f}  "
                     f"MLPs {s['mean_mlp_total']:+.4f}  bias {s['mean_bias']:+.4f}")
        cm = self.tables["components_mean"].set_index("component")
        lines.append("top components (mean over rows, logits):")
        lines.append(plotting.text_table(
            [(c, f"{v:+.4f}", _fmt_std(cm.loc[c, "std_contribution"])) for c, v in s["top_components_mean"]],
            ["component", "mean", "std"]))
        hm = self.tables["heads_mean"].set_index(["layer", "head_idx"])
        lines.append("top heads (mean over rows, logits):")
        lines.append(plotting.text_table(
            [(f"L{L}H{h}", f"{v:+.4f}", _fmt_std(hm.loc[(L, h), "std_contribution"]))
             for L, h, v in s["top_heads_mean"]], ["head", "mean", "std"]))
        if s["n_rows"] > 1:
            shown = rows.head(20)
            lines.append(f"rows ({len(shown)} of {len(rows)}):")
            lines.append(plotting.text_table(
                [(int(r["row_id"]), repr(r["target"]), repr(r["foil"]) if not pd.isna(r["foil"]) else "-",
                  f"{r['logit_diff']:+.4f}", r["top_component"]) for r in shown.to_dict("records")],
                ["row_id", "target", "foil", "logit_diff", "top component"]))
        return "\n".join(lines)

    def figures(self) -> dict:
        s = self.summary()
        n = s["n_rows"]
        over = f" (mean over {n} rows)" if n > 1 else ""
        cm = self.tables["components_mean"]
        att = subset(cm, cm["kind"] == "attn").sort_values("layer")
        mlp = subset(cm, cm["kind"] == "mlp").sort_values("layer")
        values = {"embed": float(column(subset(cm, cm["kind"] == "embed"), "mean_contribution").sum())}
        colors = {"embed": "gray"}
        for (L, a), m in zip(zip(att["layer"], att["mean_contribution"]), mlp["mean_contribution"]):
            values[f"attn.{L}"], values[f"mlp.{L}"] = float(a), float(m)
            colors[f"attn.{L}"], colors[f"mlp.{L}"] = "tab:blue", "tab:orange"
        figs = {"components": plotting.bars(values, colors=colors,
                                            title=f"Direct logit attribution: {s['metric']}{over}",
                                            ylabel="direct contribution (logits)",
                                            xlabel="component (attn / mlp by block index)")}
        h = self.tables["heads_mean"]
        h = h[h["head_idx"] >= 0]
        grid = h.pivot(index="layer", columns="head_idx", values="mean_contribution").sort_index()
        figs["heads"] = plotting.heatmap(grid.to_numpy(), grid.columns.tolist(), grid.index.tolist(), diverging=True,
                                         title=f"Per-head direct contribution{over} (logits)", xlabel="head",
                                         ylabel="layer", colorbar_label="logits")
        return figs


def _fmt_std(x) -> str:
    return "-" if pd.isna(x) else f"{float(x):.4f}"


@register
class DirectLogitAttribution(RowTargetsExperiment):
    """Direct logit attribution (Elhage et al. 2021) of each row's target (minus its foil) at a position.

    Fields:
        prompts: one string or a list (one row each); or
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`: inline ``rows``, a file ``path``,
            or a ``generator`` such as ``ioi``), each with its own ``target`` and ``foil``.
        target: with ``prompts``: a one-token string for every prompt (``" Paris"``), or a list with
            one token per prompt (each row's own answer). Not given with a ``dataset``.
        foil: optional, the same forms; with it the metric becomes the logit difference
            ``logit[target] - logit[foil]`` (default none: the target's logit alone). Every row has a
            foil or none does.
        position: the read position (:class:`tracekit.tokens.Position`), resolved per row: an int
            (an index into the row's tokens, BOS counted when prepended; negative from the end),
            ``last`` (default), ``token:<text>``, or a named position of the dataset's rows (``END``,
            ``IO``...; counted in the row's own tokens after BOS, whatever the padding).
        top_k: components / heads listed in the summary.
        batch_size: rows per forward pass.

    Summary keys and tables: :class:`DirectLogitAttributionResult`.

    Raises:
        TokenizationError: target/foil not one token, position not in a prompt.
        DatasetError: a dataset row without a target, rows with and without foils, a named position
            a row does not have.
        AttributionError: an architecture whose residual stream is not the sum of the parts read.
    """

    kind: Literal["direct_logit_attribution"] = "direct_logit_attribution"
    top_k: int = Field(default=10, ge=1)
    batch_size: int = Field(default=8, ge=1)

    result_class = DirectLogitAttributionResult

    target_role = "the token whose logit is split"

    def prepare(self, model: HookedModel) -> DirectLogitAttributionInputs:
        """The rows prepared once (prompts tokenized, per-row target/foil ids, named positions) and
        each row's read position (tokenizer only: works on a :class:`tracekit.model.ModelInfo`;
        ``filter: correct`` runs the model where it can).

        Raises:
            TokenizationError / DatasetError: see the class docstring.
        """
        if self.dataset is None:
            data = prompt_rows(model, self.prompts, self.target, self.foil)
        else:
            data = kind_dataset(model, None, self.dataset, batch_size=self.batch_size)
        check_row_targets(data, "dataset" if self.dataset is not None else "prompts", "direct logit attribution")
        return DirectLogitAttributionInputs(data, tuple(row_positions(model, data, self.position)))

    def _run(self, model: HookedModel, inputs: DirectLogitAttributionInputs, progress: bool = True
             ) -> DirectLogitAttributionResult:
        data = inputs.data
        kept = CachedActivations("every hook DLA read, at each row's attributed position")
        das = logit_attribution(model, data, position=self.position, read_at=inputs.read_at,
                                batch_size=self.batch_size, keep=kept)
        comps, heads, recs = [], [], []
        for d in das:
            c = d.components_frame().drop(columns=["prompt_idx"])
            c.insert(0, "row_id", d.row_id)
            comps.append(c)
            h = d.heads_frame().drop(columns=["prompt_idx"]).rename(columns={"head": "head_idx"})
            h.insert(0, "row_id", d.row_id)
            heads.append(h)
            top_c = _top(c, "contribution", 1).iloc[0]
            hh = subset(h, h["head_idx"] >= 0)
            top_h = _top(hh, "contribution", 1).iloc[0]
            total = d.total()
            assert d.attributed is not None  # set in DirectAttribution.__post_init__
            recs.append({
                "position": d.position, "token": d.tokens[d.position], "metric": d.target.label,
                "logit_diff": d.logit, "attributed_logit_diff": d.attributed, "sum_of_parts": total,
                "sum_error": abs(total - float(d.attributed)), "max_identity_error": d.max_error,
                "final_scale": d.final_scale, "output_transform": d.transform,
                "top_component": top_c["component"], "top_component_contribution": float(top_c["contribution"]),
                "top_head_layer": int(top_h["layer"]), "top_head_idx": int(top_h["head_idx"]),
                "top_head_contribution": float(top_h["contribution"]), "tokens": d.tokens})
        components = pd.concat(comps, ignore_index=True)
        heads_t = pd.concat(heads, ignore_index=True)
        frame = data.frame()
        rows = pd.concat([frame.drop(columns=[c for c in recs[0] if c in frame.columns]),
                          pd.DataFrame(recs)], axis=1)
        tables = {"components": components, "heads": heads_t, "rows": rows,
                  "components_mean": aggregate_components(components), "heads_mean": aggregate_heads(heads_t)}
        meta = {"n_layers": int(model.cfg.n_layers), "n_heads": int(model.cfg.n_heads),
                "process_weights": bool(getattr(getattr(model, "tracekit_spec", None), "process_weights", True)),
                "dataset": {"source": data.source, "dropped": dict(data.dropped), "n_rows": len(data)},
                "scale": "final-norm scale of each row's run, frozen (post-attention/MLP norms too, where a block has "
                         "them)",
                "attributed": "the logit (difference) the parts add up to: the model's own, or the pre-transform "
                              "value under a nonlinear output transform (e.g. Gemma 2's final soft-cap)"}
        result = DirectLogitAttributionResult(self, tables, meta)
        result.activations = kept
        return result
