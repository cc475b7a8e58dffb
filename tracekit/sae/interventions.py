"""SAE features as a unit basis (:class:`SAEBasis`, :mod:`tracekit.units`), interventions on them
(the verbs of :data:`tracekit.units.VERBS`, error term kept) measured on the target's probability and
logit, and random feature baselines."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from jaxtyping import Bool, Float

from ..core.errors import SAEError
from ..dla import resolve_target
from ..model.info import HookedModel
from ..tokens import encode, pad_ids
from ..units import VERBS, UnitEdit, intervene, random_units
from .decompose import _direct_ok, effective_decoder, sae_terms, splice_hook
from .load import LoadedSAE
from .windows import special_token_ids

__all__ = ["SAEBasis", "feature_intervention", "random_features"]


class SAEBasis:
    """The features of one SAE as a :class:`tracekit.units.UnitBasis`: activations are SAELens'
    ``encode`` of the hook's value (:func:`tracekit.sae.sae_terms`); feature ``f``'s row is its
    effective decoder row (:func:`tracekit.sae.effective_decoder`, in the activation's units).
    Edits splice the SAE in with its error term kept (:func:`tracekit.sae.splice_hook`), so only
    the edit moves the activation; ``steer`` adds ``value x`` the rows to the hook's value.
    Supports every verb of :data:`tracekit.units.VERBS`."""

    name = "sae_feature"
    verbs: tuple[str, ...] = VERBS  # declared as UnitBasis does (a literal tuple type would not match it)

    def __init__(self, handle: LoadedSAE):
        self.handle = handle
        self.hook = handle.hook
        self.n_units = handle.d_sae

    def check(self, units: Sequence[int], field: str = "features") -> list[int]:
        """Feature indices as ints.

        Raises:
            SAEError: a feature outside ``[0, d_sae)``, naming ``field``.
        """
        n = self.n_units
        bad = [u for u in units if isinstance(u, bool) or not hasattr(u, "__index__") or not 0 <= int(u) < n]
        if bad:
            raise SAEError(f"{field}: feature {bad[0]!r} out of range: the SAE has {n} features (0..{n - 1})")
        return [int(u) for u in units]

    def activations(self, value: torch.Tensor) -> Float[torch.Tensor, "... d_sae"]:
        """The SAE's feature activations of the hook's value (SAELens ``encode``; per-head values
        ``[..., head, d_head]`` flattened to ``d_in``)."""
        return sae_terms(self.handle, value).acts

    def decoder_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_model"]:
        """Effective decoder rows (float32) of an SAE that writes the residual stream.

        Raises:
            SAEError: the SAE's hook is not a residual write of width d_model.
        """
        h = self.handle
        if not _direct_ok(h.hook):
            raise SAEError(f"sae: the decoder rows of an SAE on {h.hook} do not write the residual stream")
        return effective_decoder(h)[list(units)].float()

    def hook_rows(self, units: Sequence[int]) -> Float[torch.Tensor, "k d_in"]:
        """Effective decoder rows in the hook's space and the SAE's dtype."""
        return effective_decoder(self.handle)[list(units)]

    def edit_hook(self, units: Sequence[int], edit: Callable[[torch.Tensor], torch.Tensor] | None,
                  add: Float[torch.Tensor, " d_in"] | None, where: Bool[torch.Tensor, " pos"],
                  start: torch.Tensor | None = None) -> Callable:
        """The SAE spliced in at its hook (error kept): the features ``units`` set to ``edit(acts)``
        at ``where``; ``add`` added to the hook's value at ``where``."""
        feats = torch.tensor(list(units), dtype=torch.long)
        sae_edit: Callable[[torch.Tensor], torch.Tensor] | None = None
        if edit is not None:
            def edit_feats(acts):
                f, w = feats.to(acts.device), where.to(acts.device)
                sub = acts[..., f]
                acts[..., f] = torch.where(w[:, None], edit(sub), sub)
                return acts
            sae_edit = edit_feats
        add_all = None
        if add is not None:
            add_all = torch.zeros(1, len(where), add.shape[-1], dtype=add.dtype, device=add.device)
            add_all[0, where.to(add.device)] = add
        splice = splice_hook(self.handle, use_error=True, edit=sae_edit, add=add_all)
        if start is None:
            return splice

        def from_start(act, hook=None):
            return splice(start.clone().to(act.dtype), hook)
        return from_start


@torch.no_grad()
def feature_intervention(model: HookedModel, handle: LoadedSAE, prompt: str, target: str, foil: str | None,
                         features: Sequence[int], mode: str, value: float = 0.0,
                         intervene_at: str | Sequence[int] = "all", means: Sequence[float] | None = None,
                         full: bool = False) -> dict:
    """Edit SAE features (error term kept, so only the edit moves the activation) and measure the
    effect on the target's probability and logit (difference) at the last position
    (:func:`tracekit.units.intervene` over :class:`SAEBasis`; Templeton et al. 2024's feature
    ablation / steering).

    Modes (:data:`tracekit.units.VERBS`): ``zero`` (activation -> 0; ``ablate`` is read as
    ``zero``), ``mean`` (-> ``means``, one per feature), ``clamp`` (-> ``value``), ``scale``
    (x ``value``), ``steer`` (add ``value x`` the feature's decoder row, in the activation's units,
    at ``intervene_at``). ``intervene_at``: ``all`` (every non-special token) or token indices (BOS
    counted); every mode edits the same positions.

    Returns:
        ``{clean_prob, prob, delta_prob, clean_logit, logit, delta_logit}`` (logit = logit
        difference with a foil); with ``full``, the :func:`tracekit.units.intervene` dict
        (``{"clean", "patched", "delta"}`` of :func:`tracekit.units.output_metrics`, what the
        ``sae_features`` kind tabulates with :func:`tracekit.units.intervention_row`).

    Raises:
        SAEError: unknown mode, feature out of range, ``intervene_at`` out of range, non-finite
            value / means. TokenizationError: target / foil not one token.
    """
    tgt = resolve_target(model, target, foil)
    edit = UnitEdit(SAEBasis(handle), list(features), mode, value=value, means=means, field="features")
    ids = encode(model, prompt, prepend_bos=handle.info.prepend_bos)
    batch = pad_ids(model, [ids])
    n = len(ids)
    special_ids = set(special_token_ids(model))
    sel = torch.zeros(n, dtype=torch.bool)
    if intervene_at == "all":
        sel[:] = True
    else:
        for q in intervene_at:
            if not -n <= int(q) < n:
                raise SAEError(f"intervene_at: {q} is out of range for a prompt of {n} tokens")
            sel[int(q) % n] = True
    sel &= torch.tensor([int(i) not in special_ids for i in ids])
    r = intervene(model, edit, batch, n - 1, tgt, where=sel, field="features")
    if full:
        return r
    c, p = r["clean"], r["patched"]
    return {"clean_prob": c["target_prob"], "prob": p["target_prob"], "delta_prob": p["target_prob"] - c["target_prob"],
            "clean_logit": c["logit_diff"], "logit": p["logit_diff"], "delta_logit": p["logit_diff"] - c["logit_diff"]}


def random_features(d_sae: int, k: int, exclude: Iterable[int] = (), pool: Sequence[int] | None = None,
                    seed: int = 0) -> list[int]:
    """``k`` random features (from ``pool`` when it has enough, else from all), none in ``exclude``,
    sorted (:func:`tracekit.units.random_units`, numpy's generator seeded with ``seed``)."""
    return sorted(random_units(d_sae, k, exclude, pool, seed))
