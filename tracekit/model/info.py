"""What a model is without its weights (:class:`ModelInfo`, built in seconds to check configs), and
:class:`HookedModel`, the type every method's ``model`` argument has."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

from ..core.cachedir import cache_path
from ..core.errors import ModelLoadError
from ..core.protocols import HookedModel as HookedModel  # re-exported: the type of every model argument
from . import load as _load
from .source import _load_config_and_tokenizer
from .spec import ModelSpec, _check_devices, as_spec

log = logging.getLogger("tracekit.model")


class ModelInfo:
    """What a model is, without its weights: tokenizer, TransformerLens config and hook names.

    Built in seconds by :func:`load_model_info` so configs can be checked (single-token targets,
    prompt lengths against the context, layer/head indices, hook names) before the model loads.
    Duck-types the parts of a loaded model that ``Experiment.check`` reads: ``tokenizer``,
    ``cfg``, ``hook_dict`` (names only), ``tracekit_spec`` and ``_gated_hook_reason``.
    """

    def __init__(self, spec: ModelSpec, tokenizer, cfg, hook_names: list[str], gate):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.hook_dict = {n: None for n in hook_names}
        self._gate = gate
        self.tracekit_spec = spec.model_copy(update={"prepend_bos": spec.resolved_prepend_bos(tokenizer)})
        self.tracekit_requested_spec = spec

    def _gated_hook_reason(self, name: str) -> Optional[str]:
        return self._gate(name)

    def _no_weights(self, what: str):
        raise ModelLoadError(f"{what}: {self!r} is the model's tokenizer and config only (no weights); "
                             "load the model (tracekit.load_model) to run it")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._no_weights("a forward pass")

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any:
        self._no_weights("run_with_cache")

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any:
        self._no_weights("run_with_hooks")

    def hooks(self, *args: Any, **kwargs: Any) -> Any:
        self._no_weights("hooks")

    def __repr__(self) -> str:
        return f"ModelInfo({self.tracekit_spec.name!r}, n_layers={self.cfg.n_layers})"


_INFO: dict[str, ModelInfo] = {}


def load_model_info(spec: ModelSpec | str | dict | None = None, **overrides) -> "ModelInfo | Any":
    """The tokenizer, config and hook names of a spec's model, without reading its weights.

    A model already loaded in this process is returned as is. Otherwise the architecture is
    instantiated with one block on the ``meta`` device (no memory, no weights) and wrapped in a
    bridge to read TransformerLens' config and hook names, which are then named for every block.
    Those are kept in the model-info cache (:func:`_info_cache_file`; local models only), so the
    next process reads them back without importing TransformerLens (its config then is a
    :class:`CachedConfig` with the same fields).

    Raises:
        ModelLoadError: as :func:`load_model`, for what can be known without the weights.
    """
    spec = as_spec(spec, **overrides)
    if spec.key() in _load._CACHE:
        return _load._CACHE[spec.key()]
    if spec.key() in _INFO:
        return _INFO[spec.key()]
    _check_devices(spec)
    config, tok, bridge_name = _load_config_and_tokenizer(spec)
    where = _info_cache_file(spec)
    info = _read_cached_info(where, spec, tok) if where is not None else None
    if info is None:
        info = _info_from_config(spec, config, tok, bridge_name)
        if where is not None:
            _write_cached_info(where, info)
    _INFO[spec.key()] = info
    return info


#: Bump when what :func:`_write_cached_info` stores changes.
_INFO_FORMAT = 1


class CachedConfig(SimpleNamespace):
    """A model's TransformerLens config read back from the model-info cache: the same fields as
    the ``TransformerBridgeConfig`` it was taken from (plain values), without importing
    TransformerLens; ``head_dim`` as the bridge config has it."""

    @property
    def head_dim(self) -> int:
        return int(self.d_head)

    def to_dict(self) -> dict:
        return dict(vars(self))


def _stamp(path: Path) -> list:
    """Name, size and modification time of ``path`` (a file) or of each file directly in it (a folder)."""
    files = sorted(q for q in path.iterdir() if q.is_file()) if path.is_dir() else [path]
    return [[q.name, q.stat().st_size, q.stat().st_mtime_ns] for q in files]


def _info_cache_file(spec: ModelSpec) -> Optional[Path]:
    """Where the model-info cache keeps ``spec``'s config and hook names
    (``<cache root>/model-info/<key>.pkl``), keyed by the spec, its local files' sizes and times
    (the GGUF file, the model folder, the tokenizer folder), the versions of TransformerLens,
    transformers and torch, and this module's source. None for a hub model (its files are not
    stamped here) or with ``TRACEKIT_CACHE=off``."""
    import hashlib
    import importlib.metadata as md
    import json

    from . import weights_cache
    from .source import _source

    if not weights_cache.cache_enabled():
        return None
    src = _source(spec)
    if src.kind == "hub":
        return None
    try:
        stamps = {"source": _stamp(Path(src.path)) if src.kind != "random" else None,
                  "tokenizer": _stamp(Path(spec.tokenizer)) if spec.tokenizer and Path(spec.tokenizer).exists() else
                  spec.tokenizer}
        versions = {}
        for dist in ("transformer-lens", "transformers", "torch"):
            try:
                versions[dist] = md.version(dist)
            except md.PackageNotFoundError:
                versions[dist] = None
        blob = {"format": _INFO_FORMAT, "spec": spec.key(), "source": [src.kind, src.path, src.bridge_name],
                "stamps": stamps, "versions": versions,
                "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}
    except OSError:
        return None
    key = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return cache_path("model_info") / f"{key}.pkl"


def _write_cached_info(where: Path, info: ModelInfo) -> None:
    """Store ``info``'s config fields, hook names and gated hooks (best effort: a cache that cannot
    be written is skipped)."""
    import pickle

    from ..core.io import atomic_write

    names = list(info.hook_dict)
    data = {"format": _INFO_FORMAT, "cfg": dict(vars(info.cfg)), "names": names,
            "gated": {n: r for n in names if (r := info._gated_hook_reason(n)) is not None}}
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(where, pickle.dumps(data))
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        log.debug("model-info cache not written (%s): %s", where, e)


def _read_cached_info(where: Path, spec: ModelSpec, tok) -> Optional[ModelInfo]:
    """The :class:`ModelInfo` of a model-info cache entry (``tok`` as its tokenizer), or None when
    there is none or it cannot be read (then it is rebuilt)."""
    import pickle

    if not where.is_file():
        return None
    try:
        data = pickle.loads(where.read_bytes())
        if data.get("format") != _INFO_FORMAT:
            return None
        cfg = CachedConfig(**data["cfg"])
        gated = dict(data["gated"])
        names = list(data["names"])
    except Exception as e:  # noqa: BLE001 - an unreadable entry is rebuilt
        log.debug("model-info cache entry %s unreadable: %s", where, e)
        return None

    def gate_fn(name: str) -> Optional[str]:
        return gated.get(name)

    return ModelInfo(spec, tok, cfg, names, gate_fn)


def _info_from_config(spec: ModelSpec, config, tok, bridge_name: str) -> ModelInfo:
    import copy
    import re

    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM

    n_layers = None
    small = copy.deepcopy(config)
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(small, attr):
            n_layers = int(getattr(small, attr))
            setattr(small, attr, 1)
            break
    if n_layers is None:
        raise ModelLoadError(f"model {spec.name!r}: cannot read the number of layers from its config")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(small)
            bridge = TransformerBridge.boot_transformers(bridge_name, hf_model=hf, tokenizer=tok, device="meta")
        except NotImplementedError:  # e.g. GPT-2's fused QKV must be read at boot: use empty memory
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(small)
            hf = hf.to_empty(device="cpu")
            bridge = TransformerBridge.boot_transformers(bridge_name, hf_model=hf, tokenizer=tok, device="cpu")
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"TransformerLens' bridge does not support this model: {e}") from e
        bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    cfg = copy.copy(bridge.cfg)
    cfg.n_layers = n_layers
    names = []
    pat = re.compile(r"^blocks\.0\.")
    for n in bridge.hook_dict:
        if pat.match(n):
            names += [pat.sub(f"blocks.{L}.", n) for L in range(n_layers)]
        else:
            names.append(n)
    gate = bridge._gated_hook_reason if hasattr(bridge, "_gated_hook_reason") else (lambda n: None)
    frozen_cfg = copy.copy(cfg)

    def gate_fn(name: str, _g=gate) -> Optional[str]:
        return _g(name)

    return ModelInfo(spec, tok, frozen_cfg, names, gate_fn)

