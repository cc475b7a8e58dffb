"""The experiment protocol: a config class whose ``run(model)`` returns a :class:`Result`.

An experiment kind is a pydantic model (its fields are the YAML keys) with a ``kind`` name; the same
class is the notebook API::

    from tracekit import LogitLens, load_model
    result = LogitLens(prompts=["The capital of France is"], target=" Paris").run(load_model())
    result.to_frame(); result.summary(); result.plot(); result.save("out/")

``Experiment.run`` is a template method (as SAELens' ``SAE.forward`` over ``encode``/``decode``):
it turns a model name/spec into a loaded model, builds the kind's inputs once with
:meth:`Experiment.prepare` (tokenization, target ids, positions, layers: everything that needs
only the tokenizer and the model's config, validated on the way; :meth:`Experiment.check` is
``prepare`` plus any further checks), then calls the kind's :meth:`Experiment._run` with those
inputs inside a :func:`tracekit.hooks.state_guard`, so no hook, hook setting or mode survives the
call whatever is raised. Kinds implement ``prepare`` (returning a small frozen ``<Kind>Inputs``
dataclass), optionally ``check``, and ``_run(model, inputs, progress)``; they never override
``run``. Prompts are tokenized in ``prepare`` and ``_run`` reuses the ids; where a kind's engine
takes prompt strings and tokenizes them itself, the kind says so.

:class:`Result`, :func:`register` / :data:`REGISTRY` and :class:`Expectation` live in
:mod:`tracekit.results` (loading a result needs no kind imported first) and are re-exported here.
To add a kind: subclass :class:`Experiment` and :class:`Result`, decorate the experiment with
``@register``, import its module in ``tracekit/experiments/__init__.py`` and add it to
:data:`tracekit.results.KINDS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence, Union, cast

import pandas as pd
import torch
from pydantic import Field, field_validator, model_validator

from ..core.errors import DatasetError
from ..core.io import jsonable
from ..core.strict import Indices, OptionalPrompts, Prompts, StrictModel, retired_message
from ..dataset import DatasetSpec, PreparedDataset, Rows, kind_rows, rows_from_prompts, target_rows
from ..dataset.targets import DLA_POSITION_FORMS, LogitTarget, as_position
from ..hooks import state_guard
from ..model.checks import model_dtype
from ..model.info import HookedModel
from ..model.load import bos_info, load_model, model_fingerprint, model_spec_of
from ..model.spec import ModelSpec
from ..results import MANIFEST, REGISTRY, RESULTS, Expectation, Result, lookup, register
from ..tokens import PositionSpec, encode_prompts

__all__ = ["REGISTRY", "RESULTS", "register", "as_model", "StrictModel", "Prompts", "OptionalPrompts", "Indices",
           "Expectation", "Experiment", "Result", "lookup", "jsonable", "MANIFEST", "retired_message",
           "RESERVED_NAMES", "encode_prompts", "kind_dataset", "check_dataset_fields", "DatasetSpec",
           "PreparedDataset", "Rows", "column", "subset", "RowTargetsExperiment", "RowInputs", "prompt_rows", "check_row_targets", "row_frame",
           "dataset_meta", "PrecisionTolerance", "PRECISION", "precision_note"]


def as_model(model: HookedModel | str | ModelSpec | dict | None) -> HookedModel:
    """A loaded hooked model from a model, a model name, a ModelSpec, a dict or None (default)."""
    if model is None or isinstance(model, (str, dict, ModelSpec)):
        return load_model(model)
    return model



def check_dataset_fields(prompts: Sequence[str] | None, dataset: Optional[DatasetSpec], target: Any = None,
                         foil: Any = None) -> None:
    """A kind's rows come from ``prompts`` (+ ``target``/``foil``) or from ``dataset``, never both.

    Raises:
        ValueError: both or neither given, or ``target``/``foil`` beside a ``dataset`` (its rows carry
            their own); pydantic reports it at the kind's YAML path.
    """
    if dataset is not None and prompts:
        raise ValueError("give prompts or dataset, not both (a dataset's rows hold their prompts)")
    if dataset is None and not prompts:
        raise ValueError("give prompts (a string or a list) or a dataset ({rows: ...}, {path: ...} or "
                         "{generator: ioi})")
    if dataset is not None and (target is not None or foil is not None):
        raise ValueError("target/foil beside a dataset: each row carries its own target and foil (set them in "
                         "the rows); to follow the same tokens on every row use track")


def kind_dataset(model: HookedModel, prompts: Sequence[str] | None, dataset: Optional[DatasetSpec],
                 target: Any = None, foil: Any = None, batch_size: int = 16) -> Rows:
    """The rows a kind runs on: :func:`tracekit.dataset.kind_rows` (kept here for the kinds that
    import it).

    Raises:
        DatasetError / TokenizationError: a row that cannot be used, naming it.
    """
    return kind_rows(model, prompts, dataset, target, foil, batch_size=batch_size)


_NAME = re.compile(r"[^\W][\w.-]*", re.UNICODE)

#: Files a run directory keeps for itself (tracekit.runner): no step may be named like them, or its
#: folder would replace them (the status would read "unknown", the summary would be lost).
RESERVED_NAMES = frozenset({"status.json", "summary.json", "environment.json", "references.json",
                            "config.resolved.yaml", "expectations.json", "error.txt"})


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

    def prepare(self, model: HookedModel) -> Any:
        """The kind's inputs, built once: prompts tokenized, target/foil ids, resolved positions and
        layers, as a small frozen ``<Kind>Inputs`` dataclass (default: None, nothing to prepare).

        Validates what it builds (targets are one token, prompts fit the context, positions are in
        the prompts, layer/head indices), before any forward pass. ``model`` may be a loaded model or
        a :class:`tracekit.model.ModelInfo` (the tokenizer and config, no weights).

        Raises:
            TracekitError: bad input, naming the field.
        """
        return None

    def check(self, model: HookedModel) -> Any:
        """Validate everything that needs only the tokenizer and the model's config (targets are one
        token, prompts fit the context, layer/head indices, hook names, data files), before any
        forward pass: :meth:`prepare` plus the kind's further checks. ``model`` may be a loaded
        model or a :class:`tracekit.model.ModelInfo`.

        Returns:
            The prepared inputs (what :meth:`prepare` returns).

        Raises:
            TracekitError: bad input, naming the field.
        """
        return self.prepare(model)

    def run(self, model: HookedModel | str | ModelSpec | dict | None = None, progress: bool = True, *,
            check: bool = True, inputs: Any = ...) -> "Result":
        """Run the experiment and return its :class:`Result`.

        The inputs are prepared once (:meth:`check`, or only :meth:`prepare` with ``check=False``;
        or given as ``inputs``) and handed to the kind's ``_run``; prompts are not tokenized again by
        the kind.

        Args:
            model: a loaded model, a model name / :class:`~tracekit.model.ModelSpec` / dict, or
                None (the embedded default).
            progress: show progress bars.
            check: call :meth:`check` (not only :meth:`prepare`) first (the runner checks every step
                before the first runs and passes ``check=False``).
            inputs: the prepared inputs, when they were built already (what :meth:`check` or
                :meth:`prepare` returned for this model's tokenizer and config: the runner passes
                what its check before the run returned); neither is called again. ``...``
                (default): prepare them here.

        Raises:
            TracekitError: bad input (from :meth:`check` / :meth:`prepare` or the run), naming the field.
        """
        model = as_model(model)
        if inputs is ...:
            inputs = self.check(model) if check else self.prepare(model)
        with state_guard(model):
            result = self._run(model, inputs, progress=progress)
        spec = model_spec_of(model)
        result.meta.setdefault("model", spec.model_dump(mode="json"))
        result.meta.setdefault("tokenization", bos_info(model))
        result.meta.setdefault("model_fingerprint", model_fingerprint(model))
        note = precision_note(self.kind, model_dtype(model))
        if note is not None:
            result.meta.setdefault("precision", note)
            _summary_with_precision(result)
        _summary_with_filter(result, inputs)
        return result

    def _run(self, model: HookedModel, inputs: Any, progress: bool = True) -> "Result":  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement _run(model, inputs, progress)")


def prompt_rows(model: HookedModel, prompts: Sequence[str], target: Any, foil: Any,
                prepend_bos: Optional[bool] = None) -> Rows:
    """A kind's ``prompts`` with a required ``target``/``foil``: :func:`tracekit.dataset.target_rows`
    (kept here for the kinds that import it).

    Raises:
        TokenizationError / AttributionError: see :func:`tracekit.dataset.target_rows`.
    """
    return target_rows(model, prompts, target, foil, prepend_bos)


def check_row_targets(data: Rows, where: str, what: str) -> None:
    """Every row has a target, and every row has a foil or none does.

    Raises:
        DatasetError: rows without a target, or rows with and without foils (naming the rows).
    """
    missing = [e.row_id for e in data.examples if e.target_id is None]
    if missing:
        raise DatasetError(f"{where}: rows {missing[:10]} have no target; {what} reads each row's target logit "
                           "(give every row a target)")
    no_foil = [e.row_id for e in data.examples if e.foil_id is None]
    if no_foil and len(no_foil) < len(data):
        raise DatasetError(f"{where}: rows {no_foil[:10]} have no foil while other rows have one; the metric would "
                           "be a logit on some rows and a logit difference on others (give every row a foil, or none)")


def row_frame(data: Rows, recs: list[dict]) -> pd.DataFrame:
    """The ``rows`` table: the rows' fields (:meth:`Rows.frame`) then the kind's numbers."""
    frame = data.frame()
    return pd.concat([frame.drop(columns=[c for c in recs[0] if c in frame.columns]).reset_index(drop=True),
                      pd.DataFrame(recs)], axis=1)


def column(df: pd.DataFrame, name: str) -> pd.Series:
    """``df[name]`` typed as the column it is (pandas' stubs type ``df[name]`` as a Series or a
    DataFrame); the same object, nothing copied or converted."""
    return cast(pd.Series, df[name])


def subset(df: pd.DataFrame, mask: Any) -> pd.DataFrame:
    """``df[mask]`` for a boolean row mask, typed as the DataFrame it is; the same operation."""
    return cast(pd.DataFrame, df[mask])


def dataset_meta(data: Rows) -> dict:
    """``meta.json``'s ``dataset``: :meth:`tracekit.dataset.Rows.meta`."""
    return data.meta()


