"""Paired rows: what every paired method takes (activation and attribution patching, the circuit
methods, path patching, faithfulness).

A :class:`PairedRows` is a set of prepared rows (:class:`~tracekit.dataset.rows.PreparedDataset`)
whose clean and corrupted prompts tokenize to the same length row by row (rows of different lengths
are fine: engines run them in length groups), with each row's target and foil ids and the named
positions a method reads or patches. It is built once per model from pairs, a pairs file or a
dataset (the kinds' row source, :meth:`PairedRows.prepare`) and handed to the engines as it is.

The errors a method needs are chosen by parameters (``foil_required``, ``corrupted_needed_by``,
``align_positions``), never by reading another error's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

from ..core.errors import DatasetError, PatchingError, TokenizationError
from ..model.info import HookedModel
from ..tokens import Position, check_length, encode, parse_position, single_token_id, str_tokens
from .pairs import PromptPair, load_pairs
from .rows import Example, PreparedDataset, Row
from .spec import DatasetSpec

__all__ = ["PairedRows", "POSITION_SPEC_FORMS", "pair_ids", "side_by_side", "position_specs"]

#: Forms a ``positions`` entry takes (:data:`tracekit.tokens.POSITION_FORMS`).
POSITION_SPEC_FORMS = ("int", "last", "token:<text>", "name")

#: Per row the target (or foil) ids.
_Ids = list[list[int]]


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

    @classmethod
    def prepare(cls, model: HookedModel, *, pairs: Sequence[PromptPair] = (), pairs_file: Optional[str] = None,
                dataset: Optional[DatasetSpec] = None, positions: Optional[Sequence[Union[int, str]]] = None,
                foil_required: bool = False, corrupted_needed_by: Optional[str] = None,
                align_positions: bool = False) -> "PairedRows":
        """The rows of exactly one of ``pairs``, ``pairs_file``, ``dataset``, prepared for ``model``
        (tokenizer only: works on a :class:`tracekit.model.ModelInfo`; a dataset's ``filter:
        correct`` then waits for the run).

        Args:
            model: the model (its tokenizer and config).
            pairs: inline pairs (they become rows with ``prompt`` = ``clean``).
            pairs_file: or a file of pairs (:func:`tracekit.dataset.pairs.load_pairs`).
            dataset: or a dataset (:class:`tracekit.dataset.DatasetSpec`).
            positions: ``positions`` entries (:data:`POSITION_SPEC_FORMS`), resolved per row; None:
                every position.
            foil_required: every row needs a foil (the ``logit_diff`` metric).
            corrupted_needed_by: why every row needs a corrupted prompt and the fix (quoted in the
                error after ``no corrupted prompt;``); None: all rows or none may have one (an
                ablation-only run).
            align_positions: without ``positions``, rows of different lengths or templates are
                aligned at the dataset's named positions (the method patches position-indexed sites).

        Raises:
            ConfigError: a pairs file that cannot be read.
            TokenizationError: a pair's target/foil that is not one token, a pair whose prompts
                tokenize to different lengths (both tokenizations side by side), an index or text
                not in a row's prompt.
            DatasetError: a dataset row without target, foil (``foil_required``) or corrupted prompt,
                or a named position it does not have, naming the row.
            PatchingError: pairs with different numbers of targets or foils; a pair without a foil
                (``foil_required``); rows that need aligning without named positions.
        """
        if dataset is not None:
            data, tids, fids = _dataset_rows(model, dataset, foil_required)
        else:
            data, tids, fids = _pair_rows(model, list(pairs) if pairs else load_pairs(str(pairs_file)),
                                          "pairs" if pairs else f"pairs_file ({pairs_file})",
                                          "pairs" if pairs else str(pairs_file), foil_required)
        has_corr = _corrupted(data, corrupted_needed_by)
        pos, names = _resolve_positions(model, data, positions)
        auto = None
        if pos is None and align_positions:
            pos, names, auto = _auto_positions(data)

        def texts(e: Example, which: str) -> tuple[str, ...]:
            return cast(tuple[str, ...], e.row.target_texts if which == "target" else e.row.foil_texts)

        return cls(
            data=data, target_ids=tuple(tuple(t) for t in tids),
            foil_ids=None if fids is None else tuple(tuple(f) for f in fids),
            targets=tuple(texts(e, "target") for e in data.examples),
            foils=None if fids is None else tuple(texts(e, "foil") for e in data.examples),
            clean_ids=tuple(e.ids for e in data.examples),
            corrupted_ids=tuple(e.corrupted_ids if e.corrupted_ids is not None else e.ids for e in data.examples),
            has_corrupted=has_corr,
            positions=None if pos is None else tuple(tuple(r) for r in pos),
            position_names=tuple(names), positions_auto=auto)


def position_specs(v: Any) -> Any:
    """A config's ``positions`` checked (a field validator's body): None, or a non-empty list of
    :data:`POSITION_SPEC_FORMS` entries (a single one becomes a list), none given twice.

    Raises:
        ValueError: an empty list, an entry of no such form, a position given twice.
    """
    if v is None:
        return v
    if isinstance(v, (str, int)):
        v = [v]
    if not isinstance(v, list) or not v:
        raise ValueError("positions: give a non-empty list (e.g. [S2, END] or [-1])")
    labels = []
    for i, p in enumerate(v):
        labels.append(str(parse_position(p, POSITION_SPEC_FORMS, f"positions[{i}]")))
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"positions: {dup} given twice")
    return v


def side_by_side(cs: Sequence[str], xs: Sequence[str]) -> str:
    """Two tokenizations position by position, differing positions marked ``<-`` (a table of lines)."""
    lines = [f"{'pos':>4}  {'clean':<22} {'corrupted':<22}"]
    for p in range(max(len(cs), len(xs))):
        a = repr(cs[p]) if p < len(cs) else "-"
        b = repr(xs[p]) if p < len(xs) else "-"
        mark = "" if p < len(cs) and p < len(xs) and cs[p] == xs[p] else "  <-"
        lines.append(f"{p:>4}  {a:<22} {b:<22}{mark}")
    return "\n".join(lines)


def pair_ids(model: HookedModel, clean: Sequence[str], corrupted: Sequence[str], field: str = "pairs"
             ) -> list[tuple[list[int], list[int]]]:
    """Tokenize each (clean, corrupted) pair and require equal lengths (position-wise patching).

    Returns:
        ``[(clean_ids, corrupted_ids), ...]`` (BOS included per the model spec).

    Raises:
        TokenizationError: a pair tokenizes to different lengths; the message shows both
            tokenizations side by side, position by position, and how to fix it.
    """
    out = []
    for i, (c, x) in enumerate(zip(clean, corrupted)):
        ci, xi = encode(model, c), encode(model, x)
        if len(ci) != len(xi):
            raise TokenizationError(
                f"{field}[{i}]: clean and corrupted prompts must tokenize to the same length for "
                f"position-wise patching, but clean {c!r} is {len(ci)} tokens and corrupted {x!r} is "
                f"{len(xi)} tokens:\n" + side_by_side(str_tokens(model, ci), str_tokens(model, xi))
                + "\nReword one prompt (e.g. pick a corrupted "
                "word that is as many tokens as the clean one) so both have the same number of tokens."
            )
        out.append((ci, xi))
    return out


def _token_ids(model: HookedModel, pairs: Sequence[PromptPair], foil_required: bool) -> tuple[_Ids, _Ids | None]:
    """Per pair the target ids and (when every pair has them) the foil ids."""
    tids, fids = [], []
    for i, p in enumerate(pairs):
        many_t, many_f = len(p.targets) > 1, len(p.foils) > 1
        t = [single_token_id(model, x, field=f"pairs[{i}].target" + (f"[{j}]" if many_t else ""))
             for j, x in enumerate(p.targets)]
        f = [single_token_id(model, x, field=f"pairs[{i}].foil" + (f"[{j}]" if many_f else ""))
             for j, x in enumerate(p.foils)]
        if f and len(f) != len(t):
            raise PatchingError(f"pairs[{i}]: target has {len(t)} tokens but foil has {len(f)}; give one foil "
                                "token per target (logit_diff pairs them up)")
        if foil_required and not f:
            raise PatchingError(f"pairs[{i}].foil: the logit_diff metric needs a foil token (e.g. ' Rome'); "
                                "add it or drop logit_diff from metrics")
        tids.append(t)
        fids.append(f)
    if len({len(t) for t in tids}) > 1:
        raise PatchingError("pairs[*].target: every pair needs the same number of target tokens")
    return tids, (fids if all(fids) else None)


def _pair_rows(model: HookedModel, pairs: list[PromptPair], field: str, source: str, foil_required: bool
               ) -> tuple[PreparedDataset, _Ids, _Ids | None]:
    """The pairs as prepared rows (``prompt`` = ``clean``), each prompt tokenized once, with the
    pairs' own errors (side-by-side tokenizations, ``pairs[i].target``)."""
    tids, fids = _token_ids(model, pairs, foil_required)
    ids = pair_ids(model, [p.clean for p in pairs], [p.corrupted for p in pairs], field=field)
    n_bos = len(encode(model, ""))  # 1 when the model spec prepends a BOS
    examples = []
    for i, (p, (c, x)) in enumerate(zip(pairs, ids)):
        check_length(model, c, f"{field}[{i}]", p.clean)
        one = len(p.targets) == 1 and len(p.foils) <= 1
        row = Row(prompt=p.clean, corrupted=p.corrupted, target=p.targets[0] if one else None,
                  foil=(p.foils[0] if p.foils else None) if one else None,
                  targets=() if one else tuple(p.targets), foils=() if one else tuple(p.foils))
        examples.append(Example(i, row, tuple(c), tids[i][0] if one else None,
                                fids[i][0] if one and fids is not None else None, {}, tuple(x), n_bos))
    return PreparedDataset(tuple(examples), source), tids, fids


