"""Dose-response of a steering vector against norm-matched random directions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch

from ..core.budget import bytes_of, run_chunked
from ..core.errors import SteeringError
from ..hooks import enabled_hooks, fwd_hooks
from ..model.info import HookedModel
from ..patching.engine import replay_chunk, replay_row_bytes
from ..tokens import pad_rows
from .apply import StepClock, _add_hook
from .vectors import SteeringVector, check_vector, random_directions

__all__ = ["SteerRow", "DoseResponse", "dose_response", "forward_batch", "sequence_bytes", "control_spread",
           "DEFAULT_N_RANDOM", "CONTROL_BAND"]

#: Random control directions of a dose-response by default (the ``steering`` kind's
#: ``controls.n_random``): enough for a percentile band and a rank, batched with the vector's runs.
DEFAULT_N_RANDOM = 16

#: The controls' percentile band (in %) reported and drawn (:func:`control_spread`).
CONTROL_BAND = (5.0, 95.0)


@dataclass(frozen=True)
class SteerRow:
    """One prompt of a dose-response.

    Attributes:
        ids: token ids (BOS included as the model prepends it).
        target_id: the token whose probability is read.
        foil_id: optional, for the logit difference.
        read_at: the read position (index into ``ids``).
        at: the steered positions (indices into ``ids``, non-negative).
    """

    ids: tuple[int, ...]
    target_id: int
    foil_id: Optional[int]
    read_at: int
    at: tuple[int, ...]


@dataclass
class DoseResponse:
    """What :func:`dose_response` measured.

    Attributes:
        table: one line per (direction, alpha, row): ``direction`` (``steer`` / ``random_<i>``),
            ``draw`` (-1 for the vector, ``i`` for ``random_<i>``), ``alpha``, ``row`` (index into
            the rows), ``target_prob`` (probability), ``target_log_prob`` (nats), ``logit_diff``
            (logit(target) - logit(foil); the target logit without a foil), ``foil_prob`` (NaN
            without a foil).
        directions: ``[1 + n_random, d]``: the vector then the random directions (float32).
        vector_norm: the vector's L2 norm (every random direction has it).
        batch_size: sequences per forward pass used (``run.memory_budget`` and ``batch_size``,
            after any out-of-memory halving).
    """

    table: pd.DataFrame
    directions: torch.Tensor
    vector_norm: float
    batch_size: int = 0


def sequence_bytes(model: HookedModel, seq_len: int) -> int:
    """Bytes one sequence of ``seq_len`` tokens needs in a plain forward pass that returns every
    position's logits: one block's activations and the last-position readout
    (:func:`tracekit.patching.engine.replay_row_bytes`) plus the logits ``[seq_len, d_vocab]``
    twice in float32 (the model's output and a temporary: the softcap, a dtype cast)."""
    return replay_row_bytes(model, seq_len) + 2 * bytes_of(max(1, int(seq_len)), int(model.cfg.d_vocab))


def forward_batch(model: HookedModel, lengths: Sequence[int], batch_size: int | str, what: str) -> int:
    """Sequences per forward pass for prompts of ``lengths`` tokens: what ``run.memory_budget``
    allows at :func:`sequence_bytes` of the longest each, at most ``batch_size`` (``auto``: 512).

    Raises:
        MemoryBudgetError: one sequence of the longest length does not fit (names ``what``).
    """
    return replay_chunk(model, sequence_bytes(model, max(lengths, default=1)), max(1, len(lengths)), what=what,
                        batch_size=batch_size, unit="sequence", fix="shorten the prompts")


def _check_rows(rows: Sequence[SteerRow], alphas: Sequence[float]) -> None:
    if not rows:
        raise SteeringError("prompts: give at least one row")
    if not alphas:
        raise SteeringError("alphas: give at least one multiplier (e.g. [0, 2, 4, 8])")
    if not all(np.isfinite(float(a)) for a in alphas):
        raise SteeringError(f"alphas: {list(alphas)} holds a non-finite value")
    for i, r in enumerate(rows):
        n = len(r.ids)
        if not 0 <= r.read_at < n or any(not 0 <= p < n for p in r.at):
            raise SteeringError(f"rows[{i}]: read position {r.read_at} / steered positions {list(r.at)} outside its "
                                f"{n} tokens")
        if not r.at:
            raise SteeringError(f"positions: row {i} has no prompt position to steer (a dose-response reads the next "
                                "token after the prompt, so 'generated' alone adds nothing); give all, an index or a "
                                "named position")


@torch.no_grad()
def _dose_batch(model: HookedModel, rows: Sequence[SteerRow], jobs: Sequence[tuple[int, float, int]], directions: torch.Tensor,
                hook: str) -> list[dict]:
    """One forward pass over ``jobs`` = (direction index, alpha, row index); one metric dict each."""
    batch = pad_rows(model, [rows[r].ids for _, _, r in jobs], "prompts")
    add = torch.stack([float(a) * directions[k] for k, a, _ in jobs])
    mask = torch.zeros(batch.tokens.shape, dtype=torch.bool)
    for b, (_, _, r) in enumerate(jobs):
        for p in rows[r].at:
            mask[b, batch.offsets[b] + p] = True
    clock = StepClock()

    def where(offset: int, seq: int) -> torch.Tensor:
        return mask[:, offset:offset + seq]

    kw = {"attention_mask": batch.attention_mask} if batch.needs_mask else {}
    with fwd_hooks(model, [(hook, _add_hook(add, where, clock))]):
        logits = model(batch.tokens, return_type="logits", **kw)
    read = torch.tensor([batch.offsets[b] + rows[r].read_at for b, (_, _, r) in enumerate(jobs)], device=logits.device)
    lg = logits[torch.arange(len(jobs), device=logits.device), read].float()
    lp = torch.log_softmax(lg, -1)
    out = []
    for b, (k, a, r) in enumerate(jobs):
        t, f = rows[r].target_id, rows[r].foil_id
        out.append({"direction": "steer" if k == 0 else f"random_{k - 1}", "draw": k - 1, "alpha": float(a), "row": r,
                    "target_prob": float(lp[b, t].exp()), "target_log_prob": float(lp[b, t]),
                    "logit_diff": float(lg[b, t] - (lg[b, f] if f is not None else 0.0)),
                    "foil_prob": float(lp[b, f].exp()) if f is not None else float("nan")})
    return out


def dose_response(model: HookedModel, rows: Sequence[SteerRow], vector: Union[SteeringVector, torch.Tensor], hook: str,
                  alphas: Sequence[float], *, n_random: int = DEFAULT_N_RANDOM, seed: int = 0, batch_size: int = 32) -> DoseResponse:
    """Target probability, log-prob and logit difference at each alpha, for the vector and for
    ``n_random`` random directions of exactly the vector's norm (:func:`random_directions`: seeded
    Gaussian directions normalised, then scaled), so an effect of the direction can be told from an
    effect of adding anything that large (Turner et al. 2023 and Rimsky et al. 2024 sweep the
    multiplier; the norm-matched random control follows Templeton et al. 2024's random-feature steering).

    Each row is steered at its own ``at`` positions and read at ``read_at`` on the model's own logits
    (output transform included). Alpha 0 adds exactly 0 (the clean run). Every (direction, alpha,
    row) is one sequence of a batch of up to ``batch_size``, fewer where ``run.memory_budget`` says
    so (:func:`forward_batch`); each batch is padded to its longest row.

    Args:
        model: a hooked model.
        rows: the prompts (:class:`SteerRow`).
        vector: the steering vector ``[d]`` (checked against ``hook``).
        hook: TransformerLens hook steered.
        alphas: multipliers (finite; at least one).
        n_random: random control directions (0: none; default :data:`DEFAULT_N_RANDOM`).
        seed: the random directions' seed.
        batch_size: sequences per forward pass at most (the budget may choose fewer; an
            out-of-memory error halves it).

    Returns:
        A :class:`DoseResponse`.

    Raises:
        SteeringError: no rows, no alphas, a non-finite alpha, a row without steered positions, a
            position outside its row; as :func:`check_vector`.
        MemoryBudgetError: one sequence of the longest row does not fit ``run.memory_budget``.
    """
    v = check_vector(model, vector, hook)
    _check_rows(rows, alphas)
    if n_random < 0:
        raise SteeringError(f"controls.n_random: {n_random} must be >= 0")
    norm = float(v.double().norm())
    directions = torch.cat([v[None, :], random_directions(n_random, v.shape[0], norm, seed)]) if n_random else v[None]
    jobs = [(k, float(a), r) for k in range(directions.shape[0]) for a in alphas for r in range(len(rows))]
    recs: list[dict] = [{} for _ in jobs]
    bs = forward_batch(model, [len(rows[r].ids) for _, _, r in jobs], batch_size, "steering dose-response")

    def do(sl: slice) -> None:
        recs[sl] = _dose_batch(model, rows, jobs[sl], directions, hook)

    with enabled_hooks(model, [hook]):
        used = run_chunked(do, len(jobs), bs, what="steering dose-response")
    return DoseResponse(pd.DataFrame(recs), directions, norm, int(used))


def control_spread(table: pd.DataFrame, alphas: Sequence[float], col: str = "target_prob",
                   band: tuple[float, float] = CONTROL_BAND) -> pd.DataFrame:
    """Per alpha, the random controls' spread and the vector's place among them.

    ``table`` holds means over rows per (direction, alpha): ``direction`` (``steer`` or
    ``random_<i>``), ``alpha`` and ``col`` (the ``steering`` kind's ``dose_response`` table, or
    :attr:`DoseResponse.table` averaged over rows).

    Returns:
        One line per alpha: ``alpha``, ``n_random``, ``steer`` (the vector's value), the controls'
        ``random_mean``, ``random_std`` (ddof 0), ``random_min``, ``random_p<lo>`` / ``random_p<hi>``
        (the ``band`` percentiles, linear interpolation), ``random_max``; ``vector_rank`` (1 + the
        controls strictly above the vector: 1 = at or above every control; of ``n_random + 1``) and
        ``vector_percentile`` (the share of controls below the vector in %, a tie counting half: 100
        = above every control; NaN without controls). Units: those of ``col``.
    """
    lo_name, hi_name = f"random_p{band[0]:g}", f"random_p{band[1]:g}"
    out = []
    for a in alphas:
        at = table[table["alpha"] == float(a)]
        sv = np.asarray(at[at["direction"] == "steer"][col], dtype=float)
        x = float(sv[0]) if len(sv) else float("nan")
        r = np.asarray(at[at["direction"] != "steer"][col], dtype=float)
        rec = {"alpha": float(a), "n_random": int(len(r)), "steer": x}
        if len(r):
            above, tied = int(np.sum(r > x)), int(np.sum(r == x))
            rec.update({"random_mean": float(r.mean()), "random_std": float(r.std()), "random_min": float(r.min()),
                        lo_name: float(np.percentile(r, band[0])), hi_name: float(np.percentile(r, band[1])),
                        "random_max": float(r.max()), "vector_rank": 1 + above,
                        "vector_percentile": 100.0 * (len(r) - above - tied + 0.5 * tied) / len(r)})
        else:
            rec.update({k: float("nan") for k in ("random_mean", "random_std", "random_min", lo_name, hi_name,
                                                  "random_max", "vector_percentile")})
            rec["vector_rank"] = 1
        out.append(rec)
    return pd.DataFrame(out)
