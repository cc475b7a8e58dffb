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

if TYPE_CHECKING:  # the same names for type checkers and IDEs; at run time they load on first use
    from .activations.store import ActivationStore
    from .config import RunConfig, load_config, parse_config
    from .errors import (
        AttentionError,
        AttributionError,
        ConfigError,
        CorpusError,
        HookError,
        MethodRefused,
        ModelLoadError,
        OutputError,
        PatchingError,
        ProbingError,
        ResultLoadError,
        SAEError,
        TokenizationError,
        TracekitError,
    )
    from .experiments import (
        REGISTRY,
        AblationConfig,
        ActivationPatching,
        ActivationPatchingResult,
        AttentionPattern,
        AttentionPatternResult,
        AttributionPatching,
        AttributionPatchingResult,
        Circuit,
        CircuitResult,
        DirectLogitAttribution,
        DirectLogitAttributionResult,
        EdgeAttribution,
        EdgeAttributionResult,
        Expectation,
        Experiment,
        HeadScan,
        HeadScanResult,
        KeyReadoutConfig,
        LinearProbe,
        LinearProbeResult,
        LogitLens,
        LogitLensResult,
        NeuronAttribution,
        NeuronAttributionResult,
        PathPatching,
        PathPatchingResult,
        ProbeDatasetSpec,
        PromptPair,
        Result,
        SAEEval,
        SAEEvalResult,
        SAEFeatures,
        SAEFeaturesResult,
        SAETrain,
        SAETrainResult,
        register,
    )
    from .experiments.activations import CacheActivations, CacheActivationsResult
    from .experiments.causal_tracing import CausalTracing, CausalTracingResult
    from .experiments.lens_quality import LensQuality, LensQualityResult
    from .experiments.patchscope import Patchscope, PatchscopeResult
    from .experiments.steering import Steering, SteeringResult
    from .experiments.trace import TokenTrace, TokenTraceResult
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
    "PatchscopeError": ".errors", "SteeringError": ".errors",
    "ProbingError": ".errors",
    "ResultLoadError": ".errors",
    "SAEError": ".errors",
    "TokenizationError": ".errors",
    "TracekitError": ".errors",
    "REGISTRY": ".experiments",
    "AblationConfig": ".experiments",
    "ActivationPatching": ".experiments",
    "ActivationPatchingResult": ".experiments",
    "AttentionPattern": ".experiments",
    "AttentionPatternResult": ".experiments",
    "AttributionPatching": ".experiments",
    "AttributionPatchingResult": ".experiments",
    "Circuit": ".experiments",
    "CircuitResult": ".experiments",
    "DirectLogitAttribution": ".experiments",
    "DirectLogitAttributionResult": ".experiments",
    "EdgeAttribution": ".experiments",
    "EdgeAttributionResult": ".experiments",
    "Expectation": ".experiments",
    "Experiment": ".experiments",
    "HeadScan": ".experiments",
    "HeadScanResult": ".experiments",
    "KeyReadoutConfig": ".experiments",
    "LinearProbe": ".experiments",
    "LinearProbeResult": ".experiments",
    "LogitLens": ".experiments",
    "LogitLensResult": ".experiments",
    "NeuronAttribution": ".experiments",
    "NeuronAttributionResult": ".experiments",
    "PathPatching": ".experiments",
    "PathPatchingResult": ".experiments",
    "ProbeDatasetSpec": ".experiments",
    "PromptPair": ".experiments",
    "Result": ".experiments",
    "SAEEval": ".experiments",
    "SAEEvalResult": ".experiments",
    "SAEFeatures": ".experiments",
    "SAEFeaturesResult": ".experiments",
    "SAETrain": ".experiments",
    "SAETrainResult": ".experiments",
    "register": ".experiments",
    "CausalTracing": ".experiments.causal_tracing",
    "CausalTracingResult": ".experiments.causal_tracing",
    "LensQuality": ".experiments.lens_quality",
    "LensQualityResult": ".experiments.lens_quality",
    "Patchscope": ".experiments.patchscope",
    "PatchscopeResult": ".experiments.patchscope",
    "Steering": ".experiments.steering",
    "SteeringResult": ".experiments.steering",
    "TokenTrace": ".experiments.trace",
    "TokenTraceResult": ".experiments.trace",
    "CacheActivations": ".experiments.activations",
    "CacheActivationsResult": ".experiments.activations",
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
}


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
    "OutputError", "MethodRefused",
    # models, tokens, readout
    "ModelSpec", "ModelInfo", "load_model", "load_model_info", "model_spec_of", "wrap_hf_model", "Readout",
    "verify_model", "VerifyReport",
    "Position", "parse_position",
    # protocol and config
    "REGISTRY", "Experiment", "Result", "Expectation", "register", "RunConfig", "load_config", "parse_config",
    # sweeps
    "load_results", "load_metrics", "load_point", "run_sweep",
    # kinds
    "LogitLens", "LogitLensResult", "ActivationPatching", "ActivationPatchingResult", "PromptPair",
    "DirectLogitAttribution", "DirectLogitAttributionResult", "NeuronAttribution", "NeuronAttributionResult",
    "KeyReadoutConfig", "AblationConfig", "AttentionPattern", "AttentionPatternResult", "HeadScan",
    "HeadScanResult", "LinearProbe", "LinearProbeResult", "ProbeDatasetSpec", "load_probe_directions",
    "SAEFeatures", "SAEFeaturesResult", "SAEEval", "SAEEvalResult", "SAETrain", "SAETrainResult", "SAESpec",
]
__all__ += ["TokenTrace", "TokenTraceResult", "CacheActivations", "CacheActivationsResult", "ActivationStore"]
__all__ += ["AttributionPatching", "AttributionPatchingResult", "EdgeAttribution", "EdgeAttributionResult",
            "PathPatching", "PathPatchingResult", "Circuit", "CircuitResult"]
__all__ += ["LensQuality", "LensQualityResult", "Patchscope", "PatchscopeResult", "Steering", "SteeringResult",
            "CausalTracing", "CausalTracingResult"]
