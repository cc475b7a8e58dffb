"""AtP*'s QK fix (Kramár et al. 2024, section 3.1.1): the effect of patching a query or key on
the attention pattern, computed exactly through the softmax.

Patching key ``s`` of a head changes only column ``s`` of its attention scores (to the score of
the base queries with the source key); patching query ``t`` changes only row ``t`` (the source query
with the base keys). Both sets of *cross* scores come from one replay of block ``L`` on the base
rows with every key (or query) replaced by the source run's (a score depends only on its own query
and key, so one replay serves every position and head). For one changed column the new pattern
row is a closed form of the old one::

    r = 1 - p_ts + p_ts * exp(c_ts - S_ts);  p'_ts = p_ts exp(c_ts - S_ts) / r;  p'_ts' = p_ts' / r

and the estimate is ``sum_t (p'_t - p_t) . dM/dp_t`` (only the step after the pattern is
linearised). Computed in float64 in the log domain.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from ..core.sites import hook
from ..errors import MethodRefused
from ..model.info import HookedModel
from ..patching.engine import CachedRun, patch_hook
from ..patching.setters import Site, layer_setter
from .gradients import GradPass

__all__ = ["cross_scores", "qk_fixed"]


class _Stop(Exception):
    """Raised by the score hook to end a block replay once the scores are read."""


def cross_scores(model: HookedModel, runs: CachedRun, layer: int, base_rows: torch.Tensor, which: str,
                 source: torch.Tensor) -> torch.Tensor:
    """``[g, head, dest, src]`` attention scores of block ``layer`` on the base rows with every
    ``which`` (``q`` or ``k``) activation replaced by ``source`` (``hook_{which}`` layout).

    Every hook is removed in a ``finally``."""
    store: dict = {}

    def grab(module, inputs, output):
        store["s"] = output.detach()
        raise _Stop

    hd = model.hook_dict
    handles = []
    rows = torch.arange(len(base_rows), device=source.device)
    try:
        handles.append(hd[hook(f"head_{which}", layer)].register_forward_hook(
            lambda m, i, o: patch_hook(m, i, o, layer_setter, rows, {}, source, rows)))
        handles.append(hd[hook("head_scores", layer)].register_forward_hook(grab))
        a, kw = runs.block_call(layer, base_rows.to(runs.resid[layer].device))
        try:
            cast(Any, model).blocks[layer](runs.resid[layer][base_rows].clone(), *a, **kw)
        except _Stop:
            pass
    finally:
        for h in handles:
            h.remove()
    if "s" not in store:
        raise MethodRefused(f"qk_fix: block {layer} did not call attn.hook_attn_scores; this architecture's "
                            "attention scores are not exposed, so the QK fix cannot be computed")
    return store["s"]


def qk_fixed(model: HookedModel, site: Site, layer: int, bp: GradPass, sp: GradPass, k: int, runs: CachedRun,
             base_is_first: bool) -> torch.Tensor:
    """The QK-fixed estimate of site ``head_q``/``head_k`` (``_by_pos``) at ``layer``, reduced to
    ``[g, *site.axes]`` (as :func:`tracekit.circuits.attribution.reduce_site`).

    Args:
        bp: the base run (with gradients of metric ``k``), recording ``hook_attn_scores``,
            ``hook_pattern``, ``hook_q`` and ``hook_k`` at ``layer``.
        sp: the source run, recording the same hooks.
        runs: a cached run of ``[corrupted; clean]`` rows (block inputs for the replay).
        base_is_first: the base rows are the first half of ``runs`` (denoising).

    Raises:
        MethodRefused: ``softmax(hook_attn_scores) != hook_pattern`` (scores transformed after the hook).
    """
    scores, pattern = hook("head_scores", layer), hook("head_pattern", layer)
    S = bp.acts[scores].double()
    P = bp.acts[pattern].double()
    G = bp.grads[k][pattern].double()
    if float((torch.softmax(S, -1) - P).abs().max()) > 1e-4:
        raise MethodRefused(f"qk_fix: block {layer}'s pattern is not softmax(hook_attn_scores) on this "
                            "architecture, so the pattern cannot be recomputed from the scores; run without qk_fix")
    g = S.shape[0]
    base_rows = torch.arange(g) if base_is_first else torch.arange(g) + g
    which = "k" if site.name.startswith("head_k") else "q"
    C = cross_scores(model, runs, layer, base_rows, which, sp.acts[hook(f"head_{which}", layer)]).double()
    by_pos = "pos" in site.axes
    if which == "q":
        new = torch.softmax(C, -1)  # row t = the source query t with the base keys
        delta = ((new - P) * G).sum(-1)  # [g, head, dest]
        return delta.transpose(1, 2).float() if by_pos else delta.sum(-1).float()
    n_heads, n_kv = S.shape[1], bp.acts[hook("head_k", layer)].shape[2]
    if by_pos:
        allowed = torch.isfinite(S) & torch.isfinite(C)
        d = torch.where(allowed, C - torch.where(allowed, S, 0.0), 0.0)
        logp = torch.log(P)
        lpa = logp + d
        lr = torch.logaddexp(torch.log1p(-P.clamp(max=1.0)), lpa)
        A = (P * G).sum(-1, keepdim=True)  # [g, head, dest, 1]
        delta = (A - P * G) * torch.exp(-lr) + torch.exp(lpa - lr) * G - A
        delta = torch.where(allowed, delta, 0.0).sum(2)  # [g, head, src]
    else:
        delta = ((torch.softmax(C, -1) - P) * G).sum((2, 3))  # [g, head]
    grouped = delta.reshape(g, n_kv, n_heads // n_kv, *delta.shape[2:]).sum(2)  # query heads -> their kv head
    return grouped.transpose(1, 2).float() if by_pos else grouped.float()
