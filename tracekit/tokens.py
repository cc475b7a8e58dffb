"""Tokenization and batched forward passes with correct padding.

Every experiment tokenizes through :func:`tokenize`, so BOS handling, padding and "where is each
prompt's last real token" are decided in one place:

* each prompt is tokenized on its own, without the tokenizer's special tokens; exactly one BOS
  is prepended when ``prepend_bos`` is on (none when off);
* prompts are padded on the left or right into one ``[batch, pos]`` tensor with an attention
  mask; the bridge derives position ids from the mask, so a left-padded prompt sees the same
  positions as when run alone (tested: batched == one-by-one);
* :attr:`Batch.last` gives each prompt's last real position.

Answer/target strings must be exactly one token, leading space included (``" Paris"``):
:func:`single_token_id` raises :class:`TokenizationError` showing how the string tokenizes.
"""

from __future__ import annotations

import warnings

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import torch
from jaxtyping import Float, Int

from .models import model_device, model_spec_of


class TokenizationError(ValueError):
    """A string that must be one token is not, or prompts that must align do not."""


def _tok(model):
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise TokenizationError("the model has no tokenizer; load it with tracekit.load_model")
    return tok


def encode(model, text: str, prepend_bos: Optional[bool] = None) -> list[int]:
    """Token ids of one string, with exactly one BOS when ``prepend_bos`` (default: the model spec's)."""
    tok = _tok(model)
    if prepend_bos is None:
        prepend_bos = model_spec_of(model).prepend_bos
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if prepend_bos:
        bos = tok.bos_token_id
        if bos is None:
            raise TokenizationError(
                "model.prepend_bos is true but this tokenizer has no BOS token; set model.prepend_bos: false"
            )
        ids = [bos] + ids
    return ids


def str_tokens(model, ids: Sequence[int]) -> list[str]:
    """Decoded string of each token id (``" Paris"`` keeps its leading space)."""
    tok = _tok(model)
    return [tok.decode([int(i)]) for i in ids]


def describe_tokenization(model, text: str) -> str:
    """Human-readable tokenization, e.g. ``[' Par'(1234), 'is'(271)]``."""
    ids = encode(model, text, prepend_bos=False)
    return "[" + ", ".join(f"{s!r}({i})" for s, i in zip(str_tokens(model, ids), ids)) + "]"


def single_token_id(model, text: str, field: str = "target") -> int:
    """Id of a string that must be exactly one token.

    Args:
        model: the hooked model (its tokenizer is used).
        text: e.g. ``" Paris"`` (the leading space is part of the token).
        field: config field name, quoted in the error.

    Raises:
        TokenizationError: the string is empty or is several tokens; the message shows its
            tokenization and suggests the first token.
    """
    if not isinstance(text, str) or text == "":
        raise TokenizationError(f"{field}: must be a non-empty string, got {text!r}")
    ids = encode(model, text, prepend_bos=False)
    if len(ids) != 1:
        hint = ""
        if ids:
            first = str_tokens(model, ids[:1])[0]
            hint = f" Use a single-token string such as {first!r}"
            if not text.startswith(" "):
                sp = encode(model, " " + text, prepend_bos=False)
                if len(sp) == 1:
                    hint = f" Did you mean {' ' + text!r} (with a leading space, one token)?"
        raise TokenizationError(
            f"{field}: {text!r} is {len(ids)} tokens {describe_tokenization(model, text)}, "
            f"but must be exactly one token.{hint}"
        )
    if not text.startswith(" ") and text[:1].isalpha() and len(encode(model, " " + text, prepend_bos=False)) == 1:
        warnings.warn(f"{field}: {text!r} has no leading space; after a word the model usually predicts "
                      f"{' ' + text!r}, a different token. Use {' ' + text!r} unless you mean the bare form.",
                      stacklevel=2)
    return ids[0]


