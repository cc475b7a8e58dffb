# Over 600 lines (reason): the one units abstraction: basis, verbs, interventions, interventions table and summary, contexts and vocabulary readouts (the house issue put them in one place on purpose); the readouts can move to units_readout.py.
"""Units: one abstraction for FFN neurons and SAE features, so "top units vs random units under
interventions" is written once.

A **unit basis** (:class:`UnitBasis`) is a set of units read at one TransformerLens hook: the
neurons of one MLP (:class:`tracekit.neurons.NeuronBasis`, hook ``blocks.L.mlp.hook_post``) or the
features of one SAE (:class:`tracekit.sae.SAEBasis`, the SAE's hook). Each unit has an activation
(read from the hook's value) and a decoder row (what one unit of activation writes; Geva et al.
2021's "value", an SAE's ``W_dec[f]``). The shape follows SAELens' ``SAE`` (``saes/sae.py``:
``encode`` / ``decode`` around one hook point).

Written once here, over any basis:

* the **verbs** (:data:`VERBS`, :func:`new_activations`, :func:`steer_vector`): ``zero``
  (activation := 0), ``mean`` (:= the unit's mean activation, given), ``clamp`` (:= value),
  ``scale`` (x factor), ``steer`` (add value x the units' rows to the hook's value at the chosen
  positions); the old names ``ablate`` / ``amplify`` map to ``zero`` / ``scale``
  (:data:`RETIRED_VERBS`, :func:`canonical_verb`);
* the **measurement** (:func:`intervene`): clean vs edited target probability / logit (difference)
  with :mod:`tracekit.metrics` (:func:`output_metrics`), hooks optionally frozen at their clean values;
* the **random controls** (:func:`random_units`);
* the **config vocabulary** of the kinds that intervene on units (:class:`InterventionVerbs`, the
  base of ``neuron_attribution.ablation`` and ``sae_features.interventions``: ``modes``,
  ``scale_factors``, ``clamp_value``, ``steer_values``), the columns of their ``interventions``
  tables (:data:`INTERVENTION_COLUMNS`, :func:`intervention_row`) and the top-vs-random summary of
  such a table (:func:`intervention_summary`, keyed by :func:`verb_key`: ``zero``, ``mean``,
  ``clamp_x{value:g}``, ``scale_x{factor:g}``, ``steer_x{value:g}``);
* the **readouts**: top-activating contexts (:func:`top_contexts`, a bounded running top-n with a
  deterministic tie order) and the vocabulary projection of decoder rows (:func:`vocab_readout`,
  Geva et al. 2022).

The engines keep their public functions as thin wrappers: :func:`tracekit.neurons.neuron_intervention`,
``random_neurons``, ``key_readout``, ``value_readout``; :func:`tracekit.sae.feature_intervention`,
``random_features``, ``top_activating_contexts``, ``decoder_vocab``. Every function that adds hooks
removes them whatever is raised (TransformerLens' ``hooks`` context manager and ``run_with_cache``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import (
    Callable,
    ClassVar,
    Iterable,
    Literal,
    Optional,
    Protocol,
    Sequence,
    Union,
    get_args,
    runtime_checkable,
)

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from pydantic import Field, field_validator, model_validator

from . import plotting
from .core.errors import AttributionError, SAEError
from .core.strict import StrictModel
from .hooks import check_hooks, enabled_hooks, hook_layer
from .metrics import logit_diff, target_log_prob, target_prob
from .model.info import HookedModel
from .model.readout import Readout
from .tokens import Batch, forward_kwargs, run_with_cache, token_texts

__all__ = ["UnitError", "UnitBasis", "VERBS", "RETIRED_VERBS", "VERB_PARAM", "canonical_verb", "new_activations",
           "steer_vector", "UnitEdit", "intervene", "output_metrics", "random_units", "hook_values", "RunningTop",
           "TopContexts", "top_contexts", "vocab_readout", "BatchPart", "batch_parts", "Verb", "verb_key", "InterventionVerbs",
           "INTERVENTION_COLUMNS", "intervention_row", "intervention_summary", "intervention_text"]

#: The intervention verbs, one set for every basis.
VERBS = ("zero", "mean", "clamp", "scale", "steer")
#: Old verb names -> the verb they are now (SAE ``ablate``; the neuron kind's ``amplify`` factors).
RETIRED_VERBS = {"ablate": "zero", "amplify": "scale"}
#: The parameter each verb reads (named in errors): ``UnitEdit.value`` is the clamp value, the
#: scale factor or the steering multiple; ``UnitEdit.means`` the per-unit means.
VERB_PARAM = {"zero": None, "mean": "means", "clamp": "value", "scale": "factor", "steer": "value"}
#: A verb of :data:`VERBS`, as a config field's type.
Verb = Literal["zero", "mean", "clamp", "scale", "steer"]
assert get_args(Verb) == VERBS


class UnitError(AttributionError, SAEError):
    """Bad unit-intervention input (verb, units, values). Also each engine's own error type, so
    ``except AttributionError`` (neurons) and ``except SAEError`` (SAE features) both catch it."""


@runtime_checkable
class UnitBasis(Protocol):
    """A basis of units read and edited at one hook.

    Attributes:
        name: ``"neuron"`` or ``"sae_feature"`` (tables, errors).
        hook: the TransformerLens hook whose value holds (or encodes) the activations.
        n_units: number of units (``d_mlp`` / ``d_sae``).
        verbs: the verbs of :data:`VERBS` this basis supports.
    """

    name: str
    hook: str
    n_units: int
    verbs: tuple[str, ...]

    def check(self, units: Sequence[int], field: str = "units") -> list[int]:
        """The unit indices as ints. Raises (naming ``field``) for one outside ``[0, n_units)``."""
        ...

    def activations(self, value: torch.Tensor) -> Float[torch.Tensor, "... n_units"]:
        """Every unit's activation from the hook's value (``[batch, pos, ...]``)."""
        ...

    def decoder_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_model"]:
        """What one unit of each unit's activation writes into the residual stream (float32)."""
        ...

    def hook_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_hook"]:
        """Each unit's direction in the hook's own space (what ``steer`` adds, per unit of value)."""
        ...

    def edit_hook(self, units: Sequence[int], edit: Optional[Callable[[torch.Tensor], torch.Tensor]],
                  add: Optional[Float[torch.Tensor, " d_hook"]], where: Bool[torch.Tensor, " pos"],
                  start: Optional[torch.Tensor] = None) -> Callable:
        """A forward hook: at the positions ``where``, set the units' activations ``cur``
        (``[batch, n_where, k]``) to ``edit(cur)`` and add ``add`` to the hook's value; ``start``:
        the value to edit instead of the hook's own (a frozen clean value)."""
        ...


