"""Results, the registry of experiment kinds and expectations: what a saved result needs, nothing more.

A :class:`Result` holds tidy tables (pandas) plus JSON-able metadata and tensors; ``summary()`` and
the figures are computed from those, so ``Result.load(dir)`` gives back exactly what was saved.
Saving is atomic: a result folder is written under a temporary name, with a ``manifest.json``
listing every file last, and renamed into place; ``Result.load`` refuses a folder without a
complete manifest.

Kinds are registered by name (:func:`register`, refusing duplicates), as SAELens registers SAE
architectures, so a YAML ``kind: logit_lens`` finds its class without an if-chain.

Design (why this module sits low, under the kinds): it imports only :mod:`tracekit.core`, never a
kind or an engine. Loading a result needs the kind's config class (to validate ``config.json``)
and its result class (``result_class``); :data:`REGISTRY` finds both by kind name. A kind already
registered (its module imported) is found directly; a built-in kind that is not yet registered is
imported on demand from :data:`KINDS`, a table of ``kind -> "module:Class"`` strings. So
:meth:`Result.load` never depends on which kind modules happen to be imported, and loading one
kind's result imports that kind's module only (``import tracekit`` itself still imports every
kind, for the notebook API). A kind from outside tracekit registers with ``@register`` when its
module is imported, as before.

Over 600 lines, with a reason: the result container, its atomic save and manifest-checked load,
expectations and the kinds registry are the one idea "what a saved result needs", and the kinds
below import them together.

To add a built-in kind: subclass ``tracekit.experiments.base.Experiment`` and :class:`Result`,
decorate the experiment with ``@register`` and add one line to
:data:`tracekit.core.kinds.BUILTIN_KINDS` (the one table; :data:`KINDS` and the lazy exports of
``tracekit.experiments`` and ``tracekit`` are generated from it, and a test checks it against the
registry).
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Optional, TypeVar, Union

import pandas as pd
from pydantic import Field, field_validator, model_validator

from . import plotting
from .core import paths
from .core.errors import OutputError, ResultLoadError
from .core.io import atomic_folder, jsonable
from .core.kinds import kind_targets
from .core.strict import StrictModel

#: An experiment config (a ``tracekit.experiments.base.Experiment``, which sits above this module
#: and so cannot be imported here; results read its ``kind``, ``expect`` and ``result_class``).
ExperimentConfig = Any

_E = TypeVar("_E", bound=type)

__all__ = ["KINDS", "REGISTRY", "RESULTS", "RENAMED_COLUMNS", "shadowing_columns", "register", "experiment_class", "known_kinds", "Expectation",
           "Result", "ResultFolder", "lookup", "MANIFEST", "round_sig", "SUMMARY_DIGITS", "COMMON_SUMMARY_KEYS"]

#: Summary keys any kind's result may carry besides the ones its class declares (``summary_keys``):
#: ``dataset_filter``, what the rows' ``filter`` kept and dropped (added by the experiment base).
COMMON_SUMMARY_KEYS: tuple[str, ...] = ("dataset_filter",)

#: Built-in kinds: kind name -> ``"module:ExperimentClass"``, imported on demand by :data:`REGISTRY`;
#: generated from the one table :data:`tracekit.core.kinds.BUILTIN_KINDS`.
KINDS: dict[str, str] = kind_targets()

MANIFEST = "manifest.json"


class _Registry(dict):
    """``kind -> class``; a built-in kind not registered yet is imported from :data:`KINDS` on lookup
    (``[]`` and ``get``). ``in`` sees every built-in kind without importing it; iterating (and
    ``len``, ``keys``, ``values``, ``items``) imports them all. So a config imports only the kinds
    it uses (``tracekit.experiments`` is lazy too), and listing the registry lists every kind."""

    def __missing__(self, kind: str):
        if kind not in KINDS:
            raise KeyError(kind)
        _import_kind(kind)
        return dict.__getitem__(self, kind)

    def __contains__(self, kind: object) -> bool:
        return dict.__contains__(self, kind) or (isinstance(kind, str) and kind in KINDS)

    def _all(self) -> None:
        for kind in KINDS:  # listing the registry lists every built-in kind: import them all
            if not dict.__contains__(self, kind):
                _import_kind(kind)

    def __iter__(self):
        self._all()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._all()
        return dict.__len__(self)

    def keys(self):  # type: ignore[override]
        self._all()
        return dict.keys(self)

    def values(self):  # type: ignore[override]
        self._all()
        return dict.values(self)

    def items(self):  # type: ignore[override]
        self._all()
        return dict.items(self)

    def get(self, kind, default=None):
        try:
            return self[kind]
        except KeyError:
            return default


def _import_kind(kind: str) -> None:
    """Import a built-in kind's module and make sure its class is registered (its ``@register`` ran
    when the module was first imported; a class taken out of the registry since is put back)."""
    module, _, name = KINDS[kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if dict.get(REGISTRY, kind) is not cls or dict.get(RESULTS, kind) is not cls.result_class:
        dict.pop(REGISTRY, kind, None)
        register(cls)


#: Experiment classes by kind name (``REGISTRY["logit_lens"]`` is :class:`tracekit.LogitLens`).
REGISTRY: dict[str, type[ExperimentConfig]] = _Registry()
#: Result classes by kind name (each kind's ``result_class``).
RESULTS: dict[str, type["Result"]] = _Registry()


def register(cls: _E) -> _E:
    """Class decorator: make an experiment kind available to configs under its ``kind`` name.

    Raises:
        ValueError: another class is already registered under that kind (two kinds cannot share
            a name; the second would silently replace the first).
        TypeError: the class has no string default for ``kind`` or overrides ``run``.
    """
    kind = cls.model_fields["kind"].default
    if not isinstance(kind, str):
        raise TypeError(f"{cls.__name__} needs a string default for field 'kind'")
    old = dict.get(REGISTRY, kind)
    builtin = KINDS.get(kind)
    if old is None and builtin is not None and builtin != f"{cls.__module__}:{cls.__qualname__}":
        old_name = builtin.rpartition(":")[2]  # a built-in kind not imported yet is registered all the same
        raise ValueError(f"experiment kind {kind!r} is already registered by {old_name}; "
                         f"{cls.__qualname__} needs another kind name")
    if old is not None and old is not cls:
        raise ValueError(f"experiment kind {kind!r} is already registered by {old.__qualname__}; "
                         f"{cls.__qualname__} needs another kind name")
    if "run" in cls.__dict__:
        raise TypeError(f"{cls.__name__} overrides run(); implement _run(model, inputs, progress) instead")
    REGISTRY[kind] = cls
    RESULTS[kind] = cls.result_class
    return cls


def known_kinds() -> list[str]:
    """Every kind name: the built-in ones and any registered from outside tracekit."""
    return sorted(set(KINDS) | set(REGISTRY))


def experiment_class(kind: Any) -> Optional[type[ExperimentConfig]]:
    """The experiment class of a kind name (imported on demand), or None for an unknown kind."""
    return REGISTRY.get(kind) if isinstance(kind, str) else None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


#: Significant digits a summary keeps (:func:`round_sig`).
SUMMARY_DIGITS = 6


def round_sig(obj: Any, digits: int = SUMMARY_DIGITS) -> Any:
    """``obj`` with every float rounded to ``digits`` *significant* digits (and never to fewer than
    ``digits`` decimal places, so values above 1 keep 1e-6 absolute precision), in nested dicts,
    lists and tuples (tuples become lists); numpy and float32 scalars become Python floats first.

    The one rounding rule of summaries: significant digits, never decimal places. ``round(p, 6)``
    turns a probability of 4.128e-06 into 4e-06 (and a float32 4e-06 prints as 3.99999e-06), so
    the same number read from a list and from a scalar disagreed; with significant digits both read
    4.128e-06. Non-finite floats, ints, bools, strings and None are returned unchanged.

    Args:
        obj: a JSON-like value.
        digits: significant digits kept (>= 1).

    Returns:
        The rounded copy.
    """
    import numpy as np

    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return obj
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        if not math.isfinite(x) or x == 0.0:
            return x
        d = max(1, int(digits))  # d significant digits, and never coarser than d decimals (2.2006046 -> 2.200605)
        return round(x, max(d, d - 1 - math.floor(math.log10(abs(x)))))
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, dict):
        return {k: round_sig(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [round_sig(v, digits) for v in obj]
    return obj


def lookup(obj: Any, path: str) -> Any:
    """``a.b[3]`` / ``a['x y']`` lookup in nested dicts/lists (:func:`tracekit.core.paths.get`)."""
    return paths.get(obj, path)


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


#: Table columns renamed so that none shadows a DataFrame method (``df.head`` is a method, so
#: ``df[df.head == 3]`` was silently an empty frame): old -> new, for every kind. A result class adds
#: its own in :attr:`Result.renamed_columns` (``"rank"``, or ``"table.rank"`` for one table).
RENAMED_COLUMNS: dict[str, str] = {"head": "head_idx", "mode": "verb"}


def shadowing_columns(df: pd.DataFrame) -> list[str]:
    """Columns of ``df`` named like a DataFrame attribute (``head``, ``rank``, ``index``, ``count``...):
    ``df.<name>`` would give the method, not the column."""
    return [str(c) for c in df.columns if str(c) in _FRAME_ATTRS]


_FRAME_ATTRS = frozenset(dir(pd.DataFrame))


class Result:
    """Outcome of an experiment: named tidy tables + metadata (JSON-able) + tensors.

    Subclasses implement ``summary()`` and ``figures()`` from ``self.tables`` / ``self.meta``
    (never from live tensors), so a loaded result behaves like the original.
    """

    main_table: ClassVar[str] = "main"
    #: This kind's renamed columns beyond :data:`RENAMED_COLUMNS` (``old`` or ``table.old`` -> new).
    renamed_columns: ClassVar[dict[str, str]] = {}

    @classmethod
    def renamed_column(cls, table: str, column: str) -> Optional[str]:
        """The new name of a retired column of ``table`` (None when ``column`` is not retired)."""
        table_map = {**RENAMED_COLUMNS, **cls.renamed_columns}
        return table_map.get(f"{table}.{column}", table_map.get(column))

    @classmethod
    def _rename_old_columns(cls, tables: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
        """Tables saved before a rename, with today's column names."""
        out = {}
        for name, df in tables.items():
            ren = {c: new for c in df.columns if (new := cls.renamed_column(name, str(c))) and new not in df.columns}
            out[name] = df.rename(columns=ren) if ren else df
        return out

    def __init__(self, config: ExperimentConfig, tables: dict[str, pd.DataFrame], meta: Optional[dict] = None,
                 arrays: Optional[dict] = None):
        self.config = config
        self.tables = tables
        self.meta = meta or {}
        self.arrays = arrays or {}  # name -> torch.Tensor, saved as safetensors
        #: The activations the kind cached during its run (hook name -> tensor; a
        #: :class:`tracekit.activations.cached.CachedActivations` where the kind keeps them), in
        #: memory only: not saved, empty on a loaded result (docs/results.md).
        self.activations: Mapping[str, Any] = {}

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

    #: Summary keys shown first by the notebook display (:meth:`_repr_html_`); the rest follow in
    #: the summary's order, scalars before lists and dicts, up to :attr:`html_max_rows` rows.
    headline_keys: ClassVar[tuple[str, ...]] = ()
    html_max_rows: ClassVar[int] = 24

    def headline(self, summary: Optional[dict] = None) -> list[tuple[str, Any]]:
        """The summary's headline ``(key, value)`` pairs, as the notebook display shows them:
        :attr:`headline_keys` first, then scalar values, then lists and dicts (at most
        :attr:`html_max_rows`).

        Args:
            summary: this result's :meth:`summary` when the caller has it already (default: computed).
        """
        s = {k: v for k, v in (self.summary() if summary is None else summary).items() if k != "expectations"}
        first = [k for k in self.headline_keys if k in s]
        scal = [k for k, v in s.items() if k not in first and not isinstance(v, (list, tuple, dict))]
        rest = [k for k in s if k not in first and k not in scal]
        return [(k, s[k]) for k in (first + scal + rest)[:self.html_max_rows]]

    def _repr_html_(self) -> str:
        """Rich notebook display: the kind, the tables' sizes, the headline numbers of
        :meth:`summary` (:meth:`headline`; numbers to 4 significant digits) and the main figure
        inline as a base64 PNG. Self-contained: inline styles only, no script or external file."""
        cfg = self.config
        name = getattr(cfg, "step_name", None) or getattr(cfg, "name", None)
        title = f"{type(self).__name__} ({cfg.kind}" + (f", step {name!r})" if name else ")")
        summary = self.summary()
        rows = [(k, plotting.format_value(v)) for k, v in self.headline(summary)]
        n_keys = len([k for k in summary if k != "expectations"])
        notes = ["tables: " + ", ".join(f"{t} ({len(df)} x {df.shape[1]})" for t, df in sorted(self.tables.items()))]
        if n_keys > len(rows):
            notes.append(f"{n_keys - len(rows)} more summary keys: .summary()")
        if getattr(cfg, "expect", None):
            chk = [e.check(summary) for e in cfg.expect]
            notes.append(f"expectations met: {sum(bool(c.get('met')) for c in chk)} of {len(chk)}")
        return plotting.html_card(title, rows, self._figure_html(), notes)

    def _figure_html(self) -> str:
        """The main figure (:meth:`plot`) as an inline ``<img>``, or a line saying why there is none."""
        from html import escape

        import matplotlib.pyplot as plt

        try:
            fig = self.plot()
        except ValueError:  # this result draws no figures
            return ""
        except Exception as e:  # noqa: BLE001 - a figure that fails must not hide the numbers
            return f'<div style="color:#a00">main figure not drawn: {escape(type(e).__name__)}: {escape(str(e))}</div>'
        try:
            return plotting.fig_to_html(fig)
        finally:
            plt.close(fig)

    def check_expectations(self) -> list[dict]:
        """Every expectation of the config checked against :meth:`summary` (report rows)."""
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
        d = Path(directory)
        try:
            with atomic_folder(d) as tmp:
                self._write(tmp, figures)
        except OSError as e:
            raise OutputError(f"cannot write the result to {d}: {e.strerror or e}") from e
        return d

    def _write(self, tmp: Path, figures: bool) -> None:
        """The files of :meth:`save`, into the (temporary) folder ``tmp``; the manifest last."""
        import matplotlib.pyplot as plt

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
                    # a figure that asks for more (plotting.paper_heatmap: its Figure.dpi) gets it
                    fig.savefig(tmp / f"{name}.png", dpi=max(110, float(fig.dpi)), bbox_inches="tight")
                finally:
                    plt.close(fig)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {"kind": self.config.kind, "files": files, "tables": sorted(self.tables),
                    "arrays": sorted(self.arrays), "figures": figures}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "Result":
        """Load a result saved by :meth:`save` (the right subclass is found from ``config.json``,
        through :data:`REGISTRY`: the kind's module is imported if it is not yet).

        Every file is read through :class:`ResultFolder` (one checked loader): the manifest,
        ``config.json`` (validated by the kind's config class), ``meta.json``, ``summary.json``,
        every table and the arrays.

        Raises:
            ResultLoadError: the folder is not a complete saved result (no manifest: the save was
                interrupted, or it is not a step folder; a foreign manifest; a listed file missing,
                truncated or unreadable; a config its kind refuses), or its kind is unknown. The
                message names the folder, the file and what is wrong.
        """
        f = ResultFolder(directory)
        exp = f.config()
        kind = exp.kind
        f.json("summary.json")  # a damaged summary is a damaged result, even though it is recomputed
        tables = RESULTS[kind]._rename_old_columns({t: f.table(t) for t in f.tables})
        meta = f.json("meta.json")
        if not isinstance(meta, dict):
            raise f.error("meta.json", f"holds {type(meta).__name__}, not a mapping")
        return RESULTS[kind](exp, tables, meta, f.arrays())


