"""Linear probing across layers, with honest controls (``kind: linear_probe``).

Question: is property X (a label of each prompt) *linearly decodable* from layer L's activations
at a chosen token position? (Alain & Bengio 2016, "Understanding intermediate layers using linear
classifier probes".) Decodability alone says little: a probe can memorise, read the answer off the
input tokens, or ride on class imbalance. So each run reports, per layer, the probe *and its
controls* (Hewitt & Liang 2019, "Designing and interpreting probes with control tasks"; Belinkov
2022, "Probing classifiers: promises, shortcomings, and advances"):

* a **control task**: the same probe (same hyper-parameter search) fitted to shuffled labels --
  by default each entity gets a random label, consistent across its templates. *Selectivity* =
  accuracy - control accuracy;
* the **majority-class baseline** (predict the training split's most frequent class);
* the **embedding layer** (``blocks.0.hook_resid_pre`` at the same position, layer 0): if it decodes
  about as well as the best layer, the property may be a lexical shortcut, and a warning says so;
* **train/test split by group** (entity, template or both; checked, never assumed), optional
  group k-fold with pooled out-of-fold predictions, and the regularisation strength chosen by group
  cross-validation inside the training split only;
* **bootstrap confidence intervals** (cluster bootstrap over test entities by default; the same
  resamples for every layer, so differences between a layer and its controls are paired).

A layer *beats the controls* when the lower ends of the paired bootstrap intervals of (metric -
control metric), (metric - majority baseline) and (metric - embedding-layer metric) are all above 0.

Layer numbering is ``hidden_states`` (see :mod:`tracekit.probing`): layer 0 = embedding, layer L =
output of block L-1; ``attn_out``/``mlp_out`` layer L = that output of block L-1.

Tables: ``main`` (one row per site x layer: metrics with CIs, controls, baselines, chosen
regularisation), ``predictions`` (test predictions per layer), ``split`` (each row's side of the
split, fold and control label). Arrays: ``probe.<site>.<layer>.weight`` ``[n_out, d]`` and ``.bias``
in the model's activation basis (standardisation undone) -- load them with
:func:`tracekit.probing.load_probe_directions`.
"""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

import numpy as np
import pandas as pd
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..probing import (
    EMBEDDING_HOOK, ProbeDataset, bootstrap_metrics, bootstrap_weights, check_hooks, control_labels,
    country_dataset, extract_activations, fit_probe, group_kfold, group_split, load_probe_dataset,
    load_probe_directions, parse_position, percentile_ci, probe_hooks, _row_positions,
)
from ..tokens import encode
from .base import Experiment, Result, register, StrictModel

# load_probe_directions is re-exported so that ``tracekit.load_probe_directions`` works.
__all__ = ["LinearProbe", "LinearProbeResult", "ProbeDatasetSpec", "load_probe_directions"]

CLASS_METRICS = ("accuracy", "balanced_accuracy", "macro_f1", "auroc")
REG_METRICS = ("r2", "pearson", "mse")


class ProbeDatasetSpec(StrictModel):
    """Where the labelled rows come from (YAML ``dataset:``).

    Either ``builtin: countries`` (50 countries x templates; ``target: continent | language``,
    optional ``templates`` with ``{country}``) or ``path:`` a ``.jsonl``/``.json``/``.csv``/``.tsv``
    file with columns named by ``text``, ``label``, ``group`` and optionally ``template``.
    ``drop_small_classes: true`` drops classes with fewer than two groups (otherwise such a class is
    an error, since it cannot be on both sides of a group split).
    """

    model_config = ConfigDict(extra="forbid")

    builtin: Optional[Literal["countries"]] = None
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
        if (self.builtin is None) == (self.path is None):
            raise ValueError("dataset: give exactly one of 'builtin: countries' or 'path: <file>'")
        return self

    def load(self, task: str = "classification") -> ProbeDataset:
        """Build the :class:`~tracekit.probing.ProbeDataset` (errors name the ``dataset.*`` field)."""
        if self.builtin == "countries":
            if task != "classification":
                raise ValueError("task: the builtin countries dataset is a classification task")
            ds = country_dataset(self.target, self.templates)
        else:
            ds = load_probe_dataset(self.path, self.text, self.label, self.group, self.template, task)
        if self.drop_small_classes:
            ds = ds.drop_small_classes(2)
        return ds