def canonical_verb(verb: str, field: str = "mode") -> str:
    """``verb`` as one of :data:`VERBS` (``ablate`` -> ``zero``, ``amplify`` -> ``scale``).

    Raises:
        UnitError: not a verb, naming ``field`` and the accepted ones.
    """
    v = RETIRED_VERBS.get(verb, verb)
    if v not in VERBS:
        raise UnitError(f"{field}: {verb!r} is not one of {', '.join(VERBS)}")
    return v


def new_activations(verb: str, cur: Float[torch.Tensor, "*shape k"], value: float = 0.0,
                    means: Optional[Float[torch.Tensor, " k"]] = None) -> Float[torch.Tensor, "*shape k"]:
    """The edited activations of ``k`` units for the activation-setting verbs.

    ``zero``: 0; ``mean``: ``means`` (per unit); ``clamp``: ``value``; ``scale``: ``cur * value``.
    ``steer`` does not set activations (it adds to the hook's value: :func:`steer_vector`).

    Raises:
        UnitError: ``steer`` or an unknown verb; ``mean`` without ``means``.
    """
    if verb == "zero":
        return torch.zeros_like(cur)
    if verb == "mean":
        if means is None:
            raise UnitError("means: verb 'mean' needs the mean activation of every unit")
        return means.to(device=cur.device, dtype=cur.dtype).expand_as(cur).clone()
    if verb == "clamp":
        return torch.full_like(cur, float(value))
    if verb == "scale":
        return cur * value
    raise UnitError(f"mode: {verb!r} does not set activations (steer adds to the hook's value)")


def steer_vector(basis: UnitBasis, units: Sequence[int], value: float) -> Float[torch.Tensor, " d_hook"]:
    """``value x`` the sum of the units' rows in the hook's space (what ``steer`` adds per position)."""
    return basis.hook_rows(units).sum(0) * float(value)


