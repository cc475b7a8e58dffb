"""Activation patching: exact, batched, layer-skipping interventions on every site of a model.

Method (Meng et al. 2022, "Locating and Editing Factual Associations in GPT" (ROME), *causal
tracing*; Wang et al. 2022, "Interpretability in the Wild" (IOI); Heimersheim & Nanda 2024, "How to
use and interpret activation patching"; Zhang & Nanda 2023, "Towards Best Practices of Activation
Patching in Language Models: Metrics and Methods"). Reference implementation:
``transformer_lens.patching`` (one forward pass per site).

Run the model on two prompts that differ in one key detail: the *clean* prompt
(``"The capital of France is"`` -> target ``" Paris"``) and the *corrupted* prompt
(``"The capital of Italy is"`` -> foil ``" Rome"``). Then run it again on one of them while
replacing a single activation (a *site*: the residual stream at layer L and position p, one
attention head's output, one MLP neuron, ...) with that activation from the other run, and measure
how far the output moves:

* **denoising** (clean -> corrupted run): does restoring this one clean activation restore the
  clean answer? Finds activations that are *sufficient* (given the rest of the corrupted run).
* **noising** (corrupted -> clean run): does corrupting this activation break the clean answer?
  Finds activations that are *necessary*.
* **ablations** of the clean run (:data:`ABLATIONS`), replacing the site by

  - ``zero``;
  - ``mean``: its mean over a stated *baseline population* of prompts (by default every pair's
    clean prompt; or ``baseline_prompts``), **other than the pair's own clean prompt**, each
    aligned to the pair by position from the end (only prompts at least as long as the pair
    count). At least :data:`MIN_MEAN_POPULATION` such prompts are required
    (:class:`PatchingError` otherwise): a mean over one prompt is a resample, over none the
    prompt's own activation (an effect of exactly 0 that measures nothing);
  - ``resample``: the site from one other prompt of the same population (never the pair's own
    clean prompt), drawn with ``seed``.

  The population size (``baseline_n``) and the resampled prompt (``baseline_source``) are part of
  every result (:class:`JobResult`).

Metrics come from :mod:`tracekit.metrics` (``logit_diff`` = logit(target) - logit(foil) in logits,
``prob``, ``log_prob`` in nats, ``kl`` = KL(P_clean || P_run) in nats), read at the last token of
each prompt (the answer position); :func:`tracekit.metrics.normalize` maps them so the clean run
scores 1 and the corrupted run 0.

Inputs are unpadded: every function here takes equal-length token rows (pairs of different
lengths run in separate groups inside :func:`run_patching`). A padded batch would read the metric
at a pad position and let real tokens attend to pads, so it is refused (:class:`PatchingError`):
a :class:`tracekit.tokens.Batch` with padding, an ``attention_mask`` with zeros, or a tensor whose
rows end in the padding token or start with runs of it of different lengths.

Structure: :func:`run_patching` (what the ``activation_patching`` kind calls) builds one
:class:`PatchJob` per (direction or ablation, site) and returns per-job results. For notebooks,
:func:`batched_activation_patch` patches one kind of site everywhere, with *setters* that say which
slice of an activation a site is (``layer_pos_setter``, ``layer_head_vector_setter``, ...),
specialised with :func:`functools.partial` into :func:`batched_act_patch_resid_pre`,
:func:`batched_act_patch_attn_head_out_by_pos`, ... (TransformerLens' functions of similar purpose
are ``generic_activation_patch`` / ``get_act_patch_*``; these take token tensors, not a cache, and
return per-prompt values). Unlike TransformerLens, which runs one full forward pass per site, the
engine is fast and still exact:

1. **one cached run** per group of equal-length prompts records every block's exact call inputs
   (residual + kwargs: position embeddings, mask, position ids; forward pre-hooks on
   ``model.blocks[i]``) and only the site activations needed;
2. **layer skipping**: a patch at layer L cannot change layers < L, so a patched variant starts
   from the cached input of block L and replays only ``model.blocks[L:]``, then reads the logits
   at the last position through :class:`tracekit.model.readout.Readout`;
3. **many variants per batch**: each row of a replay batch is one (site, prompt) variant; hooks
   inside the block patch each row's own slice. Rows are sorted by start layer and a chunk runs as a
   *staircase*: rows join the batch at the block where their patch happens;
4. **no-op patches are not run**: a variant whose patched value is bit-identical to the value it
   replaces gets the cached run's metric directly (``skip_unchanged``);
5. the batch holds what ``run.memory_budget`` allows (:func:`replay_chunk`: the cached run is a
   fixed cost, :func:`replay_row_bytes` per variant; a run whose cached run and one variant do not
   fit is refused before the cached run is made); an int ``batch_size`` caps it; an out-of-memory
   error halves the batch and retries (:func:`run_chunked`). Results do not depend on the batch:
   a replay runs a single row as two and reads out at least :data:`MIN_READOUT_ROWS` rows.

Every hook the engine adds is removed in a ``finally`` (out-of-memory, ``KeyboardInterrupt``, a
metric that raises): no call leaves a hook on the model.

Results equal TransformerLens' one-at-a-time patching within 2e-5 (float32; tested on perturbed
models).

Sites (``SITES``; hook names are TransformerLens'):

=====================  ==================================  =========================
site                   hook                                index axes
=====================  ==================================  =========================
resid_pre/mid/post     blocks.L.hook_resid_{pre,mid,post}  layer, pos
attn_out, mlp_out      blocks.L.hook_{attn,mlp}_out        layer, pos
head_out (z), head_q,  blocks.L.attn.hook_{z,q,k,v}        layer, head (all positions)
head_k, head_v                                             (``*_by_pos``: layer, pos, head)
head_pattern           blocks.L.attn.hook_pattern          layer, head (``_by_pos``: dest pos)
neuron                 blocks.L.mlp.hook_post              layer, neuron (``_by_pos``: + pos)
resid_pre_layer, ...   the whole layer, all positions      layer
=====================  ==================================  =========================

``layer`` is a block index ``0 .. n_layers-1`` (negative counts from the end where a list of layers
is given). ``head_k``/``head_v`` index key/value heads (``n_key_value_heads`` under grouped-query
attention).

Modules: :mod:`.setters` (setters, :class:`Site`, :data:`SITES`, :data:`SITE_GROUPS`),
:mod:`.checks` (equal lengths, no padding, layers, sites the model has), :mod:`.request` (the
paired-run front door shared with :mod:`tracekit.circuits`: :func:`check_pairs`,
:func:`length_groups`, :func:`check_positions`, :func:`check_request`, and :func:`paired_args` for
a :class:`tracekit.dataset.PairedRows`), :mod:`.engine` (:func:`cache_run`, :func:`patch_hook`,
:func:`patch_rows`, batching and out-of-memory halving), :mod:`.ablation`
(baseline populations), :mod:`.jobs` (the one job builder of both front-ends, :func:`count_variants`)
and :mod:`.run` (:func:`run_patching`, :func:`batched_activation_patch`, ``batched_act_patch_*``).
"""

from ..errors import PatchingError
from . import ablation, checks, engine, jobs, request, run, setters
from .ablation import *  # noqa: F403 - the package re-exports each module's __all__
from .checks import *  # noqa: F403
from .engine import *  # noqa: F403
from .jobs import *  # noqa: F403
from .request import *  # noqa: F403
from .run import *  # noqa: F403
from .setters import *  # noqa: F403

__all__ = ["PatchingError"]
__all__ += ablation.__all__
__all__ += checks.__all__
__all__ += engine.__all__
__all__ += jobs.__all__
__all__ += request.__all__
__all__ += run.__all__
__all__ += setters.__all__
