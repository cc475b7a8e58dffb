"""Activation patching: exact, batched, layer-skipping interventions on every site of a model.

Method (Meng et al. 2022, "Locating and Editing Factual Associations in GPT" (ROME), *causal
tracing*; Wang et al. 2022, "Interpretability in the Wild" (IOI); Heimersheim & Nanda 2024, "How to
use and interpret activation patching"; Zhang & Nanda 2023, "Towards Best Practices of Activation
Patching in Language Models: Metrics and Methods"). Reference implementation:
``transformer_lens.patching`` (one forward pass per site).

Run the model on two prompts that differ in one key detail: the *clean* prompt
(``"The capital of France is"`` -> target ``" Paris"``) and the *corrupted* prompt
(``"The capital of Italy is"`` -> foil ``" Rome"``). Then run it again on one of them while
replacing a single activation (a *site*: the residual stream at layer L and position p, one
attention head's output, one MLP neuron, ...) with that activation from the other run, and measure
how far the output moves:

* **denoising** (clean -> corrupted run): does restoring this one clean activation restore the
  clean answer? Finds activations that are *sufficient* (given the rest of the corrupted run).
* **noising** (corrupted -> clean run): does corrupting this activation break the clean answer?
  Finds activations that are *necessary*.
* **ablations** of the clean run (:data:`ABLATIONS`), replacing the site by

  - ``zero``;
  - ``mean``: its mean over a stated *baseline population* of prompts (by default every pair's
    clean prompt; or ``baseline_prompts``), **other than the pair's own clean prompt**, each
    aligned to the pair by position from the end (only prompts at least as long as the pair
    count). At least :data:`MIN_MEAN_POPULATION` such prompts are required
    (:class:`PatchingError` otherwise): a mean over one prompt is a resample, over none the
    prompt's own activation (an effect of exactly 0 that measures nothing);
  - ``resample``: the site from one other prompt of the same population (never the pair's own
    clean prompt), drawn with ``seed``.

  The population size (``baseline_n``) and the resampled prompt (``baseline_source``) are part of
  every result (:class:`JobResult`).

Metrics come from :mod:`tracekit.metrics` (``logit_diff`` = logit(target) - logit(foil) in logits,
``prob``, ``log_prob`` in nats, ``kl`` = KL(P_clean || P_run) in nats), read at the last token of
each prompt (the answer position); :func:`tracekit.metrics.normalize` maps them so the clean run
scores 1 and the corrupted run 0.

Inputs are unpadded: every function here takes equal-length token rows (pairs of different
lengths run in separate groups inside :func:`run_patching`). A padded batch would read the metric
at a pad position and let real tokens attend to pads, so it is refused (:class:`PatchingError`):
a :class:`tracekit.tokens.Batch` with padding, an ``attention_mask`` with zeros, or a tensor whose
rows end in the padding token or start with runs of it of different lengths.

Structure: :func:`run_patching` (what the ``activation_patching`` kind calls) builds one
:class:`PatchJob` per (direction or ablation, site) and returns per-job results. For notebooks,
:func:`batched_activation_patch` patches one kind of site everywhere, with *setters* that say which
slice of an activation a site is (``layer_pos_setter``, ``layer_head_vector_setter``, ...),
specialised with :func:`functools.partial` into :func:`batched_act_patch_resid_pre`,
:func:`batched_act_patch_attn_head_out_by_pos`, ... (TransformerLens' functions of similar purpose
are ``generic_activation_patch`` / ``get_act_patch_*``; these take token tensors, not a cache, and
return per-prompt values). Unlike TransformerLens, which runs one full forward pass per site, the
engine is fast and still exact:

1. **one cached run** per group of equal-length prompts records every block's exact call inputs
   (residual + kwargs: position embeddings, mask, position ids; forward pre-hooks on
   ``model.blocks[i]``) and only the site activations needed;
2. **layer skipping**: a patch at layer L cannot change layers < L, so a patched variant starts
   from the cached input of block L and replays only ``model.blocks[L:]``, then reads the logits
   at the last position through :class:`tracekit.model.readout.Readout`;
3. **many variants per batch**: each row of a replay batch is one (site, prompt) variant; hooks
   inside the block patch each row's own slice. Rows are sorted by start layer and a chunk runs as a
   *staircase*: rows join the batch at the block where their patch happens;
4. **no-op patches are not run**: a variant whose patched value is bit-identical to the value it
   replaces gets the cached run's metric directly (``skip_unchanged``);
5. batch size adapts to free memory (``batch_size="auto"``); an out-of-memory error halves the
   batch and retries (:func:`run_chunked`).

Every hook the engine adds is removed in a ``finally`` (out-of-memory, ``KeyboardInterrupt``, a
metric that raises): no call leaves a hook on the model.

Results equal TransformerLens' one-at-a-time patching within 2e-5 (float32; tested on perturbed
models).

Sites (``SITES``; hook names are TransformerLens'):

=====================  ==================================  =========================
site                   hook                                index axes
=====================  ==================================  =========================
resid_pre/mid/post     blocks.L.hook_resid_{pre,mid,post}  layer, pos
attn_out, mlp_out      blocks.L.hook_{attn,mlp}_out        layer, pos
head_out (z), head_q,  blocks.L.attn.hook_{z,q,k,v}        layer, head (all positions)
head_k, head_v                                             (``*_by_pos``: layer, pos, head)
head_pattern           blocks.L.attn.hook_pattern          layer, head (``_by_pos``: dest pos)
neuron                 blocks.L.mlp.hook_post              layer, neuron (``_by_pos``: + pos)
resid_pre_layer, ...   the whole layer, all positions      layer
=====================  ==================================  =========================

``layer`` is a block index ``0 .. n_layers-1`` (negative counts from the end where a list of layers
is given). ``head_k``/``head_v`` index key/value heads (``n_key_value_heads`` under grouped-query
attention).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import pandas as pd
import torch
from jaxtyping import Float, Int

from . import metrics as M
from .core.sites import SITE_TABLE, check_layers, check_neurons, head_count
from .errors import PatchingError, TokenizationError
from .hooks import enabled_hooks
from .model.architectures import require
from .model.load import model_device
from .model.readout import Readout
from .tokens import Batch, encode, str_tokens

log = logging.getLogger(__name__)

__all__ = [
    "ABLATIONS",
    "DIRECTIONS",
    "MIN_MEAN_POPULATION",
    "SITES",
    "SITE_GROUPS",
    "CachedRun",
    "JobResult",
    "PatchJob",
    "PatchingError",
    "PatchingRun",
    "Site",
    "auto_batch_size",
    "baseline_members",
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
    "cache_run",
    "check_same_length",
    "check_unpadded",
    "count_variants",
    "expand_sites",
    "is_oom",
    "layer_head_pattern_setter",
    "layer_head_pos_pattern_setter",
    "layer_head_vector_setter",
    "layer_neuron_setter",
    "layer_pos_head_vector_setter",
    "layer_pos_neuron_setter",
    "layer_pos_setter",
    "layer_setter",
    "patch_rows",
    "resolve_layers",
    "run_chunked",
    "run_patching",
]

#: Patching directions: ``denoising`` (clean activation into the corrupted run), ``noising`` (the reverse).
DIRECTIONS = ("denoising", "noising")
#: Ablations of the clean run.
ABLATIONS = ("zero", "mean", "resample")
#: ``mean`` ablation needs at least this many baseline prompts other than the pair's own clean prompt.
MIN_MEAN_POPULATION = 2
#: ``resample`` needs at least this many (one prompt is drawn).
MIN_RESAMPLE_POPULATION = 1


# ---------------------------------------------------------------------------------------------
# Setters: which slice of an activation a site is. Each patches rows ``rows`` of the (batched)
# activation ``act`` with rows ``src_rows`` of ``source`` at the variant's ``index``; every index
# entry is a LongTensor with one element per row. Activation layouts are TransformerLens':
# [batch, pos, ...] for everything except attention patterns [batch, head, dest_pos, src_pos].
# ---------------------------------------------------------------------------------------------

def layer_setter(act, rows, index, source, src_rows):
    """Whole activation, all positions (index = [layer])."""
    act[rows] = source[src_rows]
    return act


def layer_pos_setter(act, rows, index, source, src_rows):
    """index = [layer, pos]; act is [batch, pos, ...] (residual, attn/MLP output)."""
    act[rows, index["pos"]] = source[src_rows, index["pos"]]
    return act


def layer_head_vector_setter(act, rows, index, source, src_rows):
    """index = [layer, head]; act is [batch, pos, head, d_head] (z, q, k, v); all positions."""
    act[rows, :, index["head"]] = source[src_rows, :, index["head"]]
    return act


def layer_pos_head_vector_setter(act, rows, index, source, src_rows):
    """index = [layer, pos, head]; act is [batch, pos, head, d_head]."""
    act[rows, index["pos"], index["head"]] = source[src_rows, index["pos"], index["head"]]
    return act


def layer_head_pattern_setter(act, rows, index, source, src_rows):
    """index = [layer, head]; act is [batch, head, dest_pos, src_pos]; every destination."""
    act[rows, index["head"]] = source[src_rows, index["head"]]
    return act


def layer_head_pos_pattern_setter(act, rows, index, source, src_rows):
    """index = [layer, pos, head] with pos the destination position; act is [batch, head, dest, src]."""
    act[rows, index["head"], index["pos"]] = source[src_rows, index["head"], index["pos"]]
    return act


def layer_neuron_setter(act, rows, index, source, src_rows):
    """index = [layer, neuron]; act is [batch, pos, d_mlp] (``mlp.hook_post``); all positions."""
    act[rows, :, index["neuron"]] = source[src_rows, :, index["neuron"]]
    return act


def layer_pos_neuron_setter(act, rows, index, source, src_rows):
    """index = [layer, pos, neuron]; act is [batch, pos, d_mlp]."""
    act[rows, index["pos"], index["neuron"]] = source[src_rows, index["pos"], index["neuron"]]
    return act


@dataclass(frozen=True)
class Site:
    """A kind of patching site.

    Attributes:
        name: the site's name in configs and tables (``resid_pre``, ``head_out_by_pos``, ...).
        hook: hook-name template, ``{layer}`` filled in.
        axes: index axes after ``layer`` (``pos``, ``head``, ``neuron``).
        setter: the setter function.
        start: ``hook`` (replay from block L, patch in a hook inside it), ``input`` (patch block
            L's input directly: resid_pre) or ``next_input`` (patch block L+1's input: resid_post).
        kv_heads: the head axis counts key/value heads (k, v under grouped-query attention).
    """

    name: str
    hook: str
    axes: tuple[str, ...]
    setter: Callable
    start: str = "hook"
    kv_heads: bool = False
    description: str = ""

    def hook_name(self, layer: int) -> str:
        return self.hook.format(layer=layer)

    def start_layer(self, layer: int) -> int:
        return layer + 1 if self.start == "next_input" else layer


def _site_table() -> dict[str, Site]:
    """Patching's sites: the sites of :data:`tracekit.core.sites.SITE_TABLE` (hook templates) with
    their setters, plus the ``_by_pos`` (one position) and ``_layer`` (a whole layer) variants."""
    t = SITE_TABLE
    s: dict[str, Site] = {}
    for nm, start in (("resid_pre", "input"), ("resid_mid", "hook"), ("resid_post", "next_input")):
        s[nm] = Site(nm, t[nm].template, ("pos",), layer_pos_setter, start, description=t[nm].description)
        s[nm + "_layer"] = Site(nm + "_layer", t[nm].template, (), layer_setter, start,
                                description=f"the whole {nm} residual stream of a layer (all positions)")
    for nm in ("attn_out", "mlp_out"):
        s[nm] = Site(nm, t[nm].template, ("pos",), layer_pos_setter, description=t[nm].description)
        s[nm + "_layer"] = Site(nm + "_layer", t[nm].template, (), layer_setter,
                                description=f"{nm} of a layer, all positions")
    for nm in ("head_out", "head_q", "head_k", "head_v"):
        kv = nm in ("head_k", "head_v")
        s[nm] = Site(nm, t[nm].template, ("head",), layer_head_vector_setter, kv_heads=kv,
                     description=t[nm].description)
        s[nm + "_by_pos"] = Site(nm + "_by_pos", t[nm].template, ("pos", "head"), layer_pos_head_vector_setter,
                                 kv_heads=kv, description=f"{t[nm].description.split(',')[0]} per layer x position x head")
    s["head_pattern"] = Site("head_pattern", t["head_pattern"].template, ("head",), layer_head_pattern_setter,
                             description=t["head_pattern"].description)
    s["head_pattern_by_pos"] = Site("head_pattern_by_pos", t["head_pattern"].template, ("pos", "head"),
                                    layer_head_pos_pattern_setter,
                                    description="attention pattern row per layer x destination position x head")
    s["neuron"] = Site("neuron", t["neuron"].template, ("neuron",), layer_neuron_setter,
                       description=t["neuron"].description)
    s["neuron_by_pos"] = Site("neuron_by_pos", t["neuron"].template, ("pos", "neuron"), layer_pos_neuron_setter,
                              description="MLP neuron activation per position")
    return s


SITES: dict[str, Site] = _site_table()

#: Shorthands expanding to several sites (TransformerLens' ``get_act_patch_*_every``).
SITE_GROUPS: dict[str, list[str]] = {
    "block_every": ["resid_pre", "attn_out", "mlp_out"],
    "resid_every": ["resid_pre", "resid_mid", "resid_post"],
    "heads_every": ["head_out", "head_q", "head_k", "head_v", "head_pattern"],
    "heads_every_by_pos": ["head_out_by_pos", "head_q_by_pos", "head_k_by_pos", "head_v_by_pos",
                           "head_pattern_by_pos"],
}


def expand_sites(names: Sequence[str], field: str = "sites") -> list[str]:
    """Expand group names (``block_every``, ...) and check every site exists.

    Raises:
        PatchingError: an unknown site; the message lists the known ones.
    """
    out: list[str] = []
    for i, n in enumerate(names):
        for m in SITE_GROUPS.get(n, [n]):
            if m not in SITES:
                raise PatchingError(
                    f"{field}[{i}]: unknown site {n!r}; use one of {sorted(SITES)} or a group {sorted(SITE_GROUPS)}"
                )
            if m not in out:
                out.append(m)
    return out


# ---------------------------------------------------------------------------------------------
# Inputs: equal lengths, no padding, layers.
# ---------------------------------------------------------------------------------------------


def check_same_length(model, clean: Sequence[str], corrupted: Sequence[str], field: str = "pairs"
                      ) -> list[tuple[list[int], list[int]]]:
    """Tokenize each (clean, corrupted) pair and require equal lengths (position-wise patching).

    Returns:
        ``[(clean_ids, corrupted_ids), ...]`` (BOS included per the model spec).

    Raises:
        TokenizationError: a pair tokenizes to different lengths; the message shows both
            tokenizations side by side, position by position, and how to fix it.
    """
    out = []
    for i, (c, x) in enumerate(zip(clean, corrupted)):
        ci, xi = encode(model, c), encode(model, x)
        if len(ci) != len(xi):
            cs, xs = str_tokens(model, ci), str_tokens(model, xi)
            lines = [f"{'pos':>4}  {'clean':<22} {'corrupted':<22}"]
            for p in range(max(len(cs), len(xs))):
                a = repr(cs[p]) if p < len(cs) else "-"
                b = repr(xs[p]) if p < len(xs) else "-"
                mark = "" if p < len(cs) and p < len(xs) and cs[p] == xs[p] else "  <-"
                lines.append(f"{p:>4}  {a:<22} {b:<22}{mark}")
            raise TokenizationError(
                f"{field}[{i}]: clean and corrupted prompts must tokenize to the same length for "
                f"position-wise patching, but clean {c!r} is {len(ci)} tokens and corrupted {x!r} is "
                f"{len(xi)} tokens:\n" + "\n".join(lines) + "\nReword one prompt (e.g. pick a corrupted "
                "word that is as many tokens as the clean one) so both have the same number of tokens."
            )
        out.append((ci, xi))
    return out


# ---------------------------------------------------------------------------------------------
# The cached run.
# ---------------------------------------------------------------------------------------------

def _strip_cache(x):
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        Cache = ()  # type: ignore
    return None if isinstance(x, Cache) else x


@dataclass
class CachedRun:
    """One forward pass over a batch of equal-length prompts, with what replays need.

    Attributes:
        tokens: ``[n, pos]`` token ids (no padding: prompts in a run have equal length).
        block_inputs: per block ``i`` (and ``n_layers`` = the input of ``ln_final``): the residual
            ``[n, pos, d_model]`` and the block's other call arguments (``args``, ``kwargs``), with
            any KV cache removed and ``use_cache=False``.
        acts: cached activations ``{hook_name: [n, ...]}`` (only the names asked for).
        logits: ``[n, d_vocab]`` the model's logits at the last position (unnormalised).
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
def cache_run(model, tokens: Int[torch.Tensor, "n pos"], hook_names: Sequence[str] = ()) -> CachedRun:
    """Run the model once on ``tokens`` recording block inputs, the named activations and the
    last-position logits. Prompts must share one length (no padding)."""
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
    try:  # every hook is registered inside the try, so each one registered is removed
        for i in range(n_layers):
            handles.append(model.blocks[i].register_forward_pre_hook(partial(_pre_adapter, fn=pre, i=i),
                                                                     with_kwargs=True))
        handles.append(model.ln_final.register_forward_pre_hook(partial(_pre_adapter, fn=pre, i=n_layers),
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

def is_oom(e: BaseException) -> bool:
    """An out-of-memory error (CUDA's ``OutOfMemoryError`` or a RuntimeError saying so)."""
    oom_cls = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_cls is not None and isinstance(e, oom_cls):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def run_chunked(fn: Callable[[slice], None], n: int, batch_size: int, align: int = 1) -> int:
    """Call ``fn(slice)`` over ``range(n)`` in chunks; on an out-of-memory error halve the chunk
    (keeping it a multiple of ``align``) and retry the same chunk. Returns the final chunk size.

    Raises:
        the OOM error itself when a chunk of ``align`` rows does not fit.
    """
    bs = max(align, (int(batch_size) // align) * align)
    i = 0
    while i < n:
        sl = slice(i, min(n, i + bs))
        try:
            fn(sl)
        except Exception as e:  # re-raised unless out of memory
            if not is_oom(e) or bs <= align:
                raise
            bs = max(align, ((bs // 2) // align) * align)
            log.warning("patching: out of memory, halving the batch to %d variants and retrying", bs)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        i = sl.stop
    return bs


def auto_batch_size(model, seq_len: int, budget_fraction: float = 0.3, cap: int = 512) -> int:
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


def _replay(model, run: CachedRun, jobs: list[PatchJob], rows: list[tuple[int, int]]
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
                        fn = partial(_patch_hook, setter=job.site.setter, rows=rws, index=index,
                                     source=src, src_rows=src_rows)
                        if not hook_dict:
                            hook_dict = model.hook_dict
                        hp = hook_dict[job.site.hook_name(lay)]
                        handles.append(hp.register_forward_hook(fn))
                x = xn if x is None else torch.cat([x, xn], 0)
                base_order = torch.cat([base_order, nb])
            if L == n_layers:
                break
            a, kw = run.block_call(L, base_order)
            out = model.blocks[L](x, *a, **kw)
            x = out[0] if isinstance(out, tuple) else out
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


def _patch_hook(module, inputs, output, setter, rows, index, source, src_rows):
    # As HookPoint.add_hook: present the activation in TransformerLens' layout (e.g. hook_z as
    # [batch, pos, head, d_head]) and convert the patched tensor back.
    conv = getattr(module, "hook_conversion", None)
    act = conv.convert(output) if conv is not None else output
    act = setter(act, rows, index, source, src_rows)
    return conv.revert(act) if conv is not None else act


@torch.no_grad()
def patch_rows(
    model,
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
            results[j] = torch.full((len(job), vals.shape[-1]), float("nan"))
            results[j][idx] = vals
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
            if results[j] is None:
                results[j] = torch.full((len(jobs[j]), vals.shape[-1]), float("nan"))
            results[j][v] = vals[r]
        if progress:
            progress(len(chunk))

    run_chunked(do, len(todo), int(batch_size))
    return [r if r is not None else torch.zeros((0, 0)) for r in results]


def _index_df(model, site: Site, n_pos: int, layers=None, index_df=None, neurons=None) -> pd.DataFrame:
    if index_df is not None:
        return index_df.reset_index(drop=True)
    layers = list(layers) if layers is not None else list(range(model.cfg.n_layers))
    axes = ("layer",) + site.axes
    rows: list = []
    for L in layers:
        rng = {"layer": [L], "pos": list(range(n_pos)), "head": list(range(head_count(model, L, site.kv_heads)))}
        if "neuron" in site.axes:
            rng["neuron"] = check_neurons(model, L, neurons)
        rows += list(itertools.product(*[rng[a] for a in axes]))
    return pd.DataFrame(rows, columns=list(axes))


# ---------------------------------------------------------------------------------------------
# Input checks shared by the kind's check() and the engine.
# ---------------------------------------------------------------------------------------------

def _pad_id(model) -> int | None:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def check_unpadded(model, tokens, field: str = "tokens",
                   attention_mask: Int[torch.Tensor, "batch pos"] | None = None) -> Int[torch.Tensor, "batch pos"]:
    """The ``[batch, pos]`` token tensor of equal-length, unpadded prompts.

    Args:
        model: the hooked model (its tokenizer's padding token is looked for).
        tokens: a ``[batch, pos]`` tensor or a :class:`tracekit.tokens.Batch`.
        field: argument name quoted in errors.
        attention_mask: optional ``[batch, pos]`` mask; it must be all ones.

    Raises:
        PatchingError: a padded batch (a :class:`Batch` whose prompts differ in length, a mask with
            zeros, rows that end with the padding token, or rows starting with runs of it of
            different lengths): the metric would be read at a pad position. Run prompts of each
            length separately, or use :func:`run_patching`, which groups them by length.
    """
    fix = ("patching reads the metric at the last position of every row and runs without an attention mask, "
           "so prompts of a call must have one token length; patch each length separately (or use "
           "run_patching / the activation_patching kind, which group pairs by length)")
    if isinstance(tokens, Batch):
        if tokens.needs_mask:
            raise PatchingError(f"{field}: a padded batch (prompt lengths {tokens.lengths}); {fix}")
        tokens = tokens.tokens
    if not torch.is_tensor(tokens) or tokens.ndim != 2 or tokens.shape[1] == 0:
        raise PatchingError(f"{field}: expected a [batch, pos] tensor of token ids, got "
                            f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    if attention_mask is not None and not bool((attention_mask != 0).all()):
        raise PatchingError(f"{field}: attention_mask has padding (zeros); {fix}")
    pad = _pad_id(model)
    if pad is not None:
        ends = (tokens[:, -1] == pad).nonzero().flatten().tolist()
        if ends:
            raise PatchingError(f"{field}: row {ends[0]} ends with the padding token (id {pad}): a right-padded "
                                f"batch; {fix}")
        is_pad = (tokens == pad).long()
        lead = torch.cumprod(is_pad, dim=1).sum(1)
        if tokens.shape[0] > 1 and int(lead.max()) != int(lead.min()):
            raise PatchingError(f"{field}: rows start with {sorted(set(lead.tolist()))} padding tokens (id {pad}): "
                                f"a left-padded batch; {fix}")
    return tokens


def resolve_layers(n_layers: int, layers: Sequence[int] | None, field: str = "layers") -> list[int]:
    """Block indices ``0 .. n_layers-1``, sorted and unique; negative counts from the end; None = all
    (:func:`tracekit.core.sites.check_layers`).

    Raises:
        SiteError (a PatchingError): a layer out of range (naming ``field``).
    """
    return check_layers(n_layers, layers, field)


def baseline_members(clean_ids: Sequence[Sequence[int]], population_ids: Sequence[Sequence[int]], mode: str,
                     population: str = "the pairs' clean prompts", field: str = "ablations") -> list[list[int]]:
    """Which baseline prompts a ``mean``/``resample`` ablation of each pair may use.

    For pair ``i`` (clean prompt of ``P`` tokens): every population prompt with at least ``P``
    tokens (aligned by position from the end) whose tokens differ from pair ``i``'s clean prompt
    (a prompt is never its own baseline).

    Returns:
        Per pair, the population indices.

    Raises:
        PatchingError: fewer than :data:`MIN_MEAN_POPULATION` (``mean``) or
            :data:`MIN_RESAMPLE_POPULATION` (``resample``) such prompts for some pair; the message
            names the pair, the population and the fix (more pairs or ``baseline_prompts``).
    """
    need = MIN_MEAN_POPULATION if mode == "mean" else MIN_RESAMPLE_POPULATION
    out = []
    pops = [list(map(int, p)) for p in population_ids]
    for i, c in enumerate(clean_ids):
        c = list(map(int, c))
        ok = [m for m, p in enumerate(pops) if len(p) >= len(c) and p != c]
        if len(ok) < need:
            what = "a mean over" if mode == "mean" else "a draw from"
            raise PatchingError(
                f"{field}: {mode!r} ablation of pairs[{i}] ({len(c)} tokens) is {what} baseline prompts other than "
                f"its own clean prompt with at least {len(c)} tokens (aligned by position from the end); it needs "
                f"at least {need}, but {population} ({len(pops)} prompt(s)) hold {len(ok)}. Add pairs, give "
                f"baseline_prompts (at least {need} prompts of {len(c)}+ tokens), or drop {mode!r} from ablations.")
        out.append(ok)
    return out


def _tail(act: torch.Tensor, n_pos: int, site: Site) -> torch.Tensor:
    """The last ``n_pos`` positions of a batched activation (patterns: destination and source)."""
    if site.hook.endswith("hook_pattern"):
        return act[:, :, -n_pos:, -n_pos:]
    return act[:, -n_pos:]


def _population_acts(model, population_ids: Sequence[Sequence[int]], hooks: Sequence[str]
                     ) -> dict[int, tuple[list[int], dict[str, torch.Tensor]]]:
    """Activations of the baseline prompts, one unpadded forward per token length:
    ``{length: (population indices, {hook: [n, ...]})}``."""
    dev = model_device(model)
    names = set(hooks)
    by_len: dict[int, list[int]] = {}
    for m, p in enumerate(population_ids):
        by_len.setdefault(len(p), []).append(m)
    out = {}
    for L, idx in sorted(by_len.items()):
        toks = torch.tensor([list(population_ids[m]) for m in idx], dtype=torch.long, device=dev)
        _, cache = model.run_with_cache(toks, names_filter=names.__contains__)
        out[L] = (idx, {h: cache[h] for h in names})
    return out


def _ablation_source(pop_acts, hook: str, site: Site, n_pos: int, chosen: Sequence[Sequence[int]]
                     ) -> torch.Tensor:
    """``[n, ...]``: per pair the mean of the chosen population prompts' activations (aligned from the end)."""
    rows = []
    for members in chosen:
        want = set(members)
        parts = []
        for idx, acts in pop_acts.values():
            sel = [r for r, m in enumerate(idx) if m in want]
            if sel:
                a = acts[hook]
                parts.append(_tail(a[torch.tensor(sel, device=a.device)], n_pos, site))
        cat = torch.cat(parts)
        rows.append(cat.float().mean(0).to(cat.dtype))
    return torch.stack(rows)


def count_variants(model, lengths: Sequence[int], sites: Sequence[str], n_modes: int,
                   layers: Sequence[int] | None = None, neuron_layers: Sequence[int] | None = None,
                   neurons: Sequence[int] | None = None) -> int:
    """How many patched runs :func:`run_patching` makes (for progress bars)."""
    n_layers = int(model.cfg.n_layers)
    lay = resolve_layers(n_layers, layers)
    nlay = resolve_layers(n_layers, neuron_layers or [], "neuron_layers")
    total = 0
    for s in expand_sites(sites):
        site = SITES[s]
        for P in lengths:
            total += len(_index_df(model, site, P, nlay if s.startswith("neuron") else lay, neurons=neurons))
    return total * n_modes


# ---------------------------------------------------------------------------------------------
# run_patching: every direction / ablation x site x pair.
# ---------------------------------------------------------------------------------------------

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
    """

    mode: str
    site: Site
    index: pd.DataFrame
    pairs: list[int]
    n_pos: int
    values: Float[torch.Tensor, "rows n_metrics"]
    baseline_n: list[int] | None = None
    baseline_source: list[int] | None = None


@dataclass
class PatchingRun:
    """What :func:`run_patching` returns.

    Attributes:
        metrics: metric names (columns of every ``values``).
        clean, corrupted: ``[n_pairs, n_metrics]`` each pair's unpatched clean / corrupted scores.
        jobs: one :class:`JobResult` per (length group, mode, site).
        lengths: each pair's token length.
        population_size: number of baseline prompts (``mean``/``resample``).
    """

    metrics: list[str]
    clean: Float[torch.Tensor, "pairs n_metrics"]
    corrupted: Float[torch.Tensor, "pairs n_metrics"]
    jobs: list[JobResult]
    lengths: list[int]
    population_size: int = 0


def _refuse_side_inputs(model, run: "CachedRun", rows_a: torch.Tensor, rows_b: torch.Tensor) -> None:
    """Refuse patching between runs whose blocks also read token-dependent inputs besides the
    residual stream: patching a site could never restore (or break) the other run, so every
    number would understate the site's effect."""
    varying = run.varying_inputs(rows_a, rows_b)
    if varying:
        from .model.architectures import MethodRefused, architecture_name

        raise MethodRefused(
            f"activation patching is refused on {architecture_name(model)}: its blocks read token-dependent "
            f"inputs that bypass the residual stream ({', '.join(varying[:3])}), so patching the clean "
            "run's activations into the corrupted run cannot restore the clean run.")


def _require_sites(model, sites: Sequence[str], layers: Sequence[int], neuron_layers: Sequence[int],
                   neurons: Sequence[int] | None) -> None:
    """Refuse sites this model's blocks do not have (heads on blocks without per-head outputs,
    neurons on mixture-of-experts MLPs), naming the architecture."""
    from .hooks import check_hooks

    if not hasattr(model, "blocks"):
        return
    for s in sites:
        site = SITES[s]
        lay = neuron_layers if s.startswith("neuron") else layers
        check_hooks(model, [site.hook_name(int(L)) for L in lay], f"sites ({s})")
        if site.hook.startswith("attn."):
            require(model, f"patching site {s}", layers=lay, need=("heads",))
        elif s.startswith("neuron"):
            require(model, f"patching site {s}", layers=lay, need=("neurons",))
        elif s.startswith(("attn_out", "mlp_out")):
            require(model, f"patching site {s}", layers=lay, need=(s.split("_")[0],))


def _ids_tensor(ids, field: str) -> torch.Tensor | None:
    if ids is None:
        return None
    t = torch.as_tensor([[int(x) for x in ([r] if isinstance(r, int) else r)] for r in ids], dtype=torch.long)
    if t.ndim != 2 or t.shape[1] == 0:
        raise PatchingError(f"{field}: give one or more token ids per pair, the same number for every pair")
    return t


@torch.no_grad()
def run_patching(
    model,
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
) -> PatchingRun:
    """Patch every site of ``sites`` in every mode of ``modes`` for every (clean, corrupted) pair.

    Pairs of one token length share a cached run and replay batches; pairs of different lengths are
    independent groups (never padded). Metrics (:mod:`tracekit.metrics`) are read at each prompt's
    last token.

    Args:
        model: a hooked model (TransformerBridge).
        clean_ids, corrupted_ids: per pair the token ids (BOS included as the model spec says); a
            pair's two prompts have the same length.
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
        batch_size: variants per replay batch, or ``auto``.
        skip_unchanged: bit-exact no-op patches take the cached run's value without replay.
        progress: called with the number of variants finished.

    Returns:
        :class:`PatchingRun`: baselines and one :class:`JobResult` per (group, mode, site).

    Raises:
        PatchingError: unknown site/mode/metric, layers or neurons out of range, pairs of unequal
            length, missing foils for ``logit_diff``, or a baseline population too small.
    """
    n = len(clean_ids)
    if n == 0 or len(corrupted_ids) != n:
        raise PatchingError(f"pairs: need one corrupted prompt per clean prompt (got {n} clean, "
                            f"{len(corrupted_ids)} corrupted)")
    clean_ids = [list(map(int, c)) for c in clean_ids]
    corrupted_ids = [list(map(int, c)) for c in corrupted_ids]
    for i, (c, x) in enumerate(zip(clean_ids, corrupted_ids)):
        if len(c) != len(x) or not c:
            raise PatchingError(f"pairs[{i}]: clean ({len(c)} tokens) and corrupted ({len(x)} tokens) must have "
                                "the same, non-zero length (see check_same_length)")
    sites = expand_sites(sites)
    for i, m in enumerate(modes):
        if m not in DIRECTIONS + ABLATIONS:
            raise PatchingError(f"modes[{i}]: unknown mode {m!r}; use {list(DIRECTIONS)} or {list(ABLATIONS)}")
    metric_names = list(metrics)
    for i, m in enumerate(metric_names):
        if m not in M.METRICS:
            raise PatchingError(f"metrics[{i}]: unknown metric {m!r}; use one of {sorted(M.METRICS)}")
    n_layers = int(model.cfg.n_layers)
    lay = resolve_layers(n_layers, layers, "layers")
    nlay = resolve_layers(n_layers, neuron_layers or [], "neuron_layers")
    if any(s.startswith("neuron") for s in sites) and not nlay:
        raise PatchingError("neuron_layers: neuron sites need the layers whose MLP neurons are patched")
    if any(s.startswith("neuron") for s in sites):
        require(model, "neuron patching", layers=nlay, need=("neurons",))
        for L in nlay:
            check_neurons(model, L, neurons)
    target = _ids_tensor(target_ids, "target")
    foil = _ids_tensor(foil_ids, "foil")
    if target is None or target.shape[0] != n or (foil is not None and foil.shape != target.shape):
        raise PatchingError("target/foil: give per pair the same number of target and foil token ids")
    if "logit_diff" in metric_names and foil is None:
        raise PatchingError("foil: the logit_diff metric needs a foil token per pair; add foils or drop logit_diff")

    # the baseline population of mean / resample ablations
    pop = [list(map(int, p)) for p in baseline_ids] if baseline_ids is not None else clean_ids
    pop_name = "baseline_prompts" if baseline_ids is not None else "the pairs' clean prompts"
    chosen: dict[str, list[list[int]]] = {}
    for mode in ("mean", "resample"):
        if mode in modes:
            chosen[mode] = baseline_members(clean_ids, pop, mode, pop_name)
    if "resample" in chosen:
        gen = torch.Generator().manual_seed(int(seed))
        chosen["resample"] = [[ok[int(torch.randint(len(ok), (1,), generator=gen))]] for ok in chosen["resample"]]

    dev = model_device(model)
    hooks = sorted({SITES[s].hook_name(L) for s in sites for L in (nlay if s.startswith("neuron") else lay)})
    _require_sites(model, sites, lay, nlay, neurons)
    with enabled_hooks(model, hooks):
        pop_acts = _population_acts(model, pop, hooks) if chosen else {}
        lengths = [len(c) for c in clean_ids]
        groups: dict[int, list[int]] = {}
        for i, L in enumerate(lengths):
            groups.setdefault(L, []).append(i)
        Mn = len(metric_names)
        clean_vals = torch.full((n, Mn), float("nan"))
        corr_vals = torch.full((n, Mn), float("nan"))
        out_jobs: list[JobResult] = []
        for P_len, members in sorted(groups.items()):
            g = len(members)
            toks = torch.tensor([clean_ids[i] for i in members] + [corrupted_ids[i] for i in members], device=dev)
            run = cache_run(model, toks, hooks)
            if any(m in DIRECTIONS for m in modes):
                _refuse_side_inputs(model, run, torch.arange(g), torch.arange(g) + g)
            midx = torch.tensor(members)
            inputs = M.MetricInputs(target[midx].to(dev), None if foil is None else foil[midx].to(dev),
                                    torch.log_softmax(run.logits[:g].float(), -1))

            def row_metric(logits, br, inputs=inputs, g=g):
                return M.compute_metrics(metric_names, logits, inputs.rows(br % g))

            base = row_metric(run.logits, torch.arange(2 * g, device=run.logits.device)).float().cpu()
            clean_vals[midx], corr_vals[midx] = base[:g], base[g:]

            jobs, meta = [], []
            b = torch.arange(g)
            for mode in modes:
                for s in sites:
                    site = SITES[s]
                    idf = _index_df(model, site, P_len, nlay if s.startswith("neuron") else lay, neurons=neurons)
                    V = len(idf)
                    source: dict[int, torch.Tensor] = {}
                    if mode == "denoising":
                        base_rows, src_rows = b + g, b
                    elif mode == "noising":
                        base_rows, src_rows = b, b + g
                    elif mode == "zero":
                        base_rows, src_rows = b, torch.zeros_like(b)
                    else:
                        base_rows, src_rows = b, b
                    for L in idf["layer"].unique().tolist():
                        act = run.acts[site.hook_name(int(L))]
                        if mode == "zero":
                            source[int(L)] = torch.zeros_like(act[:1])
                        elif mode in chosen:
                            source[int(L)] = _ablation_source(pop_acts, site.hook_name(int(L)), site, P_len,
                                                              [chosen[mode][i] for i in members])
                        else:
                            source[int(L)] = act
                    jobs.append(PatchJob(
                        site=site, layer=torch.tensor(idf["layer"].to_numpy(), dtype=torch.long).repeat_interleave(g),
                        index={a: torch.tensor(idf[a].to_numpy(), dtype=torch.long).repeat_interleave(g).to(dev)
                               for a in site.axes},
                        base_rows=base_rows.repeat(V).to(dev), source=source, src_rows=src_rows.repeat(V).to(dev)))
                    bn = bs = None
                    if mode in chosen:
                        bn = [len(chosen[mode][i]) for i in members]
                        if mode == "resample":
                            bs = [chosen[mode][i][0] for i in members]
                    meta.append((mode, site, idf, bn, bs))
            results = patch_rows(model, run, jobs, row_metric, batch_size, skip_unchanged, progress=progress)
            for (mode, site, idf, bn, bs), vals in zip(meta, results):
                out_jobs.append(JobResult(mode, site, idf, list(members), P_len, vals, bn, bs))
    return PatchingRun(metric_names, clean_vals, corr_vals, out_jobs, lengths, len(pop) if chosen else 0)


# ---------------------------------------------------------------------------------------------
# batched_activation_patch: one kind of site everywhere, for notebooks.
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def batched_activation_patch(
    model,
    base_tokens: Int[torch.Tensor, "batch pos"] | Batch,
    source_tokens: Int[torch.Tensor, "batch pos"] | Batch | None,
    patching_metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    patch_setter: Callable,
    activation_name: str,
    index_df: pd.DataFrame | None = None,
    layers: Sequence[int] | None = None,
    neurons: Sequence[int] | None = None,
    batch_size: int | str = "auto",
    skip_unchanged: bool = True,
    source: str | None = None,
    return_index_df: bool = False,
):
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
        layers, neurons: restrict the default index (block indices, negative from the end).
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
    """
    if activation_name not in SITES:
        raise PatchingError(f"activation_name: unknown site {activation_name!r}; use one of {sorted(SITES)}")
    site = SITES[activation_name]
    if patch_setter is not site.setter:
        site = Site(site.name, site.hook, site.axes, patch_setter, site.start, site.kv_heads)
    base_tokens = check_unpadded(model, base_tokens, "base_tokens")
    B, P_len = base_tokens.shape
    explicit = index_df is not None
    if layers is not None:
        layers = resolve_layers(int(model.cfg.n_layers), layers, "layers")
    idf = _index_df(model, site, P_len, layers, index_df, neurons)
    hooks = sorted({site.hook_name(int(L)) for L in idf["layer"].unique()})
    _require_sites(model, [activation_name], sorted({int(x) for x in idf['layer']}), sorted({int(x) for x in idf['layer']}), None)
    with enabled_hooks(model, hooks):
        dev = model_device(model)
        if source_tokens is not None:
            source_tokens = check_unpadded(model, source_tokens, "source_tokens")
            if source_tokens.shape != base_tokens.shape:
                raise PatchingError(f"source_tokens {tuple(source_tokens.shape)} and base_tokens "
                                    f"{tuple(base_tokens.shape)} must have the same shape")
            run = cache_run(model, torch.cat([base_tokens, source_tokens]).to(dev), hooks)
            _refuse_side_inputs(model, run, torch.arange(B), torch.arange(B) + B)
            src = {int(L): run.acts[site.hook_name(int(L))] for L in idf["layer"].unique()}
            src_rows = torch.arange(B) + B
        else:
            if source not in ("zero", "mean"):
                raise PatchingError("source: without source_tokens, use source='zero' or 'mean'")
            ids = base_tokens.tolist()
            chosen = baseline_members(ids, ids, "mean", "the other prompts of base_tokens", "source") \
                if source == "mean" else None
            run = cache_run(model, base_tokens.to(dev), hooks)
            src = {}
            for L in idf["layer"].unique():
                h = site.hook_name(int(L))
                a = run.acts[h]
                if chosen is None:
                    src[int(L)] = torch.zeros_like(a[:1])
                else:
                    src[int(L)] = _ablation_source({P_len: (list(range(B)), run.acts)}, h, site, P_len, chosen)
            src_rows = torch.zeros(B, dtype=torch.long) if chosen is None else torch.arange(B)
        V = len(idf)
        lay = torch.tensor(idf["layer"].to_numpy(), dtype=torch.long)
        b = torch.arange(B)
        job = PatchJob(
            site=site,
            layer=lay.repeat_interleave(B),
            index={a: torch.tensor(idf[a].to_numpy(), dtype=torch.long).repeat_interleave(B).to(dev) for a in site.axes},
            base_rows=b.repeat(V).to(dev),
            source=src,
            src_rows=src_rows.repeat(V).to(dev),
        )
        (vals,) = patch_rows(model, run, [job], lambda lg, br: patching_metric(lg, br % B)[:, None],
                             batch_size, skip_unchanged)
    out = vals[:, 0].reshape(V, B).T.contiguous()
    if not explicit:
        out = out.reshape(B, *[idf[c].nunique() for c in idf.columns])
    return (out, idf) if return_index_df else out


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