@dataclass
class UnitEdit:
    """One verb on some units of one basis.

    Attributes:
        basis: the :class:`UnitBasis`. units: unit indices (checked by the basis).
        verb: one of :data:`VERBS` (or a name of :data:`RETIRED_VERBS`).
        value: the clamp value, the scale factor, or the steering multiple (finite).
        means: for ``mean``: one finite mean activation per unit.
        field: the name of ``units`` in errors.

    Raises:
        UnitError: unknown or unsupported verb, non-finite value, missing / wrong-length /
            non-finite means (each naming its field); the basis' error for a bad unit.
    """

    basis: UnitBasis
    units: Sequence[int]
    verb: str = "zero"
    value: float = 0.0
    means: Optional[Union[Sequence[float], torch.Tensor]] = None
    field: str = "units"
    VERB_FIELD: ClassVar[str] = "mode"

    def __post_init__(self):
        self.verb = canonical_verb(self.verb, self.VERB_FIELD)
        if self.verb not in self.basis.verbs:
            raise UnitError(f"{self.VERB_FIELD}: a {self.basis.name} basis cannot {self.verb!r} "
                            f"(it supports {', '.join(self.basis.verbs)})")
        self.units = self.basis.check(list(self.units), self.field)
        param = VERB_PARAM[self.verb]
        if param in ("value", "factor") and not np.isfinite(float(self.value)):
            raise UnitError(f"{param}: {self.value!r} is not a finite number")
        if self.verb == "mean":
            if self.means is None:
                raise UnitError("means: verb 'mean' needs the mean activation of every unit")
            vals = self.means.flatten().tolist() if isinstance(self.means, torch.Tensor) else list(self.means)
            m = torch.tensor([float(x) for x in vals])
            if m.numel() != len(self.units):
                raise UnitError(f"means: {m.numel()} means for {len(self.units)} units")
            if not torch.isfinite(m).all():
                raise UnitError(f"means: the mean activations of {self.basis.name}s {self.units} are not finite "
                                f"({m.tolist()})")
            self.means = m

    def hook(self, where: Bool[torch.Tensor, "*batch pos"], start: Optional[torch.Tensor] = None) -> Callable:
        """The forward hook doing this edit at ``where`` (``[pos]``: the same positions on every row;
        ``[batch, pos]``: each row its own), from ``start`` when given."""
        if self.verb == "steer":
            return self.basis.edit_hook(self.units, None, steer_vector(self.basis, self.units, self.value), where, start)
        verb, value = self.verb, self.value
        # __post_init__ made a 'mean' edit's means a tensor; the other verbs do not read them
        means = self.means if isinstance(self.means, torch.Tensor) else None

        def edit(cur):
            return new_activations(verb, cur, value, means)
        return self.basis.edit_hook(self.units, edit, None, where, start)


def output_metrics(logits: Float[torch.Tensor, " d_vocab"], tgt) -> dict:
    """``target_prob`` (probability), ``target_log_prob`` (nats), ``target_logit`` and
    ``logit_diff`` (logits: target - foil, or the target logit without a foil) and, with a foil,
    ``foil_prob``, of one next-token logit vector, computed by :mod:`tracekit.metrics`.
    ``tgt``: anything with ``target_id`` and ``foil_id`` (:class:`tracekit.dla.LogitTarget`)."""
    lg = logits.float().reshape(1, -1)
    t = torch.tensor([[tgt.target_id]], device=lg.device)
    out = {"target_prob": float(target_prob(lg, t)[0]), "target_log_prob": float(target_log_prob(lg, t)[0]),
           "target_logit": float(lg[0, tgt.target_id])}
    if tgt.foil_id is not None:
        f = torch.tensor([[tgt.foil_id]], device=lg.device)
        out["foil_prob"] = float(target_prob(lg, f)[0])
        out["logit_diff"] = float(logit_diff(lg, t, f)[0])
    else:
        out["logit_diff"] = out["target_logit"]
    return out


def _frozen(clean, name: str, act: torch.Tensor) -> torch.Tensor:
    """The clean run's activation at hook ``name`` (``clean``: its cache), in ``act``'s dtype (a
    freeze hook's output)."""
    return clean[name].to(act.dtype)


