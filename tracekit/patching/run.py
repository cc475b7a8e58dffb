"""The two front-ends: :func:`run_patching` (every direction / ablation x site x pair; what the
``activation_patching`` kind calls) and :func:`batched_activation_patch` (one kind of site
everywhere, for notebooks) with its per-site specialisations (``batched_act_patch_*``). Both build
their jobs with :func:`tracekit.patching.jobs.build_job` and run them with
:func:`tracekit.patching.engine.patch_rows`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, TypedDict, Unpack, overload

import pandas as pd
import torch
from jaxtyping import Float, Int

from .. import metrics as M
from ..errors import PatchingError
from ..hooks import enabled_hooks
from ..model.info import HookedModel
from ..model.load import model_device
from ..tokens import Batch
from .ablation import _ablation_source, _population_acts, baseline_members, choose_baselines
from .checks import _refuse_side_inputs, check_unpadded, require_sites, resolve_layers
from .engine import CachedRun, PatchJob, cache_run, check_replay_fits, patch_rows
from .jobs import DIRECTIONS, build_job, site_index
from .request import PatchRequest, check_pairs, check_positions, check_request, length_groups
from .setters import (
    SITES,
    Site,
    layer_head_pattern_setter,
    layer_head_vector_setter,
    layer_neuron_setter,
    layer_pos_head_vector_setter,
    layer_pos_setter,
)

__all__ = [
    "JobResult",
    "PatchingRun",
    "batched_act_patch_attn_head_out_all_pos",
    "batched_act_patch_attn_head_out_by_pos",
    "batched_act_patch_attn_head_pattern_all_pos",
    "batched_act_patch_attn_out",
    "batched_act_patch_mlp_neuron",
    "batched_act_patch_mlp_out",
    "batched_act_patch_resid_mid",
    "batched_act_patch_resid_post",
    "batched_act_patch_resid_pre",
    "batched_activation_patch",
    "run_patching",
]


@dataclass
class JobResult:
    """The patched runs of one (direction or ablation, site) over one group of equal-length pairs.

    Attributes:
        mode: ``denoising``, ``noising``, ``zero``, ``mean`` or ``resample``.
        site: the :class:`Site`.
        index: ``[V]`` index rows (``layer`` + the site's axes).
        pairs: the pair indices of the group (``n``).
        n_pos: the group's token length.
        values: ``[V * n, n_metrics]`` raw metric values (units: :data:`tracekit.metrics.METRIC_UNITS`),
            index row major, pair minor.
        baseline_n: per pair, how many baseline prompts the site was replaced by the mean of
            (``mean``) or drawn from (``resample``: 1); None for other modes.
        baseline_source: per pair, the population index of the resampled prompt (``resample``), else None.
        positions: with ``run_patching(positions=...)`` and a position-indexed site: per pair (in
            ``pairs`` order) its chosen token indices; ``index``'s ``pos`` column then holds the slot
            ``k`` and pair ``pairs[i]`` was patched at ``positions[i][k]``. None otherwise (``pos``
            is the token index itself).
    """

    mode: str
    site: Site
    index: pd.DataFrame
    pairs: list[int]
    n_pos: int
    values: Float[torch.Tensor, "rows n_metrics"]
    baseline_n: list[int] | None = None
    baseline_source: list[int] | None = None
    positions: list[list[int]] | None = None


@dataclass
class PatchingRun:
    """What :func:`run_patching` returns.

    Attributes:
        metrics: metric names (columns of every ``values``).
        clean, corrupted: ``[n_pairs, n_metrics]`` each pair's unpatched clean / corrupted scores.
        jobs: one :class:`JobResult` per (length group, mode, site).
        lengths: each pair's token length.
        population_size: number of baseline prompts (``mean``/``resample``).
        batch_sizes: per length group, the variants per replay batch used (``run.memory_budget``
            and ``batch_size``; after any out-of-memory halving).
    """

    metrics: list[str]
    clean: Float[torch.Tensor, "pairs n_metrics"]
    corrupted: Float[torch.Tensor, "pairs n_metrics"]
    jobs: list[JobResult]
    lengths: list[int]
    population_size: int = 0
    batch_sizes: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# run_patching: every direction / ablation x site x pair.
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def run_patching(
    model: HookedModel,
    clean_ids: Sequence[Sequence[int]],
    corrupted_ids: Sequence[Sequence[int]],
    sites: Sequence[str],
    modes: Sequence[str],
    metrics: Sequence[str],
    target_ids: Sequence[int | Sequence[int]],
    foil_ids: Sequence[int | Sequence[int]] | None = None,
    *,
    layers: Sequence[int] | None = None,
    neuron_layers: Sequence[int] | None = None,
    neurons: Sequence[int] | None = None,
    baseline_ids: Sequence[Sequence[int]] | None = None,
    seed: int = 0,
    batch_size: int | str = "auto",
    skip_unchanged: bool = True,
    progress: Callable[[int], None] | None = None,
    positions: Sequence[Sequence[int]] | None = None,
    index_rows: dict[str, pd.DataFrame] | None = None,
) -> PatchingRun:
    """Patch every site of ``sites`` in every mode of ``modes`` for every (clean, corrupted) pair.

    Pairs of one token length share a cached run and replay batches; pairs of different lengths are
    independent groups (never padded). Metrics (:mod:`tracekit.metrics`) are read at each prompt's
    last token.

    Args:
        model: a hooked model (TransformerBridge).
        clean_ids: per pair the clean prompt's token ids (BOS included as the model spec says).
        corrupted_ids: per pair the corrupted prompt's ids, of the clean prompt's length.
        sites: site names or groups (:data:`SITES`, :data:`SITE_GROUPS`).
        modes: any of :data:`DIRECTIONS` and :data:`ABLATIONS`.
        metrics: names in :data:`tracekit.metrics.METRICS`.
        target_ids: per pair one target id or a list (the same count for every pair).
        foil_ids: per pair the foil id(s), as many as targets; required by ``logit_diff``.
        layers: block indices (negative from the end); default all. ``neuron_layers``/``neurons``:
            the layers and neurons of neuron sites.
        baseline_ids: the baseline population of ``mean``/``resample`` ablations; default: the
            pairs' clean prompts. See :func:`baseline_members`.
        seed: seeds the ``resample`` draw.
        batch_size: variants per replay batch at most, or ``auto`` (what ``run.memory_budget``
            allows; :func:`tracekit.patching.engine.replay_chunk`).
        skip_unchanged: bit-exact no-op patches take the cached run's value without replay.
        progress: called with the number of variants finished.
        positions: per pair ``k`` token indices (``0 .. len - 1``, BOS counted; the same ``k`` for
            every pair): position-indexed sites (``resid_*``, ``attn_out``, ``*_by_pos``, ...) are
            patched only there, each pair at its own indices (e.g. a named position resolved per
            row); default every position. See :attr:`JobResult.positions`.

    Returns:
        :class:`PatchingRun`: baselines and one :class:`JobResult` per (group, mode, site).

    Raises:
        PatchingError: unknown site/mode/metric, layers or neurons out of range, pairs of unequal
            length, missing foils for ``logit_diff``, a baseline population too small, or
            ``positions`` of another shape or out of a pair's range.
        MethodRefused: with a direction, on a model whose blocks read token-dependent inputs that
            bypass the residual stream, or a site the model's blocks do not have.
        MemoryBudgetError: a length group's cached run plus one variant does not fit
            ``run.memory_budget`` (before that group's cached run is made).
    """
    # Long (reason): groups of equal-length rows, each group's cached run and jobs, and the per-job results share the group's tensors; the body is already split into _group_jobs and build_job.
    clean_ids, corrupted_ids = check_pairs(clean_ids, corrupted_ids)
    req = check_request(model, len(clean_ids), sites, modes, metrics, target_ids, foil_ids,
                         layers, neuron_layers, neurons)
    pop, req.chosen = choose_baselines(clean_ids, baseline_ids, modes, seed)
    req.batch_size, req.skip_unchanged, req.progress = batch_size, skip_unchanged, progress
    req.positions = check_positions(positions, clean_ids)
    req.index_rows = index_rows

    dev = model_device(model)
    hooks = sorted({SITES[s].hook_name(L) for s in req.sites for L in req.site_layers(s)})
    require_sites(model, req.sites, req.layers, req.neuron_layers, neurons)
    n, lengths = len(clean_ids), [len(c) for c in clean_ids]
    clean_vals = torch.full((n, len(req.metric_names)), float("nan"))
    corr_vals = torch.full((n, len(req.metric_names)), float("nan"))
    out_jobs: list[JobResult] = []
    with enabled_hooks(model, hooks):
        pop_acts = _population_acts(model, pop, hooks) if req.chosen else {}
        for n_pos, members in length_groups(lengths):
            g, midx = len(members), torch.tensor(members)
            toks = torch.tensor([clean_ids[i] for i in members] + [corrupted_ids[i] for i in members], device=dev)
            base, results = _run_group(model, req, toks, members, n_pos, hooks, pop_acts, dev)
            clean_vals[midx], corr_vals[midx] = base[:g], base[g:]
            out_jobs += results
    return PatchingRun(req.metric_names, clean_vals, corr_vals, out_jobs, lengths, len(pop) if req.chosen else 0,
                       list(req.batch_sizes))


def _run_group(model: HookedModel, req: PatchRequest, toks: torch.Tensor, members: list[int], n_pos: int, hooks: list[str],
               pop_acts: dict, dev: torch.device) -> tuple[torch.Tensor, list[JobResult]]:
    """Patch one group of equal-length pairs: ``toks`` ``[2g, n_pos]`` (clean rows, then corrupted).

    Returns:
        ``([2g, n_metrics]`` unpatched clean then corrupted scores on the CPU, one
        :class:`JobResult` per (mode, site)).
    """
    g = len(members)
    check_replay_fits(model, 2 * g, n_pos, hooks, what="activation patching replay")
    run = cache_run(model, toks, hooks)
    if any(m in DIRECTIONS for m in req.modes):
        _refuse_side_inputs(model, run, torch.arange(g), torch.arange(g) + g)
    row_metric = _group_metric(req, run, torch.tensor(members), g, dev)
    base = row_metric(run.logits, torch.arange(2 * g, device=run.logits.device)).float().cpu()
    jobs, meta = _group_jobs(model, req, run, members, n_pos, pop_acts, dev)
    stats: dict = {}
    results = patch_rows(model, run, jobs, row_metric, req.batch_size, req.skip_unchanged, progress=req.progress,
                         stats=stats)
    req.batch_sizes.append(int(stats["batch_size"]))
    chosen = None if req.positions is None else req.positions[torch.tensor(members)].tolist()
    return base, [JobResult(mode, site, idf, list(members), n_pos, vals, bn, bs,
                            chosen if "pos" in site.axes else None)
                  for (mode, site, idf, bn, bs), vals in zip(meta, results)]


def _group_metric(req: PatchRequest, run: CachedRun, midx: torch.Tensor, g: int, dev: torch.device
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(logits [R, d_vocab], run rows [R]) -> [R, n_metrics]``: the request's metrics, row ``r``
    scored against pair ``r % g``'s answers and clean distribution."""
    inputs = M.MetricInputs(req.target[midx].to(dev), None if req.foil is None else req.foil[midx].to(dev),
                            torch.log_softmax(run.logits[:g].float(), -1))

    def row_metric(logits, br):
        return M.compute_metrics(req.metric_names, logits, inputs.rows(br % g))

    return row_metric


def _group_jobs(model: HookedModel, req: PatchRequest, run: CachedRun, members: list[int], n_pos: int, pop_acts: dict,
                dev: torch.device) -> tuple[list[PatchJob], list[tuple]]:
    """One job per (mode, site) of a group, and per job ``(mode, site, index, baseline_n, baseline_source)``."""
    jobs, meta = [], []
    pos_map = None if req.positions is None else req.positions[torch.tensor(members)]
    for mode in req.modes:
        for s in req.sites:
            site = SITES[s]
            site_map = pos_map if "pos" in site.axes else None  # pos then holds a slot into site_map's row
            idf = site_index(model, site, n_pos if site_map is None else int(site_map.shape[1]),
                            req.site_layers(s), (req.index_rows or {}).get(s), neurons=req.neurons)
            ablation = bn = bs = None
            if mode in req.chosen:
                picks = [req.chosen[mode][i] for i in members]
                ablation = partial(_ablation_source, pop_acts, site=site, n_pos=n_pos, chosen=picks)
                bn = [len(p) for p in picks]
                if mode == "resample":
                    bs = [p[0] for p in picks]
            jobs.append(build_job(site, idf, mode, run, len(members), dev, ablation, site_map))
            meta.append((mode, site, idf, bn, bs))
    return jobs, meta


# ---------------------------------------------------------------------------------------------
# batched_activation_patch: one kind of site everywhere, for notebooks.
# ---------------------------------------------------------------------------------------------

#: Token input of the notebook front-end: ``[batch, pos]`` ids or an unpadded :class:`Batch`.
Tokens = Int[torch.Tensor, "batch pos"] | Batch
#: ``(logits [rows, d_vocab], prompt [rows]) -> [rows]``.
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PatchOptions(TypedDict, total=False):
    """The keyword options of :func:`batched_activation_patch` (its overloads share them)."""

    index_df: pd.DataFrame | None
    layers: Sequence[int] | None
    neurons: Sequence[int] | None
    batch_size: int | str
    skip_unchanged: bool
    source: str | None


@overload
def batched_activation_patch(model: HookedModel, base_tokens: Tokens, source_tokens: Tokens | None,
                             patching_metric: Metric, patch_setter: Callable, activation_name: str, *,
                             return_index_df: Literal[False] = False, **options: Unpack[PatchOptions]
                             ) -> torch.Tensor: ...
@overload
def batched_activation_patch(model: HookedModel, base_tokens: Tokens, source_tokens: Tokens | None,
                             patching_metric: Metric, patch_setter: Callable, activation_name: str, *,
                             return_index_df: Literal[True], **options: Unpack[PatchOptions]
                             ) -> tuple[torch.Tensor, pd.DataFrame]: ...


@torch.no_grad()
def batched_activation_patch(
    model: HookedModel,
    base_tokens: Tokens,
    source_tokens: Tokens | None,
    patching_metric: Metric,
    patch_setter: Callable,
    activation_name: str,
    index_df: pd.DataFrame | None = None,
    layers: Sequence[int] | None = None,
    neurons: Sequence[int] | None = None,
    batch_size: int | str = "auto",
    skip_unchanged: bool = True,
    source: str | None = None,
    return_index_df: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, pd.DataFrame]:
    """Patch one kind of site everywhere, batched and layer-skipping; per-prompt values.

    Same purpose as TransformerLens' ``generic_activation_patch`` (which takes a clean cache and
    returns a metric averaged by the caller's function, one forward pass per site); here each index
    row (``layer`` + the site's axes) is one patch, applied to every prompt of the batch at once, and
    the metric is computed per prompt at the last position.

    Args:
        model: a hooked model (TransformerBridge).
        base_tokens: ``[batch, pos]`` the run being patched (the corrupted run for denoising), or an
            unpadded :class:`tracekit.tokens.Batch`.
        source_tokens: ``[batch, pos]`` the run patched in (the clean run), same shape; None with
            ``source`` = ``zero``/``mean``.
        patching_metric: ``(logits [rows, d_vocab] at the last position, prompt [rows]) -> [rows]``
            (vectorised over rows; ``prompt`` says which batch prompt a row is), e.g.
            ``lambda lg, b: tracekit.metrics.logit_diff(lg, target[b], foil[b])``.
        patch_setter: a setter (``layer_pos_setter``, ...); used with the site's activation.
        activation_name: the site name (``resid_pre``, ``head_out``, ... see ``SITES``).
        index_df: explicit index rows (columns ``layer`` + the site's axes); default: every index.
        layers: restrict the default index to these blocks (negative from the end).
        neurons: restrict the default index to these neurons.
        batch_size: variants (x prompts) per replay batch, or ``auto``.
        skip_unchanged: bit-exact no-op patches take the base run's value without replay.
        source: ``zero``, or ``mean``: each prompt's site replaced by the mean over the *other*
            prompts of ``base_tokens`` (those with different tokens; at least
            :data:`MIN_MEAN_POPULATION`).
        return_index_df: also return the index DataFrame.

    Returns:
        ``[batch, *index_shape]`` per-prompt metric tensor; with ``index_df`` given: ``[batch, rows]``.
        (Average over dim 0 for a mean-over-batch metric.)

    Raises:
        PatchingError: unknown site, padded or mismatched token batches, a bad ``source``, or a
            ``mean`` population that is too small.
        MemoryBudgetError: the cached run plus one variant does not fit ``run.memory_budget``
            (before the cached run is made).
    """
    site = _batched_site(activation_name, patch_setter)
    base_tokens = check_unpadded(model, base_tokens, "base_tokens")
    B, P_len = base_tokens.shape
    if layers is not None:
        layers = resolve_layers(int(model.cfg.n_layers), layers, "layers")
    idf = site_index(model, site, P_len, layers, index_df, neurons)
    idf_layers = sorted({int(x) for x in idf["layer"]})
    hooks = sorted({site.hook_name(L) for L in idf_layers})
    require_sites(model, [activation_name], idf_layers, idf_layers, None)
    n_run = B if source_tokens is None else 2 * B
    check_replay_fits(model, n_run, P_len, hooks, what="activation patching replay")
    with enabled_hooks(model, hooks):
        run, job = _batched_job(model, site, idf, base_tokens, source_tokens, source, hooks)
        (vals,) = patch_rows(model, run, [job], lambda lg, br: patching_metric(lg, br % B)[:, None],
                             batch_size, skip_unchanged)
    out = vals[:, 0].reshape(len(idf), B).T.contiguous()
    if index_df is None:
        out = out.reshape(B, *[int(n) for n in idf.nunique()])  # per column, as index_df's axes
    return (out, idf) if return_index_df else out


def _batched_site(activation_name: str, patch_setter: Callable) -> Site:
    """The site ``activation_name``, with ``patch_setter`` in place of its own setter if it differs."""
    if activation_name not in SITES:
        raise PatchingError(f"activation_name: unknown site {activation_name!r}; use one of {sorted(SITES)}")
    site = SITES[activation_name]
    if patch_setter is not site.setter:
        site = Site(site.name, site.hook, site.axes, patch_setter, site.start, site.kv_heads)
    return site


def _batched_job(model: HookedModel, site: Site, idf: pd.DataFrame, base_tokens: torch.Tensor, source_tokens,
                 source: str | None, hooks: list[str]) -> tuple[CachedRun, PatchJob]:
    """The cached run of :func:`batched_activation_patch` and its one job: ``[base; source]`` rows
    with the base rows patched from the source rows, or the base rows ablated (``source``)."""
    dev = model_device(model)
    B, P_len = base_tokens.shape
    if source_tokens is not None:
        source_tokens = check_unpadded(model, source_tokens, "source_tokens")
        if source_tokens.shape != base_tokens.shape:
            raise PatchingError(f"source_tokens {tuple(source_tokens.shape)} and base_tokens "
                                f"{tuple(base_tokens.shape)} must have the same shape")
        run = cache_run(model, torch.cat([base_tokens, source_tokens]).to(dev), hooks)
        _refuse_side_inputs(model, run, torch.arange(B), torch.arange(B) + B)
        # first half patched from the second: the row layout of noising
        return run, build_job(site, idf, "noising", run, B, dev)
    if source not in ("zero", "mean"):
        raise PatchingError("source: without source_tokens, use source='zero' or 'mean'")
    ids = base_tokens.tolist()
    chosen = baseline_members(ids, ids, "mean", "the other prompts of base_tokens", "source") \
        if source == "mean" else None
    run = cache_run(model, base_tokens.to(dev), hooks)
    ablation = None if chosen is None else partial(
        _ablation_source, {P_len: (list(range(B)), run.acts)}, site=site, n_pos=P_len, chosen=chosen)
    return run, build_job(site, idf, source, run, B, dev, ablation)


def _specialise(setter: Callable, name: str, doc: str) -> Callable:
    fn = partial(batched_activation_patch, patch_setter=setter, activation_name=name)
    fn.__doc__ = doc + " (see :func:`batched_activation_patch`)"
    return fn


batched_act_patch_resid_pre = _specialise(
    layer_pos_setter, "resid_pre", "Residual stream at the start of each block, per position: [batch, layer, pos].")
batched_act_patch_resid_mid = _specialise(
    layer_pos_setter, "resid_mid", "Residual stream between attention and MLP, per position: [batch, layer, pos].")
batched_act_patch_resid_post = _specialise(
    layer_pos_setter, "resid_post", "Residual stream at the end of each block, per position: [batch, layer, pos].")
batched_act_patch_attn_out = _specialise(
    layer_pos_setter, "attn_out", "Attention layer output per position: [batch, layer, pos].")
batched_act_patch_mlp_out = _specialise(
    layer_pos_setter, "mlp_out", "MLP layer output per position: [batch, layer, pos].")
batched_act_patch_attn_head_out_all_pos = _specialise(
    layer_head_vector_setter, "head_out", "Each head's output (hook_z), all positions: [batch, layer, head].")
batched_act_patch_attn_head_out_by_pos = _specialise(
    layer_pos_head_vector_setter, "head_out_by_pos",
    "Each head's output (hook_z) per position: [batch, layer, pos, head].")
batched_act_patch_attn_head_pattern_all_pos = _specialise(
    layer_head_pattern_setter, "head_pattern", "Each head's attention pattern: [batch, layer, head].")
batched_act_patch_mlp_neuron = _specialise(
    layer_neuron_setter, "neuron", "Each MLP neuron (mlp.hook_post), all positions: [batch, layer, neuron].")
