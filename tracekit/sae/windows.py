"""Token windows for SAEs: packed windows of corpus tokens (as SAELens packs its training
contexts) and the special-token ids masked wherever they sit."""

from __future__ import annotations

from ..core.errors import SAEError
from ..corpus import CorpusError, iter_documents, packed_windows
from ..model.info import HookedModel

__all__ = ["special_token_ids"]


def special_token_ids(model: HookedModel) -> list[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, PAD, ...): masked wherever they sit."""
    tok = model.tokenizer
    ids = {int(i) for i in (getattr(tok, "all_special_ids", None) or [])}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(tok, name, None)
        if v is not None:
            ids.add(int(v))
    return sorted(ids)


def _corpus_windows(model: HookedModel, corpus, seq_len: int, skip_tokens: int, n_tokens: int,
                    field: str, seq_field: str = "seq_len") -> list[list[int]]:
    """Windows of exactly ``seq_len`` tokens packed from the corpus (:func:`tracekit.corpus.packed_windows`,
    as SAELens packs its training contexts), after skipping ``skip_tokens`` text tokens, until
    ``n_tokens`` text tokens are collected.

    Raises:
        SAEError: ``seq_len`` leaves no room for text after the BOS.
        ConfigError: ``seq_len`` longer than the model's context (``seq_field`` named).
    """
    try:
        return [list(w) for w in packed_windows(model, iter_documents(corpus, field=field), seq_len, skip_tokens,
                                                n_tokens, seq_field)]
    except CorpusError as e:
        raise SAEError(f"{field}: {e}") from e
