"""Experiment kinds, registered by name (see :mod:`tracekit.experiments.base` and :mod:`tracekit.results`).

Each module defines one family of kinds and registers them with ``@register``. The kinds' classes
are exported here lazily (PEP 562): ``from tracekit.experiments import LogitLens`` imports only the
logit lens' module, and a config's kind is imported on demand by :data:`tracekit.results.REGISTRY`
from :data:`tracekit.results.KINDS`, so a run imports only the kinds it uses (a new kind: a module
here, its names in ``_LAZY`` and the ``TYPE_CHECKING`` block, and its entry in
:data:`tracekit.results.KINDS`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import REGISTRY, RESULTS, Expectation, Experiment, Result, StrictModel, register

if TYPE_CHECKING:  # the same names for type checkers and IDEs; at run time they load on first use
    from .activations import CacheActivations, CacheActivationsResult
    from .attention import AttentionPattern, AttentionPatternResult, HeadScan, HeadScanResult
    from .attribution import AttributionPatching, AttributionPatchingResult, VerifySpec
    from .causal_tracing import CausalTracing, CausalTracingResult, SubjectSpec
    from .circuits import Circuit, CircuitResult, ScoreSpec
    from .dla import DirectLogitAttribution, DirectLogitAttributionResult
    from .edge_attribution import EdgeAttribution, EdgeAttributionResult
    from .lens_quality import LensQuality, LensQualityResult
    from .logit_lens import LogitLens, LogitLensResult
    from .neurons import AblationConfig, KeyReadoutConfig, NeuronAttribution, NeuronAttributionResult
    from .patching import ActivationPatching, ActivationPatchingResult, PromptPair, load_pairs
    from .patchscope import Patchscope, PatchscopeResult
    from .path_patching import PathPatching, PathPatchingResult
    from .probing import LinearProbe, LinearProbeResult, ProbeDatasetSpec
    from .sae import SAEEval, SAEEvalResult, SAEFeatures, SAEFeaturesResult, SAETrain, SAETrainResult
    from .steering import Steering, SteeringResult
    from .trace import TokenTrace, TokenTraceResult

#: Exported name -> the module (in this package) that defines it.
_LAZY: dict[str, str] = {
    "CacheActivations": ".activations", "CacheActivationsResult": ".activations", "AttentionPattern": ".attention",
    "AttentionPatternResult": ".attention", "HeadScan": ".attention", "HeadScanResult": ".attention",
    "AttributionPatching": ".attribution", "AttributionPatchingResult": ".attribution",
    "VerifySpec": ".attribution", "CausalTracing": ".causal_tracing", "CausalTracingResult": ".causal_tracing",
    "SubjectSpec": ".causal_tracing", "Circuit": ".circuits", "CircuitResult": ".circuits",
    "ScoreSpec": ".circuits", "DirectLogitAttribution": ".dla", "DirectLogitAttributionResult": ".dla",
    "EdgeAttribution": ".edge_attribution", "EdgeAttributionResult": ".edge_attribution",
    "LensQuality": ".lens_quality", "LensQualityResult": ".lens_quality", "LogitLens": ".logit_lens",
    "LogitLensResult": ".logit_lens", "AblationConfig": ".neurons", "KeyReadoutConfig": ".neurons",
    "NeuronAttribution": ".neurons", "NeuronAttributionResult": ".neurons", "ActivationPatching": ".patching",
    "ActivationPatchingResult": ".patching", "PromptPair": ".patching", "load_pairs": ".patching",
    "Patchscope": ".patchscope", "PatchscopeResult": ".patchscope", "PathPatching": ".path_patching",
    "PathPatchingResult": ".path_patching", "LinearProbe": ".probing", "LinearProbeResult": ".probing",
    "ProbeDatasetSpec": ".probing", "SAEEval": ".sae", "SAEEvalResult": ".sae", "SAEFeatures": ".sae",
    "SAEFeaturesResult": ".sae", "SAETrain": ".sae", "SAETrainResult": ".sae", "Steering": ".steering",
    "SteeringResult": ".steering", "TokenTrace": ".trace", "TokenTraceResult": ".trace",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'tracekit.experiments' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value  # cached: later accesses are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def import_all() -> None:
    """Import every built-in kind's module (registering all of them), e.g. before listing
    :data:`REGISTRY`."""
    for mod in sorted(set(_LAZY.values())):
        importlib.import_module(mod, __name__)


if "__contains__" not in type(REGISTRY).__dict__:  # a registry whose ``in`` sees registered kinds only:
    import_all()  # register every kind now, as before (``tracekit.results._Registry`` decides)

__all__ = [
    "REGISTRY", "RESULTS", "Expectation", "Experiment", "Result", "StrictModel", "register", "import_all",
    "LogitLens", "LogitLensResult",
    "ActivationPatching", "ActivationPatchingResult", "PromptPair", "load_pairs",
    "AttributionPatching", "AttributionPatchingResult", "VerifySpec",
    "EdgeAttribution", "EdgeAttributionResult", "PathPatching", "PathPatchingResult", "Circuit", "CircuitResult",
    "ScoreSpec",
    "DirectLogitAttribution", "DirectLogitAttributionResult", "NeuronAttribution", "NeuronAttributionResult",
    "KeyReadoutConfig", "AblationConfig",
    "AttentionPattern", "AttentionPatternResult", "HeadScan", "HeadScanResult",
    "LinearProbe", "LinearProbeResult", "ProbeDatasetSpec",
    "SAEFeatures", "SAEFeaturesResult", "SAEEval", "SAEEvalResult", "SAETrain", "SAETrainResult",
    "TokenTrace", "TokenTraceResult",
    "CacheActivations", "CacheActivationsResult",
    "LensQuality", "LensQualityResult", "Patchscope", "PatchscopeResult", "Steering", "SteeringResult",
    "CausalTracing", "CausalTracingResult", "SubjectSpec",
]
