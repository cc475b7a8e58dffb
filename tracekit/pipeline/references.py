"""References between steps: a field's value taken from an earlier step's saved result.

A reference is a mapping with ``from`` (an earlier step's name) and exactly one of ``key`` (a
summary value), ``table`` (+ ``column``: a saved table's cell(s)) or ``path`` (a saved file or
folder); the syntax and its rules are in :mod:`tracekit.pipeline` (this package). This module holds the
:class:`Reference` model, the checks that need no model (:func:`check_references`) and the reading
of a reference's value from a saved step folder (:func:`resolve_reference`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from ..core import paths
from ..core.errors import ConfigError
from ..core.io import jsonable
from ..core.strict import StrictModel
from ..results import COMMON_SUMMARY_KEYS, MANIFEST, REGISTRY, RESULTS

__all__ = ["Reference", "check_references", "find_references", "is_reference", "lookup_path", "resolve_reference"]


class Reference(StrictModel):
    """A value taken from an earlier step's saved result (see the module docstring)."""

    from_: str = Field(alias="from")
    key: str | None = None
    table: str | None = None
    column: str | None = None
    where: str | None = None
    order_by: str | None = None
    descending: bool = False
    abs_: bool = Field(default=False, alias="abs")
    unique: bool = False
    row: int | None = None
    rows: int | None = Field(default=None, ge=1)
    path: str | None = None
    offset: int | None = None

    model_config = StrictModel.model_config | {"populate_by_name": True}

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("key", "table", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a reference needs 'from' and exactly one of 'key' (a summary value), 'table' (+ "
                             f"'column') or 'path' (a saved file/folder); got {given or 'none'}")
        table_only = [k for k, v in (("column", self.column), ("where", self.where), ("order_by", self.order_by),
                                     ("row", self.row), ("rows", self.rows)) if v is not None]
        table_only += [k for k, v in (("descending", self.descending), ("abs", self.abs_), ("unique", self.unique))
                       if v]
        if self.table is None and table_only:
            raise ValueError(f"{table_only} only apply to a table reference ('table' + 'column')")
        if self.table is not None and self.column is None:
            raise ValueError("a table reference needs 'column' (the column whose value(s) are taken)")
        if self.row is not None and self.rows is not None:
            raise ValueError("give 'row' (one value) or 'rows' (the first n values), not both")
        if self.path is not None and self.offset is not None:
            raise ValueError("'offset' applies to numbers, not to a path")
        return self

    def describe(self) -> str:
        if self.key is not None:
            src = f"{self.from_}.{self.key}"
        elif self.table is not None:
            src = f"{self.from_} table {self.table!r} column {self.column!r}"
            if self.where:
                src += f" where {self.where!r}"
            if self.order_by:
                src += f" ordered by {'|' + self.order_by + '|' if self.abs_ else self.order_by}" + \
                       (" descending" if self.descending else "")
            if self.row is not None:
                src += f" row {self.row}"
            elif self.rows is not None:
                src += f" first {self.rows} rows"
        else:
            src = f"{self.from_} path {self.path!r}"
        if self.offset:
            src += f" {'+' if self.offset > 0 else '-'} {abs(self.offset)}"
        return src


def is_reference(obj: Any) -> bool:
    """A mapping with a ``from`` key is a reference to an earlier step's result."""
    return isinstance(obj, dict) and "from" in obj


def find_references(obj: Any, loc: tuple = ()) -> list[tuple[tuple, Any]]:
    """Every ``(loc, raw reference)`` inside a raw step (loc: keys and list indices from the step)."""
    if is_reference(obj):
        return [(loc, obj)]
    out: list = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += find_references(v, loc + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += find_references(v, loc + (i,))
    return out


def _step_name(raw: Any) -> str | None:
    if not isinstance(raw, dict):
        return None
    name = raw.get("name") or raw.get("kind")
    return name if isinstance(name, str) else None


def _parse_ref(raw: dict, where: str) -> tuple[Reference | None, list[str]]:
    try:
        return Reference.model_validate(raw), []
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            sub = paths.fmt(tuple(p for p in err["loc"] if p != "from_"))
            msg = ("unknown key of a reference (known: from, key, table, column, where, order_by, descending, "
                   "abs, unique, row, rows, path, offset)") if err["type"] == "extra_forbidden" else err["msg"]
            msgs.append(f"{where}{'.' + sub if sub else ''}: {msg}")
        return None, msgs


def _graph(steps_raw: list) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for raw in steps_raw:
        name = _step_name(raw)
        if name is None:
            continue
        g.setdefault(name, set()).update(r.get("from") for _, r in find_references(raw)
                                         if isinstance(r.get("from"), str))
    return g


def _cycle(g: dict[str, set[str]], start: str) -> list[str] | None:
    """A dependency path start -> ... -> start, if any."""
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(g.get(node, ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def _holds_ref(raw: Any, loc: tuple) -> bool:
    """Whether the part of the raw step a pydantic error location points at holds a reference (it
    cannot be judged before the reference is resolved; union branches' errors included)."""
    obj = raw
    for part in loc:
        if is_reference(obj):
            return True
        if (isinstance(obj, dict) and part in obj) or (isinstance(obj, list) and isinstance(part, int)
                                                        and 0 <= part < len(obj)):
            obj = obj[part]
    return bool(find_references(obj))


def check_references(steps_raw: list, prefix: str = "experiments") -> list[str]:
    """Everything about the references of a list of raw steps that can be checked without a model.

    Returns:
        Problems, one line each, starting with the YAML path (empty when all is well).
    """
    problems: list[str] = []
    names = [_step_name(s) for s in steps_raw]
    graph = _graph(steps_raw)
    for i, raw in enumerate(steps_raw):
        if not isinstance(raw, dict):
            continue
        me = names[i]
        for loc, rref in find_references(raw):
            where = f"{prefix}[{i}].{paths.fmt(loc)}"
            if "kind" in loc[:1] or "name" in loc[:1]:
                problems.append(f"{where}: the step's kind and name cannot come from another step")
                continue
            ref, errs = _parse_ref(rref, where)
            problems += errs
            if ref is None:
                continue
            src = ref.from_
            earlier = [n for n in names[:i] if n]
            if src == me:
                problems.append(f"{where}.from: step {me!r} refers to itself (a cycle); a step can only use "
                                f"results of earlier steps {earlier}")
                continue
            if src not in names:
                problems.append(f"{where}.from: unknown step {src!r}; earlier steps: {earlier}")
                continue
            j = names.index(src)
            if j > i:
                cyc = _cycle(graph, me) if me else None
                if cyc:
                    problems.append(f"{where}.from: steps refer to each other in a cycle: {' -> '.join(cyc)}; "
                                    "each step can only use results of earlier steps")
                else:
                    problems.append(f"{where}.from: step {src!r} runs later (step {j}); steps run in order, so "
                                    f"a step can only use results of earlier steps {earlier}: move {src!r} "
                                    f"before {me!r}")
                continue
            kind = steps_raw[j].get("kind")
            cls = REGISTRY.get(kind)
            if cls is None:
                continue
            rcls = cls.result_class
            if ref.key is not None:
                documented = getattr(rcls, "summary_keys", None)
                head = re.split(r"[.\[]", ref.key, maxsplit=1)[0]
                if documented is not None and head not in documented and head not in COMMON_SUMMARY_KEYS:
                    problems.append(f"{where}.key: {kind} step {src!r} has no summary key {head!r}; its summary "
                                    f"keys: {sorted(documented)}")
            if ref.table is not None:
                tables = getattr(rcls, "table_names", None)
                if tables is not None and ref.table not in tables:
                    problems.append(f"{where}.table: {kind} step {src!r} saves no table {ref.table!r}; its "
                                    f"tables: {sorted(tables)}")
        # the step's other fields, with each reference standing in for a value of the right type
        kind = raw.get("kind")
        cls = REGISTRY.get(kind) if isinstance(kind, str) else None
        if cls is not None and find_references(raw):
            try:
                cls.model_validate(raw)
            except ValidationError as e:
                for err in e.errors():
                    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
                    if _holds_ref(raw, loc):
                        continue
                    msg = ("unknown key (check spelling; see `tracekit kinds` for each kind's fields)"
                           if err["type"] == "extra_forbidden" else err["msg"])
                    problems.append(f"{prefix}[{i}]{'.' + paths.fmt(loc) if loc else ''}: {msg}")
    return problems


def lookup_path(obj: Any, path: str) -> Any:
    """``a.b[0].c`` / ``a['x y']`` lookup in nested dicts and lists (:func:`tracekit.core.paths.get`).

    Raises:
        KeyError / IndexError / TypeError: with the part of the path that failed.
    """
    try:
        return paths.get(obj, path)
    except paths.PathError as e:
        raise KeyError(str(e)) from e


def _read_tables(folder: Path, ref: Reference, where: str):
    import pandas as pd

    man = json.loads((folder / MANIFEST).read_text())
    tables = man.get("tables", [])
    if ref.table not in tables:
        raise ConfigError(f"{where}.table: step {ref.from_!r} saved no table {ref.table!r}; its tables: {tables}")
    df = pd.read_parquet(folder / f"{ref.table}.parquet")
    cols = list(df.columns)

    def renamed(names: list[str]) -> str:
        """`` ('head' was renamed to 'head_idx')`` for retired column names among ``names``."""
        try:
            cls = RESULTS[json.loads((folder / "config.json").read_text()).get("kind")]
        except Exception:  # noqa: BLE001 - no hint without the kind
            return ""
        hits = [(n, new) for n in names if n not in cols and (new := cls.renamed_column(str(ref.table), n))]
        return "".join(f" ({n!r} was renamed to {new!r})" for n, new in hits)

    if ref.where:
        try:
            df = df.query(ref.where)
        except Exception as e:
            words = re.findall(r"[A-Za-z_]\w*", ref.where)
            raise ConfigError(f"{where}.where: {ref.where!r} cannot filter table {ref.table!r} "
                              f"({type(e).__name__}: {e}){renamed(words)}; columns: {cols}") from e
    if ref.order_by:
        if ref.order_by not in df.columns:
            raise ConfigError(f"{where}.order_by: table {ref.table!r} has no column {ref.order_by!r}"
                              f"{renamed([ref.order_by])}; columns: {cols}")
        key = (lambda s: s.abs()) if ref.abs_ else None
        df = df.sort_values(ref.order_by, ascending=not ref.descending, key=key, kind="stable")
    if ref.column not in df.columns:
        raise ConfigError(f"{where}.column: table {ref.table!r} has no column {ref.column!r}"
                          f"{renamed([str(ref.column)])}; columns: {cols}")
    values = df[ref.column].tolist()
    if ref.unique:
        values = list(dict.fromkeys(values))
    if not values and ref.row is None:
        raise ConfigError(f"{where}: {ref.describe()} matches no rows"
                          f"{' (where ' + repr(ref.where) + ')' if ref.where else ''}, so it would select nothing; "
                          "loosen the filter or give the value directly")
    if ref.row is not None:
        if not -len(values) <= ref.row < len(values):
            raise ConfigError(f"{where}.row: {ref.row} is out of range: {len(values)} row(s) "
                              f"{'match ' + repr(ref.where) if ref.where else 'in the table'}")
        return jsonable(values[ref.row])
    if ref.rows is not None:
        values = values[: ref.rows]
    return jsonable(values)


def _offset(value: Any, k: int, where: str) -> Any:
    def add(v):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                return int(v) + k
            raise ConfigError(f"{where}.offset: the referenced value {value!r} is not an integer (or a list of "
                              "integers), so an offset cannot be added")
        return v + k
    return [add(v) for v in value] if isinstance(value, list) else add(value)


def resolve_reference(ref: Reference, run_dir: str | Path, where: str = "reference") -> Any:
    """The value a reference stands for, read from ``run_dir/<from>`` (a saved step folder).

    Raises:
        ConfigError: the step's folder is missing or incomplete, or the key / table / column / row /
            path does not exist; the message names ``where`` and lists what exists.
    """
    folder = Path(run_dir) / ref.from_
    if not (folder / MANIFEST).is_file():
        raise ConfigError(f"{where}.from: step {ref.from_!r} has no saved result in {run_dir} (did it fail?)")
    if ref.key is not None:
        summary = json.loads((folder / "summary.json").read_text())
        summary.pop("expectations", None)
        try:
            value = lookup_path(summary, ref.key)
        except (KeyError, IndexError, TypeError) as e:
            msg = e.args[0] if e.args else str(e)
            raise ConfigError(f"{where}.key: step {ref.from_!r} has no summary value {ref.key!r}: {msg}") from e
    elif ref.table is not None:
        value = _read_tables(folder, ref, where)
    else:
        assert ref.path is not None  # a reference has exactly one of key / table / path (validated)
        p = (folder / ref.path).resolve()
        if not p.is_relative_to(folder.resolve()):
            raise ConfigError(f"{where}.path: {ref.path!r} leaves the step's folder {folder}")
        if not p.exists():
            have = sorted(x.name for x in folder.iterdir())
            raise ConfigError(f"{where}.path: step {ref.from_!r} saved no {ref.path!r}; its folder holds {have}")
        return str(p)
    if ref.offset:
        value = _offset(value, ref.offset, where)
    return value
