"""Dataset rows and their preparation against a model: token ids, per-row target/foil ids, named
positions resolved per row.

A row (:class:`Row`) is what a user writes: ``prompt``, optional ``target`` / ``foil`` (single
tokens), optional named ``positions``, optional ``corrupted`` prompt (patching pairs), ``group`` and
any extra columns. :func:`prepare_rows` turns rows into a :class:`PreparedDataset` of
:class:`Example` s for one model: each prompt tokenized once (BOS as the model spec says), each
target/foil checked to be one token *with the row named in the error*, each named position resolved
to an index into that row's own tokens (BOS counted). :meth:`PreparedDataset.padded_index` maps a
named position into a padded batch (left or right padding), so no kind counts from the padded
start.

Position values in a row (``positions: {IO: " Mary", S1: {text: " John", occurrence: 0}, END: -1}``):

* an ``int``: an index into the prompt's **text tokens** (BOS *not* counted, so the same row works
  with BOS on and off); negative counts from the end (``-1`` = the last token);
* a ``str``: the token holding the last character of the **last** occurrence of that text;
* ``{text, occurrence}``: the same for occurrence ``occurrence`` (0 = first, -1 = last).
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import pandas as pd
import torch
from jaxtyping import Int
from pydantic import ConfigDict, Field, field_validator

from ..core.errors import DatasetError, TokenizationError
from ..core.strict import StrictModel
from ..model.info import HookedModel
from ..tokens import (
    Batch,
    check_length,
    encode_prompts,
    prepend_bos_of,
    single_token_id,
    str_tokens,
    text_ids,
    token_index_of_substring,
    with_bos,
)
from .targets import check_answer_tokens, per_row_values, row_targets

__all__ = ["At", "PositionValue", "Row", "Example", "Rows", "PreparedDataset", "prepare_rows", "rows_from_prompts", "target_rows",
           "RESERVED_COLUMNS", "own_row_ids"]

#: Row fields with a meaning; every other key of a row is an extra column, kept as it is.
RESERVED_COLUMNS = ("row_id", "prompt", "target", "foil", "positions", "corrupted", "group")


class At(StrictModel):
    """A position given as text: the token holding the last character of occurrence ``occurrence``
    of ``text`` in the prompt.

    Fields:
        text: the text to find (``" John"``; leading space included when the token has one).
        occurrence: which occurrence: 0 = first, 1 = second, -1 = last (default).
    """

    text: str = Field(min_length=1)
    occurrence: int = -1


PositionValue = Union[int, str, At]


def _json_cell(v: Any) -> Any:
    """A CSV cell holding JSON (``{"IO": 2}``) decoded; anything else as it is."""
    if isinstance(v, str) and v.strip()[:1] in ("{", "["):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


class Row(StrictModel):
    """One dataset row as written (inline YAML, a file record or a generator's output).

    Fields:
        prompt: the text the model reads.
        target: the row's answer token (one token, leading space included), optional.
        foil: the contrasting token (e.g. the corrupted prompt's answer), optional.
        positions: named positions (see the module docstring for the value forms).
        corrupted: the corrupted counterpart of ``prompt`` (activation patching), optional.
        group: a group label (for summaries by group and for grouped splits), optional.
        targets / foils: a row scored on **several** answer tokens (activation patching pairs with a
            target list: the metric sums over them), in order; then ``target``/``foil`` are None.
            Empty (default) for a row with one answer. Per-row tables show them as a JSON list in
            the ``targets`` / ``foils`` columns.

    Any other key is an extra column, kept in :attr:`extra` and in every per-row table.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    prompt: str = Field(min_length=1)
    target: Optional[str] = None
    foil: Optional[str] = None
    positions: dict[str, PositionValue] = Field(default_factory=dict)
    corrupted: Optional[str] = None
    group: Optional[str] = None
    targets: tuple[str, ...] = ()
    foils: tuple[str, ...] = ()

    retired = {"answer": "target", "wrong": "foil", "clean": "prompt", "text": "prompt"}

    @field_validator("positions", mode="before")
    @classmethod
    def _positions(cls, v):
        v = _json_cell(v)
        if v is None:
            return {}
        if isinstance(v, dict):
            for name in v:
                if not str(name).isidentifier():
                    raise ValueError(f"position name {name!r} must be an identifier (letters, digits, _), e.g. IO, "
                                     "S1, END: kinds refer to it by name (position: END)")
        return v

    @field_validator("targets", "foils", mode="before")
    @classmethod
    def _answers(cls, v):
        return _json_cell(v)

    @field_validator("group", mode="before")
    @classmethod
    def _group_text(cls, v):
        return None if v is None else str(v)

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @property
    def target_texts(self) -> tuple[Optional[str], ...]:
        """The row's answer tokens: :attr:`targets` when it has several, else ``(target,)``."""
        return self.targets if self.targets else (self.target,)

    @property
    def foil_texts(self) -> tuple[Optional[str], ...]:
        """The row's foil tokens: :attr:`foils` when it has several targets, else ``(foil,)``."""
        return self.foils if self.targets else (self.foil,)


@dataclass(frozen=True)
class Example:
    """One prepared row: the row as given plus what the model's tokenizer makes of it.

    Attributes:
        row_id: the row's id: its own ``row_id`` column when the rows have one (a file's ids are
            kept, never renumbered), else its index in the dataset (after generators); filters keep
            the ids of the rows they keep.
        ids: the prompt's token ids (BOS included when the model spec prepends one).
        target_id / foil_id: token ids of ``row.target`` / ``row.foil`` (None when not given).
        positions: each named position as an index into ``ids`` (BOS counted), non-negative.
        corrupted_ids: the corrupted prompt's ids (None when not given).
        n_bos: 1 when ``ids`` starts with a prepended BOS.
    """

    row_id: int
    row: Row
    ids: tuple[int, ...]
    target_id: Optional[int] = None
    foil_id: Optional[int] = None
    positions: Mapping[str, int] = field(default_factory=dict)
    corrupted_ids: Optional[tuple[int, ...]] = None
    #: 1 when ``ids`` starts with a prepended BOS, else 0.
    n_bos: int = 0

    @property
    def prompt(self) -> str:
        return self.row.prompt



@dataclass(frozen=True)
class Rows:
    """Rows prepared for one model (see :func:`prepare_rows`): what every kind and engine takes.

    Made by :meth:`Rows.from_prompts` (the notebook door), :meth:`tracekit.dataset.DatasetSpec.prepare`
    (a dataset) or :func:`prepare_rows` (:class:`Row` s). ``PreparedDataset`` is its former name.

    Attributes:
        examples: the prepared rows, in dataset order.
        source: where the rows came from (``rows``, a file path, ``generator ioi (seed 0)``).
        dropped: why rows were dropped and how many (generators: names or answers that are not one
            token for this model; ``filter: correct`` / ``filter: top1``: rows the model gets wrong).
        filter_report: what the dataset's ``filter`` did (None: no filter ran): ``filter``, ``rule``,
            ``rows_in``, ``kept``, ``dropped`` and ``dropped_rows`` (per dropped row its
            ``row_id``, ``prompt``, ``target`` and what the model gave instead); see
            :func:`tracekit.dataset.spec.filter_rows`. Kinds' summaries carry it as
            ``dataset_filter``.
    """

    examples: tuple[Example, ...]
    source: str = "rows"
    dropped: Mapping[str, int] = field(default_factory=dict)
    filter_report: Optional[Mapping[str, Any]] = None

    @classmethod
    def from_prompts(cls, model: HookedModel, prompts: Union[str, Sequence[str]],
                     target: Union[str, Sequence[str], None] = None, foil: Union[str, Sequence[str], None] = None,
                     *, prepend_bos: Optional[bool] = None) -> "Rows":
        """One row per prompt, prepared for ``model``: the notebook door.

        ``target`` / ``foil``: a token string is every prompt's answer (leading space included); a
        list is one per prompt; None: no target. Each prompt is tokenized once (BOS as the model
        spec says, or ``prepend_bos``); target and foil ids are resolved once.

        >>> rows = Rows.from_prompts(model, ["The capital of France is"], target=" Paris")
        >>> len(rows), rows.has_targets, rows.has_foils
        (1, True, False)

        Raises:
            TokenizationError: a target/foil that is not exactly one token (naming ``target`` /
                ``target[i]``), a prompt longer than the model's context.
            DatasetError: a list of another length than the prompts, a foil equal to its target, an
                empty prompt (naming ``prompts[i]``).
        """
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        check_answer_tokens(model, target, foil)
        return prepare_rows(model, rows_from_prompts(texts, target, foil), where="prompts", source="prompts",
                            prepend_bos=prepend_bos)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.examples]

    @property
    def ids(self) -> list[tuple[int, ...]]:
        return [e.ids for e in self.examples]

    @property
    def has_targets(self) -> bool:
        return any(e.target_id is not None for e in self.examples)

    @property
    def has_foils(self) -> bool:
        return any(e.foil_id is not None for e in self.examples)

    @property
    def position_names(self) -> list[str]:
        """Names of the positions every row has (in first-row order)."""
        if not self.examples:
            return []
        names = list(self.examples[0].positions)
        return [n for n in names if all(n in e.positions for e in self.examples)]

    def target_ids(self) -> Int[torch.Tensor, " row"]:
        """``[row]`` target ids (-1 where a row has none)."""
        return torch.tensor([-1 if e.target_id is None else e.target_id for e in self.examples], dtype=torch.long)

    def foil_ids(self) -> Int[torch.Tensor, " row"]:
        """``[row]`` foil ids (-1 where a row has none)."""
        return torch.tensor([-1 if e.foil_id is None else e.foil_id for e in self.examples], dtype=torch.long)

    def position(self, name: str, field: str = "position") -> list[int]:
        """Each row's index (into its own ids, BOS counted) of the named position.

        Raises:
            DatasetError: a row without that name (the message lists the names the rows have).
        """
        out = []
        for e in self.examples:
            if name not in e.positions:
                raise DatasetError(f"{field}: {name!r} is not a named position of row {e.row_id} (its positions: "
                                   f"{sorted(e.positions) or 'none'}); name one of the dataset's positions or use "
                                   "last / an index")
            out.append(e.positions[name])
        return out

    def padded_index(self, batch: Batch, rows: Sequence[int], name: str, field: str = "position"
                     ) -> Int[torch.Tensor, " batch"]:
        """``[batch]`` index of the named position in a padded batch of the examples ``rows``
        (left padding shifts each row by its own pad count; right padding by none).

        Raises:
            DatasetError: a row without that name.
        """
        sub = Rows(tuple(self.examples[i] for i in rows))
        at = sub.position(name, field)
        return torch.tensor([o + a for o, a in zip(batch.offsets, at)], dtype=torch.long,
                            device=batch.tokens.device)

    def frame(self) -> pd.DataFrame:
        """One row per example: ``row_id``, ``prompt``, ``target``, ``foil``, ``corrupted``,
        ``group``, ``pos_<NAME>`` (index into the row's tokens, BOS counted) and extra columns."""
        recs = []
        for e in self.examples:
            r = e.row
            rec: dict[str, Any] = {"row_id": e.row_id, "prompt": r.prompt, "target": r.target, "foil": r.foil,
                                   "corrupted": r.corrupted, "group": r.group}
            rec.update({f"pos_{k}": v for k, v in e.positions.items()})
            if r.targets:  # several answers: a JSON list per cell, as the tables always showed them
                rec.update({"targets": json.dumps(list(r.targets)), "foils": json.dumps(list(r.foils))})
            rec.update({k: v for k, v in r.extra.items() if k not in rec})
            recs.append(rec)
        return pd.DataFrame(recs)

    def select(self, keep: Sequence[int], reason: Optional[str] = None) -> "Rows":
        """The examples at indices ``keep`` (their row ids unchanged); the rest counted under
        ``reason`` in :attr:`dropped`."""
        kept = tuple(self.examples[i] for i in keep)
        dropped = dict(self.dropped)
        if reason is not None:
            dropped[reason] = dropped.get(reason, 0) + len(self.examples) - len(kept)
        return Rows(kept, self.source, dropped, self.filter_report)

    def meta(self) -> dict[str, Any]:
        """What a kind records about its rows (``meta.json``'s ``dataset``): ``source``,
        ``dropped``, ``n_rows`` and, when a filter ran, ``filter`` (:attr:`filter_report`)."""
        out: dict[str, Any] = {"source": self.source, "dropped": dict(self.dropped), "n_rows": len(self)}
        if self.filter_report is not None:
            out["filter"] = dict(self.filter_report)
        return out


def _resolve_position(model: HookedModel, ex_ids: Sequence[int], n_bos: int, prompt: str, value: PositionValue,
                      where: str) -> int:
    n_text = len(ex_ids) - n_bos
    if isinstance(value, bool):
        raise DatasetError(f"{where}: {value!r} is not a position (an index, a text, or {{text, occurrence}})")
    if isinstance(value, int):
        if not -n_text <= value < n_text:
            raise DatasetError(f"{where}: index {value} is out of range for a prompt of {n_text} text tokens "
                               f"{str_tokens(model, list(ex_ids[n_bos:]))} (indices count the text's tokens, BOS "
                               "not counted; -1 = the last)")
        return n_bos + value % n_text
    text, occ = (value, -1) if isinstance(value, str) else (value.text, value.occurrence)
    try:
        return token_index_of_substring(model, prompt, text, ex_ids, field=where, occurrence=occ)
    except TokenizationError as e:
        raise DatasetError(str(e)) from None


def prepare_rows(model: HookedModel, rows: Sequence[Row], where: str = "dataset.rows", source: str = "rows",
                 dropped: Optional[Mapping[str, int]] = None, row_ids: Optional[Sequence[int]] = None,
                 prepend_bos: Optional[bool] = None) -> Rows:
    """Tokenize every row once and resolve its target, foil and named positions for ``model``.

    Args:
        model: a loaded model or a :class:`tracekit.model.ModelInfo` (tokenizer and config only).
        rows: the rows.
        where: how errors name a row: ``f"{where}[{i}].target"``.
        source: recorded on the result (see :class:`PreparedDataset`).
        dropped: recorded on the result (see :class:`PreparedDataset`).
        row_ids: the rows' ids (default: the rows' own ``row_id`` column when they have one, see
            :func:`own_row_ids`, else ``0..n-1``).
        prepend_bos: whether each prompt starts with a BOS (default: the model spec's, read once).

    Returns:
        The prepared :class:`Rows`.

    Raises:
        DatasetError: no rows, a ``row_id`` column that is not unique whole numbers >= 0, a target or foil that is not one token (with its tokenization), target
            equal to foil, a position that does not resolve, a corrupted prompt of another length; each
            names the row (``dataset.rows[3].target``).
        TokenizationError: a prompt longer than the model's context.
    """
    if not rows:
        raise DatasetError(f"{where}: the dataset has no rows")
    if row_ids is None:
        row_ids = own_row_ids(rows, where)
    ids_of = list(row_ids) if row_ids is not None else list(range(len(rows)))
    bos = prepend_bos_of(model) if prepend_bos is None else bool(prepend_bos)  # the spec read once
    n_bos = int(bos)  # exactly one BOS when prepended
    out = []
    for i, (rid, r) in enumerate(zip(ids_of, rows)):
        at = f"{where}[{i}]"
        ids = tuple(with_bos(model, text_ids(model, r.prompt), bos))  # each prompt tokenized once
        if len(ids) == n_bos:
            raise DatasetError(f"{at}.prompt: {r.prompt!r} tokenizes to nothing; give a non-empty prompt")
        check_length(model, ids, f"{at}.prompt", r.prompt)
        tid = fid = None
        try:
            if r.target is not None:
                tid = single_token_id(model, r.target, field=f"{at}.target")
            if r.foil is not None:
                fid = single_token_id(model, r.foil, field=f"{at}.foil")
        except TokenizationError as e:
            raise DatasetError(str(e)) from None
        if tid is not None and tid == fid:
            raise DatasetError(f"{at}: target and foil are the same token {r.target!r}; the logit difference would "
                               "be 0; set foil to the contrasting answer")
        pos = {name: _resolve_position(model, ids, n_bos, r.prompt, v, f"{at}.positions.{name}")
               for name, v in r.positions.items()}
        cids = None
        if r.corrupted is not None:
            cids = tuple(with_bos(model, text_ids(model, r.corrupted), bos))
            if len(cids) != len(ids):
                raise DatasetError(f"{at}.corrupted: {len(cids)} tokens, the prompt {len(ids)}; a corrupted prompt "
                                   f"must tokenize to the same length (prompt {str_tokens(model, list(ids))}, "
                                   f"corrupted {str_tokens(model, list(cids))})")
        out.append(Example(rid, r, ids, tid, fid, pos, cids, n_bos))
    return Rows(tuple(out), source, dict(dropped or {}))


def _as_row_id(v: Any) -> Optional[int]:
    """``v`` as a row id (a whole number >= 0: an int, an integral float, or its decimal text as a
    CSV cell holds it), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, numbers.Integral):
        return int(v) if int(v) >= 0 else None
    if isinstance(v, numbers.Real) and float(v).is_integer():
        return int(float(v)) if float(v) >= 0 else None
    if isinstance(v, str) and v.strip().isdecimal() and v.strip().isascii():
        return int(v.strip())
    return None


def own_row_ids(rows: Sequence[Row], where: str = "dataset.rows") -> Optional[list[int]]:
    """The rows' own ids when they carry a ``row_id`` column (a file's, or inline rows'), else None.

    A dataset's own ids are kept, never renumbered: every per-row table's ``row_id`` is then the
    id the file gives the row.

    Raises:
        DatasetError: some rows with a ``row_id`` and some without, a ``row_id`` that is not a whole
            number >= 0, or one given to two rows; each names the row.
    """
    given = [r.extra.get("row_id") for r in rows]
    has = [v is not None for v in given]
    if not any(has):
        return None
    ids: list[int] = []
    seen: dict[int, int] = {}
    for i, v in enumerate(given):
        at = f"{where}[{i}].row_id"
        if v is None:
            other = has.index(True)
            raise DatasetError(f"{at}: this row has none but row {other} has one; give every row a row_id (unique "
                               "whole numbers >= 0) or drop the column (rows are then numbered 0, 1, ...)")
        rid = _as_row_id(v)
        if rid is None:
            raise DatasetError(f"{at}: {str(v)!r} is not a row id (a whole number >= 0); fix it or drop the row_id "
                               "column (rows are then numbered 0, 1, ...)")
        if rid in seen:
            raise DatasetError(f"{at}: {rid} is also row {seen[rid]}'s row_id; row ids must be unique (every "
                               "per-row table is keyed by them)")
        seen[rid] = i
        ids.append(rid)
    return ids


def rows_from_prompts(prompts: Sequence[str], target: Union[str, Sequence[str], None] = None,
                      foil: Union[str, Sequence[str], None] = None, field: str = "target") -> list[Row]:
    """Rows from a kind's ``prompts`` / ``target`` / ``foil`` fields: a single string is every
    row's answer; a list is **one answer per prompt** (its length must equal the number of prompts).
    Tokens followed on every row are a kind's ``track`` field, never a ``target`` list.

    Raises:
        DatasetError: a ``target``/``foil`` list whose length differs from the number of prompts (the
            message names ``track``).
    """
    n = len(prompts)
    ts = per_row_values(target, n, field)
    fs = per_row_values(foil, n, "foil")
    return [Row(prompt=p, target=t, foil=f) for p, t, f in zip(prompts, ts, fs)]


def target_rows(model: HookedModel, prompts: Sequence[str], target: Union[str, Sequence[str], None],
                foil: Union[str, Sequence[str], None] = None, prepend_bos: Optional[bool] = None) -> Rows:
    """Prompts whose ``target`` (required) and ``foil`` (a string: every prompt's; a list: one per
    prompt) are scored, as prepared rows: each prompt tokenized once (with ``prepend_bos``: default
    the model spec's), the errors naming the kind's fields (``target[i]``, ``prompts[i]``); the
    rows of the unit kinds (direct logit attribution, neurons, SAE features, steering).

    Raises:
        TokenizationError: a target/foil that is not one token (naming ``target`` / ``target[i]``), an
            empty or too long prompt.
        AttributionError: no target, a list of the wrong length, a foil equal to its target.
    """
    tgts = row_targets(model, len(prompts), target, foil)
    bos = prepend_bos_of(model) if prepend_bos is None else bool(prepend_bos)  # the spec read once
    ids = encode_prompts(model, prompts, prepend_bos=bos)
    n_bos = int(bos)  # 1 when a BOS is prepended
    rows = rows_from_prompts(list(prompts), target, foil)
    return Rows(tuple(Example(i, r, seq, t.target_id, t.foil_id, {}, None, n_bos)
                      for i, (r, seq, t) in enumerate(zip(rows, ids, tgts))), "prompts")


#: The former name of :class:`Rows` (kept: notebooks and other modules import it).
PreparedDataset = Rows
