"""Sweeps: one config expanded over field values, every point its own run, one index.

A config with a ``sweep`` block::

    model: {name: smollm2-135m}
    seed: 0                                   # the sweep seed: each point's seed derives from it
    experiments:
      - {kind: logit_lens, name: lens, prompts: ["The capital of France is"], target: " Paris"}
    sweep:
      grid:                                   # every combination (product) of these
        model.name: [smollm2-135m, gpt2]
        experiments[0].target: [" Paris", " London"]
      zip:                                    # paired lists (same length): one axis of the grid
        experiments[0].prompts:
          capitals: ["The capital of France is"]       # a mapping names its values (index shows the name)
          rivers: ["The river through Paris is the"]
        experiments[0].name: [lens_capitals, lens_rivers]
      compare: [lens/target_prob_by_hidden_state]    # figures overlaying a metric over points (optional)

Any field path works (``model.name``, ``experiments[0].target``, ``seed``). Unless ``seed`` is swept,
each point's ``seed`` is derived from the sweep seed and the point's parameters
(:func:`derive_seed`) and recorded, so the same sweep gives the same numbers.

``tracekit sweep CONFIG --out DIR`` writes::

    DIR/sweep.yaml                   the config as given (after --set)
    DIR/index.parquet                one row per point (written atomically after every point)
    DIR/runs/<hash>/<pNNN>-<time>/   the point's run directory (tracekit run's layout)
    DIR/runs/<hash>/point.json       the point's record: parameters, seed, status, error, timings
    DIR/compare-<metric>.png         figures named in ``compare``

``<hash>`` is :func:`config_hash` of the point's validated config. Rerunning a sweep into the same
``DIR`` continues it: a point whose hash already has a complete run (``status.json`` says
``complete``) is skipped, anything partial is deleted and redone from scratch. A failing point
records its error and the sweep goes on; the exit code is 1 when any point failed (130 when
interrupted, 2 for an invalid config). Killing the process loses at most the points in flight.

Index columns: ``point``, ``label``, ``config_hash``, ``seed``, ``status``, ``error``, ``run_dir``,
``started``, ``seconds``; one column per swept path (the value, or its name when values are named);
``<step>/<summary key>`` for every number (and string) of every step's summary, nested keys
joined by ``.`` and lists by ``[i]`` (``lens/target_prob_by_hidden_state[3]``); ``summary`` (all step
summaries as JSON); ``env/...`` (device, package versions, git commit, load/step seconds).
:func:`load_results` reads it; :func:`compare` draws one metric over points.

Executors: ``local`` groups the points by model so each model loads once; ``ray`` (the
``sweeps`` extra) runs one actor per GPU (or ``--workers N`` CPU actors without GPUs), each keeping
its model loaded, with points handed to actors by model; workers write run directories into the
shared ``DIR`` and the driver keeps the index.
"""

from __future__ import annotations

import copy
import datetime as _dt
import fcntl
import gc
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core import paths
from .core.errors import ConfigError, ResultLoadError, TracekitError
from .core.io import atomic_write

__all__ = [
    "INDEX",
    "Point",
    "SweepOutcome",
    "compare",
    "config_hash",
    "derive_seed",
    "expand_sweep",
    "load_results",
    "run_status",
    "run_sweep",
    "stable_columns",
]

INDEX = "index.parquet"
SWEEP_KEYS = ("grid", "zip", "compare")
#: Index columns that differ between two runs of the same sweep (times, places).
VOLATILE = ("run_dir", "started", "seconds")


# =============================================================================================
# expansion


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
        return ", ".join(f"{k}={_short(v)}" for k, v in self.names.items())


def _short(v: Any, n: int = 40) -> str:
    s = v if isinstance(v, str) and not v.startswith(" ") else json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _keys(path: str) -> tuple:
    try:
        return paths.parse(path)
    except paths.PathError as e:
        raise ConfigError(f"sweep: {e}") from e


