"""A sweep's records and index: run status, ``point.json`` records, the wide and the long table.

Two tables, both rewritten (atomically) after every point:

* ``index.parquet`` (wide, :func:`load_results`): one row per point; the fixed columns, one column
  per swept path, ``<step>/<key>`` for every **scalar** of every step's summary (numbers, strings,
  booleans; lists and mappings live in the long table), ``summary`` (all step summaries as JSON)
  and ``env/...``. A metric or ``env/...`` column with one value in every point that has one (at
  least two points) is dropped; that value is kept in ``index.json`` (``constant``).
* ``metrics.parquet`` (long, :func:`load_metrics`): one row per point, step, metric and element:
  ``point``, the swept paths, ``step``, ``kind``, ``metric`` (the summary key), ``element`` (the
  key path inside a mapping, ``''`` for none), ``index`` (the list position, a rank for rankings;
  ``<NA>`` for a value that is not in a list), ``value`` (float; NaN for text) and ``text`` (the
  string or boolean as text; None for numbers).

``index.json`` names the steps' kinds, the headline columns (:func:`headline_columns`) and the
constant columns. Run directories are stored relative to the sweep folder (the folder can move)
and returned absolute by :func:`load_results` and :func:`load_point`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import pandas as pd

from ..core.errors import ResultLoadError
from ..core.io import atomic_write
from ..results import REGISTRY, Result, ResultFolder
from .expand import Point

__all__ = ["FIXED_COLUMNS", "HEADLINES", "INDEX", "INDEX_META", "METRICS", "VOLATILE", "build_index",
           "build_metrics", "headline_columns", "load_metrics", "load_point", "load_results", "run_problem", "run_status",
           "stable_columns", "write_index"]

INDEX = "index.parquet"
METRICS = "metrics.parquet"
INDEX_META = "index.json"
#: Index columns that differ between two runs of the same sweep (times, places).
VOLATILE = ("run_dir", "started", "seconds")
#: Index columns every sweep has (the rest: swept paths, step summaries, ``env/...``).
FIXED_COLUMNS = ("point", "label", "config_hash", "seed", "status", "error", "run_dir", "started", "seconds",
                 "summary")
#: The headline summary keys of each kind (scalars; the default columns of ``tracekit results``).
#: A result class may declare its own ``headline_keys``, which win over this table; a kind in
#: neither shows its first scalar summary keys.
HEADLINES: dict[str, tuple[str, ...]] = {
    "logit_lens": ("target_prob_final", "emergence_layer", "final_top1", "mean_target_prob_final",
                   "median_emergence_layer", "top1_accuracy_final", "mean_logit_diff_final"),
    "direct_logit_attribution": ("mean_logit_diff", "mean_attributed_logit_diff", "share_rows_correct",
                                 "mean_attn_total", "mean_mlp_total"),
    "neuron_attribution": ("mean_logit_diff", "top_mean_contribution_sum", "max_additivity_error"),
    "attention_pattern": ("max_abs_row_sum_error",),
    "activation_patching": ("mean_clean", "mean_corrupted", "share_rows_correct", "n_rows_flagged"),
    "attribution_patching": ("mean_clean", "mean_corrupted", "share_rows_correct"),
    "edge_attribution": ("mean_clean", "mean_corrupted", "n_edges"),
    "path_patching": ("mean_clean", "mean_corrupted"),
    "circuit": ("full_faithfulness", "cpr", "cmd", "n_graph_edges"),
    "sae_features": ("mean_logit_diff", "mean_l0", "mean_relative_error_norm"),
}
_N_FALLBACK = 4


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


def run_problem(run_dir: str | Path) -> str | None:
    """What keeps a run's results from being on disk, or None when they all are: the run folder
    exists, its status is ``complete`` (:func:`run_status`), and every step it ran has a complete
    saved result folder (read through :class:`~tracekit.results.ResultFolder`, the checked loader
    :meth:`Result.load` uses). The one check behind the sweep's skip-if-complete, its index and
    :func:`load_point`, so a run folder deleted or damaged after a sweep is never reported complete.

    Args:
        run_dir: a run directory (``DIR/runs/<hash>/<pNNN>-<time>``).

    Returns:
        None, or one sentence naming the folder and what is wrong.
    """
    d = Path(run_dir)
    if not d.is_dir():
        return f"its run folder {d} is missing (deleted after the sweep?)"
    st = run_status(d)
    if st != "complete":
        return f"its run folder {d} is {st}"
    state = _read_json(d / "status.json")
    steps = state.get("steps") if isinstance(state, dict) else None
    if not steps:
        summary = _read_json(d / "summary.json")
        steps = list(summary.get("steps", {})) if isinstance(summary, dict) else []
    for step in steps:
        sd = d / str(step)
        if not sd.is_dir():
            return f"its step folder {sd} is missing (deleted after the sweep?)"
        try:
            ResultFolder(sd)
        except ResultLoadError as e:
            return f"its step {step!r} is damaged: {e}"
    return None


def _runs_of(out: Path, h: str) -> list[Path]:
    d = out / "runs" / h
    return sorted((p for p in d.iterdir() if p.is_dir()), key=lambda p: p.name) if d.is_dir() else []


def _complete_run(out: Path, h: str) -> Path | None:
    done = [p for p in _runs_of(out, h) if run_problem(p) is None]
    return done[-1] if done else None


def _record_path(out: Path, h: str) -> Path:
    return out / "runs" / h / "point.json"


def _failed_record(point: Point, error: str) -> dict:
    return {"point": point.index, "config_hash": point.hash, "params": point.params, "names": point.names,
            "seed": point.seed, "started": _dt.datetime.now().isoformat(timespec="seconds"), "status": "failed",
            "error": error, "run_dir": None, "seconds": 0.0}


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


@lru_cache(maxsize=4096)
def _read_json_cached(path: str, mtime_ns: int, size: int) -> Any:
    return json.loads(Path(path).read_text())


def _read_json(path: Path) -> Any:
    """A JSON file's content (None when missing or unreadable); cached by modification time, so
    rewriting the index after every point does not reread every finished point."""
    try:
        st = path.stat()
        return _read_json_cached(str(path), st.st_mtime_ns, st.st_size)
    except (OSError, json.JSONDecodeError):
        return None


def _step_summaries(rd: Path | None) -> dict:
    s = _read_json(rd / "summary.json") if rd is not None else None
    return (s or {}).get("steps", {}) if isinstance(s, dict) else {}


def _env_columns(rd: Path | None, row: dict) -> None:
    """``env/...`` (versions, device, git commit, timings) from the run's ``environment.json``, into ``row``."""
    env = _read_json(rd / "environment.json") if rd is not None else None
    if not isinstance(env, dict):
        return
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
    summary = _step_summaries(rd)
    if row["status"] == "complete":
        problem = run_problem(rd) if rd is not None else "no run folder is recorded"
        if problem:  # never report a result that is not on disk
            row.update(status="missing", error=_missing_error(problem))
            summary = {}
    for step, s in summary.items():
        for k, v in (s.items() if isinstance(s, dict) else ()):
            if _is_scalar(v):
                row[f"{step}/{k}"] = v
    row["summary"] = json.dumps(summary, sort_keys=True) if summary else None
    _env_columns(rd, row)
    return row


