"""Circuit discovery: attribution patching (AtP, AtP*), edge attribution (EAP, EAP-IG), exact path
patching and circuit faithfulness, each checked against the exact patching engine.

Modules: :mod:`.gradients` (one gradient pass, grads enabled only inside it), :mod:`.attribution`
(node AtP over every patching site), :mod:`.qk` (AtP*'s QK fix), :mod:`.graph` (the residual-stream
graph: nodes and edges), :mod:`.edges` (EAP / EAP-IG), :mod:`.paths` (exact path patching, also the
exact check of an edge), :mod:`.faithfulness` (circuits, ablation of everything outside them, the
MIB measures) and :mod:`.verification` (approximation vs exact: correlations, recall, false negatives).

**Sign convention** (every score here): a score estimates ``M(base run with the site or edge
patched from the source run) - M(base run)`` in the metric's units. ``denoising``: base = the
corrupted run, source = the clean run, so with ``M`` = logit difference a positive score means
restoring the component moves the answer towards the clean one. ``noising``: base = clean, source =
corrupted (a negative score: corrupting it hurts).
"""

from . import attribution, gradients, graph, qk
from .attribution import *  # noqa: F403
from .gradients import *  # noqa: F403
from .graph import *  # noqa: F403
from .qk import *  # noqa: F403

__all__: list[str] = []
__all__ += attribution.__all__
__all__ += gradients.__all__
__all__ += graph.__all__
__all__ += qk.__all__
