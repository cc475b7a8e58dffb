"""The tables of the ``neuron_attribution`` kind, built from the per-row attributions of
:func:`tracekit.neurons.neuron_contributions`.

Engine side of :class:`tracekit.experiments.neurons.NeuronAttribution` (its result class, summary
and figures are in :mod:`tracekit.experiments.neurons_tables`): the ``neurons``, ``layers``,
``top_by_row`` and ``top`` tables and each row's record of the ``rows`` table, and the ranking of
neurons by their contribution (mean over rows). Contributions are in logits of the row's metric
(``logit(target) - logit(foil)``, or ``logit(target)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pandas as pd

from .dla import DirectAttribution

__all__ = ["NeuronTables", "mean_over_rows", "neuron_tables", "ranked", "top_by_row", "top_rows"]


def ranked(df: pd.DataFrame, col: str, rank_by: str) -> pd.DataFrame:
    """``df`` ordered by ``col`` (``rank_by='contribution'``: largest first) or by ``|col|`` (``abs``);
    ties keep table order."""
    c = cast(pd.Series, df[col])
    key = c if rank_by == "contribution" else c.abs()
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
        t = ranked(g, "contribution", rank_by).head(k)
        parts.append(t.assign(top_rank=np.arange(1, len(t) + 1)))
    cols = ["row_id", "top_rank", "layer", "neuron", "activation", "logit_per_activation", "contribution"]
    return cast(pd.DataFrame, pd.concat(parts, ignore_index=True)[cols]) if parts else pd.DataFrame(columns=cols)


def top_rows(neurons: pd.DataFrame, top_k: int, rank_by: str) -> tuple[list[dict], list[tuple[int, int, float]]]:
    """Rows of the ``top`` table (per layer and overall, ranked by mean contribution over rows)
    and the overall top neurons as ``(layer, neuron, mean activation)``."""
    mean = mean_over_rows(neurons)
    cols = ["layer", "neuron", "mean_activation", "mean_logit_per_activation", "mean_contribution",
            "std_contribution", "n_rows"]
    top_rows: list[dict] = []
    for _, g in mean.groupby("layer"):
        g = ranked(g, "mean_contribution", rank_by).head(top_k)
        for r, row in enumerate(cast(pd.DataFrame, g[cols]).to_dict("records")):
            top_rows.append({"scope": "layer", "top_rank": r + 1, **row})
    g = ranked(mean, "mean_contribution", rank_by).head(top_k)
    overall = []
    for r, row in enumerate(cast(pd.DataFrame, g[cols]).to_dict("records")):
        top_rows.append({"scope": "overall", "top_rank": r + 1, **row})
        overall.append((int(row["layer"]), int(row["neuron"]), float(row["mean_activation"])))
    for row in top_rows:
        row["layer"], row["neuron"], row["n_rows"] = int(row["layer"]), int(row["neuron"]), int(row["n_rows"])
    return top_rows, overall


@dataclass(frozen=True)
class NeuronTables:
    """What :func:`neuron_tables` builds.

    Attributes:
        neurons: every neuron of the chosen layers per row (``row_id, layer, neuron, activation,
            logit_per_activation, contribution``).
        layers: per row and layer ``mlp, mlp_bias, neuron_sum, additivity_error`` (logits).
        top_by_row: each row's own top neurons (:func:`top_by_row`).
        row_records: one dict per row, the row's own columns of the ``rows`` table.
    """

    neurons: pd.DataFrame
    layers: pd.DataFrame
    top_by_row: pd.DataFrame
    row_records: list[dict]


def neuron_tables(das: Sequence[DirectAttribution], layers: Sequence[int], top_k: int, rank_by: str) -> NeuronTables:
    """The per-row tables of a neuron attribution.

    Args:
        das: one :class:`tracekit.dla.DirectAttribution` per row (with ``row_id`` and neuron contributions
            of ``layers``), from :func:`tracekit.neurons.neuron_contributions`.
        layers: the MLP blocks attributed.
        top_k: neurons listed per row.
        rank_by: ``contribution`` (most positive first) or ``abs``.

    Returns:
        :class:`NeuronTables` (contributions in logits; ``additivity_error`` is
        ``|neuron_sum + mlp_bias - mlp|``).
    """
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
    tb = top_by_row(neurons, top_k, rank_by)
    recs = []
    for d in das:
        t = cast(pd.DataFrame, tb[tb["row_id"] == d.row_id]).iloc[0]
        g = cast(pd.DataFrame, lay[lay["row_id"] == d.row_id])
        recs.append({"position": d.position, "token": d.tokens[d.position], "metric": d.target.label,
                     "logit_diff": d.logit, "attributed_logit_diff": d.attributed, "final_scale": d.final_scale,
                     # pandas reductions: scalars at run time (the stubs type them loosely)
                     "mlp_total": float(cast(Any, g["mlp"].sum())), "neuron_sum": float(cast(Any, g["neuron_sum"].sum())),
                     "max_additivity_error": float(cast(Any, g["additivity_error"].max())),
                     "top_neuron": f"{int(t['layer'])}.{int(t['neuron'])}", "top_neuron_layer": int(t["layer"]),
                     "top_neuron_idx": int(t["neuron"]), "top_neuron_activation": float(t["activation"]),
                     "top_neuron_contribution": float(t["contribution"])})
    return NeuronTables(neurons, lay, tb, recs)