def _missing_error(problem: str) -> str:
    return f"{problem}; rerun the sweep into this folder to redo the point"


def _check_on_disk(df: pd.DataFrame) -> pd.DataFrame:
    """The index (``run_dir`` absolute) with every ``complete`` point whose results are no longer on
    disk (:func:`run_problem`) marked ``missing``: its error says what is gone, its ``summary`` and
    metric columns are emptied (nothing is reported that cannot be loaded)."""
    if "status" not in df.columns:
        return df
    metric = [c for c in df.columns if "/" in c and not c.startswith("env/")]
    df = df.copy()
    complete = (df["status"] == "complete").to_numpy(dtype=bool)
    for i in df.index[complete]:
        rd = df.at[i, "run_dir"] if "run_dir" in df.columns else None
        problem = run_problem(rd) if isinstance(rd, str) and rd else "no run folder is recorded"
        if problem:
            df.at[i, "status"] = "missing"
            df.at[i, "error"] = _missing_error(problem)
            if "summary" in df.columns:
                df.at[i, "summary"] = None
            for c in metric:
                df.at[i, c] = None
    return df


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


def _constant(df: pd.DataFrame, keep: set[str]) -> dict[str, Any]:
    """Metric and ``env/...`` columns (not in ``keep``) with one value in every point that has one,
    at least two points having it: column -> that value."""
    out: dict[str, Any] = {}
    for c in df.columns:
        if c in keep or c in FIXED_COLUMNS:
            continue
        vals = pd.Series(df[c]).dropna()
        if len(vals) >= 2 and int(vals.nunique()) == 1:
            v = vals.iloc[0]
            out[c] = v.item() if hasattr(v, "item") else v
    return out


