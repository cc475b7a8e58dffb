"""The strict pydantic base of every config class, its one "retired name" mechanism, and the field
types configs share.

:class:`StrictModel`: unknown keys are errors, non-finite floats (``.inf``, ``.nan``) are refused,
and a class lists what it retired, once, as data:

* ``retired = {"answer": "target"}`` -- a key that was renamed (text after ``"; "`` is a note);
* ``retired_values = {"sites": {"resid": "resid_post; ..."}}`` -- a value of a field that was renamed.

Either fails with ``'answer' was renamed to 'target'``, naming every retired name found (one line
each); the config loader reports each at its YAML path (``experiments[0].answer: ...``).

>>> class Pair(StrictModel):
...     retired = {"answer": "target"}
...     target: str
>>> try:
...     Pair(answer=" Paris")
... except ValueError as e:
...     print(str(e).splitlines()[1].strip())
Value error, 'answer' was renamed to 'target' [type=value_error, input_value={'answer': ' Paris'}, input_type=dict]
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

__all__ = ["StrictModel", "retired_message", "Prompts", "OptionalPrompts", "Indices"]


def retired_message(table: dict, old: str, what: str = "") -> str:
    """``'answer' was renamed to 'target'`` (plus the note after ``"; "`` in the table's entry)."""
    new, _, note = str(table[old]).partition("; ")
    return f"{what}'{old}' was renamed to '{new}'" + (f" ({note})" if note else "")


class StrictModel(BaseModel):
    """Base of every config class: unknown keys are errors, non-finite floats are refused, and the
    keys / values in :attr:`retired` / :attr:`retired_values` fail naming their new names."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, arbitrary_types_allowed=True)

    #: Retired keys -> their new name (an optional note after ``"; "``).
    retired: ClassVar[dict[str, str]] = {}
    #: Per field, retired values -> their new value (an optional note after ``"; "``).
    retired_values: ClassVar[dict[str, dict[str, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_retired(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        msgs = [retired_message(cls.retired, k) for k in data if k in cls.retired]
        for field, table in cls.retired_values.items():
            v = data.get(field)
            items = v if isinstance(v, list) else [v]
            for i, x in enumerate(items):
                if isinstance(x, str) and x in table:
                    where = f"{field}[{i}]: " if isinstance(v, list) else f"{field}: "
                    msgs.append(retired_message(table, x, where))
        if msgs:
            raise ValueError("\n".join(msgs))
        return data


def _str_to_list(v):
    return [v] if isinstance(v, str) else v


def _nonempty_prompts(v):
    if isinstance(v, list):
        for i, p in enumerate(v):
            if isinstance(p, str) and p == "":
                raise ValueError(f"prompt {i} is empty; give text (a BOS alone explains nothing)")
    return v


def _nonempty_selection(v):
    if isinstance(v, list) and not v:
        raise ValueError("an empty list selects nothing (no work would be done); omit the field to select every "
                         "one, or list the indices")
    return v


#: A config field holding prompts: one string or a list of strings (at least one, none empty).
Prompts = Annotated[list[str], BeforeValidator(_nonempty_prompts), BeforeValidator(_str_to_list),
                    Field(min_length=1)]
#: The same, possibly an empty list.
OptionalPrompts = Annotated[list[str], BeforeValidator(_nonempty_prompts), BeforeValidator(_str_to_list)]
#: A list of indices (layers, heads, neurons, features) that must select something: ``[]`` is refused
#: before any work (a table reference that matched no rows gives ``[]`` too).
Indices = Annotated[list[int], AfterValidator(_nonempty_selection)]
