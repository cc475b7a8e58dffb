"""Activation patching experiment: which activations carry the information that changes the answer?

The method, the sites and the engine live in :mod:`tracekit.patching` (usable from notebooks on
their own); this module is the YAML/notebook experiment around it::

    from tracekit import ActivationPatching, load_model
    res = ActivationPatching(
        pairs=[{"clean": "The capital of France is", "corrupted": "The capital of Italy is",
                "target": " Paris", "foil": " Rome"}],
        sites=["block_every"], directions=["denoising", "noising"],
    ).run(load_model())
    res.to_frame(); res.summary()["top_sites"]; res.figures()

    # over a dataset: each row its own clean/corrupted prompt, target, foil and named positions
    res = ActivationPatching(dataset={"generator": {"name": "ioi", "n": 8}}, sites=["head_out"]).run(load_model())
    res.tables["rows"]              # one line per row: clean/corrupted logit difference, correct
    res.summary()["mean_clean"]     # {metric: mean over rows}

Over 600 lines because the result's readings (ranking, ties, trivially complete lines, summary)
sit with the spec's fields and checks; the table code is in :mod:`.patching_tables`.

Rows come from ``pairs`` / ``pairs_file`` (``{clean, corrupted, target, foil}``) or from a
``dataset`` (:class:`tracekit.dataset.DatasetSpec`: each row's ``prompt`` is the clean prompt,
``corrupted`` the corrupted one, ``target``/``foil`` its own answers, ``positions`` its named
positions); pairs become rows (``prompt`` = ``clean``) and every row then takes one code path.
Rows of different token lengths are patched in separate equal-length groups (never padded), so a
named position is each row's own token index.

Sources: Meng et al. 2022 (ROME causal tracing); Wang et al. 2022 (IOI); Heimersheim & Nanda 2024
("How to use and interpret activation patching"); Zhang & Nanda 2023 (metrics).

Tables (``pair`` = the row's index in the run, ``row_id`` = its id in the dataset):

* ``main``: one line per intervention x site x index (layer, position and/or head/neuron) x row x
  metric, plus lines averaged over rows (``pair``/``row_id`` <NA>, ``scope`` = ``mean``).
  ``intervention`` is the patching direction (``denoising``, ``noising``) or the ablation
  (``zero``, ``mean``, ``resample``) (renamed from ``direction``); ``head_idx`` the head (renamed
  from ``head``); ``position`` the token index (BOS counted) and ``position_name`` the name of a
  chosen position (``positions``). ``value`` is the raw metric of the patched run (``logit_diff``
  in logits, ``prob`` in [0, 1], ``log_prob`` in nats, ``kl`` in nats); ``delta`` = ``value -
  clean`` (metric units); ``normalized`` = ``(value - corrupted) / (clean - corrupted)`` (clean run
  1, corrupted run 0; NaN for a flagged row and without corrupted prompts); ``effect`` =
  ``normalized`` for denoising, ``1 - normalized`` otherwise. Mean lines average the raw values
  over unflagged rows and normalise the averages (a ratio of means). Ablation lines carry
  ``baseline_n`` (prompts averaged by ``mean``; 1 for ``resample``) and ``baseline_source`` (the
  resampled prompt's index in the population).
* ``rows``: one line per row: ``pair``, ``row_id``, the row's fields (``prompt``, ``target``,
  ``foil``, ``corrupted``, ``group``, ``pos_<NAME>``, extra columns), ``n_tokens``,
  ``clean_<metric>`` / ``corrupted_<metric>`` (``logit_diff`` whenever the rows have foils),
  ``correct`` (``clean_logit_diff > 0``) and ``flagged`` (main metric).
* ``baselines``: per row and metric the clean and corrupted scores, their gap and ``flagged``.
* ``tokens``: every row's tokens (pair, row_id, prompt ``clean``/``corrupted``, position, token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, cast

import numpy as np
import pandas as pd
import torch
from pydantic import Field, field_serializer, field_validator, model_validator

from .. import patching as P
from ..core.progress import progress_bar
from ..dataset import DatasetSpec
from ..dataset.paired import POSITION_SPEC_FORMS, PairedRows, position_specs
from ..dataset.pairs import PromptPair, load_pairs
from ..errors import PatchingError
from ..model.info import HookedModel
from ..tokens import check_length, encode
from . import patching_tables as T
from .base import Experiment, Indices, OptionalPrompts, Result, register
from .patching_tables import baselines_frame, job_frame, normalise, rows_frame, tokens_frame
from .sources import PAIRED_SOURCES, RowSource

__all__ = ["ActivationPatching", "ActivationPatchingInputs", "ActivationPatchingResult", "PatchingSpec", "PromptPair",
           "load_pairs", "POSITION_SPEC_FORMS"]

Direction = Literal["denoising", "noising"]
Ablation = Literal["zero", "mean", "resample"]


@dataclass(frozen=True)
class ActivationPatchingInputs:
    """What :meth:`PatchingSpec.prepare` builds once: the paired rows and the baseline population.

    Attributes:
        rows: the :class:`~tracekit.dataset.paired.PairedRows` (clean/corrupted ids, targets, foils,
            positions); its fields read through as this object's (``data``, ``clean_ids``,
            ``target_ids``, ``positions``, ``positions_auto``, ...).
        baseline_ids: the ``mean``/``resample`` population's ids (None: the rows' clean prompts).
        population_name: the population's name in errors; population_source: in the result's meta.
    """

    rows: PairedRows
    baseline_ids: tuple[tuple[int, ...], ...] | None
    population_name: str
    population_source: str

    data = property(lambda self: self.rows.data)
    target_ids = property(lambda self: self.rows.target_ids)
    foil_ids = property(lambda self: self.rows.foil_ids)
    targets = property(lambda self: self.rows.targets)
    foils = property(lambda self: self.rows.foils)
    clean_ids = property(lambda self: self.rows.clean_ids)
    corrupted_ids = property(lambda self: self.rows.corrupted_ids)
    has_corrupted = property(lambda self: self.rows.has_corrupted)
    positions = property(lambda self: self.rows.positions)
    position_names = property(lambda self: self.rows.position_names)
    positions_auto = property(lambda self: self.rows.positions_auto)

    @property
    def row_ids(self) -> list[int]:
        """Each row's id in the dataset."""
        return self.rows.row_ids