@dataclass
class Batch:
    """A padded batch of prompts.

    Attributes:
        tokens: ``[batch, pos]`` token ids (padding where ``attention_mask`` is 0).
        attention_mask: ``[batch, pos]`` 1 for real tokens, 0 for padding.
        lengths: real length of each prompt (BOS included).
        padding_side: ``left`` or ``right``.
        ids: per-prompt unpadded token ids.
    """

    tokens: Int[torch.Tensor, "batch pos"]
    attention_mask: Int[torch.Tensor, "batch pos"]
    lengths: list[int]
    padding_side: str
    ids: list[list[int]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def last(self) -> Int[torch.Tensor, "batch"]:
        """Index of each prompt's last real token in the padded tensor."""
        width = self.tokens.shape[1]
        L = torch.tensor(self.lengths, device=self.tokens.device)
        return (width - 1) * torch.ones_like(L) if self.padding_side == "left" else L - 1

    @property
    def offsets(self) -> list[int]:
        """Padded index of each prompt's position 0."""
        width = self.tokens.shape[1]
        return [width - n if self.padding_side == "left" else 0 for n in self.lengths]

    def real_index(self, i: int) -> torch.Tensor:
        """Padded indices of prompt ``i``'s real tokens, in order."""
        o = self.offsets[i]
        return torch.arange(o, o + self.lengths[i], device=self.tokens.device)

    @property
    def needs_mask(self) -> bool:
        return any(n != self.tokens.shape[1] for n in self.lengths)


def tokenize(
    model,
    prompts: Sequence[str],
    prepend_bos: Optional[bool] = None,
    padding_side: Optional[str] = None,
) -> Batch:
    """Tokenize prompts one by one and pad them into a batch on the model's device.

    Args:
        model: hooked model with a tokenizer.
        prompts: the texts.
        prepend_bos: default: the model spec's ``prepend_bos``.
        padding_side: ``left`` | ``right``; default: the model spec's ``padding_side``.

    Raises:
        TokenizationError: an empty prompt list, or a prompt with no tokens.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise TokenizationError("prompts: need at least one prompt")
    spec = model_spec_of(model)
    side = padding_side or spec.padding_side
    if side not in ("left", "right"):
        raise TokenizationError(f"padding_side must be 'left' or 'right', got {side!r}")
    ids = [encode(model, p, prepend_bos) for p in prompts]
    for p, i in zip(prompts, ids):
        if not i:
            raise TokenizationError(f"prompts: {p!r} tokenizes to nothing")
    return pad_ids(model, ids, side)


def pad_ids(model, ids: Sequence[Sequence[int]], padding_side: str = "right") -> Batch:
    """Pad pre-tokenized sequences into a :class:`Batch` on the model's device."""
    tok = _tok(model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    width = max(len(i) for i in ids)
    tokens = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for r, seq in enumerate(ids):
        n = len(seq)
        sl = slice(width - n, width) if padding_side == "left" else slice(0, n)
        tokens[r, sl] = torch.tensor(list(seq), dtype=torch.long)
        mask[r, sl] = 1
    dev = model_device(model)
    return Batch(tokens.to(dev), mask.to(dev), [len(i) for i in ids], padding_side, [list(i) for i in ids])


def forward_kwargs(batch: Batch) -> dict:
    """Keyword arguments for ``model(...)``/``run_with_cache``/``run_with_hooks`` on a batch."""
    return {"attention_mask": batch.attention_mask} if batch.needs_mask else {}


@torch.no_grad()
def run_with_cache(model, batch: Batch, names: Iterable[str] | Callable[[str], bool]):
    """Forward a batch caching only the named hooks.

    Returns:
        ``(logits [batch, pos, d_vocab], cache)`` where ``cache[name]`` is ``[batch, pos, ...]``.
    """
    if not callable(names):
        wanted = set(names)
        names = wanted.__contains__
    return model.run_with_cache(batch.tokens, names_filter=names, **forward_kwargs(batch))


def chunks(n: int, size: int) -> Iterable[slice]:
    """Slices covering ``range(n)`` in steps of ``size``."""
    size = max(1, int(size))
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))
