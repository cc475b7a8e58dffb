"""File formats of sparse dictionaries, read and written without ``sae_lens`` or ``circuit_tracer``.

Over 600 lines: two formats, each with its reader, writer and the checks that name the file and
the fix, sharing one set of tensor checks; split, each half would import the other's helpers.

* **SAELens directory** (:func:`load_saelens_dir`, :func:`save_saelens_dir`): ``cfg.json`` +
  ``sae_weights.safetensors``, every inference architecture SAELens 6.54 loads from disk except the
  two with their own maths (``temporal``, ``matching_pursuit``: refused by name): ``standard``,
  ``topk``, ``abstopk``, ``jumprelu``, ``gated``, ``transcoder``, ``skip_transcoder``,
  ``jumprelu_transcoder``, ``jumprelu_skip_transcoder``. Older (pre-6.0) configs are read the way
  SAELens' ``handle_config_defaulting`` reads them (``hook_point`` -> ``hook_name``, top-level
  metadata, ``activation_fn_kwargs.k`` -> ``topk``, boolean ``normalize_activations``). Tensors as
  SAELens stores them: ``W_enc [d_in, d_sae]``, ``W_dec [d_sae, d_out]``, ``W_skip [d_out, d_in]``.
* **circuit-tracer transcoder set** (:func:`load_transcoder_set`, :func:`save_transcoder_set`): a
  YAML config (``model_name``, ``feature_input_hook``, ``feature_output_hook``, ``transcoders``:
  ``[{id, layer, filepath}]`` or a list of paths, one per layer) and one file per layer. A
  ``.safetensors`` layer holds ``W_enc [d_sae, d_in]`` (circuit-tracer's ``F.linear`` layout),
  ``W_dec [d_sae, d_out]`` (circuit-tracer's ``to_safetensors``; its first loader,
  ``load_relu_transcoder``, stored ``[d_out, d_sae]`` and transposed: read by shape), ``b_enc``,
  ``b_dec``, optional ``W_skip [d_out, d_in]``, JumpReLU ``activation_function.threshold`` (or
  ``threshold`` / ``log_threshold``), TopK ``k``; Gemma Scope's ``params.npz`` (``W_enc [d_in, d_sae]``,
  ``W_dec [d_sae, d_out]``, ``threshold``) and Gemma Scope 2's lower-case safetensors (``w_enc
  [d_in, d_sae]``, ``w_dec``, ``affine_skip_connection [d_in, d_out]``) are read too. Hooks in the
  config are relative to the block (``mlp.hook_in``, ``ln2.hook_normalized``, ``hook_mlp_out``);
  :class:`~tracekit.dictionaries.dictionary.Dictionary` holds the full names ``blocks.L.<hook>``.
  circuit-tracer's activations keep negative values (``x * (x > threshold)``, ``x * topk_mask``):
  such dictionaries load with ``nonneg=False``.

Every loaded dictionary records ``metadata["sha256"]`` (the sha256 of its weights file; a set
records one over its layers' files and hooks) so caches and results can name what they used.
Bad files (missing or unknown tensor, shape mismatch, NaN/inf, layer gaps) raise
:class:`~tracekit.core.errors.SAEError` naming the file and the fix.

Sources: SAELens ``sae_lens/saes/*.py`` and ``loading/pretrained_sae_loaders.py`` (v6.54);
circuit-tracer ``circuit_tracer/transcoder/single_layer_transcoder.py`` and ``utils/hf_utils.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from ..core.errors import SAEError
from ..core.io import atomic_write, file_sha256
from .dictionary import Dictionary, DictionarySet

__all__ = ["SAELENS_ARCHITECTURES", "load_saelens_dir", "save_saelens_dir", "load_transcoder_set",
           "save_transcoder_set", "CONFIG_NAME"]

#: SAELens architecture -> (activation, transcoder, skip).
SAELENS_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "standard": ("relu", False, False),
    "topk": ("topk", False, False),
    "abstopk": ("abstopk", False, False),
    "jumprelu": ("jumprelu", False, False),
    "gated": ("gated", False, False),
    "transcoder": ("relu", True, False),
    "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
_REFUSED_ARCHS = {
    "temporal": "its encoder attends over previous positions (not a per-vector dictionary)",
    "matching_pursuit": "its encoder is iterative matching pursuit (not a linear encoder + activation)",
    "batchtopk": "SAELens saves a trained BatchTopK SAE for inference as 'jumprelu'; re-save it with SAELens",
    "matryoshka_batchtopk": "SAELens saves it for inference as 'jumprelu'; re-save it with SAELens",
}
_CFG = "cfg.json"
_WEIGHTS = "sae_weights.safetensors"
#: File name :func:`save_transcoder_set` gives the circuit-tracer config.
CONFIG_NAME = "config.yaml"
#: Keys the loaders add to ``metadata`` (not written back as SAELens metadata).
_OWN_KEYS = ("format", "path", "sha256", "architecture", "id", "file")
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


# -- shared helpers ------------------------------------------------------------------------------

def _dtype(name: Any, where: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    s = str(name).replace("torch.", "")
    dt = getattr(torch, s, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise SAEError(f"{where}: dtype {name!r} is not a floating-point torch dtype (float32, bfloat16, ...)")
    return dt


def _dtype_str(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _layer_of(hook: str) -> Optional[int]:
    m = _BLOCK.match(hook or "")
    return int(m.group(1)) if m else None


def _check(file: Path, name: str, t: torch.Tensor, shape: tuple[int, ...], fix: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise SAEError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}; {fix}")
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise SAEError(f"{file}: tensor {name!r} holds NaN or inf values; the file is corrupt or from a diverged "
                       "run: re-export or retrain it")
    return t


def _read_safetensors(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:  # type: ignore[no-untyped-call]
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (OSError, ValueError, RuntimeError) as e:  # safetensors raises SafetensorError(Exception) too
        raise SAEError(f"{file}: cannot be read as safetensors ({e}); re-export the file") from e
    except Exception as e:  # noqa: BLE001 - safetensors_rust.SafetensorError is a bare Exception
        raise SAEError(f"{file}: cannot be read as safetensors ({e}); re-export the file") from e
    return tensors, meta


def _assign(d: Dictionary, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in tensors.items():
            p = getattr(d, name)
            p.copy_(t.to(dtype=p.dtype, device=p.device))


# -- SAELens -------------------------------------------------------------------------------------

def _saelens_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """SAELens' ``handle_config_defaulting``: a pre-6.0 config brought to the 6.x layout."""
    meta: dict[str, Any] = cfg["metadata"] if isinstance(cfg.get("metadata"), dict) else {}
    version = cfg.get("sae_lens_version") or meta.get("sae_lens_version")
    try:
        major = int(str(version).split(".")[0]) if version else 0
    except ValueError:
        major = 0
    if major >= 6:
        return cfg
    ren = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
           "activation_fn_str": "activation_fn"}
    new = {ren.get(k, k): v for k, v in cfg.items()}
    new.setdefault("apply_b_dec_to_input", True)
    new.setdefault("activation_fn", "relu")
    new.setdefault("architecture", "standard")
    new.setdefault("reshape_activations", "hook_z" if "hook_z" in str(new.get("hook_name", "")) else "none")
    kw = new.get("activation_fn_kwargs") or {}
    if new.get("activation_fn") == "topk" and kw.get("k") is not None:
        new["architecture"] = "topk"
        new["k"] = kw["k"]
    if isinstance(new.get("normalize_activations"), bool):
        new["normalize_activations"] = "expected_average_only_in" if new["normalize_activations"] else "none"
    if new.get("normalize_activations") is None:
        new["normalize_activations"] = "none"
    keys = ("model_name", "hook_name", "model_class_name", "hook_head_index", "model_from_pretrained_kwargs",
            "prepend_bos", "exclude_special_tokens", "neuronpedia_id", "context_size", "seqpos_slice",
            "dataset_path", "sae_lens_version", "sae_lens_training_version", "hook_name_out",
            "hook_head_index_out", "hf_hook_name", "hf_hook_name_out")
    new["metadata"] = {**{k: v for k, v in new.items() if k in keys}, **meta}
    return new


