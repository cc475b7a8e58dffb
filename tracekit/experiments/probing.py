"""Linear probing across layers, with honest controls (``kind: linear_probe``).

Question: is property X (a label of each prompt) *linearly decodable* from layer L's activations
at a chosen token position? (Alain & Bengio 2016, "Understanding intermediate layers using linear
classifier probes".) Decodability alone says little: a probe can memorise, read the answer off the
input tokens, or ride on class imbalance. So each run reports, per layer, the probe *and its
controls* (Hewitt & Liang 2019; Belinkov 2022, "Probing classifiers: promises, shortcomings, and
advances"); the engine is :func:`tracekit.probing.probe_layers`, whose docstring states the method:

* a **shuffled-label control**: the same probe (same hyper-parameter search) fitted to shuffled
  labels -- by default each entity gets a random label, consistent across its templates. With
  group-held-out splits it measures the accuracy reached *without label information under this
  split* (a permutation baseline), not Hewitt & Liang's selectivity (which needs the control task
  evaluated on seen entities); the table calls it ``shuffled_*`` and the difference ``vs_shuffled``;
* the **majority-class baseline** (predict the training split's most frequent class);
* the **embedding layer** (``blocks.0.hook_resid_pre`` at the same position): if it decodes about as
  well as the best layer, the property may be a lexical shortcut, and a warning says so;
* **train/test split by group** (entity, template or both; checked, never assumed), optional group
  k-fold, and the regularisation chosen by cross-validation inside the training split, grouped the
  same way as the split;
* **bootstrap confidence intervals** over the unit the split holds out (entities, templates, or both
  ways), the same resamples for every layer, so differences are paired.

A layer *beats the controls* when the lower bounds of the paired bootstrap differences (metric -
shuffled control), (metric - majority baseline) and (metric - embedding layer) are all above 0,
Bonferroni-corrected over the number of layers compared (``meta.n_comparisons``; ``correction: none``
turns it off).

Layers are block indices ``0 .. n_layers-1``; sites are ``resid_pre``, ``resid_mid``,
``resid_post`` (default: the block's output), ``attn_out``, ``mlp_out``.

Tables: ``main`` (one row per site x layer, columns ``site``, ``layer``, ``hook``: metrics with CIs,
controls, baselines, chosen regularisation, decision), ``predictions`` (test predictions per layer),
``split`` (each row's side of the split, fold and shuffled label). Arrays:
``probe.<site>.<layer>.weight`` ``[n_out, d]`` and ``.bias`` in the model's activation basis
(standardisation undone) -- load them with :func:`tracekit.probing.load_probe_directions`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from .. import plotting
from ..activations import MANIFEST as STORE_MANIFEST
from ..activations import ActivationStore
from ..dataset import DatasetSpec, GeneratorSpec, Row
from ..errors import ProbingError
from ..hooks import check_hooks
from ..model.info import HookedModel
from ..probing import (
    EMBEDDING_HOOK,
    SITES,
    Activations,
    ProbeDataset,
    country_dataset,
    extract_activations,
    group_kfold,
    group_split,
    load_probe_dataset,
    load_probe_directions,
    probe_dataset_from_frame,
    probe_hooks,
    probe_layers,
    row_positions,
)
from ..probing.extract import POSITION_FORMS_PROBING
from ..tokens import PositionSpec, encode, parse_position
from .base import Experiment, Indices, Result, StrictModel, register
from .frames import column, select

# load_probe_directions is re-exported so that ``tracekit.load_probe_directions`` works.
__all__ = ["LinearProbe", "LinearProbeInputs", "LinearProbeResult", "ProbeDatasetSpec", "load_probe_directions"]

CLASS_METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "auroc")
REG_METRICS = ("r2", "pearson", "mse")
SiteName = Literal["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"]


class ProbeDatasetSpec(StrictModel):
    """Where the labelled rows come from (YAML ``dataset:``).

    Either ``builtin: countries`` (50 countries x templates; ``target: continent | language``,
    optional ``templates`` with ``{country}``) or ``path:`` a ``.jsonl``/``.json``/``.csv``/``.tsv``
    file with columns named by ``text``, ``label``, ``group`` and optionally ``template`` (cells are
    read as text: ``NA`` is a label, not a missing value; an empty cell in those columns is an error).
    ``drop_small_classes: true`` drops classes with fewer than two groups (otherwise such a class is
    an error, since it cannot be on both sides of a group split).

    Fields:
        builtin: ``countries``: the built-in 50 countries x templates dataset (group = country,
            template = template index); default none. Give exactly one of ``builtin`` and ``path``.
        target: (builtin only) the label column: ``continent`` (default) or ``language``.
        templates: (builtin only) format strings with ``{country}`` (never the target's own
            placeholder); default: the built-in templates.
        path: a ``.jsonl``/``.json``/``.csv``/``.tsv`` file of labelled rows (relative to the working
            directory); default none. Give exactly one of ``builtin`` and ``path``.
        text: (file) the column holding each row's prompt text (default ``text``).
        label: (file) the column holding the label: a class for ``task: classification``, a number
            for ``task: regression`` (default ``label``).
        group: (file) the column naming each row's entity, held out together by the group split
            (default ``group``); null makes every row its own group (only for truly independent rows).
        template: (file) optional column naming each row's template, used by ``group_by: template``
            / ``both`` (default none).
        rows / generator: the shared dataset rows (:mod:`tracekit.dataset`: inline rows or a built-in
            generator such as ``capitals``); ``text`` defaults to each row's ``prompt``, ``label`` /
            ``group`` / ``template`` name row fields or extra columns (``capitals``: ``label: group``
            is the continent, ``group: country``), and ``position`` may name a row position (``END``).
        drop_small_classes: drop classes with fewer than two groups instead of failing (default false).
    """

    model_config = ConfigDict(extra="forbid")

    builtin: Optional[Literal["countries"]] = None
    rows: Optional[list[Row]] = None
    generator: Optional[GeneratorSpec] = None
    target: str = "continent"
    templates: Optional[list[str]] = None
    path: Optional[str] = None
    text: str = "text"
    label: str = "label"
    group: Optional[str] = "group"
    template: Optional[str] = None
    drop_small_classes: bool = False

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("builtin", "path", "rows", "generator") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("dataset: give exactly one of 'builtin: countries', 'path: <file>', 'rows: [...]' or "
                             f"'generator: <name>' (got {given or 'none'})")
        return self

    def load(self, task: str = "classification", model: HookedModel | None = None) -> ProbeDataset:
        """Build the :class:`~tracekit.probing.ProbeDataset` (errors name the ``dataset.*`` field).

        ``rows`` / ``generator`` (the shared dataset rows, :mod:`tracekit.dataset`) need ``model``
        (generators keep single-token rows for it); their ``prompt`` is the text, ``label`` /
        ``group`` / ``template`` name row fields or extra columns, and each named position is a
        ``pos_<NAME>`` column (``position: END``)."""
        if self.rows is not None or self.generator is not None:
            if model is None:
                raise ProbingError("dataset: rows / generator datasets are prepared for a model; pass model")
            data = DatasetSpec(rows=self.rows, generator=self.generator).prepare(model)
            frame = data.frame()
            if self.text not in frame.columns:
                frame[self.text] = frame["prompt"]
            frame = frame.astype(object).where(frame.notna(), None)
            ds = probe_dataset_from_frame(frame, self.text, self.label, self.group, self.template, task,
                                          name=data.source)
        elif self.builtin == "countries":
            if task != "classification":
                raise ProbingError("task: the builtin countries dataset is a classification task")
            ds = country_dataset(self.target, self.templates)
        else:
            assert self.path is not None  # the source validator: one of builtin / rows / generator / path
            ds = load_probe_dataset(self.path, self.text, self.label, self.group, self.template, task)
        if self.drop_small_classes:
            ds = ds.drop_small_classes(2)
        return ds


@dataclass(frozen=True)
class LinearProbeInputs:
    """What :meth:`LinearProbe.prepare` builds once: the dataset (read once), the probed hooks as
    ``(site, layer, hook)``, the rows' ``field:<column>`` values (None for other positions), each
    row's token ids and the positions read in it."""

    dataset: ProbeDataset
    targets: tuple[tuple[str, int, str], ...]
    fields: Optional[tuple[str, ...]]
    ids: tuple[tuple[int, ...], ...]
    positions: tuple[tuple[int, ...], ...]