def _rows_of(inputs: Any) -> Optional[Rows]:
    """The :class:`Rows` a kind's prepared inputs hold (the inputs themselves, their ``data``, or
    the ``data`` of their ``rows`` / ``data``: paired rows), else None."""
    seen = [inputs, getattr(inputs, "data", None), getattr(inputs, "rows", None)]
    seen += [getattr(x, "data", None) for x in seen[1:]]
    return next((x for x in seen if isinstance(x, Rows)), None)


def _summary_with_filter(result: Result, inputs: Any) -> None:
    """When the rows' dataset ``filter`` ran (:attr:`tracekit.dataset.Rows.filter_report`): record
    it in ``result.meta["dataset_filter"]``, make ``result.summary()`` carry it under
    ``dataset_filter`` and ``result.report()`` end with a line saying what it kept and dropped (every
    kind, whatever its own summary holds; a kind's own ``dataset_filter`` key is left as it is)."""
    from ..dataset.spec import filter_line

    rows = _rows_of(inputs)
    report = None if rows is None else rows.filter_report
    if report is None:
        return
    report = jsonable(dict(report))
    result.meta.setdefault("dataset_filter", report)
    own_summary, own_report = result.summary, result.report

    def summary() -> dict:
        s = own_summary()
        return s if "dataset_filter" in s else {**s, "dataset_filter": report}

    def text() -> str:
        return own_report().rstrip("\n") + "\n  " + filter_line(report)

    result.summary = summary  # instance attributes: this result only
    result.report = text


