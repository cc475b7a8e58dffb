"""SAE features as a unit basis (:class:`SAEBasis`, :mod:`tracekit.units`), interventions on them
(the verbs of :data:`tracekit.units.VERBS`, error term kept) measured on the target's probability and
logit (one prompt: :func:`feature_intervention`; many rows, each with its own features, target/foil
and positions, batched: :func:`feature_interventions`), and random feature baselines."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from jaxtyping import Bool, Float

from ..core.errors import SAEError
from ..dla import LogitTarget, resolve_target
from ..hooks import check_hooks, enabled_hooks
from ..model.info import HookedModel
from ..tokens import encode, forward_kwargs, pad_ids, pad_rows
from ..units import VERBS, UnitEdit, intervene, output_metrics, random_units
from .decompose import _direct_ok, effective_decoder, sae_terms, splice_hook
from .load import LoadedSAE
from .windows import special_token_ids

__all__ = ["SAEBasis", "feature_intervention", "feature_interventions", "random_features"]


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


@torch.no_grad()
def feature_interventions(model: HookedModel, handle: LoadedSAE, ids: Sequence[Sequence[int]],
                          targets: Sequence[LogitTarget], read_at: Sequence[int], features: Sequence[Sequence[int]],
                          mode: str, value: float = 0.0, where: Sequence[Sequence[bool]] | None = None,
                          means: Sequence[Sequence[float]] | None = None, batch_size: int = 8,
                          clean_metrics: Sequence[dict] | None = None) -> list[dict]:
    """:func:`feature_intervention` on many prepared rows, batched: ``batch_size`` rows per forward
    pass (padded on the model spec's ``padding_side``), row ``i`` with its own features
    ``features[i]``, edit positions ``where[i]``, target/foil ``targets[i]``, read at its own position
    ``read_at[i]`` (Templeton et al. 2024's feature ablation / steering; error term kept, so only the
    edit moves the activation). A row's result equals the same edit on that row alone (tested).

    Args:
        ids: each row's token ids (with the SAE's BOS setting).
        read_at: each row's read position, an index into its own ids (BOS counted).
        features: each row's edited features (the same verb and value on every row).
        mode: a verb of :data:`tracekit.units.VERBS`.
        value: its parameter (clamp value, scale factor, steering multiple).
        where: per row, ``[len(ids[i])]`` booleans: the row's tokens edited (default: every token);
            special tokens (BOS) are never edited.
        means: for ``mean``: per row, one mean activation per feature of ``features[i]``.
        clean_metrics: the ``clean`` dicts of an earlier call on the same rows, to skip the clean passes.

    Returns:
        One ``{"clean", "patched", "delta"}`` dict per row (:func:`tracekit.units.output_metrics`).

    Raises:
        SAEError: unknown mode, feature out of range, non-finite value / means, lists of different
            lengths.
    """
    # Long (reason): per batch: the clean pass, the edit hooks per row, the edited pass and the per-row metrics share the padded batch and the rows' feature sets.
    n = len(ids)
    if len(targets) != n or len(read_at) != n or len(features) != n or (where is not None and len(where) != n) or (
            means is not None and len(means) != n) or (clean_metrics is not None and len(clean_metrics) != n):
        raise SAEError(f"feature_interventions: give one target, position, feature set (and where / means / clean "
                       f"metrics) per row ({n} rows)")
    basis = SAEBasis(handle)
    edits = [UnitEdit(basis, list(f), mode, value=value, means=None if means is None else list(means[i]),
                      field="features") for i, f in enumerate(features)]  # checks the verb, features, values
    verb = edits[0].verb if edits else mode
    check_hooks(model, [handle.hook], "features")
    special_ids = set(special_token_ids(model))
    W = effective_decoder(handle)
    out: list[dict] = []
    size = max(1, int(batch_size))
    for s in range(0, n, size):
        rows = [list(x) for x in ids[s:s + size]]
        batch = pad_rows(model, rows)
        B, P = batch.tokens.shape
        ps = [batch.offsets[b] + int(read_at[s + b]) for b in range(B)]
        sel = torch.zeros(B, P, dtype=torch.bool)
        fmask = torch.zeros(B, handle.d_sae, dtype=torch.bool)
        fvals = torch.zeros(B, handle.d_sae)
        add = torch.zeros(B, W.shape[-1], dtype=W.dtype, device=W.device)
        for b, seq in enumerate(rows):
            e = edits[s + b]
            w = torch.ones(len(seq), dtype=torch.bool) if where is None else torch.tensor(
                [bool(x) for x in where[s + b]], dtype=torch.bool)
            if len(w) != len(seq):
                raise SAEError(f"where: {len(w)} flags for row {s + b}'s {len(seq)} tokens")
            w &= torch.tensor([int(t) not in special_ids for t in seq], dtype=torch.bool)
            sel[b, batch.offsets[b]:batch.offsets[b] + len(seq)] = w
            if e.units:
                u = torch.tensor(list(e.units), dtype=torch.long)
                fmask[b, u] = True
                if isinstance(e.means, torch.Tensor):
                    fvals[b, u] = e.means.float()
                if verb == "steer":
                    add[b] = W[u.to(W.device)].sum(0) * float(e.value)

        def hook(act, hook=None, sel=sel, fmask=fmask, fvals=fvals, add=add):
            shape = act.shape
            terms = sae_terms(handle, act)
            at = sel.to(terms.x.device)
            if verb == "steer":
                new_x = terms.x + at[..., None].to(terms.x.dtype) * add.to(terms.x.dtype)[:, None, :]
            else:
                acts = terms.acts
                edit = at[:, :, None] & fmask.to(acts.device)[:, None, :]
                if verb == "zero":
                    new = torch.zeros_like(acts)
                elif verb == "clamp":
                    new = torch.full_like(acts, float(value))
                elif verb == "scale":
                    new = acts * value
                else:  # mean
                    new = fvals.to(device=acts.device, dtype=acts.dtype)[:, None, :].expand_as(acts)
                new = torch.where(edit, new, acts)
                new_x = terms.x + terms.scale * ((new - acts) @ terms.W_eff)
            return new_x.to(act.dtype).reshape(shape)

        tg = targets[s:s + size]
        with enabled_hooks(model, [handle.hook]):
            if clean_metrics is not None:
                clean = list(clean_metrics[s:s + size])
            else:
                logits = model(batch.tokens, **forward_kwargs(batch))
                clean = [output_metrics(logits[b, ps[b]], tg[b]) for b in range(B)]
            with model.hooks(fwd_hooks=[(handle.hook, hook)]):  # removed on exit, whatever is raised
                patched = model(batch.tokens, **forward_kwargs(batch))
        for b in range(B):
            pm = output_metrics(patched[b, ps[b]], tg[b])
            out.append({"clean": clean[b], "patched": pm, "delta": {k: pm[k] - clean[b][k] for k in pm}})
    return out


def random_features(d_sae: int, k: int, exclude: Iterable[int] = (), pool: Sequence[int] | None = None,
                    seed: int = 0) -> list[int]:
    """``k`` random features (from ``pool`` when it has enough, else from all), none in ``exclude``,
    sorted (:func:`tracekit.units.random_units`, numpy's generator seeded with ``seed``)."""
    return sorted(random_units(d_sae, k, exclude, pool, seed))