def load_saelens_dir(path: Union[str, Path], *, device: Optional[torch.device | str] = None,
                     dtype: Optional[torch.dtype | str] = None) -> Dictionary:
    """Read a SAELens directory (``cfg.json`` + ``sae_weights.safetensors``) into a :class:`Dictionary`
    that computes exactly what ``sae_lens.SAE.load_from_disk(path)`` computes (encode, decode, forward).

    Args:
        path: the directory.
        device: where to put the parameters (default cpu).
        dtype: parameter dtype (default: the config's ``dtype``).

    Returns:
        The dictionary; ``hook_in`` = the config's ``hook_name``, ``hook_out`` = ``hook_name_out``
        (transcoders) or ``hook_name``; ``layer`` parsed from ``blocks.L.``; ``metadata`` = SAELens'
        metadata (``model_name``, ``hook_name``, ...) plus ``format="saelens"``, ``architecture``,
        ``path`` and ``sha256`` (of the weights file).

    Raises:
        SAEError: a missing file, an architecture or option SAELens has and this does not
            (``temporal``, ``matching_pursuit``, a non-ReLU pre-6.0 ``activation_fn``, an unfolded
            ``finetuning_scaling_factor``), a missing/unknown tensor, a shape mismatch, NaN/inf weights.

    Source: SAELens ``SAE.load_from_disk``, ``sae_lens_disk_loader``, ``handle_config_defaulting``.
    """
    path = Path(path)
    cfg_file, w_file = path / _CFG, path / _WEIGHTS
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise SAEError(f"{path}: no {f.name} (a SAELens directory holds {_CFG} + {_WEIGHTS}); "
                           "point at the folder SAELens' save_model wrote")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise SAEError(f"{cfg_file}: not readable JSON ({e}); re-export the SAE") from e
    if not isinstance(raw, dict):
        raise SAEError(f"{cfg_file}: not a JSON object; re-export the SAE")
    cfg = _saelens_defaults(raw)
    arch = str(cfg.get("architecture", "standard"))
    if arch in _REFUSED_ARCHS:
        raise SAEError(f"{cfg_file}: architecture {arch!r} is not supported without SAELens: {_REFUSED_ARCHS[arch]}")
    if arch not in SAELENS_ARCHITECTURES:
        raise SAEError(f"{cfg_file}: unknown SAELens architecture {arch!r}; supported: {sorted(SAELENS_ARCHITECTURES)}")
    activation, is_tc, skip = SAELENS_ARCHITECTURES[arch]
    if cfg.get("activation_fn", "relu") not in ("relu", "topk"):
        raise SAEError(f"{cfg_file}: activation_fn {cfg['activation_fn']!r} (a pre-6.0 option) is not supported; "
                       "SAELens 6 itself reads it as ReLU: convert the SAE to a supported architecture")
    if cfg.get("finetuning_scaling_factor") is True:
        raise SAEError(f"{cfg_file}: finetuning_scaling_factor is true (an unfolded pre-6.0 scale); "
                       "fold it into W_dec and set it false")
    meta: dict[str, Any] = dict(cfg.get("metadata") or {})
    hook = meta.get("hook_name") or cfg.get("hook_name") or ""
    hook_out = meta.get("hook_name_out") or cfg.get("hook_name_out") or hook
    apply_b = bool(cfg.get("apply_b_dec_to_input", True))
    if is_tc and apply_b:
        raise SAEError(f"{cfg_file}: apply_b_dec_to_input is true for a {arch} (SAELens refuses it too); set it false")
    reshape = str(cfg.get("reshape_activations", "none"))
    if reshape == "hook_z" and not is_tc and hook and not str(hook).endswith("_z"):
        raise SAEError(f"{cfg_file}: reshape_activations 'hook_z' for hook {hook!r} (SAELens requires a hook_z hook)")
    norm = str(cfg.get("normalize_activations", "none"))
    dt = _dtype(dtype if dtype is not None else cfg.get("dtype", "float32"), f"{cfg_file} dtype")
    tensors, _ = _read_safetensors(w_file)
    if "scaling_factor" in tensors:
        sf = tensors.pop("scaling_factor")
        if not torch.allclose(sf.float(), torch.ones_like(sf, dtype=torch.float32)):
            raise SAEError(f"{w_file}: tensor 'scaling_factor' is not all ones (a pre-6.0 fine-tuning scale SAELens 6 "
                           "cannot load either); fold it into W_dec")
    if activation == "jumprelu" and "log_threshold" in tensors and "threshold" not in tensors:
        tensors["threshold"] = torch.exp(tensors.pop("log_threshold"))
    if "W_enc" not in tensors or "b_dec" not in tensors:
        raise SAEError(f"{w_file}: missing tensor {'W_enc' if 'W_enc' not in tensors else 'b_dec'}; "
                       "not a complete SAELens SAE: re-export it")
    d_in = int(cfg.get("d_in", tensors["W_enc"].shape[0]))
    d_sae = int(cfg.get("d_sae", tensors["W_enc"].shape[-1]))
    d_out = int(cfg.get("d_out", tensors["b_dec"].shape[0])) if is_tc else d_in
    k = cfg.get("k", 100) if activation in ("topk", "abstopk") else None
    try:
        d = Dictionary(d_in, d_sae, d_out, activation=activation, k=k, skip=skip, hook_in=hook, hook_out=hook_out,
                       layer=_layer_of(hook), apply_b_dec_to_input=apply_b, dtype=dt, device=device,
                       rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
                       normalize_activations=norm, reshape_activations=reshape, nonneg=True, transcoder=is_tc)
    except SAEError as e:
        raise SAEError(f"{cfg_file}: {e}") from e
    want = _saelens_state_shapes(d)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise SAEError(f"{w_file}: a {arch} SAE has tensors {sorted(want)}"
                       + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else "")
                       + ": the weights do not match cfg.json's architecture (re-export the SAE)")
    for name, shape in want.items():
        _check(w_file, name, tensors[name], shape, f"cfg.json says d_in={d_in}, d_sae={d_sae}"
               + (f", d_out={d_out}" if is_tc else "") + ": the weights and cfg.json disagree")
    _assign(d, tensors)
    d.metadata = {**meta, "format": "saelens", "architecture": arch, "path": str(path),
                  "sha256": file_sha256(w_file)}
    return d


