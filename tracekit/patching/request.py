"""What a paired run is asked, checked once: the pairs (one corrupted prompt per clean one, of the
same token length), their length groups, the chosen positions, and a patching request (sites,
modes, metrics, layers, neurons, answers).

The shared front door of every paired-run method: :func:`tracekit.patching.run_patching`,
:func:`tracekit.circuits.attribution_patch`, :func:`tracekit.circuits.edges.edge_attribution`,
:func:`tracekit.circuits.paths.path_patch` and :func:`tracekit.circuits.faithfulness.evaluate_circuits`
take token ids; prepared rows (a :class:`tracekit.dataset.PairedRows`) become their arguments with
:func:`paired_args` (every target, the positions) or :func:`single_target_args` (one target per row):

    run_patching(model, **paired_args(rows), sites=["resid_pre"], modes=["denoising"], metrics=["logit_diff"])
    edge_attribution(model, **single_target_args(rows, "edge attribution"), method="eap")

Pairs are never padded: rows of one token length form a group (:func:`length_groups`) that shares
one cached run (:func:`tracekit.patching.engine.cache_run`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from .. import metrics as M
from ..core.sites import check_neurons
from ..dataset.paired import PairedRows
from ..errors import PatchingError
from ..model.architectures import require
from ..model.info import HookedModel
from .ablation import ABLATIONS
from .checks import _ids_tensor, resolve_layers
from .jobs import DIRECTIONS
from .setters import expand_sites

__all__ = ["PatchRequest", "check_pairs", "check_positions", "check_request", "length_groups", "paired_args",
           "single_target_args"]


def check_pairs(clean_ids: Sequence[Sequence[int]], corrupted_ids: Sequence[Sequence[int]]
                ) -> tuple[list[list[int]], list[list[int]]]:
    """The pairs' token ids as lists of ints: one corrupted prompt per clean one, of the same
    non-zero length (pairs of different lengths are fine; they run in :func:`length_groups`).

    Args:
        clean_ids: per pair the clean prompt's token ids (BOS included as the model spec says).
        corrupted_ids: per pair the corrupted prompt's ids.

    Returns:
        ``(clean, corrupted)``: ``[n_pairs][len_i]`` lists of ints each.

    Raises:
        PatchingError: no pairs, a different number of corrupted and clean prompts, or a pair whose
            prompts differ in length (or are empty).
    """
    n = len(clean_ids)
    if n == 0 or len(corrupted_ids) != n:
        raise PatchingError(f"pairs: need one corrupted prompt per clean prompt (got {n} clean, "
                            f"{len(corrupted_ids)} corrupted)")
    clean = [list(map(int, c)) for c in clean_ids]
    corrupted = [list(map(int, c)) for c in corrupted_ids]
    for i, (c, x) in enumerate(zip(clean, corrupted)):
        if len(c) != len(x) or not c:
            raise PatchingError(f"pairs[{i}]: clean ({len(c)} tokens) and corrupted ({len(x)} tokens) must have "
                                "the same, non-zero length (see check_same_length)")
    return clean, corrupted


def length_groups(lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Pairs grouped by token length: ``[(token length, pair indices), ...]`` by increasing length,
    pairs in order within a group (each group is one cached run; prompts are never padded).

    >>> length_groups([5, 3, 5])
    [(3, [1]), (5, [0, 2])]
    """
    groups: dict[int, list[int]] = {}
    for i, L in enumerate(lengths):
        groups.setdefault(L, []).append(i)
    return sorted(groups.items())


