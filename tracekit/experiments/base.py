"""The experiment protocol: a config class with ``run(model) -> Result``, registered by name.

An experiment kind is a pydantic model (its fields are the YAML keys) with a ``kind`` name and a
``run(model)`` method; the same class is the notebook API::

    from tracekit import LogitLens, load_model
    result = LogitLens(prompts=["The capital of France is"], target=" Paris").run(load_model())
    result.to_frame(); result.summary(); result.plot(); result.save("out/")

A :class:`Result` holds tidy tables (pandas) plus JSON-able metadata; ``summary()`` and the figures
are computed from those, so ``Result.load(dir)`` gives back exactly what was saved.

Kinds are registered by name (``@register``), as SAELens registers SAE architectures, so a YAML
``kind: logit_lens`` finds its class without an if-chain. To add a kind: subclass
:class:`Experiment` and :class:`Result`, decorate the experiment with ``@register``, import the
module in ``tracekit/experiments/__init__.py``.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any, ClassVar, Optional

import pandas as pd
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

def _str_to_list(v):
    return [v] if isinstance(v, str) else v


#: A config field holding prompts: one string or a list of strings (at least one).
Prompts = Annotated[list[str], BeforeValidator(_str_to_list), Field(min_length=1)]
#: The same, possibly empty.
OptionalPrompts = Annotated[list[str], BeforeValidator(_str_to_list)]

REGISTRY: dict[str, type["Experiment"]] = {}
RESULTS: dict[str, type["Result"]] = {}


def register(cls: type["Experiment"]) -> type["Experiment"]:
    """Class decorator: make an experiment kind available to configs under ``cls.kind``.

    Also lets ``run`` take a model name / :class:`~tracekit.models.ModelSpec` / ``None`` (the
    embedded default) in place of a loaded model: ``LogitLens(...).run("gpt2")``.
    """
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__} needs a string default for field 'kind'")
    REGISTRY[kind] = cls
    RESULTS[kind] = cls.result_class
    if "run" in cls.__dict__ and not getattr(cls.__dict__["run"], "_tracekit_wrapped", False):
        orig = cls.__dict__["run"]

        @functools.wraps(orig)
        def run(self, model=None, *args, **kwargs):
            return orig(self, as_model(model), *args, **kwargs)

        run._tracekit_wrapped = True
        cls.run = run
    return cls


def as_model(model):
    """A loaded hooked model from a model, a model name, a ModelSpec, a dict or None (default)."""
    from ..models import ModelSpec, load_model

    if model is None or isinstance(model, (str, dict, ModelSpec)):
        return load_model(model)
    return model


class Expectation(BaseModel):
    """A reference value a run checks, e.g. the seed article's numbers.

    ``metric`` is a key of the step's ``summary()``, optionally indexed: ``target_prob_by_layer[8]``.
    Met when ``|observed - value| <= atol`` (if ``value`` given) and within ``[min, max]``.
    """

    model_config = ConfigDict(extra="forbid")

    metric: str
    value: Optional[Any] = None
    atol: float = 0.0
    min: Optional[float] = None
    max: Optional[float] = None
    note: Optional[str] = None

    @model_validator(mode="after")
    def _needs_bound(self):
        if self.value is None and self.min is None and self.max is None:
            raise ValueError("an expectation needs 'value' (with 'atol'), 'min' or 'max'")
        return self

    def check(self, summary: dict) -> dict:
        """Evaluate against a summary dict; returns a JSON-able report row."""
        row: dict[str, Any] = {"metric": self.metric, "expected": self.value, "atol": self.atol,
                               "min": self.min, "max": self.max, "note": self.note}
        try:
            obs = lookup(summary, self.metric)
        except (KeyError, IndexError, TypeError) as e:
            keys = sorted(k for k in summary if k != "expectations")
            row.update(observed=None, met=False,
                       error=f"no such summary metric {self.metric!r} ({type(e).__name__}: {e}); "
                             f"available: {keys}")
            return row
        row["observed"] = obs
        met = True
        if self.value is not None:
            if isinstance(self.value, (int, float)) and isinstance(obs, (int, float)):
                met &= bool(abs(float(obs) - float(self.value)) <= self.atol + 1e-12)
            else:
                met &= obs == self.value
        if self.min is not None:
            met &= isinstance(obs, (int, float)) and obs >= self.min
        if self.max is not None:
            met &= isinstance(obs, (int, float)) and obs <= self.max
        row["met"] = bool(met)
        return row


_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_INDEX = re.compile(r"\[(-?\d+|'[^']*'|\"[^\"]*\")\]")


def lookup(obj: Any, path: str) -> Any:
    """``a.b[3]`` / ``a['x y']`` lookup in nested dicts/lists."""
    head, _, _ = path.partition("[")
    parts = [p for p in head.split(".") if p]
    for p in parts:
        obj = obj[p] if isinstance(obj, dict) else obj[int(p)]
    for m in _INDEX.finditer(path[len(head):]):
        k = m.group(1)
        obj = obj[int(k)] if k.lstrip("-").isdigit() else obj[k.strip("'\"")]
    return obj


class Experiment(BaseModel):
    """Base class of every experiment kind (config + ``run``).

    Fields shared by all kinds: ``kind`` (registry name), ``name`` (unique step name in a config;
    default: the kind) and ``expect`` (reference values checked after the run).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    kind: str
    name: Optional[str] = None
    expect: list[Expectation] = Field(default_factory=list)

    result_class: ClassVar[type["Result"]]

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v):
        if v is not None and (not _NAME.fullmatch(v) or v in (".", "..")):
            raise ValueError(f"step name {v!r} must be letters, digits, '.', '_' or '-' "
                             "(it names the step's folder in the run directory)")
        return v

    def check(self, model) -> None:
        """Validate everything that needs the tokenizer (targets, prompt alignment) before any
        model work. Raise ``TokenizationError``/``ValueError`` naming the field. Default: nothing."""

    def run(self, model, progress: bool = True) -> "Result":  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def step_name(self) -> str:
        return self.name or self.kind


