"""Sparse-autoencoder (SAE) feature decomposition through SAELens.

An SAE (Bricken et al. 2023, "Towards Monosemanticity"; Cunningham et al. 2023) rewrites one
activation ``x`` (a TransformerLens hook, e.g. ``blocks.8.hook_resid_pre``) as a sparse sum of
decoder rows::

    x = sum_f a_f(x) * d_f  +  b  +  e        (features + decoder bias + reconstruction error)

where ``a_f`` is feature ``f``'s activation (``feature`` = latent index ``0 .. d_sae-1``), ``d_f``
its effective decoder row (SAELens' ``W_dec[f]``, divided by its norm when the SAE was trained
with ``rescale_acts_by_decoder_norm``, times the per-token output scale of a ``layer_norm`` /
``constant_norm_rescale`` input normalisation), ``b`` the decoder bias term and ``e = x - x_hat``
the reconstruction error, kept as its own term everywhere.

The SAE is always a SAELens object (``sae_lens.SAE``): loaded with SAELens' own loaders
(``SAE.from_pretrained``, ``SAE.load_from_disk``, which accept older field names) or trained with
SAELens' ``LanguageModelSAETrainingRunner`` on tracekit's own bridge model and an in-memory
dataset of token windows from the offline corpus (:mod:`tracekit.corpus`). One config block,
:class:`SAESpec` (YAML key ``sae:``), names it in every SAE kind.

Functions (notebook use)::

    from tracekit import load_model
    from tracekit.sae import SAESpec, load_sae, feature_decomposition, sae_quality
    model = load_model()
    h = load_sae(SAESpec(path="my_sae/"), model)
    dec = feature_decomposition(model, h, "The capital of France is", target=" Paris")
    dec.top_features(10)

Units: activations in the SAE's input units; ``contribution`` (direct) and ``attribution`` (total)
in logits (of the target, or target - foil); ``mse`` per token summed over dimensions (SAELens);
``ce_loss_*`` in nats per token; ``kl`` in nats.

Errors: :class:`tracekit.errors.SAEError` for everything an SAE cannot be used for (source cannot
be had, hook missing / not firing, width, trained on another model or basis, unsupported
normalisation), before any forward pass.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from pydantic import ConfigDict, Field, model_validator

from .core.io import ManifestInvalid, verify_files_manifest, write_files_manifest
from .core.sites import hook as site_hook
from .core.strict import StrictModel
from .errors import SAEError

__all__ = [
    "FeatureDecomposition",
    "LoadedSAE",
    "SAEInfo",
    "SAEQuality",
    "SAESpec",
    "SAETerms",
    "SAETrainSpec",
    "check_sae",
    "decoder_vocab",
    "eval_windows",
    "feature_dashboard_html",
    "feature_decomposition",
    "feature_intervention",
    "hook_width",
    "load_sae",
    "sae_cache_dir",
    "sae_info",
    "sae_quality",
    "sae_terms",
    "special_token_ids",
    "splice_hook",
    "top_activating_contexts",
    "train_sae",
]


class _Strict(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# =============================================================================================
# specs


class SAETrainSpec(_Strict):
    """Train an SAE with SAELens' ``LanguageModelSAETrainingRunner`` on tracekit's model.

    Fields:
        hook: TransformerLens hook the SAE reads and reconstructs (``blocks.24.hook_resid_pre``).
        architecture: ``topk`` (Gao et al. 2024; default) or ``standard`` (ReLU + L1).
        d_sae: number of features (default ``expansion_factor x d_in``).
        expansion_factor: used when ``d_sae`` is not given.
        k: active features per token (``topk``).
        l1_coefficient: L1 sparsity penalty coefficient of the ``standard`` architecture (default
            5.0; ignored by ``topk``).
        training_tokens: activations the SAE is trained on (SAELens' ``training_tokens``; more than
            ``dataset_tokens`` means several passes over them).
        dataset_tokens: distinct corpus tokens trained on: the first ``dataset_tokens`` of the
            corpus, packed into windows (default: ``training_tokens``).
        eval_tokens: held-out tokens (the corpus tokens right after the dataset tokens), kept for
            evaluation (``sae_eval`` reads them by default). The stdlib corpus holds ~130k tokens.
        context_size: tokens per training window (BOS included when the model prepends one).
        train_batch_size_tokens / lr: SAELens' optimiser settings.
        dead_feature_window: training steps without firing after which SAELens counts a feature
            as dead (the TopK auxiliary loss then trains dead features on the residual error,
            Gao et al. 2024); keep it well below the number of steps or the auxiliary loss never acts.
        corpus: ``stdlib`` (offline default), a text/JSONL file or a directory.
        seed: SAELens' seed.

    The trained SAE is saved in SAELens' format under ``$TRACEKIT_CACHE_DIR/saes/<hash>`` (default
    ``~/.cache/tracekit/saes``), keyed by this block, the model's fingerprint and basis, so the
    first run trains and later runs load.
    """

    hook: str
    architecture: Literal["topk", "standard"] = "topk"
    d_sae: int | None = Field(default=None, ge=1)
    expansion_factor: int = Field(default=8, ge=1)
    k: int = Field(default=32, ge=1)
    l1_coefficient: float = Field(default=5.0, ge=0)
    training_tokens: int = Field(default=40_960, ge=64)
    dataset_tokens: int | None = Field(default=None, ge=64)
    eval_tokens: int = Field(default=4096, ge=64)
    context_size: int = Field(default=64, ge=4)
    train_batch_size_tokens: int = Field(default=1024, ge=8)
    lr: float = Field(default=4e-4, gt=0)
    dead_feature_window: int = Field(default=1000, ge=1)
    corpus: str | list[str] = "stdlib"
    seed: int = 0

    @model_validator(mode="after")
    def _means_what_it_says(self):
        # values SAELens would quietly change (k clipped to d_sae; fewer tokens than one batch = one
        # step) are refused, naming the field and the fix
        if self.architecture == "topk" and self.d_sae is not None and self.k > self.d_sae:
            raise ValueError(f"k: {self.k} active features per token is more than d_sae ({self.d_sae}) features; "
                             "lower k or raise d_sae")
        if self.training_tokens < self.train_batch_size_tokens:
            raise ValueError(f"training_tokens: {self.training_tokens} is less than one batch "
                             f"(train_batch_size_tokens {self.train_batch_size_tokens}): not one full optimiser step; "
                             "raise training_tokens (to many batches) or lower train_batch_size_tokens")
        return self

    def check_width(self, d_in: int | None, field: str = "sae.train") -> None:
        """Refuse a TopK ``k`` above the SAE's width once the hook's width ``d_in`` is known (``d_sae``
        defaults to ``expansion_factor x d_in``)."""
        d_sae = self.d_sae or (d_in or 0) * self.expansion_factor
        if self.architecture == "topk" and d_sae and self.k > d_sae:
            raise SAEError(f"{field}.k: {self.k} active features per token is more than the SAE's {d_sae} features "
                           f"(expansion_factor {self.expansion_factor} x width {d_in}); lower k or raise d_sae")


class SAESpec(_Strict):
    """Which SAE (config key ``sae:``): exactly one of

    * ``release`` + ``id``: a SAELens pretrained SAE (``gpt2-small-res-jb`` /
      ``blocks.8.hook_resid_pre``), from the local Hugging Face cache or the hub;
    * ``path``: a directory in SAELens' format (``cfg.json`` + ``sae_weights.safetensors``),
      older SAELens field names accepted (``hook_point`` ...);
    * ``train``: an :class:`SAETrainSpec` (trained once, then loaded from the cache).

    The SAE is always put on the model's device and dtype, whatever its ``cfg.json`` says.

    Fields:
        release: a SAELens pretrained release name (``gpt2-small-res-jb``); needs ``id``.
        id: the SAE's id within ``release`` (``blocks.8.hook_resid_pre``); needs ``release``.
        path: a local directory in SAELens' format (``cfg.json`` + ``sae_weights.safetensors``).
        train: an :class:`SAETrainSpec`: train the SAE on this model once, then load it from the cache.
    """

    release: str | None = None
    id: str | None = None
    path: str | None = None
    train: SAETrainSpec | None = None

    retired = {"sae_id": "id; sae: {release: ..., id: ...}"}

    @model_validator(mode="before")
    @classmethod
    def _no_hook(cls, v):
        if isinstance(v, dict) and ("hook_point" in v or "hook_name" in v):
            raise ValueError("the hook of an SAE comes from its cfg.json (path/release) or train.hook")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        given = [n for n in ("release", "path", "train") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one SAE source: release + id (SAELens pretrained), path (a SAELens "
                             f"directory) or train (train one here); got {given or 'none'}")
        if (self.release is None) != (self.id is None):
            raise ValueError("release and id go together (sae: {release: gpt2-small-res-jb, id: blocks.8.hook_resid_pre})")
        return self

    def describe(self) -> str:
        if self.release is not None:
            return f"{self.release}/{self.id}"
        if self.path is not None:
            return str(self.path)
        assert self.train is not None
        return f"trained:{self.train.hook}"


# =============================================================================================
# what an SAE is, without its weights; checks


@dataclass
class SAEInfo:
    """An SAE's identity, enough to check it against a model before any forward pass.

    Attributes:
        hook: hook name it reads. d_in / d_sae: widths. model_name: the model it was trained on.
        fingerprint: :func:`tracekit.model.model_fingerprint` of that model when tracekit trained it.
        processed: whether its activations come from a weight-processed model (TransformerLens
            ``center_writing_weights``); None when unknown.
        prepend_bos / context_size: its training tokenization. normalize: its input normalisation.
        head_index: ``hook_head_index`` (unsupported when set).
    """

    hook: str | None
    d_in: int | None = None
    d_sae: int | None = None
    model_name: str | None = None
    fingerprint: str | None = None
    processed: bool | None = None
    prepend_bos: bool | None = None
    context_size: int | None = None
    normalize: str = "none"
    head_index: int | None = None
    source: str = ""


def _cfg_info(cfg_dict: dict, source: str) -> SAEInfo:
    """SAEInfo from a SAELens cfg dict (new layout with ``metadata``, or pre-6.0 flat)."""
    from sae_lens.loading.pretrained_sae_loaders import handle_config_defaulting

    d = handle_config_defaulting(dict(cfg_dict))
    meta = dict(d.get("metadata") or {})
    get = lambda k: meta.get(k, d.get(k))
    kwargs = get("model_from_pretrained_kwargs") or {}
    processed = get("tracekit_process_weights")
    if processed is None:
        processed = bool(kwargs.get("center_writing_weights", True))
    return SAEInfo(hook=get("hook_name"), d_in=d.get("d_in"), d_sae=d.get("d_sae"), model_name=get("model_name"),
                   fingerprint=get("tracekit_fingerprint"), processed=processed, prepend_bos=get("prepend_bos"),
                   context_size=get("context_size"), normalize=str(d.get("normalize_activations") or "none"),
                   head_index=get("hook_head_index"), source=source)


def _release_info(spec: SAESpec, field: str) -> tuple[Any, str, str]:
    from sae_lens.loading.pretrained_saes_directory import get_pretrained_saes_directory

    directory = get_pretrained_saes_directory()
    if spec.release not in directory:
        import difflib

        close = difflib.get_close_matches(str(spec.release), list(directory), n=3, cutoff=0.5)
        raise SAEError(f"{field}.release: {spec.release!r} is not a SAELens pretrained release"
                       + (f"; did you mean {close}?" if close else "") + " (see sae_lens/pretrained_saes.yaml)")
    rel = directory[spec.release]
    if spec.id not in rel.saes_map:
        ids = list(rel.saes_map)
        raise SAEError(f"{field}.id: {spec.id!r} is not in release {spec.release!r}; ids: {ids[:8]}"
                       + (" ..." if len(ids) > 8 else ""))
    return rel, rel.repo_id, rel.saes_map[spec.id]


def _release_available(spec: SAESpec, field: str) -> None:
    """Refuse (at once, no network wait) a pretrained SAE that is neither cached nor downloadable."""
    from huggingface_hub import try_to_load_from_cache

    from .model.source import _hub_reachable

    _, repo, folder = _release_info(spec, field)
    cached = False
    for name in (f"{folder}/cfg.json", f"{folder}/sae_weights.safetensors"):
        try:
            cached = isinstance(try_to_load_from_cache(repo, name), str)
        except Exception:  # noqa: BLE001
            cached = False
        if not cached:
            break
    if not cached and not _hub_reachable():
        raise SAEError(f"{field}: the SAELens SAE {spec.release}/{spec.id} (hub repo {repo}, folder {folder}) is not "
                       "in the local Hugging Face cache and the hub cannot be reached (offline, or HF_HUB_OFFLINE=1). "
                       "Download it on a machine with network, give sae.path (a SAELens directory), or train one "
                       "here with sae.train.")


def hook_width(model, hook: str) -> int | None:
    """The width an SAE on ``hook`` reads (``d_model`` for the residual / attention / MLP outputs,
    ``d_mlp`` for ``mlp.hook_pre/post``, ``n_heads x d_head`` for ``attn.hook_z/q``); None when unknown."""
    cfg = model.cfg
    d_model = int(cfg.d_model)
    if hook.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
                      site_hook("embed"), site_hook("pos_embed"), "ln_final.hook_normalized")):
        return d_model
    if hook.endswith(("mlp.hook_post", "mlp.hook_pre")):
        return int(getattr(cfg, "d_mlp", 0) or 0) or None
    if hook.endswith(("attn.hook_z", "attn.hook_q")):
        return int(cfg.n_heads) * int(cfg.d_head)
    if hook.endswith(("attn.hook_k", "attn.hook_v")):
        n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
        return int(n_kv) * int(cfg.d_head)
    return None


def _same_model(a: str | None, b: str) -> bool:
    """Whether SAELens' model name ``a`` names the model ``b`` (TransformerLens aliases resolved)."""
    if not a:
        return True

    def norm(s: str) -> str:
        try:
            from transformer_lens.loading_from_pretrained import get_official_model_name

            s = get_official_model_name(s)
        except Exception:  # noqa: BLE001, S110
            pass
        return s.lower().split("/")[-1]

    return norm(a) == norm(b)


