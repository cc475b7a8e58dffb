"""One forward pass for points that differ only in what a kind can read off the same pass.

A sweep over ``target`` of a logit lens (``experiments[0].target: [" Paris", " Beijing", " London"]``)
runs the same forward pass and the same readout (final norm + unembedding + log-softmax over the
vocabulary) for every target; only the gathered column differs. Inside :func:`shared_passes`
(the sweep executor opens one per model), a :class:`~tracekit.experiments.logit_lens.LogitLens`
step whose *siblings* (other steps of the sweep equal to it but for ``target`` and ``name``) are
known runs the lens once for all of them, with every sibling's target ids appended to ``track``
(read from the same log-softmax), and each sibling then takes its own slice (:func:`split_lens`).

The slices are the numbers a separate run computes, bit for bit: the same batches, the same
readout, the target log-prob gathered from the same log-softmax row, the rank counted with the
same comparison (``1 + #{tokens with a strictly larger log-prob}``) in the same integer type.
The tests check every table of every point against a run of that point alone.

Not grouped (each such step runs alone, as before): ``lens: tuned``, ``layer_convention: resid_pre``
(its final-output rank is not among the reads), a model other than the one the pass was made on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, Optional

from ..core.errors import TokenizationError, TracekitError
from ..logit_lens import PromptLens
from ..model.info import HookedModel
from ..tokens import single_token_id

__all__ = ["SharedPasses", "current", "shared_passes", "split_lens"]

#: Fields whose values a shared pass tells apart (excluded from the sibling key).
_FREE = ("target", "name")


class SharedPasses:
    """The steps of a sweep that may share passes, and the passes computed so far.

    Args:
        steps: every step config of the points (any kinds; only logit lenses are grouped).
    """

    def __init__(self, steps: Iterable[Any]):
        self.steps = [s for s in steps if getattr(s, "kind", None) == "logit_lens"]
        self.cache: dict[tuple, tuple[list, list[int]]] = {}
        self.passes = 0  # forward passes run here (for the benchmark and the tests)

    @staticmethod
    def key(step) -> str:
        """What must be equal for two lens steps to share a pass: every field but ``target`` / ``name``."""
        return json.dumps(step.model_dump(mode="json", exclude=set(_FREE)), sort_keys=True, default=str)

    def siblings(self, step) -> list:
        """The steps sharing ``step``'s pass (itself included, first-seen order, duplicates by target
        dropped); ``[]`` when the step cannot share one."""
        if getattr(step, "lens", "logit") != "logit" or getattr(step, "layer_convention", "") == "resid_pre":
            return []
        k = self.key(step)
        out, seen = [], set()
        for s in self.steps:
            if self.key(s) == k:
                t = json.dumps(s.target)
                if t not in seen:
                    seen.add(t)
                    out.append(s)
        return out if len(out) > 1 else []

    def lens(self, model: HookedModel, step, n_rows: int, own_track: list[int], compute: Callable[[list[int]], list]
             ) -> Optional[tuple[list, list[int]]]:
        """``(union lens, union track ids)`` for ``step`` (computed once per sibling group and model),
        or None when the step has no siblings.

        Args:
            model: the model (passes are keyed by it).
            step: the lens step about to run.
            n_rows: its number of rows.
            own_track: its own tracked token ids (first in the union).
            compute: ``compute(track_ids) -> list[PromptLens]``: the engine call with that ``track``.
        """
        sibs = self.siblings(step)
        if not sibs:
            return None
        key = (id(model), self.key(step))
        if key not in self.cache:
            extra: list[int] = []
            for s in sibs:
                try:
                    ids = _row_ids(model, s.target, n_rows)
                except TracekitError:  # that sibling fails in its own prepare, naming its field; not here
                    continue
                extra += [t for t in ids if t is not None and t not in extra]
            track = list(own_track) + extra
            self.cache[key] = (compute(track), track)
            self.passes += 1
        return self.cache[key]


def _row_ids(model: HookedModel, target, n_rows: int) -> list[Optional[int]]:
    """Each row's target id for a lens ``target`` field (a token for every row, one per row, or None).

    Raises:
        TokenizationError: a target that is not one token; a list of another length than the rows.
    """
    if target is None:
        return [None] * n_rows
    if isinstance(target, list) and len(target) != n_rows:
        raise TokenizationError(f"target: {len(target)} tokens for {n_rows} rows")
    if isinstance(target, str):
        return [single_token_id(model, target, field="target")] * n_rows
    return [single_token_id(model, t, field=f"target[{j}]") for j, t in enumerate(target)]


_CURRENT: ContextVar[Optional[SharedPasses]] = ContextVar("tracekit_shared_passes", default=None)


def current() -> Optional[SharedPasses]:
    """The :class:`SharedPasses` of the enclosing :func:`shared_passes`, or None."""
    return _CURRENT.get()


@contextmanager
def shared_passes(steps: Iterable[Any] | SharedPasses) -> Iterator[SharedPasses]:
    """Let lens steps among ``steps`` that differ only in ``target`` share one pass while inside.

    Args:
        steps: the step configs of the points to be run (or a :class:`SharedPasses` to reuse).

    Yields:
        The :class:`SharedPasses` (its ``passes``: how many shared passes ran).
    """
    sp = steps if isinstance(steps, SharedPasses) else SharedPasses(steps)
    token = _CURRENT.set(sp)
    try:
        yield sp
    finally:
        _CURRENT.reset(token)


def split_lens(union: list[PromptLens], track: list[int], n_own_track: int, target_ids: list[Optional[int]]
               ) -> list[PromptLens]:
    """Each row's lens for its own target, sliced out of a pass that tracked every sibling's target.

    Args:
        union: the shared pass, one :class:`~tracekit.logit_lens.PromptLens` per row.
        track: the union's tracked ids (the step's own ``n_own_track`` first, then the siblings' targets).
        n_own_track: how many of ``track`` are the step's own tracked tokens.
        target_ids: each row's own target id (None: no target).

    Returns:
        One PromptLens per row, equal to the one a separate run of the step computes.
    """
    out = []
    for pl, tid in zip(union, target_ids):
        final_at = max(range(len(pl.points)), key=lambda j: (pl.points[j].hidden_state, pl.points[j].site == "resid_post"))
        k = n_own_track
        if tid is None:
            sl = slice(0, 0)
        else:
            j = track.index(tid, n_own_track)
            sl = slice(j, j + 1)
        out.append(replace(
            pl, target_ids=[] if tid is None else [int(tid)],
            target_log_prob=pl.track_log_prob[..., sl], target_rank=pl.track_rank[..., sl],
            final_log_prob=pl.final_track_log_prob[:, sl], final_rank=pl.track_rank[final_at][:, sl],
            track_ids=list(pl.track_ids[:k]), track_log_prob=pl.track_log_prob[..., :k],
            track_rank=pl.track_rank[..., :k], final_track_log_prob=pl.final_track_log_prob[:, :k]))
    return out
