"""Adding ``alpha x vector`` at a hook, at absolute token positions, correct under a KV cache."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from ..core.errors import SteeringError
from ..hooks import enabled_hooks, fwd_hooks
from ..model.info import HookedModel
from .vectors import check_vector

__all__ = ["StepClock", "Steer", "steer"]


@dataclass
class StepClock:
    """The absolute position (BOS counted) of the first token of the current forward pass: 0 for a
    full pass, ``n - 1`` for a KV-cached step on a sequence of ``n`` tokens. Set by the caller."""

    offset: int = 0


@dataclass(frozen=True)
class Steer:
    """Add ``alpha x vector`` at a hook.

    Attributes:
        vector: ``[d]``, checked against ``hook``.
        hook: TransformerLens hook (``blocks.6.hook_resid_pre``).
        alpha: the multiplier (the vector's own units; with a unit-norm vector, residual-norm units).
            Positive steers towards the vector's direction.
        at: absolute prompt positions (indices into the prompt's ids, BOS counted; negative count
            from the prompt's end).
        generated: also add at every generated token (positions at or after the prompt's length).
    """

    vector: torch.Tensor
    hook: str
    alpha: float
    at: tuple[int, ...] = ()
    generated: bool = False


def _add_hook(add: torch.Tensor, where, clock: StepClock):
    """A forward hook returning ``act + add[b]`` where ``where(offset, seq)[b, j]`` is true, else ``act``."""
    def hook(act, hook):
        m = where(clock.offset, act.shape[1]).to(act.device)
        a = add.to(device=act.device, dtype=act.dtype)
        return torch.where(m[..., None], act + a[:, None, :], act)
    return hook


@contextlib.contextmanager
def steer(model: HookedModel, steering: Steer, prompt_len: int) -> Iterator[StepClock]:
    """Add a :class:`Steer` to every forward pass inside the block; its hook is removed on exit
    whatever is raised. Every row of a batch is steered at the same positions (rows without padding).

    Args:
        model: a hooked model.
        steering: what to add, where.
        prompt_len: the prompt's length in tokens (negative ``at`` and ``generated`` are counted from it).

    Yields:
        The :class:`StepClock` the hook reads; leave ``offset`` at 0 for full forward passes, set it
        to the absolute position of the first token fed for a KV-cached step.

    Raises:
        SteeringError / HookError: as :func:`check_vector`; a position outside the prompt.
    """
    v = check_vector(model, steering.vector, steering.hook)
    at = set()
    for p in steering.at:
        if not -prompt_len <= int(p) < prompt_len:
            raise SteeringError(f"positions: {p} is outside a prompt of {prompt_len} tokens (0..{prompt_len - 1})")
        at.add(int(p) % prompt_len)
    wanted = torch.tensor(sorted(at), dtype=torch.long)
    clock = StepClock()

    def where(offset: int, seq: int) -> torch.Tensor:
        pos = torch.arange(offset, offset + seq)
        m = torch.isin(pos, wanted)
        if steering.generated:
            m |= pos >= prompt_len
        return m[None, :]

    hook = _add_hook((float(steering.alpha) * v)[None, :], where, clock)
    with enabled_hooks(model, [steering.hook]), fwd_hooks(model, [(steering.hook, hook)]):
        yield clock
