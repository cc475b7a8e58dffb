"""Ablations of the clean run: the ``mean``/``resample`` baseline population, its activations,
and the activation each ablated prompt's site is replaced by.

A prompt is never its own baseline: for a pair whose clean prompt has ``P`` tokens, the population
members are the baseline prompts of at least ``P`` tokens (aligned by position from the end) whose
tokens differ from that clean prompt (:func:`baseline_members`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import PatchingError
from ..model.info import HookedModel
from ..model.load import model_device
from .setters import Site

__all__ = ["ABLATIONS", "MIN_MEAN_POPULATION", "MIN_RESAMPLE_POPULATION", "baseline_members"]

#: Ablations of the clean run.
ABLATIONS = ("zero", "mean", "resample")
#: ``mean`` ablation needs at least this many baseline prompts other than the pair's own clean prompt.
MIN_MEAN_POPULATION = 2
#: ``resample`` needs at least this many (one prompt is drawn).
MIN_RESAMPLE_POPULATION = 1


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


def _population_acts(model: HookedModel, population_ids: Sequence[Sequence[int]], hooks: Sequence[str]
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
    """``[n, ...]``: per pair the mean of the chosen population prompts' activations at ``hook``
    (their last ``n_pos`` positions, aligned from the end; computed in float32, returned in the
    activations' dtype). ``pop_acts`` is :func:`_population_acts` output, ``chosen`` per pair the
    population indices."""
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


def choose_baselines(clean_ids: list[list[int]], baseline_ids: Sequence[Sequence[int]] | None,
                     modes: Sequence[str], seed: int) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """The baseline population and, per ``mean``/``resample`` mode in ``modes``, each pair's members.

    Returns:
        ``(population, chosen)``: the population's token ids (``baseline_ids``, default the pairs'
        clean prompts) and ``{mode: per pair the population indices}``; for ``resample`` the one
        index drawn per pair (a ``torch.Generator`` seeded with ``seed``). Empty without those modes.

    Raises:
        PatchingError: a population too small for some pair (:func:`baseline_members`).
    """
    pop = [list(map(int, p)) for p in baseline_ids] if baseline_ids is not None else clean_ids
    pop_name = "baseline_prompts" if baseline_ids is not None else "the pairs' clean prompts"
    chosen: dict[str, list[list[int]]] = {}
    for mode in ("mean", "resample"):
        if mode in modes:
            chosen[mode] = baseline_members(clean_ids, pop, mode, pop_name)
    if "resample" in chosen:
        gen = torch.Generator().manual_seed(int(seed))
        chosen["resample"] = [[ok[int(torch.randint(len(ok), (1,), generator=gen))]] for ok in chosen["resample"]]
    return pop, chosen
