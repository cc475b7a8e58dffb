"""SAE feature kinds over :mod:`tracekit.sae` (SAELens-format SAEs, read without SAELens: both
TransformerLens stacks; only ``sae.release`` needs SAELens).

* ``kind: sae_features`` (:class:`SAEFeatures`): decompose each row (``prompts`` or a ``dataset``)
  into SAE features at the SAE's hook, attribute the row's own target logit (difference) at its own
  read position to them (direct and total; batched, one forward+backward pass per ``batch_size``
  rows), with the reconstruction error, decoder bias and special tokens as their own terms; per-row
  tables and aggregates over rows; optional
  interventions (the verbs of :mod:`tracekit.units`: zero / mean / clamp / scale / steer, against
  random-feature controls) and per-feature HTML
  dashboards (top-activating corpus contexts, decoder vocabulary readout, activation density).
* ``kind: sae_eval`` (:class:`SAEEval`): the SAE spliced into the model on corpus windows (the
  held-out tokens of an SAE trained here): MSE, explained variance, L0, dead / dense features,
  CE loss recovered against zero and mean ablation, KL to the clean run.
* ``kind: sae_train`` (:class:`SAETrain`): train (or find in the cache) the SAE of a ``sae.train``
  block (SAELens' runner where SAELens imports, tracekit's own trainer elsewhere) and evaluate it
  on held-out text.

``sae_eval`` and ``sae_train`` are defined in :mod:`tracekit.experiments.sae_quality` and re-exported here.

Every kind takes the same ``sae:`` block (:class:`tracekit.sae.SAESpec`). Units: activations in
the SAE's input units; ``direct``/``total``/``contribution`` in logits; losses in nats.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import torch
from pydantic import Field

from ..dataset import PreparedDataset
from ..dataset.bos import with_bos
from ..dla import row_positions
from ..errors import SAEError
from ..model.context import check_window
from ..model.info import HookedModel
from ..sae import (
    SAEInfo,
    SAESpec,
    check_sae,
    decoder_vocab,
    eval_windows,
    random_features,
    sae_info,
    top_activating_contexts,
)
from ..sae.dashboard import prompt_activations, sae_identity
from ..sae.decompose import feature_decompositions
from ..sae.interventions import feature_interventions
from ..tokens import PositionSpec, check_length
from ..units import InterventionVerbs, Verb, intervention_row
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
from .frames import column, select
from .neurons import ROW_INTERVENTION_COLUMNS
from .sae_quality import SAEEval, SAEEvalResult, SAETrain, SAETrainResult, load_handle
from .sae_tables import SAEFeaturesResult, decomposition_tables, row_numbers

# SAEEval / SAETrain live in .sae_quality, SAEFeaturesResult in .sae_tables; re-exported here (one import path
# for the SAE kinds).
__all__ = [
    "SAEDashboardConfig",
    "SAEEval",
    "SAEEvalResult",
    "SAEFeatures",
    "SAEFeaturesInputs",
    "SAEFeaturesResult",
    "SAEInterventionConfig",
    "SAETrain",
    "SAETrainResult",
]


# =============================================================================================
# sae_features


class SAEInterventionConfig(InterventionVerbs):
    """Interventions on the top features (error term kept, so only the edited features move), with
    the verbs of :mod:`tracekit.units` (:class:`tracekit.units.InterventionVerbs`, the same
    vocabulary as ``neuron_attribution.ablation``).

    Fields:
        features: ``top`` (each row's own top ``k`` features by |contribution|) or a list of feature
            indices (the same on every row).
        k: how many top features.
        modes: any of ``zero`` (activation -> 0), ``mean`` (-> the feature's mean activation over
            the row's non-special tokens), ``clamp`` (-> ``clamp_value``), ``scale`` (x each of
            ``scale_factors``), ``steer`` (add each of ``steer_values`` x the decoder row); default
            ``[zero, steer]``. Retired: ``ablate`` (now ``zero``), ``amplify`` (now ``scale``).
        intervene_at: where the edit applies: ``all`` (every non-special token), ``position`` (each
            row's read position), or a list of token indices (BOS counted; every row).
        n_random: random control sets of the same size, per row (features active on the row for
            zero / mean / clamp / scale; any feature for steer).
        seed: the random control sets' seed (set ``i`` is drawn with ``seed + i``).
    """

    features: Literal["top"] | Indices = "top"
    k: int = Field(default=3, ge=1)
    modes: list[Verb] = Field(default_factory=lambda: ["zero", "steer"])
    intervene_at: Literal["all", "position"] | list[int] = "all"
    n_random: int = Field(default=3, ge=0)
    seed: int = 0

    retired = {**InterventionVerbs.retired, "positions": "intervene_at; all | position | token indices"}


class SAEDashboardConfig(StrictModel):
    """Per-feature dashboards of the top features (self-contained HTML pages, saved with the result).

    Fields:
        features: how many of the top features on average over rows (the ``features_mean`` table).
        corpus: the text scanned for each feature's top-activating contexts: ``stdlib`` (default,
            offline), a text/JSONL file or directory path, or a list of such paths.
        max_tokens / seq_len / batch_size: the corpus scan.
        top_n: top-activating corpus contexts shown per feature (default 8).
        vocab_k: promoted / suppressed tokens listed.
    """

    features: int = Field(default=5, ge=1)
    corpus: str | list[str] = "stdlib"
    max_tokens: int = Field(default=8192, ge=16)
    seq_len: int = Field(default=64, ge=4)
    batch_size: int = Field(default=8, ge=1)
    top_n: int = Field(default=8, ge=1)
    vocab_k: int = Field(default=10, ge=1)


@dataclass(frozen=True)
class SAEFeaturesInputs(RowInputs):
    """What :meth:`SAEFeatures.prepare` builds once: the SAE's identity (hook, BOS setting, training
    context; no weights), the rows (token ids with the SAE's BOS setting, per-row target and foil
    ids, named positions) and each row's read position (an index into its own ids, BOS counted)."""

    info: SAEInfo
    data: PreparedDataset
    read_at: tuple[int, ...]



