"""Typed access to the result tables (pandas-stubs types a boolean-mask selection, a column read by
name and ``itertuples`` rows loosely: ``DataFrame | Series``, ``tuple``). Each helper does exactly
the pandas operation its name says, so the numbers are the same as the untyped expression."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pandas as pd

__all__ = ["column", "records", "scalar", "values", "where"]


def where(df: pd.DataFrame, mask: Any) -> pd.DataFrame:
    """``df[mask]``: the rows of ``df`` where the boolean ``mask`` (a Series aligned with ``df``) holds."""
    return cast(pd.DataFrame, df[mask])


def column(df: pd.DataFrame, name: str) -> pd.Series:
    """``df[name]``: one column of a table, as a Series."""
    return cast(pd.Series, df[name])


def values(df: pd.DataFrame, name: str, dtype: Any = None) -> np.ndarray:
    """``df[name].to_numpy(dtype)``: one column of a table as a numpy array."""
    return column(df, name).to_numpy(dtype=dtype)


def records(df: pd.DataFrame) -> Iterator[Any]:
    """``df.itertuples()``: the rows as named tuples (attribute per column; typed ``Any`` because
    the columns are the table's own)."""
    return cast(Iterator[Any], df.itertuples())


def scalar(x: Any) -> float:
    """``float(x)`` of a pandas reduction (``Series.sum()``, ``.max()``, ``.mean()``: a scalar at run
    time, typed loosely by the stubs)."""
    return float(x)
