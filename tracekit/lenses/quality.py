"""How far each lens is from the model's own output, per hidden state, on held-out text.

For every lens (``logit``: the logit lens; ``tuned``: the tuned lens, :mod:`.tuned`;
``patchscope``: the Patchscope identity readout, :mod:`.patchscope`) and every hidden state ``h``
(``0 .. n_layers``; docs/glossary.md), over held-out token positions ``t`` that have a next token
(BOS and padding excluded; a window's last token has no next token in the window and is skipped):

* ``kl`` = mean over t of ``KL(p_final || p_lens_h) = sum_v p_final(v) (log p_final(v) - log p_lens_h(v))``
  (nats), ``p_final`` being the model's own output distribution (the
  :class:`~tracekit.model.readout.Readout` of hidden state ``n_layers``): the tuned lens' training
  loss (Belrose et al. 2023, arXiv:2303.08112, section 4);
* ``cross_entropy`` = mean of ``-log p_lens_h(x_{t+1})`` (nats) against the actual next token;
* ``top1_agreement`` = share of positions where the lens' top-1 token equals the model's final top-1;
* ``n_tokens`` = positions averaged over; ``kl_se`` = the standard error of ``kl`` (sample std / sqrt(n)).

The logit lens at the last hidden state *is* the model's output (``kl`` = 0, ``top1_agreement`` = 1,
tested). Patchscope costs one target-prompt forward per (hidden state, position), so it is scored
on a seeded sample of ``patchscope_positions`` positions only (its ``n_tokens``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from .. import plotting
from ..core.budget import bytes_of, chunk_rows, run_chunked
from ..corpus import Window, window_batches
from ..fastpath import residual_stream
from ..logit_lens import lens_points
from ..model.info import HookedModel
from ..model.readout import (
    MIN_READOUT_ROWS,
    Readout,
    chunked_log_probs,
    forward_row_bytes,
    readout_bytes,
    readout_chunk,
)
from .patchscope import patchscope_lens_log_probs
from .tuned import TunedLens

__all__ = ["LENSES", "quality_table", "quality_figure", "QUALITY_COLUMNS", "quality_batch_size"]

#: The lenses the table knows, in display order.
LENSES = ("logit", "tuned", "patchscope")
QUALITY_COLUMNS = ["lens", "hidden_state", "kl", "kl_se", "cross_entropy", "top1_agreement", "n_tokens"]


class _Acc:
    """Per-hidden-state sums of KL, KL^2, cross-entropy, top-1 agreement and counts."""

    def __init__(self, H: int):
        self.s = np.zeros((H, 5))

    def add(self, h: int, fin: torch.Tensor, lp: torch.Tensor, nxt: torch.Tensor) -> None:
        self.add_rows(h, *_row_stats(fin, lp, nxt))

    def add_rows(self, h: int, kl: torch.Tensor, ce: torch.Tensor, top: torch.Tensor) -> None:
        """Add per-row float64 KL, cross-entropy and top-1 agreement ``[N]``."""
        self.s[h] += [float(kl.sum()), float((kl * kl).sum()), float(ce.sum()), float(top.sum()), len(kl)]

    def rows(self, lens: str) -> list[dict]:
        out = []
        for h, (kl, kl2, ce, top, n) in enumerate(self.s):
            n = max(n, 1.0)
            mean = kl / n
            var = max(0.0, kl2 / n - mean * mean) * n / max(n - 1, 1.0)
            out.append({"lens": lens, "hidden_state": h, "kl": mean, "kl_se": float(np.sqrt(var / n)),
                        "cross_entropy": ce / n, "top1_agreement": top / n, "n_tokens": int(self.s[h, 4])})
        return out


def _row_stats(fin: torch.Tensor, lp: torch.Tensor, nxt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``[N]`` (float64): KL(final || lens), next-token cross-entropy, top-1 agreement."""
    kl = (fin.exp() * (fin - lp)).sum(-1).double()
    ce = -lp.gather(1, nxt[:, None])[:, 0].double()
    top = (lp.argmax(-1) == fin.argmax(-1)).double()
    return kl, ce, top


