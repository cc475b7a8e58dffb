"""What tracekit has measured about a loaded model, in one typed attribute.

A bridge is a TransformerLens object; tracekit never subclasses it. What tracekit learns about a
model once (the final norm's affine form, the write path of every block, the output transform,
the verification report, the methods refused on it, the checkpoint's unembedding hash, the weights
fingerprint, an activation store's model identity, the causal-tracing noise scale) and whether a
:func:`tracekit.hooks.state_guard` is active on it live in one :class:`ModelState` stored on the
model (``state_of(model)``), computed lazily and kept for the model's life (weights are frozen).

Two attributes stay plain public attributes of the bridge, because a
:class:`tracekit.model.ModelInfo` (tokenizer and config, no weights) has them too and code reads
them from either: ``tracekit_spec`` (the resolved :class:`~tracekit.model.spec.ModelSpec`, read
through :func:`tracekit.model.load.model_spec_of`) and ``tracekit_requested_spec`` (the spec as
asked for); :func:`tracekit.model.load.wrap_hf_model` is the one place that sets them on a bridge.
The transformers model inside a bridge carries two private markers of the loader
(``_tracekit_wrapped``, ``_tracekit_cache_entry``): they are the weights cache's bookkeeping of that
object, written and read only inside :mod:`tracekit.model`, not facts about the bridge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["ModelState", "state_of"]

_ATTR = "_tracekit_state"


@dataclass
class ModelState:
    """Measured facts about one loaded model (see module docstring).

    Attributes:
        final_norm: the final norm's :class:`tracekit.model.norms.AffineNorm` (Readout).
        output_transform: :class:`tracekit.model.readout.OutputTransform` (soft-cap, logit scaling).
        write_paths: ``{(layer, "attn"|"mlp"): WritePath}`` (:mod:`tracekit.model.writepath`).
        architecture: :class:`tracekit.model.architectures.ArchitectureInfo`.
        verification: the load-time verification report (a dict, :mod:`tracekit.verify`).
        refusals: ``{method: reason}``: methods refused on this model, with the reason.
        unembed_hash: the tuned-lens package's hash of the checkpoint's unembedding, taken before
            weight processing (:func:`tracekit.model.load.checkpoint_unembed_hash`); None for a
            model wrapped outside :func:`tracekit.model.load.wrap_hf_model`.
        fingerprint: the weights fingerprint (:func:`tracekit.model.load.model_fingerprint`), once
            computed.
        store_identity: what an activation store records of this model
            (:func:`tracekit.activations.model_identity`), once computed.
        subjects_table_scale: causal tracing's ``subjects_table`` noise scale
            (:func:`tracekit.causal_tracing.noise_scale`), once computed.
        guarded: a :func:`tracekit.hooks.state_guard` is active on the model (nested guards are no-ops).
    """

    final_norm: Any = None
    output_transform: Any = None
    write_paths: dict = field(default_factory=dict)
    architecture: Any = None
    verification: Optional[dict] = None
    refusals: dict = field(default_factory=dict)
    unembed_hash: Optional[str] = None
    fingerprint: Optional[str] = None
    store_identity: Optional[dict] = None
    subjects_table_scale: Any = None
    guarded: bool = False


def state_of(model: object) -> ModelState:
    """The :class:`ModelState` of a model (created empty on first use; a throwaway one for an
    object without a ``__dict__``). Raises nothing."""
    d = getattr(model, "__dict__", None)
    if d is None:  # pragma: no cover - objects without a __dict__ get a throwaway state
        return ModelState()
    st = d.get(_ATTR)
    if st is None:
        st = ModelState()
        d[_ATTR] = st
    return st
