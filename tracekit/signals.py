"""Signal handlers around library calls that install their own.

SAELens' training runner installs SIGINT/SIGTERM handlers that raise its ``InterruptedException``
and never restores the previous ones: after a training, Ctrl-C in a notebook raised SAELens'
exception instead of ``KeyboardInterrupt``, ``tracekit run`` recorded an interrupted run as failed
(exit 1, not 130), and a sweep's Ctrl-C failed one point while the others kept running.
:func:`preserved_signal_handlers` restores every handler on exit and turns a library's interrupt
exception into ours (``KeyboardInterrupt``), so an interrupt means one thing in tracekit.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["preserved_signal_handlers", "HANDLED_SIGNALS"]

#: The signals tracekit handles (Ctrl-C and ``kill``).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def preserved_signal_handlers(interrupt_types: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Restore the SIGINT/SIGTERM handlers on exit, whatever the block installed or raised; an
    exception of ``interrupt_types`` (a library's "interrupted") is re-raised as
    ``KeyboardInterrupt``. Outside the main thread (where handlers cannot change) it only maps."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in HANDLED_SIGNALS} if main else {}
    try:
        yield
    except interrupt_types as e:
        raise KeyboardInterrupt(f"interrupted ({type(e).__name__})") from e
    finally:
        for s, h in saved.items():
            if signal.getsignal(s) is not h and h is not None:
                signal.signal(s, h)