class RowTargetsExperiment(Experiment):
    """Base of the kinds that attribute each row's own target (DLA, neuron attribution, SAE
    features): the fields they share, validated once.

    Fields:
        prompts: one string or a list (or give ``dataset``).
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`), each with its own target and foil.
        target: with ``prompts``: a one-token string for every prompt, or a list with one per prompt.
        foil: optional, the same way; with it the metric is the logit difference.
        position: the read position: an int (BOS counted), ``last``, ``token:<text>`` or a named
            position of the dataset's rows (``END``), resolved per row.
    """

    prompts: OptionalPrompts = Field(default_factory=list)
    dataset: Optional[DatasetSpec] = None
    target: Union[str, list[str], None] = None
    foil: Union[str, list[str], None] = Field(default=None, json_schema_extra={"null_from_reference": True})
    position: PositionSpec = "last"

    #: What the target is to the kind (quoted when it is missing).
    target_role: ClassVar[str] = "the token explained"

    @field_validator("position")
    @classmethod
    def _position(cls, v):
        as_position(v, "position", DLA_POSITION_FORMS)
        return v

    @model_validator(mode="after")
    def _rows(self):
        check_dataset_fields(self.prompts, self.dataset, self.target, self.foil)
        if self.dataset is None and self.target is None:
            raise ValueError(f"target: give {self.target_role} (a string for every prompt, or a list with one per "
                             "prompt)")
        if self.dataset is None:
            rows_from_prompts(self.prompts, self.target, self.foil)  # list lengths: one per prompt
        return self


