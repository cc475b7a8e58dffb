"""Run configs: YAML parsed into pydantic models, with errors that name the YAML path.

A config file::

    model:                      # tracekit.model.ModelSpec
      name: smollm2-135m
      device: auto
      dtype: float32
      prepend_bos: true
    seed: 0
    experiments:                # named steps, run in order; each saved as soon as it finishes
      - kind: logit_lens        # a registered experiment kind (``tracekit kinds`` lists them)
        name: paris             # unique step name (default: the kind)
        prompts: ["The capital of China is Beijing. The capital of France is"]
        target: " Paris"
        expect:                 # optional reference values, reported as met / not met
          - {metric: target_prob_final, value: 0.96, atol: 0.03}

YAML is read with YAML 1.2's core schema (:func:`yaml_load`): ``1e-6`` and ``1E3`` are numbers
(PyYAML's YAML 1.1 rules read them as strings), only ``true``/``false`` are booleans (``no`` is
the string "no"), a key repeated in one mapping is an error naming both lines, and anchors /
aliases are expanded into independent copies (an override of one step never changes another).
Non-finite numbers (``.inf``, ``.nan``) are refused wherever a float is expected.

Errors: unknown keys, wrong types and bad values raise :class:`ConfigError` whose message lists
every problem with its path, e.g. ``experiments[0].target: Field required``.
``--set path=value`` overrides (``experiments[0].target= Rome``, ``model.device=cpu``) are
applied to the raw YAML before validation. Values are parsed as YAML (numbers, lists, mappings,
quoted strings), except that an unquoted string is kept verbatim, leading space included.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticUndefined

from .core import paths
from .core.errors import ConfigError
from .core.schema_check import SCHEMA_FILE, close_matches, source_hashes
from .core.yamlconf import apply_override, load_raw, yaml_load
from .experiments.base import REGISTRY, Experiment, StrictModel
from .model.spec import ModelSpec
from .pipeline import PendingStep, check_references, make_step

__all__ = ["ConfigError", "RunConfig", "parse_config", "apply_override", "load_raw", "load_config", "yaml_load",
           "field_rows", "docstring_fields", "kinds_schema", "write_kinds_schema"]


class RunSettings(StrictModel):
    """How a run uses the machine (``run:`` mapping); no effect on any number.

    Fields:
        memory_budget: bytes every batched engine may hold for its chunked tensors at one time:
            ``auto`` (default: 30% of the memory free on the run's device when the engine asks), a
            size (``4GiB``, ``512MB``, or a number of bytes) or a share of free memory (``40%``).
            Engines choose their chunk sizes from it; chunked results equal unchunked ones exactly.
            A step whose single row does not fit stops, saying how much it needs
            (:mod:`tracekit.core.budget`).
    """

    memory_budget: Union[str, float, int] = "auto"

    @field_validator("memory_budget")
    @classmethod
    def _check_budget(cls, v):
        from .core.budget import MemoryBudgetError, parse_budget

        try:
            parse_budget(v)
        except MemoryBudgetError as e:
            raise ValueError(str(e).removeprefix("run.memory_budget: ")) from None
        return v


class RunConfig(StrictModel):
    """A whole config file: the model, a seed and a list of experiment steps.

    Fields:
        model: the model spec (``model:`` mapping, see the model spec section); default: the
            :class:`ModelSpec` defaults.
        seed: the run seed; Python, NumPy and torch RNGs are re-seeded with it before every step
            (default 0). Recorded in the run's manifest.
        description: free text recorded in the run's manifest (default none); no effect on results.
        experiments: the steps to run, in order (a list of mappings, each with a ``kind``; required).
        run: how the run uses the machine (``run.memory_budget``), :class:`RunSettings`.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)

    model: ModelSpec = Field(default_factory=ModelSpec)
    seed: int = 0
    description: Optional[str] = None
    experiments: list[Experiment]
    run: RunSettings = Field(default_factory=RunSettings)


_RETIRED = re.compile(r"^(?:(?P<field>[\w.]+)(?:\[(?P<i>\d+)\])?: )?'(?P<old>[^']+)' was renamed to .*$")


def _model_in(t) -> Optional[type]:
    """The first pydantic model class in an annotation (``Optional[list[Spec]]`` -> ``Spec``)."""
    if isinstance(t, type) and issubclass(t, BaseModel):
        return t
    return next((m for a in typing.get_args(t) if (m := _model_in(a)) is not None), None)


def _fields_at(cls: Optional[type], loc: tuple) -> list[str]:
    """The field names of the model reached from ``cls`` along ``loc`` (list indices skipped)."""
    for part in loc:
        if cls is None:
            return []
        if isinstance(part, str):
            f = cls.model_fields.get(part)  # type: ignore[attr-defined]
            cls = _model_in(f.annotation) if f is not None else None
    return list(cls.model_fields) if cls is not None else []  # type: ignore[attr-defined]


