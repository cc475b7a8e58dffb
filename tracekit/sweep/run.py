"""Running a sweep: expand, skip points already complete, execute the rest, keep the index."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import ConfigError, OutputError
from ..core.io import atomic_write
from ..core.locks import acquire, release
from ..core.signals import interrupt_handler
from ..plotting import plt
from .executors import _run_local, _run_ray
from .expand import Point, _groups, expand_sweep
from .figures import _safe, compare
from .index import INDEX, _complete_run, _record_path, _runs_of, absolute_run_dirs, build_index, write_index

__all__ = ["SweepOutcome", "run_sweep"]


@dataclass
class SweepOutcome:
    """What :func:`run_sweep` did."""

    out: Path
    index: Any                                    # pandas DataFrame
    ran: list[int] = field(default_factory=list)  # points run now
    skipped: list[int] = field(default_factory=list)  # complete before
    failed: list[int] = field(default_factory=list)
    interrupted: bool = False
    shared_passes: int = 0                        # logit-lens passes shared by points differing in target

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else (1 if self.failed else 0)


def _figures_flag(spec: dict) -> bool:
    """The sweep block's ``figures`` (default false: no per-point PNGs).

    Raises:
        ConfigError: not a boolean.
    """
    v = spec.get("figures", False)
    if not isinstance(v, bool):
        raise ConfigError(f"sweep.figures: must be true or false (write each point's figures), got {v!r}")
    return v


def _lock_out(out: Path):
    """Create the sweep folder and hold its lock (an open file; release with :func:`_unlock`).

    Raises:
        OutputError: the folder cannot be created.
        ConfigError: another sweep holds the lock.
    """
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"--out {out}: cannot create the sweep folder: {e.strerror or e}") from e
    try:
        lock = acquire(out / ".sweep.lock")  # held for the whole sweep, released in _unlock
    except OSError as e:
        raise OutputError(f"--out {out}: cannot create the sweep's lock file: {e.strerror or e}") from e
    if lock is None:
        raise ConfigError(f"--out {out}: another sweep is running into this folder; wait for it or use another "
                          "--out")
    return lock


def _unlock(lock) -> None:
    release(lock)


def _complete_record(out: Path, p: Point, done: Path) -> dict:
    """The record of a point whose run ``done`` is complete: its ``point.json``, or one rebuilt
    from the run directory when that is missing or stale."""
    rec = {}
    rp = _record_path(out, p.hash)
    if rp.is_file():
        try:
            rec = json.loads(rp.read_text())
        except (OSError, json.JSONDecodeError):
            rec = {}
    if rec.get("run_dir") != str(done.relative_to(out)) or rec.get("status") != "complete":
        env = json.loads((done / "environment.json").read_text()) if (done / "environment.json").is_file() else {}
        rec = {"status": "complete", "error": None, "run_dir": str(done.relative_to(out)),
               "started": env.get("started"), "seconds": env.get("total_s")}
    return rec


def _prior_records(out: Path, points: list[Point]) -> tuple[dict[int, dict], list[Point], list[int]]:
    """``(records, todo, skipped)``: the records of points complete before, the points to run, and
    the indices of the complete ones."""
    records: dict[int, dict] = {}
    todo: list[Point] = []
    skipped: list[int] = []
    for p in points:
        done = _complete_run(out, p.hash)
        if done is None:
            todo.append(p)
            continue
        records[p.index] = _complete_record(out, p, done)
        skipped.append(p.index)
    return records, todo, skipped


class _Recorder:
    """Takes each finished point's record (``on_record``): keeps it, rewrites the index, logs failures;
    ``on_signal`` turns SIGINT/SIGTERM into KeyboardInterrupt, raised again after the next record
    in case the first one was swallowed (e.g. inside a weakref callback)."""

    def __init__(self, out: Path, points: list[Point], records: dict[int, dict], outcome: SweepOutcome,
                 log: Callable):
        self.out, self.points, self.records, self.outcome, self.log = out, points, records, outcome, log
        self.stop_asked = False

    def on_record(self, p: Point, rec: dict) -> None:
        self.records[p.index] = rec
        self.outcome.ran.append(p.index)
        write_index(self.out, build_index(self.out, self.points, self.records))
        if rec["status"] != "complete":
            self.log(f"point {p.index} ({p.label}) {rec['status']}: {str(rec.get('error')).splitlines()[0]}")
        if self.stop_asked:  # the signal's KeyboardInterrupt was swallowed
            raise KeyboardInterrupt

    def on_signal(self, signum) -> None:
        self.stop_asked = True
        raise KeyboardInterrupt


def _compare_figures(out: Path, df, spec: dict, log: Callable) -> None:
    """Write ``compare-<metric>.png`` for every item of the sweep's ``compare`` list (a metric, or
    ``{metric, by}``); a metric that cannot be drawn is logged and skipped."""
    for item in spec.get("compare") or []:
        metric, by = (item, None) if isinstance(item, str) else (item.get("metric"), item.get("by"))
        try:
            fig = compare(df, metric, by=by)
        except (KeyError, ValueError) as e:
            log(f"compare {metric!r}: {e}")
            continue
        fig.savefig(out / f"compare-{_safe(metric)}.png", dpi=110, bbox_inches="tight")
        plt().close(fig)


def run_sweep(config: str | Path | dict, out: str | Path, overrides: list[str] | tuple = (), executor: str = "local",
              workers: int | None = None, address: str | None = None, progress: bool = True,
              log: Callable = print) -> SweepOutcome:
    """Run (or continue) a sweep into ``out``; see :mod:`tracekit.sweep`.

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
    if executor not in ("local", "ray"):
        raise ConfigError(f"--executor: unknown executor {executor!r}; use 'local' or 'ray'")
    points, raw = expand_sweep(config, overrides)
    figures = _figures_flag(raw.get("sweep", {}))
    out = Path(out)
    lock = _lock_out(out)
    try:
        atomic_write(out / "sweep.yaml", yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
        records, todo, skipped = _prior_records(out, points)
        log(f"sweep: {len(points)} point(s), {len(skipped)} already complete, {len(todo)} to run "
            f"({len(_groups(todo))} model(s)); index: {out / INDEX}")
        outcome = SweepOutcome(out, None, skipped=skipped)
        write_index(out, build_index(out, points, records))
        rec = _Recorder(out, points, records, outcome, log)
        try:
            with interrupt_handler(rec.on_signal):
                if not todo:
                    pass
                elif executor == "ray":
                    outcome.shared_passes = _run_ray(todo, out, rec.on_record, progress, log, address, workers,
                                                     figures=figures)
                else:
                    outcome.shared_passes = _run_local(todo, out, rec.on_record, progress, log,
                                                       figures=figures).passes
        except KeyboardInterrupt:
            outcome.interrupted = True
            for p in todo:
                if p.index not in records and _runs_of(out, p.hash):
                    records[p.index] = {"status": "interrupted", "error": "interrupted (KeyboardInterrupt)"}
        df = build_index(out, points, records)
        write_index(out, df)
        outcome.index = absolute_run_dirs(df, out)
        outcome.failed = [int(r["point"]) for r in df.to_dict("records") if r["status"] == "failed"]
        _compare_figures(out, df, raw.get("sweep", {}), log)
        return outcome
    finally:
        _unlock(lock)
