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
from .sweep import load_results, run_sweep
from .tokens import Position, parse_position
from .verify import VerifyReport, verify_model

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
    "load_results", "run_sweep",
    # kinds
    "LogitLens", "LogitLensResult", "ActivationPatching", "ActivationPatchingResult", "PromptPair",
    "DirectLogitAttribution", "DirectLogitAttributionResult", "NeuronAttribution", "NeuronAttributionResult",
    "KeyReadoutConfig", "AblationConfig", "AttentionPattern", "AttentionPatternResult", "HeadScan",
    "HeadScanResult", "LinearProbe", "LinearProbeResult", "ProbeDatasetSpec", "load_probe_directions",
    "SAEFeatures", "SAEFeaturesResult", "SAEEval", "SAEEvalResult", "SAETrain", "SAETrainResult", "SAESpec",
]
__all__ += ["TokenTrace", "TokenTraceResult"]
__all__ += ["AttributionPatching", "AttributionPatchingResult", "EdgeAttribution", "EdgeAttributionResult",
            "PathPatching", "PathPatchingResult", "Circuit", "CircuitResult"]
__all__ += ["LensQuality", "LensQualityResult", "Patchscope", "PatchscopeResult", "Steering", "SteeringResult",
            "CausalTracing", "CausalTracingResult"]
