"""Sweep executors: run one point (:func:`execute_point`), all points locally (one model load per
model) or on Ray actors (one per GPU, or ``--workers N`` CPU actors), each keeping its model loaded."""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ..core.errors import ConfigError
from ..core.io import atomic_write
from ..core.progress import progress_bar
from ..experiments.onepass import SharedPasses, shared_passes
from ..model.info import HookedModel
from ..model.load import load_model
from ..runner import run_config
from .expand import Point, _groups
from .index import _failed_record, _record_path, _runs_of, run_status

__all__ = ["execute_point"]


def _quiet(*args, **kwargs) -> None:
    pass


def _run_point_config(point: Point, hdir: Path, model: HookedModel | None, figures: bool):
    """``run_config`` for one point; ``figures=False`` leaves out each step's PNGs (the slowest part
    of saving a small step; ``Result.load(...).figures()`` draws them later)."""
    return run_config(point.config, hdir, stem=point.stem, model=model, progress=False, log=_quiet,
                      figures=figures)


def execute_point(point: Point, out: str | Path, model: HookedModel | None = None, figures: bool = True) -> dict:
    """Run one point into ``out/runs/<hash>/`` (partial runs of the same hash are deleted first)
    and write its record ``point.json``. Errors are recorded, not raised (KeyboardInterrupt is).

    Args:
        point: the point.
        out: the sweep folder.
        model: the loaded model (default: the runner loads the point's).
        figures: write each step's figures (PNG) into its folder.

    Returns:
        The point's record (``status``, ``error``, ``run_dir`` relative to ``out``, ``seconds``...).
    """
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
        run_dir, _ = _run_point_config(point, hdir, model, figures)
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


def _progress(total: int, enabled: bool):
    """The sweep's bar over points (bars off: a line with points done and the ETA every 30 s)."""
    if enabled and total:
        return progress_bar(total=total, unit="point", desc="sweep", dynamic_ncols=True, file=sys.stderr)
    return progress_bar(total=total, unit="point", desc="sweep", enabled=False)


def _run_local(todo: list[Point], out: Path, on_record: Callable, progress: bool, log, figures: bool = False
               ) -> SharedPasses:
    """Run the points, grouped by model (each model loaded once); logit-lens steps differing only in
    ``target`` share one pass (:mod:`tracekit.experiments.onepass`). Returns the shared passes."""
    bar = _progress(len(todo), progress)
    shared = SharedPasses(s for p in todo for s in p.config.experiments)
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
                with shared_passes(shared):
                    for p in group:
                        bar.set_postfix_str(p.label[:60])
                        on_record(p, execute_point(p, out, model, figures=figures))
                        bar.update(1)
            finally:
                shared.cache.clear()  # the passes of this model
                del model
                gc.collect()
    finally:
        bar.close()
    return shared


# ---- Ray ------------------------------------------------------------------------------------------


class _RayWorker:
    """A Ray actor: keeps the last model it loaded and runs units of points (:func:`_units`: logit-lens
    points differing only in ``target`` share one pass, as locally) into the shared output dir."""

    def __init__(self, env: dict, figures: bool = False):
        os.environ.update(env)
        self.figures = figures
        warnings.filterwarnings("ignore")
        self.key: str | None = None
        self.model = None

    def run(self, unit: list[Point], out: str) -> tuple[list[dict], int]:
        """Run one unit: ``(each point's record, forward passes shared)``; a model that fails to
        load fails every point of the unit."""
        key = unit[0].model_key
        if key != self.key:
            self.model, self.key = None, None
            gc.collect()
            try:
                self.model = load_model(unit[0].config.model)
            except Exception as e:  # noqa: BLE001
                return [_failed_record(p, f"{type(e).__name__}: {e}") for p in unit], 0
            self.key = key
        shared = SharedPasses(s for p in unit for s in p.config.experiments)
        try:
            with shared_passes(shared):
                return [execute_point(p, out, self.model, figures=self.figures) for p in unit], shared.passes
        finally:
            shared.cache.clear()


def _units(points: list[Point]) -> list[list[Point]]:
    """The points of one model cut into units for the actors: points whose logit-lens steps share
    passes (:meth:`SharedPasses.siblings`: equal but for ``target`` / ``name``) go to one actor
    together, every other point alone; first-seen order."""
    shared = SharedPasses(s for p in points for s in p.config.experiments)
    units: dict[str, list[Point]] = {}
    for p in points:
        keys = [SharedPasses.key(s) for s in p.config.experiments if shared.siblings(s)]
        units.setdefault(json.dumps(keys) if keys else f"#{p.index}", []).append(p)
    return list(units.values())