def _step_kinds(points: list[Point]) -> tuple[dict[str, list[str]], dict[int, dict[str, str]]]:
    """``(step -> its kinds over the points, point -> {step: kind})`` (a swept ``kind`` gives a step
    several kinds)."""
    kinds: dict[str, list[str]] = {}
    by_point: dict[int, dict[str, str]] = {}
    for p in points:
        for s in getattr(p.config, "experiments", []):
            k = getattr(s, "kind", None)
            if k:
                by_point.setdefault(p.index, {})[s.step_name] = k
                if k not in kinds.setdefault(s.step_name, []):
                    kinds[s.step_name].append(k)
    return kinds, by_point


def build_index(out: str | Path, points: list[Point], records: dict[int, dict]) -> pd.DataFrame:
    """The wide index: one row per point (``status: pending`` where nothing ran yet), scalar metrics
    only, constant metric / ``env`` columns dropped (``df.attrs["constant"]`` holds them,
    ``df.attrs["kinds"]`` the steps' kinds); ``run_dir`` relative to ``out``."""
    out = Path(out)
    rows = [_row(out, p, records.get(p.index, {"status": "pending"})) for p in points]
    df = pd.DataFrame(rows)
    swept = list(dict.fromkeys(k for p in points for k in p.names))
    head = list(dict.fromkeys(["point", "label", *swept, "status", "error", "seed", "config_hash", "run_dir",
                               "started", "seconds"])) if points else []
    rest = sorted(c for c in df.columns if c not in head and not c.startswith("env/") and c != "summary")
    env = sorted(c for c in df.columns if c.startswith("env/"))
    cols = [c for c in head if c in df.columns] + rest + (["summary"] if "summary" in df.columns else []) + env
    df = cast(pd.DataFrame, df[cols])  # a list of columns selects a DataFrame (pandas types [] as DataFrame | Series)
    df = _sanitize(df.reset_index(drop=True))
    const = _constant(df, set(swept)) if len(df) > 1 else {}
    df = cast(pd.DataFrame, df.drop(columns=list(const)))
    kinds, point_kinds = _step_kinds(points)
    df.attrs = {"constant": const, "kinds": kinds, "point_kinds": point_kinds, "swept": swept}
    return df


def _walk(v: Any, element: str, index: int | None, out: list) -> None:
    """Append ``(element, index, value)`` for every scalar inside a summary value to ``out``:
    mapping keys join ``element`` with ``.``; the outermost list gives ``index``, deeper lists add
    ``[i]`` to ``element``."""
    if isinstance(v, dict):
        for k, x in v.items():
            _walk(x, f"{element}.{k}" if element else str(k), index, out)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if index is None:
                _walk(x, element, i, out)
            else:
                _walk(x, f"{element}[{i}]", index, out)
    elif _is_scalar(v):
        out.append((element, index, v))


