"""Steering vectors: where a direction comes from (contrastive prompts, a saved probe, an SAE decoder
row, a file), its width check against a hook, and norm-matched random directions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import numpy as np
import torch
from jaxtyping import Float

from ..core.errors import SteeringError  # defined in core.errors; this import path stays public
from ..core.sites import hook as site_hook
from ..hooks import check_hooks, enabled_hooks, hook_layer
from ..model.info import HookedModel
from ..patching.engine import replay_chunk, replay_row_bytes
from ..probing.directions import load_probe_directions
from ..sae.load import LoadedSAE, load_sae
from ..sae.spec import SAESpec, hook_width
from ..tokens import Position, pad_rows
from ..units import hook_values

__all__ = ["SteeringError", "SteeringVector", "mean_difference", "probe_vector", "sae_vector", "file_vector",
           "check_vector", "random_directions"]


# ---------------------------------------------------------------------------------------------
# vectors


@dataclass(frozen=True)
class SteeringVector:
    """A steering direction in a hook's space.

    Attributes:
        vector: ``[d]`` float32 on the CPU.
        source: what it was made from (JSON-able: ``{"source": "mean_difference", ...}``).
        hook: the hook it belongs to when its source fixes one (read there, or an SAE's hook), else None.
    """

    vector: Float[torch.Tensor, " d"]
    source: dict = field(default_factory=dict)
    hook: Optional[str] = None

    @property
    def norm(self) -> float:
        """L2 norm of :attr:`vector` (units of the hook's activations)."""
        return float(self.vector.double().norm())

    def normalized(self) -> "SteeringVector":
        """The unit-norm vector (alpha then counts residual-norm units).

        Raises:
            SteeringError: a zero vector (no direction).
        """
        n = self.norm
        if not n > 0:
            raise SteeringError("vector.normalize: the vector is zero; it has no direction to normalize")
        return SteeringVector((self.vector.double() / n).float(), {**self.source, "normalized": True}, self.hook)


def _float_vector(v: Any, field: str) -> torch.Tensor:
    """``v`` (a tensor or an array of real numbers) as a ``[d]`` float32 CPU tensor.

    Raises:
        SteeringError: not a tensor or array of numbers (strings, objects, complex, bool), not one
            row ``[d]`` (a ``[1, d]`` or ``[d, 1]`` is flattened), empty, or NaN/inf values.
    """
    if not isinstance(v, torch.Tensor):
        try:
            v = np.asarray(v)
        except (ValueError, TypeError):
            raise SteeringError(f"{field}: a {type(v).__name__} that is no array of numbers; a steering vector is "
                                "one row [d] of real numbers (float)") from None
        if v.dtype.kind not in "fiu":
            raise SteeringError(f"{field}: an array of {v.dtype} values; a steering vector is one row [d] of real "
                                "numbers (float)")
        v = torch.from_numpy(np.ascontiguousarray(v))
    elif v.is_complex() or v.dtype == torch.bool:
        raise SteeringError(f"{field}: a {v.dtype} tensor; a steering vector is one row [d] of real numbers (float)")
    t = v.detach().float().cpu()
    if t.ndim == 2 and 1 in t.shape:
        t = t.flatten()
    if t.ndim != 1:
        raise SteeringError(f"{field}: a steering vector is one row [d]; got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise SteeringError(f"{field}: the vector is empty (shape [0]); a steering vector has the hook's width")
    if not torch.isfinite(t).all():
        raise SteeringError(f"{field}: the vector holds NaN/inf values")
    return t


@torch.no_grad()
def _reads(model: HookedModel, ids: Sequence[Sequence[int]], hook: str, read_position: str, batch_size: int
           ) -> Float[torch.Tensor, "n d"]:
    """One activation per prompt at ``hook``: the last token's, or the mean over its tokens (BOS not counted)."""
    layer = hook_layer(hook)
    out = []
    # activations up to the hook only (no logits): one block's of each prompt, replay_row_bytes
    batch_size = replay_chunk(model, replay_row_bytes(model, max((len(x) for x in ids), default=1)), len(ids),
                              what="steering vector reads", batch_size=batch_size, unit="prompt",
                              fix="shorten the prompts")
    for s in range(0, len(ids), batch_size):
        chunk = [list(x) for x in ids[s:s + batch_size]]
        batch = pad_rows(model, chunk, "vector.positive")
        val = hook_values(model, batch, [hook], None if layer is None else layer + 1)[hook].double()
        for i, seq in enumerate(chunk):
            real = batch.offsets[i] + torch.tensor(
                Position("mean").resolve(model, "", seq) if read_position == "mean" else [len(seq) - 1])
            out.append(val[i, real.to(val.device)].mean(0).cpu())
    return torch.stack(out)


def mean_difference(model: HookedModel, positive_ids: Sequence[Sequence[int]], negative_ids: Sequence[Sequence[int]], hook: str,
                    read_position: Literal["last", "mean"] = "last", batch_size: int = 16) -> SteeringVector:
    """The mean activation over the positive prompts minus the mean over the negative prompts at
    ``hook`` (CAA, Rimsky et al. 2024: mean over contrastive pairs; ActAdd, Turner et al. 2023: one
    pair). Equal to the mean of the pairwise differences when the sets are paired.

    Args:
        model: a hooked model.
        positive_ids: token ids of the prompts steered towards (BOS included as the model prepends it).
        negative_ids: token ids of the prompts steered away from.
        hook: TransformerLens hook read (``blocks.6.hook_resid_pre``).
        read_position: ``last`` (each prompt's last token) or ``mean`` (mean over its tokens, BOS
            excluded when prepended).
        batch_size: prompts per forward pass at most (fewer where ``run.memory_budget`` says so).

    Returns:
        A :class:`SteeringVector` (``hook`` set), computed in float64 and stored as float32.

    Raises:
        SteeringError: an empty set or an unknown ``read_position``. HookError: an unknown hook.
        MemoryBudgetError: one prompt does not fit ``run.memory_budget``.
    """
    if not positive_ids or not negative_ids:
        raise SteeringError("vector.positive / vector.negative: give at least one prompt in each set")
    if read_position not in ("last", "mean"):
        raise SteeringError(f"vector.read_position: {read_position!r} is not 'last' or 'mean'")
    check_hooks(model, [hook], "hook")
    with enabled_hooks(model, [hook]):
        pos = _reads(model, positive_ids, hook, read_position, batch_size).mean(0)
        neg = _reads(model, negative_ids, hook, read_position, batch_size).mean(0)
    src = {"source": "mean_difference", "read_position": read_position, "n_positive": len(positive_ids),
           "n_negative": len(negative_ids), "hook": hook}
    return SteeringVector((pos - neg).float(), src, hook)


def probe_vector(source: Any, layer: int, cls: Union[int, str, None] = None, site: str = "resid_post"
                 ) -> SteeringVector:
    """A fitted ``linear_probe`` direction (one class's weight row, in the model's activation basis)
    of a saved run (:func:`tracekit.probing.load_probe_directions`).

    Args:
        source: a ``LinearProbeResult`` or its saved step directory.
        layer: the probe's block index.
        cls: the class: its index in the result's classes, or its name; None for a binary probe's
            single direction.
        site: the probe's site (``resid_post``, ``resid_pre``, ...).

    Returns:
        The class's weight row (``hook`` = the site's hook at ``layer``).

    Raises:
        SteeringError: no probe at that layer, or an unknown class (naming the known ones).
        ProbingError: no saved directions.
    """
    dirs = load_probe_directions(source, site=site)
    if layer not in dirs:
        raise SteeringError(f"vector.layer: no probe at layer {layer}; the saved layers are {sorted(dirs)}")
    w = dirs[layer]
    meta = getattr(source, "meta", None)
    if meta is None and isinstance(source, (str, Path)) and (Path(source) / "meta.json").is_file():
        meta = json.loads((Path(source) / "meta.json").read_text())
    classes = [str(c) for c in (meta or {}).get("classes") or []]
    if w.shape[0] == 1:
        ok = cls is None or cls in (0, 1) or (len(classes) == 2 and str(cls) == classes[1])
        if not ok:
            raise SteeringError(f"vector.class: a binary probe has one direction (towards {classes[1:] or 'class 1'}); "
                                f"leave class out (got {cls!r})")
        row = 0
    elif isinstance(cls, int) and 0 <= cls < w.shape[0]:
        row = cls
    elif isinstance(cls, str) and cls in classes:
        row = classes.index(cls)
    else:
        raise SteeringError(f"vector.class: {cls!r} is not a class of this probe; give an index 0..{w.shape[0] - 1} "
                            f"or one of {classes}")
    src = {"source": "probe", "path": str(source) if isinstance(source, (str, Path)) else None, "layer": int(layer),
           "class": cls, "site": site}
    return SteeringVector(_float_vector(w[row], "vector"), src, site_hook(site, layer))


def sae_vector(model: HookedModel, sae: Union[SAESpec, LoadedSAE], feature: int) -> SteeringVector:
    """An SAE feature's decoder row ``W_dec[feature]`` (what one unit of the feature's activation writes).

    Args:
        model: the hooked model (the SAE is loaded onto it and checked against it).
        sae: an :class:`~tracekit.sae.spec.SAESpec` or an already loaded SAE.
        feature: the feature index.

    Returns:
        The decoder row (``hook`` = the SAE's hook).

    Raises:
        SteeringError: a feature outside ``[0, d_sae)``. SAEError: as :func:`tracekit.sae.load.load_sae`.
    """
    loaded = sae if isinstance(sae, LoadedSAE) else load_sae(sae, model, "vector.sae")
    if not 0 <= int(feature) < loaded.d_sae:
        raise SteeringError(f"vector.feature: {feature} is out of range for an SAE of {loaded.d_sae} features")
    row = loaded.sae.W_dec[int(feature)]
    return SteeringVector(_float_vector(row, "vector"), {"source": "sae", "feature": int(feature),
                                                         "sae": loaded.info.source or loaded.path},
                          loaded.hook)


#: How to write each file type :func:`file_vector` reads (quoted in its errors).
_HOW_TO_SAVE = {
    ".npy": "numpy.save(path, vector) with a float array [d]",
    ".pt": "torch.save(vector, path) with a float tensor [d] (or a dict of them: torch.save({'name': vector}, path) "
           "and key: name)",
    ".safetensors": "safetensors.torch.save_file({'name': vector}, path) and key: name",
}
_HOW_TO_SAVE[".pth"] = _HOW_TO_SAVE[".pt"]


def _load_vector_file(p: Path) -> Any:
    """The object saved in ``p``, loaded without unpickling anything but tensors.

    ``.npy``: ``numpy.load(allow_pickle=False)``; ``.pt`` / ``.pth``: ``torch.load(weights_only=True)``
    (tensors and plain containers only); ``.safetensors``: ``safetensors.torch.load_file``.

    Raises:
        SteeringError: an unknown suffix, or a file that is damaged or not a saved vector (the
            message names the file and how to save one; it never advises unpickling).
    """
    import pickle
    import zipfile

    suffix = p.suffix.lower()
    if suffix not in _HOW_TO_SAVE:
        raise SteeringError(f"vector.path: {p.name!r}: give a .pt, .npy or .safetensors file")
    errors: tuple[type[BaseException], ...] = (ValueError, OSError, EOFError, RuntimeError, pickle.UnpicklingError,
                                               zipfile.BadZipFile, AttributeError, ImportError, TypeError, KeyError)
    try:
        if suffix == ".npy":
            return np.load(str(p), allow_pickle=False)
        if suffix == ".safetensors":
            from safetensors import SafetensorError  # lazy: only for this format
            from safetensors.torch import load_file

            try:
                return load_file(str(p))
            except SafetensorError as e:
                raise ValueError(str(e)) from None
        return torch.load(str(p), map_location="cpu", weights_only=True)
    except errors as e:
        what = {".npy": "a NumPy array of numbers", ".safetensors": "a safetensors file"}.get(suffix, "a saved tensor")
        npy = suffix == ".npy" and p.read_bytes()[:6] == b"\x93NUMPY"
        why = ("it holds Python objects, which are never unpickled" if npy and "pickle" in str(e)
               else "weights-only loading refuses the Python objects it holds" if "Weights only load failed" in str(e)
               else f"damaged or another format ({type(e).__name__})")
        raise SteeringError(f"vector.path: {p.name} is not {what}: {why}. Save a vector with "
                            f"{_HOW_TO_SAVE[suffix]}") from None


def file_vector(path: Union[str, Path], key: Optional[str] = None) -> SteeringVector:
    """A vector saved in a file: ``.pt`` / ``.pth`` (a tensor, or a dict of tensors with ``key``),
    ``.npy``, or ``.safetensors`` (``key`` needed when it holds more than one tensor). The one
    checked loader of steering vectors: nothing is unpickled but tensors (``.npy`` with
    ``allow_pickle=False``, ``.pt`` with ``torch.load(weights_only=True)``); the vector must be one
    row ``[d]`` of finite real numbers.

    Returns:
        The vector (``[d]`` float32, CPU) with ``source = {"source": "file", "path", "key"}``.

    Raises:
        SteeringError: no such file, an unknown suffix, a damaged file or one that is not a saved
            vector, a missing or ambiguous key, not one row of numbers; each names the field
            (``vector.path`` / ``vector.key``), the file and how to save a vector.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise SteeringError(f"vector.path: {str(p)!r} is not a file")
    obj = _load_vector_file(p)
    how = _HOW_TO_SAVE[p.suffix.lower()]
    if isinstance(obj, dict):
        if key is None and len(obj) == 1:
            key = next(iter(obj))
        if key is None or key not in obj:
            raise SteeringError(f"vector.key: {p.name} holds {sorted(map(str, obj))}; name one with key: (got "
                                f"{key!r})")
        obj = obj[key]
    elif key is not None:
        raise SteeringError(f"vector.key: {p.name} holds one tensor, not a dict; leave key out")
    where = f"vector.path: {p.name}" + (f" [{key!r}]" if key is not None else "")
    if not isinstance(obj, (torch.Tensor, np.ndarray)):
        raise SteeringError(f"{where} holds {type(obj).__name__} data, not a tensor or array. Save a vector with {how}")
    try:
        vec = _float_vector(obj, where)
    except SteeringError as e:
        raise SteeringError(f"{e}. Save a vector with {how}") from None
    return SteeringVector(vec, {"source": "file", "path": str(p), "key": key})


def check_vector(model: HookedModel, vector: Union[SteeringVector, torch.Tensor], hook: str, field: str = "vector"
                 ) -> torch.Tensor:
    """The vector as ``[d]`` float32 after checking it fits ``hook``.

    Raises:
        HookError: an unknown hook. SteeringError: a hook whose width is unknown (not a residual,
            attention-output or MLP hook), a width different from the hook's, non-finite values.
    """
    check_hooks(model, [hook], "hook")
    v = _float_vector(vector.vector if isinstance(vector, SteeringVector) else vector, field)
    width = hook_width(model, hook)
    if width is None or hook.endswith(("attn.hook_z", "attn.hook_q", "attn.hook_k", "attn.hook_v")):
        raise SteeringError(f"hook: {hook!r} is not a [batch, pos, d] hook a vector can be added to; steer at "
                            "blocks.L.hook_resid_pre / hook_resid_mid / hook_resid_post / hook_attn_out / hook_mlp_out")
    if v.shape[0] != width:
        raise SteeringError(f"{field}: the vector has width {v.shape[0]} but {hook} is {width} wide (d_model "
                            f"{int(model.cfg.d_model)}); was it made for another model or another hook?")
    return v


def random_directions(n: int, d: int, norm: float, seed: int = 0) -> Float[torch.Tensor, "n d"]:
    """``n`` random directions of exactly ``norm``: seeded standard Gaussian vectors (float64,
    ``torch.Generator().manual_seed(seed)``) divided by their own norm and multiplied by ``norm``
    (isotropic directions; float32 rounding leaves a relative norm error below 1e-6)."""
    g = torch.Generator().manual_seed(int(seed))
    x = torch.randn(int(n), int(d), generator=g, dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True) * float(norm)).float()
