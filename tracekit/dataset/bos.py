"""Prepared rows under another BOS setting: a method that reads a component trained with its own
BOS convention (an SAE's ``prepend_bos``) takes the rows the shared door prepared
(:func:`tracekit.dataset.prepare_rows`, :meth:`tracekit.dataset.DatasetSpec.prepare`) and encodes
again only the rows whose BOS count differs, so named positions keep naming the same tokens."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..model.info import HookedModel
from ..tokens import encode
from .rows import PreparedDataset

__all__ = ["with_bos"]


def with_bos(model: HookedModel, data: PreparedDataset, prepend_bos: Optional[bool]) -> PreparedDataset:
    """``data`` tokenized with the BOS setting ``prepend_bos`` (``None``: ``data`` unchanged).

    Rows whose BOS count (0 or 1 leading BOS tokens) differs from the setting's are encoded again
    (the prompt, and the corrupted prompt where the row has one) and their named positions shifted
    by the difference: positions count the text's tokens after the BOS, so they name the same
    tokens. Rows that already match are kept as they are (the same objects).

    Raises:
        TokenizationError: a prompt that cannot be encoded (as :func:`tracekit.tokens.encode`).
    """
    if prepend_bos is None:
        return data
    n_bos = len(encode(model, "", prepend_bos))
    if all(e.n_bos == n_bos for e in data.examples):
        return data
    out = []
    for e in data.examples:
        if e.n_bos == n_bos:
            out.append(e)
            continue
        shift = n_bos - e.n_bos
        cids = tuple(encode(model, str(e.row.corrupted), prepend_bos)) if e.corrupted_ids is not None else None
        out.append(replace(e, ids=tuple(encode(model, e.prompt, prepend_bos)), corrupted_ids=cids, n_bos=n_bos,
                           positions={k: v + shift for k, v in e.positions.items()}))
    return PreparedDataset(tuple(out), data.source, dict(data.dropped))
