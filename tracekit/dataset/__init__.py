"""Datasets, not single prompts: one row type for every kind.

A dataset is rows with a ``prompt``, optional per-row ``target`` / ``foil`` (single tokens), named
``positions`` (``{IO: " Mary", S1: {text: " John", occurrence: 0}, END: -1}``), an optional
``corrupted`` prompt, a ``group`` and any extra columns; given inline, read from a file, or made by
a built-in generator (``ioi``, ``capitals``, ``induction``), optionally filtered to the rows the
model gets right. Every kind prepares its rows once per model (:class:`PreparedDataset`) and writes
one table row per dataset row.

Modules: :mod:`.rows` (:class:`Row`, :class:`Example`, :class:`PreparedDataset`,
:func:`prepare_rows`), :mod:`.read` (files), :mod:`.generators`, :mod:`.spec` (:class:`DatasetSpec`,
:func:`filter_correct`).

Notebook use (on the GPT-2 tokenizer):

>>> from tracekit.dataset import DatasetSpec
>>> spec = DatasetSpec(rows=[{"prompt": "When Mary and John went out, John gave it to",
...                           "target": " Mary", "foil": " John",
...                           "positions": {"S2": {"text": " John"}, "END": -1}}])
>>> spec.rows[0].positions["END"]
-1
"""

from . import generators, paired, read, rows, spec
from .generators import *  # noqa: F403 - the package re-exports each module's __all__
from .paired import *  # noqa: F403
from .read import *  # noqa: F403
from .rows import *  # noqa: F403
from .spec import *  # noqa: F403

__all__: list[str] = []
__all__ += generators.__all__
__all__ += paired.__all__
__all__ += read.__all__
__all__ += rows.__all__
__all__ += spec.__all__