def _model_names(model) -> list[str]:
    from .model.load import model_spec_of
    from .model.spec import EMBEDDED_ALIASES, EMBEDDED_HUB_NAME

    spec = model_spec_of(model)
    names = [spec.name, str(getattr(model.cfg, "model_name", ""))]
    if spec.name.lower() in EMBEDDED_ALIASES:
        names.append(EMBEDDED_HUB_NAME)
    return [n for n in names if n]


def check_sae(model, info: SAEInfo, field: str = "sae") -> None:
    """Check an SAE against a model before any forward pass.

    Checks, each its own :class:`SAEError`: the SAE names a hook; the hook exists on the model
    and fires (gated hooks are enabled by the SAE runs; ``hook_pos_embed`` under rotary positions
    never fires); the SAE's width ``d_in`` equals the hook's width; the SAE was trained on this
    model (its SAELens ``model_name``, or the weights fingerprint tracekit recorded when it trained
    it); the activation basis matches (an SAE trained on unprocessed activations is refused on a
    weight-processed model and vice versa: TransformerLens' ``center_writing_weights`` changes the
    residual stream); the input normalisation is one tracekit applies exactly; no head index.

    Works on a :class:`tracekit.model.ModelInfo` (no weights: the fingerprint is checked once
    the model is loaded).
    """
    from .errors import HookError
    from .hooks import check_hooks
    from .model.load import model_spec_of

    if not info.hook:
        raise SAEError(f"{field}: the SAE's config names no hook (cfg.json metadata.hook_name, or hook_point in "
                       "older SAELens files); add it to cfg.json")
    try:
        check_hooks(model, [info.hook], f"{field} hook_name")
    except HookError as e:
        raise SAEError(f"{field}: the SAE reads hook {info.hook!r}, which this model does not have: {e}") from e
    if info.hook.endswith(site_hook("pos_embed")) and getattr(model.cfg, "positional_embedding_type", "") == "rotary":
        raise SAEError(f"{field}: hook {info.hook!r} never fires on this model (rotary positions)")
    if info.head_index is not None:
        raise SAEError(f"{field}: SAEs on one head (hook_head_index={info.head_index}) are not supported; "
                       "use an SAE on the whole hook")
    width = hook_width(model, info.hook)
    if info.d_in is not None and width is not None and int(info.d_in) != width:
        raise SAEError(f"{field}: the SAE's width d_in={info.d_in} does not match hook {info.hook!r} of this model "
                       f"(width {width}); it was trained on another model or hook")
    if info.normalize not in ("none", "layer_norm", "constant_norm_rescale"):
        raise SAEError(f"{field}: the SAE's input normalisation {info.normalize!r} is not applied by tracekit "
                       "(supported: none, layer_norm, constant_norm_rescale; SAELens folds "
                       "expected_average_only_in when loading a release that records its scaling factor)")
    spec = model_spec_of(model)
    processed = bool(spec.process_weights)
    if info.fingerprint is None and not any(_same_model(info.model_name, n) for n in _model_names(model)):
        raise SAEError(f"{field}: the SAE was trained on model {info.model_name!r}, not on this model "
                       f"({spec.name!r}); use an SAE trained on it (or sae.train)")
    if info.processed is not None and info.processed != processed:
        want = "true" if info.processed else "false"
        raise SAEError(f"{field}: the SAE was trained on {'processed' if info.processed else 'unprocessed'} "
                       f"activations (TransformerLens center_writing_weights {info.processed}) but this model is "
                       f"loaded with process_weights {processed}: its residual stream is in another basis, so the "
                       f"SAE would read the wrong vectors. Load the model with model.process_weights: {want}")
    if info.fingerprint is not None and hasattr(model, "parameters") and hasattr(model, "W_U"):
        from .model.load import model_fingerprint

        fp = model_fingerprint(model)
        if fp != info.fingerprint:
            raise SAEError(f"{field}: the SAE was trained by tracekit on another model (weights fingerprint "
                           f"{info.fingerprint}, this model {fp}, {info.model_name!r}); train it on this model "
                           "(sae.train) or load the model it was trained on")