class ActivationPatchingResult(Result):
    """Result of :class:`ActivationPatching`: tables ``main``, ``rows``, ``baselines``, ``tokens``
    (columns in the module docstring).

    Summary keys (rows = the dataset rows patched, in the order of the ``rows`` table):

    * ``n_rows``; ``row_id_by_row`` (each row's dataset id); ``dataset_source``; ``rows_dropped``
      (why rows were dropped by the dataset, and how many).
    * ``metrics``, ``main_metric``, ``interventions`` (the directions and ablations run),
      ``sites``, ``positions`` (the chosen positions' names, or None: every position),
      ``positions_auto`` (why the positions are the dataset's named positions although none were
      given: rows of different lengths or templates, whose positions by index mix token roles).
    * ``mean_clean`` / ``mean_corrupted``: ``{metric: mean over rows}`` of the unpatched clean /
      corrupted run's score (``mean_corrupted`` values are None without corrupted prompts).
    * ``clean_logit_diff_by_row`` / ``corrupted_logit_diff_by_row`` (logits), ``correct_by_row``
      (``clean_logit_diff > 0``) and ``share_rows_correct`` (the fraction of rows with it): None
      without foils.
    * ``flagged_rows`` (``{pair, row_id, metric, clean, corrupted}`` per row and metric whose gap
      is below ``min_denominator``), ``n_rows_flagged`` / ``n_rows_unflagged`` (on the main metric),
      ``metrics_with_flagged_mean`` (metrics whose mean-over-rows gap is below it).
    * ``baseline_population`` (``mean``/``resample`` runs: its source and size).
    * ``ranked_by``: ``effect`` (with corrupted prompts) or ``delta`` (ablation-only runs without
      them). ``top_sites``: the ``top_k`` mean-over-rows lines of the main metric with the largest
      |``ranked_by``|, as ``{intervention, site, layer, label, position, position_name, head_idx,
      neuron, token, mean_value, mean_delta, mean_normalized, mean_effect}`` (``mean_value``: the
      mean over unflagged rows of the patched score; ``mean_delta``: minus the mean clean score;
      ``mean_normalized`` / ``mean_effect``: that mean normalised by the mean clean and corrupted
      scores). The list ranks the component sites (``attn``, ``mlp``, ``heads``, ``neurons``)
      when the run patched any, else the residual stream (``top_sites_families`` says which);
      ``top_resid_sites``: the residual-stream lines ranked apart (a residual patch moves a
      position's whole state, so it would crowd out the components). Each record also has
      ``rank``, ``tied_with_top`` and ``ci_low``/``ci_high`` (95% bootstrap interval over rows);
      ``top_sites_tied`` / ``top_resid_sites_tied``: the labels of the lines tied with the first
      (their |effect| intervals overlap: the order among them is noise). Trivially complete lines
      (fixed by construction, or a block-0 write at the only changed token that restores the whole
      difference) are left out of both (:meth:`top_sites`) and listed in ``trivial_sites``
      (``{intervention, site, label, cause, mean_effect}``, main metric). ``top_by_site``:
      ``{"<intervention>/<site>": the top 3 such records}``. Numbers are not rounded (float64 of the tables).
    """

    config: "ActivationPatching"
    main_table = "main"
    #: ``direction`` held ablations too; ``head`` -> ``head_idx`` is global (tracekit.results.RENAMED_COLUMNS).
    renamed_columns = {"main.direction": "intervention"}
    #: Keys of summary() (pipelines check references against them before any model loads).
    summary_keys = ("n_rows", "row_id_by_row", "dataset_source", "rows_dropped", "metrics", "main_metric",
                    "interventions", "sites", "positions", "positions_auto", "mean_clean", "mean_corrupted",
                    "clean_logit_diff_by_row", "corrupted_logit_diff_by_row", "correct_by_row",
                    "share_rows_correct", "flagged_rows", "n_rows_flagged", "n_rows_unflagged",
                    "metrics_with_flagged_mean", "baseline_population", "ranked_by", "top_sites", "top_sites_families",
                    "top_sites_tied", "top_resid_sites", "top_resid_sites_tied", "trivial_sites", "top_by_site",
                    "chunks")
    table_names = ("main", "rows", "baselines", "tokens")
    #: First in the notebook display (``_repr_html_``).
    headline_keys = ("n_rows", "main_metric", "ranked_by", "mean_clean", "mean_corrupted", "share_rows_correct",
                     "n_rows_flagged", "top_sites_families", "top_sites")
    #: Why a summary value can be null (quoted when a pipeline reference resolves to null).
    null_reasons = {
        "share_rows_correct": "the rows have no foil, so there is no logit difference to call correct",
        "positions": "no positions were chosen: position-indexed sites were patched at every position",
        "positions_auto": "the positions were given (positions:), or every row has the same length and template",
    }

    # ---- helpers -------------------------------------------------------------------------
    @property
    def ranked_by(self) -> str:
        """``effect`` (normalised against the corrupted run), or ``delta`` when the rows have no
        corrupted prompt (an ablation-only run)."""
        return "effect" if self.meta.get("has_corrupted", True) else "delta"

    def _mean_rows(self, metric: str | None = None) -> pd.DataFrame:
        df = self.tables["main"]
        df = T.where(df, df["scope"] == "mean")
        return T.where(df, df["metric"] == (metric or self.config.main_metric))

    def top_sites(self, n: int | None = None, intervention: str | None = None, site: str | None = None,
                  metric: str | None = None, *, family: str | list[str] = "auto", trivial: bool = False,
                  k: int | None = None, intervals: bool = True) -> pd.DataFrame:
        """Mean-over-rows lines with the largest |effect| (|delta| without corrupted prompts; ties:
        lower layer first). ``effect`` is ``normalized`` for denoising and ``1 - normalized`` for
        noising and ablations (the damage).

        The residual stream is ranked apart from the components: a residual-stream patch moves the
        whole state of a position, so late layers at the last token restore nearly everything and
        would fill the list. ``family="auto"`` ranks the component sites (``attn``, ``mlp``,
        ``heads``, ``neurons``) when the run patched any, else the residual stream; lines whose
        effect is fixed by construction or that carry the whole clean/corrupted difference by where
        they sit (trivially complete, :func:`~tracekit.experiments.patching_tables.trivial_causes`:
        the last block's ``resid_post`` at the last token, block 0's ``resid_pre`` at the only
        changed token, whole-layer residual sites, and a block-0 ``attn_out``/``mlp_out`` at the
        only changed token whose measured effect is within
        :data:`~tracekit.experiments.patching_tables.TRIVIAL_TOL` of the whole residual's) are left
        out unless ``trivial=True``.

        Ties: each returned line gets a 95% percentile bootstrap interval over the rows
        (:func:`~tracekit.experiments.patching_tables.line_intervals`, 1000 resamples, seed
        ``seed``); a line whose interval of |effect| overlaps the first line's is **tied with the
        top** (``tied_with_top``) and shares its ``rank`` 1: the order among them is noise. One row:
        no intervals, no ties.

        Args:
            n: lines returned (default: the config's ``top_k``).
            intervention: only this intervention (``denoising``, ``noising``, ``zero``, ...).
            site: only this site (``resid_pre``, ``head_out``, ...).
            metric: the metric ranked (default: ``main_metric``).
            family: ``auto``, ``all``, or one family or a list of
                :data:`~tracekit.experiments.patching_tables.SITE_FAMILIES` (``resid``, ``attn``,
                ``mlp``, ``heads``, ``neurons``).
            trivial: keep the trivially complete lines.
            k: the former name of ``n`` (kept as an alias).
            intervals: compute the bootstrap intervals and ties (else those columns are NaN/False).

        Returns:
            The ``main`` lines (``scope`` ``mean``), best first, with columns ``family``,
            ``trivial`` (trivially complete), ``trivial_cause`` (why, or None), ``ci_low`` /
            ``ci_high`` (the 95% bootstrap interval of the ranked column, ``effect`` or ``delta``),
            ``tied_with_top`` (its |value| interval overlaps the first line's; False for the first
            line) and ``rank`` (1 for the first line and every line tied with it, else its place).

        Raises:
            TypeError: ``n`` and ``k`` both given with different values.
            ValueError: an unknown family.
        """
        if n is not None and k is not None and n != k:
            raise TypeError(f"top_sites: give n (or its alias k), not both (n={n}, k={k})")
        n = n if n is not None else k
        df = self._mean_rows(metric)
        if intervention is not None:
            df = T.where(df, df["intervention"] == intervention)
        if site is not None:
            df = T.where(df, df["site"] == site)
        df = df.assign(family=df["site"].astype(str).map(T.site_family))
        causes = self._trivial().reindex(df.index)
        df = df.assign(trivial=causes.notna().to_numpy(), trivial_cause=causes.astype(object).to_numpy())
        fams = T.families(family, df)
        df = T.where(df, df["family"].isin(fams) & (trivial | ~df["trivial"]))
        col = self.ranked_by
        df = T.where(df, df[col].notna())
        df = df.assign(_abs=df[col].abs()).sort_values(["_abs", "layer"], ascending=[False, True])
        df = df.drop(columns="_abs").head(n or self.config.top_k)
        return self._ties(df, intervals)

    def _ties(self, df: pd.DataFrame, intervals: bool) -> pd.DataFrame:
        """``df`` (ranked, best first) with ``ci_low``, ``ci_high``, ``tied_with_top`` and ``rank``."""
        df = df.assign(ci_low=np.nan, ci_high=np.nan, tied_with_top=False,
                       rank=np.arange(1, len(df) + 1, dtype=np.int64))
        if not intervals or len(df) == 0:
            return df
        iv = T.line_intervals(df, self.tables["main"], self.tables["baselines"], self.ranked_by,
                              self.config.min_denominator, named=bool(self.meta.get("positions")),
                              seed=self.config.seed)
        df["ci_low"], df["ci_high"] = iv["ci_low"].to_numpy(), iv["ci_high"].to_numpy()
        lo, hi = iv["abs_low"].to_numpy(), iv["abs_high"].to_numpy()
        tied = (lo <= hi[0]) & (hi >= lo[0]) & np.isfinite(lo) & np.isfinite(lo[0])
        tied[0] = False
        df["tied_with_top"] = tied
        df.loc[tied, "rank"] = 1
        return df

    def _trivial(self) -> pd.Series:
        """:func:`~tracekit.experiments.patching_tables.trivial_causes` of the mean lines (computed once)."""
        main = self.tables["main"]
        key = (id(main), len(main))
        if getattr(self, "_trivial_key", None) != key:
            mean = T.where(main, main["scope"] == "mean")
            self._trivial_flags = T.trivial_causes(mean, self._rows_table(), self.tables["tokens"],
                                                  int(self.meta.get("n_layers", 0)))
            self._trivial_key = key
        return self._trivial_flags

    def top_heads(self, n: int | None = None, **kw) -> pd.DataFrame:
        """:meth:`top_sites` of the attention heads (``family="heads"``; the other arguments as there)."""
        return self.top_sites(n, family="heads", **kw)

    def _rows_table(self) -> pd.DataFrame:
        """The ``rows`` table (:func:`~tracekit.experiments.patching_tables.rows_table`)."""
        return T.rows_table(self.tables)

    # ---- summary -------------------------------------------------------------------------
    def summary(self) -> dict:
        base = self.tables["baselines"]
        rows = self._rows_table()
        cfg = self.config
        dmeta = self.meta.get("dataset", {})
        out: dict = {
            "n_rows": int(len(rows)),
            "row_id_by_row": [int(x) for x in rows["row_id"]],
            "dataset_source": dmeta.get("source"),
            "rows_dropped": dict(dmeta.get("dropped", {})),
            "metrics": list(cfg.metrics),
            "main_metric": cfg.main_metric,
            "interventions": sorted(self.tables["main"]["intervention"].unique().tolist()),
            "sites": list(self.meta.get("sites", [])),
            "positions": list(self.meta["positions"]) if self.meta.get("positions") else None,
            "positions_auto": self.meta.get("positions_auto"),
        }

        def mean_or_none(x: pd.Series | pd.DataFrame) -> float | None:
            num = cast(pd.Series, pd.to_numeric(x, errors="coerce"))
            return None if num.isna().all() else float(num.mean())

        out["mean_clean"] = {m: mean_or_none(g["clean"]) for m, g in base.groupby("metric")}
        out["mean_corrupted"] = {m: mean_or_none(g["corrupted"]) for m, g in base.groupby("metric")}
        has_ld = "clean_logit_diff" in rows
        out["clean_logit_diff_by_row"] = [float(x) for x in rows["clean_logit_diff"]] if has_ld else None
        out["corrupted_logit_diff_by_row"] = ([None if pd.isna(x) else float(x) for x in rows["corrupted_logit_diff"]]
                                              if has_ld else None)
        correct = [bool(x) for x in rows["correct"]] if has_ld else None
        out["correct_by_row"] = correct
        out["share_rows_correct"] = float(np.mean(correct)) if correct is not None and len(rows) else None
        flagged = T.where(base, base["flagged"])
        rid = "row_id" if "row_id" in base else "pair"
        out["flagged_rows"] = [{"pair": int(r["pair"]), "row_id": int(r[rid]), "metric": r["metric"],
                                "clean": float(r["clean"]), "corrupted": float(r["corrupted"])}
                               for r in T.records(flagged)]
        main_base = T.where(base, base["metric"] == cfg.main_metric)
        out["n_rows_flagged"] = int(T.column(main_base, "flagged").sum())
        out["n_rows_unflagged"] = int((~T.column(main_base, "flagged")).sum())
        mrows = T.where(self.tables["main"], self.tables["main"]["scope"] == "mean")
        out["metrics_with_flagged_mean"] = sorted(T.where(mrows, mrows["flagged"].astype(bool))["metric"].unique().tolist())
        out["baseline_population"] = self.meta.get("baseline_population")
        out["ranked_by"] = self.ranked_by

        def rec(r: dict[str, Any]) -> dict:
            d = {"intervention": r["intervention"], "site": r["site"], "layer": int(r["layer"]),
                 "label": T.site_label(r)}
            for c in ("value", "delta", "normalized", "effect"):
                v = r.get(c)
                d[f"mean_{c}"] = None if T.is_missing(v) else float(cast(float, v))  # unrounded, as every number of this summary
            for c in ("position", "head_idx", "neuron"):
                if not T.is_missing(r.get(c)):
                    d[c] = int(r[c])
            for c in ("position_name", "token"):
                if isinstance(r.get(c), str):
                    d[c] = r[c]
            if "rank" in r:
                d["rank"] = int(r["rank"])
                d["tied_with_top"] = bool(r["tied_with_top"])
                for c in ("ci_low", "ci_high"):
                    d[c] = None if T.is_missing(r.get(c)) else float(cast(float, r[c]))
            return d

        top = self.top_sites()
        out["top_sites"] = [rec(r) for r in T.records(top)]
        out["top_sites_families"] = sorted(set(top["family"]))
        out["top_sites_tied"] = [f"{r['site']} {r['label']}" for r in out["top_sites"] if r.get("tied_with_top")]
        out["top_resid_sites"] = [rec(r) for r in T.records(self.top_sites(family="resid"))]
        out["top_resid_sites_tied"] = [f"{r['site']} {r['label']}" for r in out["top_resid_sites"] if r.get("tied_with_top")]
        allm = self._mean_rows()
        causes = self._trivial().reindex(allm.index)
        triv = T.where(allm, causes.notna())
        out["trivial_sites"] = [{"intervention": r["intervention"], "site": r["site"], "label": T.site_label(r),
                                 "cause": str(causes[i]),
                                 "mean_effect": None if T.is_missing(r.get("effect")) else float(r["effect"])}
                                for i, r in zip(triv.index, T.records(triv))]
        by = {}
        for (d, s), _ in self._mean_rows().groupby(["intervention", "site"], sort=True):  # pyright: ignore[reportGeneralTypeIssues] # stubs: a list key gives tuples
            top = self.top_sites(k=3, intervention=str(d), site=str(s), intervals=False)
            by[f"{d}/{s}"] = [rec(r) for r in T.records(top)]
        out["top_by_site"] = by
        out["chunks"] = self.meta.get("chunks")
        return out

    def report(self) -> str:
        """The summary as text (:func:`~tracekit.experiments.patching_tables.report_text`)."""
        return T.report_text(self.summary(), self.config, self.tables["baselines"])

    # ---- figures -------------------------------------------------------------------------
    def figures(self) -> dict:
        """One heatmap per (intervention, site) of the main metric's mean-over-rows lines
        (:func:`~tracekit.experiments.patching_tables.heatmaps`)."""
        return T.heatmaps(self._mean_rows(), self.tables["tokens"], self.tables["baselines"], self.meta,
                          self.config.main_metric, self.ranked_by)


