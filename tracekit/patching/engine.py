"""The patching engine: one cached run per group of equal-length prompts, then batched,
layer-skipping replays of every patched variant (the staircase), with out-of-memory halving.

* :func:`cache_run` records every block's exact call inputs, the named activations and the
  last-position logits (:class:`CachedRun`);
* :func:`patch_rows` runs :class:`PatchJob` s: bit-exact no-op variants take the cached run's
  metric, the rest are sorted by start layer and replayed in chunks (:func:`run_chunked`,
  :func:`auto_batch_size`), each chunk as a staircase (``_replay``) whose hooks are always removed.

Memory: the chunk is what ``run.memory_budget`` allows (:func:`tracekit.core.budget.chunk_rows`)
given :func:`replay_row_bytes` per variant and the cached run's bytes as a fixed cost
(:func:`cached_run_bytes` before it exists, :func:`tensor_bytes` after); an explicit
``batch_size`` caps it. The replay engines of :mod:`tracekit.circuits` and
:mod:`tracekit.causal_tracing` size their chunks with the same two estimates.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from jaxtyping import Float, Int

from ..core.budget import MemoryBudgetError, bytes_of, chunk_rows, is_oom, run_chunked
from ..errors import PatchingError
from ..model.info import HookedModel
from ..model.load import model_device
from ..model.readout import Readout
from .setters import Site

try:
    from transformers.cache_utils import Cache as _HFCache
except ImportError:  # pragma: no cover
    _HFCache = ()  # type: ignore

log = logging.getLogger("tracekit.patching")

__all__ = ["AUTO_CAP", "CachedRun", "MIN_READOUT_ROWS", "MemoryBudgetError", "PatchJob", "auto_batch_size",
           "cache_run", "cached_run_bytes", "check_replay_fits", "is_oom", "patch_hook", "patch_rows", "readout_last", "replay_chunk",
           "replay_row_bytes", "run_chunked", "tensor_bytes"]


def _strip_cache(x):
    """None for a transformers KV cache object (a replay must not read or grow it), else ``x``."""
    return None if isinstance(x, _HFCache) else x


@dataclass
class CachedRun:
    """One forward pass over a batch of equal-length prompts, with what replays need.

    Attributes:
        tokens: ``[n, pos]`` token ids (no padding: prompts in a run have equal length).
        resid, args, kwargs: per block ``i`` (and ``n_layers`` = the input of ``ln_final``): the
            residual ``[n, pos, d_model]`` and the block's other call arguments, with any KV cache
            removed and ``use_cache=False``.
        acts: cached activations ``{hook_name: [n, ...]}`` (only the names asked for).
        logits: ``[n, d_vocab]`` the model's logits at the last position (unnormalised, float32).
        heads: ``cfg.n_heads`` (to select rows of call arguments with batch and heads folded together).
    """

    tokens: Int[torch.Tensor, "n pos"]
    resid: list[Float[torch.Tensor, "n pos d_model"]]
    args: list[tuple]
    kwargs: list[dict]
    acts: dict[str, torch.Tensor]
    logits: Float[torch.Tensor, "n d_vocab"]
    heads: int = 0

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def block_call(self, i: int, rows: torch.Tensor) -> tuple[tuple, dict]:
        """Block ``i``'s extra args/kwargs with batch-dimension tensors indexed by ``rows``."""
        n = self.n

        heads = self.heads

        def sel(v):
            if torch.is_tensor(v):
                if v.ndim >= 2 and v.shape[0] == n:
                    return v[rows]
                if heads > 1 and v.ndim >= 2 and v.shape[0] == n * heads:
                    # batch x heads folded into one axis (Bloom's ALiBi bias [n * heads, 1, pos])
                    return v.reshape(n, heads, *v.shape[1:])[rows].reshape(-1, *v.shape[1:])
                return v
            if isinstance(v, tuple):
                return tuple(sel(u) for u in v)
            if isinstance(v, list):
                return [sel(u) for u in v]
            return v

        return tuple(sel(a) for a in self.args[i]), {k: sel(v) for k, v in self.kwargs[i].items()}

    def run_block(self, model: HookedModel, i: int, x: Float[torch.Tensor, "b pos d_model"],
                  rows: torch.Tensor) -> Float[torch.Tensor, "b pos d_model"]:
        """Block ``i`` of ``model`` on residual ``x`` (block input), with the extra arguments of the
        cached rows ``rows`` (one per row of ``x``): the replay step every replay engine shares.

        A single row is run as two (a copy appended, dropped after the block; hooks see both):
        TransformerLens' attention multiplies head-transposed views, which for one row take
        another matmul path (another summation order) than for several, so without the copy a
        variant's result would depend on how many rows share its replay batch. (A chunk of one row
        therefore costs two rows' block activations: within the x4 temporaries that
        :func:`replay_row_bytes` counts.)"""
        single = x.shape[0] == 1
        if single:
            x, rows = torch.cat([x, x]), torch.cat([rows, rows])
        a, kw = self.block_call(i, rows)
        out = cast(Any, model).blocks[i](x, *a, **kw)  # a loaded bridge's block (not in HookedModel)
        out = out[0] if isinstance(out, tuple) else out
        return out[:1] if single else out

    def varying_inputs(self, rows_a: torch.Tensor, rows_b: torch.Tensor) -> list[str]:
        """Block call arguments other than the residual stream that differ between two row sets
        (e.g. Gemma 4's per-layer token embeddings, Zamba 2's original embeddings): token-dependent
        inputs that bypass the residual stream, which residual patching cannot carry."""
        n = self.n
        out = []
        for i in range(len(self.args)):
            items = [(f"args[{j}]", a) for j, a in enumerate(self.args[i])] + list(self.kwargs[i].items())
            for name, v in items:
                vs = v if isinstance(v, (tuple, list)) else (v,)
                for t in vs:
                    if torch.is_tensor(t) and t.ndim >= 1 and t.shape[0] == n:
                        if not torch.equal(t[rows_a.to(t.device)], t[rows_b.to(t.device)]):
                            out.append(f"block {i} {name}")
                            break
        return out


