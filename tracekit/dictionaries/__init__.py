"""Sparse dictionaries without SAELens: SAEs and (skip) transcoders as one module, their file formats,
and their training.

* :class:`Dictionary` (:mod:`.dictionary`): encoder ``W_enc [d_in, d_sae]``, decoder
  ``W_dec [d_sae, d_out]``, activation ``relu`` / ``topk`` / ``jumprelu`` / ``gated``, optional skip
  ``W_skip [d_out, d_in]``; an SAE is the case ``hook_in == hook_out``. Runs on both TransformerLens
  stacks (no ``sae_lens`` import).
* :class:`DictionarySet`: one dictionary per layer (a transcoder set: what an attribution graph
  replaces the MLPs with).
"""

from .dictionary import ACTIVATIONS, Dictionary, DictionarySet

__all__ = ["ACTIVATIONS", "Dictionary", "DictionarySet"]
