"""The experiment protocol: a config class whose ``run(model)`` returns a :class:`Result`.

An experiment kind is a pydantic model (its fields are the YAML keys) with a ``kind`` name; the same
class is the notebook API::

    from tracekit import LogitLens, load_model
    result = LogitLens(prompts=["The capital of France is"], target=" Paris").run(load_model())
    result.to_frame(); result.summary(); result.plot(); result.save("out/")

``Experiment.run`` is a template method (as SAELens' ``SAE.forward`` over ``encode``/``decode``):
it turns a model name/spec into a loaded model, calls :meth:`Experiment.check` once (everything that
needs only the tokenizer and the model's config), then the kind's :meth:`Experiment._run` inside a
:func:`tracekit.hooks.state_guard`, so no hook, hook setting or mode survives the call whatever is
raised. Kinds implement ``check`` and ``_run`` and never override ``run``.

A :class:`Result` holds tidy tables (pandas) plus JSON-able metadata and tensors; ``summary()`` and
the figures are computed from those, so ``Result.load(dir)`` gives back exactly what was saved.
Saving is atomic: a result folder is written under a temporary name, with a ``manifest.json``
listing every file last, and renamed into place; ``Result.load`` refuses a folder without a
complete manifest.

Kinds are registered by name (``@register``, refusing duplicates), as SAELens registers SAE
architectures, so a YAML ``kind: logit_lens`` finds its class without an if-chain. To add a kind:
subclass :class:`Experiment` and :class:`Result`, decorate the experiment with ``@register`` and
import its module in ``tracekit/experiments/__init__.py``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import pandas as pd
from pydantic import Field, field_validator, model_validator

from ..core import paths
from ..core.errors import OutputError, ResultLoadError
from ..core.io import atomic_folder, jsonable
from ..core.strict import Indices, OptionalPrompts, Prompts, StrictModel, retired_message

__all__ = ["REGISTRY", "RESULTS", "register", "as_model", "StrictModel", "Prompts", "OptionalPrompts", "Indices",
           "Expectation", "Experiment", "Result", "lookup", "jsonable", "MANIFEST", "retired_message"]


REGISTRY: dict[str, type["Experiment"]] = {}
RESULTS: dict[str, type["Result"]] = {}


def register(cls: type["Experiment"]) -> type["Experiment"]:
    """Class decorator: make an experiment kind available to configs under its ``kind`` name.

    Raises:
        ValueError: another class is already registered under that kind (two kinds cannot share
            a name; the second would silently replace the first).
        TypeError: the class has no string default for ``kind`` or overrides ``run``.
    """
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__} needs a string default for field 'kind'")
    if kind in REGISTRY and REGISTRY[kind] is not cls:
        raise ValueError(f"experiment kind {kind!r} is already registered by {REGISTRY[kind].__qualname__}; "
                         f"{cls.__qualname__} needs another kind name")
    if "run" in cls.__dict__:
        raise TypeError(f"{cls.__name__} overrides run(); implement _run(model, progress) instead")
    REGISTRY[kind] = cls
    RESULTS[kind] = cls.result_class
    return cls


def as_model(model):
    """A loaded hooked model from a model, a model name, a ModelSpec, a dict or None (default)."""
    from ..model.load import load_model
    from ..model.spec import ModelSpec

    if model is None or isinstance(model, (str, dict, ModelSpec)):
        return load_model(model)
    return model


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Expectation(StrictModel):
    """A reference value a run checks, e.g. the seed article's numbers.

    ``metric`` is a key of the step's ``summary()``, optionally indexed: ``target_prob_by_layer[8]``.
    Met when ``|observed - value| <= atol`` (if ``value`` is a number), ``observed == value`` (if
    ``value`` is a string or bool), and within ``[min, max]``. ``atol``, ``min`` and ``max`` must be
    finite numbers; ``atol`` needs a numeric ``value``.

    Fields:
        metric: the ``summary()`` key to check, optionally indexed (``target_prob_by_layer[8]``); required.
        value: the expected value: a number (compared with ``atol``), a string or a bool (compared
            exactly); default none (then ``min`` and/or ``max`` must be given).
        atol: absolute tolerance for a numeric ``value``, in the metric's units (>= 0; default 0 = exact).
        min: inclusive lower bound on the observed value (default none: no lower bound).
        max: inclusive upper bound on the observed value (default none: no upper bound).
        note: free text shown with the check's report row (e.g. the source of the reference value).
    """

    metric: str
    value: Optional[Union[bool, int, float, str]] = None
    atol: float = Field(default=0.0, ge=0)
    min: Optional[float] = None
    max: Optional[float] = None
    note: Optional[str] = None

    @field_validator("atol", "min", "max", mode="before")
    @classmethod
    def _numeric(cls, v):
        if v is not None and not _is_number(v):
            raise ValueError(f"must be a number, got {v!r} ({type(v).__name__})")
        return v

    @field_validator("value", mode="before")
    @classmethod
    def _finite_value(cls, v):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v!r}")
        return v

    @model_validator(mode="after")
    def _needs_bound(self):
        if self.value is None and self.min is None and self.max is None:
            raise ValueError("an expectation needs 'value' (with 'atol'), 'min' or 'max'")
        if self.atol and not _is_number(self.value):
            raise ValueError(f"atol: a tolerance needs a numeric value, but value is {self.value!r}")
        return self

    def check(self, summary: dict) -> dict:
        """Evaluate against a summary dict; returns a JSON-able report row."""
        row: dict[str, Any] = {"metric": self.metric, "expected": self.value, "atol": self.atol,
                               "min": self.min, "max": self.max, "note": self.note}
        try:
            obs = lookup(summary, self.metric)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            keys = sorted(k for k in summary if k != "expectations")
            row.update(observed=None, met=False,
                       error=f"no such summary metric {self.metric!r} ({type(e).__name__}: {e}); "
                             f"available: {keys}")
            return row
        row["observed"] = obs
        numeric = _is_number(self.value) or self.min is not None or self.max is not None
        if numeric and not (_is_number(obs) and math.isfinite(float(obs))):
            # NaN compares false with every bound (a NaN error is never "greater" than a tolerance):
            # a non-finite or missing number never meets a numeric expectation
            row.update(met=False, error=f"observed {obs!r} is not a finite number")
            return row
        met = True
        if self.value is not None:
            if _is_number(self.value) and _is_number(obs):
                met &= math.isfinite(float(obs)) and abs(float(obs) - float(self.value)) <= self.atol + 1e-12
            else:
                met &= obs == self.value
        if self.min is not None:
            met &= _is_number(obs) and obs >= self.min
        if self.max is not None:
            met &= _is_number(obs) and obs <= self.max
        row["met"] = bool(met)
        return row


_NAME = re.compile(r"[^\W][\w.-]*", re.UNICODE)

#: Files a run directory keeps for itself (tracekit.runner): no step may be named like them, or its
#: folder would replace them (the status would read "unknown", the summary would be lost).
RESERVED_NAMES = frozenset({"status.json", "summary.json", "environment.json", "references.json",
                            "config.resolved.yaml", "expectations.json", "error.txt"})


def lookup(obj: Any, path: str) -> Any:
    """``a.b[3]`` / ``a['x y']`` lookup in nested dicts/lists (:func:`tracekit.core.paths.get`)."""
    return paths.get(obj, path)


class Experiment(StrictModel):
    """Base class of every experiment kind (config + ``run``).

    Fields shared by all kinds: ``kind`` (registry name), ``name`` (unique step name in a config;
    default: the kind; letters of any script, digits, ``_ . -``) and ``expect`` (reference values
    checked after the run).
    """

    kind: str
    name: Optional[str] = None
    expect: list[Expectation] = Field(default_factory=list)

    result_class: ClassVar[type["Result"]]

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v):
        if v is not None and (not _NAME.fullmatch(v) or v in (".", "..") or v.startswith(".")):
            raise ValueError(f"step name {v!r} must be letters (any script), digits, '_', '.' or '-', not "
                             "starting with '.' (it names the step's folder in the run directory)")
        if v is not None and v.lower() in RESERVED_NAMES:
            raise ValueError(f"step name {v!r} is the name of a file the run directory keeps for itself "
                             f"({', '.join(sorted(RESERVED_NAMES))}); the step's folder would replace it. "
                             "Choose another name")
        return v

    @property
    def step_name(self) -> str:
        return self.name or self.kind

    def check(self, model) -> None:
        """Validate everything that needs only the tokenizer and the model's config (targets are one
        token, prompts fit the context, layer/head indices, hook names, data files), before any
        forward pass. ``model`` may be a loaded model or a :class:`tracekit.model.ModelInfo`.
        Raise a :class:`tracekit.errors.TracekitError` naming the field. Default: nothing."""

    def run(self, model=None, progress: bool = True, *, check: bool = True) -> "Result":
        """Run the experiment and return its :class:`Result`.

        Args:
            model: a loaded model, a model name / :class:`~tracekit.model.ModelSpec` / dict, or
                None (the embedded default).
            progress: show progress bars.
            check: call :meth:`check` first (the runner checks every step before the first runs and
                passes ``check=False``).

        Raises:
            TracekitError: bad input (from :meth:`check` or the run), naming the field.
        """
        from ..hooks import state_guard
        from ..model.load import bos_info, model_fingerprint, model_spec_of

        model = as_model(model)
        if check:
            self.check(model)
        with state_guard(model):
            result = self._run(model, progress=progress)
        spec = model_spec_of(model)
        result.meta.setdefault("model", spec.model_dump(mode="json"))
        result.meta.setdefault("tokenization", bos_info(model))
        result.meta.setdefault("model_fingerprint", model_fingerprint(model))
        return result

    def _run(self, model, progress: bool = True) -> "Result":  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement _run(model, progress)")


MANIFEST = "manifest.json"


class Result:
    """Outcome of an experiment: named tidy tables + metadata (JSON-able) + tensors.

    Subclasses implement ``summary()`` and ``figures()`` from ``self.tables`` / ``self.meta``
    (never from live tensors), so a loaded result behaves like the original.
    """

    main_table: ClassVar[str] = "main"

    def __init__(self, config: Experiment, tables: dict[str, pd.DataFrame], meta: Optional[dict] = None,
                 arrays: Optional[dict] = None):
        self.config = config
        self.tables = tables
        self.meta = meta or {}
        self.arrays = arrays or {}  # name -> torch.Tensor, saved as safetensors

    def to_frame(self, name: Optional[str] = None) -> pd.DataFrame:
        """The main tidy table (or the named one)."""
        return self.tables[name or self.main_table]

    def summary(self) -> dict:
        """Headline numbers (JSON-able)."""
        return {}

    def figures(self) -> dict:
        """Named matplotlib figures (the caller closes them)."""
        return {}

    def plot(self, name: Optional[str] = None):
        """The main figure (or the named one) as a matplotlib ``Figure``; every other figure the
        result drew is closed, so repeated calls in a notebook do not pile up open figures."""
        import matplotlib.pyplot as plt

        figs = self.figures()
        if not figs:
            raise ValueError(f"{type(self).__name__} has no figures")
        key = name or next(iter(figs))
        if key not in figs:
            for f in figs.values():
                plt.close(f)
            raise KeyError(f"no figure {key!r}; this result has {list(figs)}")
        for k, f in figs.items():
            if k != key:
                plt.close(f)
        return figs[key]

    def report(self) -> str:
        """Human-readable text printed by ``tracekit run`` (default: the summary as JSON)."""
        return json.dumps(jsonable(self.summary()), indent=2)

    def check_expectations(self) -> list[dict]:
        s = self.summary()
        return [e.check(s) for e in self.config.expect]

    def save(self, directory: str | Path, figures: bool = True) -> Path:
        """Write the result into ``directory``, atomically.

        Files: ``config.json``, ``meta.json``, ``summary.json``, ``<table>.parquet``, figures
        (PNG), ``arrays.safetensors``, and ``manifest.json`` (every file with its size), written
        last. Everything goes to a temporary sibling folder that is renamed into place when
        complete; an existing ``directory`` is replaced as a whole (no stale files survive).

        Returns:
            The directory.

        Raises:
            OutputError: the folder cannot be written (the message names it; the result stays in
                memory).
        """
        import matplotlib.pyplot as plt

        d = Path(directory)
        try:
            with atomic_folder(d) as tmp:
                (tmp / "config.json").write_text(json.dumps(self.config.model_dump(mode="json"), indent=2))
                (tmp / "meta.json").write_text(json.dumps(jsonable(self.meta), indent=2))
                for name, df in self.tables.items():
                    df.to_parquet(tmp / f"{name}.parquet", index=False)
                if self.arrays:
                    from safetensors.torch import save_file

                    save_file({k: v.detach().cpu().contiguous() for k, v in self.arrays.items()},
                              str(tmp / "arrays.safetensors"))
                summary = self.summary()
                if self.config.expect:
                    summary = {**summary, "expectations": self.check_expectations()}
                (tmp / "summary.json").write_text(json.dumps(jsonable(summary), indent=2))
                if figures:
                    for name, fig in self.figures().items():
                        try:
                            fig.savefig(tmp / f"{name}.png", dpi=110, bbox_inches="tight")
                        finally:
                            plt.close(fig)
                files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
                manifest = {"kind": self.config.kind, "files": files, "tables": sorted(self.tables),
                            "arrays": sorted(self.arrays), "figures": figures}
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        except OSError as e:
            raise OutputError(f"cannot write the result to {d}: {e.strerror or e}") from e
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "Result":
        """Load a result saved by :meth:`save` (the right subclass is found from ``config.json``).

        Raises:
            ResultLoadError: the folder is not a complete saved result (no manifest: the save was
                interrupted, or it is not a step folder; a listed file missing or truncated).
        """
        d = Path(directory)
        man = d / MANIFEST
        if not man.is_file():
            hint = ("pass a step's folder inside a run directory, e.g. results/<run>/<step name>"
                    if not (d / "config.json").is_file() else
                    "its save did not finish (interrupted?); rerun the step")
            raise ResultLoadError(f"{d} is not a complete saved tracekit result (no {MANIFEST}); {hint}")
        try:
            manifest = json.loads(man.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ResultLoadError(f"{d}: unreadable {MANIFEST} ({e}); rerun the step") from e
        problems = []
        for name, size in manifest.get("files", {}).items():
            p = d / name
            if not p.is_file():
                problems.append(f"{name} is missing")
            elif p.stat().st_size != size:
                problems.append(f"{name} has {p.stat().st_size} bytes, {size} were written")
        if problems:
            raise ResultLoadError(f"{d} is incomplete: " + "; ".join(problems) + "; rerun the step")
        cfg = json.loads((d / "config.json").read_text())
        kind = cfg.get("kind")
        if kind not in REGISTRY:
            raise ResultLoadError(f"{d}: unknown experiment kind {kind!r}; known: {sorted(REGISTRY)}")
        exp = REGISTRY[kind].model_validate(cfg)
        tables = {t: pd.read_parquet(d / f"{t}.parquet") for t in manifest.get("tables", [])}
        meta = json.loads((d / "meta.json").read_text())
        arrays = {}
        if (d / "arrays.safetensors").exists():
            from safetensors.torch import load_file

            arrays = load_file(str(d / "arrays.safetensors"))
        return RESULTS[kind](exp, tables, meta, arrays)