def _errors(e: ValidationError, prefix: tuple = (), cls: Optional[type] = None) -> list[str]:
    """One line per error, each starting with its YAML path; a retired key or value
    (:mod:`tracekit.core.strict`) is reported at its own path: ``experiments[0].positions: 'positions'
    was renamed to 'position'``. ``cls``: the validated class, for "did you mean" on an unknown key."""
    msgs = []
    for err in e.errors():
        loc = prefix + tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = err["msg"]
        if err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
            parts = msg.split("\n")
            found = [_RETIRED.match(p) for p in parts]
            if parts and all(found):
                for m in found:
                    assert m is not None  # all(found) above
                    at = loc + ((m["field"],) + ((int(m["i"]),) if m["i"] else ()) if m["field"] else (m["old"],))
                    text = m.group(0)[m.start("old") - 1:] if m["field"] else m.group(0)
                    msgs.append(f"{paths.fmt(at)}: {text}")
                continue
        if err["type"] == "extra_forbidden":
            near = close_matches(loc[-1], _fields_at(cls, loc[len(prefix):-1]))
            msg = f"unknown key{near} (check spelling; see `tracekit kinds` for each kind's fields)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        inp = err.get("input")
        shown = "" if err["type"] in ("missing", "extra_forbidden") or isinstance(inp, dict) else f" (got {inp!r})"
        msgs.append(f"{paths.fmt(loc)}: {msg}{shown}")
    return msgs


def parse_config(raw: Any, source: str = "<config>") -> RunConfig:
    """Validate a raw (YAML-loaded) config into a :class:`RunConfig`.

    Raises:
        ConfigError: listing every invalid field by its YAML path.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping with 'model' and 'experiments'")
    problems: list[str] = []
    if "sweep" in raw:  # sweeps: see tracekit.sweep
        problems.append("sweep: a config with a sweep block runs with `tracekit sweep CONFIG --out DIR` "
                        "(or tracekit.sweep.expand_sweep)")
        raw = {k: v for k, v in raw.items() if k != "sweep"}
    top = {k: v for k, v in raw.items() if k != "experiments"}
    steps_raw = raw.get("experiments")
    if steps_raw is None:
        problems.append("experiments: required field is missing (a list of steps, each with a 'kind')")
        steps_raw = []
    elif not isinstance(steps_raw, list) or not steps_raw:
        problems.append("experiments: must be a non-empty list of steps")
        steps_raw = []
    try:
        head = RunConfig.model_validate({**top, "experiments": []})
    except ValidationError as e:
        problems += [m for m in _errors(e, (), RunConfig) if not m.startswith("experiments")]
        head = None
    steps: list[Experiment | PendingStep] = []  # PendingStep: a step taking earlier steps' results
    for i, step in enumerate(steps_raw):
        where = f"experiments[{i}]"
        if not isinstance(step, dict):
            problems.append(f"{where}: must be a mapping with a 'kind'")
            continue
        kind = step.get("kind")
        if kind not in REGISTRY:
            near = close_matches(kind, REGISTRY)
            problems.append(f"{where}.kind: unknown experiment kind {kind!r}{near}{' ' if near else '; '}"
                            f"known kinds: {sorted(REGISTRY)}")
            continue
        pending = make_step(step, i)  # pipeline: fields taking earlier steps' results (tracekit.pipeline)
        if pending is not None:
            steps.append(pending)
            continue
        try:
            steps.append(REGISTRY[kind].model_validate(step))
        except ValidationError as e:
            problems += _errors(e, ("experiments", i), REGISTRY[kind])
    problems += check_references(steps_raw)  # pipeline: references resolvable, in order, no cycle
    names = [s.step_name for s in steps]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"experiments: step names must be unique, repeated: {dup}; give each step a 'name'")
    if problems:
        raise ConfigError(f"{source}: invalid config:\n  " + "\n  ".join(problems))
    assert head is not None
    return RunConfig.model_construct(**{**dict(head), "experiments": steps})


def load_config(path: str | Path, overrides: list[str] | tuple = ()) -> tuple[RunConfig, dict]:
    """Load, override and validate a config file. Returns ``(config, raw_after_overrides)``."""
    raw = load_raw(path)
    for a in overrides:
        apply_override(raw, a)
    return parse_config(raw, source=str(path)), raw


# ---------------------------------------------------------------------------------------------
# The generated schema (tracekit/data/kinds_schema.json) for the torch-free CLI paths
# (tracekit.core.schema_check): field rows as docs/reference/config.md shows them, and JSON schemas.

#: Fields every kind inherits from ``Experiment`` (as in docs/gen_config_reference.py).
COMMON_FIELDS = {
    "kind": "The experiment kind (registry name); selects the class.",
    "name": "Step name, unique in a config (default: the kind); names the step's folder in the run directory.",
    "expect": "Reference values checked after the run (list of expectations, see Expectation below).",
}
_SECTION = re.compile(r"^(\s*)(Fields|Attributes|Args)\s*:\s*$")
_ENTRY = re.compile(r"^([A-Za-z_]\w*(?:\s*(?:,|/)\s*[A-Za-z_]\w*)*)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_LOOSE = (BeforeValidator, WrapValidator, PlainValidator)


def docstring_fields(cls: type) -> dict[str, str]:
    """``name -> description`` from the ``Fields:`` / ``Attributes:`` / ``Args:`` sections of ``cls``'s
    docstring and its bases' (an entry ``a, b: text`` documents both)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.getdoc(klass) if klass.__dict__.get("__doc__") else None
        lines = doc.splitlines() if doc else []
        i = 0
        while i < len(lines):
            m = _SECTION.match(lines[i])
            i += 1
            if not m:
                continue
            indent, names, cur = None, [], []
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(m[1])):
                line = lines[i]
                i += 1
                if not line.strip():
                    continue
                ind = len(line) - len(line.lstrip())
                indent = ind if indent is None else indent
                em = _ENTRY.match(line.strip())
                if ind == indent and em:
                    out.update({n: " ".join(cur).strip() for n in names})
                    names, cur = [n.strip() for n in re.split(r"[,/]", em[1])], [em[2].strip()]
                else:
                    cur.append(line.strip())
            out.update({n: " ".join(cur).strip() for n in names})
    return out


