"""Fitting linear probes: one probe (:func:`fit_probe`) and every layer with its controls
(:func:`probe_layers`, the engine behind ``kind: linear_probe``).

Method: logistic regression (lbfgs, L2; multinomial over more than two classes) or ridge regression
on standardised features (Alain & Bengio 2016), the regularisation strength chosen by cross-validation
*inside the training split* with the same grouping as the outer split; controls and decision rule as
described in :func:`probe_layers` (Hewitt & Liang 2019; Belinkov 2022).

scikit-learn API used: ``LogisticRegression(C=, tol=, max_iter=)`` (lbfgs default; multinomial for
>2 classes, the default since 0.22), ``RidgeCV(alphas=, cv=<list of splits>, scoring=)``,
``sklearn.metrics.log_loss(labels=)`` -- nothing newer than scikit-learn 0.22 (no
``LogisticRegressionCV``: its ``l1_ratios``/``use_legacy_attributes`` arguments changed in 1.8).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, cast

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from ..errors import ProbingError
from .data import ProbeDataset
from .extract import EMBEDDING_HOOK, Activations
from .metrics import bootstrap_metrics, percentile_ci, split_bootstrap_weights
from .splits import control_labels, group_kfold, group_split, held_out_units, inner_splits

__all__ = ["FittedProbe", "fit_probe", "ProbingWarning", "LayerProbes", "probe_layers"]


class ProbingWarning(UserWarning):
    """A probing choice was made for the user (e.g. an inner fold left out); also in the result."""


@dataclass
class FittedProbe:
    """A fitted probe, its test predictions, and its weights in the activation basis.

    Attributes:
        weight: ``[n_out, d]`` in the *original* activation basis (standardisation undone), so that
            ``x @ weight.T + bias`` equals the probe's decision function on a raw activation ``x``.
            ``n_out`` is the number of classes for multiclass, 1 for binary (the positive class,
            ``classes[1]``) and for regression.
        bias: ``[n_out]``.
        classes: class indices the probe was trained on (classification), else empty.
        reg: the chosen regularisation (``C`` for logistic regression, ``alpha`` for ridge).
        pred: test predictions (class index or value), ``[n_test]``.
        proba: ``[n_test, n_classes_total]`` class probabilities (classification) or None.
        train_score: accuracy (or R^2) on the training rows.
        excluded_folds: inner folds left out of the choice of ``reg`` because their training part
            lacks a class: ``[(fold, [class names])]``.
        uninformative: the training activations are identical across rows (no variance: e.g. every
            prompt ends in the same token, read at the embedding layer of a model without position
            embeddings); the probe is then the constant prior (majority class / mean), at chance.
    """

    weight: np.ndarray
    bias: np.ndarray
    classes: np.ndarray
    reg: float
    pred: np.ndarray
    proba: Optional[np.ndarray]
    train_score: float
    excluded_folds: list = field(default_factory=list)
    uninformative: bool = False
    extra: dict = field(default_factory=dict)


def _usable_folds(y: np.ndarray, splits, class_names: Optional[Sequence[str]]):
    """Inner folds whose training part has every class of ``y``; the others with their missing classes."""
    classes = set(np.unique(y).tolist())
    keep, dropped = [], []
    for j, (tr, te) in enumerate(splits):
        missing = sorted(classes - set(np.unique(y[tr]).tolist()))
        if missing:
            names = [class_names[c] if class_names is not None else c for c in missing]
            dropped.append((j, names))
        else:
            keep.append((tr, te))
    return keep, dropped


def fit_probe(
    X_train: Float[np.ndarray, "n_train d"],
    y_train: np.ndarray,
    X_test: Float[np.ndarray, "n_test d"],
    groups_train: Optional[np.ndarray] = None,
    task: str = "classification",
    n_classes: Optional[int] = None,
    Cs: Sequence[float] = (0.001, 0.01, 0.1, 1.0),
    alphas: Sequence[float] = (0.1, 1.0, 10.0, 100.0, 1000.0),
    inner_folds: int = 3,
    seed: int = 0,
    max_iter: int = 1000,
    splits: Optional[list[tuple[np.ndarray, np.ndarray]]] = None,
    class_names: Optional[Sequence[str]] = None,
) -> FittedProbe:
    """Fit one linear probe with its regularisation chosen by group cross-validation in the training set.

    Features are standardised with the training rows' mean and standard deviation; when ``d`` exceeds
    the number of training rows, the fit runs in the span of the training rows (exact for
    L2-penalised models: the optimum lies in that span -- the representer theorem), which is much
    faster. BLAS runs single-threaded during fitting (multi-threaded BLAS thrashes on small matrices).

    * classification: :class:`sklearn.linear_model.LogisticRegression` (lbfgs, L2, multinomial for
      more than two classes); ``C`` is the value of ``Cs`` with the lowest mean held-out log loss over
      the inner folds, then the probe is refit on every training row;
    * regression: :class:`sklearn.linear_model.RidgeCV` over ``alphas`` (mean squared error) with the
      same folds.

    An inner fold whose training part lacks a class cannot score that class's held-out rows: it is
    left out of the choice (a :class:`ProbingWarning` names the class; ``excluded_folds`` records it).
    With a single value in the grid no cross-validation is run.

    Args:
        X_train: ``[n_train, d]`` activations; X_test: ``[n_test, d]``.
        y_train: class indices (int) or targets (float).
        groups_train: group of each training row (inner group k-fold over it) when ``splits`` is None.
        n_classes: total number of classes (probability columns); default ``max(y_train) + 1``.
        splits: the inner folds ``[(train_idx, test_idx)]`` (e.g. from
            :func:`tracekit.probing.splits.inner_splits`); default: group k-fold over ``groups_train``.
        class_names: names for the class indices (warnings).

    Returns:
        :class:`FittedProbe`.

    Raises:
        ProbingError: fewer than two classes in the training rows, a single training group, or every
            inner fold lacking a class (the message names them and the fixes).
    """
    # Long (reason): the inner CV, the refit and the metrics share the standardisation and the class mapping of one fit.
    from sklearn.linear_model import LogisticRegression, RidgeCV
    from sklearn.metrics import log_loss
    from threadpoolctl import threadpool_limits

    X_train = np.asarray(X_train, dtype=np.float64)
    X_test = np.asarray(X_test, dtype=np.float64)
    grid = list(Cs) if task == "classification" else list(alphas)
    if splits is None and len(grid) > 1:
        if groups_train is None:
            raise ProbingError("fit_probe: pass groups_train or splits for the inner cross-validation")
        strat = y_train if task == "classification" else None
        splits = inner_splits(np.asarray(groups_train).astype(str), None, strat, "entity", inner_folds, seed)
    excluded: list = []
    if task == "classification":
        classes = np.unique(y_train)
        if len(classes) < 2:
            raise ProbingError(f"the training split has {len(classes)} class; a probe needs >= 2")
        if len(grid) > 1:
            splits, excluded = _usable_folds(y_train, splits, class_names)
            if excluded:
                warnings.warn(ProbingWarning(
                    f"inner_folds: {len(excluded)} inner fold(s) left out of choosing C: their training part "
                    f"lacks class(es) {sorted({c for _, cs in excluded for c in cs})}"), stacklevel=2)
            if not splits:
                raise ProbingError(
                    f"inner_folds: every inner fold's training part lacks a class "
                    f"({sorted({c for _, cs in excluded for c in cs})} have too few groups in the training split), "
                    "so C cannot be chosen. Drop small classes (dataset.drop_small_classes), use fewer "
                    "inner_folds, or give Cs a single value.")
    with threadpool_limits(1):
        mu = X_train.mean(0)
        sd = X_train.std(0)
        sd = np.where(sd > 1e-8 * max(1.0, float(np.abs(mu).max(initial=0.0))), sd, 1.0)
        Xs = (X_train - mu) / sd
        Xt = (X_test - mu) / sd
        V = None
        if Xs.shape[1] > Xs.shape[0]:
            # Row space of the training matrix from its Gram matrix (n x n): Xs = U S V^T.
            evals, U = np.linalg.eigh(Xs @ Xs.T)
            keep = evals > max(float(evals.max(initial=0.0)), 1e-300) * 1e-9
            V = (Xs.T @ U[:, keep]) / np.sqrt(evals[keep])  # [d, r], orthonormal columns
            Zs, Zt = Xs @ V, Xt @ V
        else:
            Zs, Zt = Xs, Xt
        if Zs.shape[1] == 0 or not np.any(Zs):
            return _constant_probe(task, y_train, len(X_test), X_train.shape[1], n_classes)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(converge|iteration|penalty|l1_ratio).*")
            if task == "classification":
                n_classes = n_classes or int(y_train.max()) + 1

                def make(C):
                    return LogisticRegression(C=C, max_iter=max_iter, tol=1e-4)

                if len(grid) > 1:
                    assert splits is not None  # made above when the grid has several values
                    scores = []
                    for C in grid:
                        s = []
                        for tr, te in splits:
                            m = make(C).fit(Zs[tr], y_train[tr])
                            s.append(log_loss(y_train[te], m.predict_proba(Zs[te]), labels=m.classes_))
                        scores.append(np.mean(s))
                    reg = float(grid[int(np.argmin(scores))])
                else:
                    reg = float(grid[0])
                m = make(reg).fit(Zs, y_train)
                coef, b = m.coef_, m.intercept_
                p = m.predict_proba(Zt)
                proba = np.zeros((len(Zt), n_classes))
                proba[:, m.classes_] = p
                pred = m.classes_[np.argmax(p, 1)]
                train_score = float((m.predict(Zs) == y_train).mean())
            else:
                classes = np.array([], dtype=np.int64)
                cv = splits if len(grid) > 1 else None
                if cv is None:
                    from sklearn.linear_model import Ridge

                    m = Ridge(alpha=grid[0]).fit(Zs, y_train)
                    reg = float(grid[0])
                else:
                    m = RidgeCV(alphas=grid, cv=cv, scoring="neg_mean_squared_error").fit(Zs, y_train)
                    reg = float(cast(float, m.alpha_))  # set by fit (sklearn's attributes are untyped)
                coef, b = np.atleast_2d(cast(np.ndarray, m.coef_)), np.atleast_1d(m.intercept_)
                pred = m.predict(Zt)
                proba = None
                ss = ((y_train - y_train.mean()) ** 2).sum()
                train_score = float(1 - ((m.predict(Zs) - y_train) ** 2).sum() / ss) if ss > 0 else float("nan")
    w_std = coef @ V.T if V is not None else coef  # [n_out, d] in the standardised basis
    weight = w_std / sd
    bias = b - weight @ mu
    return FittedProbe(weight, bias, classes, reg, pred, proba, train_score, excluded)


def _constant_probe(task: str, y_train: np.ndarray, n_test: int, d: int, n_classes: int | None) -> "FittedProbe":
    """The probe of activations that carry no information (identical across the training rows):
    the prior, i.e. the majority class with the training frequencies as probabilities, or the mean
    for regression; zero weights, flagged ``uninformative``."""
    if task == "classification":
        K = int(n_classes or int(y_train.max()) + 1)
        freq = np.bincount(y_train.astype(np.int64), minlength=K) / len(y_train)
        classes = np.unique(y_train)
        major = int(np.argmax(freq))
        n_out = 1 if len(classes) == 2 else len(classes)
        eps = 1e-12
        bias = (np.array([np.log(freq[classes[1]] + eps) - np.log(freq[classes[0]] + eps)]) if n_out == 1
                else np.log(freq[classes] + eps))
        return FittedProbe(np.zeros((n_out, d)), bias, classes, float("nan"), np.full(n_test, major),
                           np.tile(freq, (n_test, 1)), float((y_train == major).mean()), [], True)
    mean = float(np.mean(y_train))
    return FittedProbe(np.zeros((1, d)), np.array([mean]), np.array([], dtype=np.int64), float("nan"),
                       np.full(n_test, mean), None, 0.0, [], True)


# --------------------------------------------------------------------------------------------
# every layer, with controls
# --------------------------------------------------------------------------------------------

@dataclass
class LayerProbes:
    """What :func:`probe_layers` returns: tidy tables, meta and the probe directions.

    Attributes:
        main: one row per probed hook (``site``, ``layer`` = block index, ``hook``): metrics with
            intervals, shuffled-label control, majority baseline, embedding layer, decision.
        predictions: every test prediction per hook.
        split: each dataset row's side of the split, fold and shuffled label.
        meta: split sizes, classes, units, decision rule (``n_comparisons``, ``correction``, ...).
        directions: ``probe.<site>.<layer>.weight`` ``[n_out, d]`` / ``.bias`` tensors (activation basis).
    """

    main: pd.DataFrame
    predictions: pd.DataFrame
    split: pd.DataFrame
    meta: dict
    directions: dict


def _ci(values: np.ndarray, level: float, n_boot: int) -> tuple[float, float]:
    return percentile_ci(values, level) if n_boot else (float("nan"), float("nan"))


def _lower(values: np.ndarray, q: float, n_boot: int) -> float:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(np.quantile(v, q)) if (n_boot and len(v)) else float("nan")


def probe_layers(
    acts: Activations,
    ds: ProbeDataset,
    targets: Sequence[tuple[str, int, str]],
    *,
    group_by: str = "entity",
    test_size: float = 0.3,
    cv_folds: Optional[int] = None,
    seed: int = 0,
    Cs: Sequence[float] = (0.01, 0.1, 1.0, 10.0),
    alphas: Sequence[float] = (0.1, 1.0, 10.0, 100.0, 1000.0),
    inner_folds: int = 3,
    max_iter: int = 1000,
    control: str = "auto",
    bootstrap: int = 1000,
    bootstrap_unit: str = "group",
    ci: float = 0.95,
    correction: str = "bonferroni",
    save_directions: bool = True,
    progress: bool = False,
) -> LayerProbes:
    """Fit a probe per hook, with its controls, and decide which layers beat them.

    Per hook (``targets``: ``(site, layer, hook)`` from :func:`tracekit.probing.probe_hooks`; the
    embedding hook ``blocks.0.hook_resid_pre`` must be among them):

    * the **probe** (:func:`fit_probe`), regularisation chosen by inner folds grouped as the split
      (:func:`tracekit.probing.splits.inner_splits`);
    * the **shuffled-label control**: the same probe and search fitted to shuffled labels
      (:func:`tracekit.probing.splits.control_labels`; by default each entity gets one random label).
      *What it measures here*: the test groups are unseen in training, so the shuffled labels of the
      test rows carry no information a probe could transfer from training; the control therefore
      estimates the **accuracy reached without label information under this split** (chance level,
      plus whatever the split's group and class structure lets leak) -- a permutation baseline. It is
      *not* Hewitt & Liang's (2019) selectivity, whose control task is evaluated on word types seen in
      training and so measures the probe's capacity to memorise; hence the columns are named
      ``shuffled_*`` and ``vs_shuffled`` (probe minus control), not "selectivity";
    * the **majority-class baseline** (the training split's most frequent class; training mean for
      regression) and the **embedding layer** (lexical baseline).

    Intervals: percentile bootstrap (``bootstrap`` resamples, level ``ci``) over the **unit the split
    holds out** (``bootstrap_unit: group``): entities (``group_by: entity``), templates (``template``),
    entities and templates independently (``both``: two-way bootstrap, Owen 2007); ``row`` resamples
    rows. The same resamples serve every hook and control (paired differences).

    Decision rule: a hook **beats the controls** when the lower bounds of the paired bootstrap
    differences (probe - shuffled control), (probe - majority baseline) and (probe - embedding layer)
    are all above 0 (an intersection-union test: all three must hold, no correction across them).
    **Multiple comparisons**: every non-embedding hook is one comparison, ``m`` = their number (all
    sites together); with ``correction: bonferroni`` (default) the lower bounds are the
    ``(1 - ci) / (2 m)`` quantiles (family-wise error over the m layers at ``(1 - ci) / 2``, one-sided),
    with ``none`` the ``(1 - ci) / 2`` quantiles. ``m``, the correction and the quantile are in ``meta``;
    the ``*_lo`` / ``*_hi`` columns stay the unadjusted ``ci`` intervals, the adjusted bounds are the
    ``*_lo_adj`` columns.

    Raises:
        ProbingError: bad split settings, the embedding hook missing from ``targets``, a hook not in
            ``acts``, an unknown control / correction / bootstrap unit.
    """
    # Long (reason): one loop over (site, layer) whose steps (fit, controls, selectivity, baselines) share the split, the inner CV folds and the control labels; splitting it is planned (house issue's closing note).
    from ..core.progress import progress_bar

    task = ds.task
    if correction not in ("bonferroni", "none"):
        raise ProbingError(f"correction: unknown {correction!r}; use bonferroni or none")
    if bootstrap_unit not in ("group", "row"):
        raise ProbingError(f"bootstrap_unit: unknown {bootstrap_unit!r}; use group (the held-out unit) or row")
    targets = [(site, layer, hook) for site, layer, hook in targets]
    if EMBEDDING_HOOK not in [h for _, _, h in targets]:
        raise ProbingError(f"targets: the embedding baseline {EMBEDDING_HOOK} must be probed "
                           "(tracekit.probing.probe_hooks always adds it)")
    targets = sorted(targets, key=lambda t: t[2] != EMBEDDING_HOOK)  # embedding first
    metric = "accuracy" if task == "classification" else "r2"
    classes = ds.classes
    K = len(classes) if task == "classification" else None
    splits = (group_kfold(ds, cv_folds, group_by, seed) if cv_folds
              else [group_split(ds, group_by, test_size, seed)])
    y_row = ds.y()
    # Control labels are shuffled within each side of the split (each fold's test rows for k-fold),
    # so train and test keep the real task's class counts exactly.
    parts = [sp.test for sp in splits] + ([splits[0].train, splits[0].dropped] if len(splits) == 1 else [])
    yc_row, cmode = control_labels(ds, control if task == "classification" else "shuffle_rows", seed, parts)
    ex_rows = acts.rows
    y_ex, yc_ex = y_row[ex_rows], yc_row[ex_rows]
    f = ds.frame
    groups_ex = f["group"].to_numpy()[ex_rows]
    entity_ex = f["group"].astype(str).to_numpy()[ex_rows]
    template_ex = f["template"].astype(str).to_numpy()[ex_rows] if ds.has_templates else None
    fold_ex = []  # (train example idx, test example idx) per fold
    for s in splits:
        fold_ex.append((np.flatnonzero(np.isin(ex_rows, s.train)), np.flatnonzero(np.isin(ex_rows, s.test))))
    grid = list(Cs) if task == "classification" else list(alphas)
    inner, inner_c = [], []  # inner folds per outer fold, for the probe and the control (stratified by its labels)
    for tr, _ in fold_ex:
        if len(grid) > 1:
            tpl = template_ex[tr] if template_ex is not None else None
            strat = y_ex[tr] if task == "classification" else None
            strat_c = yc_ex[tr] if task == "classification" else None
            inner.append(inner_splits(entity_ex[tr], tpl, strat, group_by, inner_folds, seed))
            inner_c.append(inner_splits(entity_ex[tr], tpl, strat_c, group_by, inner_folds, seed))
        else:
            inner.append(None)
            inner_c.append(None)
    test_all = np.concatenate([te for _, te in fold_ex])
    y_test, yc_test = y_ex[test_all], yc_ex[test_all]
    if bootstrap_unit == "group":
        units = [u[ex_rows][test_all] for u in held_out_units(f, group_by)]
        unit_name = {"entity": "entity", "template": "template", "both": "entity x template"}[group_by]
    else:
        units = [np.arange(len(test_all))]
        unit_name = "row"
    W = split_bootstrap_weights(units, bootstrap, seed) if bootstrap else np.ones((1, len(test_all)))
    ones = np.ones((1, len(test_all)))
    # baseline: the training split's majority class (classification) / mean (regression)
    base_pred = np.concatenate([
        np.full(len(te), np.bincount(y_ex[tr], minlength=len(classes)).argmax() if task == "classification"
                else y_ex[tr].mean()) for tr, te in fold_ex])
    base_boot = bootstrap_metrics(y_test, base_pred, None, W, task, K)[metric]
    base_point = float(bootstrap_metrics(y_test, base_pred, None, ones, task, K)[metric][0])
    m_comp = max(1, len(targets) - 1)
    q = (1 - ci) / 2 / (m_comp if correction == "bonferroni" else 1)

    rows, pred_rows, arrays, boots = [], [], {}, {}
    excluded: dict[str, set] = {"probe": set(), "control": set()}
    fit_kw: dict[str, Any] = dict(task=task, n_classes=K, Cs=Cs, alphas=alphas, inner_folds=inner_folds, seed=seed,
                  max_iter=max_iter, class_names=classes or None)
    bar = progress_bar(total=len(targets), desc="probing layers", unit="layer", enabled=progress)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ProbingWarning)  # collected below, reported once in meta
            for site, layer, hook in targets:
                X = acts.get(hook).double().numpy()
                preds, probas, cpreds, cprobas, regs, cregs, trs = [], [], [], [], [], [], []
                probe = None
                uninformative = False
                for (tr, te), sp, spc in zip(fold_ex, inner, inner_c):
                    fp = fit_probe(X[tr], y_ex[tr], X[te], splits=sp, **fit_kw)
                    cp = fit_probe(X[tr], yc_ex[tr], X[te], splits=spc, **fit_kw)
                    for name, fit in (("probe", fp), ("control", cp)):
                        for _, cs in fit.excluded_folds:
                            excluded[name] |= set(map(str, cs))
                    preds.append(fp.pred)
                    cpreds.append(cp.pred)
                    probas.append(fp.proba)
                    cprobas.append(cp.proba)
                    regs.append(fp.reg)
                    cregs.append(cp.reg)
                    trs.append(fp.train_score)
                    uninformative = uninformative or fp.uninformative
                    probe = probe or fp
                pred = np.concatenate(preds)
                cpred = np.concatenate(cpreds)
                proba = np.concatenate(probas) if task == "classification" else None
                cproba = np.concatenate(cprobas) if task == "classification" else None
                if save_directions:
                    if len(fold_ex) > 1:  # k-fold: the saved direction is refit on every used row
                        used = np.union1d(fold_ex[0][0], fold_ex[0][1])
                        sp = None
                        if len(grid) > 1:
                            tpl = template_ex[used] if template_ex is not None else None
                            sp = inner_splits(entity_ex[used], tpl, y_ex[used] if task == "classification" else None,
                                              group_by, inner_folds, seed)
                        probe = fit_probe(X[used], y_ex[used], X[:1], splits=sp, **fit_kw)
                    assert probe is not None
                    key = f"probe.{site}.{layer}"
                    arrays[f"{key}.weight"] = torch.tensor(probe.weight, dtype=torch.float32)
                    arrays[f"{key}.bias"] = torch.tensor(probe.bias, dtype=torch.float32)
                mb = bootstrap_metrics(y_test, pred, proba, W, task, K)
                mp = bootstrap_metrics(y_test, pred, proba, ones, task, K)
                cb = bootstrap_metrics(yc_test, cpred, cproba, W, task, K)
                cpt = bootstrap_metrics(yc_test, cpred, cproba, ones, task, K)
                boots[hook] = mb[metric]
                row = {"site": site, "layer": int(layer), "hook": hook,
                       "n_train": int(sum(len(tr) for tr, _ in fold_ex) / len(fold_ex)), "n_test": len(test_all)}
                for k in mp:
                    row[k] = float(mp[k][0])
                    row[f"{k}_lo"], row[f"{k}_hi"] = _ci(mb[k], ci, bootstrap)
                for k in cpt:
                    row[f"shuffled_{k}"] = float(cpt[k][0])
                row[f"shuffled_{metric}_lo"], row[f"shuffled_{metric}_hi"] = _ci(cb[metric], ci, bootstrap)
                row["vs_shuffled"] = row[metric] - row[f"shuffled_{metric}"]
                row["vs_shuffled_lo"], row["vs_shuffled_hi"] = _ci(mb[metric] - cb[metric], ci, bootstrap)
                row["vs_shuffled_lo_adj"] = _lower(mb[metric] - cb[metric], q, bootstrap)
                row[f"baseline_{metric}"] = base_point
                row["vs_baseline"] = row[metric] - base_point
                row["vs_baseline_lo"], row["vs_baseline_hi"] = _ci(mb[metric] - base_boot, ci, bootstrap)
                row["vs_baseline_lo_adj"] = _lower(mb[metric] - base_boot, q, bootstrap)
                row["reg"] = float(np.median(regs))
                row["reg_at_edge"] = bool(len(grid) > 1 and row["reg"] in (min(grid), max(grid)))
                row["shuffled_reg"] = float(np.median(cregs))
                row["train_score"] = float(np.mean(trs))
                row["uninformative"] = bool(uninformative)
                rows.append(row)
                inv = dict(enumerate(classes))
                for j, e in enumerate(test_all):
                    r = int(ex_rows[e])
                    pr = {"site": site, "layer": int(layer), "hook": hook, "example": int(e), "row": r,
                          "position": int(acts.positions[e]), "group": groups_ex[e]}
                    if task == "classification":
                        assert proba is not None  # a classification probe returns probabilities
                        pr.update(y_true=inv[int(y_test[j])], y_pred=inv[int(pred[j])],
                                  correct=bool(y_test[j] == pred[j]), p_true=float(proba[j, int(y_test[j])]),
                                  shuffled_true=inv[int(yc_test[j])], shuffled_pred=inv[int(cpred[j])])
                    else:
                        pr.update(y_true=float(y_test[j]), y_pred=float(pred[j]), shuffled_true=float(yc_test[j]),
                                  shuffled_pred=float(cpred[j]))
                    pred_rows.append(pr)
                bar.update(1)
    finally:
        bar.close()
    emb = boots[EMBEDDING_HOOK]
    emb_point = rows[0][metric]
    for row in rows:
        b = boots[row["hook"]]
        row[f"embedding_{metric}"] = emb_point
        row["vs_embedding"] = row[metric] - emb_point
        row["vs_embedding_lo"], row["vs_embedding_hi"] = _ci(b - emb, ci, bootstrap)
        is_emb = row["hook"] == EMBEDDING_HOOK
        row["vs_embedding_lo_adj"] = float("nan") if is_emb else _lower(b - emb, q, bootstrap)
        row["is_embedding"] = is_emb
        row["beats_controls"] = bool(not is_emb and row["vs_shuffled_lo_adj"] > 0 and row["vs_baseline_lo_adj"] > 0
                                     and row["vs_embedding_lo_adj"] > 0)
    main = pd.DataFrame(rows)
    side = np.full(len(ds), "dropped", dtype=object)
    fold = np.full(len(ds), -1)
    for s in splits:
        fold[s.test] = s.fold
        side[s.test] = "test"
        if len(splits) == 1:
            side[s.train] = "train"
    split_df = pd.DataFrame({
        "row": np.arange(len(ds)), "text": f["text"].to_numpy(), "label": f["label"].to_numpy(),
        "group": f["group"].to_numpy(), "template": f["template"].astype(object).where(f["template"].notna(), None),
        "side": side, "fold": fold.astype(int),
        "shuffled_label": [classes[int(v)] for v in yc_row] if task == "classification" else yc_row.astype(float)})
    test_classes = set(y_test.tolist()) if task == "classification" else set()
    train_classes = set(y_ex[fold_ex[0][0]].tolist()) if task == "classification" else set()
    meta = {
        "dataset": ds.name, "task": task, "metric": metric, "classes": classes,
        "group_by": group_by, "cv_folds": cv_folds, "n_rows": len(ds),
        "n_examples": len(acts), "n_train": int(np.mean([len(tr) for tr, _ in fold_ex])),
        "n_test": int(len(test_all)),
        "n_dropped": int(sum(len(s.dropped) for s in splits[:1])), "control_mode": cmode,
        "bootstrap": bootstrap, "bootstrap_unit": bootstrap_unit, "bootstrap_resamples": unit_name, "ci": ci,
        "n_comparisons": m_comp, "correction": correction, "decision_quantile": q,
        "inner_folds_excluded": {k: sorted(v) for k, v in excluded.items() if v},
        "hooks": [h for _, _, h in targets],
        "test_classes_unseen_in_train": [classes[c] for c in sorted(test_classes - train_classes)]
        if len(fold_ex) == 1 else [],
    }
    return LayerProbes(main, pd.DataFrame(pred_rows), split_df, meta, arrays if save_directions else {})