def sae_info(spec: SAESpec, model, field: str = "sae") -> SAEInfo:
    """The identity of the SAE a spec names, without loading weights or training.

    Raises:
        SAEError: a path without ``cfg.json``, an unknown release/id, a pretrained SAE that is
            neither cached nor downloadable.
    """
    if spec.path is not None:
        p = Path(spec.path).expanduser()
        if not (p / "cfg.json").is_file():
            raise SAEError(f"{field}.path: {spec.path!r} is not a SAELens SAE directory (cfg.json + "
                           "sae_weights.safetensors)")
        try:
            cfg = json.loads((p / "cfg.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SAEError(f"{field}.path: cannot read {p / 'cfg.json'}: {e}") from e
        if not isinstance(cfg, dict):
            raise SAEError(f"{field}.path: {p / 'cfg.json'} is not a JSON object")
        return _cfg_info(cfg, str(p))
    if spec.release is not None:
        rel, _, _ = _release_info(spec, field)
        _release_available(spec, field)
        overrides = dict(rel.config_overrides or {})
        kwargs = overrides.get("model_from_pretrained_kwargs") or {}
        hook = spec.id if str(spec.id).startswith(("blocks.", "hook_")) else None
        return SAEInfo(hook=hook or "", model_name=rel.model, processed=bool(kwargs.get("center_writing_weights", True)),
                       source=spec.describe())
    t = spec.train
    assert t is not None
    from .model.load import model_spec_of

    width = hook_width(model, t.hook)
    t.check_width(width, f"{field}.train")
    return SAEInfo(hook=t.hook, d_in=width, d_sae=t.d_sae or (width or 0) * t.expansion_factor,
                   model_name=model_spec_of(model).name, processed=bool(model_spec_of(model).process_weights),
                   prepend_bos=bool(model_spec_of(model).prepend_bos), context_size=t.context_size,
                   source=spec.describe())


# =============================================================================================
# loading


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
    import torch

    for name, p in sae.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            raise SAEError(f"{field}: the SAE's {name} holds {bad} non-finite value(s) (NaN/inf) of {p.numel()}; "
                           "its file is damaged or its training diverged: retrain it or load another")


def _to_model(sae, model, field: str = "sae"):
    from .model.load import model_device

    _check_finite(sae, field)
    dev = model_device(model)
    dtype = next(model.parameters()).dtype
    sae = sae.to(device=dev, dtype=dtype)
    sae.cfg.device = str(dev)
    sae.cfg.dtype = str(dtype).replace("torch.", "")
    sae.eval()
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae


def _load_dir(path: Path, model, field: str):
    from sae_lens import SAE

    if not (path / "sae_weights.safetensors").is_file():
        raise SAEError(f"{field}.path: {str(path)!r} has no sae_weights.safetensors (SAELens format: cfg.json + "
                       "sae_weights.safetensors)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dtype = str(next(model.parameters()).dtype).replace("torch.", "")
            sae = SAE.load_from_disk(str(path), device="cpu", dtype=dtype)
    except Exception as e:
        raise SAEError(f"{field}.path: SAELens cannot load {str(path)!r}: {type(e).__name__}: {e}") from e
    return _to_model(sae, model, field)


def load_sae(spec: SAESpec, model, field: str = "sae", progress: bool = False) -> LoadedSAE:
    """Load (or train, once, then load) the SAE a spec names, on the model's device and dtype, and
    check it against the model (:func:`check_sae`).

    Raises:
        SAEError: as :func:`sae_info` and :func:`check_sae`; SAELens cannot load the files.
    """
    if spec.path is not None:
        info = sae_info(spec, model, field)
        check_sae(model, info, field)
        p = Path(spec.path).expanduser()
        return LoadedSAE(_load_dir(p, model, field), info, spec, str(p))
    if spec.release is not None:
        _release_available(spec, field)
        from sae_lens import SAE

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sae, _, _ = SAE.from_pretrained_with_cfg_and_sparsity(spec.release, spec.id, device="cpu")
        except Exception as e:
            raise SAEError(f"{field}: SAELens cannot load {spec.release}/{spec.id}: {type(e).__name__}: {e}") from e
        info = _cfg_info(sae.cfg.to_dict(), spec.describe())
        check_sae(model, info, field)
        return LoadedSAE(_to_model(sae, model, field), info, spec)
    info = sae_info(spec, model, field)
    check_sae(model, info, field)
    path, hit, stats = train_sae(model, spec.train, progress=progress, field=f"{field}.train")
    loaded = _load_dir(path, model, field)
    info = _cfg_info(loaded.cfg.to_dict(), spec.describe())
    check_sae(model, info, field)
    return LoadedSAE(loaded, info, spec, str(path), cache_hit=hit, train_stats=stats)


# =============================================================================================
# training


#: The files of a cached SAE (SAELens' format plus tracekit's training record), checked against the
#: entry's manifest (sizes and sha256) on every cache hit.
SAE_FILES = ("cfg.json", "sae_weights.safetensors", "tracekit_train.json")


def sae_cache_entries() -> list[dict]:
    """Every cached SAE: ``key, path, size_bytes, hook, created, valid`` (sizes only; a hit checks
    the sha256 too); leftover temporary folders of killed trainings are listed as invalid."""
    from .model import weights_cache as cache

    def describe(d: Path, man: dict) -> dict:
        return {"created": man.get("created"), "hook": json.loads((d / "cfg.json").read_text()).get("hook_name"),
                "valid": cache.sizes_match(d, man) and set(SAE_FILES) <= set(man.get("files", {}))}

    return cache.dir_entries(sae_cache_dir(), describe)


def clear_sae_cache() -> tuple[int, int]:
    """Remove every cached SAE and leftover temporary folder: ``(entries removed, bytes freed)``."""
    from .model import weights_cache as cache

    return cache.clear_dir(sae_cache_dir())


def sae_cache_dir() -> Path:
    """``$TRACEKIT_CACHE_DIR/saes`` (default ``~/.cache/tracekit/saes``)."""
    root = os.environ.get("TRACEKIT_CACHE_DIR")
    base = Path(root).expanduser() if root else Path("~/.cache/tracekit").expanduser()
    return base / "saes"


def _train_key(model, t: SAETrainSpec) -> str:
    import sae_lens

    from .inputs import input_files
    from .model.load import model_fingerprint, model_spec_of

    spec = model_spec_of(model)
    corpus = {k: v["sha256"] for k, v in input_files({"corpus": t.corpus}).items()}  # what the files hold
    blob = {"train": t.model_dump(mode="json"), "corpus_sha256": corpus, "fingerprint": model_fingerprint(model),
            "process_weights": bool(spec.process_weights), "prepend_bos": bool(spec.prepend_bos),
            "dtype": spec.dtype, "sae_lens": getattr(sae_lens, "__version__", "?")}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def _corpus_windows(model, corpus, seq_len: int, skip_tokens: int, n_tokens: int, field: str) -> list[list[int]]:
    """Windows of exactly ``seq_len`` tokens packed from the corpus, after skipping ``skip_tokens``
    text tokens: documents are tokenized one by one and concatenated (separated by the tokens of a
    blank line, which is text), then cut into windows of ``seq_len`` tokens, BOS first when the
    model prepends one (as SAELens packs its training contexts). Deterministic; a window never
    starts mid-skip. Stops once ``n_tokens`` text tokens are collected."""
    from .corpus import iter_documents
    from .model.load import model_spec_of
    from .tokens import encode

    bos = encode(model, "", prepend_bos=True) if model_spec_of(model).prepend_bos else []
    width = seq_len - len(bos)
    if width < 1:
        raise SAEError(f"{field}: seq_len {seq_len} leaves no room for text after the BOS")
    sep = encode(model, "\n\n", prepend_bos=False)
    out: list[list[int]] = []
    buf: list[int] = []
    seen = 0
    for _, text in iter_documents(corpus, field=field):
        buf.extend(encode(model, text, prepend_bos=False) + sep)
        while len(buf) >= width:
            chunk, buf = buf[:width], buf[width:]
            if seen < skip_tokens:
                seen += width
                continue
            out.append(bos + chunk)
            if len(out) * width >= n_tokens:
                return out
    return out


def eval_windows(model, handle: LoadedSAE, corpus: str | list[str] | None = None,
                 max_tokens: int = 4096, seq_len: int | None = None, field: str = "corpus") -> list[list[int]]:
    """Token windows to evaluate an SAE on: for an SAE trained here with ``corpus`` None, the
    held-out tokens that follow its training tokens; else the first ``max_tokens`` of ``corpus``.
    Windows are ``seq_len`` tokens (default: the SAE's context size, else 64).

    Raises:
        SAEError: the corpus gives no window.
    """
    t = handle.spec.train if handle.spec is not None else None
    L = int(seq_len or (t.context_size if t else None) or handle.info.context_size or 64)
    if t is not None and corpus is None:
        wins = _corpus_windows(model, t.corpus, t.context_size, t.dataset_tokens or t.training_tokens,
                               min(max_tokens, t.eval_tokens) if max_tokens else t.eval_tokens, field)
    else:
        wins = _corpus_windows(model, corpus or "stdlib", L, 0, max_tokens, field)
    if not wins:
        raise SAEError(f"{field}: no full window of {L} tokens in the corpus; lower seq_len or give more text")
    return wins


@torch.no_grad()
def _cache_activations(model, hook: str, windows: list[list[int]], out: Path, batch_size: int = 16,
                       progress: bool = False) -> None:
    """Run the model once over ``windows`` and save the activations at ``hook`` (and the token ids)
    as a ``datasets`` dataset in SAELens' cached-activations format (one row per window: a
    ``[context_size, d_in]`` array named after the hook, plus ``token_ids``), so SAELens' trainer
    can take several passes over them without re-running the model. The forward pass stops at the
    hook. Windows must all have the same length and no padding."""
    import numpy as np
    from datasets import Array2D, Dataset, Features, Sequence, Value

    from .fastpath import residual_stream
    from .tokens import pad_ids

    chunks: list[np.ndarray] = []
    it = range(0, len(windows), batch_size)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"activations at {hook}", unit="batch")
    for i in it:
        batch = pad_ids(model, windows[i:i + batch_size])
        act = residual_stream(model, batch, [hook])[0]
        chunks.append(act.reshape(act.shape[0], act.shape[1], -1).float().cpu().numpy())
    acts = np.concatenate(chunks)
    del chunks
    feats = Features({hook: Array2D(shape=tuple(acts.shape[1:]), dtype="float32"),
                      "token_ids": Sequence(Value("int32"), length=acts.shape[1])})
    ds = Dataset.from_dict({hook: acts, "token_ids": np.asarray(windows, dtype=np.int32)}, features=feats)
    del acts
    import datasets

    bars = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(out))
    finally:
        if bars:
            datasets.enable_progress_bars()


def _sae_lens_interrupts() -> tuple[type[BaseException], ...]:
    try:
        from sae_lens.training._interruption import InterruptedException
    except ImportError:  # pragma: no cover - another SAELens layout: nothing to map
        return ()
    return (InterruptedException,)


def _runner_class(base):
    """SAELens' runner without its signal handling: its ``run_trainer_with_interruption_handling``
    installs SIGINT/SIGTERM handlers that raise its own exception and are never restored; tracekit's
    own handlers (Ctrl-C -> KeyboardInterrupt, SIGTERM -> an interrupted run) stay in charge."""

    class _Runner(base):
        def run_trainer_with_interruption_handling(self, trainer):
            return trainer.fit()

    return _Runner


def train_sae(model, t: SAETrainSpec, progress: bool = False, field: str = "sae.train",
              cache_dir: Path | None = None) -> tuple[Path, bool, dict]:
    """Train an SAE with SAELens' ``LanguageModelSAETrainingRunner`` (``override_model``: this
    bridge; ``override_dataset``: an in-memory ``datasets.Dataset`` of corpus token windows), save
    it in SAELens' format and cache it by the hash of its training config and model.

    Returns:
        ``(directory, cache_hit, stats)``; ``stats`` has the training time and token counts.

    Raises:
        SAEError: the hook cannot be read, or the corpus is too small.
    """
    import time

    from datasets import Dataset
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        StandardTrainingSAEConfig,
        TopKTrainingSAEConfig,
    )

    from .core.signals import preserved_signal_handlers
    from .hooks import enabled_hooks, state_guard
    from .model import weights_cache as cache
    from .model.load import model_device, model_fingerprint, model_spec_of

    root = Path(cache_dir) if cache_dir is not None else sae_cache_dir()
    cache.remove_stale_temps(root)  # what killed trainings left behind
    key = _train_key(model, t)
    out = root / key
    if out.exists():
        try:
            verify_files_manifest(out, SAE_FILES)
            stats = json.loads((out / "tracekit_train.json").read_text())
            return out, True, stats
        except (ManifestInvalid, OSError, ValueError) as e:
            warnings.warn(f"the cached SAE {out} is invalid ({e}): removing it and training it again", stacklevel=2)
            shutil.rmtree(out, ignore_errors=True)
    width = hook_width(model, t.hook)
    if width is None:
        raise SAEError(f"{field}.hook: cannot tell the width of hook {t.hook!r}; train on a residual, attn_out, "
                       "mlp_out or mlp.hook_post hook")
    d_sae = t.d_sae or width * t.expansion_factor
    n_data = t.dataset_tokens or t.training_tokens
    wins = _corpus_windows(model, t.corpus, t.context_size, 0, n_data, f"{field}.corpus")
    n_tok = sum(len(w) for w in wins)
    held = _corpus_windows(model, t.corpus, t.context_size, n_data, t.eval_tokens, f"{field}.corpus")
    n_held = sum(len(w) for w in held)
    if n_tok < n_data or n_held < t.eval_tokens:
        raise SAEError(f"{field}: the corpus gives {n_tok} dataset tokens and {n_held} held-out tokens, fewer than "
                       f"dataset_tokens ({n_data}) and eval_tokens ({t.eval_tokens}); lower them (the stdlib corpus "
                       "holds ~130k tokens; training_tokens above dataset_tokens repeats the dataset) or give a "
                       "larger corpus")
    spec = model_spec_of(model)
    dev = str(model_device(model))
    if t.architecture == "topk":
        t.check_width(width, field)
        sae_cfg = TopKTrainingSAEConfig(d_in=width, d_sae=d_sae, k=t.k, device=dev)
    else:
        sae_cfg = StandardTrainingSAEConfig(d_in=width, d_sae=d_sae, l1_coefficient=t.l1_coefficient, device=dev)
    tmp = root / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    n_buffer = max(4, math.ceil(2 * t.train_batch_size_tokens / t.context_size))
    acts_dir = tmp / "activations"
    cfg = LanguageModelSAERunnerConfig(
        sae=sae_cfg, model_name=spec.name, hook_name=t.hook, dataset_path="tracekit-corpus",
        is_dataset_tokenized=True, streaming=False, context_size=t.context_size, training_tokens=t.training_tokens,
        use_cached_activations=True, cached_activations_path=str(acts_dir),
        exclude_special_tokens=special_token_ids(model),
        train_batch_size_tokens=t.train_batch_size_tokens, store_batch_size_prompts=8, n_batches_in_buffer=n_buffer,
        prepend_bos=False, device=dev, lr=t.lr, seed=t.seed, logger=LoggingConfig(log_to_wandb=False),
        dead_feature_window=t.dead_feature_window,
        output_path=str(tmp), checkpoint_path=None, n_checkpoints=0, verbose=bool(progress),
        n_batches_for_norm_estimate=4, n_eval_batches=1, dtype="float32",
        model_from_pretrained_kwargs={"center_writing_weights": bool(spec.process_weights)})
    ds = Dataset.from_dict({"input_ids": wins})
    t0 = time.time()
    import logging

    sl_logger = logging.getLogger("sae_lens")
    level = sl_logger.level
    sl_logger.setLevel(logging.ERROR)
    try:
        with state_guard(model), enabled_hooks(model, [t.hook]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _cache_activations(model, t.hook, wins, acts_dir, progress=progress)
            t_acts = time.time() - t0
            runner = _runner_class(LanguageModelSAETrainingRunner)(cfg, override_dataset=ds, override_model=model)
            with preserved_signal_handlers(_sae_lens_interrupts()):
                runner.run()
            # sae-lens' runner may leave the trainer's grad settings on: the model stays frozen.
            for p in model.parameters():
                p.requires_grad_(False)
        cj = json.loads((tmp / "cfg.json").read_text())
        cj.setdefault("metadata", {})
        cj["metadata"].update({"tracekit_fingerprint": model_fingerprint(model),
                               "tracekit_process_weights": bool(spec.process_weights),
                               "tracekit_model": spec.name, "prepend_bos": bool(spec.prepend_bos),
                               "model_from_pretrained_kwargs": {"center_writing_weights": bool(spec.process_weights)}})
        (tmp / "cfg.json").write_text(json.dumps(cj))
        shutil.rmtree(acts_dir, ignore_errors=True)
        stats = {"train_seconds": round(time.time() - t0, 2), "activation_seconds": round(t_acts, 2),
                 "train_tokens": t.training_tokens,
                 "dataset_tokens": n_tok, "train_windows": len(wins), "held_out_tokens": n_held,
                 "d_sae": d_sae, "d_in": width, "key": key, "train": t.model_dump(mode="json")}
        (tmp / "tracekit_train.json").write_text(json.dumps(stats))
        write_files_manifest(tmp, {"key": key, "kind": "sae"})  # sizes + sha256, checked on every hit
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        sl_logger.setLevel(level)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out, False, stats


# =============================================================================================
# the decomposition x = sum_f a_f d_f + b + e


def special_token_ids(model) -> list[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, PAD, ...): masked wherever they sit."""
    tok = model.tokenizer
    ids = {int(i) for i in (getattr(tok, "all_special_ids", None) or [])}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(tok, name, None)
        if v is not None:
            ids.add(int(v))
    return sorted(ids)


@dataclass
class SAETerms:
    """The SAE's reading of activations ``x`` (flattened to ``[..., d_in]``).

    ``x = recon + error``; ``recon = scale * (acts @ W_eff + b_dec) + shift``, so feature ``f``
    writes ``scale * acts[..., f] * W_eff[f]`` and the decoder-bias term is ``scale * b_dec + shift``.
    """

    x: torch.Tensor
    acts: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor
    W_eff: torch.Tensor
    b_dec: torch.Tensor

    @property
    def bias_term(self) -> torch.Tensor:
        return self.scale * self.b_dec + self.shift

    @property
    def recon(self) -> torch.Tensor:
        return self.scale * (self.acts @ self.W_eff + self.b_dec) + self.shift

    @property
    def error(self) -> torch.Tensor:
        return self.x - self.recon


def _flat(handle: LoadedSAE, x: torch.Tensor) -> torch.Tensor:
    return x.flatten(-2, -1) if x.ndim == 4 else x


def effective_decoder(handle: LoadedSAE) -> Float[torch.Tensor, "d_sae d_in"]:
    """Decoder rows as they write into the activation: ``W_dec`` (divided by its row norms when the
    SAE rescales activations by decoder norm, SAELens TopK)."""
    sae = handle.sae
    W = sae.W_dec
    if getattr(sae.cfg, "rescale_acts_by_decoder_norm", False):
        W = W / W.norm(dim=-1, keepdim=True)
    return W


@torch.no_grad()
def sae_terms(handle: LoadedSAE, x: Float[torch.Tensor, "... d_in"]) -> SAETerms:
    """Encode ``x`` with the SAE (SAELens' ``encode``: its input normalisation, ``b_dec``
    subtraction, activation function) and return the linear pieces of its reconstruction.

    Raises:
        SAEError: the activation's width is not the SAE's ``d_in``.
    """
    sae = handle.sae
    x = _flat(handle, x)
    if x.shape[-1] != sae.cfg.d_in:
        raise SAEError(f"sae: activation width {x.shape[-1]} != the SAE's d_in {sae.cfg.d_in}")
    xs = x.to(sae.dtype)
    acts = sae.encode(xs)
    if acts.is_sparse:
        acts = acts.to_dense()
    norm = sae.cfg.normalize_activations
    one = torch.ones(xs.shape[:-1] + (1,), dtype=xs.dtype, device=xs.device)
    zero = torch.zeros_like(one)
    if norm == "layer_norm":
        mu = xs.mean(dim=-1, keepdim=True)
        scale, shift = (xs - mu).std(dim=-1, keepdim=True), mu
    elif norm == "constant_norm_rescale":
        scale, shift = xs.norm(dim=-1, keepdim=True) / (sae.cfg.d_in ** 0.5), zero
    else:
        scale, shift = one, zero
    for attr in ("ln_mu", "ln_std", "x_norm_coeff"):
        if attr in sae.__dict__:
            delattr(sae, attr)
    return SAETerms(xs, acts, scale, shift, effective_decoder(handle), sae.b_dec)


FeatureEdit = Callable[[torch.Tensor], torch.Tensor]


def splice_hook(handle: LoadedSAE, *, use_error: bool = True, edit: FeatureEdit | None = None,
                add: torch.Tensor | None = None, keep: torch.Tensor | None = None,
                store: dict | None = None):
    """A TransformerLens forward hook that splices the SAE in at its hook.

    Args:
        use_error: with the error term the output is ``x + scale * (acts' - acts) @ W_eff`` (equal to
            ``x`` exactly when nothing is edited); without it, the reconstruction ``x_hat(acts')``.
        edit: ``acts -> acts'`` (``[batch, pos, d_sae]``), e.g. set a feature to 0.
        add: ``[batch, pos, d_in]`` added to the output (steering along decoder rows).
        keep: ``[batch, pos]`` bool, positions left untouched (special tokens, padding).
        store: filled with the :class:`SAETerms` of the clean activation (key ``terms``).
    """

    def hook(act, hook=None):
        shape = act.shape
        terms = sae_terms(handle, act)
        if store is not None:
            store["terms"] = terms
        new = terms.acts if edit is None else edit(terms.acts.clone())
        if use_error:
            out = terms.x + terms.scale * ((new - terms.acts) @ terms.W_eff) if edit is not None else terms.x.clone()
        else:
            out = terms.scale * (new @ terms.W_eff + terms.b_dec) + terms.shift
        if add is not None:
            out = out + add.to(out.dtype)
        if keep is not None:
            out = torch.where(keep[..., None].to(out.device), terms.x, out)
        return out.to(act.dtype).reshape(shape)

    return hook


# =============================================================================================
# decomposition + attribution of prompts


@dataclass
class FeatureDecomposition:
    """One prompt read through the SAE.

    Attributes:
        prompt, tokens (decoded), ids, position (the read position), special (bool per token).
        acts: ``[pos, d_sae]`` feature activations. error_norm / x_norm: ``[pos]``.
        metric: the model's target logit (or logit difference) at ``position``.
        direct: ``[d_sae]`` each feature's direct contribution (logits) at ``position`` through the
            frozen final-norm scale; None when the hook is not a residual write of width d_model.
        direct_error / direct_bias / direct_total: the same for the error and decoder-bias terms,
            and for the whole activation (features + error + bias = total).
        total: ``[d_sae]`` activation x gradient of the metric, summed over the non-special
            positions; total_error / total_bias / total_special / total_activation likewise
            (features + error + bias + special = activation).
    """

    prompt: str
    tokens: list[str]
    ids: list[int]
    position: int
    special: list[bool]
    acts: torch.Tensor
    error_norm: torch.Tensor
    x_norm: torch.Tensor
    metric: float
    label: str
    direct: torch.Tensor | None
    direct_error: float
    direct_bias: float
    direct_total: float
    final_scale: float
    total: torch.Tensor
    total_error: float
    total_bias: float
    total_special: float
    total_activation: float


def _metric_fn(target_id: int, foil_id: int | None):
    def f(logits_row):
        v = logits_row[target_id].float()
        return v - logits_row[foil_id].float() if foil_id is not None else v
    return f


def _direct_ok(hook: str) -> bool:
    return hook.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out"))


def feature_decomposition(model, handle: LoadedSAE, prompt: str, target: str, foil: str | None = None,
                          position: int = -1, field: str = "prompts") -> FeatureDecomposition:
    """Read one prompt through the SAE and attribute the target logit (difference) to its features.

    Tokenized with the SAE's ``prepend_bos`` when it records one. Special tokens (BOS wherever it
    sits) are masked by id: they get no feature rows in rankings and their activation's attribution
    is reported as its own term.

    * direct (Elhage et al. 2021 direct logit attribution through the frozen final-norm scale of
      this run, from the final norm's input and output; :meth:`tracekit.Readout.direction`; under
      a nonlinear output transform such as Gemma 2's soft-cap, of the pre-transform logits): feature ``f`` at the
      read position contributes ``scale * a_f * W_eff[f] . u_eff / sigma`` logits.
    * total (attribution patching, Nanda 2023; Marks et al. 2024 for SAE features): ``a_f * d_f .
      grad_x metric``, summed over positions; grads are enabled only for this call.

    Raises:
        TokenizationError: target/foil not one token, prompt too long, position out of range.
        SAEError: the prompt is longer than the SAE's training context.
    """
    from .dla import resolve_target
    from .errors import TokenizationError
    from .hooks import enabled_hooks
    from .model.norms import run_sigma
    from .model.readout import Readout
    from .tokens import check_length, encode, pad_ids, str_tokens

    tgt = resolve_target(model, target, foil)
    ids = encode(model, prompt, prepend_bos=handle.info.prepend_bos)
    check_length(model, ids, field, prompt)
    ctx = handle.info.context_size
    if ctx and len(ids) > int(ctx):
        raise SAEError(f"{field}: {prompt[:40]!r}... is {len(ids)} tokens, longer than the SAE's training context "
                       f"({ctx}); its features are not defined beyond it")
    n = len(ids)
    if not -n <= position < n:
        raise TokenizationError(f"position: {position} is out of range for a prompt of {n} tokens")
    p = position % n
    batch = pad_ids(model, [ids])
    special_ids = set(special_token_ids(model))
    special = [int(i) in special_ids for i in ids]
    store: dict = {}

    def grab(act, hook):
        leaf = act.detach().clone().requires_grad_(True)
        store["x"] = leaf
        return leaf

    def grab_final(act, hook):
        store[hook.name] = act.detach()

    with enabled_hooks(model, [handle.hook]), torch.enable_grad():
        logits = model.run_with_hooks(batch.tokens, fwd_hooks=[(handle.hook, grab),
                                                               (site_hook("final_norm_in"), grab_final),
                                                               (site_hook("final_norm_out"), grab_final)])
        m = _metric_fn(tgt.target_id, tgt.foil_id)(logits[0, p])
        m.backward()
    x = store["x"]
    grad = _flat(handle, x.grad.detach())[0].float()
    terms = sae_terms(handle, x.detach()[0:1])
    acts = terms.acts[0].float()
    W = terms.W_eff.float()
    sc = terms.scale[0].float()
    feat_mask = torch.tensor([not s for s in special], device=acts.device)
    gW = grad @ W.T  # [pos, d_sae]
    per_pos = acts * sc * gW  # [pos, d_sae]
    total = (per_pos * feat_mask[:, None]).sum(0)
    err = terms.error[0].float()
    bias = terms.bias_term[0].float()
    xf = terms.x[0].float()
    dot = lambda v: (v * grad).sum(-1)
    total_error = float((dot(err) * feat_mask).sum())
    total_bias = float((dot(bias.expand_as(err)) * feat_mask).sum())
    total_special = float((dot(xf) * ~feat_mask).sum())
    total_activation = float(dot(xf).sum())
    direct = None
    d_err = d_bias = d_tot = float("nan")
    readout = Readout(model)
    sigma = float("nan")
    if site_hook("final_norm_in") in store and site_hook("final_norm_out") in store:  # the final norm's scale in this run
        sigma = float(run_sigma(readout.final_norm, store[site_hook("final_norm_in")][0, p], store[site_hook("final_norm_out")][0, p]))
    if _direct_ok(handle.hook) and W.shape[-1] == int(model.cfg.d_model):
        ue, _ = readout.direction(tgt.target_id, tgt.foil_id)
        ue = ue.to(W.device)
        inv = 1.0 / sigma
        direct = acts[p] * sc[p] * (W @ ue) * inv
        if special[p]:
            direct = torch.zeros_like(direct)
        d_err = float(err[p] @ ue) * inv
        d_bias = float(bias[p] @ ue) * inv if bias.ndim > 1 else float(bias @ ue) * inv
        d_tot = float(xf[p] @ ue) * inv
    return FeatureDecomposition(
        prompt=prompt, tokens=str_tokens(model, ids), ids=list(ids), position=p, special=special,
        acts=acts.detach().cpu(), error_norm=err.norm(dim=-1).cpu(), x_norm=xf.norm(dim=-1).cpu(),
        metric=float(m.detach()), label=tgt.label, direct=None if direct is None else direct.detach().cpu(),
        direct_error=d_err, direct_bias=d_bias, direct_total=d_tot, final_scale=1.0 / sigma,
        total=total.detach().cpu(), total_error=total_error, total_bias=total_bias, total_special=total_special,
        total_activation=total_activation)


# =============================================================================================
# quality


@dataclass
class SAEQuality:
    """SAE quality on a set of token windows (SAELens' definitions, ``sae_lens.evals``).

    ``metrics``: ``mse`` (``||x - x_hat||^2`` summed over dimensions, mean over tokens),
    ``explained_variance`` (``1 - E||x - x_hat||^2 / (E||x||^2 - ||E x||^2)``, SAELens'
    ``ExplainedVarianceCalculator``), ``l0`` (mean active features per token), ``ce_loss_clean`` /
    ``ce_loss_sae`` / ``ce_loss_zero`` / ``ce_loss_mean`` (nats per predicted token),
    ``ce_loss_recovered`` (``(ce_zero - ce_sae) / (ce_zero - ce_clean)``, SAELens'
    ``ce_loss_score``), ``ce_loss_recovered_mean`` (against mean ablation), ``kl`` (KL(clean ||
    spliced), nats), ``n_dead`` / ``n_dense``, ``n_tokens``.
    ``density``: ``[d_sae]`` fraction of tokens each feature is active on; ``dead``: never active.
    """

    metrics: dict
    density: torch.Tensor
    max_act: torch.Tensor

    def dead(self) -> list[int]:
        return torch.nonzero(self.density == 0).flatten().tolist()

    def dense(self, threshold: float) -> list[int]:
        return torch.nonzero(self.density > threshold).flatten().tolist()


def _ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token next-token cross-entropy ``[batch, pos-1]`` (nats)."""
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -lp.gather(-1, tokens[:, 1:, None])[..., 0]


@torch.no_grad()
def sae_quality(model, handle: LoadedSAE, windows: Sequence[Sequence[int]], batch_size: int = 8,
                dense_threshold: float = 0.1, progress: bool = False) -> SAEQuality:
    """Evaluate an SAE spliced into the model on token windows.

    Padding and special tokens are excluded from every metric and left untouched by the splice
    and by the ablations (SAELens' ``exclude_special_tokens`` / ``ignore_tokens`` mask); the CE
    loss counts position ``t`` (predicting token ``t+1``) when token ``t`` is counted and ``t+1``
    is real. The mean ablation replaces the activation by its mean over the counted tokens of all
    windows. Results do not depend on ``batch_size`` (per-token sums).
    """
    from sae_lens.evals import ExplainedVarianceCalculator

    from .hooks import enabled_hooks
    from .tokens import forward_kwargs, pad_ids

    hook = handle.hook
    special = torch.tensor(special_token_ids(model))
    d_sae = handle.d_sae
    counts = torch.zeros(d_sae, dtype=torch.float64)
    max_act = torch.zeros(d_sae)
    evc = ExplainedVarianceCalculator()
    sums = {k: 0.0 for k in ("mse", "l0", "ce_clean", "ce_sae", "ce_zero", "ce_mean", "kl")}
    n_tok = 0
    n_ce = 0
    x_sum = None
    batches = [list(windows[i:i + batch_size]) for i in range(0, len(windows), max(1, batch_size))]
    clean_cache = []

    def masks(batch):
        real = batch.attention_mask.bool()
        keep = ~torch.isin(batch.tokens.cpu(), special).to(real.device) & real
        ce_mask = keep[:, :-1] & real[:, 1:]
        return keep, ce_mask

    with enabled_hooks(model, [hook]):
        for wins in batches:  # pass 1: clean logits, SAE stats, activation mean
            batch = pad_ids(model, wins)
            keep, ce_mask = masks(batch)
            st: dict = {}

            def grab(act, hook=None, st=st):
                st["x"] = act.detach()
            logits = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, grab)], **forward_kwargs(batch))
            terms = sae_terms(handle, st["x"])
            k = keep.to(terms.x.device)
            x = terms.x[k].float()
            xh = terms.recon[k].float()
            a = terms.acts[k].float()
            evc.add_batch(sae_output=xh, hidden_acts=x)
            sums["mse"] += float((x - xh).pow(2).sum())
            sums["l0"] += float((a != 0).sum())
            counts += (a != 0).sum(0).double().cpu()
            if len(a):
                max_act = torch.maximum(max_act, a.max(0).values.cpu())
            x_sum = x.sum(0) if x_sum is None else x_sum + x.sum(0)
            n_tok += int(k.sum())
            ce = _ce(logits, batch.tokens)
            sums["ce_clean"] += float(ce[ce_mask].sum())
            n_ce += int(ce_mask.sum())
            clean_cache.append(torch.log_softmax(logits.float(), -1)[:, :-1][ce_mask].cpu())
        if n_tok == 0:
            raise SAEError("the evaluation windows hold no token to evaluate (all padding or special tokens)")
        mean_x = (x_sum / n_tok)
        for bi, wins in enumerate(batches):  # pass 2: spliced, zero- and mean-ablated runs
            batch = pad_ids(model, wins)
            keep, ce_mask = masks(batch)
            untouched = ~keep

            def zero(act, hook=None, untouched=untouched):
                flat = _flat(handle, act)
                out = torch.where(untouched[..., None].to(act.device), flat, torch.zeros_like(flat))
                return out.reshape(act.shape)

            def mean(act, hook=None, untouched=untouched):
                flat = _flat(handle, act)
                out = torch.where(untouched[..., None].to(act.device), flat, mean_x.to(flat.dtype).expand_as(flat))
                return out.reshape(act.shape)
            kw = forward_kwargs(batch)
            spliced = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, splice_hook(handle, use_error=False,
                                                                                       keep=untouched))], **kw)
            lz = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, zero)], **kw)
            lm = model.run_with_hooks(batch.tokens, fwd_hooks=[(hook, mean)], **kw)
            for name, lg in (("ce_sae", spliced), ("ce_zero", lz), ("ce_mean", lm)):
                sums[name] += float(_ce(lg, batch.tokens)[ce_mask].sum())
            ref = clean_cache[bi].to(spliced.device)
            lp = torch.log_softmax(spliced.float(), -1)[:, :-1][ce_mask]
            sums["kl"] += float((ref.exp() * (ref - lp)).sum())
    density = (counts / n_tok).float()
    ce = {k: sums[k] / max(1, n_ce) for k in ("ce_clean", "ce_sae", "ce_zero", "ce_mean")}

    def recovered(abl):
        den = abl - ce["ce_clean"]
        return (abl - ce["ce_sae"]) / den if abs(den) > 1e-12 else float("nan")
    metrics = {
        "mse": sums["mse"] / n_tok, "explained_variance": float(evc.compute()), "l0": sums["l0"] / n_tok,
        "ce_loss_clean": ce["ce_clean"], "ce_loss_sae": ce["ce_sae"], "ce_loss_zero": ce["ce_zero"],
        "ce_loss_mean": ce["ce_mean"], "ce_loss_recovered": recovered(ce["ce_zero"]),
        "ce_loss_recovered_mean": recovered(ce["ce_mean"]), "kl": sums["kl"] / max(1, n_ce),
        "n_dead": int((counts == 0).sum()), "n_dense": int((density > dense_threshold).sum()),
        "dense_threshold": dense_threshold, "n_tokens": n_tok, "n_ce_tokens": n_ce, "n_windows": len(windows),
    }
    return SAEQuality(metrics, density, max_act)