def check_positions(positions: Sequence[Sequence[int]] | None, clean: Sequence[Sequence[int]]
                    ) -> torch.Tensor | None:
    """The chosen token indices per pair as a ``[n_pairs, k]`` LongTensor, or None (every position).

    Args:
        positions: per pair ``k`` token indices (``0 .. len - 1``, BOS counted; the same ``k`` for
            every pair), e.g. a named position resolved per row; None: every position.
        clean: the pairs' clean token ids (their lengths bound the indices).

    Raises:
        PatchingError: not one list of the same non-zero length per pair, or an index outside its pair.
    """
    if positions is None:
        return None
    rows = [[int(p) for p in r] for r in positions]
    if len(rows) != len(clean) or not rows or len({len(r) for r in rows}) != 1 or not rows[0]:
        raise PatchingError(f"positions: give per pair the same number (at least 1) of token indices; got "
                            f"{[len(r) for r in rows]} for {len(clean)} pair(s)")
    for i, (r, c) in enumerate(zip(rows, clean)):
        bad = [p for p in r if not 0 <= p < len(c)]
        if bad:
            raise PatchingError(f"positions[{i}]: {bad[0]} is outside pair {i} ({len(c)} tokens; indices 0.."
                                f"{len(c) - 1})")
    return torch.tensor(rows, dtype=torch.long)


@dataclass
class PatchRequest:
    """A checked patching request (:func:`check_request`): what every length group is patched with.

    Attributes:
        sites: site names, groups expanded (:func:`tracekit.patching.expand_sites`).
        modes: directions and ablations (:data:`tracekit.patching.DIRECTIONS`, ``ABLATIONS``).
        metric_names: metric names (:data:`tracekit.metrics.METRICS`).
        layers: block indices of the non-neuron sites (``0 .. n_layers-1``, sorted).
        neuron_layers: block indices of the neuron sites.
        neurons: the neurons patched (None: every neuron).
        target: ``[n_pairs, k]`` target token ids.
        foil: ``[n_pairs, k]`` foil token ids, or None.
        chosen: per ablation mode, per pair the baseline population members (set by the caller).
        batch_size, skip_unchanged, progress: replay options (:func:`tracekit.patching.patch_rows`).
        positions: ``[n_pairs, k]`` per pair the token indices position-indexed sites are patched
            at (None: every position; :func:`check_positions`).
        index_rows: per site explicit index rows (``layer`` + the site's axes) to patch instead of every index.
        batch_sizes: per length group run, the variants per replay batch used (set by the run).
    """

    sites: list[str]
    modes: Sequence[str]
    metric_names: list[str]
    layers: list[int]
    neuron_layers: list[int]
    neurons: Sequence[int] | None
    target: torch.Tensor
    foil: torch.Tensor | None
    chosen: dict[str, list[list[int]]]
    batch_size: int | str = "auto"
    skip_unchanged: bool = True
    progress: Callable[[int], None] | None = None
    positions: torch.Tensor | None = None
    index_rows: dict[str, pd.DataFrame] | None = None
    batch_sizes: list[int] = field(default_factory=list)

    def site_layers(self, s: str) -> list[int]:
        """The layers site ``s`` is patched at (``neuron_layers`` for neuron sites)."""
        return self.neuron_layers if s.startswith("neuron") else self.layers


