"""Advisory folder locks (``flock`` on a lock file), written once: sweeps lock their ``--out``
folder, activation stores lock their folder against a second writer (:mod:`tracekit.activations`).

``flock`` locks belong to an open file, so two threads or two processes that each open the lock
file exclude each other, and a lock is released when its holder exits, however it dies (a killed
writer never leaves a stale lock behind). A shared lock (``shared=True``) admits other shared
holders and excludes an exclusive one.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO, Callable, Optional, Union

__all__ = ["acquire", "release", "holder_pid"]


def acquire(path: Union[str, Path], *, shared: bool = False, wait: bool = False,
            on_wait: Optional[Callable[[], None]] = None) -> Optional[IO]:
    """Open (creating it) the lock file ``path`` and lock it.

    Args:
        path: the lock file (e.g. ``<folder>/.sweep.lock``).
        shared: a shared lock (readers) instead of an exclusive one (writers).
        wait: when the lock is held, wait for it (``on_wait`` is called once first) instead of
            returning None. Ctrl-C interrupts the wait.
        on_wait: called before waiting (e.g. to say who is waited for).

    Returns:
        The open lock file (keep it: closing it or :func:`release` releases the lock), or None
        when the lock is held elsewhere and ``wait`` is off. An exclusive holder's pid is written
        into the file (:func:`holder_pid`).

    Raises:
        OSError: the lock file cannot be opened (a read-only or missing folder); callers map it
            to an error naming the folder.
    """
    f = open(path, "a+")  # noqa: SIM115 - the lock lives as long as the open file; closed by release()
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        fcntl.flock(f, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        if not wait:
            f.close()
            return None
        if on_wait is not None:
            on_wait()
        try:
            fcntl.flock(f, mode)
        except BaseException:
            f.close()
            raise
    if not shared:
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
        except OSError:  # a full disk must not stop a lock that is held already
            pass
    return f


def release(lock: Optional[IO]) -> None:
    """Release a lock returned by :func:`acquire` (None: nothing to release)."""
    if lock is None or lock.closed:
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        lock.close()


def holder_pid(path: Union[str, Path]) -> Optional[int]:
    """The pid the last exclusive holder of lock file ``path`` wrote (None: unknown)."""
    try:
        return int(Path(path).read_text().strip() or "x")
    except (OSError, ValueError):
        return None
