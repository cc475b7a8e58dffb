"""Exact path patching (Wang et al. 2022, "Interpretability in the Wild", section 3.1;
Goldowsky-Dill et al. 2023, "Localizing Model Behavior with Path Patching").

A *sender* set (upstream nodes, :mod:`tracekit.circuits.graph`) is patched from the source run
*only along its direct paths into the receivers* (downstream nodes: heads' q/k/v inputs, MLP
inputs, the logits): every receiver's input gets ``sum_senders (write_src - write_base)`` added;
no other component sees the change, and what the receivers then compute flows on through the rest
of the model as usual. Where the receivers sit in more than one block, two rules differ in what a
later receiver's input is (``recipe``):

* ``wang`` (default; Wang et al. 2022's three runs): ``input_base + delta``, what it reads in a run
  with the senders patched and *every* other head and MLP frozen to the base run (receivers
  included); a later receiver does not see what earlier receivers' changed outputs write.
* ``live``: ``input_live + delta``, its live input in the patched run (which carries what earlier
  receivers' changed outputs wrote) plus the senders' difference. With every component downstream
  of the senders as a receiver this is activation patching of the senders.

With the receivers in one block (one edge, or a head's q/k/v inputs) both are the same, and with one
sender and one receiver it is the exact effect of one edge (what EAP estimates).

Engine: the batched replay of :mod:`tracekit.patching` -- one cached run of ``[corrupted; clean]``
per group of equal-length rows records each block's inputs and the senders' writes; each
(variant, row) is one row of a replay batch that starts at the first receiver's block (layer
skipping), with hooks adding each row's own difference at its receivers. Every hook is removed in a
``finally``; out-of-memory halves the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Float

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
    readout_last,
    replay_chunk,
    replay_row_bytes,
    run_chunked,
    tensor_bytes,
)
from ..patching.request import check_pairs, length_groups
from .graph import Graph, build_graph, check_separable, receiver_hooks, upstream_hooks
from .writes import check_writes, stack_writes

__all__ = ["PathRun", "RECIPES", "path_patch", "path_patch_bytes", "replay", "receiver_hook"]

#: Path-patching rules for receivers in several blocks (module docstring): ``wang`` (Wang et al.
#: 2022: later receivers read the frozen base input plus the senders' difference) and ``live``.
RECIPES = ("wang", "live")


@dataclass
class PathRun:
    """What :func:`path_patch` returns.

    Attributes:
        values: ``[variants, rows, n_metrics]`` the metrics of each path-patched run.
        clean, corrupted: ``[rows, n_metrics]`` the unpatched runs.
        metrics: metric names. senders / receivers: per variant the node names.
        recipe: the rule used for receivers in several blocks (``wang`` or ``live``).
        batch_sizes: per length group, the variants per replay batch used (``run.memory_budget``
            and ``batch_size``; after any out-of-memory halving).
    """

    values: Float[torch.Tensor, "variants rows n_metrics"]
    clean: Float[torch.Tensor, "rows n_metrics"]
    corrupted: Float[torch.Tensor, "rows n_metrics"]
    metrics: list[str]
    senders: list[list[str]]
    receivers: list[list[str]]
    recipe: str = "wang"
    batch_sizes: list[int] = field(default_factory=list)


def receiver_hook(graph: Graph, name: str) -> tuple[str, int | None, int]:
    """``(hook name, head index or None, block)`` of downstream node ``name`` (``logits``: the final
    residual, block ``n_layers``)."""
    if name == "logits":
        return "", None, graph.n_layers
    layer = int(name[1:].split(".")[0].split("<")[0])
    if name.startswith("m"):
        return hook("mlp_in", layer), None, layer
    head = int(name.split(".h")[1].split("<")[0])
    which = name[-2]
    return hook(f"head_{which}_input", layer), head, layer


def _add(module, inputs, output, rows: torch.Tensor, head: int | None, delta: torch.Tensor, sign: float = 1.0):
    conv = getattr(module, "hook_conversion", None)
    act = conv.convert(output) if conv is not None else output
    act = act.clone()
    d = (sign * delta).to(act.dtype)
    if head is None:
        act[rows] += d
    else:
        act[rows, :, head] += d
    return conv.revert(act) if conv is not None else act


def _set(module, inputs, output, rows: torch.Tensor, head: int | None, value: torch.Tensor):
    """Set the receiver's input of ``rows`` (``head``'s slice) to ``value`` (the ``wang`` rule)."""
    conv = getattr(module, "hook_conversion", None)
    act = conv.convert(output) if conv is not None else output
    act = act.clone()
    v = value.to(act.dtype)
    if head is None:
        act[rows] = v
    else:
        act[rows, :, head] = v
    return conv.revert(act) if conv is not None else act


def replay(model: HookedModel, run: CachedRun, base_rows: torch.Tensor, start: int,
           layer_hooks: Callable[[int], list[tuple[str, Callable]]],
           final: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Float[torch.Tensor, "rows d_vocab"]:
    """Run blocks ``start..n_layers-1`` on the cached inputs of ``base_rows`` with, in block ``L``,
    the forward hooks ``layer_hooks(L)`` (``(hook name, module hook)``); ``final`` edits the final
    residual. Returns float32 logits at the last position. Hooks are removed in a ``finally``."""
    n_layers = int(model.cfg.n_layers)
    x = run.resid[start][base_rows].clone()
    hd = model.hook_dict
    for L in range(start, n_layers):
        handles = []
        try:
            for name, fn in layer_hooks(L):
                handles.append(hd[name].register_forward_hook(fn))
            x = run.run_block(model, L, x, base_rows)
        finally:
            for h in handles:
                h.remove()
    if final is not None:
        x = final(x)
    return readout_last(model, x)


@torch.no_grad()
def path_patch(model: HookedModel, clean_ids: Sequence[Sequence[int]], corrupted_ids: Sequence[Sequence[int]],
               senders: Sequence[Sequence[str]], receivers: Sequence[Sequence[str]],
               target_ids: Sequence[int], foil_ids: Sequence[int] | None = None, *,
               metrics: Sequence[str] = ("logit_diff",), mode: str = "denoising",
               batch_size: int | str = "auto", recipe: str = "wang") -> PathRun:
    """Exact path patching: per variant ``j``, the senders ``senders[j]`` patched from the source
    run into the receivers ``receivers[j]`` only (module docstring), on every row.

    Args:
        model: a hooked model (TransformerBridge).
        clean_ids: per row the clean prompt's token ids (equal lengths per row)
        corrupted_ids: per row the corrupted prompt's token ids (the same lengths).
        senders: per variant upstream node names (``input``, ``a{L}.h{H}``, ``m{L}``).
        receivers: per variant downstream node names (``a{L}.h{H}<q|k|v>``, ``a{L}.h{H}`` = its
            q, k and v inputs, ``m{L}``, ``logits``).
        target_ids: per row one target token id.
        foil_ids: per row one foil token id (or None where the metric needs none).
        metrics: metric names (:mod:`tracekit.metrics`).
        mode: ``denoising`` (base = corrupted run, source = clean) or ``noising``.
        batch_size: (variant, row) runs per replay batch at most, or ``auto``: what
            ``run.memory_budget`` allows (:func:`path_patch_bytes`), at most 512 rows.
        recipe: ``wang`` (default: a receiver in a later block than the variant's first receivers
            reads ``input_base + delta``, its input with every non-sender frozen, as in Wang et al.
            2022's run 2, and ARENA's / TransformerLens-based path patching) or ``live``
            (``input_live + delta``: it sees what earlier receivers' changed outputs wrote).

    From prepared rows: ``path_patch(model, **single_target_args(rows, "path patching"), senders=..., receivers=...)``
    (:func:`tracekit.patching.request.single_target_args`).

    Returns:
        :class:`PathRun`.

    Raises:
        CircuitError: an unknown node, mode or recipe, a sender named twice in one variant, a receiver
            that reads before one of its senders writes.
        MethodRefused: a model whose writes are not separable.
        MemoryBudgetError: a length group's cached run, writes and one variant do not fit
            ``run.memory_budget`` (before that group's cached run is made).
    """
    if mode not in ("denoising", "noising"):
        raise CircuitError(f"mode: {mode!r}; use denoising or noising")
    if recipe not in RECIPES:
        raise CircuitError(f"recipe: {recipe!r}; use 'wang' (Wang et al. 2022's frozen receivers' inputs) or 'live'")
    if len(senders) != len(receivers) or not senders:
        raise CircuitError("path patching: give one receiver list per sender list (at least one variant)")
    check_separable(model, "path patching")
    graph = build_graph(model)
    send_idx, recv = _check_variants(graph, senders, receivers)
    late = _late_receivers(graph, recv) if recipe == "wang" else [[] for _ in recv]
    base_hooks = sorted({receiver_hook(graph, r)[0] for rs in late for r in rs if r != "logits"})
    clean_ids, corrupted_ids = check_pairs(clean_ids, corrupted_ids)
    dev = model_device(model)
    n, V = len(clean_ids), len(senders)
    values = torch.full((V, n, len(metrics)), float("nan"))
    clean_v, corr_v = torch.zeros(n, len(metrics)), torch.zeros(n, len(metrics))
    tgt = torch.tensor([[int(t)] for t in target_ids])
    foil = None if foil_ids is None else torch.tensor([[int(f)] for f in foil_ids])
    batch_sizes: list[int] = []
    cache_hooks = list(dict.fromkeys(upstream_hooks(graph) + base_hooks))
    with enabled_hooks(model, receiver_hooks(graph) + upstream_hooks(graph)):
        for n_pos, members in length_groups([len(c) for c in clean_ids]):
            midx = torch.tensor(members)
            g = len(members)
            per_variant, writes = path_patch_bytes(model, graph, g, n_pos, V)
            check_replay_fits(model, 2 * g, n_pos, cache_hooks, what="path patching replay", per_unit=per_variant,
                              extra=writes, fix="give fewer or shorter rows")
            toks = torch.tensor([corrupted_ids[i] for i in members] + [clean_ids[i] for i in members], device=dev)
            run = cache_run(model, toks, cache_hooks)
            half = {k: v[:g] for k, v in run.acts.items()}, {k: v[g:] for k, v in run.acts.items()}
            check_writes(model, graph, half[1], half[0], "path patching")
            inputs = M.MetricInputs(tgt[midx].to(dev), None if foil is None else foil[midx].to(dev),
                                    torch.log_softmax(run.logits[g:], -1))
            clean_v[midx] = M.compute_metrics(list(metrics), run.logits[g:], inputs).float().cpu()
            corr_v[midx] = M.compute_metrics(list(metrics), run.logits[:g], inputs).float().cpu()
            w_corr, w_clean = stack_writes(model, graph, half[0]), stack_writes(model, graph, half[1])
            base_off = 0 if mode == "denoising" else g
            d_write = (w_clean - w_corr) if mode == "denoising" else (w_corr - w_clean)  # [g, pos, n_up, d]
            deltas = torch.stack([d_write[:, :, s].sum(2) for s in send_idx])  # [V, g, pos, d]
            chunk = replay_chunk(model, per_variant, V, what="path patching replay",
                                 fixed=tensor_bytes(run, w_corr, w_clean, d_write, deltas), batch_size=batch_size,
                                 rows_per_unit=g, fix="give fewer or shorter rows")

            def do(sl: slice, deltas=deltas, run=run, inputs=inputs, base_off=base_off, g=g, midx=midx):
                vs = list(range(V))[sl]
                logits = _replay_variants(model, graph, run, vs, recv, deltas, base_off, g, late)
                rows = torch.arange(g).repeat(len(vs))
                vals = M.compute_metrics(list(metrics), logits, inputs.rows(rows.to(logits.device))).float().cpu()
                values[sl.start:sl.stop][:, midx] = vals.reshape(len(vs), g, -1)

            batch_sizes.append(run_chunked(do, V, chunk, what="path patching replay"))
    return PathRun(values, clean_v, corr_v, list(metrics), [list(s) for s in senders],
                   [[r for r in rs] for rs in recv], recipe, batch_sizes)


def path_patch_bytes(model: HookedModel, graph: Graph, g: int, seq_len: int, n_variants: int) -> tuple[int, int]:
    """``(bytes of one variant, bytes of the writes)`` of :func:`path_patch` on a group of ``g``
    rows of ``seq_len`` tokens with ``n_variants`` variants.

    One variant is ``g`` replay rows (:func:`tracekit.patching.engine.replay_row_bytes` each) plus
    per row four ``[seq_len, d_model]`` float32 copies of its difference (the hooks' selections and
    the frozen inputs). The writes (a fixed cost beside the cached run): the clean and corrupted
    upstream writes and their difference, ``3 x [g, seq_len, n_up, d_model]``, and the senders'
    summed differences ``[n_variants, g, seq_len, d_model]``, all float32.
    """
    d, n_up = int(model.cfg.d_model), len(graph.upstream)
    per = g * (replay_row_bytes(model, seq_len) + 4 * bytes_of(seq_len, d))
    return per, 3 * bytes_of(g, seq_len, n_up, d) + bytes_of(n_variants, g, seq_len, d)


def _check_variants(graph: Graph, senders: Sequence[Sequence[str]], receivers: Sequence[Sequence[str]]) -> tuple[list[list[int]], list[list[str]]]:
    """Per variant the senders' upstream indices and the receivers' downstream names (expanded)."""
    send_idx, recv = [], []
    for j, (ss, rs) in enumerate(zip(senders, receivers)):
        if not ss or not rs:
            raise CircuitError(f"path patching variant {j}: give at least one sender and one receiver")
        idx = []
        for s in ss:
            if list(ss).count(s) > 1:
                raise CircuitError(f"senders (variant {j}): {s!r} is listed twice; each sender's difference would "
                                    "be added once per listing (name each sender once)")
            if s not in graph.up_index:
                raise CircuitError(f"senders: {s!r} is not an upstream node; use 'input', 'a{{L}}.h{{H}}' or "
                                    f"'m{{L}}' (layers 0..{graph.n_layers - 1}, heads 0..{graph.n_heads - 1})")
            idx.append(graph.up_index[s])
        names = [x for r in rs for x in graph.receivers_of(r)]
        for r in names:
            for s in ss:
                if not bool(graph.mask[graph.down_index[r], graph.up_index[s]]):
                    raise CircuitError(f"receivers: {r} reads the residual stream before sender {s} writes it; "
                                        "receivers must be later than every sender")
        send_idx.append(idx)
        recv.append(list(dict.fromkeys(names)))
    return send_idx, recv


def _late_receivers(graph: Graph, recv: list[list[str]]) -> list[list[str]]:
    """Per variant the receivers that read later than its first ones (``wang``: they get the frozen
    base input plus the difference; the first ones' live input is the base input already)."""
    out = []
    for rs in recv:
        t0 = min(graph.down_time(r) for r in rs)
        out.append([r for r in rs if graph.down_time(r) > t0])
    return out


def _replay_variants(model: HookedModel, graph: Graph, run: CachedRun, vs: list[int], recv: list[list[str]],
                     deltas: torch.Tensor, base_off: int, g: int, late: list[list[str]]) -> torch.Tensor:
    """Logits ``[len(vs) * g, d_vocab]`` of variants ``vs`` (variant major), each row's receivers
    getting its variant's difference: added to the live input, or for the receivers in ``late[j]``
    added to the base run's cached input (``wang``)."""
    dev = run.resid[0].device
    by_hook: dict[tuple[str, int | None, bool], list[int]] = {}
    final_rows: dict[bool, list[int]] = {False: [], True: []}
    start = graph.n_layers
    for k, j in enumerate(vs):
        frozen = set(late[j])
        for r in recv[j]:
            hook, head, layer = receiver_hook(graph, r)
            start = min(start, layer)
            if r == "logits":
                final_rows[r in frozen].append(k)
            else:
                by_hook.setdefault((hook, head, r in frozen), []).append(k)
    sub = deltas[vs]  # [len(vs), g, pos, d]

    def rows_of(ks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(replay rows, their differences, their base rows in the cached run)."""
        kt = torch.tensor(ks)
        rows = (kt[:, None] * g + torch.arange(g)[None]).flatten().to(dev)
        base = (torch.arange(g) + base_off).repeat(len(ks)).to(dev)
        return rows, sub[kt].reshape(len(ks) * g, *sub.shape[2:]).to(dev), base

    def layer_hooks(L: int):
        out = []
        for (hook, head, frozen), ks in by_hook.items():
            if int(hook.split(".")[1]) != L:
                continue
            rows, d, base = rows_of(ks)
            if frozen:
                cached = run.acts[hook][base]
                value = (cached if head is None else cached[:, :, head]).float() + d
                out.append((hook, lambda m, i, o, rows=rows, head=head, v=value: _set(m, i, o, rows, head, v)))
            else:
                out.append((hook, lambda m, i, o, rows=rows, head=head, d=d: _add(m, i, o, rows, head, d)))
        return out

    def final(x):
        if not any(final_rows.values()):
            return x
        x = x.clone()
        for frozen, ks in final_rows.items():
            if ks:
                rows, d, base = rows_of(ks)
                if frozen:
                    x[rows] = (run.resid[graph.n_layers][base].float() + d).to(x.dtype)
                else:
                    x[rows] += d.to(x.dtype)
        return x

    base_rows = (torch.arange(g) + base_off).repeat(len(vs)).to(dev)
    return replay(model, run, base_rows, start, layer_hooks, final)
