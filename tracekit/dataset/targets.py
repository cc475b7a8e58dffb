"""Targets and read positions of rows: what every kind that scores a row's own answer resolves.

* :class:`LogitTarget`: a target token and an optional foil (the metric is ``logit[target] -
  logit[foil]``); :func:`resolve_target` one, :func:`row_targets` one per prompt;
* :func:`per_row_values`: the **one** reader of a per-row field: a single value (every row's) or a
  list (one per row, its length checked);
* :func:`as_position` / :func:`row_positions`: a kind's ``position`` field checked against the forms
  it accepts (:data:`UNIT_POSITION_FORMS`, :data:`DLA_POSITION_FORMS`) and resolved per row.

Needs only the tokenizer (works on a :class:`tracekit.model.ModelInfo`).

>>> per_row_values(" Paris", 2, "target")
[' Paris', ' Paris']
>>> per_row_values([" Paris", " Rome"], 2, "target")
[' Paris', ' Rome']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from ..core.errors import AttributionError, DatasetError, TokenizationError, TracekitError
from ..model.info import HookedModel
from ..tokens import Position, PositionSpec, parse_position, single_token_id

if TYPE_CHECKING:
    from .rows import Rows

__all__ = ["LogitTarget", "resolve_target", "row_targets", "per_row_values", "check_answer_tokens",
           "UNIT_POSITION_FORMS", "DLA_POSITION_FORMS", "as_position", "row_positions"]

#: The position forms direct logit attribution and neuron attribution accept on prompts.
UNIT_POSITION_FORMS = ("int", "last", "token:<text>")
#: The forms direct logit attribution accepts on a dataset: those plus a named position (``END``,
#: ``IO``...) of the dataset's rows, resolved per row.
DLA_POSITION_FORMS = (*UNIT_POSITION_FORMS, "name")


@dataclass(frozen=True)
class LogitTarget:
    """A target token and an optional foil (the metric is ``logit[target] - logit[foil]``)."""

    target: str
    target_id: int
    foil: Optional[str] = None
    foil_id: Optional[int] = None

    @property
    def label(self) -> str:
        return f"logit({self.target!r})" + (f" - logit({self.foil!r})" if self.foil is not None else "")


def per_row_values(value: Any, n: int, name: str, rows_word: str = "prompt",
                   error: type[TracekitError] = DatasetError, track_hint: bool = True) -> list[Any]:
    """``[n]`` values from one value (every row's: None, a string or a token id) or a list (one per
    row): the one reader of a per-row ``target`` / ``foil`` field.

    Args:
        value: the field's value.
        n: the number of rows.
        name: the field, quoted in the error.
        rows_word: what a row is called in the error (``prompt``, ``row``).
        error: the error class raised (:class:`DatasetError` for rows; :class:`AttributionError`
            for the unit kinds' prompts).
        track_hint: the message points to ``track`` (the field for tokens followed on every row) on
            the kinds that have one.

    Raises:
        DatasetError (or ``error``): a list whose length is not ``n``.
    """
    if value is None or isinstance(value, (str, int)):
        return [value] * n
    vals = list(value)
    if len(vals) != n:
        if track_hint:
            raise error(f"{name}: {len(vals)} tokens for {n} {rows_word}(s); a {name} list gives each {rows_word} "
                        f"its own answer (one per {rows_word}). To follow the same tokens on every {rows_word} use "
                        f"track: {vals!r}")
        raise error(f"{name}: {len(vals)} tokens for {n} {rows_word}(s); a {name} list gives each {rows_word} "
                    f"its own token (one per {rows_word})")
    return vals


def resolve_target(model: HookedModel, target: str, foil: Optional[str] = None) -> LogitTarget:
    """Token ids of ``target`` (and ``foil``); needs only the tokenizer (works on a ``ModelInfo``).

    Raises:
        TokenizationError: ``target``/``foil`` is not exactly one token (message shows the split).
        AttributionError: ``foil`` equals ``target``.
    """
    t = single_token_id(model, target, field="target")
    f = single_token_id(model, foil, field="foil") if foil is not None else None
    if f is not None and f == t:
        raise AttributionError(f"foil: {foil!r} is the same token as target; pick a different foil or drop it")
    return LogitTarget(target, t, foil, f)


def check_answer_tokens(model: HookedModel, target: Union[str, Sequence[str], None],
                        foil: Union[str, Sequence[str], None] = None) -> None:
    """Each ``target`` / ``foil`` token is exactly one token, the error naming the field as the
    user wrote it (``target``, ``target[2]``); tokenizer only.

    Raises:
        TokenizationError: a token that is not exactly one token.
    """
    for name, v in (("target", target), ("foil", foil)):
        for j, t in enumerate([v] if isinstance(v, str) else (v or [])):
            single_token_id(model, t, field=name if isinstance(v, str) else f"{name}[{j}]")


def row_targets(model: HookedModel, n: int, target: Union[str, Sequence[str], None],
                foil: Union[str, Sequence[str], None] = None) -> list[LogitTarget]:
    """One :class:`LogitTarget` per prompt from a ``target``/``foil`` string (every prompt's) or list
    (one per prompt), each distinct token resolved once; needs only the tokenizer.

    Raises:
        AttributionError: no target, or a list of another length than the prompts.
        TokenizationError: a target/foil that is not one token (naming ``target[i]`` for lists).
    """
    if target is None:
        raise AttributionError("target: give the token whose logit is split (a string for every prompt, or a "
                               "list with one per prompt), or pass prepared Rows whose rows carry targets")
    ts = per_row_values(target, n, "target", error=AttributionError, track_hint=False)
    fs = per_row_values(foil, n, "foil", error=AttributionError, track_hint=False)
    listed = not isinstance(target, str) or (foil is not None and not isinstance(foil, str))
    seen: dict[tuple, LogitTarget] = {}
    out = []
    for i, (t, f) in enumerate(zip(ts, fs)):
        if (t, f) not in seen:
            if not listed:
                seen[(t, f)] = resolve_target(model, t, f)
            else:
                ti = single_token_id(model, t, field=f"target[{i}]" if not isinstance(target, str) else "target")
                fi = (single_token_id(model, f, field=f"foil[{i}]" if not isinstance(foil, str) else "foil")
                      if f is not None else None)
                if fi is not None and fi == ti:
                    raise AttributionError(f"foil[{i}]: {f!r} is the same token as target[{i}]; pick a different "
                                           "foil or drop it")
                seen[(t, f)] = LogitTarget(t, ti, f, fi)
        out.append(seen[(t, f)])
    return out


def as_position(position: Union[PositionSpec, Position], field: str = "position",
                allowed: Sequence[str] = UNIT_POSITION_FORMS) -> Position:
    """A :class:`tracekit.tokens.Position` of one of ``allowed`` (default :data:`UNIT_POSITION_FORMS`:
    int, ``last``, ``token:<text>``; :data:`DLA_POSITION_FORMS` adds a dataset position name).

    Raises:
        TokenizationError: another form, or a bare token string (the message suggests ``token:<text>``;
            a string with surrounding spaces such as ``" is"`` is token text, never a name).
    """
    if isinstance(position, Position):
        kinds = {"int": "index", "last": "last", "token:<text>": "token", "name": "name"}
        if position.kind not in {kinds[a] for a in allowed if a in kinds}:
            parse_position(str(position), allowed, field)  # raises, listing the accepted forms
        return position
    if ("name" in allowed and isinstance(position, str) and position != position.strip()
            and position.strip().isidentifier()):
        raise TokenizationError(f"{field}: {position!r} is token text, not a position name (names have no "
                                f"spaces); write 'token:{position}'")
    return parse_position(position, allowed, field)


def row_positions(model: HookedModel, data: "Rows", position: Union[PositionSpec, Position],
                  field: str = "position") -> list[int]:
    """Each row's read position as an index into its own ids (BOS counted), tokenizer only.

    Args:
        data: the prepared rows.
        position: an int (an index into the row's ids, BOS counted when prepended; negative from the
            end), ``last``, ``token:<text>``, or a named position of the rows (``END``, ``IO``).

    Raises:
        TokenizationError: an index out of range or a text not in a row (naming the row).
        DatasetError: a name some row does not have.
    """
    pos = as_position(position, field, DLA_POSITION_FORMS)
    if pos.kind == "name":
        assert pos.text is not None
        return data.position(pos.text, field)
    out = []
    for e in data.examples:
        try:
            out.append(pos.resolve(model, e.prompt, e.ids, field=field)[0])
        except TokenizationError as err:
            raise TokenizationError(f"{err} (row {e.row_id}: {e.prompt!r})") from None
    return out