class Result:
    """Outcome of an experiment: named tidy tables + metadata (JSON-able).

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
        """Named matplotlib figures."""
        return {}

    def plot(self):
        """The main figure (matplotlib ``Figure``)."""
        figs = self.figures()
        if not figs:
            raise ValueError(f"{type(self).__name__} has no figures")
        return next(iter(figs.values()))

    def report(self) -> str:
        """Human-readable text printed by ``tracekit run`` (default: the summary as JSON)."""
        return json.dumps(_jsonable(self.summary()), indent=2)

    def check_expectations(self) -> list[dict]:
        s = self.summary()
        return [e.check(s) for e in self.config.expect]

    def save(self, directory: str | Path, figures: bool = True) -> Path:
        """Write ``config.json``, ``meta.json``, ``summary.json``, ``<table>.parquet``, figures (PNG)
        and arrays (``arrays.safetensors``) into ``directory``. Returns the directory."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(self.config.model_dump(mode="json"), indent=2))
        (d / "meta.json").write_text(json.dumps(_jsonable(self.meta), indent=2))
        for name, df in self.tables.items():
            df.to_parquet(d / f"{name}.parquet", index=False)
        if self.arrays:
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous() for k, v in self.arrays.items()},
                      str(d / "arrays.safetensors"))
        summary = self.summary()
        if self.config.expect:
            summary = {**summary, "expectations": self.check_expectations()}
        (d / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2))
        if figures:
            import matplotlib.pyplot as plt

            for name, fig in self.figures().items():
                fig.savefig(d / f"{name}.png", dpi=110, bbox_inches="tight")
                plt.close(fig)
        return d

    @classmethod
    def load(cls, directory: str | Path) -> "Result":
        """Load a result saved by :meth:`save` (the right subclass is found from ``config.json``)."""
        d = Path(directory)
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"{d} is not a saved tracekit result (no config.json); pass a step's "
                                    "folder inside a run directory, e.g. results/<run>/<step name>")
        cfg = json.loads((d / "config.json").read_text())
        kind = cfg.get("kind")
        if kind not in REGISTRY:
            raise ValueError(f"{d}: unknown experiment kind {kind!r}")
        exp = REGISTRY[kind].model_validate(cfg)
        tables = {p.stem: pd.read_parquet(p) for p in sorted(d.glob("*.parquet"))}
        meta = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else {}
        arrays = {}
        if (d / "arrays.safetensors").exists():
            from safetensors.torch import load_file

            arrays = load_file(str(d / "arrays.safetensors"))
        return RESULTS[kind](exp, tables, meta, arrays)


def _jsonable(x: Any) -> Any:
    """Convert numpy/torch scalars and NaN to JSON-friendly values."""
    import numpy as np

    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return x
