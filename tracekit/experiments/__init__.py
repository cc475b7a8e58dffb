"""Experiment kinds, registered by name (see :mod:`tracekit.experiments.base` and :mod:`tracekit.results`).

Each module defines one family of kinds and registers them with ``@register``. The kinds' classes
are exported here lazily (PEP 562): ``from tracekit.experiments import LogitLens`` imports only the
logit lens' module, and a config's kind is imported on demand by :data:`tracekit.results.REGISTRY`
from :data:`tracekit.results.KINDS`, so a run imports only the kinds it uses. Both tables are
generated from the one kinds table :data:`tracekit.core.kinds.BUILTIN_KINDS` (a new kind: a module
here and one line there; the ``TYPE_CHECKING`` block below repeats the names for type checkers,
and ``tests/unit/test_registry.py`` checks it against the table).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..core.kinds import experiments_exports
from .base import REGISTRY, RESULTS, Expectation, Experiment, Result, StrictModel, register

if TYPE_CHECKING:  # the same names for type checkers and IDEs (checked against the kinds table by tests/unit/test_registry.py)
    from .activations import CacheActivations, CacheActivationsResult  # noqa: F401
    from .attention import AttentionPattern, AttentionPatternResult, HeadScan, HeadScanResult  # noqa: F401
    from .attribution import AttributionPatching, AttributionPatchingResult, VerifySpec  # noqa: F401
    from .attribution_graph import AttributionGraphExperiment, AttributionGraphResult  # noqa: F401
    from .causal_tracing import CausalTracing, CausalTracingResult, SubjectSpec  # noqa: F401
    from .circuits import Circuit, CircuitResult, ScoreSpec  # noqa: F401
    from .dla import DirectLogitAttribution, DirectLogitAttributionResult  # noqa: F401
    from .edge_attribution import EdgeAttribution, EdgeAttributionResult  # noqa: F401
    from .lens_quality import LensQuality, LensQualityResult  # noqa: F401
    from .logit_lens import LogitLens, LogitLensResult  # noqa: F401
    from .neurons import AblationConfig, KeyReadoutConfig, NeuronAttribution, NeuronAttributionResult  # noqa: F401
    from .patching import ActivationPatching, ActivationPatchingResult, PromptPair, load_pairs  # noqa: F401
    from .patchscope import Patchscope, PatchscopeResult  # noqa: F401
    from .path_patching import PathPatching, PathPatchingResult  # noqa: F401
    from .probing import LinearProbe, LinearProbeResult, ProbeDatasetSpec  # noqa: F401
    from .sae import SAEFeatures, SAEFeaturesResult  # noqa: F401
    from .sae_quality import SAEEval, SAEEvalResult, SAETrain, SAETrainResult  # noqa: F401
    from .steering import Steering, SteeringResult  # noqa: F401
    from .trace import TokenTrace, TokenTraceResult  # noqa: F401
    from .transcoders import TranscoderTrain, TranscoderTrainResult  # noqa: F401

#: Exported name -> the module (in this package) that defines it; generated from the one kinds
#: table :data:`tracekit.core.kinds.BUILTIN_KINDS` (and :data:`~tracekit.core.kinds.KIND_MODULE_NAMES`).
_LAZY: dict[str, str] = experiments_exports()


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

__all__ = ["REGISTRY", "RESULTS", "Expectation", "Experiment", "Result", "StrictModel", "register", "import_all"]
__all__ += list(_LAZY)  # pyright: ignore[reportUnsupportedDunderAll]  # generated from the kinds table
