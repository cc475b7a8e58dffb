"""Interventions on SAE features: ablate, clamp or steer features (error term kept) and measure the
effect on the target's probability and logit; random feature baselines."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from ..core.errors import SAEError
from ..dla import resolve_target
from ..hooks import enabled_hooks
from ..metrics import target_prob
from ..model.info import HookedModel
from ..tokens import encode, pad_ids
from .decompose import effective_decoder, splice_hook
from .load import LoadedSAE
from .windows import special_token_ids

__all__ = ["feature_intervention", "random_features"]


@torch.no_grad()
def feature_intervention(model: HookedModel, handle: LoadedSAE, prompt: str, target: str, foil: str | None,
                         features: Sequence[int], mode: Literal["ablate", "clamp", "steer"], value: float = 0.0,
                         intervene_at: str | Sequence[int] = "all") -> dict:
    """Edit SAE features (error term kept, so only the edit moves the activation) and measure the
    effect on the target's probability and logit (difference) at the last position.

    Modes: ``ablate`` (activation -> 0), ``clamp`` (activation -> ``value``), ``steer`` (add
    ``value x`` the feature's decoder row, in the activation's units, at ``intervene_at``).
    ``intervene_at``: ``all`` (every non-special token) or token indices (BOS counted); ablate and
    clamp edit the same positions.

    Returns:
        ``{clean_prob, prob, delta_prob, clean_logit, logit, delta_logit}`` (logit = logit
        difference with a foil).
    """
    tgt = resolve_target(model, target, foil)
    ids = encode(model, prompt, prepend_bos=handle.info.prepend_bos)
    batch = pad_ids(model, [ids])
    n = len(ids)
    special_ids = set(special_token_ids(model))
    sel = torch.zeros(n, dtype=torch.bool)
    if intervene_at == "all":
        sel[:] = True
    else:
        for q in intervene_at:  # type: ignore[union-attr]
            if not -n <= int(q) < n:
                raise SAEError(f"intervene_at: {q} is out of range for a prompt of {n} tokens")
            sel[int(q) % n] = True
    sel &= torch.tensor([int(i) not in special_ids for i in ids])
    sel = sel.to(batch.tokens.device)
    feats = torch.tensor(list(features), dtype=torch.long, device=batch.tokens.device)
    add = None

    def edit(acts):
        if mode == "steer":
            return acts
        sub = acts[0][:, feats]
        new = torch.zeros_like(sub) if mode == "ablate" else torch.full_like(sub, float(value))
        acts[0][:, feats] = torch.where(sel[:, None], new, sub)
        return acts
    if mode == "steer":
        W = effective_decoder(handle)
        vec = W[feats].sum(0) * float(value)
        add = torch.zeros(1, n, vec.shape[-1], dtype=vec.dtype, device=vec.device)
        add[0, sel] = vec
    ft = tgt.target_id
    tt = torch.tensor([[ft]], device=batch.tokens.device)

    def read(lg):
        row = lg[0, -1].float()
        v = row[ft] - (row[tgt.foil_id] if tgt.foil_id is not None else 0.0)
        return float(target_prob(row[None], tt)[0]), float(v)
    with enabled_hooks(model, [handle.hook]):
        clean = model(batch.tokens)
        hook = splice_hook(handle, use_error=True, edit=None if mode == "steer" else edit, add=add)
        patched = model.run_with_hooks(batch.tokens, fwd_hooks=[(handle.hook, hook)])
    cp, cl = read(clean)
    pp, pl = read(patched)
    return {"clean_prob": cp, "prob": pp, "delta_prob": pp - cp, "clean_logit": cl, "logit": pl,
            "delta_logit": pl - cl}


def random_features(d_sae: int, k: int, exclude: Iterable[int] = (), pool: Sequence[int] | None = None,
                    seed: int = 0) -> list[int]:
    """``k`` random features (from ``pool`` when it has enough, else from all), none in ``exclude``."""
    rng = random.Random(seed)
    ex = {int(e) for e in exclude}
    cands = [int(f) for f in (pool or []) if int(f) not in ex]
    if len(cands) < k:
        cands = [f for f in range(d_sae) if f not in ex]
    return sorted(rng.sample(cands, min(k, len(cands))))