def _dataset_rows(model: HookedModel, dataset: DatasetSpec, foil_required: bool
                  ) -> tuple[PreparedDataset, _Ids, _Ids | None]:
    """The dataset's rows, each with its own target (required) and foil (required by
    ``logit_diff``; used by every metric only when every row has one)."""
    data = dataset.prepare(model, "dataset")
    tids, fids = [], []
    for e in data.examples:
        if e.target_id is None:
            raise DatasetError(f"dataset row {e.row_id} ({e.prompt[:60]!r}): no target; activation patching "
                               "scores each row's own target (and foil): add target to every row")
        if e.foil_id is None and foil_required:
            raise DatasetError(f"dataset row {e.row_id} ({e.prompt[:60]!r}): no foil; the logit_diff metric "
                               "needs each row's foil (e.g. the corrupted prompt's answer): add foil to every "
                               "row or drop logit_diff from metrics")
        tids.append([e.target_id])
        if e.foil_id is not None:
            fids.append([e.foil_id])
    return data, tids, (fids if len(fids) == len(data.examples) else None)


def _corrupted(data: PreparedDataset, needed_by: Optional[str]) -> bool:
    """Whether the rows have corrupted prompts (all or none).

    Raises:
        DatasetError: a row without one when ``needed_by`` says why each needs one, or some rows
            with and some without; naming the row.
    """
    missing = [e for e in data.examples if e.corrupted_ids is None]
    if not missing:
        return True
    e = missing[0]
    where = f"dataset row {e.row_id} ({e.prompt[:60]!r})"
    if needed_by is not None:
        raise DatasetError(f"{where}: no corrupted prompt; {needed_by}")
    if len(missing) < len(data):
        raise DatasetError(f"{where}: no corrupted prompt, while other rows have one; give every row a "
                           "corrupted prompt (normalised effects) or none (an ablation-only run scored by delta)")
    return False


