"""Loading an SAE: from a SAELens directory, a SAELens pretrained release, or a training (trained
once, then loaded from the cache), onto the model's device and dtype, checked against the model.

The SAE is always tracekit's own :class:`tracekit.dictionaries.Dictionary` (SAELens' maths,
reproduced: encode/decode equal to SAELens' to float precision), so every SAE kind runs on both
TransformerLens stacks: a SAELens directory is read by
:func:`tracekit.dictionaries.formats.load_saelens_dir` without ``sae_lens``. Only a pretrained
release (``sae.release`` + ``id``) is fetched through SAELens' registry (then converted); where
SAELens is missing it is refused naming ``sae.path`` as the alternative.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.errors import SAEError
from ..dictionaries.dictionary import Dictionary
from ..dictionaries.formats import load_saelens_dir
from ..model.info import HookedModel
from ..model.load import model_device, model_parameters
from .spec import SAEInfo, SAESpec, _cfg_info, _release_available, check_sae, require_release_support, sae_info
from .train import train_sae

__all__ = ["LoadedSAE", "load_sae", "saelens_architecture"]


@dataclass
class LoadedSAE:
    """An SAE (a :class:`~tracekit.dictionaries.Dictionary` with ``hook_in == hook_out``) on a
    model's device and dtype, with what tracekit knows about it.

    Attributes:
        sae: the :class:`~tracekit.dictionaries.Dictionary` (SAELens' maths: ``normalize_activations``,
            ``rescale_acts_by_decoder_norm``, ``apply_b_dec_to_input`` as its ``cfg.json`` says).
        info: :class:`SAEInfo`. spec: the :class:`SAESpec` it came from.
        path: its SAELens directory (None for a release). cache_hit: training skipped (cache).
        train_stats: what training reported (time, tokens), when it trained now.
    """

    sae: Dictionary
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
        return int(self.sae.d_sae)

    @property
    def d_in(self) -> int:
        return int(self.sae.d_in)


def saelens_architecture(sae: Dictionary) -> str:
    """SAELens' architecture name of a dictionary (``standard`` for ReLU, else its activation:
    ``topk``, ``jumprelu``, ``gated``, ...), as SAELens' ``cfg.architecture()`` reports it.

    Args:
        sae: the dictionary.

    Returns:
        The name. Raises nothing.
    """
    return "standard" if sae.activation == "relu" else str(sae.activation)


def _check_finite(sae: Dictionary | dict[str, torch.Tensor], field: str) -> None:
    """Refuse an SAE with NaN/inf weights (a module or a file's tensors): every number it gives would
    be NaN (or, through a max, a silent 0)."""
    items = sae.items() if isinstance(sae, dict) else sae.named_parameters()
    for name, p in items:
        if not p.is_floating_point():
            continue
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            raise SAEError(f"{field}: the SAE's {name} holds {bad} non-finite value(s) (NaN/inf) of {p.numel()}; "
                           "its file is damaged or its training diverged: retrain it or load another")


def _to_model(sae: Dictionary, model: HookedModel, field: str = "sae") -> Dictionary:
    """``sae`` on the model's device and dtype, in eval mode, frozen (finite weights checked first)."""
    _check_finite(sae, field)
    dev = model_device(model)
    dtype = next(model_parameters(model)).dtype
    sae = sae.to(device=dev, dtype=dtype)
    sae.eval()
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae


def _load_dir(path: Path, model: HookedModel, field: str) -> Dictionary:
    """Load a SAELens directory (no SAELens needed) and put it on the model.

    Raises:
        SAEError: no ``sae_weights.safetensors``, or the directory cannot be read as a SAELens SAE.
    """
    if not (path / "sae_weights.safetensors").is_file():
        raise SAEError(f"{field}.path: {str(path)!r} has no sae_weights.safetensors (SAELens format: cfg.json + "
                       "sae_weights.safetensors)")
    dtype = next(model_parameters(model)).dtype
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sae = load_saelens_dir(path, device="cpu", dtype=dtype)
    except Exception as e:  # noqa: BLE001 - any reader failure is this field's
        _check_file_finite(path, field)  # NaN/inf weights: the message that names the tensor and the count
        raise SAEError(f"{field}.path: cannot load {str(path)!r} as a SAELens SAE: {type(e).__name__}: {e}") from e
    return _to_model(sae, model, field)


def _check_file_finite(path: Path, field: str) -> None:
    """:func:`_check_finite` on the tensors of ``path``'s ``sae_weights.safetensors`` (nothing when it
    cannot be read: the caller reports that)."""
    from safetensors.torch import load_file  # lazy: only on a failed load

    try:
        state = load_file(str(path / "sae_weights.safetensors"))
    except Exception:  # noqa: BLE001, S110 - unreadable: the loader's own error is reported
        return
    _check_finite(state, field)


def _load_release(spec: SAESpec, model: HookedModel, field: str) -> tuple[Dictionary, dict]:
    """A SAELens pretrained SAE through SAELens' registry (which folds a recorded activation scaling
    factor into the weights), converted to a :class:`Dictionary` through SAELens' own directory
    format (``save_model``, then :func:`load_saelens_dir`). Returns ``(dictionary, cfg dict)``.

    Raises:
        SAEError: SAELens is missing (:func:`require_release_support`) or cannot load it.
    """
    require_release_support(f"{field}.release")
    assert spec.release is not None and spec.id is not None, "SAESpec pairs release with id"
    from sae_lens import SAE  # lazy: sae_lens is heavy and optional

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sae, _, _ = SAE.from_pretrained_with_cfg_and_sparsity(spec.release, spec.id, device="cpu")
    except Exception as e:
        raise SAEError(f"{field}: SAELens cannot load {spec.release}/{spec.id}: {type(e).__name__}: {e}") from e
    with tempfile.TemporaryDirectory(prefix="tracekit-sae-") as tmp:
        sae.save_model(tmp)
        cfg = json.loads((Path(tmp) / "cfg.json").read_text())
        d = _load_dir(Path(tmp), model, field)
    return d, cfg


def load_sae(spec: SAESpec, model: HookedModel, field: str = "sae", progress: bool = False) -> LoadedSAE:
    """Load (or train, once, then load) the SAE a spec names, on the model's device and dtype, and
    check it against the model (:func:`check_sae`).

    Args:
        spec: the ``sae:`` block.
        model: the hooked model.
        field: the YAML field named in errors.
        progress: show training progress.

    Returns:
        The :class:`LoadedSAE` (its ``sae`` a :class:`~tracekit.dictionaries.Dictionary`).

    Raises:
        SAEError: a release where SAELens is not available (:func:`require_release_support`; a path
            needs no SAELens, a training as :func:`tracekit.sae.train.train_sae`); as
            :func:`sae_info` and :func:`check_sae`; the files cannot be read.
    """
    if spec.path is not None:
        info = sae_info(spec, model, field)
        check_sae(model, info, field)
        p = Path(spec.path).expanduser()
        return LoadedSAE(_load_dir(p, model, field), info, spec, str(p))
    if spec.release is not None:
        assert spec.id is not None, "SAESpec pairs release with id"
        _release_available(spec, field)
        sae, cfg = _load_release(spec, model, field)
        info = _cfg_info(cfg, spec.describe())
        check_sae(model, info, field)
        return LoadedSAE(sae, info, spec)
    assert spec.train is not None, "SAESpec has exactly one source: path, release + id, or train"
    info = sae_info(spec, model, field)
    check_sae(model, info, field)
    path, hit, stats = train_sae(model, spec.train, progress=progress, field=f"{field}.train")
    loaded = _load_dir(path, model, field)
    info = _cfg_info(_read_cfg(path, field), spec.describe())
    check_sae(model, info, field)
    return LoadedSAE(loaded, info, spec, str(path), cache_hit=hit, train_stats=stats)


def _read_cfg(path: Path, field: str) -> dict:
    """The ``cfg.json`` of a SAELens directory.

    Raises:
        SAEError: missing or not a JSON object.
    """
    try:
        cfg = json.loads((path / "cfg.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SAEError(f"{field}: cannot read {path / 'cfg.json'}: {e}") from e
    if not isinstance(cfg, dict):
        raise SAEError(f"{field}: {path / 'cfg.json'} is not a JSON object")
    return cfg