class ResultFolder:
    """The one checked loader of a saved result folder (:meth:`Result.save`): every file it holds
    (``manifest.json``, ``config.json``, ``meta.json``, ``summary.json``, ``<table>.parquet``,
    ``arrays.safetensors``) is read here, and anything wrong (a foreign or half-written folder, a
    file missing, truncated, not parseable, or a config its kind refuses) is a
    :class:`~tracekit.core.errors.ResultLoadError` naming the folder, the file and the problem,
    never a raw ``ValidationError`` / ``FileNotFoundError`` / ``JSONDecodeError``.

    Used by :meth:`Result.load` and the sweep index (:func:`tracekit.sweep.load_results`,
    :func:`tracekit.sweep.load_point`).

    Args:
        directory: the saved step folder (e.g. ``results/<run>/<step name>``).

    Raises:
        ResultLoadError: no manifest, a manifest that is not tracekit's, or a listed file missing
            or of another size than written (:func:`_read_manifest`).
    """

    def __init__(self, directory: str | Path):
        self.path = Path(directory)
        self.manifest = _read_manifest(self.path)
        #: The tables the manifest lists (names, without ``.parquet``).
        self.tables: list[str] = list(self.manifest.get("tables", []))

    def error(self, name: str, what: str) -> ResultLoadError:
        """The error for file ``name`` of this folder: ``<folder>: <name> <what>; rerun the step``."""
        return ResultLoadError(f"{self.path}: {name} {what}; this is not a complete saved tracekit result "
                               "(rerun the step, or pass a folder written by tracekit)")

    def file(self, name: str) -> Path:
        """The path of file ``name``, which must exist.

        Raises:
            ResultLoadError: the file is missing.
        """
        p = self.path / name
        if not p.is_file():
            raise self.error(name, "is missing")
        return p

    def json(self, name: str) -> Any:
        """The parsed content of JSON file ``name`` (UTF-8).

        Raises:
            ResultLoadError: the file is missing, unreadable or not valid JSON.
        """
        p = self.file(name)
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.error(name, f"is not valid JSON ({type(e).__name__}: {e})") from e

    def table(self, name: str) -> pd.DataFrame:
        """Table ``name`` (``<name>.parquet``) as saved (old column names are renamed by
        :meth:`Result.load`, not here).

        Raises:
            ResultLoadError: the file is missing or not a readable parquet table.
        """
        fname = f"{name}.parquet"
        p = self.file(fname)
        try:
            return pd.read_parquet(p)
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a damaged file
            raise self.error(fname, f"is not a readable parquet table ({type(e).__name__}: {e})") from e

    def config(self) -> ExperimentConfig:
        """``config.json`` validated by its kind's config class (found through :data:`REGISTRY`).

        Raises:
            ResultLoadError: the file is missing or not JSON, names no or an unknown kind (or
                another kind than the manifest), or its kind's class refuses it (each field
                named).
        """
        from pydantic import ValidationError

        cfg = self.json("config.json")
        if not isinstance(cfg, dict):
            raise self.error("config.json", f"holds {type(cfg).__name__}, not a mapping with a 'kind'")
        kind = cfg.get("kind")
        exp_cls = experiment_class(kind)
        if exp_cls is None:
            raise self.error("config.json", f"names an unknown experiment kind {kind!r}; known: {known_kinds()}")
        if self.manifest.get("kind") not in (None, kind):
            raise self.error("config.json", f"is a {kind!r} config but {MANIFEST} says {self.manifest['kind']!r}")
        try:
            return exp_cls.model_validate(cfg)
        except ValidationError as e:
            errs = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(top level)'}: {x['msg']}" for x in e.errors())
            raise self.error("config.json", f"is not a valid {kind!r} config ({errs})") from e

    def arrays(self) -> dict:
        """The saved tensors (``arrays.safetensors``; ``{}`` when the result saved none).

        Raises:
            ResultLoadError: the manifest lists the file and it is missing or unreadable.
        """
        name = "arrays.safetensors"
        if name not in self.manifest.get("files", {}) and not (self.path / name).exists():
            return {}
        p = self.file(name)
        from safetensors.torch import load_file

        try:
            return load_file(str(p))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged file
            raise self.error(name, f"is not a readable safetensors file ({type(e).__name__}: {e})") from e


