"""The ``dataset:`` config block every kind takes, and its filters (``correct``, ``top1``).

Exactly one source::

    dataset: {rows: [{prompt: ..., target: ..., foil: ..., positions: {END: -1}}]}   # inline
    dataset: {path: ioi.jsonl, columns: {prompt: text}}       # JSONL/JSON/CSV/TSV/Parquet/datasets folder
    dataset: {generator: {name: ioi, n: 64, seed: 0, corrupt: swap_s2}, filter: correct}
    dataset: {generator: {name: capitals, corrupt: country}, filter: top1}

:meth:`DatasetSpec.prepare` reads or generates the rows, prepares them for the model
(:func:`tracekit.dataset.rows.prepare_rows`) and, with a ``filter`` and a model that can run,
keeps only the rows the model gets right (:func:`filter_rows`): ``correct`` (the target beats the
row's foil: right for IOI, whose foil is the one alternative) or ``top1`` (the target is the
model's top-1 next token: "the rows the model knows", right for factual recall, whose foil is one
of many wrong answers). What the filter kept and dropped, row by row, is the rows'
:attr:`~tracekit.dataset.rows.Rows.filter_report`, which every kind's summary carries as
``dataset_filter``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import torch
from pydantic import Field, field_validator, model_validator

from ..core.errors import DatasetError
from ..core.strict import StrictModel
from ..model.info import HookedModel
from ..tokens import pad_ids, str_tokens
from .generators import CORRUPT, GENERATORS, GeneratorError, generate
from .read import read_records
from .rows import RESERVED_COLUMNS, Row, Rows, _json_cell, prepare_rows, rows_from_prompts

__all__ = ["GeneratorSpec", "DatasetSpec", "filter_correct", "filter_rows", "filter_line", "FILTERS", "kind_rows"]

#: ``filter`` values and what each keeps.
FILTERS = {
    "none": "every row",
    "correct": "rows the model gets right: logit(target) - logit(foil) > 0 at the last token where the row has a "
               "foil, else the target is the model's top-1 next token",
    "top1": "rows the model knows: the target is the model's top-1 next token at the last token (of the clean "
            "prompt), whatever the foil",
}

#: At most this many dropped rows are listed in a filter report (the count is always whole).
MAX_LISTED = 100

#: Generator options and the generators that take them.
_OPTIONS = {"n": ("ioi", "capitals", "induction"), "seed": ("ioi", "capitals", "induction"),
            "corrupt": ("ioi", "capitals"), "names": ("ioi",), "few_shot": ("capitals",), "seq_len": ("induction",)}


class GeneratorSpec(StrictModel):
    """A built-in generator and its options (:mod:`tracekit.dataset.generators`).

    Fields:
        name: ``ioi`` | ``capitals`` | ``induction``.
        n: rows (ioi default 64, induction 32, capitals all usable).
        seed: the draw's seed.
        corrupt: the corrupted counterpart (default: the generator's first below): ioi ``swap_s2``,
            ``abc`` or ``none``; capitals ``country`` (another country of the same token length;
            its capital is the foil) or ``none``.
        names: ioi's name list (default Wang et al.'s).
        few_shot: capitals: prefix the seed article's "The capital of China is Beijing. ".
        seq_len: induction: words per copy (default 10).
    """

    name: Literal["ioi", "capitals", "induction"]
    n: Optional[int] = Field(default=None, ge=1)
    seed: int = 0
    corrupt: Optional[Literal["swap_s2", "abc", "country", "none"]] = None
    names: Optional[list[str]] = None
    few_shot: bool = False
    seq_len: int = Field(default=10, ge=2)

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, v):
        """``generator: ioi`` is ``generator: {name: ioi}``; a config saved before capitals took
        ``corrupt`` lists ioi's old default ``swap_s2`` for every generator: what ran was none."""
        if isinstance(v, str):
            if v not in GENERATORS:
                raise ValueError(f"unknown generator {v!r}; use one of {sorted(GENERATORS)}")
            return {"name": v}
        if isinstance(v, dict) and v.get("name") not in (None, "ioi") and v.get("corrupt") == "swap_s2":
            return {**v, "corrupt": "none" if v.get("name") == "capitals" else None}
        return v

    @model_validator(mode="after")
    def _options_fit(self):
        # an option of another generator at its default is no error: a saved config lists every field
        fields = type(self).model_fields
        bad = [k for k in sorted(self.model_fields_set) if k in _OPTIONS and self.name not in _OPTIONS[k]
               and getattr(self, k) != fields[k].get_default(call_default_factory=True)]
        if bad:
            raise ValueError(f"generator {self.name!r} takes no " + ", ".join(
                f"{k} (an option of {' / '.join(_OPTIONS[k])})" for k in bad))
        takes = CORRUPT.get(self.name, ())
        if self.corrupt is not None and takes and self.corrupt not in takes:
            raise ValueError(f"corrupt: generator {self.name!r} takes {' | '.join(takes)}, not {self.corrupt!r} "
                             f"({' / '.join(g for g, v in CORRUPT.items() if self.corrupt in v)}'s)")
        if self.corrupt is None and takes:  # the generator's default, written out (config.json says what ran)
            object.__setattr__(self, "corrupt", takes[0])
        return self

    def options(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _OPTIONS if self.name in _OPTIONS[k]
                and (k not in ("n", "corrupt") or getattr(self, k) is not None)}


