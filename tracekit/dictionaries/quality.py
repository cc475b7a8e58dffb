"""How good a transcoder set is, on held-out token windows: per layer and as a replacement model.

Per layer (the model's own activations at ``hook_in`` fed to the layer's transcoder, compared with
the model's ``hook_out``):

* ``fvu``: fraction of variance unexplained ``sum ||y - y_hat||^2 / sum ||y - mean(y)||^2`` (the
  mean over the evaluated tokens, per output dimension); 0 = perfect, 1 = no better than the mean;
* ``mse``: ``mean ||y - y_hat||^2 / d_out`` (per element, in ``hook_out`` units squared);
* ``l0``: active features per token; ``dead_fraction``: features never active on these tokens.

Whole replacement model: every covered MLP's output (``hook_out``) replaced at once by its
transcoder's prediction from the *replacement* run's own ``hook_in`` (errors compound through the
layers, as in Ameisen et al. 2025 / Dunefsky et al. 2024's "spliced-in" evaluation): next-token
cross-entropy of the model (``ce_model``) and of the replacement model (``ce_replacement``),
``ce_delta`` = their difference, ``kl`` = ``KL(p_model || p_replacement)`` per token, all in nats,
averaged over every predicted position (special-token targets included, as the model sees them).

The forward passes run in chunks of windows under the memory budget (``run.memory_budget``); the
sums over tokens are accumulated in float64 (log-probabilities in float32), so the figures do not
depend on the chunking beyond float32 rounding.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int

from ..activations.chunking import forward_chunk_size, forward_row_bytes
from ..hooks import enabled_hooks, fwd_hooks, state_guard
from ..model.info import HookedModel
from ..model.load import model_device
from .dictionary import DictionarySet

__all__ = ["transcoder_quality", "QUALITY_COLUMNS"]

#: Columns of the per-layer table.
QUALITY_COLUMNS = ["layer", "hook_in", "hook_out", "fvu", "mse", "l0", "dead_fraction", "d_sae"]


def _as_tokens(tokens: Any, device: torch.device) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        t = tokens
    else:
        t = torch.tensor(np.asarray(tokens, dtype=np.int64))
    if t.ndim == 1:
        t = t[None]
    return t.to(device=device, dtype=torch.long)


@torch.no_grad()
def transcoder_quality(model: HookedModel, dset: DictionarySet,
                       tokens: Int[torch.Tensor, "n_windows seq"] | Sequence[Sequence[int]],
                       batch_size: int = 8) -> tuple[pd.DataFrame, dict]:
    """Per-layer FVU / MSE / L0 / dead features and the whole replacement model's CE and KL.

    Args:
        model: the hooked model (the transcoders' hooks must exist on it).
        dset: the transcoder set (``layer -> Dictionary`` with ``hook_in`` / ``hook_out``).
        tokens: ``[n_windows, seq]`` token ids of equal-length windows (BOS included as the model
            prepends it; e.g. the held-out packed windows of the training), run as given.
        batch_size: windows per forward pass (further chunked under the memory budget).

    Returns:
        ``(per_layer, overall)``: ``per_layer`` has :data:`QUALITY_COLUMNS` (one row per layer);
        ``overall`` has ``ce_model``, ``ce_replacement``, ``ce_delta``, ``kl`` (nats per token),
        ``fvu_mean``, ``l0_mean``, ``n_tokens``, ``n_predictions``.

    Raises:
        HookError: a transcoder's hook the model lacks.
        MemoryBudgetError: one window's forward pass does not fit the budget.

    Source: the definitions of SAELens' ``evals.py`` (explained variance, L0, CE with the SAE
    spliced in) applied to transcoders; Dunefsky et al. 2024 (transcoder evaluation).
    """
    dev = model_device(model)
    toks = _as_tokens(tokens, dev)
    layers = dset.layers
    ins = {L: dset[L].hook_in for L in layers}
    outs = {L: dset[L].hook_out for L in layers}
    hooks = list(dict.fromkeys(list(ins.values()) + list(outs.values())))
    acc = {L: {"se": 0.0, "sy": torch.zeros(dset[L].d_out, dtype=torch.float64),
               "syy": torch.zeros(dset[L].d_out, dtype=torch.float64), "l0": 0.0,
               "fired": torch.zeros(dset[L].d_sae, dtype=torch.bool)} for L in layers}
    ce_m = ce_r = kl = 0.0
    n_tok = n_pred = 0
    n, T = int(toks.shape[0]), int(toks.shape[1])
    per_row = 3 * forward_row_bytes(model, T, logits=True)
    chunk = min(max(1, batch_size), forward_chunk_size(model, n, per_row, what="transcoder quality",
                                                       fix="lower the evaluation windows' length"))
    got: dict[str, torch.Tensor] = {}
    replaced: dict[str, torch.Tensor] = {}

    def save(act: torch.Tensor, hook: Any) -> None:
        got[hook.name] = act.detach()

    def keep_in(act: torch.Tensor, hook: Any) -> None:
        replaced[hook.name] = act

    def make_out(L: int):
        def put(act: torch.Tensor, hook: Any) -> torch.Tensor:
            return dset[L](replaced[ins[L]]).to(act.dtype).reshape(act.shape)

        return put

    with state_guard(model), enabled_hooks(model, hooks):
        for s in range(0, n, chunk):
            batch = toks[s:s + chunk]
            got.clear()
            replaced.clear()
            with fwd_hooks(model, [(h, save) for h in hooks]):
                logits_m = model(batch)
            for L in layers:
                d = dset[L]
                x = got[ins[L]].reshape(-1, d.d_in)
                y = got[outs[L]].reshape(-1, d.d_out).double()
                feats = d.encode(x)
                y_hat = (d.decode(feats) + (d.skip_out(x) if d.W_skip is not None else 0)).double()
                a = acc[L]
                a["se"] += float((y - y_hat).pow(2).sum())
                a["sy"] += y.sum(0).cpu()
                a["syy"] += y.pow(2).sum(0).cpu()
                a["l0"] += float((feats > 0).sum())
                a["fired"] |= (feats > 0).any(0).cpu()
            n_tok += int(batch.numel())
            rep_hooks = [(ins[L], keep_in) for L in layers] + [(outs[L], make_out(L)) for L in layers]
            with fwd_hooks(model, rep_hooks):
                logits_r = model(batch)
            lp_m = torch.log_softmax(logits_m[:, :-1].float(), -1)
            lp_r = torch.log_softmax(logits_r[:, :-1].float(), -1)
            tgt = batch[:, 1:, None]
            ce_m += float(-lp_m.gather(-1, tgt).double().sum())
            ce_r += float(-lp_r.gather(-1, tgt).double().sum())
            kl += float((lp_m.exp() * (lp_m - lp_r)).sum(-1).double().sum())  # per position in float32, summed in float64
            del logits_m, logits_r, lp_m, lp_r
            n_pred += int(tgt.numel())
    rows = []
    for L in layers:
        a, d = acc[L], dset[L]
        var = float((a["syy"] - a["sy"].pow(2) / max(1, n_tok)).sum())
        rows.append({"layer": int(L), "hook_in": ins[L], "hook_out": outs[L],
                     "fvu": a["se"] / var if var > 0 else float("nan"),
                     "mse": a["se"] / max(1, n_tok * d.d_out), "l0": a["l0"] / max(1, n_tok),
                     "dead_fraction": float((~a["fired"]).float().mean()), "d_sae": int(d.d_sae)})
    per_layer = pd.DataFrame(rows, columns=QUALITY_COLUMNS)
    overall = {"ce_model": ce_m / max(1, n_pred), "ce_replacement": ce_r / max(1, n_pred),
               "ce_delta": (ce_r - ce_m) / max(1, n_pred), "kl": kl / max(1, n_pred),
               "fvu_mean": float(np.mean([r["fvu"] for r in rows])), "l0_mean": float(np.mean([r["l0"] for r in rows])),
               "n_tokens": n_tok, "n_predictions": n_pred}
    return per_layer, overall