def _ray_env() -> dict:
    pkg_root = str(Path(__file__).resolve().parents[2])  # the folder holding the tracekit package
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "MPLBACKEND",
                                      "TOKENIZERS_PARALLELISM") if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and p != pkg_root])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _start_ray(ray, env: dict, address: str | None, workers: int | None) -> bool:
    """Start Ray (a local one, or join ``address``) unless it runs already; True when started here."""
    if ray.is_initialized():
        return False
    kw: dict = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True,
                "runtime_env": {"env_vars": env}}
    if address:
        ray.init(address=address, **kw)
    else:
        ray.init(num_cpus=max(1, workers or min(4, os.cpu_count() or 1)), object_store_memory=200 * 2 ** 20, **kw)
    return True


def _actor_plan(ray, n_points: int, workers: int | None) -> tuple[int, dict, int]:
    """``(actors, actor options, GPUs)``: one actor per GPU, else ``workers`` (or all CPUs) CPU actors;
    never more actors than ``n_points`` (the units of work)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpus > 0:
        n, opts = gpus, {"num_gpus": 1, "num_cpus": 1}
    else:
        n = max(1, workers or int(ray.cluster_resources().get("CPU", 1)))
        opts = {"num_cpus": 1}
    return min(n, n_points) or 1, opts, gpus


class _Scheduler:
    """Hands units of points (:func:`_units`) to actors by model: an actor keeps its model while that
    model has units left, then takes the model with the most units per actor already on it."""

    def __init__(self, todo: list[Point], n: int):
        by_model: dict[str, list[Point]] = {}
        for p in todo:
            by_model.setdefault(p.model_key, []).append(p)
        self.pending: dict[str, list[list[Point]]] = {k: _units(v) for k, v in by_model.items()}
        self.current: dict[int, str | None] = {a: None for a in range(n)}

    def next_unit(self, a: int) -> list[Point] | None:
        pending, current = self.pending, self.current
        key = current[a]
        if key is None or not pending.get(key):  # no model yet, or its units are all handed out
            busy = {k: sum(1 for b in current if current[b] == k and b != a) for k in pending}
            cands = [k for k in pending if pending[k]]
            if not cands:
                return None
            key = max(cands, key=lambda k: len(pending[k]) / (1 + busy.get(k, 0)))
        current[a] = key
        u = pending[key].pop(0)
        if not pending[key]:
            del pending[key]
        return u


def _drive_actors(ray, actors: list, make_actor: Callable, sched: _Scheduler, out: Path, on_record: Callable,
                  bar) -> int:
    """Keep every actor busy until no unit is left; an actor that dies fails its unit's points and is
    replaced (``make_actor()``: a new one). Returns the forward passes shared."""
    inflight: dict = {}
    idle = list(range(len(actors)))
    passes = 0
    while sched.pending or inflight:
        while idle and sched.pending:
            a = idle.pop(0)
            u = sched.next_unit(a)
            if u is None:
                break
            inflight[actors[a].run.remote(u, str(out))] = (a, u)
        done, _ = ray.wait(list(inflight), num_returns=1)
        for ref in done:
            a, u = inflight.pop(ref)
            try:
                recs, n = ray.get(ref)
                passes += n
            except Exception as e:  # noqa: BLE001 - the actor died (OOM, crash): record and replace it
                recs = [_failed_record(p, f"{type(e).__name__}: {e}") for p in u]
                actors[a] = make_actor()
                sched.current[a] = None
            for p, rec in zip(u, recs):
                on_record(p, rec)
                bar.update(1)
            idle.append(a)
    return passes


def _run_ray(todo: list[Point], out: Path, on_record: Callable, progress: bool, log, address: str | None,
             workers: int | None, figures: bool = False) -> int:
    """Run the points on Ray actors (:func:`_actor_plan`), units of points sharing a lens pass on one
    actor. Returns the forward passes shared."""
    try:
        import ray  # lazy: optional/heavy (the `sweeps` extra)
    except ImportError as e:
        raise ConfigError("--executor ray needs Ray: pip install 'tracekit[sweeps]' (or pip install 'ray[default]')"
                          ) from e
    env = _ray_env()
    started_here = _start_ray(ray, env, address, workers)
    try:
        sched = _Scheduler(todo, 0)
        n, opts, gpus = _actor_plan(ray, sum(len(u) for u in sched.pending.values()), workers)  # <= one per unit
        sched.current = {a: None for a in range(n)}
        Actor = ray.remote(**opts)(_RayWorker)
        actors = [Actor.remote(env, figures) for _ in range(n)]
        log(f"ray: {n} {'GPU' if gpus else 'CPU'} actor(s) for {len(todo)} point(s)")
        bar = _progress(len(todo), progress)
        try:
            return _drive_actors(ray, actors, lambda: Actor.remote(env, figures), sched, out, on_record, bar)
        finally:
            bar.close()
    finally:
        if started_here:
            ray.shutdown()
