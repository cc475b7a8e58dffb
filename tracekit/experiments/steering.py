"""Steering vectors as an experiment kind: a dose-response against norm-matched random directions, and
text generated with and without steering.

``kind: steering`` (:class:`Steering`): a vector (contrastive prompts' mean difference, CAA / ActAdd; a
saved probe direction; an SAE decoder row; a file) is added ``alpha`` times at a hook and positions;
each row's target probability, log-prob and logit difference against its foil are read at each
alpha, for the vector and for ``controls.n_random`` random directions of exactly its norm, so the
summary answers "is it the direction or just the norm?". With ``generate``, each prompt is continued
with and without steering (same seed) and the texts are stored side by side. The computation is
:mod:`tracekit.steering`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union, cast

import numpy as np
import pandas as pd
import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from .. import plotting
from ..core.sites import check_layer
from ..core.sites import hook as site_hook
from ..core.strict import Prompts, StrictModel
from ..dataset import PreparedDataset
from ..dla import DLA_POSITION_FORMS, as_position, row_positions
from ..hooks import check_hooks
from ..model.context import check_generation, check_window
from ..model.info import HookedModel
from ..sae.spec import SAESpec
from ..steering import (
    DEFAULT_N_RANDOM,
    Steer,
    SteeringError,
    SteeringVector,
    SteerRow,
    check_vector,
    control_spread,
    dose_response,
    file_vector,
    forward_batch,
    generate,
    mean_difference,
    probe_vector,
    sae_vector,
)
from ..tokens import Position, encode_prompts, pad_rows
from .base import Result, RowInputs, RowTargetsExperiment, check_row_targets, kind_dataset, prompt_rows, register
from .frames import column, select, tuples

__all__ = ["Steering", "SteeringResult", "SteeringInputs", "MeanDifferenceSource", "ProbeSource", "SAESource",
           "FileSource", "Controls", "GenerateSpec"]


class _Source(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, arbitrary_types_allowed=True,
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)


class MeanDifferenceSource(_Source):
    """``vector: {source: mean_difference, positive: [...], negative: [...]}``: mean activation over the
    positive prompts minus the mean over the negative ones at the steered hook (CAA; ActAdd with one pair).

    Fields:
        positive: prompts steered towards (e.g. "... The capital of Italy").
        negative: prompts steered away from (e.g. "... The capital of France").
        read_position: ``last`` (each prompt's last token) or ``mean`` (mean over its tokens, BOS excluded).
    """

    source: Literal["mean_difference"] = Field(description="where the vector comes from: ``mean_difference`` here")
    positive: Prompts
    negative: Prompts
    read_position: Literal["last", "mean"] = "last"


class ProbeSource(_Source):
    """``vector: {source: probe, path: <linear_probe step dir>, layer: L, class: <name or index>}``.

    Fields:
        path: a saved ``linear_probe`` step directory (run with ``save_directions: true``).
        layer: the probe's block index.
        class_: (YAML ``class``) the class whose weight row is the direction: a name or an index;
            leave out for a binary probe.
        site: the probe's site (default ``resid_post``); the steered hook defaults to it at ``layer``.
    """

    source: Literal["probe"] = Field(description="where the vector comes from: ``probe`` here")
    path: str
    layer: int
    class_: Union[int, str, None] = Field(default=None, alias="class")
    site: str = "resid_post"


class SAESource(_Source):
    """``vector: {source: sae, sae: {...}, feature: N}``: the feature's decoder row ``W_dec[N]``; the
    steered hook defaults to the SAE's.

    Fields:
        sae: the SAE (:class:`tracekit.sae.spec.SAESpec`: ``path``, ``release`` + ``id`` or ``train``).
        feature: the feature index.
    """

    source: Literal["sae"] = Field(description="where the vector comes from: ``sae`` here")
    sae: SAESpec
    feature: int = Field(ge=0)


class FileSource(_Source):
    """``vector: {source: file, path: v.pt, key: name}``: a ``.pt`` / ``.npy`` / ``.safetensors`` file.

    Fields:
        path: the file.
        key: the tensor's name in a dict / safetensors file holding several.
    """

    source: Literal["file"] = Field(description="where the vector comes from: ``file`` here")
    path: str
    key: Optional[str] = None


VectorSource = Annotated[Union[MeanDifferenceSource, ProbeSource, SAESource, FileSource], Field(discriminator="source")]


class Controls(StrictModel):
    """Random control directions of exactly the vector's norm.

    Fields:
        n_random: how many (0: none; default 16, run in the same batches as the vector: a
            handful of controls leaves their spread unknown, one of 3 reached p 0.17 where a
            vector reached 0.5).
        seed: their seed (seeded standard Gaussian directions, normalised, scaled to the vector's norm).
    """

    n_random: int = Field(default=DEFAULT_N_RANDOM, ge=0)
    seed: int = 0


class GenerateSpec(StrictModel):
    """Generated text with and without steering (same seed), per prompt.

    Fields:
        max_new_tokens: tokens generated at most.
        do_sample: sample (default greedy).
        temperature: sampling temperature.
        top_p: nucleus mass (None: the whole vocabulary).
        seed: sampling seed.
        alpha: which multiplier(s) to generate with (default: the largest of ``alphas``).
        use_kv_cache: reuse keys/values between steps (default true).
        max_prompts: generate for the first N rows only.
    """

    max_new_tokens: int = Field(default=20, ge=1, le=512)
    do_sample: bool = False
    temperature: float = Field(default=1.0, gt=0)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    seed: int = 0
    alpha: Union[float, list[float], None] = None
    use_kv_cache: bool = True
    max_prompts: int = Field(default=4, ge=1)


@dataclass(frozen=True)
class SteeringInputs(RowInputs):
    """What :meth:`Steering.prepare` builds once: the rows, each row's read position and steered
    prompt positions, the hook, the contrastive prompts' ids, and (file / probe sources) the vector."""

    data: PreparedDataset
    read_at: tuple[int, ...]
    at: tuple[tuple[int, ...], ...]
    generated: bool
    hook: str
    positive_ids: tuple[tuple[int, ...], ...] = ()
    negative_ids: tuple[tuple[int, ...], ...] = ()
    vector: Optional[SteeringVector] = None


def _position_items(v: Any) -> list:
    if v is None:
        return []  # `steer_at: null` -> the "give at least one position" error below
    return [v] if isinstance(v, (int, str)) else list(v)


def _mean_or_none(x) -> Optional[float]:
    v = float(np.mean(x)) if len(x) else float("nan")
    return v if np.isfinite(v) else None


class SteeringResult(Result):
    """Tables:

    * ``dose_response``: one line per (direction, alpha), means over rows: ``direction`` (``steer`` or
      ``random_<i>``), ``draw`` (-1 for the vector), ``alpha``, ``target_prob`` (probability),
      ``target_log_prob`` (nats), ``logit_diff`` (logits: target - foil, or the target logit without
      foils), ``foil_prob``, ``n_rows``.
    * ``rows``: the same per row (``row_id``, ``prompt``, ``target``, ``foil`` added).
    * ``controls``: one line per alpha, the random controls' spread on the target probability
      (:func:`tracekit.steering.control_spread`): ``alpha``, ``n_random``, ``steer``, ``random_mean``,
      ``random_std``, ``random_min``, ``random_p5`` / ``random_p95`` (percentiles), ``random_max``,
      ``vector_rank`` (1 + the controls above the vector, of ``n_random + 1``) and
      ``vector_percentile`` (% of controls below it, ties half).
    * ``generations`` (with ``generate``): ``row_id``, ``prompt``, ``alpha``, ``steered_text``,
      ``unsteered_text``, ``same_text``, ``steered_first_token``, ``unsteered_first_token``.

    Summary keys: ``hook``, ``vector_source``, ``vector_norm`` (the added vector's L2 norm, after
    ``normalize``), ``normalize``, ``alphas``, ``n_random``, ``n_rows``, ``metric``;
    ``mean_clean_target_prob`` (mean over rows, no hook) and ``alpha0_max_abs_error`` (max over rows of
    ``|p(alpha 0) - p(clean)|``; None without alpha 0); per alpha (lists aligned with ``alphas``):
    ``mean_target_prob_by_alpha`` / ``mean_logit_diff_by_alpha`` (the vector, means over rows), ``random_target_prob_mean_by_alpha``
    / ``random_target_prob_max_by_alpha`` and ``random_logit_diff_mean_by_alpha`` /
    ``random_logit_diff_max_by_alpha`` (over the controls' means over rows), ``effect_vs_random_max_by_alpha``
    (vector minus the best control, target prob), ``beats_random_by_alpha``,
    ``random_target_prob_p5_by_alpha`` / ``random_target_prob_p95_by_alpha`` (the controls' 5th / 95th
    percentile), ``vector_rank_by_alpha`` / ``vector_percentile_by_alpha`` (the vector's rank among the
    ``n_random + 1`` directions, 1 = highest target prob; the % of controls below it); at the largest alpha:
    ``top_alpha``, ``top_alpha_mean_target_prob``, ``top_alpha_random_max_target_prob``; with ``generate``:
    ``generation_alpha``, ``generated_row_ids`` and, aligned with them, ``steered_text_by_row``,
    ``unsteered_text_by_row``, ``steered_first_token_by_row``, ``unsteered_first_token_by_row``;
    ``chunks`` (``{"steering dose-response": {"sequences": n}}``: sequences per forward pass used,
    what ``run.memory_budget`` allowed at most ``batch_size``).
    """

    config: "Steering"
    main_table = "dose_response"
    table_names = ("dose_response", "rows", "controls", "generations")
    summary_keys = ("hook", "vector_source", "vector_norm", "normalize", "alphas", "n_random", "n_rows", "metric",
                    "mean_clean_target_prob", "alpha0_max_abs_error", "mean_target_prob_by_alpha",
                    "mean_logit_diff_by_alpha", "random_target_prob_mean_by_alpha", "random_target_prob_max_by_alpha",
                    "random_logit_diff_mean_by_alpha", "random_logit_diff_max_by_alpha",
                    "effect_vs_random_max_by_alpha", "beats_random_by_alpha", "top_alpha", "top_alpha_mean_target_prob",
                    "top_alpha_random_max_target_prob", "chunks", "random_target_prob_p5_by_alpha",
                    "random_target_prob_p95_by_alpha", "vector_percentile_by_alpha", "vector_rank_by_alpha",
                    "generation_alpha", "generated_row_ids", "steered_text_by_row", "unsteered_text_by_row",
                    "steered_first_token_by_row", "unsteered_first_token_by_row")

    def summary(self) -> dict:
        dr = self.tables["dose_response"]
        alphas = [float(a) for a in self.config.alphas]
        st = dr[dr["direction"] == "steer"].set_index("alpha")
        rnd = dr[dr["direction"] != "steer"]

        def by_alpha(frame, col, how):
            out = []
            for a in alphas:
                v = frame[frame["alpha"] == a][col].to_numpy(dtype=float)
                out.append(None if not len(v) else float(getattr(np, how)(v)))
            return out

        p = [float(st.loc[a, "target_prob"]) for a in alphas]
        r_max = by_alpha(rnd, "target_prob", "max")
        top = int(np.argmax(np.abs(alphas)))
        s = {"hook": self.meta.get("hook"), "vector_source": self.meta.get("vector_source"),
             "vector_norm": self.meta.get("vector_norm"), "normalize": bool(self.config.normalize), "alphas": alphas,
             "n_random": int(self.config.controls.n_random), "n_rows": int(self.meta.get("n_rows", 0)),
             "metric": self.meta.get("metric"), "mean_clean_target_prob": self.meta.get("mean_clean_target_prob"),
             "alpha0_max_abs_error": self.meta.get("alpha0_max_abs_error"),
             "mean_target_prob_by_alpha": p, "mean_logit_diff_by_alpha": [float(st.loc[a, "logit_diff"]) for a in alphas],
             "random_target_prob_mean_by_alpha": by_alpha(rnd, "target_prob", "mean"),
             "random_target_prob_max_by_alpha": r_max,
             "random_logit_diff_mean_by_alpha": by_alpha(rnd, "logit_diff", "mean"),
             "random_logit_diff_max_by_alpha": by_alpha(rnd, "logit_diff", "max"),
             "effect_vs_random_max_by_alpha": [None if m is None else x - m for x, m in zip(p, r_max)],
             "beats_random_by_alpha": [None if m is None else bool(x > m) for x, m in zip(p, r_max)],
             "top_alpha": alphas[top], "top_alpha_mean_target_prob": p[top], "top_alpha_random_max_target_prob": r_max[top],
             "chunks": self.meta.get("chunks")}
        sp = control_spread(dr, alphas)
        has = bool(s["n_random"])
        for key, c in (("random_target_prob_p5_by_alpha", "random_p5"), ("random_target_prob_p95_by_alpha", "random_p95"),
                       ("vector_percentile_by_alpha", "vector_percentile")):
            s[key] = [float(v) if has else None for v in sp[c]]
        s["vector_rank_by_alpha"] = [int(v) if has else None for v in sp["vector_rank"]]
        gen = self.tables.get("generations")
        if gen is not None and len(gen):
            s.update({"generation_alpha": float(gen.iloc[0]["alpha"]),
                      "generated_row_ids": [int(v) for v in gen["row_id"]],
                      **{f"{c}_by_row": [str(v) for v in gen[c]] for c in
                         ("steered_text", "unsteered_text", "steered_first_token", "unsteered_first_token")}})
        return s

    def report(self) -> str:
        s = self.summary()
        lines = [f"steering [{self.config.step_name}]: {s['vector_source']} vector, norm {s['vector_norm']:.4g}, added at "
                 f"{s['hook']} ({', '.join(map(str, self.config.steer_at))}); {s['n_rows']} row(s), metric {s['metric']}; "
                 f"clean target prob {s['mean_clean_target_prob']:.4g}"]
        rows = []

        def g(v: Optional[float]) -> str:
            return "-" if v is None else f"{v:.4g}"
        n = s["n_random"]
        for i, a in enumerate(s["alphas"]):
            lo, hi = s["random_target_prob_p5_by_alpha"][i], s["random_target_prob_p95_by_alpha"][i]
            rank = s["vector_rank_by_alpha"][i]
            rows.append((f"{a:g}", f"{s['mean_target_prob_by_alpha'][i]:.4g}", g(s["random_target_prob_mean_by_alpha"][i]),
                         "-" if lo is None else f"{lo:.4g}-{hi:.4g}", g(s["random_target_prob_max_by_alpha"][i]),
                         "-" if rank is None else f"{rank}/{n + 1} ({s['vector_percentile_by_alpha'][i]:.0f}%)",
                         f"{s['mean_logit_diff_by_alpha'][i]:+.3f}"))
        lines.append(plotting.text_table(rows, ["alpha", "p(target) steer", f"random mean ({n})", "random p5-p95",
                                                "random max", "vector rank (% controls below)", "logit diff steer"]))
        if 0 < n < DEFAULT_N_RANDOM:
            lines.append(f"  only {n} random control(s): their spread is poorly known (the default is {DEFAULT_N_RANDOM})")
        gen = self.tables.get("generations")
        if gen is not None and len(gen):
            for g in tuples(gen.head(4)):
                lines.append(f"row {int(g.row_id)} alpha {g.alpha:g}: {g.prompt!r}\n  steered:   "
                             f"{g.steered_text!r}\n  unsteered: {g.unsteered_text!r}")
        return "\n".join(lines)

    def figures(self) -> dict:
        s = self.summary()
        dr = self.tables["dose_response"]
        fig, axes = plotting.plt().subplots(1, 2, figsize=(10, 4))
        for ax, col, label in ((axes[0], "target_prob", "target probability"), (axes[1], "logit_diff", s["metric"])):
            st = select(dr, column(dr, "direction") == "steer").sort_values("alpha")
            rnd = select(dr, column(dr, "direction") != "steer").groupby("alpha")[col]
            if s["n_random"]:
                lo, hi, mean = cast(pd.Series, rnd.min()), cast(pd.Series, rnd.max()), cast(pd.Series, rnd.mean())
                p5, p95 = cast(pd.Series, rnd.quantile(0.05)), cast(pd.Series, rnd.quantile(0.95))
                ax.fill_between(lo.index, lo.to_numpy(), hi.to_numpy(), color="gray", alpha=0.15,
                                label=f"random directions, same norm (min-max of {s['n_random']})")
                ax.fill_between(p5.index, p5.to_numpy(), p95.to_numpy(), color="gray", alpha=0.35,
                                label="random 5th-95th percentile")
                ax.plot(mean.index, mean.to_numpy(), color="gray", ls="--", label="random mean")
            ax.plot(st["alpha"], st[col], "o-", color="tab:red", label="steering vector")
            ax.set_xlabel("alpha (multiple of the vector)")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
        fig.suptitle(f"Steering dose-response at {s['hook']} (mean over {s['n_rows']} row(s))")
        fig.tight_layout()
        return {"dose_response": fig}


@register
class Steering(RowTargetsExperiment):
    """Steering vectors (ActAdd, Turner et al. 2023; CAA, Rimsky et al. 2024) with a dose-response
    against norm-matched random directions and generated text.

    Fields:
        prompts: one string or a list (one row each); or ``dataset`` (rows with own targets / foils).
        target: the token steered towards (a string for every prompt or one per prompt).
        foil: optional, the same way (the logit difference is target - foil).
        position: the read position (default ``last``).
        vector: where the vector comes from: ``{source: mean_difference, positive, negative,
            read_position}`` | ``{source: probe, path, layer, class, site}`` | ``{source: sae, sae,
            feature}`` | ``{source: file, path, key}``.
        hook: the TransformerLens hook steered (any d_model-wide hook: ``blocks.L.hook_resid_pre`` ...);
            or give ``layer`` (+ ``site``); default the probe's / SAE's hook.
        layer: block index of ``site`` (with ``hook`` unset).
        site: ``resid_pre`` (default) | ``resid_mid`` | ``resid_post`` | ``attn_out`` | ``mlp_out``.
        steer_at: where to add, one or a list: ``all`` (every prompt token after BOS), ``generated``
            (every generated token), an int (BOS counted), ``last``, ``token:<text>``, or a named
            position of the dataset's rows (``SUBJ``).
        alphas: multipliers (the vector's own units; with ``normalize``, residual-norm units).
        normalize: scale the vector to unit norm first.
        controls: ``{n_random, seed}``: random directions of exactly the vector's norm (default 16;
            the summary, report and figure give their mean, 5th-95th percentile band and max, and the
            vector's rank among them).
        generate: optional :class:`GenerateSpec`: text with and without steering.
        batch_size: sequences per forward pass of the dose-response.

    Raises:
        SteeringError: a vector of the wrong width, a hook that is not d_model-wide, no prompt position
            to steer. HookError: an unknown hook. TokenizationError / DatasetError: as other row kinds.
        ConfigError: a prompt then ``generate.max_new_tokens`` (or an SAE's ``train.context_size``)
            longer than the model's context.
    """

    kind: Literal["steering"] = "steering"
    vector: VectorSource
    hook: Optional[str] = None
    layer: Optional[int] = None
    site: Literal["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"] = "resid_pre"
    steer_at: list[Union[int, str]] = Field(default_factory=lambda: ["all"])
    alphas: list[float] = Field(default_factory=lambda: [0.0, 2.0, 4.0, 8.0])
    normalize: bool = False
    controls: Controls = Field(default_factory=Controls)
    generate: Optional[GenerateSpec] = None
    batch_size: int = Field(default=32, ge=1)

    result_class = SteeringResult
    target_role = "the token steered towards"

    @field_validator("steer_at", mode="before")
    @classmethod
    def _positions(cls, v):
        items = _position_items(v)
        if not items:
            raise ValueError("give at least one position (all, generated, an index, last, token:<text> or a name)")
        for i, p in enumerate(items):
            if p not in ("all", "generated"):
                as_position(p, f"steer_at[{i}]", DLA_POSITION_FORMS)
        return items

    @field_validator("alphas", mode="before")
    @classmethod
    def _alphas(cls, v: Any) -> Any:
        items: Any = [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        if not items:
            raise ValueError("give at least one multiplier, e.g. [0, 2, 4, 8]")
        dup = [a for i, a in enumerate(items) if a in items[:i]]
        if dup:
            raise ValueError(f"{dup[0]!r} is listed twice")
        return items

    @model_validator(mode="after")
    def _where(self):
        if self.hook is not None and self.layer is not None:
            raise ValueError("hook: give hook or layer (+ site), not both")
        if self.hook is None and self.layer is None and isinstance(self.vector, (MeanDifferenceSource, FileSource)):
            raise ValueError("hook: say where to steer: hook (blocks.6.hook_resid_pre) or layer (+ site)")
        return self

    def _hook(self, model: HookedModel) -> str:
        if self.hook is not None:
            return self.hook
        if self.layer is not None:
            return site_hook(self.site, check_layer(model, self.layer, "layer"))
        if isinstance(self.vector, ProbeSource):
            return site_hook(self.vector.site, check_layer(model, self.vector.layer, "vector.layer"))
        assert isinstance(self.vector, SAESource)  # _where: a mean-difference or file vector names its hook
        return str(self.vector.sae.train.hook) if self.vector.sae.train is not None else ""  # else: the SAE's, in _run

    def prepare(self, model: HookedModel) -> SteeringInputs:
        """The rows, read and steered positions, hook and contrastive prompts prepared once (tokenizer
        only); a file or probe vector is loaded and its width checked. Raises the errors listed in
        the class docstring.
        """
        data = (prompt_rows(model, self.prompts, self.target, self.foil) if self.dataset is None
                else kind_dataset(model, None, self.dataset, batch_size=self.batch_size))
        check_row_targets(data, "dataset" if self.dataset is not None else "prompts", "steering")
        read_at = tuple(row_positions(model, data, self.position))
        at: list[set[int]] = [set() for _ in data.examples]
        for i, p in enumerate(self.steer_at):
            if p == "all":
                for s, e in zip(at, data.examples):
                    s.update(Position("all").resolve(model, e.prompt, e.ids))
            elif p != "generated":
                for s, idx in zip(at, row_positions(model, data, p, f"steer_at[{i}]")):
                    s.add(int(idx))
        empty = [e.row_id for e, s in zip(data.examples, at) if not s]
        if empty:
            raise SteeringError(f"steer_at: rows {empty[:10]} have no prompt position to steer; the dose-response reads "
                                "the token after the prompt, so 'generated' alone adds nothing there: add all, an index "
                                "or a named position")
        hook = self._hook(model)
        if hook:
            check_hooks(model, [hook], "hook")
        vec = None
        if isinstance(self.vector, FileSource):
            vec = file_vector(self.vector.path, self.vector.key)
        elif isinstance(self.vector, ProbeSource):
            vec = probe_vector(self.vector.path, self.vector.layer, self.vector.class_, self.vector.site)
        if vec is not None:
            check_vector(model, vec, hook)
        if self.generate is not None:  # the rows _generations runs, checked before any work
            where = "dataset" if self.dataset is not None else "prompts"
            for i, e in enumerate(data.examples[:self.generate.max_prompts]):
                check_generation(model, len(e.ids), self.generate.max_new_tokens, "generate.max_new_tokens",
                                 f"{where}[{i}]")
        if isinstance(self.vector, SAESource) and self.vector.sae.train is not None:
            check_window(model, self.vector.sae.train.context_size, "vector.sae.train.context_size")
        pos_ids = neg_ids = ()
        if isinstance(self.vector, MeanDifferenceSource):
            pos_ids = encode_prompts(model, self.vector.positive, "vector.positive")
            neg_ids = encode_prompts(model, self.vector.negative, "vector.negative")
        return SteeringInputs(data, read_at, tuple(tuple(sorted(s)) for s in at), "generated" in self.steer_at, hook,
                              tuple(map(tuple, pos_ids)), tuple(map(tuple, neg_ids)), vec)

    def _vector(self, model: HookedModel, inputs: SteeringInputs) -> tuple[SteeringVector, str]:
        if isinstance(self.vector, MeanDifferenceSource):
            vec = mean_difference(model, inputs.positive_ids, inputs.negative_ids, inputs.hook,
                                  self.vector.read_position, batch_size=self.batch_size)
        elif isinstance(self.vector, SAESource):
            vec = sae_vector(model, self.vector.sae, self.vector.feature)
        else:
            assert inputs.vector is not None, "prepare loads file and probe vectors"
            vec = inputs.vector
        hook = inputs.hook or str(vec.hook)
        return (vec.normalized() if self.normalize else vec), hook

    def _run(self, model: HookedModel, inputs: SteeringInputs, progress: bool = True) -> SteeringResult:
        vec, hook = self._vector(model, inputs)
        v = check_vector(model, vec, hook)
        ex = inputs.data.examples
        rows = []
        for e, r, a in zip(ex, inputs.read_at, inputs.at):
            assert e.target_id is not None  # prepare: check_row_targets
            rows.append(SteerRow(tuple(e.ids), int(e.target_id), e.foil_id, r, a))
        dr = dose_response(model, rows, v, hook, self.alphas, n_random=self.controls.n_random, seed=self.controls.seed,
                           batch_size=self.batch_size)
        clean = _clean(model, rows, self.batch_size)
        per = dr.table.copy()
        frame = inputs.data.frame().reset_index(drop=True)
        per.insert(3, "row_id", [int(ex[r].row_id) for r in per["row"]])
        for c in ("prompt", "target", "foil"):
            per[c] = [frame.loc[r, c] if c in frame else None for r in per["row"]]
        per = per.drop(columns=["row"])
        agg = cast(pd.DataFrame, per.groupby(["direction", "draw", "alpha"], sort=False)[
            ["target_prob", "target_log_prob", "logit_diff", "foil_prob"]].mean()).reset_index()
        agg["n_rows"] = len(rows)
        a0 = column(select(per, (column(per, "direction") == "steer") & (column(per, "alpha") == 0.0)),
                    "target_prob").to_numpy()
        tables = {"dose_response": agg, "rows": per, "controls": control_spread(agg, self.alphas),
                  "generations": self._generations(model, inputs, v, hook)}
        has_foil = all(r.foil_id is not None for r in rows)
        meta = {"hook": hook, "vector_source": vec.source.get("source"), "vector": dict(vec.source),
                "vector_norm": float(v.double().norm()), "n_rows": len(rows), "mean_clean_target_prob": float(np.mean(clean)),
                "alpha0_max_abs_error": float(np.max(np.abs(a0 - clean))) if len(a0) else None,
                "metric": "logit(target) - logit(foil)" if has_foil else "logit(target)",
                "controls": "seeded standard Gaussian directions, normalised, then scaled to exactly the vector's norm",
                "steered_positions": [list(a) for a in inputs.at], "steer_generated": inputs.generated,
                "chunks": {"steering dose-response": {"sequences": int(dr.batch_size)}}}
        return SteeringResult(self, tables, meta, {"vector": v.clone(), "random_directions": dr.directions[1:].clone()})

    def _generations(self, model: HookedModel, inputs: SteeringInputs, v: torch.Tensor, hook: str) -> pd.DataFrame:
        cols = ["row_id", "prompt", "alpha", "steered_text", "unsteered_text", "same_text", "steered_first_token",
                "unsteered_first_token"]
        g = self.generate
        if g is None:
            return pd.DataFrame(columns=cols)
        alphas = [max(self.alphas, key=abs)] if g.alpha is None else ([g.alpha] if isinstance(g.alpha, (int, float))
                                                                      else list(g.alpha))
        recs = []
        for e, at in list(zip(inputs.data.examples, inputs.at))[:g.max_prompts]:
            kw = {"max_new_tokens": g.max_new_tokens, "do_sample": g.do_sample, "temperature": g.temperature,
                  "top_p": g.top_p, "seed": g.seed, "use_kv_cache": g.use_kv_cache}
            plain = generate(model, e.ids, **kw)
            for a in alphas:
                st = generate(model, e.ids, steering=Steer(v, hook, float(a), at, inputs.generated), **kw)
                recs.append({"row_id": int(e.row_id), "prompt": e.prompt, "alpha": float(a), "steered_text": st.text,
                             "unsteered_text": plain.text, "same_text": st.text == plain.text,
                             "steered_first_token": _first(model, st), "unsteered_first_token": _first(model, plain)})
        return pd.DataFrame(recs, columns=cols)


def _first(model: HookedModel, g) -> str:
    """The first generated token as text ('' when none)."""
    return str(model.tokenizer.decode(list(g.new_ids[:1]))) if g.new_ids else ""


@torch.no_grad()
def _clean(model: HookedModel, rows: list[SteerRow], batch_size: int) -> np.ndarray:
    """Each row's target probability without any hook (the reference alpha 0 must equal)."""
    out = []
    batch_size = forward_batch(model, [len(r.ids) for r in rows], batch_size, "steering clean run")
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        batch = pad_rows(model, [r.ids for r in chunk], "prompts")
        kw = {"attention_mask": batch.attention_mask} if batch.needs_mask else {}
        logits = model(batch.tokens, return_type="logits", **kw)
        for b, r in enumerate(chunk):
            lp = torch.log_softmax(logits[b, batch.offsets[b] + r.read_at].float(), -1)
            out.append(float(lp[r.target_id].exp()))
    return np.array(out)