def _resolve_positions(model: HookedModel, data: PreparedDataset, positions: Optional[Sequence[Union[int, str]]]
                       ) -> tuple[_Ids | None, list[str]]:
    """Per row the token index (BOS counted) of each of ``positions``, and their names.

    Raises:
        DatasetError: a named position a row does not have (naming the row).
        TokenizationError: an index or text not in a row's prompt.
    """
    if not positions:
        return None, []
    cols, names = [], []
    for i, spec in enumerate(positions):
        pos: Position = parse_position(spec, POSITION_SPEC_FORMS, f"positions[{i}]")
        names.append(str(pos))
        if pos.kind == "name":
            cols.append(data.position(str(pos.text), f"positions[{i}]"))
        else:
            cols.append([pos.resolve(model, e.prompt, e.ids, f"positions[{i}] (row {e.row_id})")[0]
                         for e in data.examples])
    return [list(r) for r in zip(*cols)], names


def _auto_positions(data: PreparedDataset) -> tuple[_Ids | None, list[str], Optional[str]]:
    """Without ``positions``: the positions of position-indexed sites when a per-position mean
    over the rows would mix token roles, ``(per row indices, names, why)``; ``(None, [], None)``
    when it would not (every row the same length, named positions at the same index in each).

    Rows of different lengths align only by position from the end, and rows whose named
    positions sit at different indices (another template, e.g. IOI's ABBA and BABA) do not align
    by index either: at one position, different rows hold tokens of different roles. Such rows
    are patched at the dataset's named positions (those every row has), each row at its own
    index, and averaged by name.

    Raises:
        PatchingError: such rows without named positions (nothing to align them by).
    """
    ex = data.examples
    lengths = sorted({len(e.ids) for e in ex})
    names = data.position_names
    moved = [n for n in names if len({e.positions[n] for e in ex}) > 1]
    if len(lengths) == 1 and not moved:
        return None, [], None
    why = (f"the rows have different token lengths ({', '.join(map(str, lengths[:6]))}"
           f"{', ...' if len(lengths) > 6 else ''})" if len(lengths) > 1 else
           f"the named position(s) {moved} sit at different token indices in different rows (different templates)")
    if not names:
        raise PatchingError(
            f"positions: {why}, so a per-position mean over the rows would average tokens of different roles "
            "(a position counted from the end is another token in each template); give positions: either "
            "named positions of the dataset (add positions: {S2: ..., END: -1} to each row, then positions: "
            "[S2, END]) or indices counted from the end that hold the same role in every row (positions: [-1]); "
            "or patch whole-layer sites (resid_pre_layer, head_out, mlp_out_layer) instead")
    return ([[e.positions[n] for n in names] for e in ex], list(names),
            f"{why}: patched at the dataset's named positions {list(names)} (each row at its own index, "
            "averaged by name), not at every index; give positions: to choose others")
