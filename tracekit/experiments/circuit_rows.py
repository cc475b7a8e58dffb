"""The rows of the circuit kinds (``edge_attribution``, ``path_patching``, ``circuit``): pairs,
a pairs file or a dataset whose rows have a corrupted prompt of the clean prompt's length, one
target and one foil each, one metric -- prepared as :class:`tracekit.dataset.paired.PairedRows`
(through the kinds' row source :class:`tracekit.experiments.sources.RowSource`), with these kinds'
own errors. Signs and node names: :mod:`tracekit.circuits`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional

import numpy as np
import pandas as pd
import torch
from pydantic import Field

from ..core.errors import DatasetError
from ..dataset import DatasetSpec
from ..dataset.paired import PairedRows
from ..dataset.pairs import PromptPair
from ..model.info import HookedModel
from .base import Experiment, row_frame
from .sources import PAIRED_SOURCES, RowSource

__all__ = ["CircuitRowsExperiment", "Metric", "Mode", "MIB_FRACTIONS"]

Metric = Literal["logit_diff", "prob", "log_prob", "kl"]
Mode = Literal["denoising", "noising"]
#: The circuit sizes (fractions of all edges) the MIB benchmark evaluates.
MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class CircuitRowsExperiment(RowSource, Experiment):
    """Rows with clean/corrupted prompts, one target and one foil each, and one metric (the fields
    and errors of :class:`tracekit.experiments.patching.ActivationPatching`'s rows)."""

    row_sources = PAIRED_SOURCES
    pairs: list[PromptPair] = Field(default_factory=list)
    pairs_file: Optional[str] = None
    dataset: Optional[DatasetSpec] = None
    metric: Metric = "logit_diff"

    def prepare(self, model: HookedModel) -> PairedRows:
        """The rows, each with one target and one foil token and a corrupted prompt.

        Raises:
            DatasetError: a row with several targets, or rows without corrupted prompts.
            TokenizationError / PatchingError: as :meth:`tracekit.dataset.paired.PairedRows.prepare`.
        """
        rows = self.paired_rows(
            model, foil_required=self.metric == "logit_diff", align_positions=True,
            corrupted_needed_by=f"{self.kind} compares each row's clean and corrupted runs (same token length): add "
                                "corrupted to every row (e.g. the ioi generator's corrupt: swap_s2)")
        rows.single_target("circuit methods")
        if not rows.has_corrupted:
            raise DatasetError("dataset: every row needs a corrupted prompt (circuit methods compare the clean "
                               "and corrupted runs)")
        return rows

    @staticmethod
    def ids(inputs: PairedRows) -> tuple[list[list[int]], list[list[int]], list[int], list[int] | None]:
        """``(clean ids, corrupted ids, target ids, foil ids)`` per row."""
        tgt, foil = inputs.single_target("circuit methods")
        return [list(c) for c in inputs.clean_ids], [list(x) for x in inputs.corrupted_ids], tgt, foil

    def _rows_table(self, inputs: PairedRows, clean: Sequence[float] | np.ndarray | torch.Tensor,
                    corrupted: Sequence[float] | np.ndarray | torch.Tensor) -> pd.DataFrame:
        """The ``rows`` table: per row its fields and the clean and corrupted metric (``clean`` /
        ``corrupted``: ``[rows]``)."""
        m = self.metric
        recs = [{"row_id": e.row_id, f"clean_{m}": float(c), f"corrupted_{m}": float(x)}
                for e, c, x in zip(inputs.data.examples, clean, corrupted)]
        return row_frame(inputs.data, recs)
