"""Pipelines: a step's field may take an earlier step's result.

Any field of a step (at any depth, also inside a list) may be a *reference* instead of a value: a
mapping with ``from`` (the name of an earlier step) and exactly one of ``key``, ``table`` or
``path``::

    experiments:
      - {kind: logit_lens, name: lens, prompts: [...], target: " Paris"}
      - kind: neuron_attribution
        name: neurons
        # a summary value (path into the step's summary.json; dots and [index] / ['key'])
        layers: [{from: lens, key: emergence_layer}]     # the block whose output has the target on top
      - kind: attention_pattern
        # a cell of a saved table: filter rows (pandas query), order them, take a column
        layer: {from: dla, table: heads, where: "head >= 0 and prompt_idx == 0",
                order_by: contribution, abs: true, descending: true, column: layer, row: 0}
      - kind: some_kind
        # a file or folder the step saved (e.g. an SAE directory): its absolute path
        sae: {from: train, path: sae}

Table references: ``where`` (a ``DataFrame.query`` string), ``order_by`` (a column; ``abs: true``
orders by absolute value, ``descending: true`` largest first), ``column`` (required), ``unique``
(drop repeated values, first kept), then ``row: i`` (one value) or ``rows: n`` (the first ``n`` as a
list; neither: the whole column as a list). ``offset: k`` adds ``k`` to an int (or to each int of a
list), e.g. to turn a lens hidden-state index into a block index.

Checked when the config is parsed, before any model loads (:func:`check_references`, errors are
:class:`~tracekit.errors.ConfigError` lines naming the YAML path): malformed references, an unknown
step, a step referring to itself or to a later step (steps run in order), cycles, summary keys /
tables a kind documents (``summary_keys`` / ``table_names`` class attributes of its result class,
where the kind declares them), and every other field of the step. When the step is about to run,
:func:`resolve_step` reads the referenced values from the earlier steps' saved folders (what was
saved is what is used), checks each key / table / column / path exists, validates the whole step
with the resolved values against the kind's pydantic field types (a value that does not fit is a
``ConfigError`` naming the YAML path, the reference and the value), and returns the resolved step
with its record (:class:`Resolution`). This module writes no file: the runner
(:mod:`tracekit.runner`) records the resolution in ``config.resolved.yaml`` and ``references.json``
of the run directory (and, through ``Result.save``, in the step's ``config.json``) and runs the
step, its ``check`` first.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..core import paths
from ..core.errors import ConfigError
from ..core.io import jsonable
from ..model.info import HookedModel
from ..results import MANIFEST, REGISTRY, RESULTS
from .references import (
    Reference,
    check_references,
    find_references,
    is_reference,
    lookup_path,
    resolve_reference,
)

__all__ = [
    "PendingStep",
    "Reference",
    "Resolution",
    "resolve",
    "check_references",
    "find_references",
    "is_reference",
    "lookup_path",
    "make_step",
    "resolve_reference",
    "resolve_step",
]


class PendingStep:
    """A step whose fields hold references: validated as far as possible when the config is parsed,
    made into its experiment by :func:`resolve_step` when it is about to run.

    Quacks like an :class:`~tracekit.experiments.base.Experiment` where the runner needs it before
    resolution (``kind``, ``name``, ``step_name``, ``model_dump``, ``check`` (nothing: the step is
    checked once resolved)).
    """

    def __init__(self, raw: dict, index: int):
        self.raw = copy.deepcopy(raw)
        self.index = index
        self.kind: str = raw["kind"]
        self.name: str | None = raw.get("name")
        self.references = []
        for loc, r in find_references(raw):
            try:
                self.references.append((loc, Reference.model_validate(r)))
            except ValidationError:
                pass  # reported by check_references when the config is parsed

    @property
    def step_name(self) -> str:
        return self.name or self.kind

    @property
    def expect(self) -> list:
        return []

    @property
    def result_class(self):
        return REGISTRY[self.kind].result_class

    @property
    def writes_store(self) -> str | None:
        """The kind's ``writes_store`` field (the activation store it writes; None for other kinds)."""
        return getattr(REGISTRY.get(self.kind), "writes_store", None)

    def check(self, model: HookedModel) -> None:
        """Nothing yet: the step is checked once its values are known (:func:`resolve_step`, or the
        runner's ``run(model)`` of the :func:`resolve`-d step)."""

    def model_dump(self, mode: str = "python", **kwargs) -> dict:
        return copy.deepcopy(self.raw)

    def run(self, *args, **kwargs):
        raise ConfigError(f"experiments[{self.index}] ({self.step_name}): the step takes values from earlier steps "
                          f"({', '.join(r.describe() for _, r in self.references)}); run the whole config "
                          "(tracekit run) or resolve it with tracekit.pipeline.resolve_step")

    def __repr__(self) -> str:
        return f"PendingStep({self.kind!r}, name={self.name!r}, references={len(self.references)})"


def make_step(raw: dict, index: int):
    """A :class:`PendingStep` when the raw step holds references, else None (validate it normally)."""
    return PendingStep(raw, index) if find_references(raw) else None