def _saelens_state_shapes(d: Dictionary) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"W_enc": (d.d_in, d.d_sae), "W_dec": (d.d_sae, d.d_out), "b_dec": (d.d_out,)}
    if d.activation == "gated":
        out.update(b_gate=(d.d_sae,), b_mag=(d.d_sae,), r_mag=(d.d_sae,))
    else:
        out["b_enc"] = (d.d_sae,)
    if d.activation == "jumprelu":
        out["threshold"] = (d.d_sae,)
    if d.W_skip is not None:
        out["W_skip"] = (d.d_out, d.d_in)
    return out


def _saelens_architecture(d: Dictionary) -> str:
    if not d.is_transcoder:
        return {"relu": "standard"}.get(d.activation, d.activation)
    if d.activation == "relu":
        return "skip_transcoder" if d.W_skip is not None else "transcoder"
    if d.activation == "jumprelu":
        return "jumprelu_skip_transcoder" if d.W_skip is not None else "jumprelu_transcoder"
    raise SAEError(f"SAELens has no {d.activation} transcoder (its transcoders are relu and jumprelu, with or "
                   "without skip); save it with save_transcoder_set (circuit-tracer's format) instead")


def save_saelens_dir(d: Dictionary, path: Union[str, Path], *, model_name: str) -> Path:
    """Write ``d`` as a SAELens directory that ``sae_lens.SAE.load_from_disk(path)`` reads back to the
    same maths (``cfg.json`` in SAELens 6's layout + ``sae_weights.safetensors``). Files are written
    atomically; other files in ``path`` are left alone.

    Args:
        d: the dictionary (SAE or relu/jumprelu transcoder, with or without skip).
        path: the directory (created).
        model_name: the model it reads (``metadata.model_name``).

    Returns:
        ``path``.

    Raises:
        SAEError: what SAELens cannot express: a topk/abstopk/gated transcoder, circuit-tracer's
            ``nonneg=False`` activations where they differ from SAELens' (a negative JumpReLU
            threshold; a TopK), a ``hook_z`` SAE whose hook does not end in ``_z``.

    Source: SAELens ``SAE.save_model`` / ``SAEConfig.to_dict``.
    """
    path = Path(path)
    arch = _saelens_architecture(d)
    if not d.nonneg and d.activation == "topk":
        raise SAEError("a circuit-tracer TopK (nonneg=False: negative kept values) has no SAELens equivalent "
                       "(SAELens' TopK ReLUs the kept values); save it with save_transcoder_set")
    if not d.nonneg and d.threshold is not None and bool((d.threshold < 0).any()):
        raise SAEError("a JumpReLU with negative thresholds and nonneg=False (circuit-tracer's x * (x > t)) differs "
                       "from SAELens' relu(x) * (x > t); save it with save_transcoder_set")
    if d.reshape_activations == "hook_z" and not d.is_transcoder and not d.hook_in.endswith("_z"):
        raise SAEError(f"a hook_z SAE must read a hook_z hook (hook_in is {d.hook_in!r})")
    meta: dict[str, Any] = {}
    for key, v in d.metadata.items():
        if key in _OWN_KEYS:
            continue
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            continue
        meta[key] = v
    version = str(meta.get("sae_lens_version") or "")
    if not version[:1].isdigit() or int(re.split(r"\D", version)[0] or 0) < 6:
        meta["sae_lens_version"] = "6.0.0"
    meta.setdefault("sae_lens_training_version", meta["sae_lens_version"])
    meta.update(model_name=model_name, hook_name=d.hook_in)
    if d.is_transcoder:
        meta["hook_name_out"] = d.hook_out
    cfg: dict[str, Any] = {"d_in": d.d_in, "d_sae": d.d_sae, "dtype": _dtype_str(d.W_enc.dtype), "device": "cpu",
                           "apply_b_dec_to_input": d.apply_b_dec_to_input,
                           "normalize_activations": d.normalize_activations,
                           "reshape_activations": d.reshape_activations, "metadata": meta}
    if d.activation in ("topk", "abstopk"):
        cfg.update(k=d.k, rescale_acts_by_decoder_norm=d.rescale_acts_by_decoder_norm)
    if d.is_transcoder:
        cfg["d_out"] = d.d_out
    cfg["architecture"] = arch
    state = {name: getattr(d, name).detach().to("cpu").contiguous() for name in _saelens_state_shapes(d)}
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / _WEIGHTS, lambda p: save_file(state, str(p)))
    atomic_write(path / _CFG, json.dumps(cfg, indent=2))
    return path


