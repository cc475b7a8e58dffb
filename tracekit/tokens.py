"""Tokenization, positions and batched forward passes with correct padding.

Over 600 lines because token display (:func:`show_token`, :func:`token_texts`, :func:`display_text`)
shares this module's byte-level decoding with the tokenization it shows; display is the piece to move
beside the tables. The model spec is read in one place (:func:`prepend_bos_of`); the tokenizer-only
helpers (:func:`text_ids`, :func:`single_token_id`) never read it, so a caller that tokenizes many
texts resolves BOS once and passes it on.

Every experiment tokenizes through :func:`tokenize`, so BOS handling, padding, context length and
"which token is position X" are decided in one place:

* each prompt is tokenized on its own. Prompt text is **text**: a special-token string inside it
  (``<|endoftext|>``, ``<|im_start|>``) is split into ordinary tokens, never turned into a control
  token (``split_special_tokens``). Exactly one BOS is prepended when the model spec's
  ``prepend_bos`` is on (none when off; the default follows the model's own tokenizer);
* a prompt longer than the model's context (``cfg.n_ctx``) is refused before any work, naming the
  prompt, its length and the limit (:func:`check_length`);
* prompts are padded on the left or right into one ``[batch, pos]`` tensor with an attention
  mask; the bridge derives position ids from the mask, so a padded prompt sees the same
  positions as when run alone (tested: batched == one-by-one);
* a *position* is one :class:`Position` everywhere (config field ``position``), parsed by
  :func:`parse_position` and resolved against a prompt's tokens by :meth:`Position.resolve`.

Target strings must be exactly one token, leading space included (``" Paris"``):
:func:`single_token_id` raises :class:`TokenizationError` showing how the string tokenizes
(byte-level pieces of non-Latin text shown as their bytes, with the characters they complete).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Optional, Sequence, Union

import torch
from jaxtyping import Int

from .errors import TokenizationError
from .model.context import context_length
from .model.info import HookedModel
from .model.load import model_device, model_spec_of

__all__ = [
    "TokenizationError", "tokenizer_of", "prepend_bos_of", "text_ids", "with_bos", "encode", "refuse_padding",
    "recurrent", "str_tokens", "token_repr", "token_text", "token_texts", "display_text", "show_token",
    "describe_tokenization", "single_token_id",
    "Batch", "tokenize", "pad_ids", "forward_kwargs", "run_with_cache", "chunks", "check_length",
    "context_length", "Position", "PositionSpec", "parse_position", "POSITION_FORMS",
    "token_index_of_substring", "encode_prompts", "pad_rows",
]


def tokenizer_of(model: HookedModel) -> Any:
    """The model's Hugging Face tokenizer.

    Raises:
        TokenizationError: the model has none (a foreign object; load it with :func:`tracekit.load_model`).
    """
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise TokenizationError("the model has no tokenizer; load it with tracekit.load_model")
    return tok


def prepend_bos_of(model: HookedModel) -> bool:
    """Whether tokenization prepends a BOS for this model: the model spec's ``prepend_bos``
    resolved against its tokenizer (``auto``: whether the tokenizer adds one itself). The one place
    tokenization reads the model spec; callers that tokenize many texts resolve it once and pass it
    to :func:`encode`."""
    tok = tokenizer_of(model)
    return bool(model_spec_of(model).resolved_prepend_bos(tok))


def text_ids(model: HookedModel, text: str) -> list[int]:
    """Token ids of ``text`` alone: no BOS, special-token strings tokenized as text
    (``split_special_tokens``); tokenizer only, the model spec is not read."""
    return list(tokenizer_of(model)(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def with_bos(model: HookedModel, ids: list[int], prepend_bos: bool) -> list[int]:
    """``ids`` with the tokenizer's BOS in front when ``prepend_bos``.

    Raises:
        TokenizationError: ``prepend_bos`` on a tokenizer without a BOS token.
    """
    if not prepend_bos:
        return ids
    bos = tokenizer_of(model).bos_token_id
    if bos is None:
        raise TokenizationError(
            "model.prepend_bos is true but this tokenizer has no BOS token; set model.prepend_bos: false"
        )
    return [bos] + ids


def encode(model: HookedModel, text: str, prepend_bos: Optional[bool] = None) -> list[int]:
    """Token ids of one string, with exactly one BOS when ``prepend_bos`` (default: the model spec's,
    :func:`prepend_bos_of`).

    Special-token strings in ``text`` are tokenized as text (``split_special_tokens``).

    Raises:
        TokenizationError: a BOS asked of a tokenizer that has none.
    """
    if prepend_bos is None:
        prepend_bos = prepend_bos_of(model)
    return with_bos(model, text_ids(model, text), prepend_bos)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table (byte-level BPE pieces -> bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_repr(model: HookedModel, token_id: int) -> str:
    """A readable form of one token: its text (``' Paris'``), or, when it is only part of a
    character (byte-level BPE pieces of non-Latin text), its bytes (``<bytes e5 b7>``)."""
    tok = tokenizer_of(model)
    s = tok.decode([int(token_id)])
    if "\ufffd" not in s:
        return repr(s)
    piece = tok.convert_ids_to_tokens(int(token_id))
    dec = _byte_decoder()
    if isinstance(piece, str) and piece and all(c in dec for c in piece):
        return "<bytes " + " ".join(f"{dec[c]:02x}" for c in piece) + ">"
    if isinstance(piece, str) and piece.startswith("<0x"):  # sentencepiece byte fallback
        return f"<bytes {piece[3:-1].lower()}>"
    return repr(s)


def token_text(model: HookedModel, token_id: int) -> str:
    """A token's text (``" Paris"``), or ``<bytes e5 b7>`` when it is only part of a character
    (byte-level BPE pieces of non-Latin text): never the replacement character ``\ufffd``."""
    r = token_repr(model, token_id)
    return r if r.startswith("<bytes ") else tokenizer_of(model).decode([int(token_id)])


def token_texts(model: HookedModel, ids: Sequence[int]) -> list[str]:
    """:func:`token_text` of each id: the tokens' texts, a piece of a character as its bytes
    (``<bytes e5 b7>``), never U+FFFD. For tables and reports; :func:`str_tokens` gives the raw
    decoded strings (for matching text)."""
    return [token_text(model, i) for i in ids]


#: How :func:`token_text` shows a token that is only part of a UTF-8 character.
_BYTES = re.compile(r"<bytes [0-9a-f]{2}(?: [0-9a-f]{2})*>")


def show_token(text: str) -> str:
    """The one display form of a token's text in reports (report.md, report.html, figure labels):
    ``repr`` so spaces and newlines are visible (``' Paris'``), except a piece of a character,
    which :func:`token_text` already gives as its bytes (``<bytes e5 b7>``) and is shown as is.

    Args:
        text: a token's text as :func:`token_text` / :func:`token_texts` give it.

    Returns:
        The text to show.
    """
    return text if isinstance(text, str) and _BYTES.fullmatch(text) else repr(text)


def display_text(model: HookedModel, ids: Sequence[int]) -> str:
    """The text of a run of token ids for display: the decoded text, except that a piece of a
    character the run does not complete (cut at the run's start or end, e.g. by a context window)
    is shown as its bytes (``<bytes e5 b7>``), never as U+FFFD.

    Args:
        model: the model (its tokenizer).
        ids: token ids, in order.

    Returns:
        The text (equal to the tokenizer's decode when that has no U+FFFD).
    """
    tok = tokenizer_of(model)
    ids = [int(i) for i in ids]
    whole = tok.decode(ids)
    if "\ufffd" not in whole:
        return whole
    out: list[str] = []
    cur: list[int] = []
    for i in ids + [None]:  # None: the end; what is left must come out
        if i is not None:
            cur.append(i)
        while cur:
            s = tok.decode(cur)
            if "\ufffd" not in s:
                out.append(s)
                cur = []
            elif i is not None and len(cur) < 4:  # a UTF-8 character spans at most 4 byte pieces
                break
            else:  # the first id starts no character the next ones complete: its bytes
                out.append(token_text(model, cur.pop(0)))
    return "".join(out)


def str_tokens(model: HookedModel, ids: Sequence[int]) -> list[str]:
    """Decoded string of each token id (``" Paris"`` keeps its leading space)."""
    tok = tokenizer_of(model)
    return [tok.decode([int(i)]) for i in ids]


def _clean_pieces(model: HookedModel, ids: Sequence[int]) -> list[tuple[str, list[int]]]:
    """Group token ids into runs that decode to whole characters: ``[(text, ids), ...]``."""
    tok = tokenizer_of(model)
    out: list[tuple[str, list[int]]] = []
    cur: list[int] = []
    for i in ids:
        cur.append(int(i))
        s = tok.decode(cur)
        if "\ufffd" not in s:
            out.append((s, cur))
            cur = []
    if cur:
        out.append((tok.decode(cur), cur))
    return out


def describe_tokenization(model: HookedModel, text: str) -> str:
    """Human-readable tokenization, e.g. ``[' Par'(1234), 'is'(271)]``; byte pieces of a character
    are shown as bytes with the character they complete (``<bytes e5 b7>(32432)+<bytes b4>(112) = '巴'``)."""
    ids = text_ids(model, text)
    parts = []
    for s, grp in _clean_pieces(model, ids):
        if len(grp) == 1 and "\ufffd" not in model.tokenizer.decode(grp):
            parts.append(f"{s!r}({grp[0]})")
        else:
            parts.append("+".join(f"{token_repr(model, i)}({i})" for i in grp) + f" = {s!r}")
    return "[" + ", ".join(parts) + "]"


def single_token_id(model: HookedModel, text: str, field: str = "target") -> int:
    """Id of a string that must be exactly one token.

    Args:
        model: the hooked model (its tokenizer is used).
        text: e.g. ``" Paris"`` (the leading space is part of the token).
        field: config field name, quoted in the error.

    Raises:
        TokenizationError: the string is empty or is several tokens; the message shows its
            tokenization and suggests a single token that decodes to text (never a byte piece).
    """
    if not isinstance(text, str) or text == "":
        raise TokenizationError(f"{field}: must be a non-empty string, got {text!r}")
    ids = text_ids(model, text)
    if len(ids) != 1:
        hint = ""
        pieces = _clean_pieces(model, ids)
        if len(pieces[0][1]) == 1:
            hint = f" Use a single-token string such as {pieces[0][0]!r}"
        else:
            hint = (f" Its first character {pieces[0][0]!r} alone is {len(pieces[0][1])} tokens, so no prefix of it "
                    "is one token; pick another target word")
        if not text.startswith(" "):
            sp = text_ids(model, " " + text)
            if len(sp) == 1:
                hint = f" Did you mean {' ' + text!r} (with a leading space, one token)?"
        raise TokenizationError(
            f"{field}: {text!r} is {len(ids)} tokens {describe_tokenization(model, text)}, "
            f"but must be exactly one token.{hint}"
        )
    if not text.startswith(" ") and text[:1].isalpha() and len(text_ids(model, " " + text)) == 1:
        warnings.warn(f"{field}: {text!r} has no leading space; after a word the model usually predicts "
                      f"{' ' + text!r}, a different token. Use {' ' + text!r} unless you mean the bare form.",
                      stacklevel=2)
    return ids[0]


def encode_prompts(model: HookedModel, prompts: Sequence[str], field: str = "prompts",
                   prepend_bos: Optional[bool] = None) -> tuple[tuple[int, ...], ...]:
    """Token ids of each prompt (:func:`tracekit.tokens.encode`), each checked to be non-empty and
    within the model's context, as :func:`tokenize` checks them.

    Raises:
        TokenizationError: a prompt with no tokens, or longer than the context (naming ``field[i]``).
    """
    bos = prepend_bos_of(model) if prepend_bos is None else prepend_bos  # the spec read once
    out = []
    for i, p in enumerate(prompts):
        ids = with_bos(model, text_ids(model, p), bos)
        check_length(model, ids, f"{field}[{i}]", p)
        if not ids:
            raise TokenizationError(f"{field}[{i}]: {p!r} tokenizes to nothing; give a non-empty prompt")
        out.append(tuple(ids))
    return tuple(out)


def check_length(model: HookedModel, ids: Sequence[int], field: str = "prompts", text: Optional[str] = None) -> None:
    """Refuse a token sequence longer than the model's context.

    Raises:
        TokenizationError: naming the field, the length and the limit.
    """
    n_ctx = context_length(model)
    if n_ctx is not None and len(ids) > n_ctx:
        shown = f" ({text[:60]!r}...)" if text else ""
        raise TokenizationError(f"{field}{shown} is {len(ids)} tokens, longer than the model's context of {n_ctx} "
                                "tokens; shorten it (the model cannot attend beyond its context)")


# ---------------------------------------------------------------------------------------------
# positions

#: Every form a position can take, and what it means.
POSITION_FORMS: dict[str, str] = {
    "int": "a token index in the tokenized prompt (BOS counted when prepended; negative counts from the end, "
           "-1 = last)",
    "last": "the prompt's last real token (same as -1)",
    "all": "every real token (BOS excluded where the kind says so)",
    "mean": "the mean over the real tokens, BOS excluded",
    "token:<text>": "the token holding the last character of the last occurrence of <text> in the prompt",
    "field:<column>": "like token:, with <text> taken from the row's <column> (probing datasets)",
    "name": "a named position of the dataset's rows (IO, S1, S2, END...: tracekit.dataset), resolved per row",
}

PositionKind = Literal["index", "last", "all", "mean", "token", "field", "name"]
#: The config type of a ``position`` field (validated by :func:`parse_position`).
PositionSpec = Union[int, str]


@dataclass(frozen=True)
class Position:
    """A parsed position spec (see :data:`POSITION_FORMS`)."""

    kind: PositionKind
    index: Optional[int] = None
    text: Optional[str] = None

    def __str__(self) -> str:
        if self.kind == "index":
            return str(self.index)
        if self.kind in ("token", "field"):
            return f"{self.kind}:{self.text}"
        if self.kind == "name":
            return str(self.text)
        return self.kind

    @property
    def single(self) -> bool:
        """True when the position names one token per prompt."""
        return self.kind in ("index", "last", "token", "field", "name")

    def resolve(self, model: HookedModel, text: str, ids: Sequence[int], field: str = "position",
                field_value: Optional[str] = None, skip_bos: Optional[bool] = None) -> list[int]:
        """Token indices (into ``ids``, BOS included) this position names in one prompt.

        Args:
            model: the model (tokenizer).
            text: the prompt text; ids: its tokens as :func:`encode` gives them.
            field_value: the row's value for ``field:<column>``.
            skip_bos: drop a leading BOS for ``all``/``mean`` (default: when the spec prepends one).

        Raises:
            TokenizationError: an index out of range, or a text not in the prompt; the message
                lists the prompt's tokens.
        """
        n = len(ids)
        if self.kind == "last":
            return [n - 1]
        if self.kind == "index":
            assert self.index is not None
            if not -n <= self.index < n:
                raise TokenizationError(f"{field}: {self.index} is out of range for a prompt of {n} tokens "
                                        f"{str_tokens(model, ids)} (use 0..{n - 1} or -1 for the last)")
            return [self.index % n]
        if self.kind in ("all", "mean"):
            bos = tokenizer_of(model).bos_token_id
            drop = skip_bos if skip_bos is not None else (n > 1 and bos is not None and ids[0] == bos
                                                          and prepend_bos_of(model))
            return list(range(1 if drop else 0, n))
        if self.kind == "name":
            raise TokenizationError(f"{field}: {self.text!r} names a dataset position; it is resolved per row from "
                                    "the dataset (tracekit.dataset.PreparedDataset.position), not from a prompt alone")
        sub = self.text if self.kind == "token" else field_value
        if sub is None:
            raise TokenizationError(f"{field}: {self} needs the row's {self.text!r} value")
        return [token_index_of_substring(model, text, str(sub), ids, field=field)]


def parse_position(spec: PositionSpec, allowed: Sequence[str] = tuple(k for k in POSITION_FORMS if k != "name"),
                   field: str = "position") -> Position:
    """Parse a position spec (an int or one of the strings in :data:`POSITION_FORMS`).

    Args:
        spec: e.g. ``-1``, ``"last"``, ``"all"``, ``"token: is"``, ``"field:country"``.
        allowed: the forms this kind accepts (keys of :data:`POSITION_FORMS`; default every form but
            ``name``, which a kind that reads datasets opts into).
        field: config field quoted in the error.

    Raises:
        TokenizationError: an unknown or disallowed form; the message lists the allowed ones.
    """
    def bad(why: str) -> TokenizationError:
        forms = "; ".join(f"{k} ({POSITION_FORMS[k]})" for k in allowed)
        return TokenizationError(f"{field}: {why}. Use {forms}")

    if isinstance(spec, bool):
        raise bad(f"{spec!r} is not a position")
    if isinstance(spec, int):
        pos = Position("index", index=int(spec))
        key = "int"
    elif isinstance(spec, str):
        s = spec.strip()
        if s in ("last", "all", "mean"):
            pos, key = Position(s), s  # type: ignore[arg-type]
        elif s.lstrip("-").isdigit():
            pos, key = Position("index", index=int(s)), "int"
        elif s.startswith(("token:", "field:")):
            kind, arg = spec.split(":", 1)
            kind = kind.strip()
            if kind == "field":
                arg = arg.strip()
            elif arg.startswith(" ") and arg.strip() and not arg.startswith("  "):
                pass  # "token: is" keeps the space: it is part of the text
            if arg.strip() == "":
                raise bad(f"{spec!r} has an empty {kind}")
            pos, key = Position(kind, text=arg), f"{kind}:<{'text' if kind == 'token' else 'column'}>"  # type: ignore[arg-type]
        elif s.isidentifier() and "name" in allowed:
            pos, key = Position("name", text=s), "name"
        else:
            raise bad(f"unknown position {spec!r} (a token string is written 'token:{spec}')")
    else:
        raise bad(f"{spec!r} is not a position")
    if key not in allowed:
        raise bad(f"{spec!r} is not accepted here")
    return pos


def token_index_of_substring(model: HookedModel, text: str, sub: str, ids: Optional[Sequence[int]] = None,
                             field: str = "position", occurrence: int = -1) -> int:
    """Index (into ``encode(model, text)``, BOS included) of the token holding the last character
    of an occurrence of ``sub`` in ``text`` (default the last; ``occurrence=0`` the first, ``1`` the
    second, ``-2`` the one before the last).

    Uses the fast tokenizer's character offsets and checks they describe the same tokens as
    :func:`encode`.

    Raises:
        TokenizationError: ``sub`` does not occur in ``text`` (that often), or the tokenizer gives no
            offsets / disagrees with :func:`encode`.
    """
    starts = [] if sub == "" else [i for i in range(len(text)) if text.startswith(sub, i)]
    if not starts:
        raise TokenizationError(f"{field}: {sub!r} does not occur in the prompt {text!r}")
    if not -len(starts) <= occurrence < len(starts):
        raise TokenizationError(f"{field}: occurrence {occurrence} of {sub!r}, but it occurs {len(starts)} "
                                f"time(s) in the prompt {text!r} (0 = first, -1 = last)")
    start = starts[occurrence]
    end = start + len(sub)
    tok = tokenizer_of(model)
    try:
        enc = tok(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
    except (NotImplementedError, TypeError) as e:
        raise TokenizationError(f"{field}: token:/field: positions need a fast tokenizer (character offsets)") from e
    ids = list(ids) if ids is not None else encode(model, text)
    n_bos = len(ids) - len(enc["input_ids"])
    if n_bos not in (0, 1) or list(enc["input_ids"]) != ids[n_bos:]:
        raise TokenizationError(f"{field}: tokenizer offsets disagree with tracekit.tokens.encode for {text!r}")
    offs = enc["offset_mapping"]
    cands = [j for j, (a, b) in enumerate(offs) if a <= end - 1 < b]
    if not cands:
        cands = [j for j, (a, _) in enumerate(offs) if a < end]
    return n_bos + cands[-1]


# ---------------------------------------------------------------------------------------------
# batches


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
    def last(self) -> Int[torch.Tensor, " batch"]:
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
    model: HookedModel,
    prompts: Sequence[str],
    prepend_bos: Optional[bool] = None,
    padding_side: Optional[str] = None,
    field: str = "prompts",
) -> Batch:
    """Tokenize prompts one by one and pad them into a batch on the model's device.

    Args:
        model: hooked model with a tokenizer.
        prompts: the texts.
        prepend_bos: default: the model spec's ``prepend_bos`` (resolved against the tokenizer).
        padding_side: ``left`` | ``right``; default: the model spec's ``padding_side``.
        field: config field quoted in errors.

    Raises:
        TokenizationError: an empty prompt list, a prompt with no tokens, or a prompt longer than
            the model's context.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise TokenizationError(f"{field}: need at least one prompt")
    if padding_side not in (None, "left", "right"):
        raise TokenizationError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    bos = prepend_bos_of(model) if prepend_bos is None else prepend_bos  # the spec read once
    ids = [with_bos(model, text_ids(model, p), bos) for p in prompts]
    for i, (p, seq) in enumerate(zip(prompts, ids)):
        if not seq:
            raise TokenizationError(f"{field}[{i}]: {p!r} tokenizes to nothing; give a non-empty prompt")
        check_length(model, seq, f"{field}[{i}]", p)
    return pad_rows(model, ids, field, padding_side)


def pad_rows(model: HookedModel, ids: Sequence[Sequence[int]], field: str = "prompts", padding_side: Optional[str] = None
             ) -> Batch:
    """Pre-tokenized rows padded into a :class:`Batch` as :func:`tokenize` pads prompts: on the
    model spec's ``padding_side`` (or ``padding_side``), right on recurrent models (pads before a
    prompt would run through the recurrence and change its state), refused on batch-sensitive
    architectures when the lengths differ.

    Raises:
        TokenizationError: rows of different lengths on an architecture that cannot batch them, or an
            unknown padding side.
    """
    side = padding_side or model_spec_of(model).padding_side
    if side not in ("left", "right"):
        raise TokenizationError(f"padding_side must be 'left' or 'right', got {side!r}")
    if side == "left" and recurrent(model):
        side = "right"
    if len({len(i) for i in ids}) > 1:
        refuse_padding(model, field)
    return pad_ids(model, [list(i) for i in ids], side)


def refuse_padding(model: HookedModel, field: str) -> None:
    """Refuse rows of different lengths on an architecture whose numbers change under padding
    (:data:`tracekit.model.architectures.BATCH_SENSITIVE`); nothing on others.

    Raises:
        TokenizationError: naming ``field`` and the fix (``batch_size: 1``).
    """
    from .model.architectures import BATCH_SENSITIVE, architecture_name

    try:
        arch = architecture_name(model)
    except Exception:  # noqa: BLE001
        return
    if arch in BATCH_SENSITIVE:
        raise TokenizationError(f"{field}: {arch} cannot batch prompts of different lengths: "
                                f"{BATCH_SENSITIVE[arch]}. Run with batch_size: 1.")


def recurrent(model: HookedModel) -> bool:
    """True for models that must be padded on the right: recurrent / state-space layers (Mamba,
    RWKV, RecurrentGemma, hybrids), where left padding would run pad tokens through the recurrence
    before the prompt, and :data:`tracekit.model.architectures.RIGHT_PADDED` (chunked attention). Right
    padding is exact for every read position: later pads cannot reach earlier tokens."""
    from .model.architectures import RIGHT_PADDED, architecture_name, category

    try:
        arch = architecture_name(model)
        return category(arch) in ("ssm", "hybrid_decoder") or arch in RIGHT_PADDED
    except Exception:  # noqa: BLE001 - objects without a config are not recurrent models
        return False


def pad_ids(model: HookedModel, ids: Sequence[Sequence[int]], padding_side: str = "right") -> Batch:
    """Pad pre-tokenized sequences into a :class:`Batch` on the model's device."""
    tok = tokenizer_of(model)
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
def run_with_cache(model: HookedModel, batch: Batch, names: Iterable[str] | Callable[[str], bool], strict: bool = True):
    """Forward a batch caching only the named hooks (gated hooks are enabled for the call).

    ``strict=False`` allows named hooks that exist but do not fire for this architecture (e.g.
    ``hook_pos_embed`` under rotary positions); they are simply absent from the cache.

    Returns:
        ``(logits [batch, pos, d_vocab], cache)`` where ``cache[name]`` is ``[batch, pos, ...]``.

    Raises:
        HookError: a named hook does not exist, or never fired.
    """
    from .hooks import check_hooks, enabled_hooks

    if callable(names):
        return model.run_with_cache(batch.tokens, names_filter=names, **forward_kwargs(batch))
    wanted = list(dict.fromkeys(names))
    check_hooks(model, wanted, "hooks")
    with enabled_hooks(model, wanted):
        logits, cache = model.run_with_cache(batch.tokens, names_filter=set(wanted).__contains__,
                                             **forward_kwargs(batch))
    missing = [n for n in wanted if n not in cache]
    if missing and strict:
        from .errors import HookError

        raise HookError(f"hooks: {missing} never fired in the forward pass")
    return logits, cache


def chunks(n: int, size: int) -> Iterable[slice]:
    """Slices covering ``range(n)`` in steps of ``size``."""
    size = max(1, int(size))
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))