def build_metrics(index: pd.DataFrame, swept: list[str] | None = None) -> pd.DataFrame:
    """The long table (module docstring) from the wide index's ``summary`` column: one row per
    point, step, metric and element.

    Args:
        index: the wide index (:func:`build_index` or :func:`load_results`).
        swept: the swept paths to repeat on every row (default: ``index.attrs["swept"]``).

    Returns:
        A DataFrame with columns ``point``, the swept paths, ``step``, ``kind``, ``metric``,
        ``element``, ``index``, ``value``, ``text``.
    """
    swept = swept if swept is not None else list(index.attrs.get("swept", []))
    point_kinds = index.attrs.get("point_kinds", {})
    recs: list[dict] = []
    for r in index.to_dict("records"):
        if not isinstance(r.get("summary"), str):
            continue
        base = {"point": r["point"], **{s: r.get(s) for s in swept}}
        kinds = point_kinds.get(r["point"]) or point_kinds.get(str(r["point"])) or {}
        for step, s in json.loads(r["summary"]).items():
            for metric, v in (s.items() if isinstance(s, dict) else ()):
                items: list = []
                _walk(v, "", None, items)
                for element, i, x in items:
                    num = isinstance(x, (int, float)) and not isinstance(x, bool)
                    recs.append({**base, "step": step, "kind": kinds.get(step), "metric": metric,
                                 "element": element, "index": i, "value": float(x) if num else math.nan,
                                 "text": None if num or x is None else str(x)})
    cols = ["point", *swept, "step", "kind", "metric", "element", "index", "value", "text"]
    df = pd.DataFrame(recs, columns=cols)
    df["index"] = df["index"].astype("Int64")
    df["value"] = df["value"].astype(float)
    return df


def headline_columns(index: pd.DataFrame, n: int = 8) -> list[str]:
    """The index's headline metric columns: per step, its kinds' headline keys (the result class's
    ``headline_keys``, else :data:`HEADLINES`, else the step's first scalar summary keys) that the
    index has, at most ``n`` in all (steps in order).

    Args:
        index: the wide index (its ``attrs["kinds"]``: step -> kinds).
        n: the most columns returned.

    Returns:
        Column names of ``index``.
    """
    out: list[str] = []
    for step, kinds in index.attrs.get("kinds", {}).items():
        keys: list[str] = []
        for kind in [kinds] if isinstance(kinds, str) else kinds:
            try:
                own = getattr(REGISTRY[kind].result_class, "headline_keys", None)
            except (KeyError, AttributeError, ImportError):
                own = None
            keys += list(own or HEADLINES.get(kind, ()))
        have = [c for c in index.columns if c.startswith(f"{step}/")]
        cols = [f"{step}/{k}" for k in dict.fromkeys(keys) if f"{step}/{k}" in have]
        if not cols:
            cols = [c for c in have if index[c].dtype.kind in "fi"][:_N_FALLBACK]
        out += cols
    return out[:n]


def write_index(out: str | Path, df: pd.DataFrame) -> Path:
    """Write ``index.parquet``, ``metrics.parquet`` and ``index.json``, each atomically (temporary
    file + rename)."""
    out = Path(out)
    meta = {"kinds": df.attrs.get("kinds", {}), "point_kinds": df.attrs.get("point_kinds", {}),
            "swept": df.attrs.get("swept", []),
            "headline": headline_columns(df), "constant": df.attrs.get("constant", {})}
    plain = df.copy()
    plain.attrs = {}
    atomic_write(out / METRICS, lambda p: build_metrics(df).to_parquet(p, index=False))
    atomic_write(out / INDEX_META, json.dumps(meta, indent=2, default=str))
    return atomic_write(out / INDEX, lambda p: plain.to_parquet(p, index=False))


def _sweep_file(directory: str | Path, name: str) -> tuple[Path, Path]:
    p = Path(directory)
    root = p.parent if p.suffix == ".parquet" else p
    f = root / name
    if not f.is_file():
        raise ResultLoadError(f"{p} is not a sweep directory (no {name}); pass the --out folder of "
                              "`tracekit sweep`")
    return root, f


