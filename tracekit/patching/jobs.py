"""Building :class:`PatchJob` s: the index rows of a site and the one job builder both front-ends
(:func:`tracekit.patching.run_patching`, :func:`tracekit.patching.batched_activation_patch`) use.

A cached run holds ``g`` prompts, or ``2g`` as two halves (``[first; second]``: clean then corrupted
for :func:`run_patching`, base then source for :func:`batched_activation_patch`). A job is one site
in one *mode*, which fixes which rows are patched and where the patched-in activation comes from:

==========  ==================  ==========================================================
mode        rows patched        activation patched in (row per prompt ``i``)
==========  ==================  ==========================================================
denoising   second half         the run's own activation, first-half row ``i``
noising     first half          the run's own activation, second-half row ``i``
zero        first ``g`` rows    zeros (one row shared by every prompt)
mean        first ``g`` rows    the ablation source, row ``i`` (a population mean)
resample    first ``g`` rows    the ablation source, row ``i`` (one drawn population prompt)
==========  ==================  ==========================================================
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pandas as pd
import torch
from jaxtyping import Int

from ..core.sites import check_neurons, head_count
from ..model.info import HookedModel
from .ablation import ABLATIONS
from .checks import resolve_layers
from .engine import CachedRun, PatchJob
from .setters import SITES, Site, expand_sites

__all__ = ["DIRECTIONS", "build_job", "count_variants", "site_index"]

#: Patching directions: ``denoising`` (clean activation into the corrupted run), ``noising`` (the reverse).
DIRECTIONS = ("denoising", "noising")


def site_index(model: HookedModel, site: Site, n_pos: int, layers: Sequence[int] | None = None,
               index_df: pd.DataFrame | None = None, neurons: Sequence[int] | None = None) -> pd.DataFrame:
    """The index rows of ``site``: one row per patch (columns ``layer`` + the site's axes, ints).

    Args:
        model: the hooked model (head counts and MLP widths per block).
        site: the :class:`Site`.
        n_pos: the prompts' token length (or the number of chosen positions: ``pos`` then holds a slot).
        layers: the blocks (default all).
        index_df: explicit index rows: returned as given (index reset).
        neurons: the neurons of a neuron site (default every neuron).

    Returns:
        ``index_df``, else every (layer, position, head / neuron) of ``layers``, in row-major order.

    Raises:
        SiteError: a neuron out of range (:func:`tracekit.core.sites.check_neurons`).
    """
    if index_df is not None:
        return index_df.reset_index(drop=True)
    layers = list(layers) if layers is not None else list(range(model.cfg.n_layers))
    axes = ("layer",) + site.axes
    rows: list = []
    for L in layers:
        rng = {"layer": [L], "pos": list(range(n_pos)), "head": list(range(head_count(model, L, site.kv_heads)))}
        if "neuron" in site.axes:
            rng["neuron"] = check_neurons(model, L, neurons)
        rows += list(itertools.product(*[rng[a] for a in axes]))
    return pd.DataFrame(rows, columns=list(axes))


def count_variants(model: HookedModel, lengths: Sequence[int], sites: Sequence[str], n_modes: int,
                   layers: Sequence[int] | None = None, neuron_layers: Sequence[int] | None = None,
                   neurons: Sequence[int] | None = None, n_positions: int | None = None) -> int:
    """How many patched runs :func:`run_patching` makes (for progress bars): per pair length and
    site, the index rows, times ``n_modes``. ``n_positions``: position-indexed sites are patched at
    that many chosen positions per pair (``run_patching(positions=...)``) instead of every position.

    Raises:
        PatchingError: an unknown site, layers or neurons out of range.
    """
    n_layers = int(model.cfg.n_layers)
    lay = resolve_layers(n_layers, layers)
    nlay = resolve_layers(n_layers, neuron_layers or [], "neuron_layers")
    total = 0
    for s in expand_sites(sites):
        site = SITES[s]
        for P in lengths:
            n_pos = n_positions if n_positions is not None and "pos" in site.axes else P
            total += len(site_index(model, site, n_pos, nlay if s.startswith("neuron") else lay, neurons=neurons))
    return total * n_modes


def _mode_rows(mode: str, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``([g] rows of the run patched, [g] rows of the source read)`` of ``mode`` (module table)."""
    b = torch.arange(g)
    if mode == "denoising":
        return b + g, b
    if mode == "noising":
        return b, b + g
    if mode == "zero":
        return b, torch.zeros_like(b)
    return b, b


def _mode_sources(site: Site, layers: Sequence[int], mode: str, run: CachedRun,
                  ablation: Callable[[str], torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """``{layer: activation patched in}`` for ``mode`` at each layer of ``layers``."""
    source: dict[int, torch.Tensor] = {}
    for L in layers:
        h = site.hook_name(int(L))
        if mode == "zero":
            source[int(L)] = torch.zeros_like(run.acts[h][:1])
        elif mode in ABLATIONS:
            assert ablation is not None, f"mode {mode!r} needs an ablation source"
            source[int(L)] = ablation(h)
        else:
            source[int(L)] = run.acts[h]
    return source


def build_job(site: Site, idf: pd.DataFrame, mode: str, run: CachedRun, g: int, device: torch.device,
              ablation: Callable[[str], torch.Tensor] | None = None,
              pos_map: Int[torch.Tensor, "g k"] | None = None) -> PatchJob:
    """The :class:`PatchJob` of one site in one mode: every index row of ``idf`` x every prompt.

    Args:
        site: the site (its setter and hook template).
        idf: ``[V]`` index rows (columns ``layer`` + the site's axes).
        mode: one of :data:`DIRECTIONS` or :data:`tracekit.patching.ABLATIONS` (see the module table).
        run: the cached run (``g`` prompts, ``2g`` for directions); directions and ``zero`` read
            the activations of ``site`` at ``idf``'s layers from it.
        g: prompts per half of the run.
        device: where the index and row tensors go (the model's device).
        ablation: for ``mean``/``resample``: ``hook -> [g, ...]`` the activation patched into each prompt.
        pos_map: ``[g, k]`` per prompt its own positions (token indices): ``idf``'s ``pos`` column
            then holds a slot ``0 .. k-1`` and prompt ``i`` of an index row is patched at
            ``pos_map[i, slot]`` (named positions that sit at different indices in different prompts).

    Returns:
        A job of ``V * g`` variants, index row major, prompt minor (variant ``v * g + i`` is index
        row ``v`` on prompt ``i``).
    """
    base_rows, src_rows = _mode_rows(mode, g)
    V = len(idf)
    index = {a: torch.tensor(idf[a].to_numpy(), dtype=torch.long).repeat_interleave(g) for a in site.axes}
    if pos_map is not None and "pos" in index:
        index["pos"] = pos_map.to(torch.long).cpu()[torch.arange(g).repeat(V), index["pos"]]
    return PatchJob(
        site=site,
        layer=torch.tensor(idf["layer"].to_numpy(), dtype=torch.long).repeat_interleave(g),
        index={a: t.to(device) for a, t in index.items()},
        base_rows=base_rows.repeat(V).to(device),
        source=_mode_sources(site, idf["layer"].unique().tolist(), mode, run, ablation),
        src_rows=src_rows.repeat(V).to(device),
    )