# -- circuit-tracer ------------------------------------------------------------------------------

def _config_file(path: Path) -> Path:
    if path.is_dir():
        for name in (CONFIG_NAME, "config.yml"):
            if (path / name).is_file():
                return path / name
        ymls = sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml"))
        if len(ymls) == 1:
            return ymls[0]
        raise SAEError(f"{path}: no {CONFIG_NAME} (circuit-tracer's transcoder config: model_name, "
                       "feature_input_hook, feature_output_hook, transcoders); pass the YAML file itself")
    if not path.is_file():
        raise SAEError(f"{path}: no such transcoder config (a circuit-tracer YAML or the folder holding it)")
    return path


def _entries(cfg: dict[str, Any], cfile: Path) -> list[tuple[int, str, str]]:
    """``(layer, id, filepath)`` per transcoder, in the config's order."""
    items = cfg.get("transcoders")
    if items is None:
        files = sorted(cfile.parent.glob("layer_*.safetensors"))
        if not files:
            raise SAEError(f"{cfile}: no 'transcoders' list and no layer_*.safetensors beside it; list the files "
                           "under transcoders: [{id, layer, filepath}]")
        out = []
        for f in files:
            m = re.fullmatch(r"layer_(\d+)\.safetensors", f.name)
            if m:
                out.append((int(m.group(1)), f.stem, f.name))
        return out
    if not isinstance(items, list) or not items:
        raise SAEError(f"{cfile}: 'transcoders' must be a non-empty list of {{id, layer, filepath}} (or of paths)")
    out = []
    for i, it in enumerate(items):
        if isinstance(it, str):
            out.append((i, f"layer_{i}", it))
        elif isinstance(it, dict) and "filepath" in it and "layer" in it:
            try:
                layer = int(it["layer"])
            except (TypeError, ValueError) as e:
                raise SAEError(f"{cfile}: transcoders[{i}].layer {it['layer']!r} is not an integer") from e
            out.append((layer, str(it.get("id", f"layer_{layer}")), str(it["filepath"])))
        else:
            raise SAEError(f"{cfile}: transcoders[{i}] must be {{id, layer, filepath}} or a path; got {it!r}")
    return out