class RowInputs:
    """Mixin of the prepared inputs of a :class:`RowTargetsExperiment` (a frozen dataclass with a
    ``data`` field): each row's token ids and its target (and foil) ids."""

    data: Rows

    @property
    def ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(e.ids for e in self.data.examples)

    @property
    def targets(self) -> tuple[LogitTarget, ...]:
        """Each row's target (and foil) token ids."""
        return tuple(LogitTarget(str(e.row.target), int(cast(int, e.target_id)), e.row.foil, e.foil_id)
                     for e in self.data.examples)


@dataclass(frozen=True)
class PrecisionTolerance:
    """What a kind keeps when its model runs in bfloat16 or float16 instead of float32 (one row of
    :data:`PRECISION`; measured by ``benchmarks/bench_precision.py``, docs/precision.md).

    The low-precision run and a float32 run of the same config on the same weights are compared on
    the ``columns`` of the result's table ``table``, rows matched by ``keys``.

    Attributes:
        table: the result table compared.
        columns: its numeric columns compared (each checked on its own).
        keys: the columns that identify a row (the same rows in both runs).
        rel: the largest allowed ``max |low - float32| / scale`` over a column, ``scale =
            max(max |float32|, floor)`` (scale-free: units cancel).
        top_k: rows ranked by ``|columns[0]|``: how many of the float32 run's top rows are compared
            (0: not a ranking, no rank check).
        min_overlap: the smallest allowed share of the float32 top ``top_k`` rows that are also
            in the low-precision top ``top_k``.
        sensitive: the part of the computation that low precision could make misleading.
        float32: True when tracekit computes that part in float32 (from the model-dtype
            activations or logits); False when it runs at the model's dtype (compare with a float32
            run before trusting small differences).
        floor: the smallest scale a column is measured on, in its own units: 1 for effects
            normalised by the clean - corrupted gap and for accuracies (their natural unit), 0.01 for
            probabilities (a probability below 1% is read on a log scale, not to 5% of itself), 0
            otherwise (the float32 run's largest value).
    """

    table: str
    columns: tuple[str, ...]
    keys: tuple[str, ...]
    rel: float
    top_k: int = 0
    min_overlap: float = 0.0
    sensitive: str = ""
    float32: bool = True
    floor: float = 0.0

    def as_dict(self) -> dict:
        """The tolerance as a JSON-able dict (the ``precision`` summary key's ``tolerance``)."""
        return {"table": self.table, "columns": list(self.columns), "rel": self.rel, "top_k": self.top_k,
                "min_overlap": self.min_overlap, "floor": self.floor}


