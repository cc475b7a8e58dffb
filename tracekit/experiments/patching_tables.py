# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""Table shaping of activation patching (``kind: activation_patching``): the engine's job results
(:mod:`tracekit.patching`) into the ``main``, ``baselines`` and ``tokens`` tables of
:class:`tracekit.experiments.patching.ActivationPatchingResult` (columns described there).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .. import patching as P
from ..metrics import normalize
from ..tokens import str_tokens

__all__ = ["tokens_frame", "baselines_frame", "job_frame", "normalise"]


def tokens_frame(model, ids) -> pd.DataFrame:
    """The ``tokens`` table: every pair's clean and corrupted tokens (pair, prompt, position, token, id)."""
    tok_rows = []
    for i, (c, x) in enumerate(ids):
        for nm, seq in (("clean", c), ("corrupted", x)):
            for p, (t, tid) in enumerate(zip(str_tokens(model, seq), seq)):
                tok_rows.append({"pair": i, "prompt": nm, "position": p, "token": t, "token_id": int(tid)})
    return pd.DataFrame(tok_rows)


def baselines_frame(out, n_pairs: int, min_denominator: float) -> pd.DataFrame:
    """The ``baselines`` table: per pair and metric the clean and corrupted scores, their gap and
    whether it is too small to normalise by (``flagged``)."""
    base_rows = []
    for i in range(n_pairs):
        for k, m in enumerate(out.metrics):
            c, x = float(out.clean[i, k]), float(out.corrupted[i, k])
            base_rows.append({"pair": i, "metric": m, "clean": c, "corrupted": x, "denominator": c - x,
                              "flagged": bool(abs(c - x) < min_denominator)})
    return pd.DataFrame(base_rows).sort_values(["pair", "metric"]).reset_index(drop=True)


def job_frame(job: P.JobResult, tokens_df: pd.DataFrame, metrics: list[str]) -> pd.DataFrame:
    """The ``main`` rows of one job (direction/ablation x site): per index (layer, position, head,
    neuron) x member pair x metric, the raw ``value`` (not yet normalised)."""
    members, site, idf = job.pairs, job.site, job.index
    n, V, Mn = len(members), len(job.index), len(metrics)
    rep = idf.loc[idf.index.repeat(n)].reset_index(drop=True)

    def col(name):
        return rep[name].astype("Int64") if name in rep else pd.array([pd.NA] * len(rep), dtype="Int64")

    def per_pair(vals):
        return pd.array(np.tile(np.asarray(vals), V) if vals is not None else [pd.NA] * (V * n), dtype="Int64")

    df = pd.DataFrame({
        "direction": job.mode, "site": site.name,
        "hook": [site.hook_name(int(L)) for L in rep["layer"]],
        "layer": rep["layer"].astype("int64"),
        "position": col("pos"), "head": col("head"), "neuron": col("neuron"),
        "pair": pd.array(np.tile(np.asarray(members), V), dtype="Int64"),
        "baseline_n": per_pair(job.baseline_n), "baseline_source": per_pair(job.baseline_source),
    })
    df["pos_from_end"] = (df["position"] - job.n_pos).astype("Int64")
    tk = tokens_df[tokens_df["prompt"] == "clean"][["pair", "position", "token"]].astype(
        {"pair": "Int64", "position": "Int64"})
    df = df.merge(tk, on=["pair", "position"], how="left")
    v = job.values.numpy().reshape(V * n, Mn)
    return pd.concat([df.assign(metric=m, value=v[:, k]) for k, m in enumerate(metrics)], ignore_index=True)

def normalise(main: pd.DataFrame, baselines: pd.DataFrame, equal: bool, min_denominator: float) -> pd.DataFrame:
    """Add ``normalized`` (clean run 1, corrupted run 0; NaN for a flagged pair), ``flagged``,
    ``scope`` and ``effect`` to the per-pair rows, plus the rows averaged over unflagged pairs
    (``scope`` = ``mean``; ``position``/``token`` only when every pair has the same length)."""
    b = baselines.set_index(["pair", "metric"])
    key = list(zip(main["pair"].astype(int), main["metric"]))
    clean = b["clean"].reindex(key).to_numpy()
    corr = b["corrupted"].reindex(key).to_numpy()
    main["normalized"] = normalize(main["value"].to_numpy(), clean, corr, min_denominator)
    main["flagged"] = b["flagged"].reindex(key).to_numpy()
    main["scope"] = "pair"
    # mean over unflagged pairs, normalising the averages
    good = main[~main["flagged"]].copy()
    good["_clean"] = clean[~main["flagged"].to_numpy()]
    good["_corr"] = corr[~main["flagged"].to_numpy()]
    keys = ["direction", "site", "hook", "layer", "pos_from_end", "head", "neuron", "metric"]
    if good.empty:
        mean = main.iloc[0:0].copy()
    else:
        agg = good.groupby(keys, dropna=False, sort=False).agg(
            value=("value", "mean"), _clean=("_clean", "mean"), _corr=("_corr", "mean"),
            position=("position", "first"), token=("token", "first")).reset_index()
        agg["normalized"] = normalize(agg["value"].to_numpy(), agg["_clean"].to_numpy(),
                                      agg["_corr"].to_numpy(), min_denominator)
        mean_flag = np.abs(agg["_clean"].to_numpy() - agg["_corr"].to_numpy()) < min_denominator
        mean = agg.drop(columns=["_clean", "_corr"])
        if not equal:
            mean["position"] = pd.array([pd.NA] * len(mean), dtype="Int64")
            mean["token"] = None
        mean["pair"] = pd.array([pd.NA] * len(mean), dtype="Int64")
        mean["baseline_n"] = pd.array([pd.NA] * len(mean), dtype="Int64")
        mean["baseline_source"] = pd.array([pd.NA] * len(mean), dtype="Int64")
        # the averaged clean/corrupted gap can vanish even when no single pair's does
        mean["flagged"] = mean_flag
        mean["scope"] = "mean"
    cols = ["scope", "direction", "site", "hook", "layer", "position", "pos_from_end", "token", "head", "neuron",
            "pair", "metric", "value", "normalized", "flagged", "baseline_n", "baseline_source"]
    out = pd.concat([main[cols], mean[cols]], ignore_index=True)
    # effect: how far the patch moves the run it was applied to, towards the other run
    # (denoising: normalized; noising and ablations of the clean run: 1 - normalized)
    out["effect"] = np.where(out["direction"] == "denoising", out["normalized"], 1.0 - out["normalized"])
    for c in ("position", "pos_from_end", "head", "neuron", "pair", "baseline_n", "baseline_source"):
        out[c] = out[c].astype("Int64")
    return out
