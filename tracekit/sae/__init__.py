"""Sparse-autoencoder (SAE) feature decomposition, with SAELens' SAEs and their maths.

An SAE (Bricken et al. 2023, "Towards Monosemanticity"; Cunningham et al. 2023) rewrites one
activation ``x`` (a TransformerLens hook, e.g. ``blocks.8.hook_resid_pre``) as a sparse sum of
decoder rows::

    x = sum_f a_f(x) * d_f  +  b  +  e        (features + decoder bias + reconstruction error)

where ``a_f`` is feature ``f``'s activation (``feature`` = latent index ``0 .. d_sae-1``), ``d_f``
its effective decoder row (SAELens' ``W_dec[f]``, divided by its norm when the SAE was trained
with ``rescale_acts_by_decoder_norm``, times the per-token output scale of a ``layer_norm`` /
``constant_norm_rescale`` input normalisation), ``b`` the decoder bias term and ``e = x - x_hat``
the reconstruction error, kept as its own term everywhere.

The SAE is always tracekit's own :class:`tracekit.dictionaries.Dictionary`, which computes what
SAELens' ``SAE`` computes (encode / decode equal to SAELens' to float precision, tested in the
default environment): a SAELens directory (``sae.path``; older field names accepted) is read
without SAELens (:func:`tracekit.dictionaries.formats.load_saelens_dir`), so every SAE kind also
runs in the TransformerLens 4 environment where ``import sae_lens`` fails; a pretrained release
(``sae.release`` + ``id``) is fetched through SAELens' registry and needs SAELens; a training
(``sae.train``) runs through :func:`tracekit.sae.train.train_sae` on tracekit's own bridge model
and an in-memory dataset of token windows from the offline corpus (:mod:`tracekit.corpus`). One
config block, :class:`SAESpec` (YAML key ``sae:``), names it in every SAE kind.

Functions (notebook use)::

    from tracekit import load_model
    from tracekit.sae import SAESpec, load_sae, feature_decomposition, sae_quality
    model = load_model()
    h = load_sae(SAESpec(path="my_sae/"), model)
    dec = feature_decomposition(model, h, "The capital of France is", target=" Paris")
    dec.top_features(10)

Units: activations in the SAE's input units; ``contribution`` (direct) and ``attribution`` (total)
in logits (of the target, or target - foil); ``mse`` per token summed over dimensions (SAELens);
``ce_loss_*`` in nats per token; ``kl`` in nats.

Errors: :class:`tracekit.errors.SAEError` for everything an SAE cannot be used for (source cannot
be had, hook missing / not firing, width, trained on another model or basis, unsupported
normalisation), before any forward pass.

Modules: :mod:`.spec` (the ``sae:`` block, an SAE's identity, checks), :mod:`.load` (loading),
:mod:`.train` (training, the cache of trained SAEs), :mod:`.windows` (corpus token
windows, special tokens), :mod:`.decompose` (the decomposition, the splice hook, attribution),
:mod:`.quality` (evals), :mod:`.interventions` (:class:`SAEBasis`, the features as a
:mod:`tracekit.units` basis: the verbs zero / mean / clamp / scale / steer, random controls),
:mod:`.dashboard` (feature readouts, HTML pages). Every name is re-exported here (``tracekit.sae.load_sae``).
"""

from __future__ import annotations

from .dashboard import decoder_vocab, feature_dashboard_html, top_activating_contexts
from .decompose import (
    FeatureDecomposition,
    FeatureEdit,
    SAETerms,
    effective_decoder,
    feature_decomposition,
    sae_terms,
    splice_hook,
)
from .interventions import SAEBasis, feature_intervention, random_features
from .load import LoadedSAE, load_sae
from .quality import SAEQuality, eval_seq_len, eval_windows, sae_quality
from .spec import SAEInfo, SAESpec, SAETrainSpec, check_sae, hook_width, sae_info
from .train import (
    SAE_FILES,
    _cache_activations,  # noqa: F401  (tests)
    _train_key,  # noqa: F401  (tests)
    clear_sae_cache,
    sae_cache_dir,
    sae_cache_entries,
    train_sae,
)
from .windows import _corpus_windows, special_token_ids  # noqa: F401  (_corpus_windows: tests)

__all__ = [
    "SAE_FILES",
    "FeatureDecomposition",
    "FeatureEdit",
    "LoadedSAE",
    "SAEBasis",
    "SAEInfo",
    "SAEQuality",
    "SAESpec",
    "SAETerms",
    "SAETrainSpec",
    "check_sae",
    "clear_sae_cache",
    "decoder_vocab",
    "effective_decoder",
    "eval_seq_len",
    "eval_windows",
    "feature_dashboard_html",
    "feature_decomposition",
    "feature_intervention",
    "hook_width",
    "load_sae",
    "random_features",
    "sae_cache_dir",
    "sae_cache_entries",
    "sae_info",
    "sae_quality",
    "sae_terms",
    "special_token_ids",
    "splice_hook",
    "top_activating_contexts",
    "train_sae",
]
