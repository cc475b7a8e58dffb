"""On-disk cache of dequantised GGUF weights: a warm start in about a second instead of ~20 s.

Loading a ``.gguf`` model (the embedded SmolLM2-135M included) makes ``transformers`` dequantise
every tensor and convert the GGUF tokenizer, every time. The first load writes the result to the
user's cache directory; later loads memory-map it (zero copy, copy-on-write: nothing a process does
to the weights reaches the file).

Location: ``$TRACEKIT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/tracekit``, else
``~/.cache/tracekit``. Entries live in ``<cache>/gguf/<key>/``::

    model.safetensors     every parameter and buffer once (tied tensors stored once, see manifest)
    config.json           the Hugging Face config of the dequantised model
    tokenizer/            the converted tokenizer (``save_pretrained``), loaded without the GGUF
    manifest.json         written last: key, GGUF sha256, dtype, versions, created, size + sha256
                          of every file, aliases of tied tensors
    processed-<key>/      TransformerLens' processed weights for this entry (see
                          :class:`processed_weights_cache`), with their own manifest
    verification-<key>.json   the passing load-time verification of a model built from this entry
                          (:func:`read_verification`; the key is made by :mod:`tracekit.model.load`)

The key is a hash of the GGUF file's sha256, the dtype, the cache format and the versions of the
packages that do the conversion (``transformers``, ``gguf``, ``torch``). An entry is used only
when its manifest matches the key and every file has its recorded size and sha256; anything else
(truncated or edited file, missing manifest, other GGUF, version change) is removed and rebuilt,
never used (``tracekit.load_model`` checks the sha256 of the weights in a background thread while
it builds the model, :class:`deferred_checks`, and returns the model only once it matches). Writes are atomic: an entry is built in a temporary folder next to its final place and
renamed into it; of two processes writing the same entry, the first rename wins and the second
process discards its copy (both get identical weights).

``TRACEKIT_CACHE=off`` disables the cache (every load dequantises). CLI: ``tracekit cache`` lists
entries, ``tracekit cache clear`` removes them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from ..core.cachedir import (  # noqa: F401
    cache_path,
    cache_root,
    clear_dir,
    dir_entries,
    dir_size,
    remove_entry,
    remove_stale_temps,
    sizes_match,
)
from ..core.io import (
    ManifestInvalid,
    file_sha256,
    fsync_dir,
    read_manifest,
    verify_files_manifest,
    write_files_manifest,
)

log = logging.getLogger("tracekit.cache")

__all__ = [
    "CACHE_FORMAT",
    "deferred_checks",
    "cache_dir",
    "cache_enabled",
    "clear_cache_dir",
    "conversion_versions",
    "entry_path",
    "file_sha256",
    "gguf_cache_key",
    "list_entries",
    "load_gguf_entry",
    "load_or_convert_gguf",
    "store_gguf_entry",
]


#: Bump when the layout of an entry changes: old entries then miss and are rebuilt.
CACHE_FORMAT = 1


_WEIGHTS_FILE = "model.safetensors"


_BUFFER_PREFIX = "__buffer__."


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def cache_dir() -> Path:
    """The tracekit cache root: ``$TRACEKIT_CACHE_DIR``, ``$XDG_CACHE_HOME/tracekit`` or ``~/.cache/tracekit``
    (:func:`tracekit.core.cachedir.cache_root`)."""
    return cache_root()


def cache_enabled() -> bool:
    """False when ``TRACEKIT_CACHE`` is ``off``/``0``/``false``/``no``."""
    return os.environ.get("TRACEKIT_CACHE", "on").strip().lower() not in ("off", "0", "false", "no")


class _HashCheck:
    """sha256 of a file computed in a background thread (hashlib releases the GIL), compared with
    the recorded one when :meth:`ok` is called; ``on_fail`` removes what the file belongs to."""

    def __init__(self, path: Path, sha256: str, on_fail: Callable[[], None]):
        import threading

        self.path, self.sha256, self.on_fail = path, sha256, on_fail
        self._got: list[str | BaseException] = []
        self._thread = threading.Thread(target=self._run, name="tracekit-cache-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._got.append(file_sha256(self.path, memo=False))
        except BaseException as e:  # noqa: BLE001 (a vanished file is a failed check)
            self._got.append(e)

    def ok(self) -> bool:
        self._thread.join()
        return bool(self._got) and self._got[0] == self.sha256


#: Active collectors of deferred hash checks (see :func:`deferred_checks`).
_DEFERRED: list[list[_HashCheck]] = []


class deferred_checks:
    """Context manager: inside it, the cache checks the sha256 of the files it memory-maps in
    background threads instead of before returning, so hashing overlaps with building the model
    (about 0.7 s of a warm load of the embedded model). The caller **must** call :meth:`all_ok`
    before using what was loaded; a failed check has already removed the bad entry, so loading
    again rebuilds it. Outside the context every check is synchronous."""

    def __init__(self):
        self.checks: list[_HashCheck] = []

    def __enter__(self):
        _DEFERRED.append(self.checks)
        return self

    def __exit__(self, *exc):
        _DEFERRED.remove(self.checks)
        return False

    def all_ok(self) -> bool:
        bad = [c for c in self.checks if not c.ok()]
        for c in bad:
            log.warning("tracekit cache file %s does not match its recorded sha256: removing it", c.path)
            warnings.warn(f"tracekit cache file {c.path} does not match its recorded sha256; rebuilding it",
                          stacklevel=2)
            c.on_fail()
        return not bad


def _check_sha(path: Path, sha256: str, on_fail: Callable[[], None]) -> None:
    """Raise _Invalid when ``path``'s sha256 differs (now, or deferred to the active collector)."""
    if _DEFERRED:
        _DEFERRED[-1].append(_HashCheck(path, sha256, on_fail))
        return
    if file_sha256(path, memo=False) != sha256:
        raise _Invalid(f"{path.name} sha256 differs from the manifest")


