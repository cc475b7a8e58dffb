"""Fast residual reads for lens-style methods: only the activations read, only the positions read,
and no forward work after the last hook read.

``tokens.run_with_cache`` keeps every cached hook at every position and runs the whole forward pass,
including the final norm and the unembedding of *every* position (``[batch, pos, d_vocab]`` logits),
which a logit lens then throws away: it reads each hidden state at a few positions and applies the
final norm + unembedding to those vectors only. :func:`residual_stream` gathers the requested
positions inside the hooks and stops the forward pass as soon as every requested hook has fired
(for ``blocks.{n_layers-1}.hook_resid_post`` that skips ``ln_final`` and ``unembed`` over the whole
batch); :func:`lens_readout` then computes every per-row statistic a lens table needs in a few
batched tensor ops (chunked, so memory stays near the weights), with no Python loop per row.

Numbers are those of ``run_with_cache`` + :class:`tracekit.model.readout.Readout`: the residuals are the
same tensors (bit-identical), the readout is ``Readout(model).log_probs`` (the final norm exists once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int

from .model.info import HookedModel
from .model.readout import Readout
from .tokens import Batch, forward_kwargs

__all__ = ["lens_readout", "residual_stream", "activations_at"]


class _AllHooksRead(Exception):
    """Raised by the last hook read to end the forward pass early (caught in residual_stream)."""


@torch.no_grad()
def residual_stream(
    model: HookedModel,
    batch: Batch,
    hook_names: Sequence[str],
    positions: Int[torch.Tensor, " batch"] | Int[torch.Tensor, "batch n_read"] | None = None,
    stop_early: bool = True,
) -> Float[torch.Tensor, "hook batch n_read d_model"] | Float[torch.Tensor, "hook batch d_model"]:
    """Activations of ``hook_names`` on a batch, read at ``positions`` only, stacked in the given order.

    Args:
        model: a hooked model (TransformerBridge).
        batch: a padded batch from :func:`tracekit.tokens.tokenize`.
        hook_names: TransformerLens hook names whose output is ``[batch, pos, d]`` (e.g.
            ``blocks.{L}.hook_resid_pre`` / ``hook_resid_post``); checked with ``check_hooks``.
        positions: ``None`` (every padded position), ``[batch]`` (one position per prompt, e.g.
            ``batch.last``) or ``[batch, n_read]`` padded indices.
        stop_early: end the forward pass once every hook has fired (default). The activations do
            not depend on it; it only skips the work after them (later blocks, the final norm and
            the unembedding of every position).

    Returns:
        ``[hook, batch, d]`` for 1-D ``positions``, else ``[hook, batch, n_read or pos, d]``;
        float, on the model's device, in the model's dtype (residual-stream units).

    Raises:
        HookError: an unknown hook name, or one that never fired.

    Source: TransformerLens ``run_with_cache(names_filter=...)``/``stop_at_layer``, narrowed to
    the read positions (the hook stores ``act[rows, positions]`` instead of ``act``).
    """
    from .errors import HookError
    from .hooks import check_hooks, enabled_hooks, fwd_hooks

    wanted = list(dict.fromkeys(hook_names))
    check_hooks(model, wanted, "hooks")
    b = batch.size
    rows = torch.arange(b, device=batch.tokens.device)
    if positions is not None:
        positions = torch.as_tensor(positions, device=batch.tokens.device)
        if positions.ndim == 2:
            rows = rows[:, None]
    got: dict[str, torch.Tensor] = {}

    def make_hook(name: str):
        def hook(act, hook=None):
            got[name] = act if positions is None else act[rows, positions]
            if stop_early and len(got) == len(wanted):
                raise _AllHooksRead

        return hook

    with enabled_hooks(model, wanted), fwd_hooks(model, [(n, make_hook(n)) for n in wanted]):
        try:
            model(batch.tokens, **forward_kwargs(batch))
        except _AllHooksRead:
            pass
    missing = [n for n in wanted if n not in got]
    if missing:
        raise HookError(f"hooks: {missing} never fired in the forward pass")
    return torch.stack([got[n] for n in hook_names])


@torch.no_grad()
def activations_at(
    model: HookedModel,
    batch: Batch,
    hook_names: Sequence[str],
    positions: Int[torch.Tensor, " batch"],
    optional: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """Each hook's activation at one position per prompt, ``act[b, positions[b]]`` (any trailing
    shape: ``[batch, d_model]`` for residual hooks, ``[batch, n_heads, d_head]`` for ``attn.hook_z``).

    Memory is that of the rows read, not of every position of every hook (``run_with_cache`` keeps
    ``[batch, pos, ...]`` per hook). A hook that fires more than once in a forward pass keeps its
    last value, as ``run_with_cache`` does (NanoChat calls its final norm after the embedding too),
    so the forward pass always runs to the end. Gated hooks are enabled for the call.

    Args:
        hook_names: hooks whose output is ``[batch, pos, ...]``.
        positions: ``[batch]`` padded index read in each prompt.
        optional: names that may not fire on this architecture (e.g. ``hook_pos_embed`` under rotary
            positions); absent from the result when they do not.

    Raises:
        HookError: an unknown name, or a required hook that never fired.
    """
    from .errors import HookError
    from .hooks import check_hooks, enabled_hooks, fwd_hooks

    wanted = list(dict.fromkeys([*hook_names, *optional]))
    required = [n for n in wanted if n not in set(optional)]
    check_hooks(model, [n for n in wanted if n in required or n in model.hook_dict], "hooks")
    wanted = [n for n in wanted if n in model.hook_dict]
    rows = torch.arange(batch.size, device=batch.tokens.device)
    pos = torch.as_tensor(positions, device=batch.tokens.device)
    got: dict[str, torch.Tensor] = {}

    def make_hook(name: str):
        def hook(act, hook=None):
            got[name] = act[rows, pos].detach().clone()

        return hook

    with enabled_hooks(model, wanted), fwd_hooks(model, [(n, make_hook(n)) for n in wanted]):
        model(batch.tokens, **forward_kwargs(batch))
    missing = [n for n in required if n not in got]
    if missing:
        raise HookError(f"hooks: {missing} never fired in the forward pass")
    return got


@torch.no_grad()
def lens_readout(
    model: HookedModel,
    resid: Float[torch.Tensor, "... d_model"],
    target_ids: Sequence[int] = (),
    top_k: int = 10,
    chunk_rows: int = 512,
) -> dict[str, torch.Tensor]:
    """Every statistic a logit-lens table reads from residual vectors, batched, no per-row loop.

    Each vector goes through the final norm (recomputed on it) and the unembedding
    (``Readout(model).log_probs``, float32), then, per vector:

    * ``target_log_prob`` ``[..., T]``: natural-log probability of each target id;
    * ``target_rank`` ``[..., T]``: 1 + number of tokens with a strictly higher log-prob;
    * ``entropy`` ``[...]``: ``-sum p log p`` in nats;
    * ``top_prob`` / ``top_id`` ``[..., k]``: the ``top_k`` most probable tokens (probabilities).

    Same formulas as the logit lens' rows (``exp`` of the log-probs, ``topk`` on the probabilities),
    so values are identical, computed ``chunk_rows`` vectors at a time so the ``[rows, d_vocab]``
    buffers stay small.

    Returns:
        A dict of CPU tensors with the shapes above (``...`` = ``resid.shape[:-1]``).
    """
    readout = Readout(model)
    lead = resid.shape[:-1]
    flat = resid.reshape(-1, resid.shape[-1])
    n = flat.shape[0]
    k = min(int(top_k), int(model.cfg.d_vocab))
    t = torch.tensor(list(target_ids), dtype=torch.long, device=flat.device)
    out = {"target_log_prob": torch.empty(n, len(t)), "target_rank": torch.empty(n, len(t), dtype=torch.long),
           "entropy": torch.empty(n), "top_prob": torch.empty(n, k), "top_id": torch.empty(n, k, dtype=torch.long)}
    for s in range(0, n, max(1, int(chunk_rows))):
        lp = readout.log_probs(flat[s:s + chunk_rows])  # [r, vocab], float32
        probs = lp.exp()
        out["entropy"][s:s + len(lp)] = -(probs * lp).sum(-1).cpu()
        tp, ti = probs.topk(k, dim=-1)
        out["top_prob"][s:s + len(lp)] = tp.cpu()
        out["top_id"][s:s + len(lp)] = ti.cpu()
        if len(t):
            t_lp = lp[:, t]  # [r, T]
            out["target_log_prob"][s:s + len(lp)] = t_lp.cpu()
            for j in range(len(t)):  # int32 counts: half the time of a bool -> int64 sum over the vocabulary
                above = (lp > t_lp[:, j:j + 1]).sum(-1, dtype=torch.int32)
                out["target_rank"][s:s + len(lp), j] = (above + 1).cpu()
        del lp, probs
    return {key: v.reshape(*lead, *v.shape[1:]) for key, v in out.items()}
