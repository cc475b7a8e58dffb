"""Input checks shared by the ``activation_patching`` kind's ``check()`` and the engine: equal-length
pairs, unpadded token batches, layers, answer ids, the sites a model has, and side inputs that
bypass the residual stream."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Int

from ..core.sites import check_layers
from ..dataset.paired import pair_ids as check_same_length  # the one pair check (dataset's, re-exported)
from ..errors import MethodRefused, PatchingError
from ..hooks import check_hooks
from ..model.architectures import architecture_name, require
from ..model.info import HookedModel
from ..tokens import Batch
from .engine import CachedRun
from .setters import SITES

__all__ = ["check_same_length", "check_unpadded", "require_sites", "resolve_layers"]


def _pad_id(model: HookedModel) -> int | None:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def check_unpadded(model: HookedModel, tokens: Int[torch.Tensor, "batch pos"] | Batch, field: str = "tokens",
                   attention_mask: Int[torch.Tensor, "batch pos"] | None = None) -> Int[torch.Tensor, "batch pos"]:
    """The ``[batch, pos]`` token tensor of equal-length, unpadded prompts.

    Args:
        model: the hooked model (its tokenizer's padding token is looked for).
        tokens: a ``[batch, pos]`` tensor or a :class:`tracekit.tokens.Batch`.
        field: argument name quoted in errors.
        attention_mask: optional ``[batch, pos]`` mask; it must be all ones.

    Raises:
        PatchingError: a padded batch (a :class:`Batch` whose prompts differ in length, a mask with
            zeros, rows that end with the padding token, or rows starting with runs of it of
            different lengths): the metric would be read at a pad position. Run prompts of each
            length separately, or use :func:`run_patching`, which groups them by length.
    """
    fix = ("patching reads the metric at the last position of every row and runs without an attention mask, "
           "so prompts of a call must have one token length; patch each length separately (or use "
           "run_patching / the activation_patching kind, which group pairs by length)")
    if isinstance(tokens, Batch):
        if tokens.needs_mask:
            raise PatchingError(f"{field}: a padded batch (prompt lengths {tokens.lengths}); {fix}")
        tokens = tokens.tokens
    if not torch.is_tensor(tokens) or tokens.ndim != 2 or tokens.shape[1] == 0:
        raise PatchingError(f"{field}: expected a [batch, pos] tensor of token ids, got "
                            f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    if attention_mask is not None and not bool((attention_mask != 0).all()):
        raise PatchingError(f"{field}: attention_mask has padding (zeros); {fix}")
    pad = _pad_id(model)
    if pad is not None:
        ends = (tokens[:, -1] == pad).nonzero().flatten().tolist()
        if ends:
            raise PatchingError(f"{field}: row {ends[0]} ends with the padding token (id {pad}): a right-padded "
                                f"batch; {fix}")
        is_pad = (tokens == pad).long()
        lead = torch.cumprod(is_pad, dim=1).sum(1)
        if tokens.shape[0] > 1 and int(lead.max()) != int(lead.min()):
            raise PatchingError(f"{field}: rows start with {sorted(set(lead.tolist()))} padding tokens (id {pad}): "
                                f"a left-padded batch; {fix}")
    return tokens


def resolve_layers(n_layers: int, layers: Sequence[int] | None, field: str = "layers") -> list[int]:
    """Block indices ``0 .. n_layers-1``, sorted and unique; negative counts from the end; None = all
    (:func:`tracekit.core.sites.check_layers`).

    Raises:
        SiteError (a PatchingError): a layer out of range (naming ``field``).
    """
    return check_layers(n_layers, layers, field)


def _ids_tensor(ids, field: str) -> torch.Tensor | None:
    """``[pairs, k]`` answer token ids (one int or a list per pair), or None for None."""
    if ids is None:
        return None
    t = torch.as_tensor([[int(x) for x in ([r] if isinstance(r, int) else r)] for r in ids], dtype=torch.long)
    if t.ndim != 2 or t.shape[1] == 0:
        raise PatchingError(f"{field}: give one or more token ids per pair, the same number for every pair")
    return t


def _refuse_side_inputs(model: HookedModel, run: CachedRun, rows_a: torch.Tensor, rows_b: torch.Tensor) -> None:
    """Refuse patching between runs whose blocks also read token-dependent inputs besides the
    residual stream: patching a site could never restore (or break) the other run, so every
    number would understate the site's effect. ``run`` is a :class:`tracekit.patching.CachedRun`.

    Raises:
        MethodRefused: some block argument other than the residual differs between the row sets.
    """
    varying = run.varying_inputs(rows_a, rows_b)
    if varying:
        raise MethodRefused(
            f"activation patching is refused on {architecture_name(model)}: its blocks read token-dependent "
            f"inputs that bypass the residual stream ({', '.join(varying[:3])}), so patching the clean "
            "run's activations into the corrupted run cannot restore the clean run.")


def require_sites(model: HookedModel, sites: Sequence[str], layers: Sequence[int], neuron_layers: Sequence[int],
                  neurons: Sequence[int] | None) -> None:
    """Refuse sites this model's blocks do not have (heads on blocks without per-head outputs,
    neurons on mixture-of-experts MLPs, hooks that do not exist or never fire), naming the
    architecture. A model without weights (a :class:`tracekit.model.ModelInfo`) is not checked.

    Args:
        model: the hooked model.
        sites: patching site names (:data:`tracekit.patching.SITES`, groups expanded).
        layers: the blocks of the non-neuron sites; neuron_layers: the blocks of the neuron sites.
        neurons: unused (the neurons are checked by :func:`tracekit.patching.request.check_request`).

    Raises:
        MethodRefused: a site the model's blocks do not have (:func:`tracekit.model.architectures.require`).
        HookError: a site's hook is missing or does not fire (:func:`tracekit.hooks.check_hooks`).
    """
    if not hasattr(model, "blocks"):
        return
    for s in sites:
        site = SITES[s]
        lay = neuron_layers if s.startswith("neuron") else layers
        check_hooks(model, [site.hook_name(int(L)) for L in lay], f"sites ({s})")
        if site.hook.startswith("attn."):
            require(model, f"patching site {s}", layers=lay, need=("heads",))
        elif s.startswith("neuron"):
            require(model, f"patching site {s}", layers=lay, need=("neurons",))
        elif s.startswith(("attn_out", "mlp_out")):
            require(model, f"patching site {s}", layers=lay, need=(s.split("_")[0],))
