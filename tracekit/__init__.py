"""tracekit: mechanistic-interpretability experiments as composable, YAML-driven classes.

Notebook use (a doctest: ``tests/integration/test_doctests.py`` runs it on a tiny model)::

    >>> import tracekit as tk
    >>> model = tk.load_model()                   # embedded SmolLM2-135M (or "gpt2", a path, ...)
    >>> res = tk.LogitLens(prompts=["The capital of China is Beijing. The capital of France is"],
    ...                    target=" Paris").run(model, progress=False)
    >>> df = res.to_frame(); fig = res.plot()
    >>> {"hidden_state", "target", "prob", "vocab_rank"} <= set(df.columns)
    True
    >>> 0.0 <= res.summary()["target_prob_final"] <= 1.0
    True

Modules, one stage of "how did the model compute this token?" each (docs/design.md has the map):
``models`` (loading), ``tokens`` (tokenization, positions, padding), ``readout`` (final norm +
unembedding, written once), ``hooks`` (hook names, gated hooks, no leaked state), ``metrics``,
one engine module per method, ``experiments`` (the kinds over the engines), ``config`` (YAML),
``runner``/``cli`` (``tracekit run``), ``errors`` (one error root).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from .core.kinds import package_exports

if TYPE_CHECKING:  # the same names for type checkers and IDEs; at run time they load on first use
    from .activations.store import ActivationStore
    from .config import RunConfig, load_config, parse_config
    from .core.budget import memory_budget
    from .errors import (
        AttentionError,
        AttributionError,
        CircuitError,
        ConfigError,
        CorpusError,
        HookError,
        MemoryBudgetError,
        MethodRefused,
        ModelLoadError,
        OutputError,
        PatchingError,
        PatchscopeError,
        ProbingError,
        ResultLoadError,
        SAEError,
        SteeringError,
        TokenizationError,
        TracekitError,
    )
    from .experiments import REGISTRY, Expectation, Experiment, Result, register

    # the kinds (tracekit.core.kinds.BUILTIN_KINDS; tests/unit/test_registry.py checks these lines against it)
    from .experiments.activations import CacheActivations, CacheActivationsResult  # noqa: F401
    from .experiments.attention import AttentionPattern, AttentionPatternResult, HeadScan, HeadScanResult  # noqa: F401
    from .experiments.attribution import AttributionPatching, AttributionPatchingResult  # noqa: F401
    from .experiments.attribution_graph import AttributionGraphExperiment, AttributionGraphResult  # noqa: F401
    from .experiments.causal_tracing import CausalTracing, CausalTracingResult  # noqa: F401
    from .experiments.circuits import Circuit, CircuitResult  # noqa: F401
    from .experiments.dla import DirectLogitAttribution, DirectLogitAttributionResult  # noqa: F401
    from .experiments.edge_attribution import EdgeAttribution, EdgeAttributionResult  # noqa: F401
    from .experiments.lens_quality import LensQuality, LensQualityResult  # noqa: F401
    from .experiments.logit_lens import LogitLens, LogitLensResult  # noqa: F401
    from .experiments.neurons import AblationConfig, KeyReadoutConfig, NeuronAttribution, NeuronAttributionResult  # noqa: F401
    from .experiments.patching import ActivationPatching, ActivationPatchingResult, PromptPair  # noqa: F401
    from .experiments.patchscope import Patchscope, PatchscopeResult  # noqa: F401
    from .experiments.path_patching import PathPatching, PathPatchingResult  # noqa: F401
    from .experiments.probing import LinearProbe, LinearProbeResult, ProbeDatasetSpec  # noqa: F401
    from .experiments.sae import SAEFeatures, SAEFeaturesResult  # noqa: F401
    from .experiments.sae_quality import SAEEval, SAEEvalResult, SAETrain, SAETrainResult  # noqa: F401
    from .experiments.steering import Steering, SteeringResult  # noqa: F401
    from .experiments.trace import TokenTrace, TokenTraceResult  # noqa: F401
    from .experiments.transcoders import TranscoderTrain, TranscoderTrainResult  # noqa: F401
    from .model.info import ModelInfo, load_model_info
    from .model.load import load_model, model_spec_of, wrap_hf_model
    from .model.readout import Readout
    from .model.spec import ModelSpec
    from .probing import load_probe_directions
    from .sae import SAESpec
    from .sweep import load_metrics, load_point, load_results, run_sweep
    from .tokens import Position, parse_position
    from .verify import VerifyReport, verify_model

#: Public name -> the module defining it (relative to ``tracekit``). ``import tracekit`` imports none
#: of them (no torch): each loads on first access (PEP 562), so ``tracekit --help`` stays fast.
_LAZY: dict[str, str] = {
    "RunConfig": ".config",
    "load_config": ".config",
    "parse_config": ".config",
    "AttentionError": ".errors",
    "AttributionError": ".errors",
    "ConfigError": ".errors",
    "CorpusError": ".errors",
    "HookError": ".errors",
    "MethodRefused": ".errors",
    "ModelLoadError": ".errors",
    "OutputError": ".errors",
    "PatchingError": ".errors",
    "PatchscopeError": ".errors",
    "SteeringError": ".errors",
    "CircuitError": ".errors",
    "ProbingError": ".errors",
    "ResultLoadError": ".errors",
    "SAEError": ".errors",
    "TokenizationError": ".errors",
    "TracekitError": ".errors",
    "REGISTRY": ".experiments",
    "Expectation": ".experiments",
    "Experiment": ".experiments",
    "Result": ".experiments",
    "register": ".experiments",
    "ActivationStore": ".activations.store",
    "ModelInfo": ".model.info",
    "load_model_info": ".model.info",
    "load_model": ".model.load",
    "model_spec_of": ".model.load",
    "wrap_hf_model": ".model.load",
    "Readout": ".model.readout",
    "ModelSpec": ".model.spec",
    "load_probe_directions": ".probing",
    "SAESpec": ".sae",
    "load_metrics": ".sweep",
    "load_point": ".sweep",
    "load_results": ".sweep",
    "run_sweep": ".sweep",
    "Position": ".tokens",
    "parse_position": ".tokens",
    "VerifyReport": ".verify",
    "verify_model": ".verify",
    "memory_budget": ".core.budget",
    "MemoryBudgetError": ".errors",
}
_LAZY.update(package_exports())  # every kind's classes, from the one kinds table (tracekit.core.kinds)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")  # a subpackage: tk.sweep, tk.patching, ...
        raise AttributeError(f"module 'tracekit' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value  # cached: later accesses are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.2.0"
__all__ = [
    # errors
    "TracekitError", "ConfigError", "ModelLoadError", "TokenizationError", "HookError", "PatchingError",
    "AttributionError", "AttentionError", "CorpusError", "ProbingError", "SAEError", "ResultLoadError",
    "OutputError", "MethodRefused", "CircuitError", "PatchscopeError", "SteeringError", "MemoryBudgetError",
    # models, tokens, readout; protocol and config; sweeps, probes, SAEs, stores (the kinds: below)
    "ModelSpec", "ModelInfo", "load_model", "load_model_info", "model_spec_of", "wrap_hf_model", "Readout",
    "verify_model", "VerifyReport", "Position", "parse_position", "memory_budget",
    "REGISTRY", "Experiment", "Result", "Expectation", "register", "RunConfig", "load_config", "parse_config",
    "load_results", "load_metrics", "load_point", "run_sweep", "load_probe_directions", "SAESpec", "ActivationStore",
]
__all__ += list(package_exports())  # pyright: ignore[reportUnsupportedDunderAll]  # the kinds, from the one kinds table