def _ref_at(raw: Any, loc: tuple) -> tuple | None:
    """The location of the reference a pydantic error location ends in (union tags and other
    non-path parts of the location are skipped), or None."""
    obj, walked = raw, ()
    for part in loc:
        if is_reference(obj):
            return walked
        if (isinstance(obj, dict) and part in obj) or (isinstance(obj, list) and isinstance(part, int)
                                                        and 0 <= part < len(obj)):
            obj, walked = obj[part], walked + (part,)
    return walked if is_reference(obj) else None


def _null_ok(cls, loc: tuple) -> bool:
    """Whether a field takes a null from a reference (it opts in with
    ``json_schema_extra={"null_from_reference": True}``: null means something there, e.g. no foil)."""
    if len(loc) != 1:
        return False
    f = cls.model_fields.get(loc[0])
    extra = getattr(f, "json_schema_extra", None) or {}
    return bool(isinstance(extra, dict) and extra.get("null_from_reference"))


def _default_of(cls, loc: tuple) -> str:
    f = cls.model_fields.get(loc[0]) if loc else None
    if f is None or len(loc) != 1:
        return "or a validation error"
    d = f.get_default(call_default_factory=True)
    return "null: every one" if d is None else repr(d)


def _null_reason(ref: Reference, run_dir: Path) -> str:
    """Why the referenced value is null, as the step's result class documents it (``null_reasons``)."""
    why = "the step recorded no value for it"
    try:
        kind = json.loads((Path(run_dir) / ref.from_ / MANIFEST).read_text()).get("kind")
        rcls = RESULTS.get(kind)
        head = (ref.key or "").split("[")[0].split(".")[0]
        why = (getattr(rcls, "null_reasons", {}) or {}).get(head, why)
    except (OSError, ValueError, AttributeError):
        pass
    return why


@dataclass(frozen=True)
class Resolution:
    """A pending step made into its experiment, with what the run directory records for it.

    Attributes:
        step: the experiment, its references replaced by the values read.
        index: the step's index in the config's ``experiments``.
        record: per reference: ``field`` (YAML path), ``from`` (the reference) and ``value`` (the
            step's entry of ``references.json``).
    """

    step: Any
    index: int
    record: list

    @property
    def entry(self) -> dict:
        """The step's entry of ``config.resolved.yaml`` (values in place of references)."""
        return jsonable(self.step.model_dump(mode="json"))


def resolve(step: PendingStep, run_dir: str | Path) -> Resolution:
    """Read a pending step's references from the run directory's earlier step folders and validate
    the step with the values; writes nothing (:mod:`tracekit.runner` records the result).

    Raises:
        ConfigError: a reference cannot be resolved, or a resolved value does not fit the field's
            type (the message names the YAML path, the reference and the value).
    """
    run_dir = Path(run_dir)
    raw = copy.deepcopy(step.raw)
    prefix = f"experiments[{step.index}]"
    record = []
    cls = REGISTRY[step.kind]
    for loc, ref in step.references:
        where = f"{prefix}.{paths.fmt(loc)}"
        value = resolve_reference(ref, run_dir, where)
        if value is None and not _null_ok(cls, loc):
            raise ConfigError(f"{where}: {ref.describe()} is null: {_null_reason(ref, run_dir)}. A null here would "
                              f"silently become the field's default ({_default_of(cls, loc)}); refer to a value that "
                              "exists, or give the field directly")
        paths.set_path(raw, loc, value, copy_value=False)
        record.append({"field": where, "from": ref.model_dump(by_alias=True, exclude_defaults=True), "value": value})
    try:
        resolved = cls.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"step {step.step_name!r}: resolved references do not fit:\n  " + "\n  ".join(
            dict.fromkeys(_misfits(step, e, record, prefix)))) from e
    return Resolution(resolved, step.index, record)


def _misfits(step: PendingStep, e: ValidationError, record: list, prefix: str) -> list[str]:
    """One line per validation error of a resolved step, naming the reference a value came from."""
    lines = []
    for err in e.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        at = _ref_at(step.raw, loc)
        if at is not None:
            ref = dict(step.references)[at]
            val = next(r["value"] for r in record if r["field"] == f"{prefix}.{paths.fmt(at)}")
            lines.append(f"{prefix}.{paths.fmt(at)}: the value {val!r} taken from {ref.describe()} does not "
                         f"fit the field: {err['msg']}")
        else:
            lines.append(f"{prefix}{'.' + paths.fmt(loc) if loc else ''}: {err['msg']}")
    return lines


def resolve_step(step, run_dir: str | Path, model: HookedModel | None = None):
    """Turn a :class:`PendingStep` into its experiment, with values read from the run directory's
    earlier step folders (:func:`resolve`); anything else is returned unchanged. With ``model``
    given, runs the resolved step's ``check(model)``. Writes nothing: the runner records what
    was resolved (``references.json``, ``config.resolved.yaml``) from :func:`resolve`.

    Raises:
        ConfigError: a reference cannot be resolved, or a resolved value does not fit the field's
            type (the message names the YAML path, the reference and the value).
    """
    if not isinstance(step, PendingStep):
        return step
    resolved = resolve(step, run_dir).step
    if model is not None:
        resolved.check(model)
    return resolved
