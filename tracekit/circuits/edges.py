"""Edge attribution patching (EAP; Syed et al. 2023) and EAP with integrated gradients (EAP-IG;
Hanna, Pezzelle & Belinkov 2024, "Have Faith in Faithfulness"; the MIB benchmark's circuit track).
Reference implementation: the ``eap`` package of Hanna et al. (``attribute.py``).

The score of an edge ``u -> v`` (graph in :mod:`tracekit.circuits.graph`) estimates the change of
the metric when only what ``u`` writes *into v's input* is patched from the source run:

    score(u -> v) = sum_{pos, d} (write_u^src - write_u^base) * g_v,

with ``g_v`` the gradient of the metric with respect to ``v``'s input (a head's q/k/v input before
the norm, the MLP input, the final residual). ``eap``: ``g_v`` at the base run. ``eap_ig``: ``g_v``
averaged over ``m = ig_steps`` runs whose embeddings lie on the straight line from the base run's
to the source run's, ``x_k = x_base + alpha_k (x_src - x_base)``; the runs interpolate the *inputs*
(EAP-IG-inputs). The points ``alpha_k`` are the rule ``ig_rule`` (:func:`ig_alphas`):

* ``left`` (default): ``alpha_k = k / m``, ``k = 0..m-1``: the ``eap`` package's EAP-IG-inputs
  (``get_scores_eap_ig``: ``corrupted + (k / steps) (clean - corrupted)`` for ``k in range(steps)``,
  summed and divided by ``steps``), so MIB's EAP-IG numbers reproduce; ``m = 1`` is EAP;
* ``right``: ``alpha_k = k / m``, ``k = 1..m`` (the package's EAP-IG-activations rule);
* ``midpoint``: ``alpha_k = (k - 1/2) / m``, ``k = 1..m`` (the smallest completeness error for a
  given ``m``: the quadrature error is O(1/m^2) instead of O(1/m)).

Signs as in :mod:`tracekit.circuits` (denoising: base = corrupted run): the score multiplies
``write^src - write^base`` (denoising: clean - corrupted). The ``eap`` package accumulates
``(corrupted - clean) . grad``: for the same metric its score is the negative of this one (it is
equal where the metric is passed to the package as a loss, i.e. negated).

Identity (exact, any model): the scores of all edges out of ``u`` add up to the node-level AtP of
``u``'s write, because ``u`` reaches the metric only through the inputs of later nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from .. import metrics as M
from ..core.budget import chunk_rows, current_budget, run_chunked
from ..errors import CircuitError
from ..model.info import HookedModel
from ..model.load import model_device
from ..patching.request import check_pairs, length_groups
from .gradients import LEAF_HOOK, GradPass, balanced_chunk, gradient_pass, hook_bytes, pass_bytes
from .graph import Graph, build_graph, check_separable, downstream_hooks, upstream_hooks
from .writes import check_writes, stack_reads, stack_writes

__all__ = ["EdgeScores", "edge_attribution", "edge_row_bytes", "ig_alphas", "METHODS", "IG_RULES", "SIGN_CONVENTION"]

#: Edge methods.
METHODS = ("eap", "eap_ig")

#: Quadrature rules of EAP-IG's interpolation points (:func:`ig_alphas`); ``left`` is the ``eap`` package's.
IG_RULES = ("left", "right", "midpoint")

#: The sign of an edge score, as recorded in results.
SIGN_CONVENTION = ("score = sum over positions and d_model of (write_u[source] - write_u[base]) * dM/d(input_v); "
                   "denoising: source = clean, base = corrupted. The eap package accumulates "
                   "(corrupted - clean) * grad: its score is the negative of this one for the same metric "
                   "(equal when the package is given the negated metric as a loss)")


def ig_alphas(steps: int, rule: str = "left") -> list[float]:
    """The interpolation points ``alpha_k`` of EAP-IG (0 = the base run's embeddings, 1 = the source run's).

    Args:
        steps: ``m``, the number of points (>= 1).
        rule: ``left`` (``k / m``, ``k = 0..m-1``: the ``eap`` package's ``get_scores_eap_ig``, Hanna
            et al. 2024, which MIB's EAP-IG baseline runs), ``right`` (``k / m``, ``k = 1..m``: the
            package's ``get_scores_ig_activations``) or ``midpoint`` (``(k - 1/2) / m``, ``k = 1..m``).

    Returns:
        ``m`` floats in ``[0, 1]``; the gradient is averaged over them (each weighs ``1 / m``).

    Raises:
        CircuitError: an unknown rule or ``steps < 1``.
    """
    if rule not in IG_RULES:
        raise CircuitError(f"ig_rule: {rule!r} is not a rule; use one of {list(IG_RULES)} (left = the eap package's)")
    if steps < 1:
        raise CircuitError(f"ig_steps: {steps}; use 1 or more")
    if rule == "left":
        return [k / steps for k in range(steps)]
    if rule == "right":
        return [k / steps for k in range(1, steps + 1)]
    return [(k + 0.5) / steps for k in range(steps)]


@dataclass
class EdgeScores:
    """Per-row edge scores of :func:`edge_attribution`.

    Attributes:
        graph: the :class:`Graph`.
        scores: ``[rows, n_down, n_up]`` (metric units; 0 where there is no edge).
        clean, corrupted: ``[rows]`` the metric on the clean and corrupted runs.
        method, mode, metric, ig_steps: how they were computed.
        ig_rule: the interpolation rule of ``eap_ig`` (:func:`ig_alphas`; None for ``eap``).
        chunks: the chunk sizes the memory budget chose: ``rows`` (per length group, rows per
            chunk) and, for ``eap_ig``, ``ig_steps`` (per row chunk, interpolation steps per
            backward pass).
    """

    graph: Graph
    scores: Float[torch.Tensor, "rows n_down n_up"]
    clean: Float[torch.Tensor, " rows"]
    corrupted: Float[torch.Tensor, " rows"]
    method: str
    mode: str
    metric: str
    ig_steps: int
    ig_rule: str | None = None
    chunks: dict = field(default_factory=dict)

    def mean(self) -> Float[torch.Tensor, "n_down n_up"]:
        return self.scores.mean(0)

    def frame(self) -> pd.DataFrame:
        """One line per edge: ``edge``, ``upstream``, ``downstream``, ``score`` (mean over rows,
        metric units), ``normalized`` (``score / (mean clean - mean corrupted)``, signed so that a
        denoising edge restoring the full gap scores 1), ``abs_rank`` (1 = largest |score|)."""
        mask = self.graph.mask
        v, u = mask.nonzero(as_tuple=True)
        mean = self.mean()[v, u].numpy()
        gap = float(self.clean.mean() - self.corrupted.mean())
        norm = mean / gap if abs(gap) > 1e-6 else np.full_like(mean, np.nan)
        if self.mode == "noising":
            norm = -norm
        df = pd.DataFrame({"upstream": [self.graph.upstream[i] for i in u.tolist()],
                           "downstream": [self.graph.downstream[i] for i in v.tolist()],
                           "score": mean, "normalized": norm})
        df.insert(0, "edge", df["upstream"] + "->" + df["downstream"])
        df["abs_rank"] = df["score"].abs().rank(ascending=False, method="first").astype(int)
        return df.sort_values("abs_rank").reset_index(drop=True)


def edge_attribution(model: HookedModel, clean_ids: Sequence[Sequence[int]], corrupted_ids: Sequence[Sequence[int]],
                     target_ids: Sequence[int], foil_ids: Sequence[int] | None = None, *,
                     metric: str = "logit_diff", mode: str = "denoising", method: str = "eap",
                     ig_steps: int = 5, ig_rule: str = "left", max_rows: int = 64) -> EdgeScores:
    """EAP / EAP-IG scores of every edge of the model's graph, per row.

    Args:
        model: a hooked model (TransformerBridge).
        clean_ids: per row the clean prompt's token ids (equal lengths per row; rows of different
            lengths run as separate groups).
        corrupted_ids: per row the corrupted prompt's token ids (the same lengths).
        target_ids: per row one target token id.
        foil_ids: per row one foil token id (or None where the metric needs none).
        metric: ``logit_diff``, ``prob``, ``log_prob`` or ``kl`` (:mod:`tracekit.metrics`).
        mode: ``denoising`` or ``noising`` (module docstring).
        method: ``eap`` or ``eap_ig``.
        ig_steps: interpolation steps of ``eap_ig`` (with ``ig_rule: left``, 1 = EAP).
        ig_rule: ``left`` (default, the ``eap`` package's), ``right`` or ``midpoint`` (:func:`ig_alphas`).
        max_rows: rows x steps per backward pass of ``eap_ig`` (at most; the memory budget may
            allow fewer).

    Memory: rows of one length are processed in chunks, and ``eap_ig``'s interpolation steps in
    passes of several steps, as many as the memory budget (``run.memory_budget``,
    :func:`tracekit.core.budget.chunk_rows`; :func:`edge_row_bytes` is the estimate) allows;
    every row's scores are computed on their own and the steps are summed in the same blocks
    (``max_rows // rows of the group`` steps) whatever the passes, so the result does not depend
    on the chunks (tested). ``EdgeScores.chunks`` records the sizes chosen.

    From prepared rows: ``edge_attribution(model, **single_target_args(rows, "edge attribution"), ...)``
    (:func:`tracekit.patching.request.single_target_args`).

    Returns:
        :class:`EdgeScores`.

    Raises:
        CircuitError: an unknown method, mode, metric or ``ig_rule``.
        MethodRefused: a model whose writes are not separable (post-norms, residual multipliers,
            heads that do not add up to the attention output).
        PatchingError: rows of unequal clean/corrupted lengths.
        MemoryBudgetError: one row (one interpolation step) needs more than the memory budget;
            raised before any forward pass.
    """
    if method not in METHODS:
        raise CircuitError(f"method: {method!r} is not an edge method; use one of {list(METHODS)}")
    if mode not in ("denoising", "noising"):
        raise CircuitError(f"mode: {mode!r}; use denoising or noising")
    if metric not in M.METRICS:
        raise CircuitError(f"metric: unknown metric {metric!r}; use one of {sorted(M.METRICS)}")
    alphas = ig_alphas(ig_steps, ig_rule) if method == "eap_ig" else []
    check_separable(model, method)
    clean_ids, corrupted_ids = check_pairs(clean_ids, corrupted_ids)
    graph = build_graph(model)
    dev = model_device(model)
    n = len(clean_ids)
    scores = torch.zeros(n, len(graph.downstream), len(graph.upstream))
    clean_v, corr_v = torch.zeros(n), torch.zeros(n)
    tgt = torch.tensor([[int(t)] for t in target_ids])
    foil = None if foil_ids is None else torch.tensor([[int(f)] for f in foil_ids])
    groups = length_groups([len(c) for c in clean_ids])
    # the budget resolved once (an ``auto`` budget measured later would count this run's own tensors
    # against it), then every group's row chunk: a row that does not fit refuses before any pass runs
    budget = current_budget(dev).bytes
    plan = [_plan(model, graph, n_pos, len(members), method, len(alphas), max_rows, dev, budget)
            for n_pos, members in groups]
    chunks: dict = {"rows": [], "ig_steps": []}
    for (_, members), (rows_chunk, held, per_pass, block) in zip(groups, plan):
        midx = torch.tensor(members)
        inputs = M.MetricInputs(tgt[midx].to(dev), None if foil is None else foil[midx].to(dev))

        def do(sl: slice, members=members, inputs=inputs, held=held, per_pass=per_pass, block=block) -> None:
            idx = torch.tensor(members[sl])
            clean = torch.tensor([clean_ids[i] for i in members[sl]], device=dev)
            corr = torch.tensor([corrupted_ids[i] for i in members[sl]], device=dev)
            sub = inputs.rows(torch.arange(sl.start, sl.stop, device=inputs.target.device))
            s, c, x, steps = _group_scores(model, graph, clean, corr, sub, metric, mode, method, alphas, block,
                                           held, per_pass, budget)
            scores[idx], clean_v[idx], corr_v[idx] = s, c, x
            chunks["ig_steps"].append(steps)

        done = run_chunked(do, len(members), rows_chunk, what=f"edge attribution ({method})")
        chunks["rows"].append(done)
    ig = method == "eap_ig"
    if not ig:
        del chunks["ig_steps"]
    return EdgeScores(graph, scores, clean_v, corr_v, method, mode, metric, ig_steps if ig else 0,
                      ig_rule if ig else None, chunks)


def edge_row_bytes(model: HookedModel, graph: Graph, n_pos: int) -> tuple[int, int]:
    """``(held, per_pass)``: bytes one row of ``n_pos`` tokens holds throughout :func:`edge_attribution`
    and bytes one row needs in one gradient pass (per interpolation step for ``eap_ig``).

    ``held`` counts both runs' recorded upstream activations, the float32 ``[pos, n_up, d_model]``
    write difference with the two stacks it is made of and the einsum's copy, four float32
    ``[pos, n_down, d_model]`` tensors (the stacked reads, the IG sum, one step's reads, the
    einsum's copy) and the ``[n_down, n_up]`` scores twice. ``per_pass``:
    :func:`tracekit.circuits.gradients.pass_bytes` with a backward pass, plus the activations and
    gradients recorded at the downstream hooks."""
    up = sum(hook_bytes(model, h, n_pos) for h in upstream_hooks(graph))
    down = sum(hook_bytes(model, h, n_pos) for h in downstream_hooks(graph))
    f32 = 4 * int(n_pos) * int(model.cfg.d_model)
    n_up, n_down = len(graph.upstream), len(graph.downstream)
    held = 2 * up + 4 * f32 * n_up + 4 * f32 * n_down + 2 * 4 * n_up * n_down
    return held, pass_bytes(model, n_pos) + 2 * down


def _plan(model: HookedModel, graph: Graph, n_pos: int, g: int, method: str, steps: int, max_rows: int,
          dev: torch.device, budget: int | None = None) -> tuple[int, int, int, int]:
    """``(rows per chunk, held bytes per row, bytes per row and step, IG steps summed together)`` of
    one length group of ``g`` rows. The block of steps is ``max_rows // g`` (the steps one backward
    pass took before the budget), whatever the chunks, so the sum over steps is the same; each row
    holds the block's stacked reads.

    Raises:
        MemoryBudgetError: one row (with one interpolation step) does not fit the budget."""
    held, per_pass = edge_row_bytes(model, graph, n_pos)
    block = max(1, min(steps, max_rows // g)) if steps else 0
    if block > 1:
        held += (block - 1) * 4 * int(n_pos) * int(model.cfg.d_model) * len(graph.downstream)
    fix = "shorten the prompts" + (", or lower max_rows" if block > 1 else "")
    rows = chunk_rows(held + per_pass, g, what=f"edge attribution ({method})", device=dev, unit="row", fix=fix,
                      budget=budget)
    return balanced_chunk(rows, g), held, per_pass, block


def _group_scores(model: HookedModel, graph: Graph, clean: torch.Tensor, corr: torch.Tensor,
                  inputs: M.MetricInputs, metric: str, mode: str, method: str, alphas: list[float], block: int,
                  held: int, per_pass: int, budget: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Scores ``[g, n_down, n_up]``, clean and corrupted metrics ``[g]`` of rows of equal length,
    and the interpolation steps per backward pass (0 for ``eap``); ``block``: steps summed together
    (:func:`_ig_grads`)."""
    up = upstream_hooks(graph)
    pc = gradient_pass(model, clean, up)
    inputs.clean_log_probs = torch.log_softmax(pc.logits, -1)
    px = gradient_pass(model, corr, up)
    check_writes(model, graph, pc.acts, px.acts, method)
    base, src = (corr, clean) if mode == "denoising" else (clean, corr)
    pb: GradPass
    ps: GradPass
    pb, ps = (px, pc) if mode == "denoising" else (pc, px)
    d_write = stack_writes(model, graph, ps.acts) - stack_writes(model, graph, pb.acts)  # [g, pos, n_up, d]
    down = downstream_hooks(graph)
    if method == "eap":
        gp = gradient_pass(model, base, down, [lambda lg: M.METRICS[metric](lg, inputs)])
        grad = stack_reads(graph, gp.grads[0])
        per = 0
    else:
        g = base.shape[0]
        per = min(block, chunk_rows(g * per_pass, len(alphas), what=f"edge attribution ({method})",
                                    device=base.device, fixed=g * held, unit="interpolation step", budget=budget))
        grad = _ig_grads(model, graph, base, ps.acts[LEAF_HOOK], inputs, metric, alphas, block, per, down)
    sc = torch.einsum("gpud,gpvd->gvu", d_write, grad) * graph.mask[None].float()
    score = lambda lg: M.METRICS[metric](lg, inputs).float().cpu()  # noqa: E731
    return sc.cpu(), score(pc.logits), score(px.logits), per


def _ig_grads(model: HookedModel, graph: Graph, base: torch.Tensor, src_resid0: torch.Tensor, inputs: M.MetricInputs, metric: str, alphas: list[float],
              block: int, per: int, down: list[str]) -> torch.Tensor:
    """Downstream input gradients averaged over the runs interpolating block 0's input from the
    base run's (on ``base``'s tokens) to ``src_resid0`` at each of ``alphas`` (:func:`ig_alphas`).

    The steps are summed in blocks of ``block`` (``max_rows // rows of the length group``: one
    backward pass each when nothing is chunked) and the blocks' sums added in order; each block's
    steps run ``per`` at a time (the memory budget's choice, at most ``block``) and are stacked
    before the block is summed, so the sum is the same whatever ``per`` and the row chunks."""
    g = base.shape[0]
    steps = len(alphas)
    total = None
    for b0 in range(0, steps, block):
        b1 = min(steps, b0 + block)
        parts = []
        for s0 in range(b0, b1, per):
            ks = list(range(s0, min(b1, s0 + per)))
            a = torch.tensor([alphas[k] for k in ks], device=src_resid0.device).repeat_interleave(g)
            toks = base.repeat(len(ks), 1)
            src = src_resid0.repeat(len(ks), 1, 1)
            rows = inputs.rows(torch.arange(g).repeat(len(ks)))

            def leaf(x, a=a, src=src):
                return x + a[:, None, None].to(x.dtype) * (src.to(x.dtype) - x)

            gp = gradient_pass(model, toks, down, [lambda lg, rows=rows: M.METRICS[metric](lg, rows)], leaf_fn=leaf)
            r = stack_reads(graph, gp.grads[0])
            parts.append(r.reshape(len(ks), g, *r.shape[1:]))
            del gp
        r = (parts[0] if len(parts) == 1 else torch.cat(parts)).sum(0)
        total = r if total is None else total + r
    assert total is not None
    return total / steps