@torch.no_grad()
def cache_run(model: HookedModel, tokens: Int[torch.Tensor, "n pos"], hook_names: Sequence[str] = ()) -> CachedRun:
    """Run the model once on ``tokens`` recording block inputs, the named activations and the
    last-position logits. Prompts must share one length (no padding).

    Args:
        model: the hooked model (its blocks are called as ``model.blocks[i]``).
        tokens: ``[n, pos]`` token ids, on the model's device.
        hook_names: the activations to keep (``{hook: [n, ...]}`` in :attr:`CachedRun.acts`).

    Raises:
        PatchingError: some block's input was not recorded (blocks not called as ``model.blocks[i]``).
    """
    n_layers = model.cfg.n_layers
    resid: list = [None] * (n_layers + 1)
    args: list = [()] * (n_layers + 1)
    kwargs: list = [{}] * (n_layers + 1)

    def pre(mod, a, k, i):
        resid[i] = a[0].detach().clone()
        args[i] = tuple(_strip_cache(v) for v in a[1:])
        kk = {key: _strip_cache(v) for key, v in k.items()}
        if "use_cache" in kk:
            kk["use_cache"] = False
        kwargs[i] = kk

    handles = []
    names = set(hook_names)
    # blocks / ln_final are a loaded bridge's modules, not part of HookedModel (which a weightless
    # ModelInfo also satisfies)
    modules = cast(Any, model)
    try:  # every hook is registered inside the try, so each one registered is removed
        for i in range(n_layers):
            handles.append(modules.blocks[i].register_forward_pre_hook(partial(_pre_adapter, fn=pre, i=i),
                                                                       with_kwargs=True))
        handles.append(modules.ln_final.register_forward_pre_hook(partial(_pre_adapter, fn=pre, i=n_layers),
                                                                  with_kwargs=True))
        logits, cache = model.run_with_cache(tokens, names_filter=lambda nm: nm in names)
    finally:
        for h in handles:
            h.remove()
    if any(r is None for r in resid):
        missing = [i for i, r in enumerate(resid) if r is None]
        raise PatchingError(f"patching: block inputs {missing} were not recorded; this model's blocks "
                            "are not called as model.blocks[i] (unsupported architecture)")
    acts = {nm: cache[nm] for nm in names}
    return CachedRun(tokens, resid, args, kwargs, acts, logits[:, -1].detach().float(),
                     int(getattr(model.cfg, "n_heads", 0) or 0))