# =============================================================================================
# interventions


@torch.no_grad()
def feature_intervention(model, handle: LoadedSAE, prompt: str, target: str, foil: str | None,
                         features: Sequence[int], mode: Literal["ablate", "clamp", "steer"], value: float = 0.0,
                         intervene_at: str | Sequence[int] = "all") -> dict:
    """Edit SAE features (error term kept, so only the edit moves the activation) and measure the
    effect on the target's probability and logit (difference) at the last position.

    Modes: ``ablate`` (activation -> 0), ``clamp`` (activation -> ``value``), ``steer`` (add
    ``value x`` the feature's decoder row, in the activation's units, at ``intervene_at``).
    ``intervene_at``: ``all`` (every non-special token) or token indices (BOS counted); ablate and
    clamp edit the same positions.

    Returns:
        ``{clean_prob, prob, delta_prob, clean_logit, logit, delta_logit}`` (logit = logit
        difference with a foil).
    """
    from .dla import resolve_target
    from .hooks import enabled_hooks
    from .metrics import target_prob
    from .tokens import encode, pad_ids

    tgt = resolve_target(model, target, foil)
    ids = encode(model, prompt, prepend_bos=handle.info.prepend_bos)
    batch = pad_ids(model, [ids])
    n = len(ids)
    special_ids = set(special_token_ids(model))
    sel = torch.zeros(n, dtype=torch.bool)
    if intervene_at == "all":
        sel[:] = True
    else:
        for q in intervene_at:  # type: ignore[union-attr]
            if not -n <= int(q) < n:
                raise SAEError(f"intervene_at: {q} is out of range for a prompt of {n} tokens")
            sel[int(q) % n] = True
    sel &= torch.tensor([int(i) not in special_ids for i in ids])
    sel = sel.to(batch.tokens.device)
    feats = torch.tensor(list(features), dtype=torch.long, device=batch.tokens.device)
    add = None

    def edit(acts):
        if mode == "steer":
            return acts
        sub = acts[0][:, feats]
        new = torch.zeros_like(sub) if mode == "ablate" else torch.full_like(sub, float(value))
        acts[0][:, feats] = torch.where(sel[:, None], new, sub)
        return acts
    if mode == "steer":
        W = effective_decoder(handle)
        vec = W[feats].sum(0) * float(value)
        add = torch.zeros(1, n, vec.shape[-1], dtype=vec.dtype, device=vec.device)
        add[0, sel] = vec
    ft = tgt.target_id
    tt = torch.tensor([[ft]], device=batch.tokens.device)

    def read(lg):
        row = lg[0, -1].float()
        v = row[ft] - (row[tgt.foil_id] if tgt.foil_id is not None else 0.0)
        return float(target_prob(row[None], tt)[0]), float(v)
    with enabled_hooks(model, [handle.hook]):
        clean = model(batch.tokens)
        hook = splice_hook(handle, use_error=True, edit=None if mode == "steer" else edit, add=add)
        patched = model.run_with_hooks(batch.tokens, fwd_hooks=[(handle.hook, hook)])
    cp, cl = read(clean)
    pp, pl = read(patched)
    return {"clean_prob": cp, "prob": pp, "delta_prob": pp - cp, "clean_logit": cl, "logit": pl,
            "delta_logit": pl - cl}