@torch.no_grad()
def intervene(model: HookedModel, edits: Union[UnitEdit, Sequence[UnitEdit]], batch: Batch, read_at: int, target, *,
              where: Optional[Bool[torch.Tensor, " pos"]] = None, freeze: Sequence[str] = (),
              clean_metrics: Optional[dict] = None, field: str = "units") -> dict:
    """Edit units and measure the target on prompt 0 of ``batch`` at padded position ``read_at``
    (Geva et al. 2022's neuron interventions; SAE feature ablation / steering, Templeton et al. 2024).

    Args:
        edits: one :class:`UnitEdit` per hook (bases on different hooks).
        target: ``target_id`` / ``foil_id`` (:class:`tracekit.dla.LogitTarget`).
        where: ``[pos]`` bool, the positions edited (None: every position).
        freeze: hooks held at their clean values in the edited run (an edited hook among them is
            edited from its clean value), e.g. every later block's outputs and the final-norm scale
            so only the direct path changes.
        clean_metrics: the ``clean`` dict of an earlier call on the same batch/target/position, to
            skip the clean forward pass (ignored with ``freeze``).

    Returns:
        ``{"clean": metrics, "patched": metrics, "delta": patched - clean}`` (:func:`output_metrics`).

    Raises:
        UnitError: two edits on one hook. HookError: a hook the model does not have.
    """
    edits = [edits] if isinstance(edits, UnitEdit) else list(edits)
    names = [e.basis.hook for e in edits]
    if len(set(names)) != len(names):
        raise UnitError(f"{field}: give one edit per hook ({names})")
    check_hooks(model, names + [n for n in freeze if n not in names], field)
    mask = (torch.ones(batch.tokens.shape[1], dtype=torch.bool) if where is None else where.bool())
    mask = mask.to(batch.tokens.device)
    clean = {}  # the clean run's cache of the frozen hooks (an ActivationCache)
    with enabled_hooks(model, names):
        if freeze:
            logits, clean = run_with_cache(model, batch, list(dict.fromkeys(freeze)))
            clean_m = output_metrics(logits[0, read_at], target)
        elif clean_metrics is not None:
            clean_m = clean_metrics
        else:
            clean_m = output_metrics(model(batch.tokens, **forward_kwargs(batch))[0, read_at], target)

        def freeze_hook(act, hook):
            return _frozen(clean, hook.name, act)

        hooks = [(e.basis.hook, e.hook(mask, clean[e.basis.hook] if e.basis.hook in freeze else None)) for e in edits]
        hooks += [(n, freeze_hook) for n in dict.fromkeys(freeze) if n not in names]
        with model.hooks(fwd_hooks=hooks):  # removes exactly these hooks on exit, whatever is raised
            patched = model(batch.tokens, **forward_kwargs(batch))
    pm = output_metrics(patched[0, read_at], target)
    return {"clean": clean_m, "patched": pm, "delta": {k: pm[k] - clean_m[k] for k in pm}}


def random_units(n_units: int, k: int, exclude: Iterable[int] = (), pool: Optional[Sequence[int]] = None,
                 rng: Union[int, np.random.Generator] = 0) -> list[int]:
    """``k`` distinct random units (a control set), none in ``exclude``, in draw order.

    Drawn from ``pool`` (e.g. the units active on the prompt) when it has ``k`` units outside
    ``exclude``, else from all of ``0 .. n_units - 1``; fewer when fewer remain. ``rng``: a seed or
    a numpy ``Generator`` (shared across calls, e.g. one per layer); the same seed gives the same
    units (numpy's ``Generator.choice`` without replacement).
    """
    g = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
    ex = {int(e) for e in exclude}
    cands = [int(u) for u in (pool if pool is not None else range(n_units)) if int(u) not in ex]
    if pool is not None and len(cands) < k:
        cands = [u for u in range(n_units) if u not in ex]
    return [int(u) for u in g.choice(np.array(cands), size=min(k, len(cands)), replace=False)]


# ---------------------------------------------------------------------------------------------
# the interventions of the kinds: config vocabulary, table columns, summary

#: The columns of a kind's ``interventions`` table (``neuron_attribution``, ``sae_features``): one
#: row per prompt x unit set x (verb, value). Probabilities in [0, 1], logits in logits, log-probs in nats.
INTERVENTION_COLUMNS = {
    "row_id": "the dataset row (index into the rows; the prompts when given as prompts)",
    "set": "'top' (the top units) or 'random' (a random control set of the same size)",
    "draw": "0 for the top set, 1 .. n_random for the random sets",
    "verb": "the verb, one of the config's modes (zero, mean, clamp, scale, steer)",
    "value": "the verb's parameter: the clamp value, the scale factor or the steering multiple (NaN for zero / mean)",
    "k": "how many units the set edits",
    "units": "the set's units as JSON: neurons as 'L.N' strings, SAE features as ints",
    "clean_target_prob": "target probability, clean run", "patched_target_prob": "target probability, edited run",
    "delta_target_prob": "patched - clean target probability",
    "clean_logit_diff": "logit(target) - logit(foil) (the target logit without a foil), clean run",
    "patched_logit_diff": "the same, edited run", "delta_logit_diff": "patched - clean logit difference",
    "delta_target_log_prob": "patched - clean log-probability of the target (nats)",
}