def _read_manifest(d: Path) -> dict:
    """The manifest of a complete saved result folder.

    Raises:
        ResultLoadError: no or unreadable manifest, one that is not tracekit's (not a mapping of
            ``files`` name -> size and ``tables`` names), or a listed file missing or of another size.
    """
    man = d / MANIFEST
    if not man.is_file():
        hint = ("pass a step's folder inside a run directory, e.g. results/<run>/<step name>"
                if not (d / "config.json").is_file() else
                "its save did not finish (interrupted?); rerun the step")
        raise ResultLoadError(f"{d} is not a complete saved tracekit result (no {MANIFEST}); {hint}")
    try:
        manifest = json.loads(man.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultLoadError(f"{d}: unreadable {MANIFEST} ({e}); rerun the step") from e
    files = manifest.get("files", {}) if isinstance(manifest, dict) else None
    tables = manifest.get("tables", []) if isinstance(manifest, dict) else None
    if (not isinstance(files, dict) or not all(isinstance(k, str) and _is_int(v) for k, v in files.items())
            or not isinstance(tables, list) or not all(isinstance(t, str) for t in tables)):
        raise ResultLoadError(f"{d}: {MANIFEST} is not a tracekit result manifest (a mapping with 'files': "
                              "name -> size and 'tables': names); pass a step folder saved by tracekit")
    problems = []
    for name, size in files.items():
        p = d / name
        if not p.is_file():
            problems.append(f"{name} is missing")
        elif p.stat().st_size != size:
            problems.append(f"{name} has {p.stat().st_size} bytes, {size} were written")
    if problems:
        raise ResultLoadError(f"{d} is incomplete: " + "; ".join(problems) + "; rerun the step")
    return manifest


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
