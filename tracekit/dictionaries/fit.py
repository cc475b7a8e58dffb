"""The optimisation of one sparse dictionary (SAE or transcoder) on in-memory activations: SAELens'
TopK (+ AuxK), JumpReLU (straight-through estimators) and ReLU (+ L1) losses without SAELens.

See :mod:`tracekit.dictionaries.train` for the losses, the scaling, the seeds and the checkpoints;
sources: SAELens ``sae_lens/saes/topk_sae.py``, ``jumprelu_sae.py``, ``standard_sae.py``,
``training/sae_trainer.py`` (v6.54); Gao et al. 2024 (TopK, AuxK); Rajamanoharan et al. 2024 (JumpReLU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..core.errors import SAEError
from .dictionary import Dictionary

__all__ = ["TRAIN_VERSION", "DictTrainSettings", "fit_dictionary", "to_dictionary"]

#: Version of this trainer's maths, part of every cache key (bump when the weights would change).
TRAIN_VERSION = 1


@dataclass
class DictTrainSettings:
    """How :func:`fit_dictionary` trains one dictionary (the training block's fields, resolved).

    Attributes:
        activation: ``topk`` | ``jumprelu`` | ``relu``. d_sae / k: widths. skip: a skip matrix.
        steps: optimiser steps. batch: tokens per step. lr: Adam's learning rate.
        dead_feature_window: steps without firing after which a feature is dead (AuxK).
        l0_coefficient / bandwidth / init_threshold: JumpReLU. l1_coefficient: ReLU (SAE).
        aux_coefficient: AuxK weight (SAELens default 1). seed: ``(seed, layer)`` seeds everything.
        checkpoint_every: steps between checkpoints. apply_b_dec_to_input: SAE convention.
    """

    activation: str
    d_sae: int
    k: Optional[int]
    steps: int
    batch: int
    lr: float
    dead_feature_window: int
    seed: int
    layer: int = 0
    skip: bool = False
    l0_coefficient: float = 1e-3
    bandwidth: float = 0.05
    init_threshold: float = 0.01
    l1_coefficient: float = 5.0
    aux_coefficient: float = 1.0
    checkpoint_every: int = 100
    apply_b_dec_to_input: bool = False
    dtype: torch.dtype = torch.float32




class _StepFn(torch.autograd.Function):
    """SAELens' ``Step``: ``1[x > threshold]`` with the rectangle-kernel estimator for the threshold."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        ste = (1.0 / bw) * (((x - threshold) / bw).abs() < 0.5).to(x) * grad_output
        return None, (-ste).sum(0), None


class _JumpReLUFn(torch.autograd.Function):
    """SAELens' ``JumpReLU``: ``x * 1[x > threshold]``; threshold gradient by the rectangle kernel."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, threshold: torch.Tensor, bandwidth: float) -> torch.Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold).to(x)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        ste = (threshold / bw) * (((x - threshold) / bw).abs() < 0.5).to(x) * grad_output
        return (x > threshold).to(x) * grad_output, (-ste).sum(0), None


def _scale(v: torch.Tensor) -> float:
    """The scalar that makes ``E ||v||^2 = width`` (SAELens' ``expected_average_only_in``)."""
    ms = float(v.double().pow(2).sum(-1).mean())
    return float(np.sqrt(v.shape[-1] / ms)) if ms > 0 else 1.0


def _params(d_in: int, d_out: int, s: DictTrainSettings, y_mean: torch.Tensor) -> dict[str, torch.Tensor]:
    """Seeded initial parameters: decoder rows random unit directions; encoder columns random unit
    directions (the decoder's transpose for an SAE, as SAELens); ``b_dec`` = the target mean."""
    g = torch.Generator().manual_seed(int(s.seed) * 1_000_003 + int(s.layer))
    W_dec = torch.randn(s.d_sae, d_out, generator=g, dtype=torch.float64)
    W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True)
    if d_in == d_out and s.apply_b_dec_to_input:
        W_enc = W_dec.T.clone()
    else:
        W_enc = torch.randn(d_in, s.d_sae, generator=g, dtype=torch.float64)
        W_enc = W_enc / W_enc.norm(dim=0, keepdim=True)
    p = {"W_enc": W_enc, "b_enc": torch.zeros(s.d_sae, dtype=torch.float64), "W_dec": W_dec,
         "b_dec": y_mean.double().clone()}
    if s.activation == "topk":
        p["W_dec"] = p["W_dec"] * 0.1  # decoder norm is divided out of the output and into the pre-activations
    if s.skip:
        p["W_skip"] = torch.zeros(d_out, d_in, dtype=torch.float64)
    if s.activation == "jumprelu":
        p["threshold"] = torch.full((s.d_sae,), float(s.init_threshold), dtype=torch.float64)
    return {k: v.to(s.dtype).requires_grad_(True) for k, v in p.items()}


def _forward(p: dict[str, torch.Tensor], x: torch.Tensor, s: DictTrainSettings
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(y_hat, fired [d_sae] bool, pre, normalised decoder, sparsity term)`` of a batch in the
    scaled units (training form). TopK decodes sparsely (``embedding_bag`` over the ``k`` active
    rows of the normalised decoder: the same sum as the dense product, ~d_sae/k times cheaper)."""
    sae_in = x - p["b_dec"] if s.apply_b_dec_to_input else x
    pre = sae_in @ p["W_enc"] + p["b_enc"]
    w_unit = None
    zero = torch.zeros((), dtype=pre.dtype, device=pre.device)
    if s.activation == "topk":
        dec_norm = p["W_dec"].norm(dim=-1)
        pre = pre * dec_norm
        vals, idx = torch.topk(pre, k=min(int(s.k or 1), pre.shape[-1]), dim=-1, sorted=False)
        vals = vals.relu()
        w_unit = p["W_dec"] / dec_norm[:, None]
        y_hat = F.embedding_bag(idx, w_unit, per_sample_weights=vals, mode="sum") + p["b_dec"]
        fired = torch.zeros(pre.shape[-1], dtype=torch.bool, device=pre.device)
        fired[idx[vals > 0]] = True
        sparsity = zero
    elif s.activation == "jumprelu":
        acts = _JumpReLUFn.apply(pre, p["threshold"], s.bandwidth)
        y_hat = acts @ p["W_dec"] + p["b_dec"]
        fired = (acts > 0).any(0)
        sparsity = _StepFn.apply(pre, p["threshold"], s.bandwidth).sum(-1).mean()  # L0 (SAELens "step")
    else:
        acts = torch.relu(pre)
        y_hat = acts @ p["W_dec"] + p["b_dec"]
        fired = (acts > 0).any(0)
        sparsity = (acts * p["W_dec"].norm(dim=-1)).sum(-1).mean()  # L1 weighted by decoder norms
    if "W_skip" in p:
        y_hat = y_hat + x @ p["W_skip"].T
    return y_hat, fired, pre, w_unit, sparsity


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, s: DictTrainSettings,
          dead: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """``(loss, parts, fired [d_sae] bool)`` of one batch (SAELens' losses, module docstring)."""
    y_hat, fired, pre, w_unit, sparsity = _forward(p, x, s)
    mse = (y_hat - y).pow(2).sum(-1).mean()
    loss = mse
    parts = {"mse": float(mse.detach())}
    if s.activation == "topk":
        n_dead = int(dead.sum())
        if n_dead > 0:
            assert w_unit is not None
            k_aux = y.shape[-1] // 2
            scale = min(n_dead / k_aux, 1.0)
            k_aux = min(k_aux, n_dead)
            masked = torch.where(dead[None], pre, torch.tensor(-torch.inf, dtype=pre.dtype, device=pre.device))
            top = masked.topk(k_aux, dim=-1, sorted=False)
            recons = F.embedding_bag(top.indices, w_unit, per_sample_weights=top.values, mode="sum")
            aux = (recons - (y - y_hat).detach()).pow(2).sum(-1).mean()
            loss = loss + s.aux_coefficient * scale * aux
            parts["aux"] = float(aux.detach())
    elif s.activation == "jumprelu":
        loss = loss + s.l0_coefficient * sparsity
        parts["l0"] = float(sparsity.detach())
    else:
        loss = loss + s.l1_coefficient * sparsity
        parts["l1"] = float(sparsity.detach())
    return loss, parts, fired


def _order(n: int, batch: int, step: int, s: DictTrainSettings) -> torch.Tensor:
    """The example indices of optimiser step ``step``: consecutive slices of a seeded permutation per
    pass over the ``n`` examples (a batch straddling two passes takes from both)."""
    start = step * batch
    out = []
    while len(out) < batch:
        ep, off = divmod(start + len(out), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(
            int(s.seed) * 1_000_003 + int(s.layer) * 1009 + ep + 1))
        out.extend(perm[off: off + batch - len(out)].tolist())
    return torch.tensor(out, dtype=torch.long)


def fit_dictionary(x: torch.Tensor, y: torch.Tensor, s: DictTrainSettings, *, checkpoint: Optional[Path] = None,
                   progress: Optional[Callable[[int, dict], None]] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Train one dictionary from ``x [n, d_in]`` to ``y [n, d_out]`` (an SAE when ``y is x``).

    Args:
        x: inputs (float, CPU or the training device).
        y: targets.
        s: the settings (:class:`DictTrainSettings`).
        checkpoint: a file to save the training state to every ``s.checkpoint_every`` steps and to
            resume from when it exists (same settings and data: same weights as without a stop).
        progress: called ``(step, parts)`` after each step.

    Returns:
        ``(params, stats)``: the parameters in the *unscaled* units with the decoder norm folded
        (``W_enc [d_in, d_sae]``, ``b_enc``, ``W_dec [d_sae, d_out]``, ``b_dec``, ``W_skip``?,
        ``threshold``?) and ``{"steps", "final_mse_normalised", "dead_fraction", "x_scale", "y_scale"}``.

    Raises:
        SAEError: fewer examples than one batch.
    """
    n = int(x.shape[0])
    if n < s.batch:
        raise SAEError(f"train_batch_size_tokens: {s.batch} tokens per step but only {n} training tokens (special "
                       "tokens left out); raise dataset_tokens or lower train_batch_size_tokens")
    sx, sy = _scale(x), _scale(y)
    xs, ys = (x * sx).to(s.dtype), (y * sy).to(s.dtype)
    p = _params(xs.shape[1], ys.shape[1], s, ys.mean(0))
    opt = torch.optim.Adam(list(p.values()), lr=s.lr)
    since = torch.zeros(s.d_sae, dtype=torch.long)
    step0, recent = 0, []
    if checkpoint is not None and checkpoint.is_file():
        ck = torch.load(checkpoint, weights_only=False)
        with torch.no_grad():
            for k, v in ck["params"].items():
                p[k].copy_(v)
        opt.load_state_dict(ck["opt"])
        since, step0, recent = ck["since"], int(ck["step"]), list(ck["recent"])
    for step in range(step0, s.steps):
        idx = _order(n, s.batch, step, s)
        dead = since > s.dead_feature_window
        loss, parts, fired = _loss(p, xs[idx], ys[idx], s, dead)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
        opt.step()
        with torch.no_grad():
            if "threshold" in p:
                p["threshold"].clamp_(min=0.0)
        since = torch.where(fired, torch.zeros_like(since), since + 1)
        recent = (recent + [parts["mse"]])[-20:]
        if progress is not None:
            progress(step, parts)
        if checkpoint is not None and (step + 1) % s.checkpoint_every == 0 and step + 1 < s.steps:
            tmp = checkpoint.with_name(checkpoint.name + f".tmp-{os.getpid()}")
            torch.save({"params": {k: v.detach().clone() for k, v in p.items()}, "opt": opt.state_dict(),
                        "since": since, "step": step + 1, "recent": recent}, tmp)
            os.replace(tmp, checkpoint)
    out = {k: v.detach().double() for k, v in p.items()}
    if s.activation == "topk":  # fold the decoder norm (SAELens' _fold_norm_topk)
        nrm = out["W_dec"].norm(dim=-1)
        out["b_enc"] = out["b_enc"] * nrm
        out["W_enc"] = out["W_enc"] * nrm[None]
        out["W_dec"] = out["W_dec"] / nrm[:, None]
    # fold the input/output scales: pre-activations unchanged, outputs divided by sy
    # (an SAE applying b_dec to its input has x is y, so sx == sy: (x sx - b_dec) @ W_enc = (x - b_dec / sx) @ (sx W_enc))
    out["W_enc"] = out["W_enc"] * sx
    out["W_dec"] = out["W_dec"] / sy
    out["b_dec"] = out["b_dec"] / sy
    if "W_skip" in out:
        out["W_skip"] = out["W_skip"] * (sx / sy)
    stats = {"steps": s.steps, "final_mse_normalised": float(np.mean(recent)) if recent else None,
             "dead_fraction": float((since > s.dead_feature_window).float().mean()), "x_scale": sx, "y_scale": sy}
    return {k: v.float() for k, v in out.items()}, stats


def to_dictionary(params: dict[str, torch.Tensor], s: DictTrainSettings, hook_in: str, hook_out: str,
                  metadata: Optional[dict] = None) -> Dictionary:
    """A :class:`Dictionary` holding ``params`` (:func:`fit_dictionary`'s output)."""
    d_in, d_sae = params["W_enc"].shape
    d_out = params["W_dec"].shape[1]
    d = Dictionary(int(d_in), int(d_sae), int(d_out), activation=s.activation, k=s.k, skip="W_skip" in params,
                   hook_in=hook_in, hook_out=hook_out, layer=s.layer, apply_b_dec_to_input=s.apply_b_dec_to_input,
                   metadata=metadata)
    with torch.no_grad():
        for k, v in params.items():
            getattr(d, k).copy_(v)
    return d
