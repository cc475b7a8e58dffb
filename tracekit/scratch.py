"""Scratch folders that do not outlive the process's work.

:func:`scratch_dir` creates a folder for temporary files (activation chunks spilled to disk, ...)
under ``$TRACEKIT_SCRATCH`` when it is set (the runner sets it to ``<run_dir>/.scratch`` and cleans
that folder itself) or else the system temp dir, and removes it on every exit the process survives:

* the ``with`` block ends normally or by any exception, ``KeyboardInterrupt`` (Ctrl-C) included;
* the interpreter exits with the folder still alive (``atexit``);
* the process receives ``SIGTERM`` (``kill``): while any scratch folder is alive, a cleanup on
  :mod:`tracekit.core.signals`' stack removes them all before the signal is handled (by the
  handler on the stack, the one installed before, or the default action: the process still dies
  of SIGTERM, exit status -15).

``SIGKILL`` cannot be caught; what it leaves behind under ``$TRACEKIT_SCRATCH`` is removed by the
runner. A folder can be handed over to an owner that outlives the ``with`` block
(:meth:`Scratch.detach`); the owner calls :meth:`Scratch.remove`, and atexit / SIGTERM still cover it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from .core import signals

__all__ = ["scratch_dir", "Scratch", "scratch_root", "live_scratch_dirs", "SCRATCH_ENV"]

SCRATCH_ENV = "TRACEKIT_SCRATCH"

_LIVE: dict[str, "Scratch"] = {}
_LOCK = threading.RLock()
_ATEXIT = False


def scratch_root() -> Path:
    """``$TRACEKIT_SCRATCH`` (created if missing) when set, else the system temp dir."""
    env = os.environ.get(SCRATCH_ENV)
    if env:
        p = Path(env).expanduser()
        p.mkdir(parents=True, exist_ok=True)
        return p
    return Path(tempfile.gettempdir())


def live_scratch_dirs() -> list[Path]:
    """The scratch folders currently alive in this process."""
    with _LOCK:
        return [s.path for s in _LIVE.values()]


class Scratch:
    """One scratch folder (``path``); :meth:`remove` deletes it (idempotent)."""

    def __init__(self, path: Path):
        self.path = path
        self.detached = False

    def detach(self) -> "Scratch":
        """Keep the folder when the ``with`` block ends; the caller now owns :meth:`remove`."""
        self.detached = True
        return self

    def remove(self) -> None:
        with _LOCK:
            _LIVE.pop(str(self.path), None)
            shutil.rmtree(self.path, ignore_errors=True)
            if not _LIVE:
                signals.remove_cleanup("scratch")

    def __repr__(self) -> str:
        return f"Scratch({str(self.path)!r})"


def _cleanup_all() -> None:
    with _LOCK:
        for s in list(_LIVE.values()):
            shutil.rmtree(s.path, ignore_errors=True)
        _LIVE.clear()


@contextlib.contextmanager
def scratch_dir(prefix: str = "tracekit-") -> Iterator[Scratch]:
    """Create a scratch folder; remove it when the block exits (normally, by any exception, by
    Ctrl-C), at interpreter exit, or on SIGTERM -- unless :meth:`Scratch.detach` was called, in which
    case the caller removes it (atexit and SIGTERM still do).

    Yields:
        :class:`Scratch` (``.path`` is the folder).
    """
    global _ATEXIT
    with _LOCK:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=scratch_root()))
        s = Scratch(path)
        _LIVE[str(path)] = s
        if not _ATEXIT:
            atexit.register(_cleanup_all)
            _ATEXIT = True
        signals.add_cleanup("scratch", _cleanup_all)  # on SIGTERM, before whatever handles it
    try:
        yield s
    except BaseException:
        s.remove()
        raise
    else:
        if not s.detached:
            s.remove()