class LinearProbeResult(Result):
    """Result of :class:`LinearProbe`: tables ``main``, ``predictions``, ``split``; arrays with the
    probe directions. ``summary()``/``figures()``/``report()`` read only the tables and meta."""

    main_table = "main"

    # ---- helpers -------------------------------------------------------------------------
    @property
    def metric(self) -> str:
        return self.meta.get("metric", "accuracy")

    def _site(self, site: Optional[str] = None) -> pd.DataFrame:
        df = self.tables["main"]
        site = site or self.meta.get("primary_site", "resid")
        d = df[df["site"] == site].sort_values("layer")
        if site != "resid":  # the embedding baseline row belongs to every curve
            d = pd.concat([df[(df["site"] == "resid") & (df["layer"] == 0)], d])
        return d

    def layers_beating_controls(self, site: Optional[str] = None) -> list[int]:
        d = self._site(site)
        return [int(L) for L, b in zip(d["layer"], d["beats_controls"]) if bool(b)]

    def _warnings(self) -> list[str]:
        m = self.metric
        out = []
        df = self.tables["main"]
        emb = df[(df["site"] == "resid") & (df["layer"] == 0)].iloc[0]
        rest = df[~((df["site"] == "resid") & (df["layer"] == 0))]
        margin = float(self.meta.get("shortcut_margin", 0.05))
        if len(rest):
            best = rest.loc[rest[m].idxmax()]
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
        if len(rest) == 0 or not rest["beats_controls"].any():
            out.append("no layer beats all controls (shuffled-label control, majority baseline and "
                       "embedding layer, paired bootstrap); do not read the curve as evidence of encoding")
        hi_ctrl = df[df[f"control_{m}_lo"] > df[f"baseline_{m}"] + 1e-12]
        if len(hi_ctrl) and self.meta.get("task") == "classification":
            out.append(f"the shuffled-label control is above the majority baseline at "
                       f"{[f'{s} {int(L)}' for s, L in zip(hi_ctrl['site'], hi_ctrl['layer'])]}: "
                       "the probe can exploit group structure (check the split)")
        edge = rest[rest["reg_at_edge"].astype(bool)] if "reg_at_edge" in rest else rest.iloc[:0]
        if len(edge) > len(rest) / 2:
            out.append(f"the regularisation chosen by cross-validation is at the edge of the grid at "
                       f"{len(edge)}/{len(rest)} layers; consider widening Cs (or alphas)")
        missing = self.meta.get("test_classes_unseen_in_train") or []
        if missing:
            out.append(f"test classes never seen in training: {missing} (they are always mispredicted)")
        return out

    # ---- summary -------------------------------------------------------------------------
    def summary(self) -> dict:
        m = self.metric
        site = self.meta.get("primary_site", "resid")
        d = self._site(site)
        rest = d[d["layer"] != 0] if site == "resid" else d.iloc[1:]
        out: dict = {k: self.meta.get(k) for k in ("task", "metric", "position", "group_by", "cv_folds",
                                                      "n_rows", "n_train", "n_test", "n_dropped", "classes",
                                                      "control_mode", "bootstrap", "bootstrap_unit")}
        out["site"] = site
        out["layers"] = d["layer"].astype(int).tolist()
        out["hooks"] = d["hook"].tolist()
        out[f"{m}_by_layer"] = d[m].round(4).tolist()
        out[f"{m}_ci_by_layer"] = [[round(a, 4), round(b, 4)] for a, b in zip(d[f"{m}_lo"], d[f"{m}_hi"])]
        out[f"control_{m}_by_layer"] = d[f"control_{m}"].round(4).tolist()
        out["selectivity_by_layer"] = d["selectivity"].round(4).tolist()
        for extra in (CLASS_METRICS if m == "accuracy" else REG_METRICS):
            if extra != m and extra in d:
                out[f"{extra}_by_layer"] = d[extra].round(4).tolist()
        out[f"baseline_{m}"] = round(float(d[f"baseline_{m}"].iloc[0]), 4)
        if m == "accuracy":
            out["majority_baseline"] = out[f"baseline_{m}"]
            n_cls = len(self.meta.get("classes") or []) or 1
            out["chance"] = round(1.0 / n_cls, 4)
        out[f"embedding_{m}"] = round(float(d[m].iloc[0]), 4)
        if len(rest):
            best = rest.loc[rest[m].idxmax()]
            out["best_layer"] = int(best["layer"])
            out[f"best_{m}"] = round(float(best[m]), 4)
            out["best_selectivity"] = round(float(best["selectivity"]), 4)
        out["layers_beating_controls"] = self.layers_beating_controls(site)
        if len(self.tables["main"]["site"].unique()) > 1:
            out["by_site"] = {
                s: {f"{m}_by_layer": self._site(s)[m].round(4).tolist(),
                    "layers": self._site(s)["layer"].astype(int).tolist(),
                    "layers_beating_controls": self.layers_beating_controls(s)}
                for s in self.tables["main"]["site"].unique()}
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
                 f"{s['bootstrap']} bootstrap resamples over {s['bootstrap_unit']}s"]
        short = {"accuracy": "acc", "balanced_accuracy": "bal", "macro_f1": "F1", "auroc": "AUROC",
                 "r2": "R2", "pearson": "r", "mse": "MSE"}
        extras = [e for e in (CLASS_METRICS if m == "accuracy" else REG_METRICS) if e != m]
        for site in self.tables["main"]["site"].unique():
            d = self._site(site)
            lines.append(f"site {site}:")
            lines.append(f"{'layer':>5} {'hook':27s} {short[m]:>6} {'95% CI':>15} {'ctrl':>6} {'select':>7} "
                         f"{'vs emb':>7} " + " ".join(f"{short[e]:>6}" for e in extras) + "  beats controls")
            for r in d.itertuples():
                rr = r._asdict()
                lines.append(
                    f"{int(r.layer):>5} {r.hook:27s} {rr[m]:6.3f} [{rr[m + '_lo']:5.3f},{rr[m + '_hi']:6.3f}] "
                    f"{rr['control_' + m]:6.3f} {r.selectivity:+7.3f} {r.vs_embedding:+7.3f} "
                    + " ".join(f"{rr[e]:6.3f}" for e in extras) + ("  yes" if r.beats_controls else ""))
        base = f"baseline (majority class) {m}: {s[f'baseline_{m}']:.3f}" if m == "accuracy" else \
            f"baseline (training mean) {m}: {s[f'baseline_{m}']:.3f}"
        if "chance" in s:
            base += f"; chance 1/{len(s['classes'])} = {s['chance']:.3f}"
        lines.append(base + f"; embedding layer {m}: {s[f'embedding_{m}']:.3f}")
        if "best_layer" in s:
            lines.append(f"best layer: {s['best_layer']} ({m} {s[f'best_{m}']:.3f}, selectivity "
                         f"{s['best_selectivity']:+.3f}); layers beating all controls: {s['layers_beating_controls']}")
        for w in s["warnings"]:
            lines.append(f"WARNING: {w}")
        return "\n".join(lines)

    # ---- figures -------------------------------------------------------------------------
    def figures(self) -> dict:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        m = self.metric
        sites = list(self.tables["main"]["site"].unique())
        sites = [self.meta.get("primary_site", "resid")] + [s for s in sites if s != self.meta.get("primary_site", "resid")]
        fig, axes = plt.subplots(len(sites), 2, figsize=(12, 3.8 * len(sites)), squeeze=False)
        for i, site in enumerate(sites):
            d = self._site(site)
            a1, a2 = axes[i]
            L = d["layer"].to_numpy()
            a1.plot(L, d[m], marker="o", ms=3, label=f"probe {m}")
            a1.fill_between(L, d[f"{m}_lo"], d[f"{m}_hi"], alpha=.2)
            a1.plot(L, d[f"control_{m}"], marker=".", ms=3, color="grey", label="shuffled-label control")
            a1.fill_between(L, d[f"control_{m}_lo"], d[f"control_{m}_hi"], color="grey", alpha=.15)
            if m == "accuracy" and "balanced_accuracy" in d:
                a1.plot(L, d["balanced_accuracy"], ls=":", color="C2", label="balanced accuracy")
            a1.axhline(float(d[f"baseline_{m}"].iloc[0]), color="k", ls="--", lw=1,
                       label="majority baseline" if m == "accuracy" else "mean baseline")
            a1.axhline(float(d[m].iloc[0]), color="C3", ls="-.", lw=1, label="embedding layer")
            beat = d[d["beats_controls"].astype(bool)]
            a1.scatter(beat["layer"], beat[m], marker="*", s=60, color="C1", zorder=5, label="beats controls")
            a1.set_xlabel("layer (0 = embedding; L = output of block L-1)")
            a1.set_ylabel(m)
            a1.set_title(f"{self.meta.get('dataset')}: {m} by layer ({site}, {self.meta.get('position')})")
            if m in ("accuracy", "balanced_accuracy"):
                a1.set_ylim(-0.02, 1.02)
            a1.grid(alpha=.3)
            a1.legend(fontsize=7)
            a2.plot(L, d["selectivity"], marker="o", ms=3, label="selectivity (probe - control)")
            a2.fill_between(L, d["selectivity_lo"], d["selectivity_hi"], alpha=.2)
            a2.plot(L, d["vs_embedding"], marker=".", ms=3, label="probe - embedding layer")
            a2.axhline(0, color="k", lw=1)
            a2.set_xlabel("layer")
            a2.set_ylabel(f"difference in {m}")
            a2.set_title("selectivity and gain over the embedding layer (paired bootstrap CI)")
            a2.grid(alpha=.3)
            a2.legend(fontsize=7)
        fig.tight_layout()
        return {"by_layer": fig}