def verb_key(verb: str, value: float = float("nan")) -> str:
    """The summary key of one (verb, value): ``zero``, ``mean``, ``clamp_x{value:g}``,
    ``scale_x{value:g}``, ``steer_x{value:g}`` (e.g. ``scale_x2``, ``steer_x-20``)."""
    if VERB_PARAM.get(verb) in (None, "means"):
        return verb
    return f"{verb}_x{float(value):g}"


def intervention_row(result: dict) -> dict:
    """The metric columns of :data:`INTERVENTION_COLUMNS` from one :func:`intervene` result."""
    c, p, d = result["clean"], result["patched"], result["delta"]
    return {"clean_target_prob": c["target_prob"], "patched_target_prob": p["target_prob"],
            "delta_target_prob": d["target_prob"], "clean_logit_diff": c["logit_diff"],
            "patched_logit_diff": p["logit_diff"], "delta_logit_diff": d["logit_diff"],
            "delta_target_log_prob": d["target_log_prob"]}


def intervention_summary(table: Optional[pd.DataFrame], decimals: Optional[int] = 6) -> dict:
    """Top units vs random units, per (verb, value), of an ``interventions`` table
    (:data:`INTERVENTION_COLUMNS`); the summary ``interventions`` of both unit kinds.

    Returns:
        ``{verb_key(verb, value): entry}`` in the table's order, each entry: ``k`` (the top set's
        size, the largest over prompts), ``clean_target_prob`` / ``patched_target_prob`` (top set,
        mean over prompts), ``top_delta_target_prob`` / ``top_delta_logit_diff`` (top set, mean over
        prompts), ``n_random`` (random draws), ``random_delta_target_prob_mean`` /
        ``random_delta_logit_diff_mean`` (mean over every random row) and ``..._std`` (standard
        deviation, ddof 0, over draws of each draw's mean over prompts); None where not defined (no
        random set, a NaN). Rounded to ``decimals`` (None: not rounded).
    """
    if table is None or not len(table):
        return {}

    def num(x) -> Optional[float]:
        v = float(x)
        if not math.isfinite(v):
            return None
        return round(v, decimals) if decimals is not None else v

    def mean(v: np.ndarray) -> Optional[float]:
        return num(v.mean()) if len(v) else None

    metrics = ("clean_target_prob", "patched_target_prob", "delta_target_prob", "delta_logit_diff")
    keys = [verb_key(str(m), v) for m, v in zip(table["verb"], table["value"])]
    out: dict = {}
    for key, g in table.assign(_key=keys).groupby("_key", sort=False):
        is_top = (g["set"] == "top").to_numpy()
        is_rnd = (g["set"] == "random").to_numpy()
        col = {c: g[c].to_numpy(dtype=float) for c in metrics}
        draws = g["draw"].to_numpy()[is_rnd]
        entry: dict = {"k": int(g["k"].to_numpy()[is_top].max()) if is_top.any() and "k" in g else None,
                       "clean_target_prob": mean(col["clean_target_prob"][is_top]),
                       "patched_target_prob": mean(col["patched_target_prob"][is_top]),
                       "top_delta_target_prob": mean(col["delta_target_prob"][is_top]),
                       "top_delta_logit_diff": mean(col["delta_logit_diff"][is_top]),
                       "n_random": len(np.unique(draws))}
        for c, name in (("delta_target_prob", "random_delta_target_prob"), ("delta_logit_diff", "random_delta_logit_diff")):
            v = col[c][is_rnd]
            entry[f"{name}_mean"] = mean(v)
            entry[f"{name}_std"] = num(np.std([v[draws == d].mean() for d in np.unique(draws)])) if len(v) else None
        out[str(key)] = entry
    return out


