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

import re
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ConfigDict, Field, ValidationError

from .core import paths
from .core.errors import ConfigError
from .experiments.base import REGISTRY, Experiment, StrictModel
from .model.spec import ModelSpec
from .pipeline import PendingStep, check_references, make_step

__all__ = ["ConfigError", "RunConfig", "parse_config", "apply_override", "load_raw", "load_config", "yaml_load"]


# ---------------------------------------------------------------------------------------------
# YAML 1.2 core schema on PyYAML

_FLOAT_12 = re.compile(r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class _Loader12(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema scalars and duplicate-key detection."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                hash(key)
            except TypeError:
                continue
            if key in seen:
                raise ConfigError(f"{key_node.start_mark.name}: key {key!r} appears twice in one mapping, at line "
                                  f"{seen[key]} and line {line}; YAML keeps only the last, silently. Remove one.")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader, node):
    v = loader.construct_scalar(node)
    if v.startswith("0o"):
        return int(v[2:], 8)
    return int(v, 0) if v.startswith("0x") else int(v)


def _construct_float(loader, node):
    v = loader.construct_scalar(node).lower()
    if v.endswith("inf"):
        return float("-inf") if v.startswith("-") else float("inf")
    if v.endswith("nan"):
        return float("nan")
    return float(v)


_Loader12.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:int",
                                                  "tag:yaml.org,2002:bool")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader12.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_12, list("tTfF"))
_Loader12.add_implicit_resolver("tag:yaml.org,2002:int", _INT_12, list("-+0123456789"))
_Loader12.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))
_Loader12.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader12.add_constructor("tag:yaml.org,2002:float", _construct_float)


def _unshare(x: Any) -> Any:
    """A copy of a YAML tree in which no two places share one object (anchors/aliases expanded)."""
    if isinstance(x, dict):
        return {k: _unshare(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unshare(v) for v in x]
    return x


def yaml_load(text: str, source: str = "<string>") -> Any:
    """Parse YAML text with the YAML 1.2 core schema (see the module docstring).

    Raises:
        ConfigError: invalid YAML or a duplicate key (naming both lines).
    """
    try:
        loader = _Loader12(text)
        loader.name = source
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from e
    return _unshare(data)


class RunConfig(StrictModel):
    """A whole config file: the model, a seed and a list of experiment steps.

    Fields:
        model: the model spec (``model:`` mapping, see the model spec section); default: the
            :class:`ModelSpec` defaults.
        seed: the run seed; Python, NumPy and torch RNGs are re-seeded with it before every step
            (default 0). Recorded in the run's manifest.
        description: free text recorded in the run's manifest (default none); no effect on results.
        experiments: the steps to run, in order (a list of mappings, each with a ``kind``; required).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)

    model: ModelSpec = Field(default_factory=ModelSpec)
    seed: int = 0
    description: Optional[str] = None
    experiments: list[Experiment]


_RETIRED = re.compile(r"^(?:(?P<field>[\w.]+)(?:\[(?P<i>\d+)\])?: )?'(?P<old>[^']+)' was renamed to .*$")


def _errors(e: ValidationError, prefix: tuple = ()) -> list[str]:
    """One line per error, each starting with its YAML path; a retired key or value
    (:mod:`tracekit.core.strict`) is reported at its own path: ``experiments[0].positions: 'positions'
    was renamed to 'position'``."""
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
            msg = "unknown key (check spelling; see `tracekit kinds` for each kind's fields)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        inp = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(inp, dict) else f" (got {inp!r})"
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
        problems += [m for m in _errors(e) if not m.startswith("experiments")]
        head = None
    steps: list[Experiment | PendingStep] = []  # PendingStep: a step taking earlier steps' results
    for i, step in enumerate(steps_raw):
        where = f"experiments[{i}]"
        if not isinstance(step, dict):
            problems.append(f"{where}: must be a mapping with a 'kind'")
            continue
        kind = step.get("kind")
        if kind not in REGISTRY:
            problems.append(f"{where}.kind: unknown experiment kind {kind!r}; known kinds: {sorted(REGISTRY)}")
            continue
        pending = make_step(step, i)  # pipeline: fields taking earlier steps' results (tracekit.pipeline)
        if pending is not None:
            steps.append(pending)
            continue
        try:
            steps.append(REGISTRY[kind].model_validate(step))
        except ValidationError as e:
            problems += _errors(e, ("experiments", i))
    problems += check_references(steps_raw)  # pipeline: references resolvable, in order, no cycle
    names = [s.step_name for s in steps]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"experiments: step names must be unique, repeated: {dup}; give each step a 'name'")
    if problems:
        raise ConfigError(f"{source}: invalid config:\n  " + "\n  ".join(problems))
    assert head is not None
    return RunConfig.model_construct(**{**dict(head), "experiments": steps})


def apply_override(raw: dict, assignment: str) -> dict:
    """Apply one ``path=value`` override (value parsed as YAML) to a raw config dict in place.

    Paths: ``model.device``, ``experiments[0].target``, ``experiments.0.target``.

    Raises:
        ConfigError: malformed assignment or a path through a missing list index.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected path=value, e.g. model.device=cpu")
    path, _, value_s = assignment.partition("=")
    try:
        paths.parse(path)
    except paths.PathError as e:
        raise ConfigError(f"--set {assignment!r}: {e}") from e
    try:
        value = yaml_load(value_s, f"--set {path}") if value_s.strip() else value_s
    except ConfigError:
        value = value_s
    if isinstance(value, str) and not value_s.lstrip().startswith(("'", '"')):
        # YAML would strip a leading space, and " Paris" is a different token from "Paris".
        value = value_s
    try:
        paths.set_path(raw, path, value, copy_value=False)
    except paths.PathError as e:
        raise ConfigError(f"--set {path.strip()}: {e}") from e
    return raw


def load_raw(path: str | Path) -> dict:
    """Read a YAML config file. Raises ConfigError on missing files or YAML syntax errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    raw = yaml_load(p.read_text(encoding="utf-8"), str(p))
    if raw is None:
        raise ConfigError(f"{p}: the file is empty")
    return raw


def load_config(path: str | Path, overrides: list[str] | tuple = ()) -> tuple[RunConfig, dict]:
    """Load, override and validate a config file. Returns ``(config, raw_after_overrides)``."""
    raw = load_raw(path)
    for a in overrides:
        apply_override(raw, a)
    return parse_config(raw, source=str(path)), raw
