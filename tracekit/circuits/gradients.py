"""One gradient pass: a forward run that records activations at named hooks and the gradient of a
metric with respect to each, with gradients enabled only inside the call.

The bridge's parameters have ``requires_grad=False`` and stay that way: the graph is built from
one leaf, the residual stream entering block 0 (``blocks.0.hook_resid_pre``, optionally replaced by
an interpolation for integrated gradients), so no parameter ever gets a ``.grad`` and nothing is
left on the model (every hook is removed in a ``finally``; the kinds run inside
:func:`tracekit.hooks.state_guard` as well).

Memory: :func:`pass_bytes` and :func:`hook_bytes` estimate what one row of a pass holds, so the
engines built on it (AtP, EAP, EAP-IG) choose their row chunks from the memory budget
(:func:`tracekit.core.budget.chunk_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Float, Int

from ..core.sites import hook
from ..hooks import enabled_hooks, fwd_hooks
from ..model.checks import model_dtype
from ..model.info import HookedModel

__all__ = ["GradPass", "gradient_pass", "LEAF_HOOK", "balanced_chunk", "hook_bytes", "pass_bytes"]

#: The hook whose value is made the graph's leaf (the embeddings entering block 0).
LEAF_HOOK = hook("resid_pre", 0)


@dataclass
class GradPass:
    """What :func:`gradient_pass` returns.

    Attributes:
        acts: ``{hook: activation}`` (detached, TransformerLens layout, the model's dtype).
        grads: per metric ``{hook: d metric / d activation}`` (summed over the rows' metrics;
            rows are independent, so row ``i``'s slice is the gradient of its own metric).
        logits: ``[rows, d_vocab]`` float32 logits at the last position.
        values: ``[rows, n_metrics]`` the metrics of the run.
    """

    acts: dict[str, torch.Tensor]
    grads: list[dict[str, torch.Tensor]]
    logits: Float[torch.Tensor, "rows d_vocab"]
    values: Float[torch.Tensor, "rows n_metrics"]


def gradient_pass(model: HookedModel, tokens: Int[torch.Tensor, "rows pos"], hooks: Sequence[str],
                  metric_fns: Sequence[Callable[[torch.Tensor], torch.Tensor]] = (),
                  leaf_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  grad_hooks: Sequence[str] | None = None,
                  extra_hooks: Sequence[tuple[str, Callable]] = ()) -> GradPass:
    """Run ``tokens`` recording ``hooks``; with ``metric_fns`` also backpropagate each metric.

    Args:
        model: a hooked model (TransformerBridge); gated hooks are enabled for the call.
        tokens: ``[rows, pos]`` unpadded token ids on the model's device.
        hooks: hook names to record.
        metric_fns: each ``(logits [rows, d_vocab] at the last position) -> [rows]``; one backward
            pass each (the graph is kept between them). None: a plain forward pass, no gradients.
        leaf_fn: maps the block-0 residual to the value used (integrated gradients' interpolation).
        grad_hooks: hooks whose gradients are kept (default: all of ``hooks``).
        extra_hooks: more ``(hook, fn)`` forward hooks for the call (run after the recording hooks).

    Returns:
        :class:`GradPass`.
    """
    want_grad = bool(metric_fns)
    acts: dict[str, torch.Tensor] = {}
    grads: list[dict[str, torch.Tensor]] = [{} for _ in metric_fns]
    current = [0]
    keep = set(hooks if grad_hooks is None else grad_hooks)

    def record(act, hook, name):
        # ``name`` is the requested (TransformerLens) name; ``hook.name`` may be the bridge's canonical one
        if name == LEAF_HOOK and (want_grad or leaf_fn is not None):
            act = leaf_fn(act) if leaf_fn is not None else act
            if want_grad:
                act = act.detach().requires_grad_(True)
        if name in names:
            acts[name] = act.detach()
        if want_grad and name in keep and act.requires_grad:
            act.register_hook(lambda g, n=name: grads[current[0]].__setitem__(n, g.detach()))
        return act

    names = set(hooks)
    order = [LEAF_HOOK] + sorted(names - {LEAF_HOOK})  # the leaf first: later hooks on its point see it
    hook_list = [(h, partial(record, name=h)) for h in order] + list(extra_hooks)
    with enabled_hooks(model, list(names)), torch.enable_grad() if want_grad else torch.no_grad():
        with fwd_hooks(model, hook_list):
            logits = model(tokens)
        last = logits[:, -1].float()
        vals = []
        for k, fn in enumerate(metric_fns):
            current[0] = k
            m = fn(last)
            vals.append(m.detach())
            m.sum().backward(retain_graph=k + 1 < len(metric_fns))
    values = torch.stack(vals, -1) if vals else torch.zeros(tokens.shape[0], 0)
    return GradPass(acts, grads, last.detach(), values.float())


def _dims(model: HookedModel) -> tuple[int, int, int, int, int, int, int, int]:
    """``(n_layers, d_model, n_heads, n_kv_heads, d_head, d_mlp, d_vocab, bytes per element)``."""
    cfg = model.cfg
    d, H = int(cfg.d_model), int(cfg.n_heads)
    Hkv = int(getattr(cfg, "n_key_value_heads", None) or H)
    dh = int(getattr(cfg, "d_head", None) or d // H)
    dm = int(getattr(cfg, "d_mlp", None) or 4 * d)
    e = torch.empty((), dtype=model_dtype(model)).element_size()
    return int(cfg.n_layers), d, H, Hkv, dh, dm, int(cfg.d_vocab), e


def hook_bytes(model: HookedModel, name: str, n_pos: int) -> int:
    """Bytes of one row's activation at hook ``name`` over ``n_pos`` positions, in the model's
    dtype (an attention pattern / score ``[head, pos, pos]``; a per-head ``q/k/v/z`` ``[pos, head,
    d_head]``; a split q/k/v input or a head result ``[pos, head, d_model]``; an MLP's hidden
    ``[pos, d_mlp]``; anything else ``[pos, d_model]``)."""
    _, d, H, _, dh, dm, _, e = _dims(model)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("hook_pattern", "hook_attn_scores"):
        n = H * n_pos * n_pos
    elif leaf in ("hook_q", "hook_k", "hook_v", "hook_z", "hook_rot_q", "hook_rot_k"):
        n = n_pos * H * dh
    elif leaf in ("hook_q_input", "hook_k_input", "hook_v_input", "hook_result"):
        n = n_pos * H * d
    elif ".mlp." in name and leaf in ("hook_pre", "hook_post", "hook_pre_linear"):
        n = n_pos * dm
    else:
        n = n_pos * d
    return n * e


def pass_bytes(model: HookedModel, n_pos: int, backward: bool = True) -> int:
    """A generous estimate of the bytes one row of ``n_pos`` tokens needs while a forward pass
    (``backward=False``: one block's temporaries live at a time) or a forward + backward pass of
    :func:`gradient_pass` runs, not counting the recorded hooks (:func:`hook_bytes`).

    Counts, in the model's dtype: per block the residual-stream tensors (~12 ``[pos, d_model]``),
    q/k/v/z and their rotations (``[pos, head, d_head]``), three ``[head, pos, pos]`` score/pattern tensors and five
    ``[pos, d_mlp]`` MLP tensors; the logits ``[pos, d_vocab]`` (and their gradient); with
    ``backward`` every block's tensors are kept for the backward pass, plus two blocks' worth of
    gradients (the block being backpropagated)."""
    L, d, H, Hkv, dh, dm, V, e = _dims(model)
    T = int(n_pos)
    block = 12 * T * d + 2 * T * dh * (3 * H + 2 * Hkv) + 3 * H * T * T + 5 * T * dm
    logits = T * V
    if not backward:
        return (2 * block + 2 * T * d + logits) * e + 4 * V * 4
    return ((L + 2) * block + 4 * T * d + 2 * logits) * e + 4 * V * 4


def balanced_chunk(chunk: int, n: int) -> int:
    """The chunk size that splits ``n`` units into as many chunks as ``chunk`` would, evened out
    (``chunk=14, n=15`` -> 8: chunks of 8 and 7, not 14 and 1). A one-row pass runs some models'
    kernels differently from a batch (last-bit differences), so a chunk of one row is left only
    when the budget allows no more."""
    chunk, n = max(1, int(chunk)), max(1, int(n))
    k = -(-n // chunk)
    return -(-n // k)