def intervention_text(iv: dict) -> str:
    """An :func:`intervention_summary` as a text table (top set vs random sets; the reports)."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    rows = []
    for key, v in iv.items():
        rnd = v["random_delta_target_prob_mean"] is not None
        rows.append((key, f(v["clean_target_prob"], ".4f"), f(v["patched_target_prob"], ".4f"),
                     f(v["top_delta_target_prob"], "+.4f"), f(v["top_delta_logit_diff"], "+.3f"),
                     f"{f(v['random_delta_target_prob_mean'], '+.4f')} ({f(v['random_delta_target_prob_std'], '.4f')})"
                     if rnd else "-", f(v["random_delta_logit_diff_mean"], "+.3f") if rnd else "-"))
    return plotting.text_table(rows, ["intervention", "p clean", "p patched", "d_prob", "d_logit_diff",
                                      "random d_prob (std)", "random d_logit_diff"])


def _listed(v):
    """A single number as a one-item list; None as an empty list."""
    return [] if v is None else [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else v


class InterventionVerbs(StrictModel):
    """The verbs of a kind's interventions on units, one vocabulary for neurons and SAE features
    (:data:`VERBS`; the base of ``neuron_attribution.ablation`` and ``sae_features.interventions``).

    Fields:
        modes: the verbs run, each once per value: ``zero`` (activation := 0), ``mean`` (:= the
            unit's mean activation), ``clamp`` (:= ``clamp_value``), ``scale`` (x each of
            ``scale_factors``), ``steer`` (add each of ``steer_values`` x the unit's decoder row /
            ``W_out`` row). Retired: ``ablate`` (now ``zero``), ``amplify`` (now ``scale``).
        scale_factors: finite factor(s) ``scale`` multiplies the activations by (e.g. 2.0).
            Retired: ``amplify`` (now ``scale_factors``, with ``scale`` in ``modes``).
        clamp_value: the activation ``clamp`` sets.
        steer_values: the multiple(s) of the unit's row ``steer`` adds.

    A value field is read only when its verb is in ``modes``. A verb without values (``scale``
    with ``scale_factors: []``) and a repeated verb or value are config errors.
    """

    modes: list[Verb] = Field(default_factory=lambda: ["zero"])
    scale_factors: list[float] = Field(default_factory=lambda: [2.0])
    clamp_value: float = 0.0
    steer_values: list[float] = Field(default_factory=lambda: [10.0])

    retired = {"amplify": "scale_factors; and add 'scale' to modes"}
    retired_values = {"modes": dict(RETIRED_VERBS)}

    @field_validator("scale_factors", "steer_values", mode="before")
    @classmethod
    def _one(cls, v):
        return _listed(v)

    @model_validator(mode="after")
    def _consistent(self):
        for i, m in enumerate(self.modes):
            if m in self.modes[:i]:
                raise ValueError(f"modes: {m!r} is listed twice")
        for verb, name in (("scale", "scale_factors"), ("steer", "steer_values")):
            vals = getattr(self, name)
            if verb in self.modes:
                if not vals:
                    raise ValueError(f"{name}: mode {verb!r} needs at least one value")
                dup = [v for i, v in enumerate(vals) if v in vals[:i]]
                if dup:
                    raise ValueError(f"{name}: {dup[0]!r} is listed twice")
        return self

    def plans(self) -> list[tuple[str, float]]:
        """``(verb, value)`` per intervention, in ``modes`` order (value NaN for ``zero`` / ``mean``)."""
        out: list[tuple[str, float]] = []
        for m in self.modes:
            if m == "clamp":
                out.append((m, float(self.clamp_value)))
            elif m == "scale":
                out += [(m, float(f)) for f in self.scale_factors]
            elif m == "steer":
                out += [(m, float(v)) for v in self.steer_values]
            else:
                out.append((m, float("nan")))
        return out


# ---------------------------------------------------------------------------------------------
# readouts


@torch.no_grad()
def hook_values(model: HookedModel, batch: Batch, names: list[str], stop_at_layer: Optional[int]) -> dict:
    """The named hooks' values on ``batch``; the forward pass stops before block ``stop_at_layer``
    (TransformerLens' ``run_with_cache(stop_at_layer=...)``: no later blocks, no unembedding; its
    hooks are removed in a ``finally``).

    Raises:
        UnitError: a named hook never fired.
    """
    n_layers = int(model.cfg.n_layers)
    stop = stop_at_layer if stop_at_layer is not None and stop_at_layer < n_layers else None
    with enabled_hooks(model, names):
        _, cache = model.run_with_cache(batch.tokens, names_filter=set(names).__contains__, stop_at_layer=stop,
                                        **forward_kwargs(batch))
    missing = [n for n in names if n not in cache]
    if missing:
        raise UnitError(f"the model never produced the activations {missing}")
    return {n: cache[n] for n in names}


@dataclass
class BatchPart(Batch):
    """Some rows of a padded :class:`tracekit.tokens.Batch`, at the batch's padded width, given
    the attention mask exactly when the whole batch was (``masked``): each row is computed as in
    the whole batch, so a batch run part by part gives the whole batch's numbers."""

    masked: bool = False

    @property
    def needs_mask(self) -> bool:
        return self.masked


