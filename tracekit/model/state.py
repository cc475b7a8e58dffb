"""What tracekit has measured about a loaded model, in one typed attribute.

A bridge is a TransformerLens object; tracekit never subclasses it. What tracekit learns about a
model once (the final norm's affine form, the write path of every block, the output transform,
the verification report and the methods refused on it) lives in one :class:`ModelState` stored on
the model (``state_of(model)``), computed lazily and kept for the model's life (weights are frozen).
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
    """

    final_norm: Any = None
    output_transform: Any = None
    write_paths: dict = field(default_factory=dict)
    architecture: Any = None
    verification: Optional[dict] = None
    refusals: dict = field(default_factory=dict)


def state_of(model) -> ModelState:
    """The :class:`ModelState` of a model (created empty on first use)."""
    d = getattr(model, "__dict__", None)
    if d is None:  # pragma: no cover - objects without a __dict__ get a throwaway state
        return ModelState()
    st = d.get(_ATTR)
    if st is None:
        st = ModelState()
        d[_ATTR] = st
    return st