def _pre_adapter(mod, a, k, fn, i):
    fn(mod, a, k, i)


# ---------------------------------------------------------------------------------------------
# Batching, memory.
# ---------------------------------------------------------------------------------------------

#: Most variants per replay batch that ``batch_size: auto`` chooses (the budget may allow more).
AUTO_CAP = 512

#: Rows the final readout is run on at least: MKL's float32 GEMM sums a call of 1-3 rows in
#: another order than a larger one, so without this a variant's logits would depend on how many
#: variants shared its chunk (padding rows are copies of the first, dropped after the readout).
MIN_READOUT_ROWS = 4


def readout_last(model: HookedModel, x: Float[torch.Tensor, "rows pos d_model"]) -> Float[torch.Tensor, "rows d_vocab"]:
    """The logits at the last position of final residuals ``x`` (float32, via :class:`Readout`),
    computed on at least :data:`MIN_READOUT_ROWS` rows so that a row's logits do not depend on how
    many rows it is read out with."""
    last = x[:, -1:, :]
    b = int(last.shape[0])
    if 0 < b < MIN_READOUT_ROWS:
        last = torch.cat([last, last[:1].expand(MIN_READOUT_ROWS - b, -1, -1)])
    return Readout(model).logits(last)[:b, 0].float()


def _widths(model: HookedModel) -> tuple[int, int, int, int, int]:
    """``(d_model, d_mlp, n_heads, n_kv_heads, d_head)`` of ``model.cfg``."""
    cfg = model.cfg
    d = int(cfg.d_model)
    heads = int(getattr(cfg, "n_heads", 0) or 1)
    kv = int(getattr(cfg, "n_key_value_heads", None) or heads)
    d_head = int(getattr(cfg, "d_head", None) or max(1, d // heads))
    d_mlp = int(getattr(cfg, "d_mlp", None) or 4 * d)
    return d, d_mlp, heads, kv, d_head


def replay_row_bytes(model: HookedModel, seq_len: int) -> int:
    """Bytes one replay row (one patched variant of one prompt) needs while a staircase runs.

    Counts, in float32 (generous for half-precision models): one block's activations of the row,
    per token the residual in/out and the attention and MLP inputs/outputs (``4 x d_model``), the
    queries, keys, values and ``z`` (``(2 n_heads + 2 n_kv_heads) x d_head``), the MLP hidden
    (``3 x d_mlp``: gate, up, activation) and the attention scores and pattern
    (``3 x n_heads x seq_len``), times 4 for temporaries (a patch hook's clone, the block's own);
    plus the readout at the last position only, ``[d_vocab]`` float32 times 4 (the model dtype's
    logits, the float copy, the metric's log-softmax and its temporaries). A staircase keeps only
    each row's current residual, not every layer's: the block inputs of the other layers are the
    cached run's (a fixed cost, :func:`cached_run_bytes`).

    Args:
        model: the hooked model (its ``cfg`` widths and ``d_vocab``).
        seq_len: the prompts' token length.

    Returns:
        Bytes (an int).
    """
    d, d_mlp, heads, kv, d_head = _widths(model)
    T = max(1, int(seq_len))
    per_tok = 4 * d + (2 * heads + 2 * kv) * d_head + 3 * d_mlp + 3 * heads * T
    return 4 * bytes_of(T, per_tok) + 4 * bytes_of(int(model.cfg.d_vocab))


def cached_run_bytes(model: HookedModel, n: int, seq_len: int, hook_names: Sequence[str] = ()) -> int:
    """Bytes :func:`cache_run` needs for ``n`` prompts of ``seq_len`` tokens, before it runs.

    Counts: the block inputs it keeps, ``(n_layers + 1) x [n, seq_len, d_model]``; each named
    activation at its widest (``[n, seq_len, max(d_model, d_mlp, n_heads x d_head, n_heads x seq_len)]``);
    the last-position logits ``[n, d_vocab]``; and the forward pass's own transient: its full logits
    ``[n, seq_len, d_vocab]`` (the model returns every position's; with a 262k vocabulary this is the
    largest term) and one block's activations of ``n`` rows (:func:`replay_row_bytes`). All in float32.

    Args:
        model: the hooked model.
        n: prompts in the run (both halves of a paired run).
        seq_len: their token length.
        hook_names: the activations kept (:attr:`CachedRun.acts`).

    Returns:
        Bytes (an int).
    """
    d, d_mlp, heads, _, d_head = _widths(model)
    T, L, V = max(1, int(seq_len)), int(model.cfg.n_layers), int(model.cfg.d_vocab)
    widest = max(d, d_mlp, heads * d_head, heads * T)
    return (bytes_of(L + 1, n, T, d) + len(set(hook_names)) * bytes_of(n, T, widest) + bytes_of(n, V)
            + bytes_of(n, T, V) + n * replay_row_bytes(model, T))


def tensor_bytes(*objs: Any) -> int:
    """Bytes of the distinct tensor storages in ``objs`` (tensors, lists, tuples, dicts, a
    :class:`CachedRun`, a :class:`PatchJob`, nested): what a cached run or a job's sources hold."""
    seen: set[tuple[str, int]] = set()
    total = 0
    stack = list(objs)
    while stack:
        o = stack.pop()
        if torch.is_tensor(o):
            st = o.untyped_storage()
            key = (str(o.device), int(st.data_ptr()))
            if key not in seen:
                seen.add(key)
                total += int(st.nbytes())
        elif isinstance(o, dict):
            stack += list(o.values())
        elif isinstance(o, (list, tuple)):
            stack += list(o)
        elif isinstance(o, (CachedRun, PatchJob)):
            stack += list(vars(o).values())
    return total


def replay_chunk(model: HookedModel, per_unit: int, n: int, *, what: str, fixed: int = 0,
                 batch_size: int | str = "auto", rows_per_unit: int = 1, unit: str = "variant",
                 fix: str | None = None) -> int:
    """Units (variants, circuits, restorations x draws) per replay batch under ``run.memory_budget``.

    ``batch_size`` ``auto``: what the budget allows (:func:`tracekit.core.budget.chunk_rows`), at
    most :data:`AUTO_CAP` rows; an int: that many rows at most (the user's cap), fewer if the budget
    says so. A unit is ``rows_per_unit`` replay rows (``batch_size`` counts rows).

    Args:
        model: the hooked model (its device).
        per_unit: bytes of one unit (e.g. ``rows_per_unit x`` :func:`replay_row_bytes`).
        n: units to run.
        what: the engine, for messages.
        fixed: bytes held whatever the chunk (the cached run, the writes).
        batch_size: ``auto`` or rows per batch.
        rows_per_unit: replay rows per unit.
        unit: what one unit is, for messages.
        fix: another way out, for the message.

    Returns:
        Units per batch (1 .. max(1, n)).

    Raises:
        MemoryBudgetError: one unit plus ``fixed`` needs more than the budget (before any replay).
    """
    fix = fix or "give fewer rows of that length"
    budget_units = chunk_rows(per_unit, max(1, int(n)), what=what, device=model_device(model), fixed=fixed,
                              unit=unit, fix=fix)
    cap_rows = AUTO_CAP if batch_size == "auto" else max(1, int(batch_size))
    return max(1, min(budget_units, cap_rows // max(1, int(rows_per_unit))))


def check_replay_fits(model: HookedModel, n: int, seq_len: int, hook_names: Sequence[str] = (), *, what: str,
                      per_unit: int | None = None, extra: int = 0, unit: str = "variant",
                      fix: str | None = None) -> None:
    """Refuse, before the cached run is made, a replay whose cached run (:func:`cached_run_bytes` of
    ``n`` prompts of ``seq_len`` tokens) plus ``extra`` fixed bytes plus one unit (``per_unit``,
    default :func:`replay_row_bytes`) does not fit ``run.memory_budget``.

    Raises:
        MemoryBudgetError: naming ``what``, the bytes needed, the budget and ``run.memory_budget``.
    """
    chunk_rows(replay_row_bytes(model, seq_len) if per_unit is None else int(per_unit), 1, what=what,
               device=model_device(model), fixed=cached_run_bytes(model, n, seq_len, hook_names) + int(extra),
               unit=unit, fix=fix or "give fewer or shorter prompts")


def auto_batch_size(model: HookedModel, seq_len: int, budget_fraction: float | None = None, cap: int = AUTO_CAP,
                    fixed: int = 0, what: str = "activation patching replay") -> int:
    """Variants per replay batch that fit the memory budget: ``run.memory_budget`` (or
    ``budget_fraction`` of free memory when given: CUDA free device memory, CPU available RAM),
    less ``fixed`` bytes, over :func:`replay_row_bytes` per variant; at most ``cap``.

    Raises:
        MemoryBudgetError: one variant plus ``fixed`` needs more than the budget.
    """
    budget = None if budget_fraction is None else f"{float(budget_fraction) * 100:g}%"
    n = chunk_rows(replay_row_bytes(model, seq_len), max(1, int(cap)), what=what, device=model_device(model),
                   fixed=fixed, budget=budget, unit="variant", fix="shorten the prompts")
    return int(max(1, min(int(cap), n)))


# ---------------------------------------------------------------------------------------------
# The engine.
# ---------------------------------------------------------------------------------------------

@dataclass
class PatchJob:
    """Variants of one site: ``index`` rows (layer + axes) x base rows, each with a source row.

    Attributes:
        site: the :class:`Site`.
        layer: ``[V]`` layer of each variant.
        index: ``{axis: [V]}`` the other index values of each variant.
        base_rows: ``[V]`` which prompt of the cached run each variant runs (the run being patched).
        source: ``{layer: tensor [S, ...]}`` activations to patch in (same layout as the hook's).
        src_rows: ``[V]`` which row of ``source[layer]`` each variant takes its patch from.
    """

    site: Site
    layer: torch.Tensor
    index: dict[str, torch.Tensor]
    base_rows: torch.Tensor
    source: dict[int, torch.Tensor]
    src_rows: torch.Tensor

    def __len__(self) -> int:
        return int(self.layer.shape[0])


def _unchanged(job: PatchJob, run: CachedRun, chunk: int = 256) -> torch.Tensor:
    """[V] bool: the patch would write exactly the values already there (a no-op); compares
    ``min(chunk, 256)`` variants at a time (two copies of one activation each: less than a replay row)."""
    chunk = max(1, min(int(chunk), 256))
    out = torch.zeros(len(job), dtype=torch.bool)
    for L in job.layer.unique().tolist():
        sel = (job.layer == L).nonzero().flatten()
        base_act = run.acts[job.site.hook_name(L)]
        src = job.source[L]
        if src.shape[1:] != base_act.shape[1:]:
            continue
        for s in range(0, len(sel), chunk):
            idx = sel[s:s + chunk]
            dev = base_act.device
            idx_d = idx.to(dev)
            base = base_act[job.base_rows[idx_d]].clone()
            patched = base.clone()
            ar = torch.arange(len(idx), device=dev)
            job.site.setter(patched, ar, {k: v[idx_d] for k, v in job.index.items()}, src, job.src_rows[idx_d])
            same = (patched == base).flatten(1).all(-1)
            out[idx] = same.cpu()
    return out


def _replay(model: HookedModel, run: CachedRun, jobs: list[PatchJob], rows: list[tuple[int, int]]
            ) -> Float[torch.Tensor, "rows d_vocab"]:
    """Replay a chunk of variants (``(job, variant)`` pairs, sorted by start layer) as a staircase;
    return the logits at the last position ``[len(rows), d_vocab]`` (float32, via :class:`Readout`).

    Hooks for the rows joining at block L are registered inside the ``try`` whose ``finally``
    removes them, so nothing raised (out-of-memory while growing the batch, ``KeyboardInterrupt``)
    leaves a hook on the model."""
    n_layers = model.cfg.n_layers
    starts = [jobs[j].site.start_layer(int(jobs[j].layer[v])) for j, v in rows]
    first = min(starts)
    dev = run.resid[0].device
    x = None
    base_order = torch.empty(0, dtype=torch.long, device=dev)
    k = 0
    handles: list = []
    hook_dict: dict = {}  # resolved once per replay: the bridge rebuilds model.hook_dict on every access
    try:
        for L in range(first, n_layers + 1):
            new = []
            while k < len(rows) and starts[k] == L:
                new.append(k)
                k += 1
            if new:
                nb = torch.tensor([int(jobs[rows[i][0]].base_rows[rows[i][1]]) for i in new], device=dev)
                xn = run.resid[L][nb].clone()
                off = 0 if x is None else x.shape[0]
                # group new rows by job (rows are sorted by job within a start layer)
                for j, grp in itertools.groupby(range(len(new)), key=lambda t: rows[new[t]][0]):
                    grp = list(grp)
                    job = jobs[j]
                    vs = torch.tensor([rows[new[t]][1] for t in grp], device=job.layer.device)
                    lay = int(job.layer[vs[0]])
                    index = {a: t[vs].to(dev) for a, t in job.index.items()}
                    src = job.source[lay]
                    src_rows = job.src_rows[vs].to(src.device)
                    if job.site.start in ("input", "next_input"):
                        job.site.setter(xn, torch.tensor(grp, device=dev), index, src, src_rows)
                    else:
                        rws = torch.tensor(grp, device=dev) + off
                        fn = partial(patch_hook, setter=job.site.setter, rows=rws, index=index,
                                     source=src, src_rows=src_rows)
                        if not hook_dict:
                            hook_dict = model.hook_dict
                        hp = hook_dict[job.site.hook_name(lay)]
                        handles.append(hp.register_forward_hook(fn))
                x = xn if x is None else torch.cat([x, xn], 0)
                base_order = torch.cat([base_order, nb])
            if L == n_layers:
                break
            assert x is not None  # rows joined at or before layer L (the first start layer)
            x = run.run_block(model, L, x, base_order)
            for h in handles:
                h.remove()
            handles = []
    finally:
        for h in handles:
            h.remove()
    assert x is not None
    # rows were appended in order of start layer, i.e. in the given order
    return readout_last(model, x)


def patch_hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor, setter: Callable,
               rows: torch.Tensor, index: dict[str, torch.Tensor], source: torch.Tensor,
               src_rows: torch.Tensor) -> torch.Tensor:
    """A forward hook (on a hook point) that patches its output with ``setter``: the one patch step
    of every replay (bind the keyword arguments with :func:`functools.partial`).

    As TransformerLens' ``HookPoint.add_hook``, the activation is presented to the setter in
    TransformerLens' layout (the hook point's ``hook_conversion``, e.g. ``hook_z`` as
    ``[batch, pos, head, d_head]``) and the patched tensor converted back.

    Args:
        module: the hook point; inputs: its inputs (unused); output: its activation ``[batch, ...]``.
        setter: ``setter(act, rows, index, source, src_rows) -> act`` (:mod:`tracekit.patching.setters`).
        rows: ``[R]`` the batch rows patched; index: ``{axis: [R]}`` each row's position / head / neuron.
        source: the activation patched in (the hook's layout, any batch size); src_rows: ``[R]`` its rows.

    Returns:
        The patched activation, in the hook point's own layout.
    """
    conv = getattr(module, "hook_conversion", None)
    act = conv.convert(output) if conv is not None else output
    act = setter(act, rows, index, source, src_rows)
    return conv.revert(act) if conv is not None else act


@torch.no_grad()
def patch_rows(
    model: HookedModel,
    run: CachedRun,
    jobs: list[PatchJob],
    row_metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch_size: int | str = "auto",
    skip_unchanged: bool = True,
    progress: Callable[[int], None] | None = None,
    stats: dict | None = None,
) -> list[torch.Tensor]:
    """Run every variant of every job with layer skipping and batching; return per job ``[V, M]``.

    The replay batch holds what ``run.memory_budget`` allows (:func:`replay_chunk`: the cached
    run and the jobs' sources are the fixed cost, :func:`replay_row_bytes` per variant); an int
    ``batch_size`` caps it. Results do not depend on the batch size.

    Args:
        model: the hooked model the run was cached on.
        run: :func:`cache_run` output (must contain the activations of every job's hooks).
        jobs: :class:`PatchJob` s; variants of all jobs share batches.
        row_metric: ``(logits [R, d_vocab] at the last position, base_rows [R]) -> [R, M]``.
        batch_size: variants per replay batch at most, or ``auto`` (the budget's, at most
            :data:`AUTO_CAP`).
        skip_unchanged: variants whose patch is a bit-exact no-op take the cached run's metric.
        progress: called with the number of variants finished.
        stats: if given, ``stats["batch_size"]`` is set to the variants per batch used (after any
            out-of-memory halving) and ``stats["replayed"]`` to the variants replayed.

    Returns:
        One float tensor ``[len(job), M]`` per job, on the CPU.

    Raises:
        MemoryBudgetError: the cached run and one variant do not fit ``run.memory_budget``
            (before any replay).
    """
    n_total = sum(len(j) for j in jobs)
    bs = replay_chunk(model, replay_row_bytes(model, int(run.tokens.shape[1])), n_total,
                      what="activation patching replay", fixed=tensor_bytes(run, *[j.source for j in jobs]),
                      batch_size=batch_size, fix="give fewer or shorter prompts")
    results: list[torch.Tensor | None] = [None] * len(jobs)
    todo: list[tuple[int, int, int]] = []  # (start layer, job, variant)
    for j, job in enumerate(jobs):
        skip = _unchanged(job, run, bs) if skip_unchanged else torch.zeros(len(job), dtype=torch.bool)
        if skip.any():
            idx = skip.nonzero().flatten()
            br = job.base_rows[idx.to(job.base_rows.device)].to(run.logits.device)
            vals = row_metric(run.logits[br], br).float().cpu()
            res = torch.full((len(job), vals.shape[-1]), float("nan"))
            res[idx] = vals
            results[j] = res
            if progress:
                progress(len(idx))
        for v in (~skip).nonzero().flatten().tolist():
            todo.append((job.site.start_layer(int(job.layer[v])), j, v))
    todo.sort()

    def do(sl: slice) -> None:
        chunk = [(j, v) for _, j, v in todo[sl]]
        logits = _replay(model, run, jobs, chunk)
        br = torch.tensor([int(jobs[j].base_rows[v]) for j, v in chunk], device=logits.device)
        vals = row_metric(logits, br).float().cpu()
        for r, (j, v) in enumerate(chunk):
            res = results[j]
            if res is None:
                res = results[j] = torch.full((len(jobs[j]), vals.shape[-1]), float("nan"))
            res[v] = vals[r]
        if progress:
            progress(len(chunk))

    used = run_chunked(do, len(todo), bs, what="activation patching replay") if todo else bs
    if stats is not None:
        stats["batch_size"], stats["replayed"] = int(used), len(todo)
    return [r if r is not None else torch.zeros((0, 0)) for r in results]
