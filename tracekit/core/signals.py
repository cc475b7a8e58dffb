"""One stack of SIGINT/SIGTERM handlers for the whole process.

What an interrupt means depends on what is running: inside ``tracekit run`` SIGTERM stops the run
(exit 143, the run recorded as interrupted); inside a sweep Ctrl-C or SIGTERM stops the sweep after
recording the point; scratch folders must be removed on SIGTERM whatever else happens; and a
library (SAELens' training runner) may install handlers of its own. Each of those used to call
``signal.signal`` itself. Here:

* :func:`interrupt_handler` pushes a handler for the duration of a block (the innermost wins, as
  nested blocks expect) and pops it whatever is raised;
* :func:`add_cleanup` registers work done on SIGTERM before the handler runs (scratch folders);
* with no handler pushed, a signal goes to the handler the process had before tracekit installed
  its dispatcher (Python's ``KeyboardInterrupt`` for SIGINT, the default action for SIGTERM);
* :func:`preserved_signal_handlers` restores the OS-level handlers around a library call that
  installs its own, and turns the library's interrupt exception into ``KeyboardInterrupt``.

Outside the main thread (where Python cannot set handlers) these are no-ops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator

__all__ = ["interrupt_handler", "add_cleanup", "remove_cleanup", "preserved_signal_handlers", "HANDLED_SIGNALS"]

#: The signals tracekit handles (Ctrl-C and ``kill``).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_LOCK = threading.RLock()
_STACK: list[tuple[frozenset[int], Callable[[int], None]]] = []
_CLEANUPS: dict[Any, Callable[[], None]] = {}
_SAVED: dict[int, Any] = {}  # the process's handlers before the dispatcher was installed


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _dispatch(signum: int, frame) -> None:
    if signum == signal.SIGTERM:
        for fn in list(_CLEANUPS.values()):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a cleanup never stops the signal's handling
                pass
    for sigs, fn in reversed(_STACK):
        if signum in sigs:
            fn(signum)
            return
    prev = _SAVED.get(signum)
    _restore(signum)
    if callable(prev):
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)  # the default action: the process dies of the signal
    os.kill(os.getpid(), signum)


def _restore(signum: int) -> None:
    if signum in _SAVED and signal.getsignal(signum) is _dispatch:
        prev = _SAVED.pop(signum)
        signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
    else:
        _SAVED.pop(signum, None)


def _sync() -> None:
    """Install the dispatcher for each signal something needs, restore the rest."""
    if not _main():
        return
    for s in HANDLED_SIGNALS:
        wanted = any(s in sigs for sigs, _ in _STACK) or (s == signal.SIGTERM and bool(_CLEANUPS))
        installed = signal.getsignal(s) is _dispatch
        try:
            if wanted and not installed:
                prev = signal.getsignal(s)
                if prev == signal.SIG_IGN and not any(s in sigs for sigs, _ in _STACK):
                    continue  # an ignored SIGTERM: nothing to clean up after
                _SAVED[s] = prev
                signal.signal(s, _dispatch)
            elif not wanted and installed:
                _restore(s)
        except (ValueError, OSError):  # not the main interpreter / no signals here
            pass


@contextlib.contextmanager
def interrupt_handler(fn: Callable[[int], None], signals: tuple[int, ...] = HANDLED_SIGNALS) -> Iterator[None]:
    """Call ``fn(signum)`` (which usually raises) on ``signals`` inside the block; the innermost
    block's handler wins; popped whatever is raised."""
    entry = (frozenset(signals), fn)
    with _LOCK:
        _STACK.append(entry)
        _sync()
    try:
        yield
    finally:
        with _LOCK:
            if entry in _STACK:
                _STACK.remove(entry)
            _sync()


def add_cleanup(key: Any, fn: Callable[[], None]) -> None:
    """Run ``fn()`` on SIGTERM (before the handler on the stack, or the default action) until
    :func:`remove_cleanup` ``(key)``."""
    with _LOCK:
        _CLEANUPS[key] = fn
        _sync()


def remove_cleanup(key: Any) -> None:
    with _LOCK:
        _CLEANUPS.pop(key, None)
        _sync()


@contextlib.contextmanager
def preserved_signal_handlers(interrupt_types: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Restore the SIGINT/SIGTERM handlers on exit, whatever the block installed or raised; an
    exception of ``interrupt_types`` (a library's "interrupted") is re-raised as
    ``KeyboardInterrupt``. Outside the main thread it only maps."""
    saved = {s: signal.getsignal(s) for s in HANDLED_SIGNALS} if _main() else {}
    try:
        yield
    except interrupt_types as e:
        raise KeyboardInterrupt(f"interrupted ({type(e).__name__})") from e
    finally:
        for s, h in saved.items():
            if signal.getsignal(s) is not h and h is not None:
                signal.signal(s, h)
