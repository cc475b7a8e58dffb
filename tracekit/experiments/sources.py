"""Where a kind's rows come from: the one row-source mixin of the kinds.

A kind reads its rows from ``prompts`` (+ ``target``/``foil``), ``pairs``, ``pairs_file`` or a
``dataset``. :class:`RowSource` holds what every such kind shares: the kind declares the sources it
accepts (:attr:`RowSource.row_sources`, its fields of those names), the choice is validated once
(exactly one source, the fields named in the error) and two methods return the prepared rows::

    class MyKind(RowSource, Experiment):
        row_sources = ("pairs", "pairs_file", "dataset")
        pairs: list[PromptPair] = Field(default_factory=list)
        pairs_file: Optional[str] = None
        dataset: Optional[DatasetSpec] = None

        def prepare(self, model):
            return self.paired_rows(model, corrupted_needed_by="my method compares ...")

:meth:`RowSource.paired_rows` builds a :class:`tracekit.dataset.paired.PairedRows` (the route
kind -> dataset -> tokens -> model); :meth:`RowSource.prompt_rows` the rows of ``prompts`` or a
``dataset`` (:func:`tracekit.experiments.base.kind_dataset`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Optional, Union

from pydantic import model_validator

from ..core.strict import StrictModel
from ..dataset import DatasetSpec, PreparedDataset
from ..dataset.paired import PairedRows
from ..dataset.pairs import PromptPair, load_pairs
from ..model.info import HookedModel
from .base import check_dataset_fields, kind_dataset

__all__ = ["RowSource", "PAIRED_SOURCES", "PROMPT_SOURCES"]

#: The sources of the paired kinds (activation/attribution patching, the circuit kinds).
PAIRED_SOURCES = ("pairs", "pairs_file", "dataset")
#: The sources of the prompt kinds (``target``/``foil`` go with ``prompts``).
PROMPT_SOURCES = ("prompts", "dataset")


class RowSource(StrictModel):
    """Mixin of a kind whose rows come from one of ``prompts`` (+ ``target``/``foil``), ``pairs``,
    ``pairs_file``, ``dataset``.

    The kind declares the fields (their types and defaults are its schema) and lists them in
    :attr:`row_sources`; the mixin checks that exactly one is given (pydantic reports it at the
    kind's YAML path) and prepares the rows.
    """

    #: The sources the kind accepts, each one of its fields: :data:`PAIRED_SOURCES` or :data:`PROMPT_SOURCES`.
    row_sources: ClassVar[tuple[str, ...]] = PAIRED_SOURCES

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.row_sources not in (PAIRED_SOURCES, PROMPT_SOURCES):
            raise TypeError(f"{cls.__name__}.row_sources: {cls.row_sources} is neither {PAIRED_SOURCES} nor "
                            f"{PROMPT_SOURCES}")
        missing = [f for f in cls.row_sources if f not in cls.model_fields]
        if missing and not cls.__name__.startswith("_"):
            raise TypeError(f"{cls.__name__}: row_sources {cls.row_sources} names {missing}, not fields of the kind")

    def _source(self, name: str) -> Any:
        return getattr(self, name, None)

    @model_validator(mode="after")
    def _one_row_source(self) -> "RowSource":
        if self.row_sources == PROMPT_SOURCES:
            check_dataset_fields(self._source("prompts"), self._source("dataset"), self._source("target"),
                                 self._source("foil"))
            return self
        given = [k for k in self.row_sources if self._source(k)]
        if not given:
            raise ValueError("give the rows: 'pairs' (a list of {clean, corrupted, target, foil}), 'pairs_file' "
                             "(.jsonl/.json/.csv) or 'dataset' ({rows: ...}, {path: ...} or {generator: ioi})")
        if len(given) > 1:
            raise ValueError(f"give one of 'pairs', 'pairs_file', 'dataset', not {' and '.join(given)}")
        return self

    def all_pairs(self) -> list[PromptPair]:
        """The inline ``pairs`` or those read from ``pairs_file`` ([] with a ``dataset``).

        Raises:
            ConfigError: a pairs file that cannot be read (:func:`tracekit.dataset.pairs.load_pairs`).
        """
        if self._source("dataset") is not None:
            return []
        pairs = self._source("pairs")
        return list(pairs) if pairs else load_pairs(str(self._source("pairs_file")))

    def paired_rows(self, model: HookedModel, *, positions: Optional[Sequence[Union[int, str]]] = None,
                    foil_required: bool = False, corrupted_needed_by: Optional[str] = None,
                    align_positions: bool = False) -> PairedRows:
        """The kind's pairs, pairs file or dataset as :class:`~tracekit.dataset.paired.PairedRows`
        (the arguments and errors: :meth:`tracekit.dataset.paired.PairedRows.prepare`)."""
        return PairedRows.prepare(model, pairs=self._source("pairs") or (), pairs_file=self._source("pairs_file"),
                                  dataset=self._source("dataset"), positions=positions, foil_required=foil_required,
                                  corrupted_needed_by=corrupted_needed_by, align_positions=align_positions)

    def prompt_rows(self, model: HookedModel, batch_size: int = 16) -> PreparedDataset:
        """The rows of ``prompts`` (with ``target``/``foil``) or of the ``dataset``, prepared for
        ``model`` (:func:`tracekit.experiments.base.kind_dataset`; its errors)."""
        dataset: Optional[DatasetSpec] = self._source("dataset")
        return kind_dataset(model, self._source("prompts"), dataset, self._source("target"), self._source("foil"),
                            batch_size=batch_size)