def _full_hook(hook: str, layer: int, cfile: Path, field: str) -> str:
    if not isinstance(hook, str) or not hook:
        raise SAEError(f"{cfile}: {field} is missing (a hook relative to the block, e.g. 'mlp.hook_in', "
                       "'ln2.hook_normalized', 'hook_mlp_out')")
    m = _BLOCK.match(hook)
    if m:
        hook = m.group(2)  # tolerate a full name: its block is replaced by each transcoder's layer
    return f"blocks.{layer}.{hook}"


def _read_layer(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not file.is_file():
        raise SAEError(f"{file}: transcoder file not found; fix the filepath in the config (relative paths are "
                       "read from the config's folder)")
    if file.suffix == ".npz":
        try:
            with np.load(file) as z:
                return {k: torch.from_numpy(np.array(z[k])) for k in z.files}, {"layout": "npz"}
        except (OSError, ValueError) as e:
            raise SAEError(f"{file}: cannot be read as .npz ({e}); re-download it") from e
    return _read_safetensors(file)


def _orient(file: Path, name: str, t: torch.Tensor, rows: int, cols: int, prefer_t: bool) -> torch.Tensor:
    """``t`` as ``[rows, cols]``: as stored or transposed, decided by shape (``prefer_t`` when square)."""
    if t.ndim != 2:
        raise SAEError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected a matrix [{rows}, {cols}] "
                       "or its transpose; the file is not a transcoder")
    fits, fits_t = tuple(t.shape) == (rows, cols), tuple(t.shape) == (cols, rows)
    if fits and fits_t:
        return t.T if prefer_t else t
    if fits:
        return t
    if fits_t:
        return t.T
    raise SAEError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected [{rows}, {cols}] or its transpose "
                   "(widths from b_enc / b_dec / W_enc); the layer's tensors disagree: re-export it")


