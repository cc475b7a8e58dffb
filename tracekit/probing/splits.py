"""Train/test splits that hold out whole groups, checked (not assumed), and control labels.

A row's *group* is the entity it was generated from (``entity``) or its template (``template``);
``both`` holds out entities and templates at once. Train and test never share a held-out unit
(:func:`check_no_overlap`). :func:`inner_splits` builds the folds that choose the regularisation
*inside* a training split with the same grouping as the outer split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import pandas as pd

from ..errors import ProbingError
from .data import ProbeDataset

__all__ = ["Split", "SplitLeakError", "group_split", "group_kfold", "check_no_overlap", "control_labels",
           "inner_splits", "held_out_units"]

class SplitLeakError(ProbingError):
    """A train/test split shares a group (entity or template) across its sides."""


@dataclass
class Split:
    """Row indices of one train/test split.

    Attributes:
        train, test: row indices (into the dataset's frame).
        dropped: rows in neither side (``group_by: both`` drops rows whose entity is held out but
            template is not, or vice versa).
        group_by: ``entity`` | ``template`` | ``both``.
        fold: fold number (0 for a single split).
    """

    train: np.ndarray
    test: np.ndarray
    dropped: np.ndarray
    group_by: str
    fold: int = 0


def _keys(frame: pd.DataFrame, group_by: str) -> np.ndarray:
    if group_by == "entity":
        return frame["group"].astype(str).to_numpy()
    if group_by == "template":
        if bool(frame["template"].isna().all()):
            raise ProbingError("group_by: 'template' needs a template column; set dataset.template "
                             "(or use group_by: entity)")
        return frame["template"].astype(str).to_numpy()
    raise ProbingError(f"group_by: unknown value {group_by!r}; use entity, template or both")


def _group_labels(keys: np.ndarray, labels: Optional[np.ndarray]) -> Optional[dict]:
    """key -> its single label, or None if labels vary within a key (or no labels)."""
    if labels is None:
        return None
    out: dict = {}
    for k, y in zip(keys, labels):
        if out.setdefault(k, y) != y:
            return None
    return out


def _assign_test_groups(keys: np.ndarray, labels: Optional[np.ndarray], test_size: float,
                        rng: np.random.Generator, what: str) -> set:
    uniq = sorted(set(keys.tolist()))
    gl = _group_labels(keys, labels)
    if gl is not None:
        test: set = set()
        by_class: dict = {}
        for g in uniq:
            by_class.setdefault(gl[g], []).append(g)
        for c in sorted(by_class, key=str):
            gs = by_class[c]
            if len(gs) < 2:
                raise ProbingError(
                    f"class {c!r} has only {len(gs)} {what} group ({gs}); a {what}-held-out split needs at "
                    f"least 2 per class (one for train, one for test). Add rows for it, drop small classes "
                    f"(dataset.drop_small_classes: true), or change group_by.")
            n_test = min(len(gs) - 1, max(1, int(round(test_size * len(gs)))))
            order = rng.permutation(len(gs))
            test |= {gs[i] for i in order[:n_test]}
        return test
    if len(uniq) < 2:
        raise ProbingError(f"group_by: only {len(uniq)} distinct {what} group(s); a held-out split needs >= 2")
    n_test = min(len(uniq) - 1, max(1, int(round(test_size * len(uniq)))))
    order = rng.permutation(len(uniq))
    return {uniq[i] for i in order[:n_test]}


def group_split(ds: ProbeDataset, group_by: str = "entity", test_size: float = 0.3, seed: int = 0) -> Split:
    """One train/test split with no group on both sides (checked with :func:`check_no_overlap`).

    * ``entity``: hold out whole entities (``group``), stratified by class when each entity has one
      label (each class keeps >= 1 entity on each side);
    * ``template``: hold out whole templates;
    * ``both``: hold out entities *and* templates; train keeps rows whose entity and template are both
      unseen in test, test keeps rows whose entity and template are both held out; the cross rows are
      dropped (so the test set is about ``test_size**2`` of the rows).

    Args:
        ds: the dataset.
        group_by: ``entity`` | ``template`` | ``both``.
        test_size: fraction of groups held out (0 < test_size < 1).
        seed: RNG seed; the same seed gives the same split.

    Raises:
        ProbingError: bad ``test_size``/``group_by``; a class with fewer than 2 groups; no templates for
            ``template``/``both``.
        SplitLeakError: the split shares a group (a bug; never expected).
    """
    if not 0 < test_size < 1:
        raise ProbingError(f"test_size: must be in (0, 1), got {test_size}")
    rng = np.random.default_rng(seed)
    f = ds.frame
    labels = f["label"].astype(str).to_numpy() if ds.task == "classification" else None
    if group_by in ("entity", "template"):
        keys = _keys(f, group_by)
        test_g = _assign_test_groups(keys, labels, test_size, rng, group_by)
        is_test = np.isin(keys, list(test_g))
        split = Split(np.flatnonzero(~is_test), np.flatnonzero(is_test), np.array([], dtype=np.int64), group_by)
    elif group_by == "both":
        ek, tk = _keys(f, "entity"), _keys(f, "template")
        test_e = _assign_test_groups(ek, labels, test_size, rng, "entity")
        test_t = _assign_test_groups(tk, None, test_size, rng, "template")
        e_in, t_in = np.isin(ek, list(test_e)), np.isin(tk, list(test_t))
        tr, te = ~e_in & ~t_in, e_in & t_in
        split = Split(np.flatnonzero(tr), np.flatnonzero(te), np.flatnonzero(~(tr | te)), "both")
    else:
        _keys(f, group_by)
        raise AssertionError  # pragma: no cover
    check_no_overlap(ds, split)
    if len(split.train) == 0 or len(split.test) == 0:
        raise ProbingError(f"group_by: {group_by}: the split left {len(split.train)} train / {len(split.test)} "
                           "test rows; lower test_size or use more groups")
    return split


def group_kfold(ds: ProbeDataset, k: int = 5, group_by: str = "entity", seed: int = 0) -> list[Split]:
    """``k`` folds over groups (stratified by class when each group has one label); every row is in
    exactly one test fold, and no fold shares a group across train/test (checked).

    Raises:
        ProbingError: ``k < 2``, more folds than groups, ``group_by: both`` (single split only).
    """
    if group_by == "both":
        raise ProbingError("cv_folds: k-fold is not supported with group_by: both (it drops cross rows); "
                         "use group_by: entity or template, or cv_folds: null")
    if k < 2:
        raise ProbingError(f"cv_folds: need at least 2 folds, got {k}")
    keys = _keys(ds.frame, group_by)
    labels = ds.frame["label"].astype(str).to_numpy() if ds.task == "classification" else None
    return [_check(ds, s) for s in _kfold_keys(keys, labels, k, seed, group_by)]


def _check(ds, s):
    check_no_overlap(ds, s)
    return s


def _kfold_keys(keys: np.ndarray, labels: Optional[np.ndarray], k: int, seed: int, group_by: str) -> list[Split]:
    rng = np.random.default_rng(seed)
    uniq = sorted(set(keys.tolist()))
    if k > len(uniq):
        raise ProbingError(f"cv_folds: {k} folds but only {len(uniq)} {group_by} groups; lower cv_folds")
    gl = _group_labels(keys, labels)
    buckets: dict = {}
    for g in uniq:
        buckets.setdefault(gl[g] if gl is not None else 0, []).append(g)
    fold_of: dict = {}
    start = 0
    for c in sorted(buckets, key=str):
        gs = [buckets[c][i] for i in rng.permutation(len(buckets[c]))]
        for i, g in enumerate(gs):
            fold_of[g] = (start + i) % k
        start = (start + len(gs)) % k
    folds = np.array([fold_of[g] for g in keys])
    empty = np.array([], dtype=np.int64)
    return [Split(np.flatnonzero(folds != j), np.flatnonzero(folds == j), empty, group_by, j) for j in range(k)]


def check_no_overlap(ds: ProbeDataset, split: Split) -> None:
    """Assert that train and test share no row, no entity (``entity``/``both``) and no template
    (``template``/``both``).

    Raises:
        SplitLeakError: naming the shared groups.
    """
    f = ds.frame
    both = set(split.train.tolist()) & set(split.test.tolist())
    if both:
        raise SplitLeakError(f"rows on both sides of the split: {sorted(both)[:10]}")
    checks = {"entity": ["group"], "template": ["template"], "both": ["group", "template"]}[split.group_by]
    for col in checks:
        a = set(f[col].iloc[split.train].astype(str))
        b = set(f[col].iloc[split.test].astype(str))
        shared = a & b
        if shared:
            raise SplitLeakError(f"split by {split.group_by}: {col} values on both sides: {sorted(shared)[:10]}")


def control_labels(ds: ProbeDataset, mode: str = "auto", seed: int = 0,
                   parts: Optional[Sequence[np.ndarray]] = None) -> tuple[np.ndarray, str]:
    """Shuffled labels for the control task (Hewitt & Liang 2019).

    * ``shuffle_groups``: permute the labels *of the groups* (each entity keeps one consistent, random
      label across its templates) -- the analogue of Hewitt & Liang's per-word-type control task;
      needs each group to have one label;
    * ``shuffle_rows``: permute labels across rows;
    * ``auto``: ``shuffle_groups`` when possible, else ``shuffle_rows``.

    ``parts`` (row-index arrays, e.g. the train and test rows of a split, or each fold's test rows):
    labels are permuted *within* each part, so every part keeps exactly its real class counts. Then
    the control differs from the real task only in which input carries which label; without it, a
    random excess of one control class in the test side is a deficit in the training side, and a
    signal-free probe that leans to the training majority scores systematically *below* chance.
    Rows in no part keep a permutation over the rest. Class proportions are always preserved.

    Returns ``(labels, mode used)``, labels in the same encoding as ``ds.y()``.

    Raises:
        ProbingError: unknown mode, or ``shuffle_groups`` with labels that vary within a group.
    """
    rng = np.random.default_rng(seed + 7919)
    y = ds.y()
    keys = ds.frame["group"].astype(str).to_numpy()
    if mode not in ("auto", "shuffle_groups", "shuffle_rows"):
        raise ProbingError(f"control: unknown mode {mode!r}; use auto, shuffle_groups or shuffle_rows")
    gl = _group_labels(keys, y)
    if mode == "shuffle_groups" and gl is None:
        raise ProbingError("control: shuffle_groups needs one label per group; use control: shuffle_rows")
    used = "shuffle_rows" if (mode == "shuffle_rows" or gl is None) else "shuffle_groups"
    parts = [np.asarray(p, dtype=np.int64) for p in (parts or []) if len(p)]
    covered = np.zeros(len(y), bool)
    for p in parts:
        covered[p] = True
    rest = np.flatnonzero(~covered)
    out = y.copy()
    for p in parts + ([rest] if len(rest) else []):
        if used == "shuffle_rows":
            out[p] = y[p][rng.permutation(len(p))]
        else:
            assert gl is not None  # shuffle_groups only when every group has one label
            gs = sorted(set(keys[p].tolist()))
            vals = np.array([gl[g] for g in gs])
            new = dict(zip(gs, vals[rng.permutation(len(gs))]))
            out[p] = np.array([new[k] for k in keys[p]], dtype=y.dtype)
    return out, used




def held_out_units(frame: pd.DataFrame, group_by: str) -> list[np.ndarray]:
    """The unit(s) a ``group_by`` split holds out, per row: ``[entity]``, ``[template]`` or, for
    ``both``, ``[entity, template]`` (string arrays). The bootstrap resamples these units."""
    if group_by == "both":
        return [_keys(frame, "entity"), _keys(frame, "template")]
    return [_keys(frame, group_by)]


def inner_splits(entity: np.ndarray, template: Optional[np.ndarray], y: Optional[np.ndarray], group_by: str,
                 k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Inner cross-validation folds over the rows of a training split, grouped as the outer split.

    * ``entity`` / ``template``: group k-fold over that key (stratified by class when each group has
      one label), ``k`` capped at the number of groups;
    * ``both``: entities and templates are each assigned to ``k`` folds; fold ``j`` tests the rows
      whose entity *and* template are in fold ``j`` and trains on the rows whose entity and template
      are both outside it (the cross rows sit out that fold), as the outer ``both`` split does.

    Returns:
        ``(train_idx, test_idx)`` pairs (indices into the given rows); folds with an empty side are
        left out.

    Raises:
        ProbingError: fewer than two groups of the held-out kind in the training split.
    """
    if group_by == "both":
        if template is None:
            raise ProbingError("group_by: 'both' needs a template column")
        ke = max(2, min(k, len(set(entity.tolist())), len(set(template.tolist()))))
        fe = _fold_of(np.asarray(entity).astype(str), y, ke, seed)
        ft = _fold_of(np.asarray(template).astype(str), None, ke, seed + 1)
        out = []
        for j in range(ke):
            te = np.flatnonzero((fe == j) & (ft == j))
            tr = np.flatnonzero((fe != j) & (ft != j))
            if len(te) and len(tr):
                out.append((tr, te))
        if not out:
            raise ProbingError("inner_folds: the training split is too small for an inner entity x template split")
        return out
    keys = np.asarray(template if group_by == "template" else entity).astype(str)
    n_groups = len(set(keys.tolist()))
    if n_groups < 2:
        raise ProbingError(f"inner_folds: the training split has a single {group_by} group; cannot "
                           "cross-validate the regularisation (give Cs / alphas a single value)")
    folds = _fold_of(keys, y, max(2, min(k, n_groups)), seed)
    out = []
    for j in range(int(folds.max()) + 1):
        te, tr = np.flatnonzero(folds == j), np.flatnonzero(folds != j)
        if len(te) and len(tr):
            out.append((tr, te))
    return out


def _fold_of(keys: np.ndarray, labels: Optional[np.ndarray], k: int, seed: int) -> np.ndarray:
    """Fold index of each row (groups kept whole, stratified when each group has one label)."""
    splits = _kfold_keys(keys, labels, k, seed, "inner")
    folds = np.empty(len(keys), dtype=np.int64)
    for s in splits:
        folds[s.test] = s.fold
    return folds
