"""Loading an SAE: from a SAELens directory, a SAELens pretrained release, or a training (trained
once, then loaded from the cache), onto the model's device and dtype, checked against the model."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..compat import require_sae_lens
from ..core.errors import SAEError
from ..model.info import HookedModel
from ..model.load import model_device, model_parameters
from .spec import SAEInfo, SAESpec, _cfg_info, _release_available, check_sae, sae_info
from .train import train_sae

__all__ = ["LoadedSAE", "load_sae"]


@dataclass
class LoadedSAE:
    """A SAELens SAE on a model's device and dtype, with what tracekit knows about it.

    Attributes:
        sae: the ``sae_lens.SAE`` (inference class).
        info: :class:`SAEInfo`. spec: the :class:`SAESpec` it came from.
        path: its SAELens directory (None for a release). cache_hit: training skipped (cache).
        train_stats: what training reported (time, tokens), when it trained now.
    """

    sae: Any
    info: SAEInfo
    spec: SAESpec | None = None
    path: str | None = None
    cache_hit: bool | None = None
    train_stats: dict = field(default_factory=dict)

    @property
    def hook(self) -> str:
        return str(self.info.hook)

    @property
    def d_sae(self) -> int:
        return int(self.sae.cfg.d_sae)

    @property
    def d_in(self) -> int:
        return int(self.sae.cfg.d_in)


def _check_finite(sae, field: str) -> None:
    """Refuse an SAE with NaN/inf weights: every number it gives would be NaN (or, through a max, a
    silent 0)."""
    for name, p in sae.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            raise SAEError(f"{field}: the SAE's {name} holds {bad} non-finite value(s) (NaN/inf) of {p.numel()}; "
                           "its file is damaged or its training diverged: retrain it or load another")


def _to_model(sae, model: HookedModel, field: str = "sae"):
    """``sae`` on the model's device and dtype, in eval mode, frozen (finite weights checked first)."""
    _check_finite(sae, field)
    dev = model_device(model)
    dtype = next(model_parameters(model)).dtype
    sae = sae.to(device=dev, dtype=dtype)
    sae.cfg.device = str(dev)
    sae.cfg.dtype = str(dtype).replace("torch.", "")
    sae.eval()
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae


def _load_dir(path: Path, model: HookedModel, field: str):
    """Load a SAELens directory with SAELens' ``SAE.load_from_disk`` and put it on the model.

    Raises:
        SAEError: no ``sae_weights.safetensors``, or SAELens cannot load the directory.
    """
    from sae_lens import SAE  # lazy: sae_lens is heavy

    if not (path / "sae_weights.safetensors").is_file():
        raise SAEError(f"{field}.path: {str(path)!r} has no sae_weights.safetensors (SAELens format: cfg.json + "
                       "sae_weights.safetensors)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype = str(next(model_parameters(model)).dtype).replace("torch.", "")
            sae = SAE.load_from_disk(str(path), device="cpu", dtype=dtype)
    except Exception as e:
        raise SAEError(f"{field}.path: SAELens cannot load {str(path)!r}: {type(e).__name__}: {e}") from e
    return _to_model(sae, model, field)


def load_sae(spec: SAESpec, model: HookedModel, field: str = "sae", progress: bool = False) -> LoadedSAE:
    """Load (or train, once, then load) the SAE a spec names, on the model's device and dtype, and
    check it against the model (:func:`check_sae`).

    Raises:
        SAEError: SAELens is not available (:func:`tracekit.compat.require_sae_lens`); as
            :func:`sae_info` and :func:`check_sae`; SAELens cannot load the files.
    """
    require_sae_lens(field)
    if spec.path is not None:
        info = sae_info(spec, model, field)
        check_sae(model, info, field)
        p = Path(spec.path).expanduser()
        return LoadedSAE(_load_dir(p, model, field), info, spec, str(p))
    if spec.release is not None:
        assert spec.id is not None, "SAESpec pairs release with id"
        _release_available(spec, field)
        from sae_lens import SAE  # lazy: sae_lens is heavy

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sae, _, _ = SAE.from_pretrained_with_cfg_and_sparsity(spec.release, spec.id, device="cpu")
        except Exception as e:
            raise SAEError(f"{field}: SAELens cannot load {spec.release}/{spec.id}: {type(e).__name__}: {e}") from e
        info = _cfg_info(sae.cfg.to_dict(), spec.describe())
        check_sae(model, info, field)
        return LoadedSAE(_to_model(sae, model, field), info, spec)
    assert spec.train is not None, "SAESpec has exactly one source: path, release + id, or train"
    info = sae_info(spec, model, field)
    check_sae(model, info, field)
    path, hit, stats = train_sae(model, spec.train, progress=progress, field=f"{field}.train")
    loaded = _load_dir(path, model, field)
    info = _cfg_info(loaded.cfg.to_dict(), spec.describe())
    check_sae(model, info, field)
    return LoadedSAE(loaded, info, spec, str(path), cache_hit=hit, train_stats=stats)
