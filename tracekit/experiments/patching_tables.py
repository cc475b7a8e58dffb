"""Table shaping of activation patching (``kind: activation_patching``): the engine's job results
(:mod:`tracekit.patching`) into the ``main``, ``baselines``, ``rows`` and ``tokens`` tables of
:class:`tracekit.experiments.patching.ActivationPatchingResult` (columns described there).

Every table has one line per dataset row where it is per row: ``pair`` is the row's index in the
run (0 .. n_rows-1, the order of the rows), ``row_id`` its id in the dataset (kept from the source
when ``filter: correct`` or ``limit`` dropped rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from .. import patching as P
from ..dataset import PreparedDataset
from ..metrics import normalize
from ..tokens import str_tokens

__all__ = ["tokens_frame", "baselines_frame", "rows_frame", "job_frame", "normalise", "MAIN_COLUMNS", "SITE_FAMILIES",
           "site_family", "trivial_lines"]

#: Columns of the ``main`` table, in order.
MAIN_COLUMNS = ["scope", "intervention", "site", "hook", "layer", "position", "position_name", "pos_from_end",
                "token", "head_idx", "neuron", "pair", "row_id", "metric", "value", "delta", "normalized", "flagged",
                "baseline_n", "baseline_source", "effect"]
_INT_COLUMNS = ("position", "pos_from_end", "head_idx", "neuron", "pair", "row_id", "baseline_n", "baseline_source")


def tokens_frame(model, ids: Sequence[tuple[Sequence[int], Sequence[int]]], row_ids: Sequence[int]) -> pd.DataFrame:
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
    tk = tokens_df[tokens_df["prompt"] == "clean"][["pair", "position", "token"]].astype(
        {"pair": "Int64", "position": "Int64"})
    df = df.merge(tk, on=["pair", "position"], how="left")
    v = job.values.numpy().reshape(V * n, Mn)
    return pd.concat([df.assign(metric=m, value=v[:, k]) for k, m in enumerate(metrics)], ignore_index=True)


def _one_or_na(g, col: str, dtype: str) -> pd.Series | pd.arrays.BaseMaskedArray:
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
    out = pd.concat([main[cols], mean[cols]], ignore_index=True)
    # effect: how far the patch moves the run it was applied to, towards the other run
    # (denoising: normalized; noising and ablations of the clean run: 1 - normalized)
    out["effect"] = np.where(out["intervention"] == "denoising", out["normalized"], 1.0 - out["normalized"])
    for c in _INT_COLUMNS:
        out[c] = out[c].astype("Int64")
    out["position_name"] = out["position_name"].astype(object).where(out["position_name"].notna(), None)
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


def _row_positions(line, rows: pd.DataFrame) -> np.ndarray | None:
    """Each row's token index of a mean line's position (named: ``pos_<NAME>``; else from the end)."""
    name = line["position_name"]
    if isinstance(name, str):
        col = f"pos_{name}"
        return rows[col].to_numpy(dtype=np.int64) if col in rows else None
    pfe = line["pos_from_end"]
    return None if pd.isna(pfe) else rows["n_tokens"].to_numpy(dtype=np.int64) + int(pfe)


def trivial_lines(lines: pd.DataFrame, rows: pd.DataFrame, tokens: pd.DataFrame, n_layers: int) -> pd.Series:
    """Which lines are residual-stream patches whose effect is fixed by construction (not a finding).

    A line is trivial when its site is the residual stream and the patch replaces everything the
    result depends on:

    * a whole-layer residual site (``resid_pre_layer``, ``resid_mid_layer``, ``resid_post_layer``):
      every position's whole state, so the run from there on is the source run (effect 1);
    * ``resid_post`` of the last block at each row's last token: the very vector the unembedding
      reads (effect 1, for every intervention);
    * ``resid_pre`` of block 0 (the embeddings) at each row's only position where the clean and
      corrupted tokens differ, for ``denoising``/``noising``: the patched run is the other run (effect 1).

    Args:
        lines: lines of the ``main`` table (``site``, ``layer``, ``intervention``, ``position_name``,
            ``pos_from_end``).
        rows: the ``rows`` table (``n_tokens``, ``pos_<NAME>``), one line per row in ``pair`` order.
        tokens: the ``tokens`` table (clean and corrupted tokens of every row).
        n_layers: the model's number of blocks.

    Returns:
        A boolean Series aligned with ``lines``.
    """
    out = pd.Series(False, index=lines.index)
    if lines.empty:
        return out
    resid = lines["site"].astype(str).str.startswith("resid_")
    out |= resid & lines["site"].astype(str).str.endswith("_layer")
    if "n_tokens" not in rows:  # a result saved before the rows table: only the whole-layer rule
        return out
    last = rows["n_tokens"].to_numpy(dtype=np.int64) - 1
    wide = tokens.pivot_table(index=["pair", "position"], columns="prompt", values="token_id", aggfunc="first")
    diff: dict[int, set] = {int(p): set() for p in rows["pair"]}
    if "corrupted" in wide:
        d = wide[wide["clean"] != wide["corrupted"]]
        for pair, pos in d.index:
            diff[int(pair)].add(int(pos))
    sole = [diff[int(p)] for p in rows["pair"]]
    layer = lines["layer"].astype(int)
    cand = lines[((lines["site"] == "resid_post") & (layer == n_layers - 1)) | ((lines["site"] == "resid_pre") & (layer == 0))]
    for i, ln in cand.iterrows():
        pos = _row_positions(ln, rows)
        if pos is None:
            continue
        if ln["site"] == "resid_post":
            out[i] = bool(np.all(pos == last))
        elif ln["intervention"] in ("denoising", "noising"):
            out[i] = all(s == {int(p)} for s, p in zip(sole, pos))
    return out
