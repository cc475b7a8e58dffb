"""The patching engine: one cached run per group of equal-length prompts, then batched,
layer-skipping replays of every patched variant (the staircase), with out-of-memory halving.

* :func:`cache_run` records every block's exact call inputs, the named activations and the
  last-position logits (:class:`CachedRun`);
* :func:`patch_rows` runs :class:`PatchJob` s: bit-exact no-op variants take the cached run's
  metric, the rest are sorted by start layer and replayed in chunks (:func:`run_chunked`,
  :func:`auto_batch_size`), each chunk as a staircase (``_replay``) whose hooks are always removed.
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

from ..core.budget import is_oom, run_chunked
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

__all__ = ["CachedRun", "PatchJob", "auto_batch_size", "cache_run", "is_oom", "patch_hook", "patch_rows", "run_chunked"]


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
        cached rows ``rows`` (one per row of ``x``): the replay step every replay engine shares."""
        a, kw = self.block_call(i, rows)
        out = cast(Any, model).blocks[i](x, *a, **kw)  # a loaded bridge's block (not in HookedModel)
        return out[0] if isinstance(out, tuple) else out

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

def auto_batch_size(model: HookedModel, seq_len: int, budget_fraction: float = 0.3, cap: int = 512) -> int:
    """Variants per replay batch that fit in ``budget_fraction`` of free memory (CUDA: free device
    memory; CPU: available RAM). The estimate per variant row is generous (activations of one block
    incl. attention patterns and MLP hidden, x4 for temporaries)."""
    cfg = model.cfg
    dev = model_device(model)
    d_mlp = int(getattr(cfg, "d_mlp", None) or 4 * cfg.d_model)
    per_tok = 6 * cfg.d_model + 3 * d_mlp + 3 * cfg.n_heads * seq_len
    per_row = 4 * 4 * seq_len * per_tok + 4 * cfg.d_vocab  # float32 bytes, x4 temporaries, + final logits
    try:
        if dev.type == "cuda":
            free = torch.cuda.mem_get_info(dev)[0]
        else:
            import psutil

            free = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001
        free = 2 * 1024**3
    return int(max(1, min(cap, budget_fraction * free // per_row)))


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
    """[V] bool: the patch would write exactly the values already there (a no-op)."""
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
    logits = Readout(model).logits(x[:, -1:, :])[:, 0]
    # rows were appended in order of start layer, i.e. in the given order
    return logits.float()


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
) -> list[torch.Tensor]:
    """Run every variant of every job with layer skipping and batching; return per job ``[V, M]``.

    Args:
        model: the hooked model the run was cached on.
        run: :func:`cache_run` output (must contain the activations of every job's hooks).
        jobs: :class:`PatchJob` s; variants of all jobs share batches.
        row_metric: ``(logits [R, d_vocab] at the last position, base_rows [R]) -> [R, M]``.
        batch_size: variants per replay batch, or ``auto`` (:func:`auto_batch_size`).
        skip_unchanged: variants whose patch is a bit-exact no-op take the cached run's metric.
        progress: called with the number of variants finished.

    Returns:
        One float tensor ``[len(job), M]`` per job, on the CPU.
    """
    if batch_size == "auto":
        batch_size = auto_batch_size(model, run.tokens.shape[1])
    results: list[torch.Tensor | None] = [None] * len(jobs)
    todo: list[tuple[int, int, int]] = []  # (start layer, job, variant)
    for j, job in enumerate(jobs):
        skip = _unchanged(job, run) if skip_unchanged else torch.zeros(len(job), dtype=torch.bool)
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

    run_chunked(do, len(todo), int(batch_size))
    return [r if r is not None else torch.zeros((0, 0)) for r in results]
