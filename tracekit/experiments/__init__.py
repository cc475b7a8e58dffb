# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportGeneralTypeIssues=false, reportIndexIssue=false, reportOptionalMemberAccess=false, reportOptionalSubscript=false, reportOptionalOperand=false, reportReturnType=false, reportAssignmentType=false, reportOperatorIssue=false
"""Experiment kinds, registered by name (see :mod:`tracekit.experiments.base` and :mod:`tracekit.results`).

Each module defines one family of kinds and registers them with ``@register``; they are imported
here explicitly (a new kind: a module here, one import line, and its entry in
:data:`tracekit.results.KINDS`).
"""

from .attention import AttentionPattern, AttentionPatternResult, HeadScan, HeadScanResult
from .attribution import AttributionPatching, AttributionPatchingResult, VerifySpec
from .base import REGISTRY, RESULTS, Expectation, Experiment, Result, StrictModel, register
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

__all__ = [
    "REGISTRY", "RESULTS", "Expectation", "Experiment", "Result", "StrictModel", "register",
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
    "LensQuality", "LensQualityResult", "Patchscope", "PatchscopeResult", "Steering", "SteeringResult",
    "CausalTracing", "CausalTracingResult", "SubjectSpec",
]
