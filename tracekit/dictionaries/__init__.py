"""Sparse dictionaries without SAELens: SAEs and (skip) transcoders as one module, their file formats,
and their training.

* :class:`Dictionary` (:mod:`.dictionary`): encoder ``W_enc [d_in, d_sae]``, decoder
  ``W_dec [d_sae, d_out]``, activation ``relu`` / ``topk`` / ``abstopk`` / ``jumprelu`` / ``gated``,
  optional skip ``W_skip [d_out, d_in]``; an SAE is the case ``hook_in == hook_out``. Runs on both
  TransformerLens stacks (no ``sae_lens`` import) and computes exactly what SAELens computes.
* :class:`DictionarySet`: one dictionary per layer (a transcoder set: what an attribution graph
  replaces the MLPs with).
* :mod:`.formats`: the SAELens directory (:func:`load_saelens_dir`, :func:`save_saelens_dir`) and
  circuit-tracer's transcoder set (:func:`load_transcoder_set`, :func:`save_transcoder_set`).
"""

from .dictionary import ACTIVATIONS, NORMALIZATIONS, Dictionary, DictionarySet, weights_sha256
from .formats import load_saelens_dir, load_transcoder_set, save_saelens_dir, save_transcoder_set

__all__ = ["ACTIVATIONS", "NORMALIZATIONS", "Dictionary", "DictionarySet", "weights_sha256", "load_saelens_dir",
           "save_saelens_dir", "load_transcoder_set", "save_transcoder_set"]
