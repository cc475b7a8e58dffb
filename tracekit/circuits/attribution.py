"""Attribution patching (AtP): a first-order estimate of every patching site's effect from two
forward passes and one backward pass.

Method: Nanda 2023 ("Attribution Patching: Activation Patching At Industrial Scale"), Syed et al.
2023 ("Attribution Patching Outperforms Automated Circuit Discovery"), Kramár et al. 2024 ("AtP*:
An efficient and scalable method for localizing LLM behaviour to components"). Reference
implementation: TransformerLens 4.3's ``attribution_patching``.

For a site ``a`` (one slice of an activation: the residual stream at (layer, position), one head's
``z`` at one position, one neuron, ...), patching the *base* run's value ``a_base`` with the
*source* run's ``a_src`` changes a metric ``M`` by, to first order,

    AtP(a) = (a_src - a_base) . dM/da |_base

(summed over the slice). ``denoising``: base = corrupted run, source = clean run (the gradient is
taken on the corrupted run); ``noising``: base = clean, source = corrupted. The estimate of the
patched run's score is ``M(base) + AtP(a)``, so every number here is in the units of the exact
engine's (:mod:`tracekit.patching`) and is normalised the same way ((value - corrupted) / (clean -
corrupted)). It is exact when ``M`` is linear in ``a`` along the patch (a model made linear) and is
known to miss effects that pass through a saturated softmax (attention patterns) or cancel
(Kramár et al. 2024, section 3). Every run of the ``attribution_patching`` kind therefore checks
itself against the exact engine (:mod:`tracekit.circuits.verification`).

**QK fix** (AtP*, ``qk_fix=True``): for query and key sites (``head_q``, ``head_k`` and their
``_by_pos``) the change of the attention pattern is computed exactly through the softmax (the
patched key's scores with the base queries, or the patched query's scores with the base keys, from
a replay of the block), and only the step from the pattern onwards is linearised:
``sum_{dest,src} (pattern' - pattern) * dM/dpattern``. Exact when everything after the pattern is
linear in it.

Cost: per group of equal-length rows one forward pass over the source rows without gradients and
one forward + one backward pass per metric over the base rows (both directions: two of each); the
QK fix adds one cached forward of both halves and one block replay per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from .. import metrics as M
from ..core.budget import chunk_rows, current_budget, run_chunked
from ..core.sites import hook
from ..errors import CircuitError
from ..model.info import HookedModel
from ..model.load import model_device
from ..patching.checks import require_sites
from ..patching.engine import cache_run
from ..patching.jobs import DIRECTIONS, site_index
from ..patching.request import PatchRequest, check_pairs, check_positions, check_request, length_groups
from ..patching.run import JobResult, PatchingRun
from ..patching.setters import SITES, Site
from .gradients import balanced_chunk, gradient_pass, hook_bytes, pass_bytes
from .qk import qk_fixed

__all__ = ["atp_row_bytes", "attribution_patch", "reduce_site"]


def reduce_site(site: Site, prod: torch.Tensor) -> torch.Tensor:
    """Sum an elementwise product ``delta * grad`` (the hook's layout, ``[g, ...]``) over each
    index of ``site``: returns ``[g, *axes]`` with the site's axes in order (``pos``, ``head``,
    ``neuron``; ``[g]`` for whole-layer sites)."""
    name, axes = site.name, site.axes
    if not axes:
        return prod.flatten(1).sum(1)
    if name.startswith(("resid", "attn_out", "mlp_out")):
        return prod.sum(-1)  # [g, pos]
    if name.startswith("head_pattern"):  # [g, head, dest, src]
        return prod.sum((2, 3)) if axes == ("head",) else prod.sum(3).transpose(1, 2)
    if name.startswith("head_"):  # [g, pos, head, d_head]
        return prod.sum((1, 3)) if axes == ("head",) else prod.sum(3)
    if name.startswith("neuron"):  # [g, pos, d_mlp]
        return prod.sum(1) if axes == ("neuron",) else prod
    raise AssertionError(f"no reduction for site {name}")


def _gather(site: Site, red: torch.Tensor, idf_rows, pos_map: torch.Tensor | None) -> torch.Tensor:
    """``[rows, g]``: for each index row (``idf_rows``, one layer) and prompt, its reduced value."""
    g = red.shape[0]
    i = torch.arange(g)[None, :]
    idx: list[torch.Tensor] = [i]
    for a in site.axes:
        col = torch.tensor(idf_rows[a].to_numpy(), dtype=torch.long)[:, None]
        if a == "pos" and pos_map is not None:
            col = pos_map[i.expand(len(col), g), col.expand(len(col), g)]
        idx.append(col.expand(len(col), g))
    return red.cpu()[tuple(idx)]


def attribution_patch(
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
    positions: Sequence[Sequence[int]] | None = None,
    qk_fix: bool = False,
) -> PatchingRun:
    """Attribution patching of every site of ``sites`` in every direction of ``modes``, per row.

    The arguments and the result are those of :func:`tracekit.patching.run_patching` (which gives
    the exact numbers): each :class:`JobResult` holds, instead of the patched run's score, its
    first-order estimate ``M(base) + (a_src - a_base) . dM/da`` (module docstring), in the
    metric's units.

    Args:
        modes: ``denoising`` and/or ``noising`` (ablations are not estimated here).
        qk_fix: AtP*'s QK fix for ``head_q``/``head_k`` sites (exact through the softmax).

    The other arguments are those of :func:`tracekit.patching.run_patching` (from prepared rows:
    ``attribution_patch(model, **paired_args(rows), sites=..., modes=..., metrics=...)``,
    :func:`tracekit.patching.request.paired_args`).

    Memory: the rows of one length run in chunks of as many rows as the memory budget allows
    (``run.memory_budget``, :func:`tracekit.core.budget.chunk_rows`; :func:`atp_row_bytes` is the
    estimate); each row's estimates are computed on their own, so the result does not depend on
    the chunks (tested).

    Returns:
        :class:`tracekit.patching.PatchingRun` of estimates.

    Raises:
        MemoryBudgetError: one row needs more than the memory budget (before any forward pass).
        PatchingError: as :func:`tracekit.patching.run_patching`.
        CircuitError: an ablation mode.
        MethodRefused: ``qk_fix`` on a model whose ``hook_attn_scores`` is not the softmax's input.
    """
    bad = [m for m in modes if m not in DIRECTIONS]
    if bad:
        raise CircuitError(f"modes: attribution patching estimates the directions {list(DIRECTIONS)}; {bad} are "
                            "ablations (use activation_patching for them)")
    clean_ids, corrupted_ids = check_pairs(clean_ids, corrupted_ids)
    req = check_request(model, len(clean_ids), sites, modes, metrics, target_ids, foil_ids,
                         layers, neuron_layers, neurons)
    req.positions = check_positions(positions, clean_ids)
    require_sites(model, req.sites, req.layers, req.neuron_layers, neurons)
    dev = model_device(model)
    n, lengths = len(clean_ids), [len(c) for c in clean_ids]
    clean_vals = torch.full((n, len(req.metric_names)), float("nan"))
    corr_vals = torch.full((n, len(req.metric_names)), float("nan"))
    out_jobs: list[JobResult] = []
    hooks = sorted({SITES[s].hook_name(L) for s in req.sites for L in req.site_layers(s)})
    groups = length_groups(lengths)
    # every group's row chunk first: a row that does not fit refuses before any pass runs
    budget = current_budget(dev).bytes  # resolved once for every group
    plan = [balanced_chunk(chunk_rows(atp_row_bytes(model, req, hooks, n_pos, qk_fix), len(members),
                                      what="attribution patching", device=dev, unit="row", budget=budget,
                                      fix="shorten the prompts, or ask fewer sites or metrics"), len(members))
            for n_pos, members in groups]
    for (n_pos, members), rows_chunk in zip(groups, plan):
        midx = torch.tensor(members)
        full: list = []

        def do(sl: slice, members=members, n_pos=n_pos, full=full) -> None:
            sub = torch.tensor(members[sl])
            clean = torch.tensor([clean_ids[i] for i in members[sl]], device=dev)
            corr = torch.tensor([corrupted_ids[i] for i in members[sl]], device=dev)
            base_vals, jobs = _group(model, req, clean, corr, sub, n_pos, hooks, qk_fix, dev)
            clean_vals[sub], corr_vals[sub] = base_vals
            if not full:  # the group's tables [index rows, rows, metrics], filled chunk by chunk
                full += [(mode, site, idf, torch.empty(len(idf), len(members), vals.shape[-1]))
                         for mode, site, idf, vals in jobs]
            for (_, _, idf, dst), (_, _, _, vals) in zip(full, jobs):
                dst[:, sl] = vals.reshape(len(idf), len(sub), -1)

        run_chunked(do, len(members), rows_chunk, what="attribution patching")
        out_jobs += [JobResult(mode, site, idf, list(members), n_pos, vals.reshape(len(idf) * len(members), -1),
                               None, None,
                               None if req.positions is None or "pos" not in site.axes
                               else req.positions[midx].tolist())
                     for mode, site, idf, vals in full]
    return PatchingRun(req.metric_names, clean_vals, corr_vals, out_jobs, lengths, 0)


def atp_row_bytes(model: HookedModel, req: PatchRequest, hooks: Sequence[str], n_pos: int, qk_fix: bool) -> int:
    """Bytes one row of ``n_pos`` tokens needs in :func:`attribution_patch`: one gradient pass at a
    time (:func:`tracekit.circuits.gradients.pass_bytes`; the clean run's graph is freed by its
    backward pass before the corrupted run starts), both runs' recorded activations and one
    gradient per metric at every hook (:func:`tracekit.circuits.gradients.hook_bytes`; the QK fix's
    pattern, score, q and k hooks included), three float32 copies of the largest hook for the
    ``(a_src - a_base) * grad`` product, the clean run's log-probabilities, the estimates
    (``[index rows, metrics]``, at most one per hook element) and, with the QK fix, a cached run of
    both halves (block inputs) and a block replay's cross scores in float64."""
    names = list(hooks) + _qk_hooks(req, qk_fix)
    per_hook = [hook_bytes(model, h, n_pos) for h in names]
    n_m = len(req.metric_names)
    e = max(1, hook_bytes(model, "x", 1) // int(model.cfg.d_model))
    biggest = max(per_hook, default=0) * 4 // e
    estimates = sum(per_hook) * 4 // e * len(req.modes) * n_m
    need = pass_bytes(model, n_pos) + 2 * (1 + n_m) * sum(per_hook) + 3 * biggest
    need += 4 * int(model.cfg.d_vocab) + estimates
    if _qk_hooks(req, qk_fix):
        need += 2 * (int(model.cfg.n_layers) + 1) * hook_bytes(model, "resid", n_pos) * 2
        need += 2 * 8 * int(model.cfg.n_heads) * int(n_pos) ** 2 + pass_bytes(model, n_pos, backward=False)
    return need


def _group(model: HookedModel, req: PatchRequest, clean: torch.Tensor, corr: torch.Tensor, midx: torch.Tensor,
           n_pos: int, hooks: list[str], qk_fix: bool, dev: torch.device
           ) -> tuple[tuple[torch.Tensor, torch.Tensor], list[tuple[str, Site, pd.DataFrame, torch.Tensor]]]:
    """One group of equal-length rows: ``((clean [g, M], corrupted [g, M]), [(mode, site, idf, values)])``.

    The clean rows run first (with gradients when ``noising`` is asked), then the corrupted rows
    (with gradients when ``denoising`` is); the ``kl`` reference is the clean run's distribution."""
    g = clean.shape[0]
    holder = M.MetricInputs(req.target[midx].to(dev), None if req.foil is None else req.foil[midx].to(dev))
    fns = [_metric_fn(name, holder) for name in req.metric_names]
    extra = _qk_hooks(req, qk_fix)
    p_clean = gradient_pass(model, clean, hooks + extra, fns if "noising" in req.modes else ())
    if holder.clean_log_probs is None:
        holder.clean_log_probs = torch.log_softmax(p_clean.logits, -1)
    p_corr = gradient_pass(model, corr, hooks + extra, fns if "denoising" in req.modes else ())
    clean_scores = M.compute_metrics(req.metric_names, p_clean.logits, holder).float().cpu()
    corr_scores = M.compute_metrics(req.metric_names, p_corr.logits, holder).float().cpu()
    pos_map = None if req.positions is None else req.positions[midx]
    runs = cache_run(model, torch.cat([corr, clean]), []) if extra else None
    out = []
    for mode in req.modes:
        bp, sp = (p_corr, p_clean) if mode == "denoising" else (p_clean, p_corr)
        base_scores = corr_scores if mode == "denoising" else clean_scores
        for s in req.sites:
            site = SITES[s]
            n_idx = n_pos if pos_map is None or "pos" not in site.axes else int(pos_map.shape[1])
            idf = site_index(model, site, n_idx, req.site_layers(s), neurons=req.neurons)
            vals = torch.empty(len(idf), g, len(req.metric_names))
            for L in idf["layer"].unique().tolist():
                sel = torch.tensor((idf["layer"] == L).to_numpy())
                for k in range(len(req.metric_names)):
                    if runs is not None and s.startswith(("head_q", "head_k")):
                        red = qk_fixed(model, site, int(L), bp, sp, k, runs, mode == "denoising")
                    else:
                        h = site.hook_name(int(L))
                        red = reduce_site(site, (sp.acts[h].float() - bp.acts[h].float()) * bp.grads[k][h].float())
                    vals[sel, :, k] = _gather(site, red, idf[sel.numpy()], pos_map) + base_scores[:, k][None]
            out.append((mode, site, idf, vals.reshape(len(idf) * g, -1)))
    return (clean_scores, corr_scores), out


def _metric_fn(name: str, holder: M.MetricInputs):
    """``logits -> [rows]`` of metric ``name``; the first call (the clean rows) sets the ``kl`` reference."""
    def fn(lg):
        if holder.clean_log_probs is None:
            holder.clean_log_probs = torch.log_softmax(lg.detach().float(), -1)
        return M.METRICS[name](lg, holder)
    return fn


def _needs_qk(req: PatchRequest) -> bool:
    return any(s.startswith(("head_q", "head_k")) for s in req.sites)


def _qk_hooks(req: PatchRequest, qk_fix: bool) -> list[str]:
    """The attention-pattern and score hooks the QK fix reads, at the layers of q/k sites."""
    if not qk_fix or not _needs_qk(req):
        return []
    return [hook(s, L) for L in req.layers for s in ("head_pattern", "head_scores", "head_q", "head_k")]