def _type_name(t) -> str:
    """A type annotation as docs/reference/config.md shows it, validators (``Annotated[T, ...]``) as ``T``."""
    s = repr(t) if not isinstance(t, type) else t.__name__
    s = re.sub(r"typing\.|pydantic\.|annotated_types\.|tracekit\.[\w.]+\.", "", s)
    s = re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).split(".")[-1], s)
    return _sorted_unions(_unannotate(s).replace("NoneType", "None"))


def _split_top(s: str) -> list[str]:
    """``"a, B[c, d], e"`` -> ``["a", "B[c, d]", "e"]`` (commas at bracket depth 0)."""
    out, depth, start = [], 0, 0
    for j, c in enumerate(s):
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(s[start:j].strip())
            start = j + 1
    out.append(s[start:].strip())
    return out


def _sorted_unions(s: str) -> str:
    """Every ``Union[...]`` with its members in one order (alphabetical, ``None`` last): ``typing``
    caches unions, so ``Union[str, int]`` may print as ``Union[int, str]`` depending on which modules
    were imported first; the docs and ``tracekit kinds`` must not depend on that."""
    i = s.find("Union[")
    if i < 0:
        return s
    depth, j = 0, i + len("Union[")
    for j in range(i + len("Union["), len(s)):
        if s[j] in "[(":
            depth += 1
        elif s[j] in "])":
            if depth == 0:
                break
            depth -= 1
    members = sorted((_sorted_unions(m) for m in _split_top(s[i + len("Union["):j])), key=lambda m: (m == "None", m))
    return s[:i] + "Union[" + ", ".join(members) + "]" + _sorted_unions(s[j + 1:])


def _unannotate(s: str) -> str:
    """``Annotated[T, meta...]`` -> ``T`` everywhere in a type's text (brackets balanced)."""
    while (i := s.find("Annotated[")) >= 0:
        depth, j, comma = 0, i + len("Annotated["), None
        for j in range(i + len("Annotated["), len(s)):
            c = s[j]
            if c in "[(":
                depth += 1
            elif c in "])":
                if depth == 0:
                    break
                depth -= 1
            elif c == "," and depth == 0 and comma is None:
                comma = j
        s = s[:i] + s[i + len("Annotated["):comma if comma is not None else j] + s[j + 1:]
    return s


def _default(f) -> str:
    if f.default_factory is not None:
        try:
            return repr(f.default_factory())
        except TypeError:
            return "(computed)"
    return "required" if f.default is PydanticUndefined else repr(f.default)


def _constraints(f) -> str:
    parts = []
    for m in f.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "min length"),
                          ("max_length", "max length"), ("pattern", "pattern")):
            if getattr(m, attr, None) is not None:
                parts.append(f"{sym} {getattr(m, attr)}")
    return ", ".join(parts)


def field_rows(cls: type, common: bool = False) -> list[dict]:
    """One row per field of a config class: ``name``, ``type``, ``default`` (``"required"`` when
    required), ``constraints`` and ``description`` -- what docs/reference/config.md shows (an
    undocumented field has the description ``""``)."""
    docs = docstring_fields(cls)
    return [{"name": n, "type": _type_name(f.annotation), "default": _default(f), "constraints": _constraints(f),
             "description": f.description or docs.get(n) or (COMMON_FIELDS.get(n, "") if common else "")}
            for n, f in cls.model_fields.items()]


