"""The rows a store is written from: dataset rows, prompts, or corpus windows, streamed.

Each source yields :class:`~tracekit.activations.write.StoreRow` s (token ids + the positions read)
lazily, so a corpus of any size is never held in memory (the row ids and one shard's rows are).
Positions (:data:`STORE_POSITION_FORMS`) resolve as everywhere in tracekit
(:class:`tracekit.tokens.Position`): an index (BOS counted), ``last``, ``all`` (every real token, a
prepended BOS excluded), ``mean`` (their mean, one example per row), ``token:<text>``, or a named
position of a dataset's rows (``END``, ``SUBJ``).
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

from ..core.errors import TokenizationError
from ..corpus import iter_documents, packed_windows, token_windows
from ..dataset import PreparedDataset
from ..model.context import check_window
from ..model.info import HookedModel
from ..tokens import Position, PositionSpec, check_length, encode, parse_position
from .write import StoreRow

__all__ = ["STORE_POSITION_FORMS", "store_position", "dataset_rows", "prompt_rows", "corpus_rows"]

#: Position forms a store accepts (``name`` with a dataset only; ``token:`` not on a corpus).
STORE_POSITION_FORMS = ("int", "last", "all", "mean", "token:<text>", "name")


def store_position(spec: PositionSpec, field: str = "position") -> Position:
    """Parse a store's position spec (:data:`STORE_POSITION_FORMS`).

    Raises:
        TokenizationError: an unknown form (the message lists the accepted ones).
    """
    return parse_position(spec, STORE_POSITION_FORMS, field)


def _row(model: HookedModel, row_id: int, text: Optional[str], ids: Sequence[int], pos: Position, named: Optional[int],
         field: str) -> StoreRow:
    if pos.kind == "name":
        assert named is not None
        read = [named]
    else:
        read = pos.resolve(model, text or "", ids, field)
    return StoreRow(int(row_id), tuple(int(i) for i in ids), tuple(int(p) for p in read), pos.kind == "mean")


def dataset_rows(model: HookedModel, data: PreparedDataset, position: PositionSpec, field: str = "position"
                 ) -> Iterator[StoreRow]:
    """The prepared rows of a dataset (:meth:`tracekit.dataset.DatasetSpec.prepare`), ids as prepared.

    Raises:
        DatasetError: a named position a row does not have.
        TokenizationError: a position that does not resolve in a row (naming it).
    """
    pos = store_position(position, field)
    named = data.position(str(pos.text), field) if pos.kind == "name" else [None] * len(data)
    for e, at in zip(data.examples, named):
        yield _row(model, e.row_id, e.prompt, e.ids, pos, at, f"{field} (row {e.row_id})")


def prompt_rows(model: HookedModel, prompts: Sequence[str], position: PositionSpec, field: str = "position"
                ) -> Iterator[StoreRow]:
    """One row per prompt (ids by :func:`tracekit.tokens.encode`, as probing tokenizes), row id = index.

    Raises:
        TokenizationError: a named position (prompts have none) or one that does not resolve; a
            prompt longer than the model's context (:func:`tracekit.tokens.check_length`).
    """
    pos = store_position(position, field)
    if pos.kind == "name":
        raise TokenizationError(f"{field}: {pos.text!r} names a dataset position; prompts have none (use a dataset "
                                "with named positions, or last / all / an index / token:<text>)")
    for i, p in enumerate(prompts):
        ids = encode(model, p)
        check_length(model, ids, f"prompts[{i}]", p)
        yield _row(model, i, p, ids, pos, None, f"{field} (prompt {i})")


def corpus_rows(model: HookedModel, corpus: Union[str, Sequence[str], None], seq_len: int, max_tokens: Optional[int],
                position: PositionSpec = "all", field: str = "position", corpus_field: str = "corpus",
                packed: bool = False, seq_field: str = "seq_len") -> Iterator[StoreRow]:
    """Corpus windows, streamed; row id = window index.

    Per document (default): :func:`tracekit.corpus.token_windows` (at most ``seq_len`` tokens, BOS
    first when the model prepends one; each row records its document). ``packed``: windows of
    exactly ``seq_len`` tokens packed across documents (:func:`tracekit.corpus.packed_windows`), as
    SAELens packs its training contexts; position ``all`` then reads *every* position, the BOS
    included (SAELens' cached activations hold the whole window and mask special tokens by id), so
    an SAE can train from the store (``sae.train.store``).

    Raises:
        TokenizationError: ``token:<text>`` or a named position (a corpus has neither); a packed
            corpus at another position than ``all``.
        CorpusError: a corpus source that cannot be read.
        ConfigError: ``seq_len`` longer than the model's context (``seq_field`` named), raised when
            called, before any window.
    """
    check_window(model, seq_len, seq_field)
    return _corpus_rows(model, corpus, seq_len, max_tokens, position, field, corpus_field, packed, seq_field)


def _corpus_rows(model: HookedModel, corpus: Union[str, Sequence[str], None], seq_len: int, max_tokens: Optional[int],
                 position: PositionSpec, field: str, corpus_field: str, packed: bool,
                 seq_field: str) -> Iterator[StoreRow]:
    pos = store_position(position, field)
    if pos.kind in ("name", "token"):
        raise TokenizationError(f"{field}: {position!r} needs a prompt or a dataset row; on a corpus use all, "
                                "last, mean or an index")
    docs = iter_documents(corpus, field=corpus_field)
    if packed:
        if pos.kind != "all":
            raise TokenizationError(f"{field}: a packed corpus stores every position of its windows (position: all); "
                                    f"got {position!r}: set position: all or drop corpus.packed")
        for i, ids in enumerate(packed_windows(model, docs, seq_len, 0, max_tokens, seq_field)):
            yield StoreRow(i, tuple(ids), tuple(range(len(ids))), False, None)
        return
    for w in token_windows(model, docs, seq_len=seq_len, max_tokens=max_tokens, field=seq_field):
        read = list(range(w.n_prefix, len(w.ids))) if pos.kind in ("all", "mean") else \
            pos.resolve(model, "", w.ids, f"{field} (window {w.window})")
        yield StoreRow(w.window, tuple(w.ids), tuple(read), pos.kind == "mean", w.doc_id)