def random_features(d_sae: int, k: int, exclude: Iterable[int] = (), pool: Sequence[int] | None = None,
                    seed: int = 0) -> list[int]:
    """``k`` random features (from ``pool`` when it has enough, else from all), none in ``exclude``."""
    rng = random.Random(seed)
    ex = {int(e) for e in exclude}
    cands = [int(f) for f in (pool or []) if int(f) not in ex]
    if len(cands) < k:
        cands = [f for f in range(d_sae) if f not in ex]
    return sorted(rng.sample(cands, min(k, len(cands))))


# =============================================================================================
# feature readouts: decoder -> vocabulary, top-activating contexts


@torch.no_grad()
def decoder_vocab(model, handle: LoadedSAE, features: Sequence[int], k: int = 10) -> pd.DataFrame:
    """Tokens each feature's decoder row promotes / suppresses, read through the final norm and
    unembedding at scale 1 (:meth:`tracekit.Readout.vocab_projection`, centred over the
    vocabulary; logits per unit of activation). Only for SAEs whose decoder writes the residual
    stream (width d_model).

    Returns:
        rows ``feature, side (promoted|suppressed), rank, token, token_id, logit``.
    """
    from .model.readout import Readout
    from .tokens import str_tokens

    rows = []
    if handle.d_in != int(model.cfg.d_model) or not _direct_ok(handle.hook):
        return pd.DataFrame(columns=["feature", "side", "rank", "token", "token_id", "logit"])
    W = effective_decoder(handle)
    scores = Readout(model).vocab_projection(W[list(features)])
    for i, f in enumerate(features):
        s = scores[i]
        for side, vals in (("promoted", torch.topk(s, k)), ("suppressed", torch.topk(-s, k))):
            toks = str_tokens(model, vals.indices.tolist())
            for r, (tid, v, t) in enumerate(zip(vals.indices.tolist(), vals.values.tolist(), toks)):
                rows.append({"feature": int(f), "side": side, "rank": r + 1, "token": t, "token_id": int(tid),
                             "logit": float(v if side == "promoted" else -v)})
    return pd.DataFrame(rows)