class PatchingSpec(RowSource, Experiment):
    """The fields, checks and inputs of the patching kinds (:class:`ActivationPatching`, and
    :class:`tracekit.experiments.attribution.AttributionPatching`, which estimates the same runs):
    the rows (one of ``pairs``, ``pairs_file``, ``dataset``: :class:`tracekit.experiments.sources.RowSource`),
    sites, positions, interventions and metrics. Not a kind itself (no ``kind`` of its own).

    Fields:
        pairs: inline prompt pairs (:class:`PromptPair`: ``clean``, ``corrupted``, ``target``, ``foil``).
        pairs_file: or a ``.jsonl``/``.json``/``.csv`` file of pairs (relative to the working directory).
        dataset: or a dataset (:class:`tracekit.dataset.DatasetSpec`: ``rows``, ``path`` or
            ``generator``, e.g. ``{generator: {name: ioi, n: 8}}``): per row ``prompt`` (the clean
            prompt), ``corrupted`` (required by ``directions``; a run of only the ablations ``zero``/
            ``mean``/``resample`` needs none), ``target``, ``foil`` (required by ``logit_diff``) and
            named ``positions``. Exactly one of ``pairs``, ``pairs_file``, ``dataset``.
        sites: site names or groups (``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out``,
            ``mlp_out``, ``head_out``, ``head_q|k|v``, ``head_pattern`` (each also ``_by_pos``),
            ``neuron``/``neuron_by_pos``, ``resid_pre_layer``, ...; groups ``block_every``,
            ``resid_every``, ``heads_every``, ``heads_every_by_pos``). See :mod:`tracekit.patching`.
        positions: patch position-indexed sites (``resid_*``, ``attn_out``, ``mlp_out``,
            ``*_by_pos``, ``neuron_by_pos``) only at these positions, each resolved per row: a name
            of the dataset's positions (``S2``, ``END``: each row's own index), an index (BOS counted;
            ``-1`` = the last token), ``last`` or ``token:<text>``. Default: every position. Sites
            without a position axis (``head_out``, ``*_layer``) are unaffected.
        directions: ``denoising`` (clean activation into the corrupted run) and/or ``noising``.
        ablations: baselines on the clean run: ``zero``, ``mean`` (the site's mean over the baseline
            population, other than the row's own clean prompt, aligned by position from the end;
            at least 2 such prompts at least as long as the row), ``resample`` (the site from one
            other prompt of the population, drawn with ``seed``). Table columns ``baseline_n`` and
            ``baseline_source`` record the population size and the resampled prompt.
        baseline_prompts: the baseline population of ``mean``/``resample`` (default: every row's
            clean prompt; ``baseline_source`` indexes this list).
        metrics: any of ``logit_diff``, ``prob``, ``log_prob``, ``kl`` (:mod:`tracekit.metrics`),
            each scored against the row's own target/foil.
        main_metric: the metric (one of ``metrics``) that ranks sites in the summary and colours the
            heatmaps (default ``logit_diff``).
        layers: block indices to patch (default all; negative from the end); ``neuron_layers``/``neurons``
            for neuron sites.
        neuron_layers: block indices whose MLP neurons (``blocks.{L}.mlp.hook_post``) are patched by
            ``neuron``/``neuron_by_pos`` sites (negative from the end); required when a neuron site is listed.
        neurons: neuron indices ``0 .. d_mlp-1`` patched in each of ``neuron_layers`` (default: all).
        seed: seed of the ``resample`` ablation's draw of the other prompt (default 0).
        min_denominator: a row whose |clean - corrupted| score is below this is flagged and gets
            NaN normalised values (never a division by ~0).
        batch_size: variants per replay batch or ``auto`` (free memory); halves on out-of-memory.
        skip_unchanged: bit-exact no-op patches take the cached run's score (exact, faster).
        top_k: sites listed in the summary.
    """

    row_sources = PAIRED_SOURCES
    pairs: list[PromptPair] = Field(default_factory=list)
    pairs_file: str | None = None
    dataset: Optional[DatasetSpec] = None
    sites: list[str] = Field(default_factory=lambda: ["block_every"])
    positions: Optional[list[Union[int, str]]] = None
    directions: list[Direction] = Field(default_factory=lambda: ["denoising"])
    ablations: list[Ablation] = Field(default_factory=list)
    baseline_prompts: OptionalPrompts = Field(default_factory=list)
    metrics: list[Literal["logit_diff", "prob", "log_prob", "kl"]] = Field(
        default_factory=lambda: ["logit_diff", "prob", "log_prob", "kl"], min_length=1)
    main_metric: Literal["logit_diff", "prob", "log_prob", "kl"] = "logit_diff"
    layers: Indices | None = None
    neuron_layers: Indices | None = None
    neurons: Indices | None = None
    min_denominator: float = Field(default=1e-3, gt=0)
    batch_size: int | Literal["auto"] = "auto"
    skip_unchanged: bool = True
    seed: int = 0
    top_k: int = Field(default=10, ge=1)


    @field_validator("batch_size")
    @classmethod
    def _bs(cls, v: Union[int, str]) -> Union[int, str]:
        if isinstance(v, int) and v < 1:
            raise ValueError("batch_size must be >= 1 or 'auto'")
        return v

    @field_validator("positions", mode="before")
    @classmethod
    def _positions(cls, v: Any) -> Any:
        return position_specs(v)

    @field_serializer("dataset")
    def _dataset_json(self, v: Optional[DatasetSpec]) -> Optional[dict]:
        # only the options given: a generator's options for other generators are refused on reload
        return None if v is None else v.model_dump(mode="json", exclude_unset=True)

    @model_validator(mode="after")
    def _consistent(self) -> "PatchingSpec":
        # the row source (one of pairs, pairs_file, dataset) is checked first, by RowSource
        if self.main_metric not in self.metrics:
            raise ValueError(f"main_metric {self.main_metric!r} must be one of metrics {self.metrics}")
        if not self.directions and not self.ablations:
            raise ValueError("directions and ablations are both empty; add 'denoising' to directions")
        if self.baseline_prompts and not {"mean", "resample"} & set(self.ablations):
            raise ValueError("baseline_prompts: only the 'mean' and 'resample' ablations use a baseline population; "
                             "add one to ablations or remove baseline_prompts")
        try:
            sites = P.expand_sites(self.sites)
        except P.PatchingError as e:
            raise ValueError(str(e)) from e
        if any(s.startswith("neuron") for s in sites) and not self.neuron_layers:
            raise ValueError("sites include neurons: set neuron_layers (e.g. [20, 21]) to choose the layers "
                             "whose MLP neurons are patched")
        if self.positions and not any("pos" in P.SITES[s].axes for s in sites):
            raise ValueError(f"positions: none of the sites {sites} is indexed by position (positions restrict "
                             "resid_*, attn_out, mlp_out, *_by_pos and neuron_by_pos sites); remove positions or "
                             "add such a site")
        return self

    # ---- input handling ------------------------------------------------------------------
    @property
    def modes(self) -> list[str]:
        """The directions, then the ablations."""
        return [str(d) for d in self.directions] + [str(a) for a in self.ablations]

    def _population(self, model: HookedModel) -> tuple[tuple[tuple[int, ...], ...] | None, str, str]:
        """``(baseline ids or None, population name for errors, population name for meta)``."""
        if not self.baseline_prompts:
            return None, "the rows' clean prompts", "rows.prompt"
        ids = []
        for i, text in enumerate(self.baseline_prompts):
            seq = encode(model, text)
            check_length(model, seq, f"baseline_prompts[{i}]", text)
            ids.append(tuple(seq))
        return tuple(ids), "baseline_prompts", "baseline_prompts"

    def prepare(self, model: HookedModel) -> ActivationPatchingInputs:
        """The rows (the dataset, or the pairs as rows: :class:`~tracekit.dataset.paired.PairedRows`),
        their target/foil ids, clean and corrupted token ids (equal lengths per row), chosen positions
        per row and the baseline population (tokenizer only: works on a
        :class:`tracekit.model.ModelInfo`; a dataset's ``filter: correct`` then waits for the run).

        Raises:
            TokenizationError / DatasetError / PatchingError: as
                :meth:`tracekit.dataset.paired.PairedRows.prepare`, naming the field or row.
        """
        why = None
        if self.directions:
            why = (f"the directions {list(self.directions)} patch between each row's prompt and its corrupted "
                   "prompt (same token length): add corrupted to every row, or run only the ablations "
                   "zero/mean/resample (directions: [])")
        rows = self.paired_rows(model, positions=self.positions, foil_required="logit_diff" in self.metrics,
                                corrupted_needed_by=why,
                                align_positions=any("pos" in P.SITES[s].axes for s in P.expand_sites(self.sites)))
        pop, pop_name, pop_meta = self._population(model)
        return ActivationPatchingInputs(rows=rows, baseline_ids=pop, population_name=pop_name,
                                        population_source=pop_meta)

    def check(self, model: HookedModel) -> ActivationPatchingInputs:
        """:meth:`prepare`, then the layers, neurons and baseline population (tokenizer and config
        only: works on a :class:`tracekit.model.ModelInfo`)."""
        inputs = self.prepare(model)
        n = int(model.cfg.n_layers)
        P.resolve_layers(n, self.layers, "layers")
        P.resolve_layers(n, self.neuron_layers or [], "neuron_layers")
        d_mlp = int(getattr(model.cfg, "d_mlp", 0) or 0)
        for i, j in enumerate(self.neurons or []):
            if not 0 <= j < d_mlp:
                raise PatchingError(f"neurons[{i}]: {j} is out of range (the MLP has {d_mlp} neurons)")
        clean_ids = [list(c) for c in inputs.clean_ids]
        pop = inputs.baseline_ids
        for mode in ("mean", "resample"):
            if mode in self.ablations:
                P.baseline_members(clean_ids, [list(b) for b in pop] if pop is not None else clean_ids, mode,
                                   inputs.population_name)
        return inputs

    def metric_names(self, inputs: ActivationPatchingInputs) -> list[str]:
        """``metrics``, plus ``logit_diff`` whenever the rows have foils (the rows table reports it)."""
        return list(self.metrics) + (["logit_diff"] if inputs.foil_ids is not None and "logit_diff" not in self.metrics
                                     else [])

    def _result(self, model: HookedModel, inputs: ActivationPatchingInputs, out: P.PatchingRun) -> ActivationPatchingResult:
        """The result's tables from the patched runs ``out`` (exact or estimated)."""
        clean_ids, corr_ids = [list(c) for c in inputs.clean_ids], [list(x) for x in inputs.corrupted_ids]
        row_ids = inputs.row_ids
        sites = P.expand_sites(self.sites)
        n_layers = int(model.cfg.n_layers)
        modes = self.modes
        lengths = [len(c) for c in clean_ids]
        positions = inputs.positions
        metrics = self.metric_names(inputs)
        n = len(clean_ids)
        tokens_df = tokens_frame(model, list(zip(clean_ids, corr_ids)), row_ids)
        scored = baselines_frame(out, n, self.min_denominator, row_ids, inputs.has_corrupted)
        rows = rows_frame(inputs.data, scored, list(self.metrics), self.main_metric,
                          [list(t) for t in inputs.targets],
                          None if inputs.foils is None else [list(f) for f in inputs.foils])
        baselines = T.where(scored, scored["metric"].isin(self.metrics)).reset_index(drop=True)
        frames = [job_frame(job, tokens_df, metrics, row_ids, inputs.position_names) for job in out.jobs]
        per_row = pd.concat(frames, ignore_index=True)
        per_row = T.where(per_row, per_row["metric"].isin(self.metrics)).reset_index(drop=True)
        equal = len(set(lengths)) == 1
        main = normalise(per_row, baselines, equal, self.min_denominator, named=positions is not None)
        meta = {"n_layers": n_layers, "sites": sites, "modes": modes, "lengths": lengths,
                "equal_lengths": equal, "layers": P.resolve_layers(n_layers, self.layers),
                "neuron_layers": P.resolve_layers(n_layers, self.neuron_layers or [], "neuron_layers"),
                "hooks": {s: P.SITES[s].hook for s in sites},
                "positions": list(inputs.position_names) or None,
                "positions_auto": inputs.positions_auto,
                "has_corrupted": inputs.has_corrupted,
                "dataset": {"source": inputs.data.source, "dropped": dict(inputs.data.dropped), "n_rows": n},
                "chunks": {"activation patching replay": {"variants": list(out.batch_sizes)}}}
        if {"mean", "resample"} & set(modes):
            meta["baseline_population"] = {"source": inputs.population_source, "size": out.population_size,
                                           "min_mean": P.MIN_MEAN_POPULATION,
                                           "alignment": "position from the end; own clean prompt excluded"}
        tables = {"main": main, "rows": rows, "baselines": baselines, "tokens": tokens_df}
        return cast(ActivationPatchingResult, self.result_class(self, tables, meta))