def _eval_rows(batch, group: Sequence[Window], resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``[H, N, d]`` residuals at the batch's scored positions, ``[N]`` next-token ids, and
    ``(window index in group, token index)`` of each."""
    xs, nxt, where = [], [], []
    for b, w in enumerate(group):
        n = len(w.ids)
        if n - 1 <= w.n_prefix:
            continue
        idx = batch.real_index(b)[w.n_prefix:n - 1].to(resid.device)
        xs.append(resid[:, b, idx])
        nxt.extend(w.ids[w.n_prefix + 1:n])
        where.extend((b, p) for p in range(w.n_prefix, n - 1))
    if not xs:
        return resid[:, 0, :0], torch.empty(0, dtype=torch.long), []
    return torch.cat(xs, 1), torch.tensor(nxt, dtype=torch.long, device=resid.device), where


def quality_batch_size(model: HookedModel, windows: Sequence[Window], n_hidden: int, batch_size: int) -> int:
    """Windows per forward pass: ``batch_size`` capped by the memory budget. One window costs its
    forward pass (:func:`tracekit.model.readout.forward_row_bytes`) plus its ``[hidden states,
    tokens, d_model]`` residuals kept; one readout group is counted as held besides.

    Raises:
        MemoryBudgetError: one window does not fit (before any forward pass).
    """
    from ..model.load import model_device

    if not windows:
        return max(1, int(batch_size))
    T = max(len(w.ids) for w in windows)
    per = forward_row_bytes(model, T) + 2 * bytes_of(n_hidden, T, int(model.cfg.d_model))
    return chunk_rows(per, max(1, int(batch_size)), what="lens quality forward", device=model_device(model),
                      fixed=readout_bytes(model, extra_vocab=4) * MIN_READOUT_ROWS, unit=f"window ({T} tokens)",
                      fix="shorten the windows")


@torch.no_grad()
def quality_table(model: HookedModel, windows: Sequence[Window], lenses: Sequence[str] = ("logit", "tuned"),
                  tuned: Optional[TunedLens] = None, patchscope_positions: int = 16, seed: int = 0,
                  batch_size: int = 8, chunk_rows: int = 256, patchscope_target=None,
                  patchscope_batch_size: int | str = "auto",
                  progress: Optional[Callable[[int], object]] = None) -> pd.DataFrame:
    """Per lens and hidden state: mean KL to the model's output, next-token cross-entropy and
    top-1 agreement on ``windows`` (module docstring).

    Args:
        model: a hooked model.
        windows: held-out corpus windows (:func:`tracekit.lenses.train.split_windows`).
        lenses: any of ``logit``, ``tuned``, ``patchscope``.
        tuned: the tuned lens (required when ``tuned`` is listed).
        patchscope_positions: positions scored by Patchscope (a seeded sample of the scored positions).
        seed: seeds the Patchscope sample.
        batch_size: windows per forward pass (capped by the memory budget: :func:`quality_batch_size`).
        chunk_rows: the most positions read out at once (fewer under the memory budget; the sums
            are always taken over groups of ``chunk_rows`` rows, so the table does not depend on it).
        patchscope_target: the Patchscope target prompt (None: its default identity prompt).
        patchscope_batch_size: Patchscope's batch size (``auto`` or an int).
        progress: optional callable receiving the number of windows done.

    Returns:
        The long table, columns :data:`QUALITY_COLUMNS`, ``H = n_layers + 1`` rows per lens.

    Raises:
        ValueError: an unknown lens, or ``tuned`` listed without a lens.
        MemoryBudgetError: one window's forward pass or one group of readouts does not fit
            ``run.memory_budget``.
    """
    bad = [x for x in lenses if x not in LENSES]
    if bad or ("tuned" in lenses and tuned is None):
        raise ValueError(f"lenses: unknown {bad} (know {list(LENSES)})" if bad else "tuned: no tuned lens given")
    readout = Readout(model)
    H = int(model.cfg.n_layers) + 1
    hooks = [p.hook for p in lens_points(H - 1, "hidden_states")]
    dense = [x for x in lenses if x != "patchscope"]
    acc = {x: _Acc(H) for x in lenses}
    n_scored = sum(max(0, len(w.ids) - 1 - w.n_prefix) for w in windows)
    pick: set[int] = set()
    if "patchscope" in lenses and n_scored:
        k = min(int(patchscope_positions), n_scored)
        pick = {int(i) for i in np.random.default_rng(seed).choice(n_scored, size=k, replace=False)}
    sampled: list[tuple[Window, int, torch.Tensor, int, int]] = []  # window, token index, final log-probs, next id, row
    offset = 0
    for batch, group in window_batches(model, windows, batch_size=quality_batch_size(model, windows, H, batch_size)):
        resid = residual_stream(model, batch, hooks)  # [H, b, pos, d]
        x, nxt, where = _eval_rows(batch, group, resid)
        del resid
        N = x.shape[1]
        # per-row statistics, computed `step` vectors at a time under the memory budget, then summed in
        # groups of `chunk_rows` rows whatever the step (so the sums do not depend on the budget)
        stats = {name: torch.empty(H, 3, N, dtype=torch.float64) for name in dense}
        step = readout_chunk(model, N, what="lens quality readout", cap=chunk_rows, fixed=x.element_size() * x.numel(),
                             per_row=readout_bytes(model, extra_vocab=4),
                             fix="lower eval.n_tokens or the window length") if N else 1

        def one(sl: slice, x=x, nxt=nxt, where=where, group=group, stats=stats, base=offset) -> None:
            s = sl.start
            fin = chunked_log_probs(readout, x[H - 1], sl)
            for g in range(len(fin)):
                if base + s + g in pick and not any(t[4] == base + s + g for t in sampled):
                    b, p = where[s + g]
                    sampled.append((group[b], p, fin[g].cpu(), int(nxt[s + g]), base + s + g))
            for name in dense:
                for h in range(H):
                    tr = (lambda v, h=h, tl=tuned: tl.transform(v, h)) if name == "tuned" and tuned is not None else None
                    lp = chunked_log_probs(readout, x[h], sl, tr)
                    stats[name][h, :, sl] = torch.stack(_row_stats(fin, lp, nxt[sl]))

        if N:
            run_chunked(one, N, step, align=MIN_READOUT_ROWS if step >= MIN_READOUT_ROWS else 1,
                        what="lens quality readout")
        for s in range(0, N, chunk_rows):
            for name in dense:
                for h in range(H):
                    acc[name].add_rows(h, *stats[name][h, :, s:s + chunk_rows].unbind(0))
        offset += N
        if progress is not None:
            progress(len(group))
    if sampled:
        _patchscope(model, sampled, acc["patchscope"], H, patchscope_target, patchscope_batch_size)
    rows = [r for name in lenses for r in acc[name].rows(name)]
    return pd.DataFrame(rows, columns=QUALITY_COLUMNS)


def _patchscope(model: HookedModel, sampled, acc: _Acc, H: int, target, batch_size) -> None:
    """Score the Patchscope readout at the sampled positions (grouped by window: one call each)."""
    by_window: dict[int, list] = {}
    for w, p, fin, nxt, _ in sorted(sampled, key=lambda t: t[4]):
        by_window.setdefault(w.window, []).append((w, p, fin, nxt))
    for items in by_window.values():
        w = items[0][0]
        positions = [p for _, p, _, _ in items]
        lp = patchscope_lens_log_probs(model, list(w.ids), positions, list(range(H)), target=target,
                                       batch_size=batch_size)  # [H, P, vocab]
        fin = torch.stack([f for _, _, f, _ in items])
        nxt = torch.tensor([n for _, _, _, n in items], dtype=torch.long)
        for h in range(H):
            acc.add(h, fin, lp[h].float().cpu(), nxt)


def quality_figure(table: pd.DataFrame, title: str = ""):
    """Three panels by hidden state -- KL to the final distribution, next-token cross-entropy, top-1
    agreement with the model -- one curve per lens.

    Args:
        table: :func:`quality_table`'s long table.
        title: the figure's title.

    Returns:
        A matplotlib ``Figure`` (the caller closes it).
    """
    plt = plotting.plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("kl", "KL(final || lens) (nats)"), ("cross_entropy", "next-token cross-entropy (nats)"),
              ("top1_agreement", "top-1 agreement with the model")]
    for ax, (col, label) in zip(axes, panels):
        for lens, g in table.groupby("lens", sort=False):
            g = g.sort_values("hidden_state")
            n = g["n_tokens"].to_numpy().max()
            ax.plot(g["hidden_state"], g[col], marker="o", ms=3, label=f"{lens} ({n} tokens)")
        ax.set_xlabel("hidden state (0 = embeddings, h = output of block h-1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