@torch.no_grad()
def top_activating_contexts(model, handle: LoadedSAE, features: Sequence[int], windows: Sequence[Sequence[int]],
                            top_n: int = 5, batch_size: int = 8, before: int = 12, after: int = 3
                            ) -> tuple[pd.DataFrame, dict]:
    """The corpus tokens on which each feature is most active (padding and special tokens excluded).

    Returns:
        ``(contexts, hist)``: ``contexts`` rows ``feature, rank, activation, window, position,
        token, context`` plus ``tokens`` / ``token_acts`` (JSON lists: the context's tokens and the
        feature's activation on each, for shading); ``hist[feature]`` = activations > 0 seen
        (numpy array) for density plots.
    """
    from .hooks import enabled_hooks
    from .tokens import forward_kwargs, pad_ids, str_tokens

    feats = torch.tensor(list(features), dtype=torch.long)
    special = torch.tensor(special_token_ids(model))
    best: dict[int, list] = {int(f): [] for f in features}
    hist: dict[int, list] = {int(f): [] for f in features}
    acts_keep: dict[tuple, torch.Tensor] = {}
    with enabled_hooks(model, [handle.hook]):
        for s in range(0, len(windows), max(1, batch_size)):
            wins = [list(w) for w in windows[s:s + batch_size]]
            batch = pad_ids(model, wins)
            st: dict = {}

            def grab(act, hook=None, st=st):
                st["x"] = act.detach()
            model.run_with_hooks(batch.tokens, fwd_hooks=[(handle.hook, grab)], **forward_kwargs(batch))
            a = sae_terms(handle, st["x"]).acts[..., feats.to(st["x"].device)].float().cpu()  # [b, pos, F]
            ok = batch.attention_mask.bool().cpu() & ~torch.isin(batch.tokens.cpu(), special)
            a = a * ok[..., None]
            for j, f in enumerate(features):
                col = a[..., j]
                hist[int(f)].append(col[col > 0].numpy())
                flat = col.flatten()
                kk = min(top_n, int((flat > 0).sum()))
                if kk == 0:
                    continue
                v, idx = torch.topk(flat, kk)
                for val, ix in zip(v.tolist(), idx.tolist()):
                    b, p = divmod(ix, col.shape[1])
                    best[int(f)].append((val, s + b, p))
                    acts_keep[(int(f), s + b)] = col[b]
                best[int(f)] = sorted(best[int(f)], key=lambda t: (-t[0], t[1], t[2]))[:top_n]
    rows = []
    for f in features:
        for r, (val, w, p) in enumerate(best[int(f)]):
            ids = list(windows[w])
            lo, hi = max(0, p - before), min(len(ids), p + after + 1)
            toks = str_tokens(model, ids[lo:hi])
            col = acts_keep[(int(f), w)]
            ctx = "".join(toks[: p - lo]) + "[[" + toks[p - lo] + "]]" + "".join(toks[p - lo + 1:])
            rows.append({"feature": int(f), "rank": r + 1, "activation": float(val), "window": int(w), "position": int(p),
                         "token": toks[p - lo], "context": ctx.replace("\n", " "),
                         "tokens": json.dumps(toks), "token_acts": json.dumps([round(float(x), 5) for x in col[lo:hi]])})
    df = pd.DataFrame(rows, columns=["feature", "rank", "activation", "window", "position", "token", "context",
                                     "tokens", "token_acts"])
    return df, {f: (np.concatenate(v) if v else np.zeros(0)) for f, v in hist.items()}


