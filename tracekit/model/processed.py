"""TransformerLens' processed weights, cached next to a weight-cache entry (see the section comment)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import inspect
import json
import logging
import os
import shutil
import threading
import uuid
from importlib import metadata
from pathlib import Path

import torch

from ..core.cachedir import remove_stale_temps
from ..core.io import (
    file_sha256,
)
from .weights_cache import (  # noqa: F401
    CACHE_FORMAT,
    _check_sha,
    _Invalid,
    _mmap_safetensors,
    _read_manifest,
    cache_enabled,
    remove_entry,
)

log = logging.getLogger("tracekit.cache")


def _processed_key(sig: str, options: dict) -> str:
    import transformer_lens

    blob = {"sig": sig, "options": options, "transformer_lens": getattr(transformer_lens, "__version__", "?"),
            "torch": torch.__version__, "format": CACHE_FORMAT}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _state_signature(state_dict: dict) -> str:
    """Names, shapes and dtypes of the state dict processed (the values are fixed by the entry)."""
    items = sorted((k, tuple(v.shape), str(v.dtype)) for k, v in state_dict.items() if isinstance(v, torch.Tensor))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def _load_processed(d: Path) -> dict[str, torch.Tensor] | None:
    if not d.is_dir():
        return None
    try:
        man = _read_manifest(d)
        rec = man["files"]["weights.safetensors"]
        f = d / "weights.safetensors"
        if f.stat().st_size != rec["size"]:
            raise _Invalid("weights.safetensors differs from its manifest")
        _check_sha(f, rec["sha256"], lambda d=d: remove_entry(d))
        tensors = _mmap_safetensors(f)
        out: dict[str, torch.Tensor] = {}
        for name in man["order"]:
            target = man["aliases"].get(name, name)
            if target not in tensors:
                raise _Invalid(f"processed tensor {target} missing")
            t = tensors[target]
            perm = man.get("permutations", {}).get(target)
            if perm is not None:
                if sorted(perm) != list(range(t.ndim)):
                    raise _Invalid(f"bad permutation for {target}")
                inv = [perm.index(i) for i in range(t.ndim)]
                t = t.permute(inv)
            out[name] = t
        return out
    except (_Invalid, OSError, KeyError, TypeError) as e:
        log.warning("tracekit processed-weights cache %s is invalid (%s): recomputing it", d, e)
        remove_entry(d)
        return None


def _store_processed(d: Path, out: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    if not all(isinstance(v, torch.Tensor) for v in out.values()):
        return  # something we do not know how to store: leave the cache alone
    remove_stale_temps(d.parent)
    tmp = d.parent / f".tmp-{d.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        perms: dict[str, list[int]] = {}
        for name, t in out.items():
            ident_t = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if ident_t in seen:
                aliases[name] = seen[ident_t]
                continue
            seen[ident_t] = name
            # keep the memory layout (a transposed view stays transposed on load): forward passes
            # then run the same kernels on the same strides, so the bridge is bit-identical
            perm = sorted(range(t.ndim), key=lambda i: (-t.stride(i), i))
            stored = t.detach().to("cpu").permute(perm)
            if not stored.is_contiguous():
                raise _Unstorable(name)
            if perm != list(range(t.ndim)):
                perms[name] = perm
            tensors[name] = stored
        save_file(tensors, str(tmp / "weights.safetensors"), metadata={"format": "pt"})
        f = tmp / "weights.safetensors"
        man = {"files": {"weights.safetensors": {"size": f.stat().st_size, "sha256": file_sha256(f, memo=False)}},
               "order": list(out), "aliases": aliases, "permutations": perms,
               "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        (tmp / "manifest.json").write_text(json.dumps(man))
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        try:
            os.rename(tmp, d)
        except OSError:  # another process stored it first
            shutil.rmtree(tmp, ignore_errors=True)
    except _Unstorable as e:  # a layout we cannot restore exactly: no cache rather than other bits
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("processed weights not cached: %s has a memory layout that is not a permutation", e)
    except Exception as e:  # noqa: BLE001 - a full disk surfaces as OSError or safetensors' own error
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("could not store processed weights under %s (%s: %s); loading goes on without them", d,
                    type(e).__name__, e)


class _Unstorable(Exception):
    pass


class processed_weights_cache:
    """Context manager: while it is active, TransformerLens' ``ProcessWeights.process_weights``
    reads its result from ``<entry>/processed-<key>/`` when present (memory-mapped), else computes
    it and stores it there. ``entry`` None (no cache entry behind the model), the cache off, or
    weights already on a GPU (the bridge moves them before processing): nothing changes.

    The key covers the names, shapes and dtypes of the input state dict, the processing options,
    the adapter class and the TransformerLens and torch versions; the values are those of the entry
    (whose weights are verified on load). ``hits`` / ``stores`` count what happened (for tests)."""

    def __init__(self, entry: "str | Path | None"):
        self.entry = Path(entry) if entry is not None else None
        self.hits = 0
        self.stores = 0
        self._saved = None

    def __enter__(self):
        if self.entry is None or not cache_enabled() or not _patchable():
            return self
        from transformer_lens.weight_processing import ProcessWeights  # lazy: TransformerLens is heavy

        _PATCH_LOCK.acquire()  # one patch at a time: two loads in two threads never interleave save/restore
        self._saved = ProcessWeights.__dict__["process_weights"]
        real = self._saved.__func__
        ctx = self

        def cached(state_dict, cfg, **kw):
            if any(v.device.type != "cpu" for v in state_dict.values() if isinstance(v, torch.Tensor)):
                return real(state_dict, cfg, **kw)  # GPU / multi-device: processed in place, not cached
            options = {k: (type(v).__name__ if k == "adapter" else v) for k, v in sorted(kw.items())}
            assert ctx.entry is not None  # __enter__ returned early otherwise
            d = ctx.entry / f"processed-{_processed_key(_state_signature(state_dict), options)}"
            hit = _load_processed(d)
            if hit is not None:
                ctx.hits += 1
                return hit
            out = real(state_dict, cfg, **kw)
            _store_processed(d, out)
            ctx.stores += 1
            return out

        ProcessWeights.process_weights = staticmethod(cached)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            from transformer_lens.weight_processing import ProcessWeights  # lazy: TransformerLens is heavy

            ProcessWeights.process_weights = self._saved  # type: ignore[method-assign]
            self._saved = None
            _PATCH_LOCK.release()
        return False


#: Held while ``ProcessWeights.process_weights`` is replaced (the replacement is process-global).
_PATCH_LOCK = threading.RLock()

#: TransformerLens major versions whose ``ProcessWeights.process_weights(state_dict, cfg, **options)``
#: static method this cache wraps (3.x; 4.x keeps the bridge's processing in the same place).
_SUPPORTED_TL_MAJOR = (3, 4)


def _patchable() -> bool:
    """Whether the installed TransformerLens has the static method this cache wraps, with the
    signature it expects; otherwise processing runs uncached (never patched blind)."""
    try:
        from transformer_lens.weight_processing import ProcessWeights  # lazy: TransformerLens is heavy
        tl_version = metadata.version("transformer-lens")
    except (ImportError, metadata.PackageNotFoundError):
        return False
    major = tl_version.split(".")[0]
    fn = ProcessWeights.__dict__.get("process_weights")
    ok = False
    if major.isdigit() and int(major) in _SUPPORTED_TL_MAJOR and isinstance(fn, staticmethod):
        params = list(inspect.signature(fn.__func__).parameters)
        ok = params[:2] == ["state_dict", "cfg"]
    if not ok:
        log.debug("processed-weights cache off: TransformerLens %s has no ProcessWeights.process_weights"
                  "(state_dict, cfg, ...) static method", tl_version)
    return ok
