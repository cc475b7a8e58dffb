"""Table shaping of activation patching (``kind: activation_patching``): the engine's job results
(:mod:`tracekit.patching`) into the ``main``, ``baselines``, ``rows`` and ``tokens`` tables of
:class:`tracekit.experiments.patching.ActivationPatchingResult` (columns described there).

Every table has one line per dataset row where it is per row: ``pair`` is the row's index in the
run (0 .. n_rows-1, the order of the rows), ``row_id`` its id in the dataset (kept from the source
when ``filter: correct`` or ``limit`` dropped rows).

Over 600 lines because the readings of the ``main`` table live together: the tables, the
trivially-complete rule, the bootstrap intervals that decide ties, the heatmaps and the report.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pandas as pd

from .. import patching as P
from ..dataset import PreparedDataset
from ..metrics import normalize
from ..model.info import HookedModel
from ..tokens import str_tokens

__all__ = ["families", "rows_table", "heatmaps", "records", "where", "column", "is_missing", "report_text", "site_label", "tokens_frame", "baselines_frame", "rows_frame", "job_frame", "normalise", "MAIN_COLUMNS", "SITE_FAMILIES",
           "site_family", "trivial_lines", "trivial_causes", "line_intervals", "TRIVIAL_TOL", "TIE_CI"]

#: How close (in effect units) a block-0 component at the only changed token must come to the
#: whole residual's restoration (1) to be marked trivially complete (:func:`trivial_causes`).
TRIVIAL_TOL = 0.05

#: The mass of the bootstrap interval that decides ties in ``top_sites`` (:func:`line_intervals`).
TIE_CI = 0.95

#: Columns of the ``main`` table, in order.
MAIN_COLUMNS = ["scope", "intervention", "site", "hook", "layer", "position", "position_name", "pos_from_end",
                "token", "head_idx", "neuron", "pair", "row_id", "metric", "value", "delta", "normalized", "flagged",
                "baseline_n", "baseline_source", "effect"]
_INT_COLUMNS = ("position", "pos_from_end", "head_idx", "neuron", "pair", "row_id", "baseline_n", "baseline_source")


def tokens_frame(model: HookedModel, ids: Sequence[tuple[Sequence[int], Sequence[int]]], row_ids: Sequence[int]) -> pd.DataFrame:
    """The ``tokens`` table: every row's clean and corrupted tokens (pair, row_id, prompt
    ``clean``/``corrupted``, position (BOS counted), token, token_id)."""
    tok_rows = []
    for i, ((c, x), rid) in enumerate(zip(ids, row_ids)):
        for nm, seq in (("clean", c), ("corrupted", x)):
            for p, (t, tid) in enumerate(zip(str_tokens(model, list(seq)), seq)):
                tok_rows.append({"pair": i, "row_id": int(rid), "prompt": nm, "position": p, "token": t,
                                 "token_id": int(tid)})
    return pd.DataFrame(tok_rows)


def baselines_frame(out, n_pairs: int, min_denominator: float, row_ids: Sequence[int],
                    has_corrupted: bool = True) -> pd.DataFrame:
    """The ``baselines`` table: per row and metric the clean and corrupted scores, their gap and
    whether it is too small to normalise by (``flagged``). Without corrupted prompts (an
    ablation-only run) ``corrupted`` and ``denominator`` are NaN and nothing is flagged."""
    base_rows = []
    for i in range(n_pairs):
        for k, m in enumerate(out.metrics):
            c = float(out.clean[i, k])
            x = float(out.corrupted[i, k]) if has_corrupted else float("nan")
            base_rows.append({"pair": i, "row_id": int(row_ids[i]), "metric": m, "clean": c, "corrupted": x,
                              "denominator": c - x, "flagged": bool(abs(c - x) < min_denominator)})
    return pd.DataFrame(base_rows).sort_values(["pair", "metric"]).reset_index(drop=True)


def rows_frame(data: PreparedDataset, baselines: pd.DataFrame, metrics: Sequence[str], main_metric: str,
               targets: Sequence[Sequence[str]], foils: Sequence[Sequence[str]] | None) -> pd.DataFrame:
    """The ``rows`` table: one line per dataset row, ``pair``, the row's fields
    (:meth:`PreparedDataset.frame`: ``row_id``, ``prompt``, ``target``, ``foil``, ``corrupted``,
    ``group``, ``pos_<NAME>``, extra columns), ``n_tokens``, per metric ``clean_<metric>`` and
    ``corrupted_<metric>`` (the unpatched runs' scores; ``logit_diff`` whenever the rows have foils),
    ``correct`` (the clean run prefers the target over the foil: ``clean_logit_diff > 0``; <NA>
    without foils) and ``flagged`` (the main metric's clean/corrupted gap is below
    ``min_denominator``).

    ``baselines`` holds every metric scored (including ``logit_diff`` when it was only scored for
    this table); ``targets``/``foils`` the answer texts per row (several: a JSON list)."""
    df = data.frame()
    df.insert(0, "pair", np.arange(len(df), dtype=np.int64))
    df["target"] = [t[0] if len(t) == 1 else _json_list(t) for t in targets]
    df["foil"] = [None if foils is None else f[0] if len(f) == 1 else _json_list(f)
                  for f in (foils if foils is not None else [()] * len(df))]
    df["n_tokens"] = [len(e.ids) for e in data.examples]
    wide = baselines.pivot(index="pair", columns="metric", values=["clean", "corrupted"]).sort_index()
    scored = list(metrics) + (["logit_diff"] if "logit_diff" in set(baselines["metric"]) - set(metrics) else [])
    for m in scored:
        df[f"clean_{m}"] = wide[("clean", m)].to_numpy(dtype=float)
        df[f"corrupted_{m}"] = wide[("corrupted", m)].to_numpy(dtype=float)
    if "logit_diff" in scored:
        df["correct"] = pd.array(df["clean_logit_diff"].to_numpy() > 0, dtype="boolean")
    else:
        df["correct"] = pd.array([pd.NA] * len(df), dtype="boolean")
    main = baselines[baselines["metric"] == main_metric].set_index("pair")["flagged"]
    df["flagged"] = main.reindex(df["pair"]).to_numpy(dtype=bool)
    return df


def _json_list(xs: Sequence[str]) -> str:
    import json

    return json.dumps(list(xs))


def job_frame(job: P.JobResult, tokens_df: pd.DataFrame, metrics: list[str], row_ids: Sequence[int],
              position_names: Sequence[str] = ()) -> pd.DataFrame:
    """The ``main`` rows of one job (intervention x site): per index (layer, position, head, neuron)
    x member row x metric, the raw ``value`` (not yet normalised).

    With chosen positions (:attr:`tracekit.patching.JobResult.positions`) the index's ``pos`` is a
    slot: ``position`` is then each row's own token index and ``position_name`` the slot's name
    (``position_names``)."""
    members, site, idf = job.pairs, job.site, job.index
    n, V, Mn = len(members), len(job.index), len(metrics)
    rep = idf.loc[idf.index.repeat(n)].reset_index(drop=True)

    def col(name):
        return rep[name].astype("Int64") if name in rep else pd.array([pd.NA] * len(rep), dtype="Int64")

    def per_pair(vals):
        return pd.array(np.tile(np.asarray(vals), V) if vals is not None else [pd.NA] * (V * n), dtype="Int64")

    position = col("pos")
    names: list | np.ndarray = [None] * len(rep)
    if "pos" in rep and job.positions is not None:
        slot = rep["pos"].to_numpy(dtype=np.int64)
        member = np.tile(np.arange(n), V)
        position = pd.array(np.asarray(job.positions, dtype=np.int64)[member, slot], dtype="Int64")
        names = np.asarray(list(position_names), dtype=object)[slot]
    pairs = np.tile(np.asarray(members, dtype=np.int64), V)
    df = pd.DataFrame({
        "intervention": job.mode, "site": site.name,
        "hook": [site.hook_name(int(L)) for L in rep["layer"]],
        "layer": rep["layer"].astype("int64"),
        "position": position, "position_name": pd.Series(names, dtype=object),
        "head_idx": col("head"), "neuron": col("neuron"),
        "pair": pd.array(pairs, dtype="Int64"),
        "row_id": pd.array(np.asarray(row_ids, dtype=np.int64)[pairs], dtype="Int64"),
        "baseline_n": per_pair(job.baseline_n), "baseline_source": per_pair(job.baseline_source),
    })
    df["pos_from_end"] = (df["position"] - job.n_pos).astype("Int64")
    tk = where(tokens_df, tokens_df["prompt"] == "clean")[["pair", "position", "token"]].astype(
        cast(Any, {"pair": "Int64", "position": "Int64"}))  # per-column dtypes (the stubs accept one dtype)
    df = df.merge(tk, on=["pair", "position"], how="left")
    v = job.values.numpy().reshape(V * n, Mn)
    return pd.concat([df.assign(metric=m, value=v[:, k]) for k, m in enumerate(metrics)], ignore_index=True)


def _one_or_na(g: Any, col: str, dtype: str) -> pd.Series:
    """Per group the column's value when every member has the same one, else <NA>."""
    first = g[col].first()
    same = g[col].nunique(dropna=False) == 1
    return first.where(same).astype(dtype) if dtype != "object" else first.where(same, None)


def normalise(main: pd.DataFrame, baselines: pd.DataFrame, equal: bool, min_denominator: float,
              named: bool = False) -> pd.DataFrame:
    """Add ``delta`` (value - the row's clean score), ``normalized`` (clean run 1, corrupted run 0;
    NaN for a flagged row or without corrupted prompts), ``flagged``, ``scope`` and ``effect`` to the
    per-row lines, plus the lines averaged over unflagged rows (``scope`` = ``mean``).

    Mean lines are grouped by (intervention, site, hook, layer, head_idx, neuron, metric) and the
    position: ``position_name`` with chosen positions (``named``; rows of different lengths align
    by name), else ``pos_from_end``. Their ``position``/``token`` are the rows' common value when
    every row has the same length (``equal``), else <NA> (positions from the end do not align
    tokens across lengths); with ``named``, ``position``/``pos_from_end``/``token`` are the rows'
    common value where they agree, else <NA>."""
    b = baselines.set_index(["pair", "metric"])
    key = list(zip(main["pair"].astype(int), main["metric"]))
    clean = b["clean"].reindex(key).to_numpy()
    corr = b["corrupted"].reindex(key).to_numpy()
    main["delta"] = main["value"].to_numpy() - clean
    main["normalized"] = normalize(main["value"].to_numpy(), clean, corr, min_denominator)
    main["flagged"] = b["flagged"].reindex(key).to_numpy()
    main["scope"] = "pair"
    # mean over unflagged rows, normalising the averages
    good = main[~main["flagged"]].copy()
    good["_clean"] = clean[~main["flagged"].to_numpy()]
    good["_corr"] = corr[~main["flagged"].to_numpy()]
    keys = ["intervention", "site", "hook", "layer", "position_name" if named else "pos_from_end", "head_idx",
            "neuron", "metric"]
    if good.empty:
        mean = main.iloc[0:0].copy()
    else:
        g = good.groupby(keys, dropna=False, sort=False)
        agg = g.agg(value=("value", "mean"), _clean=("_clean", "mean"), _corr=("_corr", "mean"))
        if named:
            agg["position"] = _one_or_na(g, "position", "Int64")
            agg["token"] = _one_or_na(g, "token", "object")
            agg["pos_from_end"] = _one_or_na(g, "pos_from_end", "Int64")
        else:
            agg["position"] = g["position"].first() if equal else pd.NA
            agg["token"] = g["token"].first() if equal else None
            agg["position_name"] = None
        agg = agg.reset_index()
        agg["delta"] = agg["value"] - agg["_clean"]
        agg["normalized"] = normalize(agg["value"].to_numpy(), agg["_clean"].to_numpy(),
                                      agg["_corr"].to_numpy(), min_denominator)
        mean_flag = np.abs(agg["_clean"].to_numpy() - agg["_corr"].to_numpy()) < min_denominator
        mean = agg.drop(columns=["_clean", "_corr"])
        for c in ("pair", "row_id", "baseline_n", "baseline_source"):
            mean[c] = pd.array([pd.NA] * len(mean), dtype="Int64")
        # the averaged clean/corrupted gap can vanish even when no single row's does
        mean["flagged"] = mean_flag
        mean["scope"] = "mean"
    cols = [c for c in MAIN_COLUMNS if c != "effect"]
    out = pd.concat([cast(pd.DataFrame, main[cols]), cast(pd.DataFrame, mean[cols])], ignore_index=True)
    # effect: how far the patch moves the run it was applied to, towards the other run
    # (denoising: normalized; noising and ablations of the clean run: 1 - normalized)
    out["effect"] = np.where(out["intervention"] == "denoising", out["normalized"], 1.0 - out["normalized"])
    for c in _INT_COLUMNS:
        out[c] = out[c].astype("Int64")
    names = column(out, "position_name")
    out["position_name"] = names.astype(object).where(names.notna(), None)
    return out


#: Site families of :meth:`ActivationPatchingResult.top_sites` (``family=``): family -> its sites'
#: name prefixes. ``resid`` is the residual stream (a cut through the whole state of a position);
#: the others are components writing into it.
SITE_FAMILIES: dict[str, tuple[str, ...]] = {"resid": ("resid_",), "attn": ("attn_out",), "mlp": ("mlp_out",),
                                             "heads": ("head_",), "neurons": ("neuron",)}


def site_family(site: str) -> str:
    """The family (a key of :data:`SITE_FAMILIES`) of a site name, ``other`` for none."""
    for fam, prefixes in SITE_FAMILIES.items():
        if site.startswith(prefixes):
            return fam
    return "other"


def _row_positions(line: Any, rows: pd.DataFrame) -> np.ndarray | None:
    """Each row's token index of a mean line's position (named: ``pos_<NAME>``; else from the end)."""
    name = line["position_name"]
    if isinstance(name, str):
        col = f"pos_{name}"
        return rows[col].to_numpy(dtype=np.int64) if col in rows else None
    pfe = line["pos_from_end"]
    return None if is_missing(pfe) else rows["n_tokens"].to_numpy(dtype=np.int64) + int(pfe)


def trivial_lines(lines: pd.DataFrame, rows: pd.DataFrame, tokens: pd.DataFrame, n_layers: int,
                  tol: float = TRIVIAL_TOL) -> pd.Series:
    """Which lines are trivially complete (not a finding): :func:`trivial_causes` is not None.

    Returns:
        A boolean Series aligned with ``lines``.
    """
    return trivial_causes(lines, rows, tokens, n_layers, tol).notna()


def trivial_causes(lines: pd.DataFrame, rows: pd.DataFrame, tokens: pd.DataFrame, n_layers: int,
                   tol: float = TRIVIAL_TOL) -> pd.Series:
    """Why each line is trivially complete (its effect is fixed by construction, or it carries the
    whole clean/corrupted difference by where it sits), or None.

    A line is trivially complete when the patched value determines everything downstream:

    * ``whole-layer residual``: a whole-layer residual site (``resid_pre_layer``, ``resid_mid_layer``,
      ``resid_post_layer``) replaces every position's whole state, so the run from there on is the
      source run (effect 1);
    * ``unembedding input``: ``resid_post`` of the last block at each row's last token, the very
      vector the unembedding reads (effect 1, for every intervention);
    * ``embedding of the only changed token``: ``resid_pre`` of block 0 at each row's only position
      where the clean and corrupted tokens differ, for ``denoising``/``noising`` (the patched run is
      the other run: effect 1);
    * ``first write after the only changed token's embedding``: a block-0 component (``attn_out``,
      ``mlp_out``) at each row's only changed position, for ``denoising``/``noising``, whose
      **measured** effect is within ``tol`` of that position's whole-residual restoration (the
      block-0 ``resid_pre`` line when it was patched, else 1, its value by construction). Nothing but
      the token's embedding differs upstream of it, so such a write is an extended embedding (in
      many models block 0's MLP is): restoring it restores the token, not a mechanism. A block-0
      component that restores less than that is a finding and is not marked. Where a row's pair
      differs in several tokens (a two-token country swapped for another), a block-0 component at a
      changed position is marked the same way when the block-0 ``resid_pre`` line at that position
      was patched and the component restores as much (within ``tol``) as it does: a measured
      reference only (no reference, no mark).

    Args:
        lines: lines of the ``main`` table (``site``, ``layer``, ``intervention``, ``position_name``,
            ``pos_from_end``, ``effect``).
        rows: the ``rows`` table (``n_tokens``, ``pos_<NAME>``), one line per row in ``pair`` order.
        tokens: the ``tokens`` table (clean and corrupted tokens of every row).
        n_layers: the model's number of blocks.
        tol: the largest |effect - whole-residual restoration| of a marked block-0 component
            (effect units: 1 = the whole clean/corrupted difference).

    Returns:
        An object Series aligned with ``lines``: the cause (a string), or None.
    """
    out = pd.Series([None] * len(lines), index=lines.index, dtype=object)
    if lines.empty:
        return out
    site = lines["site"].astype(str)
    out[site.str.startswith("resid_") & site.str.endswith("_layer")] = "whole-layer residual"
    if "n_tokens" not in rows:  # a result saved before the rows table: only the whole-layer rule
        return out
    last = rows["n_tokens"].to_numpy(dtype=np.int64) - 1
    wide = tokens.pivot_table(index=["pair", "position"], columns="prompt", values="token_id", aggfunc="first")
    diff: dict[int, set] = {int(p): set() for p in rows["pair"]}
    if "corrupted" in wide:
        d = wide[wide["clean"] != wide["corrupted"]]
        for pair, pos in cast(list[tuple[Any, Any]], d.index.tolist()):
            diff[int(pair)].add(int(pos))
    sole = [diff[int(p)] for p in rows["pair"]]
    layer = lines["layer"].astype(int)
    paired = lines["intervention"].astype(str).isin(["denoising", "noising"])
    first_comp = site.isin(["attn_out", "mlp_out"]) & (layer == 0) & paired
    cand = lines[((site == "resid_post") & (layer == n_layers - 1)) | ((site == "resid_pre") & (layer == 0))
                 | first_comp]
    embed: dict[tuple, float] = {}  # (intervention, position key) -> the block-0 resid_pre line's effect
    comps = []
    for i, ln in cand.iterrows():
        pos = _row_positions(ln, rows)
        if pos is None:
            continue
        sname = str(ln["site"])
        if sname == "resid_post":
            if bool(np.all(pos == last)):
                out[i] = "unembedding input"
            continue
        at_sole = all(s == {int(p)} for s, p in zip(sole, pos))
        at_changed = all(int(p) in s for s, p in zip(sole, pos))
        if not at_changed or str(ln["intervention"]) not in ("denoising", "noising"):
            continue
        key = (str(ln["intervention"]), str(ln["metric"]) if "metric" in ln else "", tuple(int(p) for p in pos))
        if sname == "resid_pre":
            if at_sole:
                out[i] = "embedding of the only changed token"
            eff = ln.get("effect")
            if not is_missing(eff):
                embed[key] = float(cast(float, eff))
        else:
            comps.append((i, key, at_sole))
    for i, key, at_sole in comps:
        ln = lines.loc[i]
        eff = ln.get("effect")
        ref = embed.get(key, 1.0 if at_sole else None)
        if is_missing(eff) or ref is None:  # several changed tokens and no block-0 residual measured there
            continue
        if abs(float(eff) - ref) <= tol:
            out[i] = (f"first write after the only changed token's embedding (block 0): restores {float(eff):.3f} "
                      f"of the whole residual's {ref:.3f}" if at_sole else
                      f"first write after a changed token's embedding (block 0; other tokens differ too): restores "
                      f"{float(eff):.3f} where the block-0 residual at that position restores {ref:.3f}")
    return out


def line_intervals(lines: pd.DataFrame, main: pd.DataFrame, baselines: pd.DataFrame, ranked_by: str,
                   min_denominator: float, *, named: bool, n_boot: int = 1000, ci: float = TIE_CI,
                   seed: int = 0) -> pd.DataFrame:
    """Percentile bootstrap intervals over rows of mean-over-rows lines (the ratio of means
    recomputed on each resample of the unflagged rows, all lines on the same resamples).

    Args:
        lines: mean lines of the ``main`` table (``scope`` ``mean``).
        main: the ``main`` table (its per-row lines, ``scope`` ``pair``).
        baselines: the ``baselines`` table (per row and metric ``clean``, ``corrupted``).
        ranked_by: ``effect`` (normalised; ``1 - normalized`` for noising and ablations) or ``delta``
            (patched - clean, metric units).
        min_denominator: a resample whose mean clean/corrupted gap is below it gives NaN.
        named: the mean lines are keyed by ``position_name`` (chosen positions), else by ``pos_from_end``.
        n_boot: resamples (rows drawn with replacement).
        ci: the interval's mass.
        seed: the resampling seed.

    Returns:
        Aligned with ``lines``: ``ci_low``, ``ci_high`` (of ``ranked_by``) and ``abs_low``,
        ``abs_high`` (of its absolute value, what ``top_sites`` ranks by); NaN with fewer than 2 rows.
    """
    out = pd.DataFrame({"ci_low": np.nan, "ci_high": np.nan, "abs_low": np.nan, "abs_high": np.nan},
                       index=lines.index)
    if lines.empty:
        return out
    keys = ["intervention", "site", "hook", "layer", "position_name" if named else "pos_from_end", "head_idx",
            "neuron", "metric"]

    def keyed(df: pd.DataFrame) -> pd.DataFrame:
        k = pd.DataFrame(index=df.index)
        for c in keys:
            v = column(df, c)
            k[c] = v.astype(object).where(v.notna(), "<NA>").astype(str)
        return k

    def values_of(c: str) -> list:
        return column(lines, c).unique().tolist()

    lk = keyed(lines).drop_duplicates()
    lk["_line"] = np.arange(len(lk))
    per = where(main, (main["scope"] == "pair") & main["metric"].isin(values_of("metric"))
                & main["site"].isin(values_of("site")) & main["intervention"].isin(values_of("intervention"))
                & main["layer"].isin(values_of("layer")))
    per = where(per, ~per["flagged"].astype(bool))
    if per.empty:
        return out
    pk = keyed(per).assign(_pair=per["pair"].astype(int).to_numpy(), _value=per["value"].to_numpy(dtype=float))
    pk = pk.merge(lk, on=keys, how="inner")
    pairs = np.sort(column(pk, "_pair").to_numpy(dtype=np.int64))
    pairs = np.unique(pairs)
    R = len(pairs)
    if R < 2:
        return out
    col = {p: j for j, p in enumerate(pairs.tolist())}
    V = np.zeros((len(lk), R))
    Msk = np.zeros((len(lk), R))
    ki = pk["_line"].to_numpy(dtype=int)
    pj = np.array([col[int(p)] for p in column(pk, "_pair")], dtype=int)
    V[ki, pj] = pk["_value"].to_numpy()
    Msk[ki, pj] = 1.0
    b = baselines.set_index(["pair", "metric"])
    C = np.zeros((len(lk), R))
    X = np.zeros((len(lk), R))
    for i, m in enumerate(lk["metric"]):
        idx = list(zip(pairs.tolist(), [m] * R))
        C[i] = b["clean"].reindex(idx).to_numpy(dtype=float)
        X[i] = b["corrupted"].reindex(idx).to_numpy(dtype=float)
    rng = np.random.default_rng(seed)
    W = rng.multinomial(R, np.full(R, 1.0 / R), size=n_boot).astype(float)  # [B, R] draw counts
    with np.errstate(invalid="ignore", divide="ignore"):
        n = W @ Msk.T
        vbar = W @ (V * Msk).T / n
        cbar = W @ (np.nan_to_num(C) * Msk).T / n
        if ranked_by == "delta":
            stat = vbar - cbar
        else:
            xbar = W @ (np.nan_to_num(X) * Msk).T / n
            den = cbar - xbar
            norm = np.where(np.abs(den) < min_denominator, np.nan, (vbar - xbar) / den)
            is_den = (lk["intervention"] == "denoising").to_numpy()
            stat = np.where(is_den[None, :], norm, 1.0 - norm)
    lo, hi = (1 - ci) / 2 * 100, (1 + ci) / 2 * 100
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a line without rows has no interval
        q = np.nanpercentile(stat, [lo, hi], axis=0)
        qa = np.nanpercentile(np.abs(stat), [lo, hi], axis=0)
    rows_of = keyed(lines).merge(lk, on=keys, how="left")["_line"].to_numpy(dtype=int)
    out["ci_low"], out["ci_high"] = q[0][rows_of], q[1][rows_of]
    out["abs_low"], out["abs_high"] = qa[0][rows_of], qa[1][rows_of]
    return out


def heatmaps(mean: pd.DataFrame, tokens: pd.DataFrame, baselines: pd.DataFrame, meta: dict, main_metric: str,
             ranked_by: str) -> dict:
    """The figures of :class:`~tracekit.experiments.patching.ActivationPatchingResult`: one heatmap
    (layer x position/head/neuron) per (intervention, site) of the main metric's mean-over-rows lines
    ``mean`` (``normalized`` when ``ranked_by`` is ``effect``, else ``delta``), ticks from the first
    row's ``tokens``; ``{"<intervention>_<site>": Figure}``."""
    # Long (reason): one figure per (site family, intervention) from the same mean table; each block is a few plotting calls.
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    figs = {}
    df = mean
    toks = tokens
    t0 = where(toks, toks["pair"] == toks["pair"].min())
    clean_t = column(where(t0, t0["prompt"] == "clean").set_index("position"), "token")
    corr_t = column(where(t0, t0["prompt"] == "corrupted").set_index("position"), "token")
    equal_len = bool(meta.get("equal_lengths", True))
    named = bool(meta.get("positions"))
    value_col = "normalized" if ranked_by == "effect" else "delta"
    value_label = (f"normalized {main_metric}: 1 = clean, 0 = corrupted" if value_col == "normalized"
                   else f"{main_metric} patched - clean")

    def pos_label(pfe: Any) -> str:
        n = len(clean_t)
        p = n + int(pfe)
        if not equal_len or p not in clean_t.index:
            return f"{int(pfe)}"
        a, b = clean_t[p], corr_t.get(p, clean_t[p])
        lab = repr(a)[1:-1] if a == b else f"{repr(a)[1:-1]}/{repr(b)[1:-1]}"
        return f"{lab[:14]} ({p})"

    names = list(meta.get("positions") or [])
    order = {n: i for i, n in enumerate(names)}

    def ptick(p: Any) -> str:
        """Tick label of a ``_pos`` value: the position's name (chosen positions, by slot) or
        its token (position from the end)."""
        return names[int(p)] if named else pos_label(p)

    for (d, site), g in df.groupby(["intervention", "site"], sort=True):  # pyright: ignore[reportGeneralTypeIssues] # stubs: a list key gives tuples
        axes = P.SITES[site].axes
        g = g.copy()
        g["layer"] = g["layer"].astype(int)
        if named and "pos" in axes:
            g["_pos"] = g["position_name"].map(lambda x: order.get(x, np.nan))
        elif "pos" in axes:
            g["_pos"] = g["pos_from_end"]
        if axes == ("pos",) or axes == ():
            col = "_pos" if axes else None
            if col is None:
                g["_c"] = 0
                col = "_c"
            piv = g.pivot_table(index="layer", columns=col, values=value_col, aggfunc="mean")
            xl = [ptick(c) for c in piv.columns] if axes else ["all positions"]
            xlabel = "position (token)" if not named else "position (named, per row)"
        elif axes == ("head",):
            piv = g.pivot_table(index="layer", columns="head_idx", values=value_col, aggfunc="mean")
            xl = [str(int(c)) for c in piv.columns]
            xlabel = "head" + (" (key/value head)" if P.SITES[site].kv_heads else "")
        elif axes == ("pos", "head"):
            piv = g.pivot_table(index="layer", columns=["_pos", "head_idx"], values=value_col, aggfunc="mean")
            xl = [f"{ptick(p)} H{int(h)}" if int(h) == 0 else f"H{int(h)}" for p, h in piv.columns]
            xlabel = "position (token) x head"
        elif axes == ("neuron",):
            piv = g.pivot_table(index="layer", columns="neuron", values=value_col, aggfunc="mean")
            xl = None
            xlabel = "neuron"
        else:  # ("pos", "neuron")
            piv = g.pivot_table(index=["layer", "_pos"], columns="neuron", values=value_col, aggfunc="mean")
            piv.index = [f"L{int(L)} {ptick(p)}" for L, p in piv.index]
            xl = None
            xlabel = "neuron"
        grid = piv.to_numpy(dtype=float)
        lim = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
        lim = max(lim, 1e-6)
        w = 3.5 + (0.55 * grid.shape[1] if xl is not None and grid.shape[1] <= 60 else 8)
        h = 2.0 + 0.22 * grid.shape[0]
        fig, ax = plt.subplots(figsize=(min(w, 40), min(h, 30)))
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="RdBu", vmin=-lim, vmax=lim,
                       interpolation="nearest")
        if xl is not None:
            ax.set_xticks(range(len(xl)), xl, rotation=70, fontsize=7)
        ax.set_yticks(range(len(piv.index)), [str(i) for i in piv.index], fontsize=6)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("layer")
        what = {"denoising": "clean -> corrupted run", "noising": "corrupted -> clean run"}.get(
            d, f"{d} ablation of the clean run")
        n_rows = int(column(baselines, "pair").nunique())
        ax.set_title(f"{site} patching, {d} ({what}), mean over {n_rows} row(s)\n{value_label}", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.03)
        fig.tight_layout()
        figs[f"{d}_{site}"] = fig
    return figs