# =============================================================================================
# dashboards (self-contained HTML, no network)


def _esc(s) -> str:
    import html

    return html.escape(str(s)).replace("\n", "&#10;")


def feature_dashboard_html(feature: int, title: str, stats: dict, contexts: pd.DataFrame, vocab: pd.DataFrame,
                           density_png_b64: str | None = None) -> str:
    """One feature's self-contained HTML page (inline CSS, the density figure as an inline PNG):
    its statistics, top-activating contexts with each token shaded by the feature's activation,
    and the tokens its decoder row promotes / suppresses."""
    rows = []
    for r in contexts.sort_values("rank").itertuples():
        toks = json.loads(r.tokens)
        vals = json.loads(r.token_acts)
        mx = max([abs(v) for v in vals] + [1e-9])
        spans = []
        for t, v in zip(toks, vals):
            a = min(1.0, abs(v) / mx)
            spans.append(f'<span title="{v:.3f}" style="background: rgba(255,120,0,{a:.2f})">{_esc(t)}</span>')
        rows.append(f"<tr><td>{r.rank}</td><td>{r.activation:.3f}</td><td class=ctx>{''.join(spans)}</td></tr>")
    voc = []
    for side in ("promoted", "suppressed"):
        v = vocab[vocab["side"] == side].sort_values("rank") if len(vocab) else vocab
        items = "".join(f"<li><code>{_esc(repr(t))}</code> {lg:+.3f}</li>" for t, lg in zip(v["token"], v["logit"]))
        voc.append(f"<div class=col><h3>{side}</h3><ol>{items or '<li>(not a residual-stream SAE)</li>'}</ol></div>")
    st = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in stats.items())
    img = f'<img alt="activation density" src="data:image/png;base64,{density_png_b64}">' if density_png_b64 else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} td.ctx{{font-family:monospace;white-space:pre-wrap}}
table{{border-collapse:collapse}} td,th{{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}}
.col{{display:inline-block;vertical-align:top;width:45%}}</style></head>
<body><h1>{_esc(title)}</h1>
<table>{st}</table>
<h2>Top-activating contexts</h2><p>Token shading: this feature's activation (darker = larger).</p>
<table><tr><th>rank</th><th>activation</th><th>context</th></tr>{''.join(rows) or '<tr><td colspan=3>never active</td></tr>'}</table>
<h2>Decoder row read in vocabulary space (logits per unit activation)</h2>{''.join(voc)}
<h2>Activation density</h2>{img}
</body></html>"""