def _tc_from_file(file: Path, layer: int, tid: str, cfg: dict[str, Any], cfile: Path, device: Any,
                  dtype: torch.dtype) -> Dictionary:
    tensors, meta = _read_layer(file)
    gs2 = "w_enc" in tensors
    ren = {"w_enc": "W_enc", "w_dec": "W_dec", "affine_skip_connection": "W_skip",
           "activation_function.threshold": "threshold"}
    t = {ren.get(k, k): v for k, v in tensors.items()}
    for lk in ("log_threshold", "log_thresholds"):
        if lk in t and "threshold" not in t:
            t["threshold"] = torch.exp(t.pop(lk).float())
    for req in ("W_enc", "W_dec", "b_enc", "b_dec"):
        if req not in t:
            raise SAEError(f"{file}: missing tensor {req!r} (a circuit-tracer transcoder holds W_enc, W_dec, b_enc, "
                           "b_dec, optional W_skip and activation_function.threshold); re-export it")
    known = {"W_enc", "W_dec", "b_enc", "b_dec", "W_skip", "threshold", "k"}
    unknown = sorted(set(t) - known)
    if unknown:
        raise SAEError(f"{file}: unknown tensors {unknown} (known: {sorted(known)}); this is not a circuit-tracer "
                       "single-layer transcoder file")
    if t["b_enc"].ndim != 1 or t["b_dec"].ndim != 1:
        raise SAEError(f"{file}: b_enc / b_dec must be vectors (shapes {tuple(t['b_enc'].shape)}, "
                       f"{tuple(t['b_dec'].shape)}); re-export it")
    d_sae, d_out = int(t["b_enc"].shape[0]), int(t["b_dec"].shape[0])
    npz_like = meta.get("layout") == "npz" or gs2
    if t["W_enc"].ndim != 2 or d_sae not in t["W_enc"].shape:
        raise SAEError(f"{file}: tensor 'W_enc' has shape {tuple(t['W_enc'].shape)}, but b_enc has {d_sae} features; "
                       "re-export it")
    # circuit-tracer safetensors: [d_sae, d_in]; Gemma Scope npz / GS2: [d_in, d_sae]
    if npz_like:
        d_in = int(t["W_enc"].shape[0] if t["W_enc"].shape[1] == d_sae else t["W_enc"].shape[1])
    else:
        d_in = int(t["W_enc"].shape[1] if t["W_enc"].shape[0] == d_sae else t["W_enc"].shape[0])
    W_enc = _orient(file, "W_enc", t["W_enc"], d_in, d_sae, prefer_t=not npz_like)
    dec_layout = meta.get("W_dec_layout", "d_sae,d_out")
    W_dec = _orient(file, "W_dec", t["W_dec"], d_sae, d_out, prefer_t=(dec_layout == "d_out,d_sae"))
    W_skip = None
    if "W_skip" in t:
        W_skip = _orient(file, "W_skip", t["W_skip"], d_out, d_in, prefer_t=gs2)
    cfg_act = cfg.get("activation")
    if "k" in t or "k" in meta or cfg_act == "topk":
        k = int(t["k"].item()) if "k" in t else int(meta["k"]) if "k" in meta else cfg.get("k")
        if k is None:
            raise SAEError(f"{cfile}: activation 'topk' without k; add k: <active features> to the config")
        activation = "topk"
    elif "threshold" in t and cfg_act != "relu":
        activation, k = "jumprelu", None
    else:
        activation, k = "relu", None
    nonneg = str(meta.get("nonneg", "false")).lower() == "true"
    d = Dictionary(d_in, d_sae, d_out, activation=activation, k=k, skip=W_skip is not None,
                   hook_in=_full_hook(cfg.get("feature_input_hook", ""), layer, cfile, "feature_input_hook"),
                   hook_out=_full_hook(cfg.get("feature_output_hook", ""), layer, cfile, "feature_output_hook"),
                   layer=layer, dtype=dtype, device=device, nonneg=nonneg, transcoder=True)
    vals: dict[str, torch.Tensor] = {"W_enc": W_enc, "W_dec": W_dec, "b_enc": t["b_enc"], "b_dec": t["b_dec"]}
    if W_skip is not None:
        vals["W_skip"] = W_skip
    if activation == "jumprelu":
        thr = t["threshold"]
        vals["threshold"] = thr.expand(d_sae) if thr.ndim == 0 else thr
    shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_out), "b_enc": (d_sae,), "b_dec": (d_out,),
              "W_skip": (d_out, d_in), "threshold": (d_sae,)}
    for name, v in vals.items():
        _check(file, name, v, shapes[name], "re-export the layer")
    _assign(d, vals)
    d.metadata = {"format": "circuit-tracer", "id": tid, "file": file.name, "path": str(file),
                  "model_name": cfg.get("model_name", ""), "sha256": file_sha256(file)}
    return d


