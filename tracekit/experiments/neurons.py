"""FFN neuron attribution as an experiment kind, per dataset row.

``kind: neuron_attribution`` (:class:`NeuronAttribution`): per-neuron direct contributions of
chosen MLP blocks to each row's target logit (difference) at its read position, read as key-value
memories (Geva et al. 2021; 2022): top neurons per row and on average over rows (per layer and
overall), the tokens the average top neurons' value vectors promote/suppress, their top-activating
corpus contexts (key readout), and a check by intervention (the verbs of :mod:`tracekit.units`:
zero, mean, clamp, scale, steer, on the top-k against k random neurons of the same layers, on every
row with its own target/foil).

Rows come from ``prompts`` (with ``target``/``foil``: a string for every prompt, a list for one per
prompt) or a ``dataset`` (each row its own target and foil). The computations are in
:mod:`tracekit.neurons` (notebook-usable; one batched forward pass per ``batch_size`` rows on the
ids prepared here); this module validates, calls them and shapes tables, summaries, reports and
figures. Units: ``contribution``/``logit_diff`` in logits, ``*_prob`` in probabilities.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Optional, Union

import pandas as pd
import torch
from pydantic import Field

from ..core.progress import progress_bar
from ..dataset import PreparedDataset
from ..dla import check_layers, row_positions
from ..model.context import check_window
from ..model.info import HookedModel
from ..neuron_tables import mean_over_rows as mean_over_rows  # the old import path of the table helpers
from ..neuron_tables import neuron_tables
from ..neuron_tables import top_by_row as top_by_row
from ..neuron_tables import top_rows as top_rows_of
from ..neurons import (
    key_readout,
    neuron_contributions,
    neuron_interventions,
    prompt_means,
    random_neurons,
    value_readout,
)
from ..units import (
    INTERVENTION_COLUMNS,
    InterventionVerbs,
    Verb,
    intervention_row,
)
from .base import (
    Indices,
    RowInputs,
    RowTargetsExperiment,
    StrictModel,
    check_row_targets,
    dataset_meta,
    kind_dataset,
    prompt_rows,
    register,
    row_frame,
)
from .neurons_tables import NeuronAttributionResult

__all__ = ["NeuronAttribution", "NeuronAttributionInputs", "NeuronAttributionResult", "KeyReadoutConfig",
           "AblationConfig", "ROW_INTERVENTION_COLUMNS"]

#: The columns of the unit kinds' ``interventions`` tables: :data:`tracekit.units.INTERVENTION_COLUMNS`
#: with the row named by its dataset ``row_id`` (``prompt_idx`` before datasets).
ROW_INTERVENTION_COLUMNS = ["row_id" if c == "prompt_idx" else c for c in INTERVENTION_COLUMNS]
if "row_id" not in ROW_INTERVENTION_COLUMNS:
    ROW_INTERVENTION_COLUMNS.insert(0, "row_id")


# =============================================================================================
# neuron attribution


class KeyReadoutConfig(StrictModel):
    """Key readout (Geva et al. 2021): top-activating corpus contexts of the top neurons.

    Fields:
        corpus: ``stdlib`` (offline default: Python's reference-manual topics and stdlib
            docstrings), a ``.txt``/``.jsonl`` file, a directory, or a list of them.
        jsonl_field: the text key in JSONL records.
        neurons: how many of the overall top neurons to read (default: the step's ``top_k``).
        top_n: contexts per neuron.
        max_tokens: text tokens read (bounds the time: ~12k tokens is < 1 min for SmolLM2 on 2 CPU cores).
        seq_len / batch_size: window length (BOS included) and windows per forward pass.
        sign: ``auto`` ranks by activation in the direction the neuron has on the prompt
            (SwiGLU activations can be negative), ``positive`` / ``negative`` force it.
    """

    corpus: Union[str, list[str]] = "stdlib"
    jsonl_field: str = "text"
    neurons: Optional[int] = Field(default=None, ge=1)
    top_n: int = Field(default=5, ge=1)
    max_tokens: Optional[int] = Field(default=12288, ge=1)
    seq_len: int = Field(default=64, ge=2)
    batch_size: int = Field(default=16, ge=1)
    sign: Literal["auto", "positive", "negative"] = "auto"


class AblationConfig(InterventionVerbs):
    """Check by intervention: edit the top-k neurons and k random neurons of the same layers (the
    control) with the verbs of :mod:`tracekit.units` (:class:`tracekit.units.InterventionVerbs`,
    the same vocabulary as ``sae_features.interventions``), at the step's read position
    (``intervene_at: position``) or at every position (``all``).

    Fields:
        k: how many of the overall top neurons (default: the step's ``top_k``).
        modes: any of ``zero`` (activation := 0), ``mean`` (:= the corpus mean from the key readout
            when it runs, else the mean over the rows' tokens, BOS excluded), ``clamp`` (:= ``clamp_value``),
            ``scale`` (x each of ``scale_factors``), ``steer`` (activation += each of
            ``steer_values``, i.e. that multiple of the neuron's ``W_out`` row added to the MLP's
            output); default ``[zero, mean, scale]``. Retired: ``ablate`` (now ``zero``),
            ``amplify`` (now ``scale``).
        n_random: random control sets drawn.
        seed: seed of the random control sets (set ``i`` is drawn with ``seed + i``; default 0).
        intervene_at: ``position`` (default) or ``all``. Retired: ``positions`` (``last`` is now
            ``position``).
    """

    k: Optional[int] = Field(default=None, ge=1)
    modes: list[Verb] = Field(default_factory=lambda: ["zero", "mean", "scale"])
    n_random: int = Field(default=5, ge=0)
    intervene_at: Literal["position", "all"] = "position"
    seed: int = 0

    retired = {**InterventionVerbs.retired, "positions": "intervene_at; position | all; 'last' is now 'position'"}


@dataclass(frozen=True)
class NeuronAttributionInputs(RowInputs):
    """What :meth:`NeuronAttribution.prepare` builds once: the rows (token ids, per-row target and
    foil ids, named positions), the MLP blocks attributed, and each row's read position (an index
    into its own ids, BOS counted)."""

    data: PreparedDataset
    layers: tuple[int, ...]
    read_at: tuple[int, ...]


@register
class NeuronAttribution(RowTargetsExperiment):
    """Which FFN neurons write each row's target into the residual stream, what they promote, when
    they fire, and whether removing them matters (Geva et al. 2021; 2022; DLA per Elhage et al. 2021).

    Fields:
        prompts: one string or a list (one row each); or
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`: inline ``rows``, a file ``path``, or
            a ``generator``), each with its own ``target`` and ``foil``.
        target: with ``prompts``: a one-token string for every prompt, or a list with one per prompt
            (each row's own answer). Not given with a ``dataset``.
        foil: optional, the same forms; the metric is ``logit[target]`` (- ``logit[foil]``). Every row
            has a foil or none does.
        position: the read position (:class:`tracekit.tokens.Position`), resolved per row: an int (an
            index into the row's tokens, BOS counted when prepended; negative from the end), ``last``
            (default), ``token:<text>``, or a named position of the dataset's rows (``END``, ``IO``...;
            counted in the row's own tokens after BOS, whatever the padding).
        layers: MLP blocks (block indices; negative from the end) to attribute, or ``all``.
        top_k: neurons listed per row, per layer and overall.
        rank_by: ``contribution`` (most positive first: neurons that push the target) or ``abs``.
        value_tokens: promoted/suppressed tokens per top neuron (0: skip the value readout).
        contexts: key readout settings, or null to skip (see :class:`KeyReadoutConfig`).
        ablation: intervention settings, or null to skip (see :class:`AblationConfig`).
        batch_size: rows per forward pass (attribution and interventions; default 8; lower it on
            out-of-memory).

    Tables and summary keys: :class:`NeuronAttributionResult`. The top neurons read out, read by key
    and intervened on are the top by mean contribution over rows; each row's own top neurons are in
    the ``top_by_row`` table.

    Raises:
        TokenizationError: target/foil not one token, position not in a prompt.
        DatasetError: a row without a target, rows with and without foils, a named position a row
            does not have.
        AttributionError: unknown layer. CorpusError: unreadable corpus.
    """

    kind: Literal["neuron_attribution"] = "neuron_attribution"
    layers: Union[Literal["all"], Indices, int] = "all"
    top_k: int = Field(default=10, ge=1)
    rank_by: Literal["contribution", "abs"] = "contribution"
    value_tokens: int = Field(default=10, ge=0)
    contexts: Optional[KeyReadoutConfig] = Field(default_factory=KeyReadoutConfig)
    ablation: Optional[AblationConfig] = Field(default_factory=AblationConfig)
    batch_size: int = Field(default=8, ge=1)

    result_class = NeuronAttributionResult

    target_role = "the token whose logit the neurons write"

    def prepare(self, model: HookedModel) -> NeuronAttributionInputs:
        """The rows prepared once (prompts tokenized, per-row target/foil ids, named positions), the
        layers and each row's read position (tokenizer and config only: works on a
        :class:`tracekit.model.ModelInfo`; ``filter: correct`` runs the model where it can).

        Raises:
            TokenizationError / DatasetError / AttributionError: see the class docstring.
            ConfigError: ``contexts.seq_len`` longer than the model's context.
        """
        if self.dataset is None:
            data = prompt_rows(model, self.prompts, self.target, self.foil)
        else:
            data = kind_dataset(model, None, self.dataset, batch_size=self.batch_size)
        check_row_targets(data, "dataset" if self.dataset is not None else "prompts", "neuron attribution")
        layers = tuple(check_layers(model, self.layers, "layers"))
        if self.contexts is not None:
            check_window(model, self.contexts.seq_len, "contexts.seq_len")
        return NeuronAttributionInputs(data, layers, tuple(row_positions(model, data, self.position)))

    @torch.no_grad()
    def _run(self, model: HookedModel, inputs: NeuronAttributionInputs, progress: bool = True) -> NeuronAttributionResult:
        # the engines read the prepared ids, targets and positions: nothing is tokenized again; the
        # tables are built by tracekit.neuron_tables from the per-row attributions
        data = inputs.data
        layers = list(inputs.layers)
        das = neuron_contributions(model, data, layers=layers, batch_size=self.batch_size, read_at=inputs.read_at)
        nt = neuron_tables(das, layers, self.top_k, self.rank_by)
        neurons, lay, tb, recs = nt.neurons, nt.layers, nt.top_by_row, nt.row_records
        top_rows, overall = top_rows_of(neurons, self.top_k, self.rank_by)
        tables = {"neurons": neurons, "layers": lay, "rows": row_frame(data, recs), "top": pd.DataFrame(top_rows),
                  "top_by_row": tb}

        if self.value_tokens:
            tables["values"] = pd.concat([
                value_readout(model, L, n, k=self.value_tokens, sign=1.0 if a >= 0 else -1.0).assign(
                    activation_sign=1 if a >= 0 else -1) for L, n, a in overall], ignore_index=True).rename(
                columns={"rank": "top_rank"})

        abl = self.ablation
        k_abl = min(abl.k or self.top_k, len(overall)) if abl else 0
        top_set = [(L, n) for L, n, _ in overall[:k_abl]]
        rand_sets = [random_neurons(model, top_set, seed=abl.seed + i, exclude=top_set) for i in range(abl.n_random)] if abl else []

        means = None
        meta = {"process_weights": bool(getattr(getattr(model, "tracekit_spec", None), "process_weights", True)),
                "dataset": dataset_meta(data), "ranking": "top / values / contexts / interventions: the top neurons "
                "by mean contribution over rows; top_by_row: each row's own"}
        if self.contexts is not None:
            means = self._contexts(model, overall, top_set, rand_sets, tables, meta, progress)
        if abl is not None and top_set:
            if means is None and "mean" in abl.modes:
                means = prompt_means(model, data, top_set + [x for s in rand_sets for x in s],
                                     batch_size=self.batch_size)
                meta["mean_source"] = "the rows' tokens (BOS excluded)"
            tables["interventions"] = self._interventions(model, inputs, top_set, rand_sets, means, progress)
        return NeuronAttributionResult(self, tables, meta)

    def _contexts(self, model: HookedModel, overall, top_set, rand_sets, tables: dict, meta: dict, progress: bool):
        """Key readout of the top neurons (table ``contexts``); returns the corpus means of every
        neuron read (the baselines of a ``mean`` ablation)."""
        cx = self.contexts
        assert cx is not None
        n_ctx = min(cx.neurons or self.top_k, len(overall))
        read = [(L, n) for L, n, _ in overall[:n_ctx]]
        sgn = {(L, n): (1.0 if a >= 0 else -1.0) for L, n, a in overall}
        if cx.sign == "positive":
            sgn = {k: 1.0 for k in sgn}
        elif cx.sign == "negative":
            sgn = {k: -1.0 for k in sgn}
        extra = [x for s in rand_sets for x in s if x not in read] + [x for x in top_set if x not in read]
        extra = list(dict.fromkeys(extra))
        kr = key_readout(model, read + extra, cx.corpus, top_n=cx.top_n, seq_len=cx.seq_len,
                         batch_size=cx.batch_size, max_tokens=cx.max_tokens,
                         signs=[sgn.get(x, 1.0) for x in read] + [1.0] * len(extra),
                         jsonl_field=cx.jsonl_field, progress=progress)
        c = kr.contexts.rename(columns={"rank": "top_rank"})
        keep = set(read)
        tables["contexts"] = c[[(int(a), int(b)) in keep for a, b in zip(c["layer"], c["neuron"])]].reset_index(drop=True)
        meta.update(corpus=cx.corpus, corpus_tokens=kr.n_tokens, corpus_windows=kr.n_windows, mean_source="corpus")
        return kr.means

    def _interventions(self, model: HookedModel, inputs: NeuronAttributionInputs, top_set, rand_sets, means,
                       progress: bool) -> pd.DataFrame:
        """One row per (verb, value) x set x dataset row: the top neurons and each random control set
        edited on every row in batched passes, each row with its own target/foil at its own position
        (table ``interventions``, columns :data:`ROW_INTERVENTION_COLUMNS`)."""
        abl = self.ablation
        assert abl is not None
        data = inputs.data
        rows = []
        clean: Optional[list] = None
        plans = abl.plans()
        sets = [("top", 0, top_set)] + [("random", i + 1, s) for i, s in enumerate(rand_sets)]
        bar = progress_bar(total=len(plans) * len(sets), desc="interventions", unit="intervention", enabled=progress)
        for mode, value in plans:
            for set_name, draw, nset in sets:
                rs = neuron_interventions(model, data, None, nset, mode=mode, means=means,
                                          factor=value if mode == "scale" else 1.0,
                                          value=value if mode in ("clamp", "steer") else 0.0,
                                          intervene_at=abl.intervene_at, clean_metrics=clean,
                                          read_at=inputs.read_at, batch_size=self.batch_size)
                clean = [r["clean"] for r in rs]
                units = json.dumps([f"{L}.{n}" for L, n in nset])
                for e, r in zip(data.examples, rs):
                    rows.append({"row_id": e.row_id, "set": set_name, "draw": draw, "verb": mode, "value": value,
                                 "k": len(nset), "units": units, **intervention_row(r)})
                bar.update(1)
        bar.close()
        return pd.DataFrame(rows, columns=ROW_INTERVENTION_COLUMNS)
