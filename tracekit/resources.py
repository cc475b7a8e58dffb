"""Peak memory of this process, for ``environment.json`` (runner) and the benchmarks.

``peak_memory()`` reads the kernel's high-water mark of resident memory (``getrusage``'s
``ru_maxrss``: KiB on Linux, bytes on macOS; ``VmHWM`` of ``/proc/self/status`` when readable),
the current RSS (``psutil`` when installed, else ``/proc/self/statm``) and, when CUDA is
initialised, ``torch.cuda.max_memory_allocated`` per device. Memory-mapped weights that were
touched count in RSS (they are file pages shared with the page cache, not private copies).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # only for the annotation: this module is loaded alone by file path too (no package imports)
    from .model.info import HookedModel

__all__ = ["current_rss_bytes", "peak_memory", "peak_rss_bytes", "weights_bytes"]

_MiB = 2**20


def peak_rss_bytes() -> int | None:
    """High-water mark of this process's resident set size, in bytes (None when unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


def current_rss_bytes() -> int | None:
    """Resident set size now, in bytes (None when unknown)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def peak_memory() -> dict:
    """Peak memory of this process: ``{"peak_rss_mib", "rss_mib", "cuda_peak_mib"?}``.

    ``peak_rss_mib``: resident high-water mark since the process started (MiB); ``rss_mib``: now;
    ``cuda_peak_mib``: ``{device: max_memory_allocated}`` in MiB, only when CUDA was initialised
    (reading it never initialises CUDA). Values are rounded to 0.1 MiB; unknown ones are None.
    """
    now = current_rss_bytes()
    peak = peak_rss_bytes()
    out: dict = {"peak_rss_mib": None if peak is None else round(peak / _MiB, 1),
                 "rss_mib": None if now is None else round(now / _MiB, 1)}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_mib"] = {f"cuda:{i}": round(torch.cuda.max_memory_allocated(i) / _MiB, 1)
                                for i in range(torch.cuda.device_count())}
    return out


def weights_bytes(model: HookedModel) -> int:
    """Bytes of a model's parameters (each tensor counted once, tied weights once)."""
    seen, total = set(), 0
    for p in cast(Any, model).parameters():  # a loaded bridge's module
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape))
        if key in seen:
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    return total
