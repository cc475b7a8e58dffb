"""What a model is without its weights (:class:`ModelInfo`, built in seconds to check configs), and
:class:`HookedModel`, the type every method's ``model`` argument has."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch

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
    info = _info_from_config(spec, config, tok, bridge_name)
    _INFO[spec.key()] = info
    return info


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

