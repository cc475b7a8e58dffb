"""The one table of tracekit's built-in experiment kinds: each kind's name, module and classes.

A kind is registered here once, by one line of :data:`BUILTIN_KINDS`; everything else that lists
the built-in kinds is generated from this table, so adding a kind is: its module in
``tracekit/experiments/`` (an ``Experiment`` subclass decorated with ``@register``, and its
``Result`` subclass), plus one line here (and, for type checkers and IDEs, the same names in the
``TYPE_CHECKING`` blocks of ``tracekit/__init__.py`` and ``tracekit/experiments/__init__.py``;
``tests/unit/test_registry.py`` checks those blocks against this table). Generated from it:

* :data:`tracekit.results.KINDS` (``kind -> "module:Class"``, imported on demand by
  :data:`tracekit.results.REGISTRY`, so loading a result imports only its kind's module);
* the lazy exports (PEP 562) and ``__all__`` of :mod:`tracekit.experiments` and of :mod:`tracekit`.

The table is plain strings (no import of any kind), so ``import tracekit``, ``tracekit --help``,
``tracekit kinds`` and ``tracekit validate --schema-only`` read it without importing torch.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["KindEntry", "BUILTIN_KINDS", "KIND_MODULE_NAMES", "kind_targets", "experiments_exports",
           "package_exports"]


class KindEntry(NamedTuple):
    """One built-in kind: the module (in ``tracekit.experiments``) defining its experiment class, the
    experiment class's name and its result class's name (the module exports both)."""

    module: str
    experiment: str
    result: str


#: Built-in kinds: kind name -> :class:`KindEntry` (the one registration place of a built-in kind).
BUILTIN_KINDS: dict[str, KindEntry] = {
    "logit_lens": KindEntry("logit_lens", "LogitLens", "LogitLensResult"),
    "direct_logit_attribution": KindEntry("dla", "DirectLogitAttribution", "DirectLogitAttributionResult"),
    "neuron_attribution": KindEntry("neurons", "NeuronAttribution", "NeuronAttributionResult"),
    "attention_pattern": KindEntry("attention", "AttentionPattern", "AttentionPatternResult"),
    "head_scan": KindEntry("attention", "HeadScan", "HeadScanResult"),
    "activation_patching": KindEntry("patching", "ActivationPatching", "ActivationPatchingResult"),
    "attribution_patching": KindEntry("attribution", "AttributionPatching", "AttributionPatchingResult"),
    "edge_attribution": KindEntry("edge_attribution", "EdgeAttribution", "EdgeAttributionResult"),
    "path_patching": KindEntry("path_patching", "PathPatching", "PathPatchingResult"),
    "circuit": KindEntry("circuits", "Circuit", "CircuitResult"),
    "linear_probe": KindEntry("probing", "LinearProbe", "LinearProbeResult"),
    "sae_features": KindEntry("sae", "SAEFeatures", "SAEFeaturesResult"),
    "sae_eval": KindEntry("sae_quality", "SAEEval", "SAEEvalResult"),
    "sae_train": KindEntry("sae_quality", "SAETrain", "SAETrainResult"),
    "transcoder_train": KindEntry("transcoders", "TranscoderTrain", "TranscoderTrainResult"),
    "token_trace": KindEntry("trace", "TokenTrace", "TokenTraceResult"),
    "lens_quality": KindEntry("lens_quality", "LensQuality", "LensQualityResult"),
    "patchscope": KindEntry("patchscope", "Patchscope", "PatchscopeResult"),
    "steering": KindEntry("steering", "Steering", "SteeringResult"),
    "causal_tracing": KindEntry("causal_tracing", "CausalTracing", "CausalTracingResult"),
    "activations": KindEntry("activations", "CacheActivations", "CacheActivationsResult"),
    "attribution_graph": KindEntry("attribution_graph", "AttributionGraphExperiment", "AttributionGraphResult"),
}

#: Other public names of the kind modules (config parts users build in notebooks): name ->
#: ``(module in tracekit.experiments, also exported by the package root tracekit)``.
KIND_MODULE_NAMES: dict[str, tuple[str, bool]] = {
    "AblationConfig": ("neurons", True),
    "KeyReadoutConfig": ("neurons", True),
    "ProbeDatasetSpec": ("probing", True),
    "PromptPair": ("patching", True),
    "load_pairs": ("patching", False),
    "VerifySpec": ("attribution", False),
    "SubjectSpec": ("causal_tracing", False),
    "ScoreSpec": ("circuits", False),
}


def kind_targets() -> dict[str, str]:
    """``kind -> "tracekit.experiments.<module>:<ExperimentClass>"`` for every built-in kind, in
    :data:`BUILTIN_KINDS` order. Raises nothing."""
    return {kind: f"tracekit.experiments.{e.module}:{e.experiment}" for kind, e in BUILTIN_KINDS.items()}


def experiments_exports() -> dict[str, str]:
    """The names :mod:`tracekit.experiments` exports lazily: name -> its module, relative to
    ``tracekit.experiments`` (``".logit_lens"``): each kind's experiment and result class, and
    :data:`KIND_MODULE_NAMES`. Raises nothing."""
    out: dict[str, str] = {}
    for e in BUILTIN_KINDS.values():
        out[e.experiment] = out[e.result] = f".{e.module}"
    for name, (module, _) in KIND_MODULE_NAMES.items():
        out[name] = f".{module}"
    return out


def package_exports() -> dict[str, str]:
    """The kind names the package root :mod:`tracekit` exports lazily: name -> its module, relative
    to ``tracekit`` (``".experiments.logit_lens"``): each kind's experiment and result class, and the
    :data:`KIND_MODULE_NAMES` marked for the root. Raises nothing."""
    out: dict[str, str] = {}
    for e in BUILTIN_KINDS.values():
        out[e.experiment] = out[e.result] = f".experiments.{e.module}"
    for name, (module, root) in KIND_MODULE_NAMES.items():
        if root:
            out[name] = f".experiments.{module}"
    return out