def where(df: pd.DataFrame, mask: pd.Series | pd.DataFrame | np.ndarray) -> pd.DataFrame:
    """The lines of ``df`` where the boolean ``mask`` (one per line) holds: ``df[mask]``, typed as a
    frame (the stubs type a column as ``Series | DataFrame``)."""
    return cast(pd.DataFrame, df[cast(pd.Series, mask)])


def column(df: pd.DataFrame, name: str) -> pd.Series:
    """The column ``name`` of ``df``, typed as a Series."""
    return cast(pd.Series, df[name])


def is_missing(v: object) -> bool:
    """A table cell that is None, NaN or <NA> (``pd.isna`` of one value)."""
    return bool(pd.isna(cast(Any, v)))


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The lines of ``df`` as dicts (column -> value), in order: typed access to table lines."""
    return cast(list[dict[str, Any]], df.to_dict("records"))


def site_label(r: dict[str, Any]) -> str:
    """A mean line's index as text: ``L3 H2 pos S2`` (layer, head, neuron, position)."""
    parts = [f"L{int(r['layer'])}"]
    if not is_missing(r.get("head_idx")):
        parts.append(f"H{int(r['head_idx'])}")
    if not is_missing(r.get("neuron")):
        parts.append(f"N{int(r['neuron'])}")
    name = r.get("position_name")
    if isinstance(name, str):
        parts.append(f"pos {name}")
    elif not is_missing(r.get("pos_from_end")):
        tok = r.get("token")
        parts.append(f"pos {int(r['position'])} {tok!r}" if not is_missing(r.get("position"))
                     else f"pos {int(r['pos_from_end'])}")
    return " ".join(parts)