class LinearProbeResult(Result):
    """Result of :class:`LinearProbe`: tables ``main``, ``predictions``, ``split``; arrays with the
    probe directions. ``summary()``/``figures()``/``report()`` read only the tables and meta."""

    config: "LinearProbe"
    main_table = "main"

    @property
    def metric(self) -> str:
        return self.meta.get("metric", "accuracy")

    def _emb(self) -> pd.Series:
        df = self.tables["main"]
        return select(df, column(df, "hook") == EMBEDDING_HOOK).iloc[0]

    def _site(self, site: Optional[str] = None, with_embedding: bool = False) -> pd.DataFrame:
        """Rows of one site sorted by layer (the embedding baseline row only if asked or its own site)."""
        df = self.tables["main"]
        site = site or self.meta.get("primary_site", "resid_post")
        d = select(df, column(df, "site") == site)
        if not with_embedding:
            d = select(d, column(d, "hook") != EMBEDDING_HOOK)
        return d.sort_values("layer")

    def layers_beating_controls(self, site: Optional[str] = None) -> list[int]:
        d = self._site(site)
        return [int(L) for L, b in zip(d["layer"], d["beats_controls"]) if bool(b)]

    def _warnings(self) -> list[str]:
        m = self.metric
        out = []
        df = self.tables["main"]
        emb = self._emb()
        rest = select(df, column(df, "hook") != EMBEDDING_HOOK)
        margin = float(self.meta.get("shortcut_margin", 0.05))
        if len(rest):
            best = rest.loc[column(rest, m).idxmax()]
            close = emb[m] >= best[m] - margin and best[m] > best[f"baseline_{m}"]
            # or: the embedding layer decodes (above the baseline) and the best layer is not
            # significantly better than it (paired bootstrap)
            indistinct = bool(emb["vs_baseline_lo"] > 0 and best["vs_embedding_lo"] <= 0)
            if close or indistinct:
                out.append(f"lexical shortcut: the embedding layer ({EMBEDDING_HOOK}) reaches {m} "
                           f"{emb[m]:.3f} vs the best layer's {best[m]:.3f} ({best['site']} {int(best['layer'])}; "
                           + (f"within {margin}" if close else "difference not significant, paired bootstrap")
                           + "): the property may be read off the input tokens at this position rather than "
                           "computed by the model")
        if len(rest) == 0 or not column(rest, "beats_controls").any():
            out.append("no layer beats all controls (shuffled-label control, majority baseline and "
                       f"embedding layer, paired bootstrap, {self.meta.get('correction', 'bonferroni')} over "
                       f"{self.meta.get('n_comparisons')} layers); do not read the curve as evidence of encoding")
        if "uninformative" in df and column(df, "uninformative").astype(bool).any():
            flat = select(df, column(df, "uninformative").astype(bool))
            out.append(f"uninformative: the activations at {[f'{s} {int(L)}' for s, L in zip(flat['site'], flat['layer'])]} "
                       "are identical across the training rows (e.g. every prompt ends in the same token, read at "
                       "the embedding layer); those layers are scored as the constant prior, at chance")
        hi_ctrl = df[df[f"shuffled_{m}_lo"] > df[f"baseline_{m}"] + 1e-12]
        if len(hi_ctrl) and self.meta.get("task") == "classification":
            out.append(f"the shuffled-label control is above the majority baseline at "
                       f"{[f'{s} {int(L)}' for s, L in zip(hi_ctrl['site'], hi_ctrl['layer'])]}: "
                       "the probe can exploit group structure (check the split)")
        edge = rest[rest["reg_at_edge"].astype(bool)] if "reg_at_edge" in rest else rest.iloc[:0]
        if len(edge) > len(rest) / 2:
            out.append(f"the regularisation chosen by cross-validation is at the edge of the grid at "
                       f"{len(edge)}/{len(rest)} layers; consider widening Cs (or alphas)")
        excl = self.meta.get("inner_folds_excluded") or {}
        if excl:
            out.append("inner folds left out of choosing the regularisation because their training part lacks "
                       f"a class: {'; '.join(f'{k}: {v}' for k, v in excl.items())}")
        missing = self.meta.get("test_classes_unseen_in_train") or []
        if missing:
            out.append(f"test classes never seen in training: {missing} (they are always mispredicted)")
        return out

    # ---- summary -------------------------------------------------------------------------
    def summary(self) -> dict:
        m = self.metric
        site = self.meta.get("primary_site", "resid_post")
        d = self._site(site)
        emb = self._emb()
        out: dict = {k: self.meta.get(k) for k in ("task", "metric", "position", "group_by", "cv_folds",
                                                      "n_rows", "n_train", "n_test", "n_dropped", "classes",
                                                      "control_mode", "bootstrap", "bootstrap_unit",
                                                      "bootstrap_resamples", "n_comparisons", "correction")}
        out["site"] = site
        out["layers"] = d["layer"].astype(int).tolist()
        out["hooks"] = d["hook"].tolist()
        out[f"{m}_by_layer"] = d[m].round(4).tolist()
        out[f"{m}_ci_by_layer"] = [[round(a, 4), round(b, 4)] for a, b in zip(d[f"{m}_lo"], d[f"{m}_hi"])]
        out[f"shuffled_{m}_by_layer"] = d[f"shuffled_{m}"].round(4).tolist()
        out["vs_shuffled_by_layer"] = d["vs_shuffled"].round(4).tolist()
        for extra in (CLASS_METRICS if m == "accuracy" else REG_METRICS):
            if extra != m and extra in d:
                out[f"{extra}_by_layer"] = d[extra].round(4).tolist()
        out[f"baseline_{m}"] = round(float(emb.loc[f"baseline_{m}"]), 4)
        if m == "accuracy":
            out["majority_baseline"] = out[f"baseline_{m}"]
            n_cls = len(self.meta.get("classes") or []) or 1
            out["chance"] = round(1.0 / n_cls, 4)
        out["embedding_hook"] = EMBEDDING_HOOK
        out[f"embedding_{m}"] = round(float(emb.loc[m]), 4)
        if len(d):
            best = d.loc[d[m].idxmax()]
            out["best_layer"] = int(best["layer"])
            out[f"best_{m}"] = round(float(best[m]), 4)
            out["best_vs_shuffled"] = round(float(best["vs_shuffled"]), 4)
        out["layers_beating_controls"] = self.layers_beating_controls(site)
        sites = [s for s in self.tables["main"]["site"].unique() if len(self._site(s))]
        if len(sites) > 1:
            out["by_site"] = {
                s: {f"{m}_by_layer": self._site(s)[m].round(4).tolist(),
                    "layers": self._site(s)["layer"].astype(int).tolist(),
                    "layers_beating_controls": self.layers_beating_controls(s)}
                for s in sites}
        out["warnings"] = self._warnings()
        return out

    def report(self) -> str:
        m = self.metric
        cfg = self.config
        s = self.summary()
        lines = [f"linear probe [{cfg.step_name}] {self.meta.get('dataset')} | task {s['task']} | position "
                 f"{s['position']!r} | split by {s['group_by']}"
                 + (f" ({s['cv_folds']}-fold)" if s.get("cv_folds") else "")
                 + f" | {s['n_train']} train / {s['n_test']} test rows | control {s['control_mode']} | "
                 f"{s['bootstrap']} bootstrap resamples over {s.get('bootstrap_resamples')}s"]
        short = {"accuracy": "acc", "balanced_accuracy": "bal", "macro_f1": "F1", "auroc": "AUROC",
                 "r2": "R2", "pearson": "r", "mse": "MSE"}
        extras = [e for e in (CLASS_METRICS if m == "accuracy" else REG_METRICS) if e != m]
        df = self.tables["main"]
        for site in df["site"].unique():
            d = self._site(site, with_embedding=True)
            if not len(d):
                continue
            rows = []
            for r in d.to_dict("records"):
                rows.append([int(r["layer"]), r["hook"], f"{r[m]:.3f}", f"[{r[m + '_lo']:.3f},{r[m + '_hi']:.3f}]",
                             f"{r['shuffled_' + m]:.3f}", f"{r['vs_shuffled']:+.3f}", f"{r['vs_embedding']:+.3f}"]
                            + [f"{r[e]:.3f}" for e in extras] + ["yes" if r["beats_controls"] else ""])
            lines.append(f"site {site}:")
            lines.append(plotting.text_table(rows, ["layer", "hook", short[m], "95% CI", "shuffled", "vs shuf", "vs emb"]
                                    + [short[e] for e in extras] + ["beats controls"]))
        base = f"baseline (majority class) {m}: {s[f'baseline_{m}']:.3f}" if m == "accuracy" else \
            f"baseline (training mean) {m}: {s[f'baseline_{m}']:.3f}"
        if "chance" in s:
            base += f"; chance 1/{len(s['classes'])} = {s['chance']:.3f}"
        lines.append(base + f"; embedding layer ({EMBEDDING_HOOK}) {m}: {s[f'embedding_{m}']:.3f}")
        lines.append(f"decision: lower bounds of (probe - shuffled), (probe - baseline), (probe - embedding) > 0; "
                     f"{s['n_comparisons']} layers compared, correction {s['correction']} "
                     f"(bound = {self.meta.get('decision_quantile', float('nan')):.2g} quantile)")
        if "best_layer" in s:
            lines.append(f"best layer: {s['best_layer']} ({m} {s[f'best_{m}']:.3f}, vs shuffled "
                         f"{s['best_vs_shuffled']:+.3f}); layers beating all controls: {s['layers_beating_controls']}")
        for w in s["warnings"]:
            lines.append(f"WARNING: {w}")
        return "\n".join(lines)

    # ---- figures -------------------------------------------------------------------------
    def figures(self) -> dict:
        plt = plotting.plt()
        m = self.metric
        primary = self.meta.get("primary_site", "resid_post")
        sites = [s for s in self.tables["main"]["site"].unique() if len(self._site(s))]
        sites = ([primary] if primary in sites else []) + [s for s in sites if s != primary]
        emb = self._emb()
        fig, axes = plt.subplots(max(1, len(sites)), 2, figsize=(12, 3.8 * max(1, len(sites))), squeeze=False)
        for i, site in enumerate(sites):
            d = self._site(site)
            a1, a2 = axes[i]
            L = d["layer"].to_numpy()
            a1.plot(L, d[m], marker="o", ms=3, label=f"probe {m}")
            a1.fill_between(L, d[f"{m}_lo"], d[f"{m}_hi"], alpha=.2)
            a1.plot(L, d[f"shuffled_{m}"], marker=".", ms=3, color="grey", label="shuffled-label control")
            a1.fill_between(L, d[f"shuffled_{m}_lo"], d[f"shuffled_{m}_hi"], color="grey", alpha=.15)
            if m == "accuracy" and "balanced_accuracy" in d:
                a1.plot(L, d["balanced_accuracy"], ls=":", color="C2", label="balanced accuracy")
            a1.axhline(float(emb.loc[f"baseline_{m}"]), color="k", ls="--", lw=1,
                       label="majority baseline" if m == "accuracy" else "mean baseline")
            a1.axhline(float(emb.loc[m]), color="C3", ls="-.", lw=1, label=f"embedding layer ({EMBEDDING_HOOK})")
            beat = d[d["beats_controls"].astype(bool)]
            a1.scatter(beat["layer"], beat[m], marker="*", s=60, color="C1", zorder=5, label="beats controls")
            a1.set_xlabel(f"layer (block index; {site})")
            a1.set_ylabel(m)
            a1.set_title(f"{self.meta.get('dataset')}: {m} by layer ({site}, {self.meta.get('position')})")
            if m in ("accuracy", "balanced_accuracy"):
                a1.set_ylim(-0.02, 1.02)
            a1.grid(alpha=.3)
            a1.legend(fontsize=7)
            a2.plot(L, d["vs_shuffled"], marker="o", ms=3, label="probe - shuffled-label control")
            a2.fill_between(L, d["vs_shuffled_lo"], d["vs_shuffled_hi"], alpha=.2)
            a2.plot(L, d["vs_embedding"], marker=".", ms=3, label="probe - embedding layer")
            a2.axhline(0, color="k", lw=1)
            a2.set_xlabel("layer (block index)")
            a2.set_ylabel(f"difference in {m}")
            a2.set_title("gain over the shuffled-label control and the embedding layer (paired bootstrap CI)")
            a2.grid(alpha=.3)
            a2.legend(fontsize=7)
        fig.tight_layout()
        return {"by_layer": fig}