@register
class SAEFeatures(RowTargetsExperiment):
    """Decompose each row's activation at the SAE's hook into SAE features and attribute the row's
    target logit (difference) to them (direct, Elhage et al. 2021; total, attribution patching,
    Marks et al. 2024), in batched passes, each row with its own target/foil at its own position.

    Fields:
        sae: the SAE (:class:`tracekit.sae.SAESpec`: ``release``+``id``, ``path`` or ``train``).
        prompts: one string or a list (one row each); or
        dataset: the rows (:class:`tracekit.dataset.DatasetSpec`), each with its own target and foil.
        target: with ``prompts``: the one-token string whose logit is attributed (e.g. ``" Paris"``),
            for every prompt, or a list with one per prompt. Not given with a ``dataset``.
        foil: optional, the same forms; with it the metric is the logit difference
            ``logit[target] - logit[foil]`` (default none: the target's logit alone). Every row has a
            foil or none does.
        position: the read position, resolved per row in the row's tokens as the SAE reads them (with
            its BOS setting): an int (token index, BOS counted; -1 = last, the default), ``last``,
            ``token:<text>``, or a named position of the dataset's rows (``END``, ``IO``...).
        top_k: features listed / ranked per row and on average.
        batch_size: rows per forward(+backward) pass (default 8).
        interventions: optional :class:`SAEInterventionConfig` (each row's own top features).
        dashboards: optional :class:`SAEDashboardConfig`: per-feature HTML dashboards of the top
            features on average over rows (default none: no dashboards, no corpus scan).

    Tables and summary keys: :class:`SAEFeaturesResult`.

    Raises:
        SAEError: (from :meth:`check`, before any forward pass) SAE source, hook, width, model,
            basis; a row longer than the SAE's training context.
        TokenizationError: target/foil not one token; prompt too long; position not in a row.
        DatasetError: a row without a target, rows with and without foils, a named position a row
            does not have.
    """

    kind: Literal["sae_features"] = "sae_features"
    sae: SAESpec
    position: PositionSpec = -1
    top_k: int = Field(default=10, ge=1)
    batch_size: int = Field(default=8, ge=1)
    interventions: SAEInterventionConfig | None = None
    dashboards: SAEDashboardConfig | None = None

    result_class = SAEFeaturesResult

    retired = {"answer": "target", "wrong": "foil", "prompt": "prompts"}

    target_role = "the token whose logit is attributed"

    def prepare(self, model: HookedModel) -> SAEFeaturesInputs:
        """The SAE's identity (no weights), the rows prepared once with the SAE's BOS setting
        (prompts tokenized, per-row target/foil ids, named positions), each row checked against the
        model's and the SAE's context, and each row's read position (works on a
        :class:`tracekit.model.ModelInfo`)."""
        info = sae_info(self.sae, model, "sae")
        where = "dataset" if self.dataset is not None else "prompts"
        if self.dataset is None:
            data = prompt_rows(model, self.prompts, self.target, self.foil, prepend_bos=info.prepend_bos)
        else:
            data = with_bos(model, kind_dataset(model, None, self.dataset, batch_size=self.batch_size),
                             info.prepend_bos)
        check_row_targets(data, where, "sae_features")
        for i, e in enumerate(data.examples):
            check_length(model, e.ids, f"{where}[{i}]", e.prompt)
            if info.context_size and len(e.ids) > int(info.context_size):
                raise SAEError(f"{where}[{i}] is {len(e.ids)} tokens, longer than the SAE's training context "
                               f"({info.context_size})")
        if self.dashboards is not None:
            check_window(model, self.dashboards.seq_len, "dashboards.seq_len")
        return SAEFeaturesInputs(info, data, tuple(row_positions(model, data, self.position)))

    def check(self, model: HookedModel) -> SAEFeaturesInputs:
        """:meth:`prepare`, then the SAE against the model (:func:`tracekit.sae.check_sae`: hook,
        width, model, activation basis)."""
        inputs = self.prepare(model)
        check_sae(model, inputs.info, "sae")
        return inputs

    def _run(self, model: HookedModel, inputs: SAEFeaturesInputs, progress: bool = True) -> SAEFeaturesResult:
        # the engines read the prepared ids, targets and positions: nothing is tokenized again
        h = load_handle(self, model, progress)
        data = inputs.data
        decs = feature_decompositions(model, h, [list(e.ids) for e in data.examples], list(inputs.targets),
                                      list(inputs.read_at), batch_size=self.batch_size, prompts=data.prompts)
        tables, recs = decomposition_tables(decs, [e.row_id for e in data.examples], self.top_k)
        features = tables["features"]
        nums = row_numbers(tables["tokens"], tables["terms"], features, [e.row_id for e in data.examples])
        tables["rows"] = row_frame(data, [{**r, **x} for r, x in zip(recs, nums)])
        meta = {"hook": h.hook, "sae": h.info.source, "d_sae": h.d_sae, "d_in": h.d_in,
                "max_sum_error": float(column(tables["rows"], "sum_error").max()),
                "sae_path": h.path, "sae_cache_hit": h.cache_hit, "sae_prepend_bos": h.info.prepend_bos,
                "sae_identity": sae_identity(h),
                "dataset": dataset_meta(data),
                "attribution": "direct: activation x decoder row . u_eff / sigma (frozen final-norm scale); total: "
                               "activation x decoder row . d metric / d activation, summed over non-special positions"}
        if self.interventions is not None:
            tables["interventions"] = self._interventions(model, h, inputs, features, decs)
        fm = tables["features_mean"]
        if self.dashboards is not None:
            self._dashboards(model, h, tables, meta, decs, [e.row_id for e in data.examples])
        elif len(fm):
            tables["vocab"] = decoder_vocab(model, h, fm["feature"].head(self.top_k).tolist(), 10).rename(
                columns={"rank": "top_rank"})
        return SAEFeaturesResult(self, tables, meta)

    def _interventions(self, model: HookedModel, h, inputs: SAEFeaturesInputs, feats: pd.DataFrame, decs) -> pd.DataFrame:
        """One row per dataset row x (verb, value) x set: each row's own top features (or the listed
        ones) and its random control sets, edited on every row in batched passes, each row with its
        own target/foil at its own read position."""
        cfg = self.interventions
        assert cfg is not None
        data = inputs.data
        if cfg.features != "top":
            bad = [f for f in cfg.features if not 0 <= f < h.d_sae]
            if bad:
                raise SAEError(f"interventions.features: {bad} out of range 0..{h.d_sae - 1}")
        plan_rows = []  # per dataset row: (index, sets, where, per-feature means)
        for i, (e, d) in enumerate(zip(data.examples, decs)):
            if cfg.features == "top":
                chosen = column(select(feats, column(feats, "row_id") == e.row_id).sort_values("top_rank"),
                                "feature").head(cfg.k).tolist()
            else:
                chosen = list(cfg.features)
            if not chosen:
                continue
            n = len(d.ids)
            where = torch.zeros(n, dtype=torch.bool)
            if cfg.intervene_at == "all":
                where[:] = True
            elif cfg.intervene_at == "position":
                where[d.position] = True
            else:
                for q in cfg.intervene_at:
                    if not -n <= int(q) < n:
                        raise SAEError(f"interventions.intervene_at: {q} is out of range for row {e.row_id}'s {n} "
                                       "tokens")
                    where[int(q) % n] = True
            pool = (d.acts != 0).any(0).nonzero().flatten().tolist()
            # random set r (draw r + 1) is drawn with seed + r: among the features active on the
            # row, or among all features for steer (steering an inactive feature is meaningful)
            sets = [("top", 0, chosen, chosen)]
            for r in range(cfg.n_random):
                sets.append(("random", r + 1, random_features(h.d_sae, len(chosen), chosen, pool, cfg.seed + r),
                             random_features(h.d_sae, len(chosen), chosen, None, cfg.seed + r)))
            fmeans = None
            if "mean" in cfg.modes:  # each feature's mean activation over the row's non-special tokens
                keep = ~torch.tensor([bool(x) for x in d.special], dtype=torch.bool)
                fmeans = d.acts[keep].float().mean(0)
            plan_rows.append((i, sets, where.tolist(), fmeans))
        if not plan_rows:
            return pd.DataFrame(columns=ROW_INTERVENTION_COLUMNS)
        idx = [i for i, *_ in plan_rows]
        ids = [list(data.examples[i].ids) for i in idx]
        tgts = [inputs.targets[i] for i in idx]
        read = [inputs.read_at[i] for i in idx]
        wh = [w for _, _, w, _ in plan_rows]
        out = []
        clean = None
        for j, (mode, v) in enumerate(cfg.plans()):
            for s in range(1 + cfg.n_random):
                use = [sets[s][3] if mode == "steer" else sets[s][2] for _, sets, _, _ in plan_rows]
                means = ([[float(fm[f]) for f in u] for u, (_, _, _, fm) in zip(use, plan_rows)]
                         if mode == "mean" else None)
                res = feature_interventions(model, h, ids, tgts, read, use, mode, 0.0 if math.isnan(v) else v,
                                            where=wh, means=means, batch_size=self.batch_size, clean_metrics=clean)
                clean = [r["clean"] for r in res]
                for q, (i, sets, _, _), u, r in zip(range(len(idx)), plan_rows, use, res):
                    name, draw = sets[s][0], sets[s][1]
                    out.append(((q, j, s), {"row_id": data.examples[i].row_id, "set": name, "draw": draw, "verb": mode,
                                            "value": v, "k": len(u), "units": json.dumps([int(f) for f in u]),
                                            **intervention_row(r)}))
        out.sort(key=lambda t: t[0])  # per row, then (verb, value), then set
        return pd.DataFrame([r for _, r in out], columns=ROW_INTERVENTION_COLUMNS)

    def _dashboards(self, model: HookedModel, h, tables: dict, meta: dict, decs, row_ids: list) -> None:
        cfg = self.dashboards
        assert cfg is not None
        fm = tables["features_mean"].sort_values("top_rank")
        chosen = fm["feature"].head(cfg.features).tolist()
        wins = eval_windows(model, h, cfg.corpus, cfg.max_tokens, cfg.seq_len, field="dashboards.corpus",
                            seq_field="dashboards.seq_len")
        ctx, hist = top_activating_contexts(model, h, chosen, wins, cfg.top_n, cfg.batch_size)
        top = fm["feature"].head(max(self.top_k, cfg.features)).tolist()
        tables["vocab"] = decoder_vocab(model, h, top, cfg.vocab_k).rename(columns={"rank": "top_rank"})
        tables["contexts"] = ctx.rename(columns={"rank": "top_rank"})
        tables["density"] = pd.DataFrame([{"feature": int(f), "activation": float(v)}
                                          for f, vals in hist.items() for v in vals],
                                         columns=["feature", "activation"])
        tables["prompt_acts"] = prompt_activations(decs, row_ids, chosen)
        meta["dashboard_features"] = [int(f) for f in chosen]
        meta["dashboard_tokens"] = int(sum(len(w) for w in wins))
        meta["dashboard_windows"] = len(wins)