def set_path(raw: dict, path: str, value: Any, where: str) -> None:
    """Set ``path`` (``model.name``, ``experiments[0].target``) in a raw config, in place (a copy of
    ``value``; :func:`tracekit.core.paths.set_path`).

    Raises:
        ConfigError: the path runs through a missing list item or a non-mapping (names ``where``).
    """
    try:
        paths.set_path(raw, path, value)
    except paths.PathError as e:
        raise ConfigError(f"{where}: {path!r}: {e}") from e


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
    from .experiments.base import jsonable
    from .inputs import input_files

    steps = [s.model_dump(mode="json") for s in config.experiments]
    blob = {"model": config.model.model_dump(mode="json"), "seed": config.seed, "experiments": steps,
            "inputs": {k: v["sha256"] for k, v in input_files({"experiments": steps}).items()}}
    return hashlib.sha256(json.dumps(jsonable(blob), sort_keys=True).encode()).hexdigest()[:16]


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
            path swept twice, a path through a missing list item), any point whose config is
            invalid (every such point is listed with its parameters), or two identical points.
    """
    from .config import apply_override, load_raw, parse_config

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
    spec = _spec(raw, source)
    base = {k: v for k, v in raw.items() if k != "sweep"}
    axes: list[list[dict]] = []  # each axis: list of {path: (shown, value)}
    seen: set = set()
    for path, values in (spec.get("grid") or {}).items():
        where = f"{source}: sweep.grid[{path!r}]"
        _keys(path)
        seen.add(path)
        axes.append([{path: sv} for sv in _axis(values, where)])
    zipped = spec.get("zip") or {}
    if zipped:
        cols = {}
        for path, values in zipped.items():
            where = f"{source}: sweep.zip[{path!r}]"
            _keys(path)
            if path in seen:
                raise ConfigError(f"{where}: {path!r} is also in sweep.grid; sweep each field once")
            cols[path] = _axis(values, where)
        lens = {p: len(v) for p, v in cols.items()}
        if len(set(lens.values())) > 1:
            raise ConfigError(f"{source}: sweep.zip: the lists must have the same length (they are paired), got {lens}")
        n = next(iter(lens.values()))
        axes.append([{p: cols[p][i] for p in cols} for i in range(n)])
    sweep_seed = raw.get("seed", 0)
    if isinstance(sweep_seed, bool) or not isinstance(sweep_seed, int):
        raise ConfigError(f"{source}: seed: the sweep seed must be an integer (each point's seed derives from it), "
                          f"got {sweep_seed!r}")
    points: list[Point] = []
    problems: list[str] = []
    for i, combo in enumerate(itertools.product(*axes)):
        chosen: dict = {}
        for part in combo:
            chosen.update(part)
        params = {p: v for p, (_, v) in chosen.items()}
        names = {p: s for p, (s, _) in chosen.items()}
        praw = copy.deepcopy(base)
        try:
            for p, v in params.items():
                set_path(praw, p, v, f"{source}: sweep[{p!r}]")
        except ConfigError as e:
            raise ConfigError(str(e)) from None
        seed = praw.get("seed", 0) if "seed" in params else derive_seed(sweep_seed, params)
        praw["seed"] = seed
        label = ", ".join(f"{k}={_short(v)}" for k, v in names.items())
        try:
            cfg = parse_config(praw, source=f"point {i} ({label})")
        except ConfigError as e:
            problems.append(str(e))
            continue
        pt = Point(i, params, names, praw, cfg, seed)
        pt.hash = config_hash(cfg)
        points.append(pt)
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more invalid points"] if len(problems) > 10 else [])
        raise ConfigError(f"{source}: {len(problems)} sweep point(s) are invalid:\n" + "\n".join(shown))
    by_hash: dict = {}
    for p in points:
        if p.hash in by_hash:
            raise ConfigError(f"{source}: sweep points {by_hash[p.hash].index} ({by_hash[p.hash].label}) and "
                              f"{p.index} ({p.label}) are the same config; sweep values must differ")
        by_hash[p.hash] = p
    return points, raw


# =============================================================================================
# run directories, records, index


def run_status(run_dir: str | Path) -> str:
    """``complete``, ``failed``, ``interrupted``, ``running`` (also a run killed mid-way) or
    ``missing``: the run's ``status.json``; without one (older runners), ``complete`` when the
    run wrote ``summary.json`` and no ``error.txt``."""
    d = Path(run_dir)
    if not d.is_dir():
        return "missing"
    st = d / "status.json"
    if st.is_file():
        try:
            return str(json.loads(st.read_text()).get("status", "running"))
        except (OSError, json.JSONDecodeError):
            return "running"
    if (d / "error.txt").is_file():
        return "failed"
    return "complete" if (d / "summary.json").is_file() else "running"


def _runs_of(out: Path, h: str) -> list[Path]:
    d = out / "runs" / h
    return sorted((p for p in d.iterdir() if p.is_dir()), key=lambda p: p.name) if d.is_dir() else []


def _complete_run(out: Path, h: str) -> Path | None:
    done = [p for p in _runs_of(out, h) if run_status(p) == "complete"]
    return done[-1] if done else None


def _record_path(out: Path, h: str) -> Path:
    return out / "runs" / h / "point.json"


def _quiet(*args, **kwargs) -> None:
    pass


def execute_point(point: Point, out: str | Path, model=None) -> dict:
    """Run one point into ``out/runs/<hash>/`` (partial runs of the same hash are deleted first)
    and write its record ``point.json``. Errors are recorded, not raised (KeyboardInterrupt is)."""
    from .runner import run_config

    out = Path(out)
    hdir = out / "runs" / point.hash
    hdir.mkdir(parents=True, exist_ok=True)
    for old in _runs_of(out, point.hash):
        if run_status(old) != "complete":
            shutil.rmtree(old, ignore_errors=True)
    started = _dt.datetime.now().isoformat(timespec="seconds")
    t0 = time.time()
    rec = {"point": point.index, "config_hash": point.hash, "params": point.params, "names": point.names,
           "seed": point.seed, "started": started, "status": "running", "error": None, "run_dir": None}
    status, error, run_dir = "failed", None, None
    try:
        run_dir, _ = run_config(point.config, hdir, stem=point.stem, model=model, progress=False, log=_quiet)
        status = run_status(run_dir)
        if status != "complete":  # a runner that records a failure without raising
            error = (run_dir / "error.txt").read_text().strip() if (run_dir / "error.txt").is_file() else status
    except KeyboardInterrupt:
        rec.update(status="interrupted", seconds=round(time.time() - t0, 3))
        atomic_write(_record_path(out, point.hash), json.dumps(rec, indent=2, default=str))
        raise
    except Exception as e:  # noqa: BLE001 - a failing point is recorded; the sweep goes on
        error = f"{type(e).__name__}: {e}"
        runs = _runs_of(out, point.hash)
        run_dir = runs[-1] if runs else None
    rec.update(status=status, error=error, seconds=round(time.time() - t0, 3),
               run_dir=str(Path(run_dir).relative_to(out)) if run_dir else None)
    atomic_write(_record_path(out, point.hash), json.dumps(rec, indent=2, default=str))
    return rec


def _failed_record(point: Point, error: str) -> dict:
    return {"point": point.index, "config_hash": point.hash, "params": point.params, "names": point.names,
            "seed": point.seed, "started": _dt.datetime.now().isoformat(timespec="seconds"), "status": "failed",
            "error": error, "run_dir": None, "seconds": 0.0}


def _flatten(obj: Any, prefix: str, out: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        out[prefix] = obj


def _row(out: Path, point: Point, rec: dict) -> dict:
    row: dict = {"point": point.index, "label": point.label, "config_hash": point.hash, "seed": point.seed,
                 "status": rec.get("status", "pending"), "error": rec.get("error"), "run_dir": rec.get("run_dir"),
                 "started": rec.get("started"), "seconds": rec.get("seconds")}
    for p, shown in point.names.items():
        row[p] = shown
    rd = out / rec["run_dir"] if rec.get("run_dir") else None
    summary: dict = {}
    if rd is not None and (rd / "summary.json").is_file():
        try:
            summary = json.loads((rd / "summary.json").read_text()).get("steps", {})
        except (OSError, json.JSONDecodeError):
            summary = {}
    for step, s in summary.items():
        flat: dict = {}
        _flatten(s, "", flat)
        for k, v in flat.items():
            row[f"{step}/{k.lstrip('.')}"] = v
    row["summary"] = json.dumps(summary, sort_keys=True) if summary else None
    if rd is not None and (rd / "environment.json").is_file():
        try:
            env = json.loads((rd / "environment.json").read_text())
        except (OSError, json.JSONDecodeError):
            env = {}
        vers = env.get("versions", {})
        for k in ("tracekit", "torch", "transformer-lens", "transformers"):
            row[f"env/{k}"] = vers.get(k)
        for k in ("device", "git_commit", "dtype", "model_load_s", "total_s"):
            row[f"env/{k}"] = env.get(k)
        for k, v in (env.get("step_seconds") or {}).items():
            row[f"env/step_seconds.{k}"] = v
    return row


def _sanitize(df):
    import pandas as pd

    for c in df.columns:
        if df[c].dtype == object:
            vals = df[c].dropna()
            types = {type(v) for v in vals}
            if len(types) > 1 or (types and not types <= {str, bool}):
                if types <= {int, float}:
                    df[c] = pd.to_numeric(df[c])
                else:
                    df[c] = df[c].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v))
                                      else str(v))
    return df


def build_index(out: str | Path, points: list[Point], records: dict[int, dict]):
    """The index DataFrame: one row per point (``status: pending`` where nothing ran yet)."""
    import pandas as pd

    out = Path(out)
    rows = [_row(out, p, records.get(p.index, {"status": "pending"})) for p in points]
    df = pd.DataFrame(rows)
    head = ["point", "label", *points[0].names.keys(), "status", "error", "seed", "config_hash", "run_dir",
            "started", "seconds"] if points else []
    head = list(dict.fromkeys(head))
    rest = sorted(c for c in df.columns if c not in head and not c.startswith("env/") and c != "summary")
    env = sorted(c for c in df.columns if c.startswith("env/"))
    df = df[[c for c in head if c in df.columns] + rest + (["summary"] if "summary" in df.columns else []) + env]
    return _sanitize(df.reset_index(drop=True))


def write_index(out: str | Path, df) -> Path:
    """Write ``index.parquet`` atomically (temporary file + rename)."""
    return atomic_write(Path(out) / INDEX, lambda p: df.to_parquet(p, index=False))


def load_results(directory: str | Path):
    """A sweep's index (``DIR/index.parquet``) as a pandas DataFrame, one row per point.

    Raises:
        ResultLoadError: the folder holds no sweep index.
    """
    import pandas as pd

    p = Path(directory)
    f = p if p.suffix == ".parquet" else p / INDEX
    if not f.is_file():
        raise ResultLoadError(f"{p} is not a sweep directory (no {INDEX}); pass the --out folder of "
                              "`tracekit sweep`")
    return pd.read_parquet(f)


def stable_columns(df):
    """The index without the columns that differ between two runs of the same sweep (run
    directories, start times, durations, environment): what must be equal for the same sweep."""
    drop = [c for c in df.columns if c in VOLATILE or c.startswith("env/")]
    return df.drop(columns=drop)


# =============================================================================================
# executors


@dataclass
class SweepOutcome:
    """What :func:`run_sweep` did."""

    out: Path
    index: Any                                    # pandas DataFrame
    ran: list[int] = field(default_factory=list)  # points run now
    skipped: list[int] = field(default_factory=list)  # complete before
    failed: list[int] = field(default_factory=list)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else (1 if self.failed else 0)


def _groups(points: list[Point]) -> list[list[Point]]:
    g: dict[str, list[Point]] = {}
    for p in points:
        g.setdefault(p.model_key, []).append(p)
    return list(g.values())


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled or total == 0, unit="point", dynamic_ncols=True,
                file=sys.stderr, desc="sweep")


def _run_local(todo: list[Point], out: Path, on_record: Callable, progress: bool, log) -> None:
    from .model.load import load_model

    bar = _progress(len(todo), progress)
    try:
        for group in _groups(todo):
            spec = group[0].config.model
            bar.set_postfix_str(f"loading {spec.name}")
            try:
                model = load_model(spec)
            except Exception as e:  # noqa: BLE001 - every point of this model fails, the sweep goes on
                for p in group:
                    on_record(p, _failed_record(p, f"{type(e).__name__}: {e}"))
                    bar.update(1)
                continue
            try:
                for p in group:
                    bar.set_postfix_str(p.label[:60])
                    on_record(p, execute_point(p, out, model))
                    bar.update(1)
            finally:
                del model
                gc.collect()
    finally:
        bar.close()


class _RayWorker:
    """A Ray actor: keeps the last model it loaded and runs points into the shared output dir."""

    def __init__(self, env: dict):
        os.environ.update(env)
        import warnings

        warnings.filterwarnings("ignore")
        self.key: str | None = None
        self.model = None

    def run(self, point: Point, out: str) -> dict:
        from .model.load import load_model

        if point.model_key != self.key:
            self.model, self.key = None, None
            gc.collect()
            try:
                self.model = load_model(point.config.model)
            except Exception as e:  # noqa: BLE001
                return _failed_record(point, f"{type(e).__name__}: {e}")
            self.key = point.model_key
        return execute_point(point, out, self.model)


def _ray_env() -> dict:
    pkg_root = str(Path(__file__).resolve().parents[1])
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "MPLBACKEND",
                                      "TOKENIZERS_PARALLELISM") if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and p != pkg_root])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run_ray(todo: list[Point], out: Path, on_record: Callable, progress: bool, log, address: str | None,
             workers: int | None) -> None:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--executor ray needs Ray: pip install 'tracekit[sweeps]' (or pip install 'ray[default]')"
                          ) from e
    env = _ray_env()
    started_here = not ray.is_initialized()
    if started_here:
        kw: dict = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True,
                    "runtime_env": {"env_vars": env}}
        if address:
            ray.init(address=address, **kw)
        else:
            ray.init(num_cpus=max(1, workers or min(4, os.cpu_count() or 1)), object_store_memory=200 * 2 ** 20, **kw)
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus > 0:
            n, opts = gpus, {"num_gpus": 1, "num_cpus": 1}
        else:
            n = max(1, workers or int(ray.cluster_resources().get("CPU", 1)))
            opts = {"num_cpus": 1}
        n = min(n, len(todo)) or 1
        Actor = ray.remote(**opts)(_RayWorker)
        actors = [Actor.remote(env) for _ in range(n)]
        log(f"ray: {n} {'GPU' if gpus else 'CPU'} actor(s) for {len(todo)} point(s)")
        pending: dict[str, list[Point]] = {}
        for p in todo:
            pending.setdefault(p.model_key, []).append(p)
        current: dict[int, str | None] = {a: None for a in range(n)}
        inflight: dict = {}
        bar = _progress(len(todo), progress)

        def next_point(a: int) -> Point | None:
            key = current[a]
            if not (pending.get(key)):
                busy = {k: sum(1 for b in current if current[b] == k and b != a) for k in pending}
                cands = [k for k in pending if pending[k]]
                if not cands:
                    return None
                key = max(cands, key=lambda k: len(pending[k]) / (1 + busy.get(k, 0)))
            current[a] = key
            p = pending[key].pop(0)
            if not pending[key]:
                del pending[key]
            return p

        try:
            idle = list(range(n))
            while pending or inflight:
                while idle and pending:
                    a = idle.pop(0)
                    p = next_point(a)
                    if p is None:
                        break
                    inflight[actors[a].run.remote(p, str(out))] = (a, p)
                done, _ = ray.wait(list(inflight), num_returns=1)
                for ref in done:
                    a, p = inflight.pop(ref)
                    try:
                        rec = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - the actor died (OOM, crash): record and replace it
                        rec = _failed_record(p, f"{type(e).__name__}: {e}")
                        actors[a] = Actor.remote(env)
                        current[a] = None
                    on_record(p, rec)
                    bar.update(1)
                    idle.append(a)
        finally:
            bar.close()
    finally:
        if started_here:
            ray.shutdown()


def run_sweep(config: str | Path | dict, out: str | Path, overrides: list[str] | tuple = (), executor: str = "local",
              workers: int | None = None, address: str | None = None, progress: bool = True,
              log: Callable = print) -> SweepOutcome:
    """Run (or continue) a sweep into ``out``; see the module docstring.

    Args:
        config: YAML path or raw dict with a ``sweep`` block.
        out: the sweep folder (created; rerun into the same folder to continue).
        executor: ``local`` or ``ray``. workers: Ray CPU actors when there are no GPUs.
        address: Ray cluster address (``auto``: the running cluster); default: a local Ray.

    Returns:
        A :class:`SweepOutcome` (its ``exit_code``: 0, 1 when a point failed, 130 when interrupted).

    Raises:
        ConfigError: invalid sweep or point configs (before anything runs), another sweep running
            into ``out``, unknown executor.
        OutputError: ``out`` cannot be written.
    """
    from .errors import OutputError

    if executor not in ("local", "ray"):
        raise ConfigError(f"--executor: unknown executor {executor!r}; use 'local' or 'ray'")
    points, raw = expand_sweep(config, overrides)
    out = Path(out)
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot create the sweep folder: {e.strerror or e}") from e
    lock = open(out / ".sweep.lock", "w")  # noqa: SIM115 - held for the whole sweep, closed in finally
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        lock.close()
        raise ConfigError(f"--out {out}: another sweep is running into this folder; wait for it or use another "
                          "--out") from e
    try:
        import yaml

        atomic_write(out / "sweep.yaml", yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
        records: dict[int, dict] = {}
        todo: list[Point] = []
        skipped: list[int] = []
        for p in points:
            done = _complete_run(out, p.hash)
            if done is None:
                todo.append(p)
                continue
            rec = {}
            rp = _record_path(out, p.hash)
            if rp.is_file():
                try:
                    rec = json.loads(rp.read_text())
                except (OSError, json.JSONDecodeError):
                    rec = {}
            if rec.get("run_dir") != str(done.relative_to(out)) or rec.get("status") != "complete":
                env = json.loads((done / "environment.json").read_text()) if (done / "environment.json").is_file() \
                    else {}
                rec = {"status": "complete", "error": None, "run_dir": str(done.relative_to(out)),
                       "started": env.get("started"), "seconds": env.get("total_s")}
            records[p.index] = rec
            skipped.append(p.index)
        log(f"sweep: {len(points)} point(s), {len(skipped)} already complete, {len(todo)} to run "
            f"({len(_groups(todo))} model(s)); index: {out / INDEX}")
        outcome = SweepOutcome(out, None, skipped=skipped)
        write_index(out, build_index(out, points, records))

        stop = {"asked": False}

        def on_record(p: Point, rec: dict) -> None:
            records[p.index] = rec
            outcome.ran.append(p.index)
            write_index(out, build_index(out, points, records))
            if rec["status"] != "complete":
                log(f"point {p.index} ({p.label}) {rec['status']}: {str(rec.get('error')).splitlines()[0]}")
            if stop["asked"]:  # the signal's KeyboardInterrupt was swallowed (e.g. inside a weakref callback)
                raise KeyboardInterrupt

        def on_signal(signum):
            stop["asked"] = True
            raise KeyboardInterrupt

        from .core.signals import interrupt_handler

        try:
            with interrupt_handler(on_signal):
                if not todo:
                    pass
                elif executor == "ray":
                    _run_ray(todo, out, on_record, progress, log, address, workers)
                else:
                    _run_local(todo, out, on_record, progress, log)
        except KeyboardInterrupt:
            outcome.interrupted = True
            for p in todo:
                if p.index not in records and _runs_of(out, p.hash):
                    records[p.index] = {"status": "interrupted", "error": "interrupted (KeyboardInterrupt)"}
        df = build_index(out, points, records)
        write_index(out, df)
        outcome.index = df
        outcome.failed = [int(r.point) for r in df.itertuples() if r.status == "failed"]
        spec = raw.get("sweep", {})
        for item in spec.get("compare") or []:
            metric, by = (item, None) if isinstance(item, str) else (item.get("metric"), item.get("by"))
            try:
                fig = compare(df, metric, by=by)
            except (KeyError, ValueError) as e:
                log(f"compare {metric!r}: {e}")
                continue
            fig.savefig(out / f"compare-{_safe(metric)}.png", dpi=110, bbox_inches="tight")
            from .plotting import plt

            plt().close(fig)
        return outcome
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def _safe(s: str) -> str:
    return re.sub(r"[^\w.-]+", "_", s).strip("_")


# =============================================================================================
# comparison figure


def compare(index, metric: str, by: str | list[str] | None = None, title: str | None = None):
    """One metric over the points of a sweep, in one figure.

    A list-valued summary metric (``lens/target_prob_by_hidden_state`` or just ``target_prob_by_hidden_state``:
    every step with that key) is drawn as one curve per point over the list index (e.g. the lens
    curve of ' Paris' per model); a scalar one as bars. ``by``: the swept path(s) naming the
    series (default: every swept parameter).

    Raises:
        KeyError: no point has the metric (the message lists the summary metrics there are).
    """
    import numpy as np

    from .plotting import bars, curves, plt

    df = load_results(index) if isinstance(index, (str, Path)) else index
    step_cols = [c for c in df.columns if "/" in c and not c.startswith("env/")]
    pat = re.compile(r"^(?:(?P<step>[^/]+)/)?(?P<key>.+?)(?:\[(?P<i>\d+)\])?$")
    want = metric if "/" in metric else None

    def matches(c: str) -> tuple[str, int | None] | None:
        m = pat.match(c)
        if not m or m.group("step") is None:
            return None
        if want is not None:
            if f"{m.group('step')}/{m.group('key')}" != want:
                return None
        elif m.group("key") != metric:
            return None
        return m.group("step"), (int(m.group("i")) if m.group("i") is not None else None)

    hits = {c: matches(c) for c in step_cols}
    hits = {c: h for c, h in hits.items() if h is not None}
    if not hits:
        keys = sorted({re.sub(r"\[\d+\]$", "", c) for c in step_cols})
        raise KeyError(f"no point has the summary metric {metric!r}; metrics: {keys[:40]}")
    swept = [c for c in df.columns if c in set(df.columns) and c not in step_cols and not c.startswith("env/")
             and c not in ("point", "label", "config_hash", "seed", "status", "error", "run_dir", "started",
                           "seconds", "summary")]
    by_cols = [by] if isinstance(by, str) else (by or swept)
    for b in by_cols:
        if b not in df.columns:
            raise KeyError(f"by: {b!r} is not a column of the index; swept parameters: {swept}")

    def name(r) -> str:
        return ", ".join(str(r[b]) for b in by_cols) if by_cols else f"point {r['point']}"

    listy = any(i is not None for _, i in hits.values())
    p = plt()
    if listy:
        series: dict = {}
        n = 1 + max(i for _, i in hits.values() if i is not None)
        for _, r in df.iterrows():
            y = np.full(n, np.nan)
            for c, (_, i) in hits.items():
                if i is not None and r.get(c) is not None and not (isinstance(r[c], float) and np.isnan(r[c])):
                    y[i] = float(r[c])
            if np.isfinite(y).any():
                series[name(r)] = y
        fig, ax = p.subplots(figsize=(7, 4))
        curves(ax, np.arange(n), series)
        ax.set_xlabel("index (e.g. layer / hidden state)")
        ax.set_ylabel(metric)
        ax.set_title(title or f"{metric} per point")
        fig.tight_layout()
        return fig
    vals = {}
    for _, r in df.iterrows():
        for c in hits:
            v = r.get(c)
            if v is not None and isinstance(v, (int, float, np.number)) and np.isfinite(float(v)):
                vals[name(r)] = float(v)
    if not vals:
        raise ValueError(f"{metric!r} has no numeric value in any point")
    return bars(vals, title=title or f"{metric} per point", ylabel=metric)


# =============================================================================================
# command line (wired into tracekit.cli)


def add_commands(sub) -> None:
    """Add ``sweep`` and ``results`` to the CLI's subparsers."""
    s = sub.add_parser("sweep", help="run a config's sweep block: one run per point, an index (resumable)")
    s.add_argument("config")
    s.add_argument("--out", required=True, help="the sweep folder; rerun into it to continue a stopped sweep")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    s.add_argument("--executor", choices=["local", "ray"], default="local")
    s.add_argument("--address", default=None, help="Ray cluster address (auto = the running cluster)")
    s.add_argument("--workers", type=int, default=None, help="Ray CPU actors when there are no GPUs")
    s.add_argument("--dry-run", action="store_true", help="list the points and exit (no model is loaded)")
    s.add_argument("--no-progress", action="store_true")
    r = sub.add_parser("results", help="print a sweep's index (and draw a comparison figure)")
    r.add_argument("directory")
    r.add_argument("--columns", default=None, help="comma-separated index columns to show (default: a summary)")
    r.add_argument("--plot", default=None, metavar="METRIC", help="draw METRIC over points (e.g. "
                   "lens/target_prob_by_hidden_state)")
    r.add_argument("--by", default=None, help="swept path naming each series (default: all swept paths)")
    r.add_argument("--output", default=None, help="figure file (default: DIR/compare-METRIC.png)")