def batch_parts(batch: Batch, size: int) -> list[tuple[slice, Batch]]:
    """``batch`` cut into parts of ``size`` rows: ``[(rows, part)]`` (the batch itself when it has
    at most ``size`` rows). Used to run a padded batch in the chunks the memory budget allows
    (:func:`tracekit.core.budget.chunk_rows`) without changing its padding."""
    n, size = batch.size, max(1, int(size))
    if size >= n:
        return [(slice(0, n), batch)]
    out: list[tuple[slice, Batch]] = []
    for s in range(0, n, size):
        sl = slice(s, min(n, s + size))
        out.append((sl, BatchPart(batch.tokens[sl], batch.attention_mask[sl], batch.lengths[sl], batch.padding_side,
                                  batch.ids[sl], masked=batch.needs_mask)))
    return out


class RunningTop:
    """The running top ``top_n`` (value, window, position) of each of ``n`` units over batches;
    ties ordered by window, then position (exact ties happen when two windows share a prefix), so
    the result does not depend on how windows are batched."""

    def __init__(self, n: int, top_n: int):
        self.values = torch.full((n, top_n), float("-inf"))
        self.windows = torch.full((n, top_n), -1, dtype=torch.long)
        self.positions = torch.full((n, top_n), -1, dtype=torch.long)

    def update(self, vals: Float[torch.Tensor, "batch pos n"], windows: Sequence[int]) -> None:
        """Merge a batch: ``vals`` (``-inf`` where a token may not rank), ``windows`` its window ids."""
        B, P, N = vals.shape
        top_n = self.values.shape[1]
        wid = torch.tensor(list(windows), dtype=torch.long).repeat_interleave(P)
        pid = torch.arange(P).repeat(B)
        cand_v = torch.cat([self.values, vals.reshape(B * P, N).T], 1)
        cand_w = torch.cat([self.windows, wid.expand(N, -1)], 1)
        cand_p = torch.cat([self.positions, pid.expand(N, -1)], 1)
        width = int(cand_p.max()) + 2
        o1 = torch.sort(cand_w * width + cand_p, dim=1, stable=True).indices
        o2 = torch.sort(cand_v.gather(1, o1), dim=1, descending=True, stable=True).indices
        order = o1.gather(1, o2)[:, :top_n]
        self.values, self.windows = cand_v.gather(1, order), cand_w.gather(1, order)
        self.positions = cand_p.gather(1, order)

    def kept_windows(self) -> set[int]:
        """Windows holding at least one ranked token."""
        return set(self.windows[torch.isfinite(self.values)].tolist())


@dataclass
class TopContexts:
    """What :func:`top_contexts` found.

    Attributes:
        top: the :class:`RunningTop` (values in the ranking direction: times ``signs``).
        signs: ``[n]`` the ranking direction of each unit (+1 / -1).
        sums / count: per unit, the sum of its activation over the valid tokens, and their number.
        n_windows: windows read. rows: ``{(unit index, window): [pos] activations (0 where not
            valid)}`` of the ranked windows, when asked.
    """

    top: RunningTop
    signs: torch.Tensor
    sums: torch.Tensor
    count: int = 0
    n_windows: int = 0
    rows: dict = field(default_factory=dict)

    def ranked(self, j: int) -> list[tuple[float, int, int]]:
        """Unit ``j``'s ranked ``(activation, window, position)`` (activation in its own sign)."""
        t = self.top
        return [(float(t.values[j, r] * self.signs[j]), int(t.windows[j, r]), int(t.positions[j, r]))
                for r in range(t.values.shape[1]) if torch.isfinite(t.values[j, r])]