@register
class LinearProbe(Experiment):
    """Linear probes on every layer, with the controls reported next to them.

    Fields:
        dataset: :class:`ProbeDatasetSpec` (``builtin: countries`` or ``path:``).
        task: ``classification`` (logistic regression) | ``regression`` (ridge).
        sites: activation sites (one hook per block), any of ``resid_pre``, ``resid_mid``,
            ``resid_post`` (default; the block's output), ``attn_out``, ``mlp_out``. (``resid`` is retired.)
        hooks: extra explicit TransformerLens hook names (e.g. ``blocks.3.mlp.hook_post``,
            ``blocks.1.hook_mlp_in``: gated hooks are switched on for the extraction).
        layers: ``all`` or a list of block indices ``0..n_layers-1`` (negative counts from the end).
            The embedding baseline ``blocks.0.hook_resid_pre`` is always probed.
        position: an int, ``last``, ``mean``, ``all``, ``token:<text>`` or ``field:<column>``
            (:class:`tracekit.tokens.Position`; ``mean``/``all`` skip a prepended BOS).
        batch_size: prompts per forward pass.
        group_by: ``entity`` | ``template`` | ``both`` (see :func:`tracekit.probing.group_split`).
        test_size: fraction of groups held out (single split).
        cv_folds: k for group k-fold (out-of-fold predictions pooled); null = single split.
        seed: seeds the split, control labels, inner folds and bootstrap; same seed, same numbers.
        Cs: inverse L2 strengths searched (logistic regression, standardised features); the table's
            ``reg_at_edge`` flags a choice at the grid's edge.
        alphas: ridge strengths searched (regression).
        inner_folds: folds inside the training split for choosing C / alpha, grouped as ``group_by``.
        max_iter: lbfgs iterations.
        control: ``auto`` | ``shuffle_groups`` | ``shuffle_rows`` (see :func:`tracekit.probing.control_labels`).
        bootstrap: number of bootstrap resamples (0 disables intervals and the decision).
        bootstrap_unit: ``group`` (default: resample the unit the split holds out -- entities,
            templates, or both ways) | ``row``.
        ci: confidence level of the intervals.
        correction: ``bonferroni`` (default; over the number of layers compared) | ``none``, for the
            "beats the controls" decision.
        shortcut_margin: warn of a lexical shortcut when the embedding layer's metric is within this
            of the best layer's (also warned: the embedding layer beats the baseline and the best layer
            is not significantly better than it).
        cache_dir: write activations here as safetensors chunks (kept); default memory, spilling to a
            scratch folder (removed on exit, Ctrl-C and SIGTERM) above ``max_memory_mb``.
        max_memory_mb: in-memory activation budget (MiB).
        store: read the activations from this activation store (a folder written by ``kind: activations``
            / ``tracekit cache-activations`` from the same rows at the same ``position``, holding every
            probed hook, the embedding baseline ``blocks.0.hook_resid_pre`` included) instead of running
            the model; a store from another model, other rows or without a hook is refused. Default none.
        save_directions: keep every probe's weights in the result's arrays.

    Raises (from :meth:`check` / :meth:`run`):
        ProbingError: unknown dataset column / target / file, an empty cell, a class with too few groups
            to split, a layer out of range.
        HookError: an unknown hook. TokenizationError: a bad position or one missing from a prompt.
    """

    kind: Literal["linear_probe"] = "linear_probe"
    dataset: ProbeDatasetSpec = Field(default_factory=lambda: ProbeDatasetSpec(builtin="countries"))
    task: Literal["classification", "regression"] = "classification"
    sites: list[SiteName] = Field(default_factory=lambda: ["resid_post"], min_length=1)
    hooks: list[str] = Field(default_factory=list)
    layers: Union[Literal["all"], Indices] = "all"
    position: PositionSpec = "last"
    batch_size: int = Field(default=16, ge=1)
    group_by: Literal["entity", "template", "both"] = "entity"
    test_size: float = Field(default=0.3, gt=0, lt=1)
    cv_folds: Optional[int] = Field(default=None, ge=2)
    seed: int = 0
    Cs: list[float] = Field(default_factory=lambda: [0.01, 0.1, 1.0, 10.0], min_length=1)
    alphas: list[float] = Field(default_factory=lambda: [0.1, 1.0, 10.0, 100.0, 1000.0], min_length=1)
    inner_folds: int = Field(default=3, ge=2)
    max_iter: int = Field(default=1000, ge=10)
    control: Literal["auto", "shuffle_groups", "shuffle_rows"] = "auto"
    bootstrap: int = Field(default=1000, ge=0)
    bootstrap_unit: Literal["group", "row"] = "group"
    ci: float = Field(default=0.95, gt=0, lt=1)
    correction: Literal["bonferroni", "none"] = "bonferroni"
    shortcut_margin: float = Field(default=0.05, ge=0)
    cache_dir: Optional[str] = None
    store: Optional[str] = None
    max_memory_mb: float = Field(default=1024.0, gt=0)
    save_directions: bool = True

    result_class = LinearProbeResult

    retired_values = {"sites": {"resid": "resid_post; the output of block L, the old layer L+1; or 'resid_pre', "
                                         f"the input of block L; sites are {list(SITES)}"}}

    @field_validator("sites", mode="before")
    @classmethod
    def _one_site(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("position")
    @classmethod
    def _pos(cls, v):
        parse_position(v, POSITION_FORMS_PROBING, "position")
        return v

    @model_validator(mode="after")
    def _named_position_needs_rows(self):
        pos = parse_position(self.position, POSITION_FORMS_PROBING, "position")
        if pos.kind == "name" and self.dataset.rows is None and self.dataset.generator is None:
            raise ValueError(f"position: {self.position!r} is not a position form here: named positions (END, SUBJ...) "
                             "come from a dataset's rows (dataset: {rows: ...} or {generator: ...}); use last, mean, "
                             "all, an index, token:<text> or field:<column>")
        return self

    @model_validator(mode="after")
    def _store_or_cache(self):
        if self.store is not None and self.cache_dir is not None:
            raise ValueError("store: activations come from the store, so cache_dir has nothing to write; give one "
                             "of store and cache_dir")
        return self

    @model_validator(mode="after")
    def _kfold_both(self):
        if self.cv_folds is not None and self.group_by == "both":
            raise ValueError("cv_folds: k-fold is not supported with group_by: both; use a single split "
                             "(cv_folds: null) or group_by: entity/template")
        return self

    # ---- validation ----------------------------------------------------------------------
    def _fields(self, ds: ProbeDataset) -> Optional[list[str]]:
        pos = parse_position(self.position, POSITION_FORMS_PROBING, "position")
        if pos.kind == "name":
            col = f"pos_{pos.text}"
            if col not in ds.frame.columns:
                names = [c[4:] for c in ds.frame.columns if str(c).startswith("pos_")]
                raise ProbingError(f"position: {pos.text!r} is not a named position of the dataset's rows (they name "
                                   f"{names or 'none'}); use one of them or last / mean / an index")
            return [str(int(v)) for v in ds.frame[col]]
        if pos.kind != "field":
            return None
        if pos.text not in ds.frame.columns:
            raise ProbingError(f"position: {self.position!r}: the dataset has no column {pos.text!r}; its columns "
                               f"are {list(ds.frame.columns)}")
        return ds.frame[pos.text].astype(str).tolist()

    def _targets(self, model: HookedModel) -> list[tuple[str, int, str]]:
        layers = None if self.layers == "all" else self.layers
        return probe_hooks(int(model.cfg.n_layers), self.sites, layers, self.hooks)

    def prepare(self, model: HookedModel) -> LinearProbeInputs:
        """Load the dataset, check the hooks exist, tokenize every row and resolve the position in
        it. Needs only the tokenizer, ``cfg`` and hook names (works on a
        :class:`tracekit.model.ModelInfo`)."""
        ds = self.dataset.load(self.task, model)
        check_hooks(model, self.hooks, "hooks")
        targets = self._targets(model)
        check_hooks(model, [h for _, _, h in targets], "layers")
        fields = self._fields(ds)
        ids = [encode(model, t) for t in ds.texts]
        positions = row_positions(model, ds.texts, ids, self.position, fields)
        return LinearProbeInputs(ds, tuple(targets), None if fields is None else tuple(fields),
                                 tuple(tuple(i) for i in ids), tuple(tuple(p) for p in positions))

    def check(self, model: HookedModel) -> LinearProbeInputs:
        """:meth:`prepare`, then check the split is possible (config only: works on a
        :class:`tracekit.model.ModelInfo`)."""
        inputs = self.prepare(model)
        if self.cv_folds:
            group_kfold(inputs.dataset, self.cv_folds, self.group_by, self.seed)
        else:
            group_split(inputs.dataset, self.group_by, self.test_size, self.seed)
        if self.store is not None and (Path(self.store).expanduser() / STORE_MANIFEST).is_file():
            self._store(inputs)  # a store an earlier step of the same run writes is checked when this step runs
        return inputs

    def _store(self, inputs: LinearProbeInputs) -> tuple[ActivationStore, np.ndarray]:
        """The ``store`` opened and checked against the hooks and the rows (token ids and read
        positions; not the model): ``(store, the store row of each dataset row)``.

        Raises:
            StoreError: no complete store there, a probed hook missing, a row (at its position) missing.
        """
        assert self.store is not None
        store = ActivationStore(self.store, "store")
        store.require_hooks([h for _, _, h in inputs.targets], "store")
        mean = parse_position(self.position, POSITION_FORMS_PROBING).kind == "mean"
        return store, store.match_rows(inputs.ids, inputs.positions, mean, "store")

    # ---- run -----------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, model: HookedModel, inputs: LinearProbeInputs, progress: bool = True) -> LinearProbeResult:
        """Extract every hook's activations, then :func:`tracekit.probing.probe_layers`; shape the result.

        The extraction (:func:`tracekit.probing.extract_activations`) takes the row texts and
        tokenizes them itself (no ids parameter yet), so each row is tokenized again there."""
        t0 = time.time()
        ds = inputs.dataset
        targets = list(inputs.targets)
        fields = None if inputs.fields is None else list(inputs.fields)
        if self.store is not None:  # read from the store: no forward pass
            store, store_rows = self._store(inputs)
            store.check_model(model, "store")
            source = Activations.from_store(store, [h for _, _, h in targets], store_rows)
        else:
            source = extract_activations(model, ds.texts, [h for _, _, h in targets], self.position, self.batch_size,
                                         fields=fields, cache_dir=self.cache_dir,
                                         max_memory_mb=self.max_memory_mb, progress=progress)
        with source as acts:
            t_extract = time.time() - t0
            out = probe_layers(acts, ds, targets, group_by=self.group_by, test_size=self.test_size,
                               cv_folds=self.cv_folds, seed=self.seed, Cs=self.Cs, alphas=self.alphas,
                               inner_folds=self.inner_folds, max_iter=self.max_iter, control=self.control,
                               bootstrap=self.bootstrap, bootstrap_unit=self.bootstrap_unit, ci=self.ci,
                               correction=self.correction, save_directions=self.save_directions,
                               progress=progress)
        meta = dict(out.meta)
        meta.update({
            "position": str(parse_position(self.position, POSITION_FORMS_PROBING)),
            "shortcut_margin": self.shortcut_margin, "primary_site": self.sites[0],
            "n_layers": int(model.cfg.n_layers), "d_model": int(model.cfg.d_model),
            "layer_numbering": "block index 0..n_layers-1; embedding baseline = " + EMBEDDING_HOOK,
            "directions": "arrays probe.<site>.<layer>.weight [n_out, d] / .bias [n_out], activation basis "
                          "(standardisation undone); rows = classes (multiclass) or the positive class "
                          "classes[1] (binary)",
            "seconds": {"extract": round(t_extract, 2), "total": round(time.time() - t0, 2)},
            "activations_from": self.store if self.store is not None else "model",
        })
        return LinearProbeResult(self, {"main": out.main, "predictions": out.predictions, "split": out.split},
                                 meta, out.directions)