@register
class LinearProbe(Experiment):
    """Linear probes on every layer, with the controls reported next to them.

    Fields (YAML keys):
        dataset: :class:`ProbeDatasetSpec` (``builtin: countries`` or ``path:``).
        task: ``classification`` (logistic regression) | ``regression`` (ridge).
        sites: activation sites, any of ``resid`` (default), ``attn_out``, ``mlp_out``.
        hooks: extra explicit hook names (e.g. ``blocks.3.mlp.hook_post``), validated against the model.
        layers: ``all`` or a list of layers (hidden-state numbering; 0 is always included as the
            embedding baseline).
        position: ``last`` | ``mean`` | ``all`` | ``token:<text>`` | ``field:<column>``.
        batch_size: prompts per forward pass.
        group_by: ``entity`` | ``template`` | ``both`` (see :func:`tracekit.probing.group_split`).
        test_size: fraction of groups held out (single split).
        cv_folds: k for group k-fold (out-of-fold predictions pooled); null = single split.
        seed: seeds the split, control labels, inner folds and bootstrap; same seed, same numbers.
        Cs: inverse L2 strengths searched (logistic regression, standardised features); the table's
            ``reg_at_edge`` flags a choice at the grid's edge.
        alphas: ridge strengths searched (regression).
        inner_folds: group folds inside the training split for choosing C / alpha.
        max_iter: lbfgs iterations.
        control: ``auto`` | ``shuffle_groups`` | ``shuffle_rows`` (see :func:`tracekit.probing.control_labels`).
        bootstrap: number of bootstrap resamples (0 disables intervals).
        bootstrap_unit: ``group`` (resample test entities, default) | ``row``.
        ci: confidence level of the intervals.
        shortcut_margin: warn of a lexical shortcut when the embedding layer's metric is within this
            of the best layer's (also warned: the embedding layer beats the baseline and the best layer
            is not significantly better than it).
        cache_dir: write activations here as safetensors chunks (kept); default memory, spilling to a
            temporary directory above ``max_memory_mb``.
        max_memory_mb: in-memory activation budget (MiB).
        save_directions: keep every probe's weights in the result's arrays.

    Raises (from :meth:`check` / :meth:`run`):
        ValueError: unknown dataset column / target / file, a class with too few groups to split, an
            unknown hook or site, a bad position spec or a position string missing from a prompt.
    """

    kind: Literal["linear_probe"] = "linear_probe"
    dataset: ProbeDatasetSpec = Field(default_factory=lambda: ProbeDatasetSpec(builtin="countries"))
    task: Literal["classification", "regression"] = "classification"
    sites: list[Literal["resid", "attn_out", "mlp_out"]] = Field(default_factory=lambda: ["resid"], min_length=1)
    hooks: list[str] = Field(default_factory=list)
    layers: Union[Literal["all"], list[int]] = "all"
    position: str = "last"
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
    shortcut_margin: float = Field(default=0.05, ge=0)
    cache_dir: Optional[str] = None
    max_memory_mb: float = Field(default=1024.0, gt=0)
    save_directions: bool = True

    result_class = LinearProbeResult

    @field_validator("position")
    @classmethod
    def _pos(cls, v):
        parse_position(v)
        return v

    @model_validator(mode="after")
    def _kfold_both(self):
        if self.cv_folds is not None and self.group_by == "both":
            raise ValueError("cv_folds: k-fold is not supported with group_by: both; use a single split "
                             "(cv_folds: null) or group_by: entity/template")
        return self

    # ---- validation ----------------------------------------------------------------------
    def _fields(self, ds: ProbeDataset) -> Optional[list[str]]:
        kind, arg = parse_position(self.position)
        if kind != "field":
            return None
        if arg not in ds.frame.columns:
            raise ValueError(f"position: {self.position!r}: the dataset has no column {arg!r}; its columns are "
                             f"{list(ds.frame.columns)}")
        return ds.frame[arg].astype(str).tolist()

    def _triples(self, model):
        layers = None if self.layers == "all" else self.layers
        return probe_hooks(model.cfg.n_layers, self.sites, layers, self.hooks)

    def check(self, model) -> None:
        """Load the dataset, check the split is possible, the hooks exist and every position resolves."""
        ds = self.dataset.load(self.task)
        if self.cv_folds:
            group_kfold(ds, self.cv_folds, self.group_by, self.seed)
        else:
            group_split(ds, self.group_by, self.test_size, self.seed)
        check_hooks(model, self.hooks, "hooks")
        check_hooks(model, [h for _, _, h in self._triples(model)], "layers")
        from ..models import model_spec_of

        ids = [encode(model, t) for t in ds.texts]
        _row_positions(model, ds.texts, ids, self.position, self._fields(ds), model_spec_of(model).prepend_bos)

    # ---- run -----------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, model, progress: bool = True) -> LinearProbeResult:
        """Extract, fit and evaluate every layer. ``fwd_hooks`` (notebook use): extra forward hooks
        active during extraction."""
        t0 = time.time()
        ds = self.dataset.load(self.task)
        task = self.task
        triples = self._triples(model)
        acts = extract_activations(model, ds.texts, [h for _, _, h in triples], self.position, self.batch_size,
                                   fields=self._fields(ds), cache_dir=self.cache_dir,
                                   max_memory_mb=self.max_memory_mb, progress=progress)
        t_extract = time.time() - t0
        try:
            result = self._fit_all(model, ds, triples, acts, progress)
        finally:
            acts.cleanup()
        result.meta["seconds"] = {"extract": round(t_extract, 2), "total": round(time.time() - t0, 2)}
        result.meta["task"] = task
        return result

    def _fit_all(self, model, ds: ProbeDataset, triples, acts, progress: bool) -> LinearProbeResult:
        from tqdm.auto import tqdm

        task = self.task
        metric = "accuracy" if task == "classification" else "r2"
        classes = ds.classes
        K = len(classes) if task == "classification" else None
        splits = (group_kfold(ds, self.cv_folds, self.group_by, self.seed) if self.cv_folds
                  else [group_split(ds, self.group_by, self.test_size, self.seed)])
        y_row = ds.y()
        # Control labels are shuffled within each side of the split (each fold's test rows for k-fold),
        # so train and test keep the real task's class counts exactly.
        parts = [sp.test for sp in splits] + ([splits[0].train, splits[0].dropped] if len(splits) == 1 else [])
        yc_row, cmode = control_labels(ds, self.control if task == "classification" else "shuffle_rows",
                                       self.seed, parts)
        ex_rows = acts.rows
        y_ex, yc_ex = y_row[ex_rows], yc_row[ex_rows]
        groups_ex = ds.frame["group"].to_numpy()[ex_rows]
        key_col = "template" if self.group_by == "template" else "group"
        inner_groups_ex = ds.frame[key_col].astype(str).to_numpy()[ex_rows]
        fold_ex = []  # (train example idx, test example idx) per fold
        for s in splits:
            fold_ex.append((np.flatnonzero(np.isin(ex_rows, s.train)), np.flatnonzero(np.isin(ex_rows, s.test))))
        test_all = np.concatenate([te for _, te in fold_ex])
        y_test, yc_test = y_ex[test_all], yc_ex[test_all]
        units = groups_ex[test_all] if self.bootstrap_unit == "group" else np.arange(len(test_all))
        W = bootstrap_weights(units, self.bootstrap, self.seed) if self.bootstrap else np.ones((1, len(test_all)))
        ones = np.ones((1, len(test_all)))
        # baseline: the training split's majority class (classification) / mean (regression)
        base_pred = np.concatenate([
            np.full(len(te), np.bincount(y_ex[tr], minlength=K).argmax() if task == "classification"
                    else y_ex[tr].mean()) for tr, te in fold_ex])
        base_boot = bootstrap_metrics(y_test, base_pred, None, W, task, K)[metric]
        base_point = float(bootstrap_metrics(y_test, base_pred, None, ones, task, K)[metric][0])

        rows, pred_rows, arrays, boots = [], [], {}, {}
        bar = tqdm(total=len(triples), desc="probing layers", disable=not progress, leave=False)
        fit_kw = dict(task=task, n_classes=K, Cs=self.Cs, alphas=self.alphas, inner_folds=self.inner_folds,
                      seed=self.seed, max_iter=self.max_iter)
        for site, layer, hook in triples:
            X = acts.get(hook).double().numpy()
            preds, probas, cpreds, cprobas, regs, cregs, trs = [], [], [], [], [], [], []
            probe = None
            for tr, te in fold_ex:
                fp = fit_probe(X[tr], y_ex[tr], X[te], inner_groups_ex[tr], **fit_kw)
                cp = fit_probe(X[tr], yc_ex[tr], X[te], inner_groups_ex[tr], **fit_kw)
                preds.append(fp.pred); cpreds.append(cp.pred)
                probas.append(fp.proba); cprobas.append(cp.proba)
                regs.append(fp.reg); cregs.append(cp.reg); trs.append(fp.train_score)
                probe = probe or fp
            pred = np.concatenate(preds)
            cpred = np.concatenate(cpreds)
            proba = np.concatenate(probas) if task == "classification" else None
            cproba = np.concatenate(cprobas) if task == "classification" else None
            if self.save_directions:
                if len(fold_ex) > 1:  # k-fold: the saved direction is refit on every used row
                    used = np.union1d(fold_ex[0][0], fold_ex[0][1])
                    probe = fit_probe(X[used], y_ex[used], X[:1], inner_groups_ex[used], **fit_kw)
                arrays[f"probe.{site}.{layer}.weight"] = torch.tensor(probe.weight, dtype=torch.float32)
                arrays[f"probe.{site}.{layer}.bias"] = torch.tensor(probe.bias, dtype=torch.float32)
            mb = bootstrap_metrics(y_test, pred, proba, W, task, K)
            mp = bootstrap_metrics(y_test, pred, proba, ones, task, K)
            cb = bootstrap_metrics(yc_test, cpred, cproba, W, task, K)
            cpt = bootstrap_metrics(yc_test, cpred, cproba, ones, task, K)
            boots[(site, layer)] = mb[metric]
            row = {"site": site, "layer": layer, "hook": hook, "n_train": int(sum(len(tr) for tr, _ in fold_ex)
                                                                               / len(fold_ex)),
                   "n_test": len(test_all)}
            for k in mp:
                row[k] = float(mp[k][0])
                row[f"{k}_lo"], row[f"{k}_hi"] = percentile_ci(mb[k], self.ci) if self.bootstrap else (np.nan, np.nan)
            for k in cpt:
                row[f"control_{k}"] = float(cpt[k][0])
            row[f"control_{metric}_lo"], row[f"control_{metric}_hi"] = (
                percentile_ci(cb[metric], self.ci) if self.bootstrap else (np.nan, np.nan))
            row["selectivity"] = row[metric] - row[f"control_{metric}"]
            row["selectivity_lo"], row["selectivity_hi"] = _ci(mb[metric] - cb[metric], self.ci, self.bootstrap)
            row[f"baseline_{metric}"] = base_point
            row["vs_baseline"] = row[metric] - base_point
            row["vs_baseline_lo"], row["vs_baseline_hi"] = _ci(mb[metric] - base_boot, self.ci, self.bootstrap)
            row["reg"] = float(np.median(regs))
            grid = self.Cs if task == "classification" else self.alphas
            row["reg_at_edge"] = bool(len(grid) > 1 and row["reg"] in (min(grid), max(grid)))
            row["control_reg"] = float(np.median(cregs))
            row["train_score"] = float(np.mean(trs))
            rows.append(row)
            inv = {i: c for i, c in enumerate(classes)}
            for j, e in enumerate(test_all):
                r = int(ex_rows[e])
                pr = {"site": site, "layer": layer, "example": int(e), "row": r,
                      "position": int(acts.positions[e]), "group": groups_ex[e]}
                if task == "classification":
                    pr.update(y_true=inv[int(y_test[j])], y_pred=inv[int(pred[j])], correct=bool(y_test[j] == pred[j]),
                              p_true=float(proba[j, int(y_test[j])]), control_true=inv[int(yc_test[j])],
                              control_pred=inv[int(cpred[j])])
                else:
                    pr.update(y_true=float(y_test[j]), y_pred=float(pred[j]), control_true=float(yc_test[j]),
                              control_pred=float(cpred[j]))
                pred_rows.append(pr)
            bar.update(1)
        bar.close()
        emb = boots[("resid", 0)]
        for row in rows:
            b = boots[(row["site"], row["layer"])]
            row[f"embedding_{metric}"] = rows[0][metric]
            row["vs_embedding"] = row[metric] - rows[0][metric]
            row["vs_embedding_lo"], row["vs_embedding_hi"] = _ci(b - emb, self.ci, self.bootstrap)
            is_emb = row["site"] == "resid" and row["layer"] == 0
            row["beats_controls"] = bool(
                not is_emb and row["selectivity_lo"] > 0 and row["vs_baseline_lo"] > 0 and row["vs_embedding_lo"] > 0)
        main = pd.DataFrame(rows)
        split_rows = []
        side = np.full(len(ds), "dropped", dtype=object)
        fold = np.full(len(ds), -1)
        for s in splits:
            fold[s.test] = s.fold
            side[s.test] = "test"
            if len(splits) == 1:
                side[s.train] = "train"
        f = ds.frame
        for i in range(len(ds)):
            split_rows.append({"row": i, "text": f["text"].iloc[i], "label": f["label"].iloc[i],
                               "group": f["group"].iloc[i], "template": f["template"].iloc[i],
                               "side": side[i], "fold": int(fold[i]),
                               "control_label": classes[int(yc_row[i])] if task == "classification" else float(yc_row[i])})
        split_df = pd.DataFrame(split_rows)
        split_df["template"] = split_df["template"].astype(object).where(split_df["template"].notna(), None)
        test_classes = set(y_test.tolist()) if task == "classification" else set()
        train_classes = set(y_ex[fold_ex[0][0]].tolist()) if task == "classification" else set()
        meta = {
            "dataset": ds.name, "task": task, "metric": metric, "classes": classes, "position": self.position,
            "group_by": self.group_by, "cv_folds": self.cv_folds, "n_rows": len(ds),
            "n_examples": len(acts), "n_train": int(np.mean([len(tr) for tr, _ in fold_ex])),
            "n_test": int(len(test_all)),
            "n_dropped": int(sum(len(s.dropped) for s in splits[:1])), "control_mode": cmode,
            "bootstrap": self.bootstrap, "bootstrap_unit": self.bootstrap_unit, "ci": self.ci,
            "shortcut_margin": self.shortcut_margin, "primary_site": self.sites[0],
            "n_layers": int(model.cfg.n_layers), "d_model": int(model.cfg.d_model),
            "hooks": [h for _, _, h in triples],
            "directions": "arrays probe.<site>.<layer>.weight [n_out, d] / .bias [n_out], activation basis "
                          "(standardisation undone); rows = classes (multiclass) or the positive class "
                          "classes[1] (binary)",
            "test_classes_unseen_in_train": [classes[c] for c in sorted(test_classes - train_classes)]
            if len(fold_ex) == 1 else [],
        }
        return LinearProbeResult(self, {"main": main, "predictions": pd.DataFrame(pred_rows), "split": split_df},
                                 meta, arrays if self.save_directions else {})


def _ci(values: np.ndarray, level: float, n_boot: int) -> tuple[float, float]:
    return percentile_ci(values, level) if n_boot else (float("nan"), float("nan"))