def conversion_versions() -> dict[str, str | None]:
    """Versions of the packages whose code turns a GGUF into float tensors (part of the key)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for pkg in ("transformers", "gguf", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def gguf_cache_key(gguf_path: str | Path, dtype: torch.dtype) -> tuple[str, dict]:
    """``(key, identity)`` of the cache entry of a GGUF file converted to ``dtype``.

    ``identity`` holds what the key hashes: the GGUF file's sha256 and size, the dtype, the cache
    format and :func:`conversion_versions`.
    """
    p = Path(gguf_path)
    ident = {"format": CACHE_FORMAT, "gguf_sha256": file_sha256(p), "gguf_size": p.stat().st_size,
             "dtype": _dtype_name(dtype), "versions": conversion_versions()}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]
    return key, ident


def _gguf_root() -> Path:
    return cache_path("weights")


def entry_path(key: str) -> Path:
    """Folder of the entry with this key (it may not exist)."""
    return _gguf_root() / key


#: An entry that must not be used (the message says why).
_Invalid = ManifestInvalid


_read_manifest = read_manifest


def _verify(d: Path, key: str, ident: dict, deferrable: bool = False) -> dict:
    """The manifest of a valid entry; raises _Invalid otherwise (identity, then sizes, then sha256;
    with ``deferrable`` the sha256 of the weights may be checked in the background, see
    :class:`deferred_checks`)."""
    man = _read_manifest(d)
    if man.get("key") != key:
        raise _Invalid("manifest key differs")
    for field in ("format", "gguf_sha256", "gguf_size", "dtype", "versions"):
        if man.get("identity", {}).get(field) != ident[field]:
            raise _Invalid(f"manifest {field} differs")
    defer = {_WEIGHTS_FILE: lambda p, sha, d=d: _check_sha(p, sha, lambda: remove_entry(d))} if deferrable else None
    return verify_files_manifest(d, (_WEIGHTS_FILE, "config.json"), defer=defer)


def _mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, memory-mapped copy-on-write (no bytes copied).

    Raises _Invalid on a malformed header or offsets outside the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise _Invalid("weights file truncated")
        (n,) = struct.unpack("<Q", raw)
        if n <= 0 or 8 + n > size:
            raise _Invalid("weights header length out of range")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise _Invalid("weights header is not JSON") from e
    base = 8 + n
    # torch types from_file on the storage base class; on UntypedStorage it returns an UntypedStorage
    storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size))
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise _Invalid(f"unsupported dtype {info.get('dtype')!r} for {name}")
        start, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        itemsize = torch.empty((), dtype=dt).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= start <= end and base + end <= size and end - start == numel * itemsize):
            raise _Invalid(f"offsets of {name} out of range")
        off = base + start
        if off % itemsize:  # not aligned for a view: copy this tensor
            t = torch.frombuffer(bytearray(storage[off:off + numel * itemsize]), dtype=dt).reshape(shape)
        else:
            # torch's stubs lack set_(source, offset, size) (stride defaults to contiguous)
            t = torch.empty(0, dtype=dt).set_(storage, off // itemsize, shape)  # pyright: ignore[reportCallIssue]
        out[name] = t
    return out


def load_gguf_entry(gguf_path: str | Path, dtype: torch.dtype, with_tokenizer: bool = True):
    """``(hf_model, tokenizer or None)`` from a valid cache entry, or ``None`` on a miss.

    An entry that exists but is invalid (see module doc) is removed, so the caller rebuilds it.
    """
    if not cache_enabled():
        return None
    key, ident = gguf_cache_key(gguf_path, dtype)
    d = entry_path(key)
    if not d.is_dir():
        return None
    try:
        man = _verify(d, key, ident, deferrable=True)
        hf = _build_model(d, man, dtype)
        tok = _load_entry_tokenizer(d) if with_tokenizer else None
    except _Invalid as e:
        log.warning("tracekit cache entry %s is invalid (%s): rebuilding it", d, e)
        warnings.warn(f"tracekit cache entry {d} is invalid ({e}); rebuilding it", stacklevel=2)
        remove_entry(d)
        return None
    return hf, tok


def _load_entry_tokenizer(d: Path):
    from transformers import AutoTokenizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(str(d / "tokenizer"))
    except Exception as e:
        raise _Invalid(f"tokenizer unreadable ({type(e).__name__}: {e})") from e


def _build_model(d: Path, man: dict, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = AutoConfig.from_pretrained(str(d))
        except Exception as e:
            raise _Invalid(f"config unreadable ({type(e).__name__})") from e
        tensors = _mmap_safetensors(d / _WEIGHTS_FILE)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    state = {k: v for k, v in tensors.items() if not k.startswith(_BUFFER_PREFIX)}
    for alias, target in man.get("aliases", {}).items():
        if target not in state:
            raise _Invalid(f"alias {alias} -> {target}: target missing")
        state[alias] = state[target]
    expected = set(hf.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise _Invalid(f"weights do not match the architecture (missing {missing[:3]}, extra {extra[:3]})")
    hf.load_state_dict(state, assign=True, strict=True)
    for name, buf in list(hf.named_buffers()):
        if buf.is_meta:
            saved = tensors.get(_BUFFER_PREFIX + name)
            if saved is None:
                raise _Invalid(f"buffer {name} missing")
            mod_name, _, attr = name.rpartition(".")
            mod = hf.get_submodule(mod_name) if mod_name else hf
            mod._buffers[attr] = saved
    # Non-tensor attributes some modules keep next to their buffers (rotary embeddings).
    for name, value in man.get("attributes", {}).items():
        mod_name, _, attr = name.rpartition(".")
        mod = hf.get_submodule(mod_name) if mod_name else hf
        setattr(mod, attr, tensors[_BUFFER_PREFIX + value] if isinstance(value, str) else value)
    if getattr(config, "tie_word_embeddings", False):
        hf.tie_weights()
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise _Invalid(f"tensors left unset: {left[:3]}")
    hf.eval()
    return hf


def _rotary_attributes(hf) -> dict:
    """Tensor attributes (not buffers) that rotary modules read, e.g. ``original_inv_freq``."""
    out = {}
    buffers = dict(hf.named_buffers())
    for mod_name, mod in hf.named_modules():
        for attr in ("original_inv_freq",):
            v = mod.__dict__.get(attr)
            if isinstance(v, torch.Tensor) and f"{mod_name}.{attr}" not in buffers:
                out[f"{mod_name}.{attr}" if mod_name else attr] = v
    return out


def store_gguf_entry(gguf_path: str | Path, dtype: torch.dtype, hf_model, tokenizer) -> Path | None:
    """Write the cache entry of ``gguf_path`` at ``dtype`` from a freshly dequantised model.

    Atomic (temporary folder + rename). Returns the entry folder, or None when the cache is off or
    cannot be written (a warning says why; loading goes on without the cache).
    """
    if not cache_enabled():
        return None
    from safetensors.torch import save_file

    key, ident = gguf_cache_key(gguf_path, dtype)
    final = entry_path(key)
    root = final.parent
    remove_stale_temps(root)
    tmp = root / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        # Parameters and persistent buffers; tied tensors once (aliases recorded).
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, t in hf_model.state_dict(keep_vars=False).items():
            ident_t = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if ident_t in seen:
                aliases[name] = seen[ident_t]
                continue
            seen[ident_t] = name
            tensors[name] = t.detach().to("cpu").contiguous()
        for name, b in hf_model.named_buffers():
            if name not in tensors and name not in aliases:
                tensors[_BUFFER_PREFIX + name] = b.detach().to("cpu").contiguous().clone()
        attributes = {}
        for name, v in _rotary_attributes(hf_model).items():
            tensors[_BUFFER_PREFIX + name] = v.detach().to("cpu").contiguous().clone()
            attributes[name] = name
        save_file(tensors, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        cfg = hf_model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        write_files_manifest(tmp, {"key": key, "identity": ident, "gguf_path": str(Path(gguf_path).resolve()),
                                   "dtype": ident["dtype"], "aliases": aliases, "attributes": attributes,
                                   "model_class": type(hf_model).__name__})
        fsync_dir(tmp)
        if final.exists():  # an invalid entry that load_gguf_entry did not remove (race): replace it
            try:
                _verify(final, key, ident)
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            except _Invalid:
                remove_entry(final)
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its (identical) entry first
            shutil.rmtree(tmp, ignore_errors=True)
        return final
    except Exception as e:  # noqa: BLE001 - a full disk surfaces as OSError or safetensors' own error
        shutil.rmtree(tmp, ignore_errors=True)
        warnings.warn(f"tracekit could not write its weight cache under {root} ({type(e).__name__}: {e}); "
                      "loading goes on without it (free disk space, or set TRACEKIT_CACHE_DIR to a writable "
                      "folder)", stacklevel=2)
        return None


def load_or_convert_gguf(gguf_path: str | Path, dtype: torch.dtype, convert: Callable[[], tuple[Any, Any]],
                         with_tokenizer: bool = True):
    """``(hf_model, tokenizer)`` of a GGUF file: from the cache when a valid entry exists, else by
    ``convert()`` (which returns the dequantised model and its tokenizer), then stored.

    ``with_tokenizer=False``: the caller has its own tokenizer (``model.tokenizer``); the tokenizer
    returned by ``convert`` is still stored so the entry is complete.
    """
    hit = load_gguf_entry(gguf_path, dtype, with_tokenizer=with_tokenizer)
    if hit is not None:
        hit[0].__dict__["_tracekit_cache_entry"] = str(entry_path(gguf_cache_key(gguf_path, dtype)[0]))
        return hit
    hf, tok = convert()
    entry = store_gguf_entry(gguf_path, dtype, hf, tok)
    if entry is not None:
        hf.__dict__["_tracekit_cache_entry"] = str(entry)
    return hf, tok


def list_entries() -> list[dict]:
    """Every entry under the cache root: ``key, gguf_path, dtype, size_bytes, created, valid``.

    ``valid`` compares sizes only (cheap); a load checks the sha256 too. Leftover temporary
    folders of interrupted writes are listed with ``key`` starting with ``.tmp-``/``.trash-``.
    """
    def describe(d: Path, man: dict) -> dict:
        return {"gguf_path": man.get("gguf_path"), "dtype": man.get("dtype"), "created": man.get("created"),
                "versions": man.get("identity", {}).get("versions"),
                "valid": bool(sizes_match(d, man) and man.get("key") == d.name)}

    return dir_entries(_gguf_root(), describe)


def clear_cache_dir() -> tuple[int, int]:
    """Remove every weight-cache entry (and leftover temporary folders): ``(entries removed, bytes freed)``."""
    return clear_dir(_gguf_root())



# --- cached load-time verification ------------------------------------------------------------
# The load-time verification (tracekit.model.load: the bridge's log-probs vs transformers', the
# readout vs the output) costs two forwards of the model on its probe. Its passing result is kept
# next to the entry the weights come from, as ``<entry>/verification-<key>.json``; the key (made by
# tracekit.model.load) hashes everything the result depends on, so any change recomputes it.

def read_verification(entry: str | Path, key: str) -> dict | None:
    """The verification record stored under ``key`` in the cache entry ``entry``, or None (absent,
    unreadable, or recorded under another key)."""
    p = Path(entry) / f"verification-{key}.json"
    try:
        rec = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("key") == key else None


def write_verification(entry: str | Path, key: str, record: dict) -> None:
    """Store a verification record under ``key`` in the entry (atomic; an unwritable entry is skipped)."""
    d = Path(entry)
    if not d.is_dir():
        return
    tmp = d / f".verification-{key}.{uuid.uuid4().hex}.tmp"
    try:
        tmp.write_text(json.dumps({**record, "key": key}, sort_keys=True, default=str))
        os.replace(tmp, d / f"verification-{key}.json")
    except OSError as e:
        log.debug("verification record not written to %s: %s", d, e)
        tmp.unlink(missing_ok=True)
