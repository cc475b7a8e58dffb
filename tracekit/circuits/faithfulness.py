"""Circuits and their faithfulness: run the model with every edge outside a circuit ablated, and
the MIB measures over circuit sizes.

A **circuit** is a set of edges of the graph (:mod:`tracekit.circuits.graph`); a set of *nodes*
(heads, MLPs) is the circuit of every edge between them (``input`` and ``logits`` always included,
a key/value input belonging to the circuit when any query head of its group does). Running the
circuit (Hanna et al. 2024's ``evaluate_graph``; MIB): on the clean run, every downstream node
``v`` reads

    input_v = (live residual) - sum_{u -> v not in the circuit} (write_u(live) - write_u(ablated))

so an edge outside the circuit carries the *ablated* write and an edge inside carries the live one.
Ablations (``ablation``): ``corrupted`` (each row's corrupted run: the standard counterfactual),
``mean`` (the mean write over the clean prompts of the rows with the same token length, per
position; at least 2 such rows), ``resample`` (the writes of another row of the same token length,
drawn with ``seed`` so that no row gets its own; at least 2 such rows) or ``zero``. By construction the full circuit gives the clean run
and, with ``corrupted``, the empty circuit gives the corrupted run (both tested).

Faithfulness of a circuit ``C``: ``f(C) = (m(C) - m(empty)) / (m(full) - m(empty))`` with ``m`` the
mean over rows of the metric (a ratio of means). Over circuit sizes ``k`` (the top-``k`` edges of a
ranking), with ``x = k / n_edges`` from 0 to 1 (the MIB benchmark, Mueller et al. 2025): **CPR**
(circuit performance ratio) = the area under ``f``; **CMD** (circuit-model difference) = the area
under ``|1 - f|`` (trapezoids over the evaluated sizes, with ``x = 0`` and ``x = 1`` always
evaluated). Intervals: percentile bootstrap over rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from jaxtyping import Bool, Float

from .. import metrics as M
from ..core.budget import bytes_of
from ..core.sites import hook
from ..errors import CircuitError
from ..hooks import enabled_hooks
from ..model.info import HookedModel
from ..model.load import model_device
from ..patching.engine import (
    CachedRun,
    cache_run,
    check_replay_fits,
    replay_chunk,
    replay_row_bytes,
    run_chunked,
    tensor_bytes,
)
from ..patching.request import check_pairs, length_groups
from .graph import Graph, build_graph, check_separable, head_writes, receiver_hooks, upstream_hooks
from .paths import replay
from .writes import check_writes, stack_writes

__all__ = ["ABLATIONS", "CircuitRun", "circuit_bytes", "circuit_from_edges", "circuit_from_nodes", "evaluate_circuits",
           "faithfulness_measures", "top_k_circuits"]

#: How edges outside a circuit are ablated.
ABLATIONS = ("corrupted", "mean", "zero", "resample")


@dataclass
class CircuitRun:
    """What :func:`evaluate_circuits` returns: ``values [circuits, rows, n_metrics]``, the clean and
    corrupted runs ``[rows, n_metrics]``, the metric names, the ablation and per length group the
    circuits per replay batch used (``batch_sizes``: ``run.memory_budget`` and ``max_bytes``, after
    any out-of-memory halving)."""

    values: Float[torch.Tensor, "circuits rows n_metrics"]
    clean: Float[torch.Tensor, "rows n_metrics"]
    corrupted: Float[torch.Tensor, "rows n_metrics"]
    metrics: list[str]
    ablation: str
    batch_sizes: list[int] = field(default_factory=list)


def circuit_from_edges(graph: Graph, edges: Sequence[str], field: str = "edges") -> torch.Tensor:
    """``[n_down, n_up]`` bool circuit of the named edges (``u->v``).

    Raises:
        CircuitError: a name that is not an edge (:meth:`Graph.parse_edge`); an edge listed twice
            (naming both entries: a circuit's size counts each edge once).
    """
    c = torch.zeros_like(graph.mask)
    first: dict[tuple[int, int], int] = {}
    for i, e in enumerate(edges):
        v, u = graph.parse_edge(e, f"{field}[{i}]")
        if (v, u) in first:
            raise CircuitError(f"{field}[{i}]: {e!r} is listed twice (also {field}[{first[(v, u)]}]); list each "
                                "edge once")
        first[(v, u)] = i
        c[v, u] = True
    return c


def _down_owner(graph: Graph, v: str) -> list[str]:
    """The upstream names a downstream node belongs to (a k/v input: every query head of its group)."""
    if v == "logits":
        return ["logits"]
    if v.startswith("m"):
        return [v]
    layer, rest = v[1:].split(".h")
    h, which = int(rest.split("<")[0]), rest[-2]
    if which == "q":
        return [f"a{layer}.h{h}"]
    per = max(1, graph.n_heads // graph.n_kv_heads)
    return [f"a{layer}.h{q}" for q in range(h * per, (h + 1) * per)]


def circuit_from_nodes(graph: Graph, nodes: Sequence[str], field: str = "nodes") -> torch.Tensor:
    """``[n_down, n_up]`` bool circuit of every edge between the named nodes (``a{L}.h{H}``,
    ``m{L}``; ``input`` and ``logits`` are always in).

    Raises:
        CircuitError: a name that is not a head or an MLP of the model; a node listed twice.
    """
    keep = {"input", "logits"}
    for i, n in enumerate(nodes):
        if n not in graph.up_index or n == "input":
            raise CircuitError(f"{field}[{i}]: {n!r} is not a node; use 'a{{L}}.h{{H}}' (a head) or 'm{{L}}' (an MLP)")
        if n in keep:
            raise CircuitError(f"{field}[{i}]: {n!r} is listed twice (also {field}[{list(nodes).index(n)}]); list "
                                "each node once")
        keep.add(n)
    up = torch.tensor([u in keep for u in graph.upstream])
    down = torch.tensor([any(o in keep for o in _down_owner(graph, v)) for v in graph.downstream])
    return graph.mask & down[:, None] & up[None, :]


def top_k_circuits(graph: Graph, scores: Float[torch.Tensor, "n_down n_up"], sizes: Sequence[int],
                   rank_by: str = "abs") -> torch.Tensor:
    """``[len(sizes), n_down, n_up]`` circuits of the top-``k`` edges of ``scores`` (``abs``:
    largest |score|; ``signed``: largest score), ties broken by graph order."""
    flat = torch.where(graph.mask, scores.abs() if rank_by == "abs" else scores, float("-inf")).flatten()
    order = torch.argsort(flat, descending=True, stable=True)
    out = torch.zeros(len(sizes), *graph.mask.shape, dtype=torch.bool)
    for i, k in enumerate(sizes):
        sel = torch.zeros(flat.numel(), dtype=torch.bool)
        sel[order[:int(k)]] = True
        out[i] = sel.reshape(graph.mask.shape) & graph.mask
    return out


@torch.no_grad()
def evaluate_circuits(model: HookedModel, clean_ids: Sequence[Sequence[int]], corrupted_ids: Sequence[Sequence[int]],
                      circuits: Bool[torch.Tensor, "circuits n_down n_up"], target_ids: Sequence[int],
                      foil_ids: Sequence[int] | None = None, *, metrics: Sequence[str] = ("logit_diff",),
                      ablation: str = "corrupted", seed: int = 0, max_bytes: float = 1.5e9) -> CircuitRun:
    """Run each circuit on every row with every edge outside it ablated (module docstring).

    Args:
        model: a hooked model (TransformerBridge).
        clean_ids: per row the clean prompt's token ids (equal lengths per row)
        corrupted_ids: per row the corrupted prompt's token ids (the same lengths).
        circuits: ``[C, n_down, n_up]`` bool (edges outside the graph's mask are ignored).
        target_ids: per row one target token id.
        foil_ids: per row one foil token id (or None where the metric needs none).
        metrics: metric names.
        ablation: ``corrupted``, ``mean``, ``resample`` or ``zero``.
        seed: the ``resample`` draw's seed.
        max_bytes: memory for the per-row write differences of one replay batch (a cap: circuits
            are evaluated in chunks that fit it and ``run.memory_budget``, :func:`circuit_bytes`;
            out-of-memory halves the chunk).

    From prepared rows: ``evaluate_circuits(model, **single_target_args(rows, "circuit evaluation"), circuits=...)``
    (:func:`tracekit.patching.request.single_target_args`).

    Returns:
        :class:`CircuitRun`.

    Raises:
        CircuitError: an unknown ablation, a ``mean``/``resample`` population under 2 rows.
        MethodRefused: writes that are not separable.
        MemoryBudgetError: a length group's cached run, writes and one circuit do not fit
            ``run.memory_budget`` (before that group's cached run is made).
    """
    if ablation not in ABLATIONS:
        raise CircuitError(f"ablation: {ablation!r}; use one of {list(ABLATIONS)}")
    check_separable(model, "circuit evaluation")
    graph = build_graph(model)
    clean_ids, corrupted_ids = check_pairs(clean_ids, corrupted_ids)
    dev = model_device(model)
    n, C = len(clean_ids), int(circuits.shape[0])
    values = torch.full((C, n, len(metrics)), float("nan"))
    clean_v, corr_v = torch.zeros(n, len(metrics)), torch.zeros(n, len(metrics))
    tgt = torch.tensor([[int(t)] for t in target_ids])
    foil = None if foil_ids is None else torch.tensor([[int(f)] for f in foil_ids])
    notin = (graph.mask[None] & ~circuits.bool()).float()  # [C, n_down, n_up]
    batch_sizes: list[int] = []
    with enabled_hooks(model, receiver_hooks(graph) + upstream_hooks(graph)):
        for n_pos, members in length_groups([len(c) for c in clean_ids]):
            midx, g = torch.tensor(members), len(members)
            if ablation in ("mean", "resample") and g < 2:
                raise CircuitError(f"ablation: {ablation} needs at least 2 rows of the same token length; the row(s) "
                                    f"{members} are the only ones of {n_pos} tokens (use corrupted or zero)")
            per_circuit, writes = circuit_bytes(model, graph, g, n_pos)
            check_replay_fits(model, 2 * g, n_pos, upstream_hooks(graph), what="circuit evaluation replay",
                              per_unit=per_circuit, extra=writes + tensor_bytes(notin), unit="circuit",
                              fix="give fewer or shorter rows")
            toks = torch.tensor([clean_ids[i] for i in members] + [corrupted_ids[i] for i in members], device=dev)
            run = cache_run(model, toks, upstream_hooks(graph))
            half = {k: v[:g] for k, v in run.acts.items()}, {k: v[g:] for k, v in run.acts.items()}
            check_writes(model, graph, half[0], half[1], "circuit evaluation")
            inputs = M.MetricInputs(tgt[midx].to(dev), None if foil is None else foil[midx].to(dev),
                                    torch.log_softmax(run.logits[:g], -1))
            clean_v[midx] = M.compute_metrics(list(metrics), run.logits[:g], inputs).float().cpu()
            corr_v[midx] = M.compute_metrics(list(metrics), run.logits[g:], inputs).float().cpu()
            w_clean = stack_writes(model, graph, half[0])
            if ablation == "corrupted":
                w_abl = stack_writes(model, graph, half[1])
            elif ablation == "mean":
                w_abl = w_clean.mean(0, keepdim=True).expand_as(w_clean)
            elif ablation == "resample":  # a seeded derangement: row i takes row perm[i] != i
                order = torch.randperm(g, generator=torch.Generator().manual_seed(seed + n_pos))
                perm = torch.empty(g, dtype=torch.long)
                perm[order] = order.roll(-1)  # each row takes the next row of a random cycle
                w_abl = w_clean[perm.to(w_clean.device)]
            else:
                w_abl = torch.zeros_like(w_clean)
            per = g * n_pos * len(graph.upstream) * int(model.cfg.d_model) * 4 * 2
            chunk = replay_chunk(model, per_circuit, C, what="circuit evaluation replay",
                                 fixed=tensor_bytes(run, w_clean, w_abl, notin), batch_size=max(1, int(max_bytes // per)),
                                 unit="circuit", fix="give fewer or shorter rows")

            def do(sl: slice, run=run, w_abl=w_abl, inputs=inputs, g=g, midx=midx):
                cs = list(range(C))[sl]
                logits = _run_chunk(model, graph, run, notin[cs].to(dev), w_abl.to(dev), g)
                rows = torch.arange(g).repeat(len(cs)).to(logits.device)
                vals = M.compute_metrics(list(metrics), logits, inputs.rows(rows)).float().cpu()
                values[sl.start:sl.stop][:, midx] = vals.reshape(len(cs), g, -1)

            batch_sizes.append(run_chunked(do, C, chunk, what="circuit evaluation replay"))
    return CircuitRun(values, clean_v, corr_v, list(metrics), ablation, batch_sizes)


def circuit_bytes(model: HookedModel, graph: Graph, g: int, seq_len: int) -> tuple[int, int]:
    """``(bytes of one circuit, bytes of the writes)`` of :func:`evaluate_circuits` on a group of
    ``g`` rows of ``seq_len`` tokens.

    One circuit is ``g`` replay rows, each: a replay row
    (:func:`tracekit.patching.engine.replay_row_bytes`), its write differences ``D`` ``[n_up,
    seq_len, d_model]``, the largest receiver correction and its permuted copy ``2 x [seq_len,
    n_heads, d_model]``, the ablated writes it reads ``[n_up, seq_len, d_model]`` and its circuit's
    ``[n_down, n_up]`` mask, all float32. The writes (fixed beside the cached run): the clean and the
    ablated upstream writes, ``2 x [g, seq_len, n_up, d_model]`` float32.
    """
    d, n_up, n_down = int(model.cfg.d_model), len(graph.upstream), len(graph.downstream)
    row = (replay_row_bytes(model, seq_len) + 2 * bytes_of(n_up, seq_len, d)
           + 2 * bytes_of(seq_len, max(1, graph.n_heads), d) + bytes_of(n_down, n_up))
    return g * row, 2 * bytes_of(g, seq_len, n_up, d)


def _run_chunk(model: HookedModel, graph: Graph, run: CachedRun, notin: torch.Tensor, w_abl: torch.Tensor, g: int) -> torch.Tensor:
    """Logits ``[c * g, d_vocab]`` of ``c`` circuits (``notin [c, n_down, n_up]``) on the clean rows.

    ``D [rows, n_up, pos, d_model]`` holds each upstream node's live write minus its ablated write,
    filled as the blocks run; a receiver in block ``L`` subtracts ``sum_u notin[v, u] D[u]`` over the
    nodes written before it (one batched matrix product per receiver kind)."""
    c = notin.shape[0]
    R = c * g
    pair = torch.arange(g).repeat(c).to(w_abl.device)
    circ = torch.arange(c).repeat_interleave(g).to(w_abl.device)
    abl = w_abl.permute(0, 2, 1, 3)  # [g, n_up, pos, d]
    U = abl.shape[1]
    D = torch.zeros(R, U, abl.shape[2], abl.shape[3], device=w_abl.device)
    D[:, 0] = run.resid[0][:g].float()[pair] - abl[pair, 0]
    H, Hkv = graph.n_heads, graph.n_kv_heads
    rows_notin = notin[circ]  # [R, n_down, n_up]

    def down_slice(L: int, kind: str) -> slice:
        base = L * (H + 2 * Hkv + 1)
        return {"q": slice(base, base + H), "k": slice(base + H, base + H + Hkv),
                "v": slice(base + H + Hkv, base + H + 2 * Hkv), "m": slice(base + H + 2 * Hkv, base + H + 2 * Hkv + 1),
                "logits": slice(len(graph.downstream) - 1, len(graph.downstream))}[kind]

    def correction(sl: slice, n_up: int) -> torch.Tensor:
        """``[R, pos, n_v, d]``: what the receivers ``sl`` lose, from the first ``n_up`` upstream nodes."""
        out = torch.einsum("rvu,rupd->rvpd", rows_notin[:, sl, :n_up], D[:, :n_up])
        return out.permute(0, 2, 1, 3)

    # the hooks read and write the first R rows of a batch: a single row runs with a copy appended
    # (CachedRun.run_block)
    def sub(module, inputs, output, sl, n_up, squeeze):
        conv = getattr(module, "hook_conversion", None)
        act = conv.convert(output) if conv is not None else output
        corr = correction(sl, n_up)
        corr = (corr[:, :, 0] if squeeze else corr).to(act.dtype)
        if act.shape[0] != R:
            act = torch.cat([act[:R] - corr, act[R:]])
        else:
            act = act - corr
        return conv.revert(act) if conv is not None else act

    def grab_z(module, inputs, output, L):
        conv = getattr(module, "hook_conversion", None)
        z = conv.convert(output) if conv is not None else output
        u0 = 1 + L * (H + 1)
        D[:, u0:u0 + H] = head_writes(model, L, z[:R]).permute(0, 2, 1, 3) - abl[pair, u0:u0 + H]
        return output

    def grab_mlp(module, inputs, output, L):
        conv = getattr(module, "hook_conversion", None)
        y = conv.convert(output) if conv is not None else output
        u = 1 + L * (H + 1) + H
        D[:, u] = y[:R].float() - abl[pair, u]
        return output

    def layer_hooks(L: int) -> list[tuple[str, Callable]]:
        before_attn, before_mlp = 1 + L * (H + 1), 1 + L * (H + 1) + (0 if graph.parallel else H)
        hs: list[tuple[str, Callable]] = [
            (hook(f"head_{w}_input", L),
             lambda m, i, o, sl=down_slice(L, w): sub(m, i, o, sl, before_attn, False)) for w in "qkv"]
        hs.append((hook("head_out", L), lambda m, i, o, L=L: grab_z(m, i, o, L)))
        hs.append((hook("mlp_in", L),
                   lambda m, i, o, sl=down_slice(L, "m"): sub(m, i, o, sl, before_mlp, True)))
        hs.append((hook("mlp_out", L), lambda m, i, o, L=L: grab_mlp(m, i, o, L)))
        return hs

    def final(x):
        return x - correction(down_slice(0, "logits"), U)[:, :, 0].to(x.dtype)

    base_rows = pair.to(run.resid[0].device)
    return replay(model, run, base_rows, 0, layer_hooks, final)


def faithfulness_measures(values: np.ndarray, full: np.ndarray, empty: np.ndarray, fractions: Sequence[float],
                          n_boot: int = 1000, seed: int = 0, ci: float = 0.95) -> dict:
    """Faithfulness per circuit size and the MIB areas, with bootstrap intervals over rows.

    Args:
        values: ``[sizes, rows]`` the metric of each circuit on each row.
        full: ``[rows]`` the full model's metric.
        empty: ``[rows]`` the empty circuit's (everything ablated) metric.
        fractions: per size ``k / n_edges`` (sorted increasing; 0 and 1 are added when missing).
        n_boot: bootstrap resamples of the rows (0: no intervals).
        seed: the bootstrap's seed.
        ci: the interval's mass.

    Returns:
        ``{"faithfulness": [sizes], "ci_low"/"ci_high": [sizes], "cpr", "cmd", "cpr_ci", "cmd_ci"}``
        (floats; intervals None without bootstrap).
    """
    x = np.asarray(fractions, dtype=float)
    vals = np.asarray(values, dtype=float)
    full, empty = np.asarray(full, float), np.asarray(empty, float)

    def measures(idx) -> tuple[np.ndarray, float, float]:
        m_full, m_empty = full[idx].mean(), empty[idx].mean()
        den = m_full - m_empty
        f = (vals[:, idx].mean(1) - m_empty) / den if abs(den) > 1e-9 else np.full(len(x), np.nan)
        xs, fs = x, f
        if xs[0] > 0:
            xs, fs = np.r_[0.0, xs], np.r_[0.0, fs]
        if xs[-1] < 1:
            xs, fs = np.r_[xs, 1.0], np.r_[fs, 1.0]
        return f, float(np.trapezoid(fs, xs)), float(np.trapezoid(np.abs(1 - fs), xs))

    rows = np.arange(vals.shape[1])
    f, cpr, cmd = measures(rows)
    out: dict = {"faithfulness": f.tolist(), "cpr": cpr, "cmd": cmd, "ci_low": None, "ci_high": None,
                 "cpr_ci": None, "cmd_ci": None}
    if n_boot and len(rows) > 1:
        rng = np.random.default_rng(seed)
        fb, cb, db = [], [], []
        for _ in range(n_boot):
            idx = rng.integers(0, len(rows), len(rows))
            a, b, c = measures(idx)
            fb.append(a)
            cb.append(b)
            db.append(c)
        lo, hi = (1 - ci) / 2 * 100, (1 + ci) / 2 * 100
        fb = np.asarray(fb)
        out["ci_low"] = np.nanpercentile(fb, lo, axis=0).tolist()
        out["ci_high"] = np.nanpercentile(fb, hi, axis=0).tolist()
        out["cpr_ci"] = [float(np.nanpercentile(cb, lo)), float(np.nanpercentile(cb, hi))]
        out["cmd_ci"] = [float(np.nanpercentile(db, lo)), float(np.nanpercentile(db, hi))]
    return out
