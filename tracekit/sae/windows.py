"""Token windows for SAEs: packed windows of corpus tokens (as SAELens packs its training
contexts) and the special-token ids masked wherever they sit."""

from __future__ import annotations

from ..core.errors import SAEError
from ..corpus import iter_documents
from ..model.info import HookedModel
from ..model.load import model_spec_of
from ..tokens import encode

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
                    field: str) -> list[list[int]]:
    """Windows of exactly ``seq_len`` tokens packed from the corpus, after skipping ``skip_tokens``
    text tokens: documents are tokenized one by one and concatenated (separated by the tokens of a
    blank line, which is text), then cut into windows of ``seq_len`` tokens, BOS first when the
    model prepends one (as SAELens packs its training contexts). Deterministic; a window never
    starts mid-skip. Stops once ``n_tokens`` text tokens are collected."""
    bos = encode(model, "", prepend_bos=True) if model_spec_of(model).prepend_bos else []
    width = seq_len - len(bos)
    if width < 1:
        raise SAEError(f"{field}: seq_len {seq_len} leaves no room for text after the BOS")
    sep = encode(model, "\n\n", prepend_bos=False)
    out: list[list[int]] = []
    buf: list[int] = []
    seen = 0
    for _, text in iter_documents(corpus, field=field):
        buf.extend(encode(model, text, prepend_bos=False) + sep)
        while len(buf) >= width:
            chunk, buf = buf[:width], buf[width:]
            if seen < skip_tokens:
                seen += width
                continue
            out.append(bos + chunk)
            if len(out) * width >= n_tokens:
                return out
    return out