def report_text(summary: dict[str, Any], config: Any, baselines: pd.DataFrame) -> str:
    """:meth:`~tracekit.experiments.patching.ActivationPatchingResult.report`: the rows, the mean
    clean/corrupted scores, flagged rows and the top sites of ``summary``, as text (``config``: the
    :class:`~tracekit.experiments.patching.PatchingSpec` run)."""
    s = summary
    cfg = config
    pos = f", positions {s['positions']}" if s["positions"] else ""
    lines = [(f"activation patching [{cfg.step_name}]: {s['n_rows']} row(s) from {s['dataset_source']}, "
              f"sites {s['sites']}{pos}, interventions {s['interventions']}")]
    if s["positions_auto"]:
        lines.append(f"  positions: {s['positions_auto']}")
    if s["rows_dropped"]:
        lines.append("  rows dropped: " + ", ".join(f"{k}: {v}" for k, v in s["rows_dropped"].items()))
    base = baselines
    for m in cfg.metrics:
        b = where(base, base["metric"] == m)
        corr = f"{b['corrupted'].mean():+.4f}" if column(b, "corrupted").notna().any() else "(no corrupted prompts)"
        lines.append(f"  {m:10s} clean {b['clean'].mean():+.4f}  corrupted {corr}"
                     f"  (mean over rows; flagged {int(column(b, 'flagged').sum())})")
    if s["share_rows_correct"] is not None:
        lines.append(f"  correct (clean logit_diff > 0): {s['share_rows_correct']:.2%} of rows")
    if s["flagged_rows"]:
        lines.append(f"  FLAGGED (|clean - corrupted| < {cfg.min_denominator}): "
                     + ", ".join(f"row {f['row_id']} {f['metric']}" for f in s["flagged_rows"]))
    if s["ranked_by"] == "effect":
        lines.append(f"top sites by |effect| on {cfg.main_metric}, mean over rows (effect = normalized for "
                     "denoising, 1 - normalized for noising/ablations; normalized: 1 = clean, 0 = corrupted):")
    else:
        lines.append(f"top sites by |delta| = |patched - clean| on {cfg.main_metric}, mean over rows (no "
                     "corrupted prompts: nothing to normalise against):")
    lines.append(f"  {'effect':>8} {'normalized':>10} {'delta':>9}  {'intervention':12s} {'site':18s} index")

    def num(v, w):
        return f"{v:+{w}.4f}" if v is not None else f"{'-':>{w}}"

    def line(t) -> str:
        return (f"  {num(t['mean_effect'], 8)} {num(t['mean_normalized'], 10)} {num(t['mean_delta'], 9)}  "
                f"{t['intervention']:12s} {t['site']:18s} {t['label']}")

    def tied(labels: list) -> list[str]:
        return ([f"  tied (within the 95% bootstrap interval) with the first: {', '.join(labels)}"]
                if labels else [])

    lines += [line(t) for t in s["top_sites"]]
    lines += tied(s.get("top_sites_tied") or [])
    if "resid" not in s["top_sites_families"] and s["top_resid_sites"]:
        lines.append("residual stream, ranked apart (a whole position's state; trivially complete lines left out):")
        lines += [line(t) for t in s["top_resid_sites"][:3]]
        lines += tied(s.get("top_resid_sites_tied") or [])
    triv = s.get("trivial_sites") or []
    if triv:
        lines.append(f"trivially complete, left out of the ranking ({len(triv)} line(s)):")
        lines += [f"  {t['intervention']:12s} {t['site']:18s} {t['label']}: {t['cause']}" for t in triv[:8]]
        if len(triv) > 8:
            lines.append(f"  ... {len(triv) - 8} more (summary trivial_sites)")
    return "\n".join(lines)


def families(family: str | list[str], df: pd.DataFrame) -> list[str]:
    """The families ``top_sites`` ranks (``auto``: the components when any were patched)."""
    if family == "auto":
        comps = sorted(set(df["family"]) - {"resid"})
        return comps or ["resid"]
    fams = list(SITE_FAMILIES) + ["other"] if family == "all" else [family] if isinstance(family, str) else family
    bad = [f for f in fams if f not in SITE_FAMILIES and f != "other"]
    if bad:
        raise ValueError(f"family: unknown {bad}; use 'auto', 'all' or of {list(SITE_FAMILIES)}")
    return list(fams)


def rows_table(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The ``rows`` table of a result's ``tables`` (results saved before it existed: built from ``baselines``)."""
    if "rows" in tables:
        return tables["rows"]
    base = tables["baselines"]
    wide = base.pivot(index="pair", columns="metric", values=["clean", "corrupted"]).sort_index()
    df = pd.DataFrame({"pair": wide.index.to_numpy(), "row_id": wide.index.to_numpy()})
    for (which, m) in wide.columns:
        df[f"{which}_{m}"] = wide[(which, m)].to_numpy()
    df["correct"] = (df["clean_logit_diff"] > 0) if "clean_logit_diff" in df else pd.NA
    return df
