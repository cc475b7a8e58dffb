"""Datasets, not single prompts: one row type for every kind.

A dataset is rows with a ``prompt``, optional per-row ``target`` / ``foil`` (single tokens), named
``positions`` (``{IO: " Mary", S1: {text: " John", occurrence: 0}, END: -1}``), an optional
``corrupted`` prompt, a ``group`` and any extra columns; given inline, read from a file, or made by
a built-in generator (``ioi``, ``capitals``, ``induction``), optionally filtered to the rows the
model gets right. Every kind prepares its rows once per model (:class:`Rows`, formerly
``PreparedDataset``) and writes one table row per dataset row; this package is the one way data
comes in.

Modules: :mod:`.rows` (:class:`Row`, :class:`Example`, :class:`Rows` and its notebook door
:meth:`Rows.from_prompts`, :func:`prepare_rows`), :mod:`.targets` (:class:`LogitTarget`, per-row
target lists, read positions), :mod:`.read` (files), :mod:`.generators`, :mod:`.spec`
(:class:`DatasetSpec`, :func:`filter_correct`, :func:`kind_rows`), :mod:`.paired` (:class:`PairedRows`).

Notebook use: prompts with one target each (one line), or a dataset spec:

>>> from tracekit.dataset import Rows
>>> rows = Rows.from_prompts(model, ["The capital of France is"], target=" Paris")
>>> len(rows), rows.examples[0].row.target
(1, ' Paris')

>>> from tracekit.dataset import DatasetSpec
>>> spec = DatasetSpec(rows=[{"prompt": "When Mary and John went out, John gave it to",
...                           "target": " Mary", "foil": " John",
...                           "positions": {"S2": {"text": " John"}, "END": -1}}])
>>> spec.rows[0].positions["END"]
-1
"""

from . import generators, paired, read, rows, spec, targets
from .generators import *  # noqa: F403 - the package re-exports each module's __all__
from .paired import *  # noqa: F403
from .read import *  # noqa: F403
from .rows import *  # noqa: F403
from .spec import *  # noqa: F403
from .targets import *  # noqa: F403

__all__: list[str] = []
__all__ += generators.__all__
__all__ += paired.__all__
__all__ += read.__all__
__all__ += rows.__all__
__all__ += spec.__all__
__all__ += targets.__all__