def check_request(model: HookedModel, n: int, sites: Sequence[str], modes: Sequence[str], metrics: Sequence[str],
                  target_ids: Sequence[int | Sequence[int]] | None,
                  foil_ids: Sequence[int | Sequence[int]] | None,
                  layers: Sequence[int] | None, neuron_layers: Sequence[int] | None,
                  neurons: Sequence[int] | None) -> PatchRequest:
    """Check the sites, modes, metrics, layers, neurons and answer ids of a request of ``n`` pairs,
    in that order (the first problem raises). Baselines are not chosen yet (``chosen`` is empty).

    The request's fields (``sites`` ... ``neurons``) are as :func:`tracekit.patching.run_patching` takes them.

    Args:
        model: the hooked model (its layer count, MLP widths and architecture).
        n: the number of pairs.
        sites: site names or groups.
        modes: directions and ablations.
        metrics: metric names.
        target_ids: per pair one target id or a list (the same count for every pair).
        foil_ids: per pair the foil id(s), as many as targets, or None.
        layers: block indices (negative from the end; None: all).
        neuron_layers: the blocks of neuron sites.
        neurons: the neurons of neuron sites (None: all).

    Returns:
        :class:`PatchRequest` (``target``/``foil`` as ``[n, k]`` LongTensors).

    Raises:
        PatchingError: an unknown site, mode or metric; layers or neurons out of range; neuron
            sites without ``neuron_layers``; not one target (and foil) list of one length per
            pair; ``logit_diff`` without foils.
        MethodRefused: neuron sites on a model without dense MLP neurons.
    """
    sites = expand_sites(sites)
    for i, m in enumerate(modes):
        if m not in DIRECTIONS + ABLATIONS:
            raise PatchingError(f"modes[{i}]: unknown mode {m!r}; use {list(DIRECTIONS)} or {list(ABLATIONS)}")
    metric_names = list(metrics)
    for i, m in enumerate(metric_names):
        if m not in M.METRICS:
            raise PatchingError(f"metrics[{i}]: unknown metric {m!r}; use one of {sorted(M.METRICS)}")
    n_layers = int(model.cfg.n_layers)
    lay = resolve_layers(n_layers, layers, "layers")
    nlay = resolve_layers(n_layers, neuron_layers or [], "neuron_layers")
    if any(s.startswith("neuron") for s in sites) and not nlay:
        raise PatchingError("neuron_layers: neuron sites need the layers whose MLP neurons are patched")
    if any(s.startswith("neuron") for s in sites):
        require(model, "neuron patching", layers=nlay, need=("neurons",))
        for L in nlay:
            check_neurons(model, L, neurons)
    target = _ids_tensor(target_ids, "target")
    foil = _ids_tensor(foil_ids, "foil")
    if target is None or target.shape[0] != n or (foil is not None and foil.shape != target.shape):
        raise PatchingError("target/foil: give per pair the same number of target and foil token ids")
    if "logit_diff" in metric_names and foil is None:
        raise PatchingError("foil: the logit_diff metric needs a foil token per pair; add foils or drop logit_diff")
    return PatchRequest(sites, modes, metric_names, lay, nlay, neurons, target, foil, chosen={})


def paired_args(rows: PairedRows) -> dict[str, Any]:
    """The id arguments of :func:`tracekit.patching.run_patching` and
    :func:`tracekit.circuits.attribution_patch` from prepared rows: ``clean_ids``,
    ``corrupted_ids`` (``[n_rows][len_i]``), ``target_ids`` / ``foil_ids`` (per row every target /
    foil, or None without foils) and ``positions`` (per row the named positions' token indices, or
    None), as lists of ints: ``run_patching(model, **paired_args(rows), sites=..., modes=..., metrics=...)``.
    """
    return {"clean_ids": [list(c) for c in rows.clean_ids],
            "corrupted_ids": [list(c) for c in rows.corrupted_ids],
            "target_ids": [list(t) for t in rows.target_ids],
            "foil_ids": None if rows.foil_ids is None else [list(f) for f in rows.foil_ids],
            "positions": None if rows.positions is None else [list(p) for p in rows.positions]}


def single_target_args(rows: PairedRows, what: str) -> dict[str, Any]:
    """The id arguments of the one-target methods (:func:`tracekit.circuits.edges.edge_attribution`,
    :func:`tracekit.circuits.paths.path_patch`, :func:`tracekit.circuits.faithfulness.evaluate_circuits`)
    from prepared rows: ``clean_ids``, ``corrupted_ids``, ``target_ids`` (one id per row) and
    ``foil_ids`` (one per row, or None).

    Raises:
        DatasetError: a row with several targets (naming ``what``, the method).
    """
    target, foil = rows.single_target(what)
    return {"clean_ids": [list(c) for c in rows.clean_ids],
            "corrupted_ids": [list(c) for c in rows.corrupted_ids],
            "target_ids": target, "foil_ids": foil}