_P = PrecisionTolerance
_METRIC = "the metric (logit difference, log-softmax, KL) computed in float32 from the model-dtype logits"
_READOUT = "the readout's log-softmax computed in float32 from the model-dtype hidden states"

#: kind -> :class:`PrecisionTolerance`: every built-in kind's stated bfloat16 / float16 tolerance
#: against a float32 run (float16 has 3 more mantissa bits than bfloat16 and is held to the same
#: numbers). Stated from bfloat16's unit roundoff (2**-8 = 0.4% per operation, compounded over
#: the layers), not fitted to the measurement; ``benchmarks/bench_precision.py`` checks them on the
#: real models (docs/precision.md). Forward-only kinds whose metric is computed in float32 allow 5%
#: of the column's scale; kinds that run gradients, training or sampled noise at the model's dtype
#: allow more and say so in their ``precision`` summary key.
PRECISION: dict[str, PrecisionTolerance] = {
    "logit_lens": _P("main", ("prob",), ("row_id", "position", "hidden_state"), 0.05, 5, 0.8, _READOUT, floor=0.01),
    "direct_logit_attribution": _P("components", ("contribution",), ("row_id", "position", "component"), 0.05,
                                   10, 0.8, "component contributions and their sum computed in float32 from the "
                                   "model-dtype activations (the sum identity's tolerance scales with the dtype)"),
    "neuron_attribution": _P("neurons", ("contribution",), ("row_id", "layer", "neuron"), 0.05, 10, 0.7,
                             "neuron contributions (activation x W_out x unembedding) computed in float32 from the "
                             "model-dtype activations"),
    "attention_pattern": _P("rows", ("weight",), ("row_id", "layer", "head_idx", "key"), 0.05, 5, 0.8,
                            "attention patterns (the model's own softmax) at the model dtype", False),
    "head_scan": _P("scores", ("induction_score", "prev_token_score"), ("layer", "head_idx"), 0.05, 5, 0.8,
                    "attention patterns (the model's own softmax) at the model dtype", False),
    "activation_patching": _P("main", ("effect",), ("scope", "intervention", "site", "layer", "position",
                                                   "head_idx", "neuron", "pair", "metric"), 0.05, 10, 0.8,
                              "the patched forward passes at the model dtype (the metric in float32): an effect "
                              "normalised by a small clean - corrupted gap carries that noise", False, floor=1.0),
    "attribution_patching": _P("main", ("effect",), ("scope", "intervention", "site", "layer", "position",
                                                           "head_idx", "neuron", "pair", "metric"), 0.10, 10, 0.7,
                               "gradients (backward pass) at the model dtype; the metric and the products "
                               "(activation difference x gradient) in float32", False, floor=1.0),
    "edge_attribution": _P("edges", ("score",), ("edge",), 0.10, 10, 0.7,
                           "gradients from a backward pass at the model dtype (EAP-IG: at every interpolation "
                           "step); the metric, the write differences and the write x gradient sums in float32", False),
    "path_patching": _P("main", ("effect",), ("senders", "receivers", "scope", "pair"), 0.05, 5, 0.8,
                        _METRIC, floor=1.0),
    "circuit": _P("curve", ("faithfulness",), ("circuit_size",), 0.10, 0, 0.0,
                  "candidate scores (AtP / EAP gradients) at the model dtype; faithfulness from the metric in "
                  "float32", False, floor=1.0),
    "linear_probe": _P("main", ("accuracy",), ("site", "layer"), 0.10, 0, 0.0,
                       "probe fit in float32 (float64 in scikit-learn) on the model-dtype activations upcast",
                       floor=1.0),
    "sae_features": _P("features", ("direct", "total", "activation"), ("row_id", "feature"), 0.10, 5, 0.6,
                       "SAE encoding and attribution of the model-dtype activations", False),
    "sae_eval": _P("metrics", ("mse", "explained_variance", "ce_loss_sae"), (), 0.25, 0, 0.0,
                   "SAE training and evaluation on model-dtype activations", False),
    "sae_train": _P("metrics", ("mse", "explained_variance", "ce_loss_sae"), (), 0.25, 0, 0.0,
                    "SAE training on model-dtype activations (a different optimisation path)", False),
    "transcoder_train": _P("layers", ("fvu",), ("layer",), 0.25, 0, 0.0,
                           "transcoder training on model-dtype activations (a different optimisation path)", False),
    "attribution_graph": _P("main_path", ("influence",), ("row_id", "layer", "position", "feature"), 0.15, 10, 0.6,
                            "gradients (batched backward passes) at the model dtype through the frozen replacement "
                            "model; influences and verification in float32", False),
    "token_trace": _P("lens", ("prob",), ("hidden_state",), 0.05, 5, 0.8, _READOUT, floor=0.01),
    "lens_quality": _P("quality", ("kl", "cross_entropy"), ("lens", "hidden_state"), 0.15, 0, 0.0,
                       "KL in float32; the tuned lens is trained on model-dtype activations", False),
    "patchscope": _P("main", ("target_prob",), ("row_id", "hidden_state"), 0.05, 5, 0.8, _READOUT, floor=0.01),
    "steering": _P("dose_response", ("logit_diff",), ("direction", "draw", "alpha"), 0.05, 0, 0.0, _METRIC),
    "causal_tracing": _P("effects", ("indirect_effect",), ("row_id", "kind", "layer", "position"), 0.10, 5, 0.6,
                         "the noise added to the subject's embeddings at the model dtype; probabilities in float32",
                         False),
    "activations": _P("shards", (), ("file",), 0.0, 0, 0.0,
                      "activations stored as the model computes them (at the store's dtype): compare with a float32 "
                      "run", False),
}