def load_transcoder_set(path: Union[str, Path], *, device: Optional[torch.device | str] = None,
                        dtype: Optional[torch.dtype | str] = None) -> DictionarySet:
    """Read a circuit-tracer transcoder set (its YAML config and one file per layer) into a
    :class:`DictionarySet` of transcoders ``blocks.L.<feature_input_hook>`` -> ``blocks.L.<feature_output_hook>``.

    Args:
        path: the YAML config, or the folder holding ``config.yaml``.
        device: where to put the parameters (default cpu).
        dtype: parameter dtype (default float32, as circuit-tracer).

    Returns:
        The set; ``metadata`` has ``model_name``, ``feature_input_hook``, ``feature_output_hook``,
        ``format="circuit-tracer"``, ``path`` and ``sha256`` (over the layers' file hashes and the hooks).
        Each dictionary: ``nonneg=False`` (circuit-tracer's activations) unless the file was written by
        :func:`save_transcoder_set` from a ReLU'd one; activation ``jumprelu`` when the file has a
        threshold, ``topk`` when it (or the config) has ``k``, else ``relu``.

    Raises:
        SAEError: a missing config field or file, an ``hf://`` path (download it first), a missing or
            unknown tensor, a shape mismatch, NaN/inf weights, a duplicated layer or a gap in the
            layers (circuit-tracer needs layers 0..L), transcoders of different widths.

    Source: circuit-tracer ``load_transcoder_set``, ``load_relu_transcoder`` / ``load_transcoder``,
    ``load_gemma_scope_transcoder``, ``load_gemma_scope_2_transcoder``.
    """
    cfile = _config_file(Path(path))
    try:
        cfg = yaml.safe_load(cfile.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SAEError(f"{cfile}: not readable YAML ({e}); fix the config") from e
    if not isinstance(cfg, dict):
        raise SAEError(f"{cfile}: not a YAML mapping (model_name, feature_input_hook, feature_output_hook, transcoders)")
    for key in ("feature_input_hook", "feature_output_hook"):
        if not cfg.get(key):
            raise SAEError(f"{cfile}: missing {key} (the hook relative to the block, e.g. 'mlp.hook_in' / "
                           "'hook_mlp_out')")
    dt = _dtype(dtype if dtype is not None else "float32", "dtype")
    entries = _entries(cfg, cfile)
    layers = [e[0] for e in entries]
    dup = sorted({x for x in layers if layers.count(x) > 1})
    if dup:
        raise SAEError(f"{cfile}: layers {dup} have more than one transcoder; keep one per layer")
    if set(layers) != set(range(max(layers) + 1)):
        missing = sorted(set(range(max(layers) + 1)) - set(layers))
        raise SAEError(f"{cfile}: layers {missing} have no transcoder (a set covers layers 0..{max(layers)} "
                       "without gaps, as circuit-tracer requires); add their files")
    dicts: dict[int, Dictionary] = {}
    for layer, tid, fp in sorted(entries):
        if fp.startswith("hf://"):
            raise SAEError(f"{cfile}: transcoder {tid!r} is {fp!r}; download it (huggingface_hub) and give the local path")
        f = Path(fp)
        f = f if f.is_absolute() else cfile.parent / f
        dicts[layer] = _tc_from_file(f, layer, tid, cfg, cfile, device, dt)
    widths = {d.d_sae for d in dicts.values()}
    if len(widths) > 1:
        raise SAEError(f"{cfile}: transcoders have different widths {sorted(widths)} (circuit-tracer needs one "
                       "d_transcoder); use one width per set")
    h = hashlib.sha256(f"{cfg['feature_input_hook']}|{cfg['feature_output_hook']}".encode())
    for layer in sorted(dicts):
        h.update(f"|{layer}:{dicts[layer].metadata['sha256']}".encode())
    meta = {"model_name": cfg.get("model_name", ""), "feature_input_hook": cfg["feature_input_hook"],
            "feature_output_hook": cfg["feature_output_hook"], "format": "circuit-tracer", "path": str(cfile),
            "sha256": h.hexdigest()}
    return DictionarySet(dicts, meta)


def _relative_hook(d: Dictionary, which: str) -> str:
    hook = d.hook_in if which == "in" else d.hook_out
    m = _BLOCK.match(hook)
    if not m or int(m.group(1)) != d.layer:
        raise SAEError(f"layer {d.layer}: hook_{which} {hook!r} is not 'blocks.{d.layer}.<hook>'; circuit-tracer's "
                       "format names hooks relative to each transcoder's own block")
    return m.group(2)


def save_transcoder_set(dset: DictionarySet, path: Union[str, Path], *, model_name: str) -> Path:
    """Write a transcoder set in circuit-tracer's layout: ``path/config.yaml`` (``model_kind``,
    ``model_name``, ``feature_input_hook``, ``feature_output_hook``, ``activation`` (+ ``k``),
    ``transcoders: [{id, layer, filepath}]``) and ``path/layer_L.safetensors`` (``W_enc [d_sae, d_in]``,
    ``W_dec [d_sae, d_out]``, ``b_enc``, ``b_dec``, optional ``W_skip [d_out, d_in]``,
    ``activation_function.threshold``), as circuit-tracer's ``TranscoderSet.to_safetensors`` writes
    them (TopK's ``k`` goes in the config, where circuit-tracer's ``load_transcoder_set`` reads it).
    The safetensors header records ``nonneg``, ``k`` and the ``W_dec`` layout so that
    :func:`load_transcoder_set` restores the exact maths. Files are written atomically.

    Args:
        dset: the set (relu / jumprelu / topk transcoders, layers 0..L, one width, one hook pair).
        path: the folder (created).
        model_name: the model the set reads.

    Returns:
        The config file (``path/config.yaml``); :func:`load_transcoder_set` takes it or ``path``.

    Raises:
        SAEError: what circuit-tracer's format cannot hold: gated/abstopk activations, SAELens input
            options (``apply_b_dec_to_input``, ``normalize_activations``, ``hook_z``, decoder-norm
            rescaling), layer gaps, mixed widths, hooks or k, hooks not under ``blocks.L``.

    Note: circuit-tracer's own activations keep negative values; a set saved from ReLU'd
    (``nonneg=True``) TopK/JumpReLU transcoders gives the same features in circuit-tracer except
    where a kept pre-activation is negative.
    """
    path = Path(path)
    if not len(dset):
        raise SAEError("an empty transcoder set cannot be saved")
    layers = dset.layers
    if layers != list(range(max(layers) + 1)):
        raise SAEError(f"transcoder set covers layers {layers}; circuit-tracer's format needs 0..{max(layers)} "
                       "without gaps")
    hooks_in, hooks_out, widths, acts, ks = set(), set(), set(), set(), set()
    for layer in layers:
        d = dset[layer]
        if d.layer != layer:
            raise SAEError(f"the set's entry {layer} is a dictionary for layer {d.layer}; fix its layer")
        if d.activation not in ("relu", "jumprelu", "topk"):
            raise SAEError(f"layer {layer}: activation {d.activation!r} has no circuit-tracer form (relu, jumprelu, "
                           "topk); use save_saelens_dir per layer")
        for opt, bad in (("apply_b_dec_to_input", d.apply_b_dec_to_input),
                         ("normalize_activations", d.normalize_activations not in ("none",)),
                         ("reshape_activations", d.reshape_activations != "none"),
                         ("rescale_acts_by_decoder_norm", d.rescale_acts_by_decoder_norm)):
            if bad:
                raise SAEError(f"layer {layer}: {opt} is set; circuit-tracer's transcoders have no such option "
                               "(fold it into the weights or use save_saelens_dir)")
        hooks_in.add(_relative_hook(d, "in"))
        hooks_out.add(_relative_hook(d, "out"))
        widths.add(d.d_sae)
        acts.add(d.activation)
        ks.add(d.k)
    for what, vals in (("feature_input_hook", hooks_in), ("feature_output_hook", hooks_out), ("d_sae", widths),
                       ("activation", acts), ("k", ks)):
        if len(vals) > 1:
            raise SAEError(f"transcoder set has several {what} values {sorted(map(str, vals))}; circuit-tracer's "
                           "config holds one per set")
    activation = acts.pop()
    cfg: dict[str, Any] = {"model_kind": "transcoder_set", "model_name": model_name,
                           "feature_input_hook": hooks_in.pop(), "feature_output_hook": hooks_out.pop(),
                           "activation": activation}
    if activation == "topk":
        cfg["k"] = int(ks.pop() or 0)
    short = model_name.split("/")[-1] or "model"
    entries = []
    path.mkdir(parents=True, exist_ok=True)
    for layer in layers:
        d = dset[layer]
        state = {"W_enc": d.W_enc.detach().T, "W_dec": d.W_dec.detach(), "b_enc": d.b_enc.detach(),
                 "b_dec": d.b_dec.detach()}
        if d.threshold is not None:
            state["activation_function.threshold"] = d.threshold.detach()
        if d.W_skip is not None:
            state["W_skip"] = d.W_skip.detach()
        state = {k: v.to("cpu").contiguous() for k, v in state.items()}
        header = {"format": "circuit-tracer", "W_dec_layout": "d_sae,d_out", "nonneg": str(d.nonneg).lower(),
                  "hook_in": d.hook_in, "hook_out": d.hook_out}
        if activation == "topk":  # in the header, not as a tensor: circuit-tracer's strict load_state_dict
            header["k"] = str(int(d.k or 0))
        name = f"layer_{layer}.safetensors"
        atomic_write(path / name, lambda p, s=state, m=header: save_file(s, str(p), metadata=m))
        entries.append({"id": f"{short}-{layer}", "layer": layer, "filepath": name})
    cfg["transcoders"] = entries
    return atomic_write(path / CONFIG_NAME, yaml.safe_dump(cfg, sort_keys=False))