class DatasetSpec(StrictModel):
    """The rows a kind runs on: inline, from a file, or generated; optionally filtered.

    Fields:
        rows: inline rows (:class:`~tracekit.dataset.rows.Row`: ``prompt``, ``target``, ``foil``,
            ``positions``, ``corrupted``, ``group``, extra columns).
        path: a ``.jsonl`` / ``.json`` / ``.csv`` / ``.tsv`` / ``.parquet`` file or a folder saved by
            ``datasets``' ``save_to_disk``.
        columns: for ``path``: row field -> the file's column (``{prompt: text, target: answer}``).
        generator: a built-in generator (``ioi``, ``capitals``, ``induction``, or ``{name, ...}``).
        filter: ``none`` (default), ``correct`` or ``top1`` (see :data:`FILTERS`); what it dropped
            is in every kind's summary (``dataset_filter``).
        limit: keep the first ``limit`` rows (after the filter).
    """

    rows: Optional[list[Row]] = None
    path: Optional[str] = None
    columns: dict[str, str] = Field(default_factory=dict)
    generator: Optional[GeneratorSpec] = None
    filter: Literal["none", "correct", "top1"] = "none"
    limit: Optional[int] = Field(default=None, ge=1)

    @field_validator("rows", mode="before")
    @classmethod
    def _nonempty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("rows is empty; give at least one row ({prompt: ..., target: ...})")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("rows", "path", "generator") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of rows, path, generator (got {given or 'none'})")
        if self.columns and self.path is None:
            raise ValueError("columns maps a file's columns; it needs path")
        bad = [k for k in self.columns if k not in RESERVED_COLUMNS[1:]]
        if bad:
            raise ValueError(f"columns: {bad} are not row fields; map {', '.join(RESERVED_COLUMNS[1:])}")
        return self

    def source(self) -> str:
        if self.rows is not None:
            return "rows"
        if self.path is not None:
            return str(self.path)
        g = self.generator
        assert g is not None
        return f"generator {g.name} (seed {g.seed})"

    def load_rows(self, model: HookedModel, field: str = "dataset") -> tuple[list[Row], dict[str, int], str]:
        """``(rows, dropped, where)``: the rows as given, generated or read (``where`` names a row
        in errors)."""
        if self.rows is not None:
            return list(self.rows), {}, f"{field}.rows"
        if self.generator is not None:
            try:
                rows, dropped = generate(model, self.generator.name, **self.generator.options())
            except GeneratorError as e:
                raise DatasetError(f"{field}.generator.{e.option}: {e}") from None
            except ValueError as e:
                raise DatasetError(f"{field}.generator: {e}") from None
            return rows, dropped, f"{field} (generator {self.generator.name}) row"
        assert self.path is not None
        recs, first = read_records(self.path, f"{field}.path")
        name = Path(self.path).name
        rows = []
        for i, r in enumerate(recs):
            rec = {k: _json_cell(v) for k, v in r.items()}
            for fld, col in self.columns.items():
                if col not in rec:
                    raise DatasetError(f"{field}.columns.{fld}: {name} has no column {col!r} (its columns: "
                                       f"{list(r)})")
                rec[fld] = rec.pop(col)
            try:
                rows.append(Row.model_validate({k: v for k, v in rec.items() if v is not None}))
            except ValueError as e:
                line = f" (line {i + first})" if first else ""
                raise DatasetError(f"{field}.path: row {i}{line} of {name}: {e}") from None
        if not rows:
            raise DatasetError(f"{field}.path: {name} has no rows")
        return rows, {}, f"{field}.path row"

    def prepare(self, model: HookedModel, field: str = "dataset", batch_size: int = 16) -> Rows:
        """The rows prepared for ``model``; a ``filter`` runs the model when it can (a
        :class:`tracekit.model.ModelInfo` has no weights: there the filter is left to the run).

        Raises:
            DatasetError: see :func:`tracekit.dataset.rows.prepare_rows`, plus a filter that keeps
                no row or needs targets the rows do not have.
        """
        rows, dropped, where = self.load_rows(model, field)
        data = prepare_rows(model, rows, where, self.source(), dropped)
        if self.filter != "none" and _can_run(model):
            data = filter_rows(model, data, self.filter, batch_size=batch_size, field=f"{field}.filter")
        elif self.filter != "none" and not data.has_targets:
            raise DatasetError(f"{field}.filter: {self.filter!r} needs each row's target")
        if self.limit is not None and len(data) > self.limit:
            data = data.select(range(self.limit), reason="beyond limit")
        return data


def _can_run(model: HookedModel) -> bool:
    from ..model.info import ModelInfo

    return not isinstance(model, ModelInfo)