_FLOAT32_OR_WIDER = (torch.float32, torch.float64)


def precision_note(kind: str, dtype: torch.dtype) -> Optional[dict]:
    """The ``precision`` summary key of a run of ``kind`` at ``dtype`` (None in float32 / float64).

    Args:
        kind: the kind's registry name (a kind outside :data:`PRECISION` gets a generic note).
        dtype: the model's parameters' dtype.

    Returns:
        ``{"dtype": "bfloat16", "sensitive": "<what> computed in float32" | "<what> at the model
        dtype: compare with a float32 run", "tolerance": {...} | None, "reference":
        "docs/precision.md"}``; None for float32 and float64 models.
    """
    if dtype in _FLOAT32_OR_WIDER:
        return None
    name = str(dtype).replace("torch.", "")
    tol = PRECISION.get(kind)
    if tol is None:
        sensitive = "not stated for this kind: compare with a float32 run"
    elif tol.float32:
        sensitive = tol.sensitive
    else:
        sensitive = f"{tol.sensitive}: compare with a float32 run before trusting small differences"
    return {"dtype": name, "sensitive": sensitive, "tolerance": None if tol is None else tol.as_dict(),
            "reference": "docs/precision.md"}


def _summary_with_precision(result: Result) -> None:
    """Make ``result.summary()`` carry ``result.meta["precision"]`` under the key ``precision``
    (only when the kind's own summary has no such key; existing keys are left as they are)."""
    own = result.summary

    def summary() -> dict:
        s = own()
        return s if "precision" in s or "precision" not in result.meta else {**s, "precision": result.meta["precision"]}

    result.summary = summary  # an instance attribute: this result only
