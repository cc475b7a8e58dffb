"""The activations a kind cached during its run, kept in memory on its result (``result.activations``).

A kind that already reads hook activations for its own computation (the logit lens reads the
residual stream at every hidden state, direct logit attribution every write into the residual
stream at the attributed position) hands them to a :class:`CachedActivations` instead of dropping
them, so a researcher can poke at them after the run without a second forward pass::

    >>> res = tk.LogitLens(prompts=["The capital of France is"], target=" Paris").run(model, progress=False)
    >>> acts = res.activations                      # hook name -> [row, read, d_model]
    >>> last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    >>> tuple(acts[last].shape) == (1, 1, model.cfg.d_model)   # one row, read at its last token
    True
    >>> acts.positions.tolist() == [[model.to_tokens("The capital of France is").shape[1] - 1]]
    True

Names are TransformerLens hook names; values are the hook's output at the positions the kind read
(the activations of a fresh ``model.run_with_cache(tokens)`` at those positions, up to the padding
of batched rows), on the CPU, detached, in the model's dtype. Rows that read fewer positions than
the widest row are padded with NaN (``positions`` -1 there).

Memory: what the kind held anyway, kept rather than freed: ``hooks x rows x reads x width`` values
(the logit lens on SmolLM2-135M in float32, 31 hidden states x 576 values: 70 KiB per read position, so 23
prompts read at their last token are 1.6 MiB). Nothing is copied on a CPU run (the kept tensors are
views of the kind's own batch tensors); on a GPU each batch is moved to the CPU once. Past
:attr:`CachedActivations.limit_mib` (default 256 MiB) the kind stops keeping them, drops what it had
and says so in :attr:`CachedActivations.note`. They live only on the in-memory result (a library
call, ``tk.run``, a notebook): they are not saved with the result, and a loaded result has none.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar, Optional

import torch
from jaxtyping import Float, Int

__all__ = ["CachedActivations"]


class CachedActivations(Mapping[str, torch.Tensor]):
    """Hook name -> ``Float[row, read, *hook_shape]``, the activations a kind read, in row order;
    :attr:`positions` ``Int[row, read]`` the token index (BOS counted) of each read, -1 where a row
    reads fewer positions (its values are NaN there).

    A mapping (``acts["blocks.0.hook_resid_post"]``, ``list(acts)``, ``len(acts)``); empty when the
    kind keeps none or dropped them (:attr:`note` says why).

    Attributes:
        limit_mib: class-wide cap (MiB) on what one result keeps; raise it before a run to keep more
            (``CachedActivations.limit_mib = 2048``).
        note: None, or why nothing is kept.
    """

    limit_mib: ClassVar[float] = 256.0

    def __init__(self, what: str = ""):
        self.what = what
        self.note: Optional[str] = None
        self._pieces: dict[str, list[torch.Tensor]] = {}
        self._positions: list[list[int]] = []
        self._bytes = 0
        self._done: Optional[dict[str, torch.Tensor]] = None
        self._pos: Optional[torch.Tensor] = None

    def add(self, acts: Mapping[str, Float[torch.Tensor, "batch read *shape"]],
            positions: Sequence[Sequence[int]]) -> None:
        """Keep one batch: ``acts[hook]`` ``[batch, read, ...]`` (padded reads beyond a row's own are
        cut by ``positions``, one list of token indices per row). Raises nothing; past
        :attr:`limit_mib` everything is dropped and :attr:`note` says so."""
        if self.note is not None:
            return
        rows = [list(map(int, p)) for p in positions]
        n = sum(v.element_size() * v[:, : max(map(len, rows), default=0)].numel() for v in acts.values())
        if (self._bytes + n) / 2**20 > self.limit_mib:
            self.note = (f"not kept: over CachedActivations.limit_mib = {self.limit_mib:g} MiB "
                         f"(raise it to keep them)")
            self._pieces.clear()
            self._positions.clear()
            return
        self._bytes += n
        for name, v in acts.items():
            self._pieces.setdefault(name, []).append(v.detach()[:, : max(map(len, rows), default=0)].to("cpu"))
        self._positions += rows
        self._done = None

    def _stack(self) -> dict[str, torch.Tensor]:
        if self._done is None:
            width = max(map(len, self._positions), default=0)
            full = all(len(row) == width for row in self._positions)
            out = {}
            for name, parts in self._pieces.items():
                if len(parts) == 1 and full:
                    out[name] = parts[0]  # the kind's own tensor: no copy
                    continue
                t = torch.full((sum(p.shape[0] for p in parts), width, *parts[0].shape[2:]), math.nan,
                               dtype=parts[0].dtype)
                r = 0
                for p in parts:
                    t[r:r + p.shape[0], : p.shape[1]] = p
                    r += p.shape[0]
                for i, row in enumerate(self._positions):  # a row's padded reads: NaN
                    t[i, len(row):] = math.nan
                out[name] = t
            self._pos = torch.tensor([row + [-1] * (width - len(row)) for row in self._positions],
                                     dtype=torch.long).reshape(len(self._positions), width)
            self._done = out
        return self._done

    @property
    def positions(self) -> Int[torch.Tensor, "row read"]:
        """The token index (BOS counted) of each read, ``[row, read]``; -1 for a padded read."""
        self._stack()
        assert self._pos is not None
        return self._pos

    @property
    def nbytes(self) -> int:
        """Bytes held by the kept tensors."""
        return sum(t.element_size() * t.numel() for t in self._stack().values())

    def __getitem__(self, name: str) -> torch.Tensor:
        acts = self._stack()
        if name not in acts:
            raise KeyError(f"no cached activations at {name!r}; this result kept {list(acts) or 'none'}"
                           + (f" ({self.note})" if self.note else ""))
        return acts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stack())

    def __len__(self) -> int:
        return len(self._stack())

    def __repr__(self) -> str:
        acts = self._stack()
        if not acts:
            return f"CachedActivations({self.note or 'empty'})"
        shape = tuple(next(iter(acts.values())).shape)
        return (f"CachedActivations({len(acts)} hooks, e.g. {next(iter(acts))} {shape}, "
                f"{self.nbytes / 2**20:.1f} MiB{'; ' + self.what if self.what else ''})")