def _nested_models(t, seen: set) -> list[type]:
    if isinstance(t, type) and issubclass(t, BaseModel):
        if t in seen:
            return []
        seen.add(t)
        return [t] + [c for f in t.model_fields.values() for c in _nested_models(f.annotation, seen)]
    return [c for a in typing.get_args(t) for c in _nested_models(a, seen)]


def _loose(t) -> bool:
    """Whether an annotation converts its input before checking it (a before/wrap/plain validator)."""
    if any(isinstance(m, _LOOSE) for m in getattr(t, "__metadata__", ())):
        return True
    return any(_loose(a) for a in typing.get_args(t))


def _strip(node: Any) -> Any:
    """A JSON schema without titles, descriptions and defaults (validation needs none of them), its
    ``anyOf`` / ``oneOf`` alternatives in one order (typing caches unions, so their member order, and
    pydantic's schema of them, depends on which modules were imported first)."""
    if isinstance(node, list):
        return [_strip(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: ({n: _strip(s) for n, s in v.items()} if k in ("properties", "$defs") else _strip(v))
           for k, v in node.items() if k not in ("title", "description", "default", "examples")}
    for k in ("anyOf", "oneOf"):
        if isinstance(out.get(k), list):
            out[k] = sorted(out[k], key=lambda s: json.dumps(s, sort_keys=True))
    return out


def _json_schema(cls: type) -> dict:
    """``cls``'s validation JSON schema, loosened where pydantic converts input first: a field with a
    before/wrap/plain validator, or a class with a model "before" validator, accepts anything here."""
    schema = _strip(cls.model_json_schema(mode="validation"))
    seen: set = set()
    for c in _nested_models(cls, seen):
        node = schema if c is cls else schema.get("$defs", {}).get(c.__name__)
        if node is None:
            continue
        deco = c.__pydantic_decorators__
        if any(v.info.mode != "after" and n != "_refuse_retired" for n, v in deco.model_validators.items()):
            node.clear()
            continue
        loose = {f for v in deco.field_validators.values() if v.info.mode != "after" for f in v.info.fields}
        for n, f in c.model_fields.items():
            if n in loose or "*" in loose or _loose(f.annotation) or any(isinstance(m, _LOOSE) for m in f.metadata):
                node.get("properties", {})[n] = {}
        if getattr(c, "retired", None):
            node["x-retired"] = dict(c.retired)
    return schema


def _summary(cls: type) -> str:
    return (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")


def kinds_schema() -> dict:
    """What ``tracekit/data/kinds_schema.json`` holds: per kind its class, summary, field rows, nested
    config classes and JSON schema; the run config's; and the sha256 of every source file they come from."""
    run = _json_schema(RunConfig)
    run["properties"].pop("experiments", None)
    run["required"] = [r for r in run.get("required", []) if r != "experiments"]
    kinds, nested, classes = {}, {}, [RunConfig, ModelSpec]
    for kind in sorted(REGISTRY):
        cls = REGISTRY[kind]
        inner = _nested_models(cls, set())[1:]
        res = getattr(cls, "result_class", None)
        kinds[kind] = {"class": cls.__name__, "summary": _summary(cls), "fields": field_rows(cls, common=True),
                       "nested": [c.__name__ for c in inner], "schema": _json_schema(cls),
                       "headline_keys": list(getattr(res, "headline_keys", ()))}
        for c in inner:
            nested.setdefault(c.__name__, {"summary": _summary(c), "fields": field_rows(c)})
        classes += [cls, *inner] + ([res] if isinstance(res, type) else [])
    files = ["tracekit/experiments/__init__.py", "tracekit/results.py"]  # the registry itself
    for c in classes:
        for k in c.__mro__:
            f = inspect.getsourcefile(k) if k.__module__.startswith("tracekit") else None
            if f:
                files.append(Path(f).resolve().relative_to(Path(__file__).resolve().parents[1]).as_posix())
    return {"format": 1, "note": "generated by tracekit.config.write_kinds_schema(); do not edit",
            "sources": source_hashes(files), "run": run, "kinds": kinds, "nested": nested}


def write_kinds_schema(path: str | Path = SCHEMA_FILE) -> Path:
    """Write :func:`kinds_schema` to ``path`` (default: the package's ``data/kinds_schema.json``):
    ``python -c "import tracekit.config as c; c.write_kinds_schema()"`` after changing a kind's fields
    (``tests/unit/test_cli_schema.py`` fails until then)."""
    p = Path(path)
    p.write_text(json.dumps(kinds_schema(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return p
