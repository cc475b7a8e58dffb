"""Run configs: YAML parsed into pydantic models, with errors that name the YAML path.

A config file::

    model:                      # tracekit.models.ModelSpec
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

Steps are named so later steps can refer to earlier ones' results (``from_step``-style fields of
future kinds); ``sweep`` (reserved) will expand a step over field values.

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
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .experiments.base import REGISTRY, Experiment
from .models import ModelSpec
from .pipeline import check_references, make_step


from .errors import ConfigError  # noqa: E402  (re-exported)


class RunConfig(BaseModel):
    """A whole config file: the model, a seed and a list of experiment steps."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: ModelSpec = Field(default_factory=ModelSpec)
    seed: int = 0
    description: Optional[str] = None
    experiments: list[Experiment]


def _fmt_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _errors(e: ValidationError, prefix: tuple = ()) -> list[str]:
    msgs = []
    for err in e.errors():
        loc = prefix + tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check spelling; see `tracekit kinds` for each kind's fields)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        inp = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(inp, dict) else f" (got {inp!r})"
        msgs.append(f"{_fmt_loc(loc)}: {msg}{shown}")
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
    steps: list[Experiment] = []
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


_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def apply_override(raw: dict, assignment: str) -> dict:
    """Apply one ``path=value`` override (value parsed as YAML) to a raw config dict in place.

    Paths: ``model.device``, ``experiments[0].target``, ``experiments.0.target``.

    Raises:
        ConfigError: malformed assignment or a path through a missing list index.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected path=value, e.g. model.device=cpu")
    path, _, value_s = assignment.partition("=")
    keys: list[Any] = []
    for name, idx in _TOKEN.findall(path.strip()):
        keys.append(int(idx) if idx else (int(name) if name.isdigit() else name))
    if not keys:
        raise ConfigError(f"--set {assignment!r}: empty path")
    try:
        value = yaml.safe_load(value_s) if value_s.strip() else value_s
    except yaml.YAMLError:
        value = value_s
    if isinstance(value, str) and not value_s.lstrip().startswith(("'", '"')):
        # YAML would strip a leading space, and " Paris" is a different token from "Paris".
        value = value_s
    obj: Any = raw
    for j, k in enumerate(keys[:-1]):
        nxt = keys[j + 1]
        if isinstance(k, int):
            if not isinstance(obj, list) or k >= len(obj):
                raise ConfigError(f"--set {path}: index [{k}] does not exist")
            obj = obj[k]
        else:
            if not isinstance(obj, dict):
                raise ConfigError(f"--set {path}: {k!r} is not inside a mapping")
            obj = obj.setdefault(k, [] if isinstance(nxt, int) else {})
    last = keys[-1]
    if isinstance(last, int):
        if not isinstance(obj, list) or last >= len(obj):
            raise ConfigError(f"--set {path}: index [{last}] does not exist")
        obj[last] = value
    else:
        if not isinstance(obj, dict):
            raise ConfigError(f"--set {path}: cannot set {last!r} on a non-mapping")
        obj[last] = value
    return raw


def load_raw(path: str | Path) -> dict:
    """Read a YAML config file. Raises ConfigError on missing files or YAML syntax errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    if raw is None:
        raise ConfigError(f"{p}: the file is empty")
    return raw


def load_config(path: str | Path, overrides: list[str] | tuple = ()) -> tuple[RunConfig, dict]:
    """Load, override and validate a config file. Returns ``(config, raw_after_overrides)``."""
    raw = load_raw(path)
    for a in overrides:
        apply_override(raw, a)
    return parse_config(raw, source=str(path)), raw