@register
class ActivationPatching(PatchingSpec):
    """Activation patching over prompt pairs or a dataset, every site, both directions, with
    ablation baselines.

    Fields: those of :class:`PatchingSpec` (``pairs`` / ``pairs_file`` / ``dataset``, ``sites``,
    ``positions``, ``directions``, ``ablations``, ``metrics``, ...).

    Summary keys and tables: :class:`ActivationPatchingResult`.

    Raises (from :meth:`check`, before any model work):
        TokenizationError: a pair's target/foil that is not one token, or a pair whose prompts
            tokenize to different lengths (both tokenizations are shown side by side).
        DatasetError: a dataset row that cannot be used, naming it: no target, no foil for
            ``logit_diff``, no corrupted prompt for a direction, a corrupted prompt of another
            length, a named position it does not have.
        PatchingError: missing foils for ``logit_diff``, layers/neurons out of range, a baseline
            population too small for ``mean``/``resample``; the field is named.
    """

    kind: Literal["activation_patching"] = "activation_patching"

    result_class = ActivationPatchingResult

    # ---- run -----------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, model: HookedModel, inputs: ActivationPatchingInputs, progress: bool = True) -> ActivationPatchingResult:
        return self._result(model, inputs, self._patch(model, inputs, progress))

    def _patch(self, model: HookedModel, inputs: ActivationPatchingInputs, progress: bool = True) -> P.PatchingRun:
        """The exact patching runs of every row (:func:`tracekit.patching.run_patching`)."""
        tids = [list(t) for t in inputs.target_ids]
        fids = None if inputs.foil_ids is None else [list(f) for f in inputs.foil_ids]
        clean_ids, corr_ids = [list(c) for c in inputs.clean_ids], [list(x) for x in inputs.corrupted_ids]
        pop = None if inputs.baseline_ids is None else [list(b) for b in inputs.baseline_ids]
        sites = P.expand_sites(self.sites)
        positions = None if inputs.positions is None else [list(p) for p in inputs.positions]
        total = P.count_variants(model, [len(c) for c in clean_ids], sites, len(self.modes), self.layers,
                                 self.neuron_layers, self.neurons,
                                 n_positions=None if positions is None else len(positions[0]))
        bar = progress_bar(total=total, desc="activation patching", unit="variant", enabled=progress)

        def tick(k: int) -> None:
            bar.update(k)
        try:
            return P.run_patching(model, clean_ids, corr_ids, sites, self.modes, self.metric_names(inputs), tids,
                                  fids, layers=self.layers, neuron_layers=self.neuron_layers, neurons=self.neurons,
                                  baseline_ids=pop, seed=self.seed, batch_size=self.batch_size,
                                  skip_unchanged=self.skip_unchanged, progress=tick, positions=positions)
        finally:
            bar.close()
