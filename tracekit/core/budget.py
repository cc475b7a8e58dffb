"""The memory budget: one setting every batched engine uses to choose its chunk sizes.

A run's budget is ``run.memory_budget`` in a config (or ``with tracekit.memory_budget("4GiB"):`` /
the ``memory_budget=`` argument of a library call). Its forms:

* ``auto`` (the default): :data:`AUTO_SHARE` of the memory free on the run's device when the
  engine asks (CUDA: ``torch.cuda.mem_get_info``; CPU: ``psutil.virtual_memory().available``), so
  the weights already loaded are not counted twice;
* a size: ``"512MiB"``, ``"4GB"``, ``"1.5GiB"``, or a plain number of bytes (``2e9``);
* a share of free memory: ``"40%"``.

An engine that holds a tensor growing with rows, positions, layers or vocabulary asks
:func:`chunk_rows` how many rows (or positions, or layers: whatever it chunks over) fit, given the
bytes one of them needs, and runs its chunks through :func:`run_chunked`, which on an out-of-memory
error halves the chunk and retries, saying so. Chunked results must equal unchunked ones exactly:
an engine only splits work whose pieces are computed independently.

When one unit does not fit, :func:`chunk_rows` raises :class:`MemoryBudgetError` naming how much
one unit needs, what the budget allows and the setting to change, before any heavy work.

Pattern: TransformerLens' ``utils.get_device``-style helpers and Accelerate's
``find_executable_batch_size`` (halve on OOM); the budget as a number of bytes is ours.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch

from .errors import MemoryBudgetError

__all__ = [
    "AUTO_SHARE", "BudgetValue", "MemoryBudget", "MemoryBudgetError", "chunk_rows", "current_budget",
    "format_bytes", "free_memory", "is_oom", "memory_budget", "parse_budget", "run_chunked", "bytes_of",
]

log = logging.getLogger("tracekit.budget")

#: Share of the device's free memory an ``auto`` budget allows.
AUTO_SHARE = 0.3

BudgetValue = Union[str, int, float, None]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.I)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def parse_budget(value: BudgetValue, field: str = "run.memory_budget") -> tuple[Optional[int], Optional[float]]:
    """``(bytes, share)``: exactly one is set; ``(None, AUTO_SHARE)`` for ``auto``/None.

    Raises:
        MemoryBudgetError: the value is not ``auto``, a size (``"4GiB"``, ``2e9``) or a share
            (``"40%"``), or is not positive; the message names ``field``.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None, AUTO_SHARE
    if isinstance(value, bool):
        raise MemoryBudgetError(f"{field}: {value!r} is not a memory budget; give 'auto', a size "
                                "such as '4GiB' or '512MB', or a share of free memory such as '40%'.")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise MemoryBudgetError(f"{field}: {value!r} must be a positive number of bytes.")
        return int(value), None
    s = str(value).strip()
    if s.endswith("%"):
        try:
            share = float(s[:-1]) / 100
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise MemoryBudgetError(f"{field}: {value!r} is not a share between 0% and 100%.")
        return None, share
    m = _SIZE.match(s)
    if m is None or m.group(2).lower() not in _UNITS:
        raise MemoryBudgetError(f"{field}: {value!r} is not a memory budget; give 'auto', a size such as "
                                "'4GiB', '512MB' or 2e9 (bytes), or a share of free memory such as '40%'.")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 1:
        raise MemoryBudgetError(f"{field}: {value!r} must be at least one byte.")
    return int(n), None


