"""Sweep expansion: a config's ``sweep`` block -> validated :class:`Point` s (no model is loaded).

Field paths (``model.name``, ``experiments[0].target``) go through :mod:`tracekit.core.paths`.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import itertools
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig, apply_override, load_raw, parse_config
from ..core import paths
from ..core.errors import ConfigError
from ..core.io import jsonable
from ..inputs import input_files
from ..results import COMMON_SUMMARY_KEYS, experiment_class

__all__ = ["SWEEP_KEYS", "Point", "canonical_path", "check_compare", "config_hash", "derive_seed", "expand_sweep"]

SWEEP_KEYS = ("grid", "zip", "compare", "figures")


@dataclass
class Point:
    """One point of a sweep: its parameters and its validated config."""

    index: int
    params: dict            # path -> value set in the config
    names: dict             # path -> value shown in the index (the value's name, or the value)
    raw: dict               # the whole raw config of the point
    config: Any             # tracekit.config.RunConfig
    seed: int
    hash: str = ""

    @property
    def stem(self) -> str:
        return f"p{self.index:03d}"

    @property
    def model_key(self) -> str:
        return json.dumps(self.config.model.model_dump(mode="json"), sort_keys=True)

    @property
    def label(self) -> str:
        return _label(self.names)


def _short(v: Any, n: int = 40) -> str:
    s = v if isinstance(v, str) and not v.startswith(" ") else json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _label(names: dict) -> str:
    return ", ".join(f"{k}={_short(v)}" for k, v in names.items())


def _groups(points: list[Point]) -> list[list[Point]]:
    """The points grouped by model (first-seen order), so each model loads once."""
    g: dict[str, list[Point]] = {}
    for p in points:
        g.setdefault(p.model_key, []).append(p)
    return list(g.values())


def _axis(values: Any, where: str) -> list[tuple[Any, Any]]:
    """``[(shown, value), ...]`` from a list or a mapping name -> value."""
    if isinstance(values, dict):
        if not values:
            raise ConfigError(f"{where}: give at least one value")
        return [(str(k), v) for k, v in values.items()]
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: must be a non-empty list of values (or a mapping name -> value)")
    return [(v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v), v) for v in values]


def derive_seed(sweep_seed: int, params: dict) -> int:
    """A point's seed: a hash of the sweep seed and the point's parameters (stable across runs,
    machines and Python versions), in ``[0, 2**31)``."""
    blob = json.dumps({"seed": sweep_seed, "params": params}, sort_keys=True, default=str)
    return int(hashlib.sha256(blob.encode()).hexdigest()[:8], 16) % (2 ** 31)


def config_hash(config) -> str:
    """16 hex digits identifying a validated config (model, seed, every step's fields, and the
    contents of every data file it names: :func:`tracekit.inputs.input_files`), so a point whose
    ``pairs_file`` or corpus was edited is a new point, never a cached one."""
    steps = [s.model_dump(mode="json") for s in config.experiments]
    blob = {"model": config.model.model_dump(mode="json"), "seed": config.seed, "experiments": steps,
            "inputs": {k: v["sha256"] for k, v in input_files({"experiments": steps}).items()}}
    return hashlib.sha256(json.dumps(jsonable(blob), sort_keys=True).encode()).hexdigest()[:16]


def _load(config: str | Path | dict, overrides, source: str | None) -> tuple[dict, str]:
    """The raw config (a copy) with ``--set`` overrides applied, and the name errors give it."""
    if isinstance(config, (str, Path)):
        source = source or str(config)
        raw = load_raw(config)
    else:
        source = source or "<config>"
        raw = copy.deepcopy(config)
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    for a in overrides:
        apply_override(raw, a)
    return raw, source


def _spec(raw: dict, source: str) -> dict:
    spec = raw.get("sweep")
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{source}: sweep: must be a mapping with 'grid' and/or 'zip' (field path -> values)")
    unknown = [k for k in spec if k not in SWEEP_KEYS]
    if unknown:
        raise ConfigError(f"{source}: sweep: unknown key(s) {unknown}; known: {list(SWEEP_KEYS)}")
    if not spec.get("grid") and not spec.get("zip"):
        raise ConfigError(f"{source}: sweep: give 'grid' (every combination) and/or 'zip' (paired lists)")
    for k in ("grid", "zip"):
        if k in spec and not isinstance(spec[k], dict):
            raise ConfigError(f"{source}: sweep.{k}: must be a mapping field path -> list of values")
    return spec


def _check_path(path: str) -> None:
    try:
        paths.parse(path)
    except paths.PathError as e:
        raise ConfigError(f"sweep: {e}") from e


def _models_in(t: Any) -> list[type]:
    """Every pydantic model class in an annotation (``Optional[list[A | B]]`` -> ``[A, B]``)."""
    from pydantic import BaseModel

    if isinstance(t, type) and issubclass(t, BaseModel):
        return [t]
    return [m for a in typing.get_args(t) for m in _models_in(a)]


def canonical_path(path: str, base: dict) -> tuple:
    """The config field a swept path sets, spelled one way: list indices as numbers
    (``experiments.0`` and ``experiments[0]`` alike), negative indices counted from the end of
    ``base``'s list, and every key that names a field by its alias (``class``) as the field's name
    (``class_``), through the config classes (a step's class from its ``kind`` in ``base``). Keys
    that are no field (mapping values such as ``model.config_overrides.n_layer``) stay as written.

    Args:
        path: a field path (:mod:`tracekit.core.paths`).
        base: the raw config the path is set in (for list lengths and each step's ``kind``).

    Returns:
        The path's keys (str / int) as a tuple.

    Raises:
        ConfigError: the path cannot be parsed.
    """
    _check_path(path)
    node: Any = base
    models: list[type] = [RunConfig]
    out: list = []
    for k in paths.parse(path):
        if isinstance(k, int):
            if isinstance(node, list) and -len(node) <= k < len(node):
                k %= len(node)
                node = node[k]
            else:
                node = None
            out.append(k)
            if tuple(out) == ("experiments", k):  # a step: its kind's class holds its fields
                cls = experiment_class(node.get("kind")) if isinstance(node, dict) else None
                models = [cls] if cls is not None else []
            continue
        fields = [(name, f) for m in models for name, f in m.model_fields.items() if k in (name, f.alias)]
        name = fields[0][0] if fields else k
        out.append(name)
        node = node.get(k, node.get(name)) if isinstance(node, dict) else None
        models = [m for _, f in fields for m in _models_in(f.annotation)]
    return tuple(out)


def _check_each_field_once(where_paths: list[tuple[str, str]], base: dict, source: str) -> None:
    """Refuse two swept paths that set the same field (two spellings, an alias and its field, a
    step or mapping and a field inside it): one value would silently win over the other.

    Raises:
        ConfigError: naming both sweep entries and the field.
    """
    seen: list[tuple[str, tuple]] = []
    for where, path in where_paths:
        canon = canonical_path(path, base)
        for w2, c2 in seen:
            if canon == c2:
                raise ConfigError(f"{source}: {w2} and {where} both sweep the field {paths.fmt(c2)} (one would "
                                  "silently win over the other); sweep each field once")
            short, long_ = sorted([(w2, c2), (where, canon)], key=lambda x: len(x[1]))
            if long_[1][:len(short[1])] == short[1]:
                raise ConfigError(f"{source}: {short[0]} sweeps the whole of {paths.fmt(short[1])} and {long_[0]} "
                                  f"sweeps {paths.fmt(long_[1])} inside it (one would silently win over the "
                                  "other); sweep each field once")
        seen.append((where, canon))


def _axes(spec: dict, source: str, base: dict) -> list[list[dict]]:
    """The sweep's axes: one per ``grid`` path, one for all ``zip`` paths together; each axis a
    list of ``{path: (shown, value)}``.

    Raises:
        ConfigError: a bad path or value list, or two paths that set the same field
            (:func:`_check_each_field_once`).
    """
    axes: list[list[dict]] = []
    grid = spec.get("grid") or {}
    zipped = spec.get("zip") or {}
    _check_each_field_once([(f"sweep.grid[{p!r}]", p) for p in grid] + [(f"sweep.zip[{p!r}]", p) for p in zipped],
                           base, source)
    for path, values in grid.items():
        _check_path(path)
        axes.append([{path: sv} for sv in _axis(values, f"{source}: sweep.grid[{path!r}]")])
    if zipped:
        cols = {}
        for path, values in zipped.items():
            where = f"{source}: sweep.zip[{path!r}]"
            _check_path(path)
            cols[path] = _axis(values, where)
        lens = {p: len(v) for p, v in cols.items()}
        if len(set(lens.values())) > 1:
            raise ConfigError(f"{source}: sweep.zip: the lists must have the same length (they are paired), got {lens}")
        n = next(iter(lens.values()))
        axes.append([{p: cols[p][i] for p in cols} for i in range(n)])
    return axes


def _sweep_seed(raw: dict, source: str) -> int:
    sweep_seed = raw.get("seed", 0)
    if isinstance(sweep_seed, bool) or not isinstance(sweep_seed, int):
        raise ConfigError(f"{source}: seed: the sweep seed must be an integer (each point's seed derives from it), "
                          f"got {sweep_seed!r}")
    return sweep_seed


def _point_raw(base: dict, params: dict, sweep_seed: int, source: str) -> tuple[dict, int]:
    """A point's raw config (``base`` with ``params`` set) and its seed (derived unless swept)."""
    praw = copy.deepcopy(base)
    for p, v in params.items():
        try:
            paths.set_path(praw, p, v)
        except paths.PathError as e:
            raise ConfigError(f"{source}: sweep[{p!r}]: {p!r}: {e}") from None
    seed = praw.get("seed", 0) if "seed" in params else derive_seed(sweep_seed, params)
    praw["seed"] = seed
    return praw, seed


def _points(axes: list[list[dict]], base: dict, sweep_seed: int, source: str) -> list[Point]:
    """Every combination of the axes, validated; all invalid points are listed in one error."""
    points: list[Point] = []
    problems: list[str] = []
    for i, combo in enumerate(itertools.product(*axes)):
        chosen: dict = {}
        for part in combo:
            chosen.update(part)
        params = {p: v for p, (_, v) in chosen.items()}
        names = {p: s for p, (s, _) in chosen.items()}
        praw, seed = _point_raw(base, params, sweep_seed, source)
        try:
            cfg = parse_config(praw, source=f"point {i} ({_label(names)})")
        except ConfigError as e:
            problems.append(str(e))
            continue
        pt = Point(i, params, names, praw, cfg, seed)
        pt.hash = config_hash(cfg)
        points.append(pt)
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more invalid points"] if len(problems) > 10 else [])
        raise ConfigError(f"{source}: {len(problems)} sweep point(s) are invalid:\n" + "\n".join(shown))
    return points


def _check_distinct(points: list[Point], source: str) -> None:
    by_hash: dict = {}
    for p in points:
        if p.hash in by_hash:
            raise ConfigError(f"{source}: sweep points {by_hash[p.hash].index} ({by_hash[p.hash].label}) and "
                              f"{p.index} ({p.label}) are the same config; sweep values must differ")
        by_hash[p.hash] = p


def _declared_keys(kind: str) -> tuple[str, ...] | None:
    """The summary keys ``kind``'s result class declares (``summary_keys``), or None when it
    declares none (its keys cannot be known before it runs)."""
    cls = experiment_class(kind)
    keys = getattr(getattr(cls, "result_class", None), "summary_keys", None) if cls is not None else None
    return tuple(keys) + COMMON_SUMMARY_KEYS if keys is not None else None


def check_compare(points: list[Point], spec: dict, source: str = "<config>") -> list[str]:
    """Check the sweep's ``compare`` list before anything runs: each item is a metric
    (``step/key`` or a bare ``key`` of any step) or ``{metric, by}``; its step must be a step of
    the points, and its key a summary key that step's kind declares (the result class's
    ``summary_keys``) in at least one point. A step whose kind declares no keys cannot be ruled
    out (its key is checked when the figure is drawn); ``by`` must be a swept path.

    Args:
        points: the expanded points (:func:`expand_sweep`).
        spec: the sweep block.
        source: the config's name, for messages.

    Returns:
        The names of the kinds whose keys could not be checked (they declare none), for a note.

    Raises:
        ConfigError: every bad item in one message, naming the key and, where one is close, the
            known key it was probably meant to be (did you mean ...).
    """
    items = spec.get("compare") or []
    if not isinstance(items, list):
        raise ConfigError(f"{source}: sweep.compare: must be a list of metrics ('step/key') or {{metric, by}}")
    swept = [*(spec.get("grid") or {}), *(spec.get("zip") or {})]
    steps: dict[str, set[str]] = {}  # step name -> kinds it has in some point
    for p in points:
        for st in p.config.experiments:
            steps.setdefault(st.step_name, set()).add(st.kind)
    problems: list[str] = []
    unchecked: set[str] = set()
    for i, item in enumerate(items):
        where = f"sweep.compare[{i}]"
        metric, by = (item, None) if isinstance(item, str) else \
            (item.get("metric"), item.get("by")) if isinstance(item, dict) else (None, None)
        if not isinstance(metric, str) or not metric or (isinstance(item, dict) and set(item) - {"metric", "by"}):
            problems.append(f"{where}: must be a metric 'step/key' (or a summary key of any step) or a mapping "
                            f"{{metric: ..., by: ...}}, got {item!r}")
            continue
        for b in [by] if isinstance(by, str) else (by or []):
            if b not in swept:
                problems.append(f"{where}.by: {b!r} is not a swept path; swept: {swept}")
        step, _, key = metric.rpartition("/")
        if step and step not in steps:
            close = difflib.get_close_matches(step, list(steps), n=1)
            problems.append(f"{where}: {metric!r} names no step {step!r}" +
                            (f" (did you mean {close[0]!r}?)" if close else "") + f"; steps: {sorted(steps)}")
            continue
        kinds = sorted({k for s in ([step] if step else list(steps)) for k in steps[s]})
        declared = {k: _declared_keys(k) for k in kinds}
        if any(v is None for v in declared.values()):
            unchecked |= {k for k, v in declared.items() if v is None}
            continue
        known = sorted({x for v in declared.values() for x in (v or ())})
        head = re.split(r"[.\[]", key, maxsplit=1)[0]
        if head not in known:
            close = difflib.get_close_matches(head, known, n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            problems.append(f"{where}: {metric!r}: no summary key {head!r} in "
                            f"{'step ' + repr(step) if step else 'any step'} ({', '.join(kinds)}); {hint}"
                            f"known keys: {known}")
    if problems:
        raise ConfigError(f"{source}: " + "\n  ".join(problems))
    return sorted(unchecked)


def expand_sweep(config: str | Path | dict, overrides: list[str] | tuple = (), source: str | None = None
                 ) -> tuple[list[Point], dict]:
    """Expand a sweep config into validated points (no model is loaded).

    Args:
        config: a YAML path or a raw config dict with a ``sweep`` block.
        overrides: ``--set path=value`` assignments applied before expansion.

    Returns:
        ``(points, raw_config)``.

    Raises:
        ConfigError: a bad sweep block (unknown key, empty list, zip lists of different lengths, a
            field swept by two paths -- two spellings, an alias and its field, a step and a field
            inside it (:func:`canonical_path`) --, a path through a missing list item), any point whose config is
            invalid (every such point is listed with its parameters), two identical points, or a
            ``compare`` metric that matches no summary key (:func:`check_compare`).
    """
    raw, source = _load(config, overrides, source)
    spec = _spec(raw, source)
    base = {k: v for k, v in raw.items() if k != "sweep"}
    axes = _axes(spec, source, base)
    points = _points(axes, base, _sweep_seed(raw, source), source)
    _check_distinct(points, source)
    check_compare(points, spec, source)
    return points, raw