COMMANDS = ("sweep", "results")


def _print_index(df, columns: str | None) -> None:
    from .plotting import text_table

    if columns:
        cols = [c.strip() for c in columns.split(",") if c.strip()]
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise KeyError(f"--columns: no column(s) {missing}; columns: {list(df.columns)}")
    else:
        fixed = ["point"]
        swept = [c for c in df.columns if "/" not in c and c not in ("point", "label", "config_hash", "seed", "status",
                                                                     "error", "run_dir", "started", "seconds",
                                                                     "summary")]
        nums = [c for c in df.columns if "/" in c and not c.startswith("env/") and "[" not in c
                and df[c].dtype.kind in "fi" and df[c].notna().any()]
        nums.sort(key=lambda c: -int(df[c].notna().sum()))  # the numbers most points have first
        cols = fixed + swept + ["status", "seconds"] + nums[:6]
    rows = []
    for _, r in df[cols].iterrows():
        rows.append([(f"{v:.4g}" if isinstance(v, float) else "" if v is None else
                      repr(v) if isinstance(v, str) and v[:1].isspace() else str(v))[:40] for v in r])
    print(text_table(rows, cols))


def main(args) -> int:
    """``tracekit sweep`` / ``tracekit results``; returns the exit code."""
    if args.cmd == "results":
        try:
            df = load_results(args.directory)
            _print_index(df, args.columns)
            if args.plot:
                fig = compare(df, args.plot, by=args.by)
                dest = Path(args.output) if args.output else Path(args.directory) / f"compare-{_safe(args.plot)}.png"
                fig.savefig(dest, dpi=110, bbox_inches="tight")
                print(f"figure: {dest}")
        except (TracekitError, KeyError, ValueError) as e:
            print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
            return 2
        failed = df[df["status"] == "failed"]
        if len(failed):
            print(f"{len(failed)} failed point(s): {failed['point'].tolist()}")
        return 0
    try:
        if args.dry_run:
            points, _ = expand_sweep(args.config, args.overrides)
            for p in points:
                print(f"point {p.index:3d} seed {p.seed:10d} hash {p.hash}  {p.label}")
            print(f"{len(points)} point(s), {len(_groups(points))} model(s)")
            return 0
        import logging

        logging.getLogger("transformers").setLevel(logging.ERROR)
        if args.no_progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        outcome = run_sweep(args.config, args.out, args.overrides, executor=args.executor, workers=args.workers,
                            address=args.address, progress=not args.no_progress)
    except TracekitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    df = outcome.index
    n_ok = int((df["status"] == "complete").sum())
    print(f"sweep: {n_ok}/{len(df)} point(s) complete ({len(outcome.skipped)} from before, "
          f"{len(outcome.ran)} run now); "
          f"index: {outcome.out / INDEX}")
    if outcome.failed:
        print(f"{len(outcome.failed)} point(s) failed:", file=sys.stderr)
        for r in df[df["status"] == "failed"].itertuples():
            print(f"  point {r.point} ({r.label}): {str(r.error).splitlines()[0]}", file=sys.stderr)
    if outcome.interrupted:
        print("interrupted: rerun the same command to continue", file=sys.stderr)
    return outcome.exit_code
