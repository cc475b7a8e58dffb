"""Paired rows: what every paired method takes (activation and attribution patching, the circuit
methods, path patching, faithfulness).

A :class:`PairedRows` is a set of prepared rows (:class:`~tracekit.dataset.rows.PreparedDataset`)
whose clean and corrupted prompts tokenize to the same length row by row (rows of different lengths
are fine: engines run them in length groups), with each row's target and foil ids and the named
positions a method reads or patches. It is built once per model from pairs, a pairs file or a
dataset (the kinds' row source) and handed to the engines as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import DatasetError
from .rows import PreparedDataset

__all__ = ["PairedRows"]


@dataclass(frozen=True)
class PairedRows:
    """Rows with a clean and a corrupted prompt of equal token length, prepared for one model.

    Attributes:
        data: the rows (pairs become rows with ``prompt`` = ``clean``).
        clean_ids / corrupted_ids: per row the token ids, BOS included when the model spec prepends
            one; ``len(clean_ids[i]) == len(corrupted_ids[i])`` for every row (without corrupted
            prompts, an ablation-only run, ``corrupted_ids`` repeats ``clean_ids`` and
            ``has_corrupted`` is False).
        target_ids / foil_ids: per row the target token ids (one or several per row) and, when every
            row has them, the foil ids (as many as the row's targets); None when no row has a foil.
        targets / foils: the same as texts (for the ``rows`` table).
        has_corrupted: the rows have corrupted prompts.
        positions: per row the token index (BOS counted) of each of ``position_names``, or None
            (every position).
        position_names: the chosen positions' names (``S2``, ``END``, ``-1``, ``token: is``).
        positions_auto: why the positions are the rows' named positions although none were asked
            for (rows of different lengths or templates), else None.

    Raises:
        DatasetError: (on construction) per-row lists of different lengths, or a row whose clean
            and corrupted ids differ in length.
    """

    data: PreparedDataset
    clean_ids: tuple[tuple[int, ...], ...]
    corrupted_ids: tuple[tuple[int, ...], ...]
    target_ids: tuple[tuple[int, ...], ...]
    foil_ids: tuple[tuple[int, ...], ...] | None
    targets: tuple[tuple[str, ...], ...]
    foils: tuple[tuple[str, ...], ...] | None
    has_corrupted: bool
    positions: tuple[tuple[int, ...], ...] | None
    position_names: tuple[str, ...]
    positions_auto: str | None = None

    def __post_init__(self) -> None:
        n = len(self.clean_ids)
        sizes = {"data": len(self.data), "corrupted_ids": len(self.corrupted_ids),
                 "target_ids": len(self.target_ids), "targets": len(self.targets)}
        if self.foil_ids is not None:
            sizes["foil_ids"] = len(self.foil_ids)
        if self.positions is not None:
            sizes["positions"] = len(self.positions)
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad:
            raise DatasetError(f"paired rows: {n} clean rows but {bad}; every per-row list has one entry per row")
        for i, (c, x) in enumerate(zip(self.clean_ids, self.corrupted_ids)):
            if len(c) != len(x):
                raise DatasetError(f"paired rows: row {self.data.examples[i].row_id} has {len(c)} clean and "
                                   f"{len(x)} corrupted tokens; a pair's prompts must tokenize to the same length")

    def __len__(self) -> int:
        return len(self.clean_ids)

    @property
    def row_ids(self) -> list[int]:
        """Each row's id (its own ``row_id`` column, else its index)."""
        return [e.row_id for e in self.data.examples]

    @property
    def lengths(self) -> list[int]:
        """Each row's token length (clean and corrupted alike)."""
        return [len(c) for c in self.clean_ids]

    def single_target(self, what: str) -> tuple[list[int], list[int] | None]:
        """Each row's one target id and one foil id (None: no foils), for methods that score one.

        Raises:
            DatasetError: a row with several targets (naming ``what``, the method).
        """
        if any(len(t) != 1 for t in self.target_ids):
            raise DatasetError(f"target: {what} scores one target (and one foil) per row; give each row a "
                               "single target")
        tgt = [int(t[0]) for t in self.target_ids]
        foil = None if self.foil_ids is None else [int(f[0]) for f in self.foil_ids]
        return tgt, foil
