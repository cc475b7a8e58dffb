"""A sweep's records and index: run status, ``point.json`` records, ``index.parquet``."""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any, cast

import pandas as pd

from ..core.errors import ResultLoadError
from ..core.io import atomic_write
from .expand import Point

__all__ = ["FIXED_COLUMNS", "INDEX", "VOLATILE", "build_index", "load_results", "run_status", "stable_columns",
           "write_index"]

INDEX = "index.parquet"
#: Index columns that differ between two runs of the same sweep (times, places).
VOLATILE = ("run_dir", "started", "seconds")
#: Index columns every sweep has (the rest: swept paths, step summaries, ``env/...``).
FIXED_COLUMNS = ("point", "label", "config_hash", "seed", "status", "error", "run_dir", "started", "seconds",
                 "summary")


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


def _summary_columns(rd: Path | None, row: dict) -> None:
    """``<step>/<key>`` for every scalar of every step's summary, and ``summary`` (JSON), into ``row``."""
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


def _env_columns(rd: Path | None, row: dict) -> None:
    """``env/...`` (versions, device, git commit, timings) from the run's ``environment.json``, into ``row``."""
    if rd is None or not (rd / "environment.json").is_file():
        return
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


def _row(out: Path, point: Point, rec: dict) -> dict:
    row: dict = {"point": point.index, "label": point.label, "config_hash": point.hash, "seed": point.seed,
                 "status": rec.get("status", "pending"), "error": rec.get("error"), "run_dir": rec.get("run_dir"),
                 "started": rec.get("started"), "seconds": rec.get("seconds")}
    for p, shown in point.names.items():
        row[p] = shown
    rd = out / rec["run_dir"] if rec.get("run_dir") else None
    _summary_columns(rd, row)
    _env_columns(rd, row)
    return row


def _sanitize(df: pd.DataFrame) -> pd.DataFrame:
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


def build_index(out: str | Path, points: list[Point], records: dict[int, dict]) -> pd.DataFrame:
    """The index DataFrame: one row per point (``status: pending`` where nothing ran yet)."""
    out = Path(out)
    rows = [_row(out, p, records.get(p.index, {"status": "pending"})) for p in points]
    df = pd.DataFrame(rows)
    head = ["point", "label", *points[0].names.keys(), "status", "error", "seed", "config_hash", "run_dir",
            "started", "seconds"] if points else []
    head = list(dict.fromkeys(head))
    rest = sorted(c for c in df.columns if c not in head and not c.startswith("env/") and c != "summary")
    env = sorted(c for c in df.columns if c.startswith("env/"))
    cols = [c for c in head if c in df.columns] + rest + (["summary"] if "summary" in df.columns else []) + env
    df = cast(pd.DataFrame, df[cols])  # a list of columns selects a DataFrame (pandas types [] as DataFrame | Series)
    return _sanitize(df.reset_index(drop=True))


def write_index(out: str | Path, df) -> Path:
    """Write ``index.parquet`` atomically (temporary file + rename)."""
    return atomic_write(Path(out) / INDEX, lambda p: df.to_parquet(p, index=False))


def load_results(directory: str | Path):
    """A sweep's index (``DIR/index.parquet``) as a pandas DataFrame, one row per point.

    Raises:
        ResultLoadError: the folder holds no sweep index.
    """
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
