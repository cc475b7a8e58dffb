# pyright: reportAttributeAccessIssue=false, reportArgumentType=false, reportCallIssue=false, reportIncompatibleVariableOverride=false, reportOptionalMemberAccess=false, reportReturnType=false, reportOptionalSubscript=false, reportGeneralTypeIssues=false
"""The rows of the circuit kinds (``edge_attribution``, ``path_patching``, ``circuit``): pairs,
a pairs file or a dataset whose rows have a corrupted prompt of the clean prompt's length, one
target and one foil each, one metric -- prepared as :class:`tracekit.experiments.patching.ActivationPatching`
prepares them, with these kinds' own errors. Signs and node names: :mod:`tracekit.circuits`."""

from __future__ import annotations

from typing import Literal, Optional

import pandas as pd
from pydantic import Field, model_validator

from ..core.errors import DatasetError
from ..dataset import DatasetSpec
from .base import Experiment, row_frame
from .pairs import PromptPair
from .patching import ActivationPatching, ActivationPatchingInputs

__all__ = ["CircuitRowsExperiment", "Metric", "Mode", "MIB_FRACTIONS", "bar_chart"]

Metric = Literal["logit_diff", "prob", "log_prob", "kl"]
Mode = Literal["denoising", "noising"]
#: The circuit sizes (fractions of all edges) the MIB benchmark evaluates.
MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class CircuitRowsExperiment(Experiment):
    """Rows with clean/corrupted prompts, one target and one foil each, and one metric (the fields
    and errors of :class:`tracekit.experiments.patching.ActivationPatching`)."""

    pairs: list[PromptPair] = Field(default_factory=list)
    pairs_file: Optional[str] = None
    dataset: Optional[DatasetSpec] = None
    metric: Metric = "logit_diff"

    def _rows(self) -> ActivationPatching:
        return ActivationPatching(pairs=self.pairs, pairs_file=self.pairs_file, dataset=self.dataset,
                                  metrics=[self.metric], main_metric=self.metric, sites=["resid_pre"])

    @model_validator(mode="after")
    def _one_source(self):
        self._rows()  # one of pairs / pairs_file / dataset, named in the error
        return self

    def prepare(self, model) -> ActivationPatchingInputs:
        """The rows (as activation patching prepares them), each with one target and one foil token.

        Raises:
            DatasetError: a row with several targets, or rows without corrupted prompts.
        """
        try:
            inputs = self._rows().prepare(model)
        except DatasetError as e:
            if "no corrupted prompt" not in str(e):
                raise
            where = str(e).split(": no corrupted prompt")[0]
            raise DatasetError(f"{where}: no corrupted prompt; {self.kind} compares each row's clean and corrupted "
                               "runs (same token length): add corrupted to every row (e.g. the ioi generator's "
                               "corrupt: swap_s2)") from None
        if any(len(t) != 1 for t in inputs.target_ids):
            raise DatasetError("target: circuit methods score one target (and one foil) per row; give each row "
                               "a single target")
        if not inputs.has_corrupted:
            raise DatasetError("dataset: every row needs a corrupted prompt (circuit methods compare the clean "
                               "and corrupted runs)")
        return inputs

    @staticmethod
    def ids(inputs: ActivationPatchingInputs) -> tuple[list[list[int]], list[list[int]], list[int], list[int] | None]:
        """``(clean ids, corrupted ids, target ids, foil ids)`` per row."""
        return ([list(c) for c in inputs.clean_ids], [list(x) for x in inputs.corrupted_ids],
                [int(t[0]) for t in inputs.target_ids],
                None if inputs.foil_ids is None else [int(f[0]) for f in inputs.foil_ids])

    def _rows_table(self, inputs: ActivationPatchingInputs, clean, corrupted) -> pd.DataFrame:
        m = self.metric
        recs = [{"row_id": e.row_id, f"clean_{m}": float(c), f"corrupted_{m}": float(x)}
                for e, c, x in zip(inputs.data.examples, clean, corrupted)]
        return row_frame(inputs.data, recs)


def bar_chart(ax, labels, values, title, xlabel):
    ax.barh(range(len(values)), values, color=["tab:blue" if v >= 0 else "tab:red" for v in values])
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