def filter_correct(model: HookedModel, data: Rows, batch_size: int = 16, field: str = "dataset.filter") -> Rows:
    """``filter: correct``: :func:`filter_rows` with ``how="correct"``."""
    return filter_rows(model, data, "correct", batch_size=batch_size, field=field)


@torch.no_grad()
def filter_rows(model: HookedModel, data: Rows, how: str = "correct", batch_size: int = 16,
                field: str = "dataset.filter") -> Rows:
    """The rows the model gets right under filter ``how`` (see :data:`FILTERS`), one batched
    forward pass per ``batch_size`` rows of equal length (no padding), read at each row's last
    token of its (clean) prompt.

    * ``correct``: logit(target) - logit(foil) > 0 where the row has a foil, else top-1. With a
      random foil (``capitals``) this only says the target beats one wrong answer.
    * ``top1``: the target is the argmax of the next-token logits (the rows the model knows; a tie
      for the top counts as top-1 only when the target wins ``argmax``'s first-index rule).

    The others are counted in ``dropped`` under ``"filter: <how>"``, and the result's
    :attr:`~tracekit.dataset.rows.Rows.filter_report` says which filter ran, on how many rows, how
    many it kept and dropped and, per dropped row (the first :data:`MAX_LISTED`), its ``row_id``,
    ``prompt``, ``target``, the model's ``top1`` token and ``logit_diff`` (logit(target) -
    logit(foil), None without a foil).

    Args:
        model: a loaded model (its weights run).
        data: the prepared rows, each with one target.
        how: ``correct`` | ``top1``.

    Raises:
        DatasetError: an unknown ``how``, a row without a target, or no row left (naming ``field``).
    """
    if how not in FILTERS or how == "none":
        raise DatasetError(f"{field}: unknown filter {how!r}; use one of {sorted(FILTERS)}")
    missing = [e.row_id for e in data.examples if e.target_id is None]
    if missing:
        raise DatasetError(f"{field}: {how!r} needs each row's target; rows {missing[:5]} have none")
    keep: list[int] = []
    lost: dict[int, dict[str, Any]] = {}
    by_len: dict[int, list[int]] = {}
    for i, e in enumerate(data.examples):
        by_len.setdefault(len(e.ids), []).append(i)
    for members in by_len.values():  # equal lengths: no padding, exact on every architecture
        for s in range(0, len(members), batch_size):
            idx = members[s:s + batch_size]
            batch = pad_ids(model, [data.examples[i].ids for i in idx], "right")
            last = model(batch.tokens)[:, -1].float()
            for j, i in enumerate(idx):
                e, lg = data.examples[i], last[j]
                top = int(lg.argmax())
                ld = None if e.foil_id is None else float(lg[e.target_id] - lg[e.foil_id])
                ok = top == e.target_id if how == "top1" or ld is None else ld > 0
                if ok:
                    keep.append(i)
                else:
                    lost[i] = {"row_id": e.row_id, "prompt": e.prompt, "target": e.row.target,
                               "top1": str_tokens(model, [top])[0], "logit_diff": ld}
    keep.sort()
    report = {"filter": how, "rule": FILTERS[how], "rows_in": len(data), "kept": len(keep),
              "dropped": len(data) - len(keep), "dropped_rows": [lost[i] for i in sorted(lost)][:MAX_LISTED]}
    if not keep:
        raise DatasetError(f"{field}: the model gets none of the {len(data)} rows right under filter: {how}; nothing "
                           "is left to study (check targets, or set filter: none)")
    return replace(data.select(keep, reason=f"filter: {how}"), filter_report=report)


def filter_line(report: Mapping[str, Any], shown: int = 8) -> str:
    """One line saying what a dataset filter did (``report``: a :attr:`Rows.filter_report`):
    ``dataset filter: top1 kept 19 of 23 rows, dropped 4: row 5 ' Warsaw' (top-1 ' Krak'), ...``."""
    rows = report.get("dropped_rows") or []
    parts = [f"row {r['row_id']} {r['target']!r} (top-1 {r['top1']!r})" for r in rows[:shown]]
    more = int(report["dropped"]) - len(parts)
    tail = (": " + ", ".join(parts) + (f", and {more} more" if more > 0 else "")) if parts else ""
    return (f"dataset filter: {report['filter']} kept {report['kept']} of {report['rows_in']} rows, dropped "
            f"{report['dropped']}{tail}")


def kind_rows(model: HookedModel, prompts: Optional[Sequence[str]], dataset: Optional[DatasetSpec],
              target: Any = None, foil: Any = None, batch_size: int = 16) -> Rows:
    """The rows a kind runs on, prepared for ``model`` once: the ``dataset`` (generated, read,
    filtered), or one row per prompt with ``target``/``foil`` (a string: every row's; a list: one
    per prompt, see :func:`tracekit.dataset.rows_from_prompts`).

    Raises:
        DatasetError / TokenizationError: a row that cannot be used, naming it (``dataset.rows[3].target``
            or ``prompts[3].target``).
    """
    if dataset is not None:
        return dataset.prepare(model, "dataset", batch_size=batch_size)
    assert prompts
    return prepare_rows(model, rows_from_prompts(list(prompts), target, foil), where="prompts", source="prompts")