@torch.no_grad()
def top_contexts(model: HookedModel, reads: Sequence[tuple[UnitBasis, int]],
                 batches: Iterable[tuple[Batch, Sequence[int], Bool[torch.Tensor, "batch pos"]]], *, top_n: int = 10,
                 signs: Optional[Sequence[float]] = None, positive_only: bool = False, keep_rows: bool = False,
                 on_batch: Optional[Callable[[TopContexts, torch.Tensor, torch.Tensor], None]] = None,
                 field: str = "units", rows_per_pass: Optional[int] = None) -> TopContexts:
    """Top-activating tokens of some units over a stream of batches (Geva et al. 2021's key readout;
    SAE feature dashboards, Bricken et al. 2023). Memory is bounded: only the running top ``top_n``
    per unit is kept; the forward pass stops after the deepest hook read.

    Args:
        reads: ``(basis, unit)`` pairs (bases may differ: neurons of several layers).
        batches: ``(batch, window ids, valid [batch, pos])``; only valid tokens rank or count.
        signs: per read, +1 ranks by the largest activation, -1 by the most negative (default +1).
        positive_only: only activations > 0 rank (SAE features: inactive is 0).
        keep_rows: keep each ranked window's activations (``TopContexts.rows``).
        on_batch: called after each batch with the :class:`TopContexts` so far, the batch's
            ``[batch, pos, n]`` activations (0 where not valid) and its ``valid`` mask.
        rows_per_pass: run each batch's forward pass in parts of this many rows
            (:func:`batch_parts`; the memory budget's choice); the batch's activations are put
            back together before anything is ranked or summed, so the result is the same.

    Raises:
        UnitError: no reads, or signs of the wrong length. HookError: a basis' hook is unknown.
    """
    if not reads:
        raise UnitError(f"{field}: give at least one unit")
    sg = torch.tensor([1.0 if (signs is None or s >= 0) else -1.0 for s in (signs or [1.0] * len(reads))])
    if len(sg) != len(reads):
        raise UnitError("signs: need one sign per unit")
    bases: dict[str, UnitBasis] = {}
    for b, _ in reads:
        bases.setdefault(b.hook, b)
    names = check_hooks(model, list(bases), field)
    layers = [hook_layer(n) for n in names]
    stop = None if any(L is None for L in layers) else max(L for L in layers if L is not None) + 1
    out = TopContexts(RunningTop(len(reads), top_n), sg, torch.zeros(len(reads), dtype=torch.float64))
    for batch, wins, valid in batches:
        parts = []
        for _, part in batch_parts(batch, rows_per_pass or batch.size):
            cache = hook_values(model, part, names, stop)
            acts_of = {n: bases[n].activations(cache[n]) for n in names}
            parts.append(torch.stack([acts_of[b.hook][..., u].float().cpu() for b, u in reads], -1))  # [b, P, N]
            del cache, acts_of
        acts = parts[0] if len(parts) == 1 else torch.cat(parts)  # [B, P, N]
        valid = valid.bool().cpu()
        masked = acts * valid[..., None]
        out.sums += masked.sum((0, 1)).double()
        out.count += int(valid.sum())
        ok = valid[..., None] & (acts > 0) if positive_only else valid[..., None].expand_as(acts)
        out.top.update((acts * sg).masked_fill(~ok, float("-inf")), wins)
        if on_batch is not None:
            on_batch(out, masked, valid)
        if keep_rows:  # the rows of the ranked (unit, window) pairs: this batch's new ones, the others kept
            here = {int(w): i for i, w in enumerate(wins)}
            live = {(j, int(w)) for j in range(len(reads))
                    for w in out.top.windows[j][torch.isfinite(out.top.values[j])].tolist()}
            out.rows = {key: (masked[here[key[1]], :, key[0]] if key[1] in here else out.rows[key]) for key in live}
        out.n_windows += len(wins)
    return out


@torch.no_grad()
def vocab_readout(model: HookedModel, basis: UnitBasis, units: Sequence[int], k: int = 10,
                  signs: Optional[Sequence[float]] = None) -> pd.DataFrame:
    """Tokens each unit's decoder row promotes and suppresses most (Geva et al. 2022's value readout;
    SAE decoder readout): the rows read through the final norm and unembedding at scale 1
    (:meth:`tracekit.model.readout.Readout.vocab_projection`, centred over the vocabulary).

    Args:
        k: tokens per side (at most the vocabulary).
        signs: per unit, ``-1`` flips the row (a unit active with a negative activation), so
            ``promoted`` means promoted in that context.

    Returns:
        rows ``unit, side ('promoted'|'suppressed'), rank, token, token_id, score`` (``score``:
        logits per unit activation at final-norm scale 1).
    """
    units = list(units)
    scores = Readout(model).vocab_projection(basis.decoder_rows(units))
    k = min(int(k), scores.shape[-1])
    rows = []
    for i, u in enumerate(units):
        s = scores[i] * (1.0 if signs is None or signs[i] >= 0 else -1.0)
        for side, vals in (("promoted", torch.topk(s, k)), ("suppressed", torch.topk(-s, k))):
            toks = token_texts(model, vals.indices.tolist())  # a piece of a character: its bytes
            for r, (tid, v, t) in enumerate(zip(vals.indices.tolist(), vals.values.tolist(), toks)):
                rows.append({"unit": int(u), "side": side, "rank": r + 1, "token": t, "token_id": int(tid),
                             "score": float(v if side == "promoted" else -v)})
    return pd.DataFrame(rows, columns=["unit", "side", "rank", "token", "token_id", "score"])