def free_memory(device: Union[str, torch.device, None] = None) -> int:
    """Bytes free on ``device`` now (CUDA: ``mem_get_info``; CPU: available RAM). 2 GiB if unknown."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    try:
        if dev.type == "cuda":
            return int(torch.cuda.mem_get_info(dev)[0])
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - an estimate; never fail a run over it
        return 2 * 1024**3


@dataclass(frozen=True)
class MemoryBudget:
    """A budget resolved on one device: ``bytes`` allowed, and where the number came from.

    Attributes:
        bytes: bytes a run may hold for its chunked tensors at one time.
        source: how it was set (``"run.memory_budget: 4GiB"``, ``"auto: 30% of 18.2 GiB free (cpu)"``).
    """

    bytes: int
    source: str

    def as_dict(self) -> dict:
        return {"memory_budget_bytes": int(self.bytes), "memory_budget": self.source}


_CURRENT: ContextVar[BudgetValue] = ContextVar("tracekit_memory_budget", default=None)


@contextlib.contextmanager
def memory_budget(value: BudgetValue) -> Iterator[None]:
    """Use ``value`` as the memory budget of every engine called inside the block.

    ``with tracekit.memory_budget("2GiB"): tracekit.logit_lens(model, ...)``. ``None`` keeps the
    enclosing budget. Raises :class:`MemoryBudgetError` for a value that is not a budget.
    """
    if value is None:
        yield
        return
    parse_budget(value)
    tok = _CURRENT.set(value)
    try:
        yield
    finally:
        _CURRENT.reset(tok)


def current_budget(device: Union[str, torch.device, None] = None, value: BudgetValue = None) -> MemoryBudget:
    """The budget in force on ``device``: ``value`` if given, else the enclosing
    :func:`memory_budget`, else ``auto``."""
    v = value if value is not None else _CURRENT.get()
    n, share = parse_budget(v)
    if n is not None:
        return MemoryBudget(n, f"run.memory_budget: {v}")
    assert share is not None
    dev = torch.device(device) if device is not None else torch.device("cpu")
    free = free_memory(dev)
    label = "auto" if v is None or str(v).strip().lower() == "auto" else f"run.memory_budget: {v}"
    return MemoryBudget(int(share * free), f"{label}: {share:.0%} of {format_bytes(free)} free ({dev.type})")


def bytes_of(*shape: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def chunk_rows(per_row: int, n: int, *, what: str, device: Union[str, torch.device, None] = None,
               fixed: int = 0, budget: BudgetValue = None, unit: str = "row",
               fix: Optional[str] = None) -> int:
    """How many of ``n`` units (rows, positions, layers) to process at once.

    Args:
        per_row: bytes one unit needs while it is processed (the engine's estimate, temporaries
            included).
        n: units to process (the answer is at most ``n``, at least 1).
        what: the engine, for messages (``"logit lens readout"``).
        device: where the tensors live.
        fixed: bytes needed whatever the chunk (e.g. a cached clean run).
        budget: a budget for this call only (else the one in force).
        unit: what one unit is, for messages.
        fix: what else could be changed (``"shorten the prompt"``), for the message.

    Raises:
        MemoryBudgetError: one unit (plus ``fixed``) needs more than the budget: the message gives
            both numbers and the settings to change.
    """
    b = current_budget(device, budget)
    need = int(per_row) + int(fixed)
    if need > b.bytes:
        raise MemoryBudgetError(
            f"{what}: one {unit} needs about {format_bytes(need)} but the memory budget allows "
            f"{format_bytes(b.bytes)} ({b.source}); set run.memory_budget to at least '{_suggest(need)}'"
            + (f", or {fix}" if fix else "") + "."
        )
    return max(1, min(int(n), int((b.bytes - int(fixed)) // max(1, int(per_row)))))


def _suggest(need: int) -> str:
    gib = need / 1024**3
    return f"{math.ceil(gib * 1.25)}GiB" if gib >= 1 else f"{math.ceil(need * 1.25 / 1024**2)}MiB"


def is_oom(e: BaseException) -> bool:
    """An out-of-memory error (CUDA's ``OutOfMemoryError`` or a RuntimeError saying so)."""
    oom_cls = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_cls is not None and isinstance(e, oom_cls):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def run_chunked(fn: Callable[[slice], None], n: int, chunk: int, align: int = 1, what: str = "tracekit") -> int:
    """Call ``fn(slice)`` over ``range(n)`` in chunks of ``chunk``; on an out-of-memory error halve
    the chunk (keeping it a multiple of ``align``), say so in the log, and retry the same chunk.
    Returns the final chunk size. ``fn`` must write each slice's results where a retry overwrites
    them (so a retried chunk is not counted twice).

    Raises:
        torch.OutOfMemoryError: the OOM error itself when a chunk of ``align`` units does not fit.
    """
    bs = max(align, (int(chunk) // align) * align)
    i = 0
    while i < n:
        sl = slice(i, min(n, i + bs))
        try:
            fn(sl)
        except Exception as e:  # re-raised unless out of memory
            if not is_oom(e) or bs <= align:
                raise
            bs = max(align, ((bs // 2) // align) * align)
            log.warning("%s: out of memory, halving the chunk to %d and retrying", what, bs)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        i = sl.stop
    return bs
