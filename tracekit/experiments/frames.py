"""Typed access to result tables: pandas types ``df[name]`` as ``Series | DataFrame`` (a list of
names gives a frame), so a kind's table code reads a column or a row subset through these two names
and the type checker knows what it holds (:func:`tuples` for named-tuple rows). Both return the very object pandas returns (no copy, no
conversion): numbers stay as they are."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

__all__ = ["column", "select", "tuples"]


def column(df: pd.DataFrame, name: str) -> pd.Series:
    """The column ``name`` of ``df`` (``df[name]``).

    Raises:
        KeyError: no such column (as pandas). TypeError: ``df`` holds several columns named ``name``.
    """
    out = df[name]
    if not isinstance(out, pd.Series):
        raise TypeError(f"table column {name!r}: {out.shape[1]} columns carry this name; expected one")
    return out


def select(df: pd.DataFrame, mask: Any) -> pd.DataFrame:
    """The rows of ``df`` where the boolean ``mask`` (a Series aligned with ``df``, or an array of
    ``len(df)``) is true (``df.loc[mask]``: the same rows, index and order as ``df[mask]``).

    Raises:
        IndexingError / ValueError: a mask of another length or index (as pandas).
    """
    out = df.loc[mask]
    assert isinstance(out, pd.DataFrame)
    return out


def tuples(df: pd.DataFrame) -> Iterable[Any]:
    """The rows of ``df`` as named tuples (``df.itertuples()``: the index first, then one field per
    column), typed so that ``row.<column>`` reads (pandas types them as plain tuples)."""
    return df.itertuples()