def _meta(root: Path) -> dict:
    m = _read_json(root / INDEX_META)
    return m if isinstance(m, dict) else {}


def load_results(directory: str | Path) -> pd.DataFrame:
    """A sweep's wide index (``DIR/index.parquet``) as a DataFrame, one row per point; ``run_dir``
    absolute (loadable from any working directory); ``df.attrs`` holds ``kinds``, ``swept``,
    ``headline`` and ``constant`` from ``index.json``. A point indexed ``complete`` whose run or
    step folder is gone or damaged since (:func:`run_problem`) reads ``missing``: its ``error``
    says what is gone, its ``summary`` and metric columns are empty.

    Args:
        directory: the sweep folder (``--out``) or its ``index.parquet``.

    Raises:
        ResultLoadError: the folder holds no sweep index.
    """
    root, f = _sweep_file(directory, INDEX)
    df = pd.read_parquet(f)
    df = _check_on_disk(absolute_run_dirs(df, root))
    df.attrs = _meta(root)
    return df


def absolute_run_dirs(df: pd.DataFrame, root: str | Path) -> pd.DataFrame:
    """``df`` with ``run_dir`` made absolute against the sweep folder ``root`` (None stays None)."""
    if "run_dir" in df.columns:
        base = os.path.abspath(root)
        df = df.copy()
        df["run_dir"] = [os.path.join(base, v) if isinstance(v, str) and v else None for v in df["run_dir"]]
    return df


def load_metrics(directory: str | Path) -> pd.DataFrame:
    """A sweep's long table (``DIR/metrics.parquet``): columns ``point``, the swept paths, ``step``,
    ``kind``, ``metric``, ``element``, ``index``, ``value``, ``text`` (module docstring).

    Raises:
        ResultLoadError: the folder holds no long table (not a sweep folder, or one written
            before the long table existed: rerun ``tracekit sweep`` into it to rebuild).
    """
    return pd.read_parquet(_sweep_file(directory, METRICS)[1])


def load_point(sweep_dir: str | Path, point: int, step: str | None = None) -> Result:
    """Load one point's result from a sweep folder, from any working directory.

    Args:
        sweep_dir: the sweep folder (``--out``), absolute or relative to the working directory.
        point: the point's number (the index's ``point`` column).
        step: the step's name; default: the point's only step.

    Returns:
        The step's :class:`~tracekit.results.Result` (its kind's subclass).

    Raises:
        ResultLoadError: no such sweep folder or point, the point has no complete run (its status
            is named; ``missing`` when its run or step folder was deleted or damaged since the
            sweep), or ``step`` is missing / not one of the point's steps (they are listed).
    """
    df = load_results(sweep_dir)
    hit = df[df["point"] == point]
    if hit.empty:
        raise ResultLoadError(f"{sweep_dir}: no point {point}; points: {df['point'].tolist()}")
    r = hit.iloc[0]
    if r["status"] != "complete" or not r["run_dir"]:
        why = f": {r['error']}" if isinstance(r.get("error"), str) and r["error"] else ""
        raise ResultLoadError(f"{sweep_dir}: point {point} ({r['label']}) has no complete run (status "
                              f"{r['status']}{why}); rerun the sweep to complete it")
    run_dir = Path(r["run_dir"])
    steps = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and (p / "manifest.json").is_file())
    if step is None:
        if len(steps) != 1:
            raise ResultLoadError(f"point {point} has {len(steps)} steps {steps}: pass step=<one of them>")
        step = steps[0]
    if step not in steps:
        raise ResultLoadError(f"point {point} has no step {step!r}; its steps: {steps}")
    return Result.load(run_dir / step)


def stable_columns(df):
    """The index without the columns that differ between two runs of the same sweep (run
    directories, start times, durations, environment): what must be equal for the same sweep."""
    drop = [c for c in df.columns if c in VOLATILE or c.startswith("env/")]
    return df.drop(columns=drop)
