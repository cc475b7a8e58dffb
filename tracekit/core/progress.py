"""Progress of the loops a user waits on: a tqdm bar when bars are on, throttled text lines when off.

One reporter for every long loop of tracekit (training steps, patching variants, backward passes,
lens-quality windows, sweep points): :func:`progress_bar` returns

* a tqdm bar when bars are on (``enabled=True``) in a terminal, or a widget bar in a Jupyter kernel
  that has ipywidgets;
* a :class:`LineProgress` otherwise: no bar, but one line ``[desc] n/total unit (p%), elapsed 1m02s,
  ETA 3m10s`` at most every ``interval`` seconds (default 30 s, or ``TRACEKIT_PROGRESS_INTERVAL``),
  so a run with ``--no-progress`` still shows it is alive and how long it has left. The first line
  comes only after ``interval`` seconds, so short loops print nothing.

Jupyter without ipywidgets: ``tqdm.auto`` falls back to the terminal bar, whose carriage returns
many notebook front ends render as one new line per refresh (a screen of repeated bars); there
:func:`bar_kind` picks ``"lines"`` (throttled lines, every :data:`NOTEBOOK_INTERVAL` seconds) instead.

A step without such a loop (a circuit's edge scores, a model load) gets a :class:`Heartbeat`: the
runner prints ``[step 2/3 circuit] running, elapsed 4m00s`` every ``2 x interval`` seconds (at
least 1 s) in which no other progress line was printed, while bars are off.

Where lines go: the innermost :func:`progress_sink` (the runner sets it to its log, so lines of a
step go where the run's step lines go, and a sweep's quiet points stay quiet); default: stderr.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

__all__ = ["progress_bar", "LineProgress", "Heartbeat", "progress_sink", "bar_kind", "format_seconds", "in_notebook",
           "DEFAULT_INTERVAL", "NOTEBOOK_INTERVAL"]

#: Seconds between two progress lines when bars are off (``TRACEKIT_PROGRESS_INTERVAL`` overrides).
DEFAULT_INTERVAL = 30.0
#: Seconds between two progress lines in a Jupyter kernel without ipywidgets (bars on).
NOTEBOOK_INTERVAL = 5.0

_SINK: contextvars.ContextVar[Optional[Callable[[str], Any]]] = contextvars.ContextVar("tracekit_progress_sink",
                                                                                       default=None)


#: When the last progress line of this process was printed (``time.monotonic``): a heartbeat stays
#: quiet while loops print their own lines.
_LAST_LINE = [float("-inf")]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_sink(log: Callable[[str], Any]):
    """Send the progress lines of every :class:`LineProgress` created inside the block to ``log``
    (a callable taking one line). Raises nothing."""
    token = _SINK.set(log)
    try:
        yield log
    finally:
        _SINK.reset(token)


def _interval(interval: Optional[float]) -> float:
    if interval is not None:
        return float(interval)
    try:
        return float(os.environ.get("TRACEKIT_PROGRESS_INTERVAL", DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL


def format_seconds(s: float) -> str:
    """``41.2 s``, ``3m05s``, ``1h02m``: a wall time in seconds for a progress line. Raises nothing."""
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class LineProgress:
    """A tqdm-like reporter that prints throttled lines instead of a bar.

    It has the part of tqdm's interface tracekit's loops use (``update``, ``close``, ``total``,
    ``n``, ``set_postfix_str``, ``set_description``, iteration, ``with``). A line is printed when
    ``update`` is called at least ``interval`` seconds after the last line (or the start); it reads
    ``[desc] n/total unit (p%), elapsed E, ETA R`` with ``R = E (total - n) / n`` (the mean rate so
    far), or ``[desc] n unit, elapsed E`` when the total is unknown.

    Args:
        total: number of units, or None when unknown (no ETA).
        desc: what is progressing (the line's prefix).
        unit: the unit's name.
        interval: seconds between lines (default :data:`DEFAULT_INTERVAL`, or
            ``TRACEKIT_PROGRESS_INTERVAL``).
        clock: seconds, monotonic (tests pass a fake clock).
        sink: where lines go (default: the current :func:`progress_sink`, else stderr).
        iterable: iterate over this, counting one unit per item.
    """

    def __init__(self, total: Optional[float] = None, desc: str = "", unit: str = "it",
                 interval: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 sink: Optional[Callable[[str], Any]] = None, iterable: Optional[Iterable] = None):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total, self.desc, self.unit, self.iterable = total, desc, unit, iterable
        self.interval = _interval(interval)
        self.clock = clock
        self.sink = sink or _SINK.get() or _stderr
        self.n: float = 0
        self.postfix = ""
        self.start = self.last = clock()
        self.lines = 0

    def __iter__(self) -> Iterator:
        for x in self.iterable or ():
            yield x
            self.update(1)

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self, now: Optional[float] = None) -> str:
        """The progress line now. Raises nothing."""
        elapsed = (self.clock() if now is None else now) - self.start
        n = int(self.n) if float(self.n).is_integer() else round(self.n, 2)
        head = f"[{self.desc}] " if self.desc else ""
        if self.total:
            pct = 100.0 * self.n / self.total
            text = f"{head}{n}/{int(self.total)} {self.unit} ({pct:.0f}%), elapsed {format_seconds(elapsed)}"
            if 0 < self.n < self.total:
                text += f", ETA {format_seconds(elapsed * (self.total - self.n) / self.n)}"
        else:
            text = f"{head}{n} {self.unit}, elapsed {format_seconds(elapsed)}"
        return text + (f" ({self.postfix})" if self.postfix else "")

    def update(self, n: float = 1) -> None:
        """Count ``n`` more units; print a line when ``interval`` seconds passed since the last one."""
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self.lines += 1
            _LAST_LINE[0] = time.monotonic()
            self.sink(self.line(now))

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """What the next line adds in parentheses (e.g. the sweep point's label)."""
        self.postfix = str(s)

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        items = dict(ordered_dict or {}, **kwargs)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_description(self, desc: Optional[str] = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


class Heartbeat:
    """``[desc] running, elapsed E`` lines while a block runs, for work without a loop to count
    (a model load, a circuit's scores): every ``interval`` seconds in which no other progress line
    (a :class:`LineProgress`'s or a heartbeat's) was printed. A daemon thread checks once a second;
    leaving the block stops it. ``enabled=False`` prints nothing.

    Args:
        desc: what is running (the line's prefix).
        interval: seconds of silence before a line (default ``2 x`` :data:`DEFAULT_INTERVAL` or
            ``2 x TRACEKIT_PROGRESS_INTERVAL``; at least 1 s).
        sink: where lines go (default: the current :func:`progress_sink`, else stderr).
        clock: seconds, monotonic (tests call :meth:`beat` with a fake one).
    """

    def __init__(self, desc: str, interval: Optional[float] = None, sink: Optional[Callable[[str], Any]] = None,
                 clock: Callable[[], float] = time.monotonic, enabled: bool = True):
        self.desc, self.enabled, self.clock = desc, enabled, clock
        self.interval = max(1.0, float(interval) if interval is not None else 2 * _interval(None))
        self.sink = sink or _SINK.get() or _stderr  # read here: a thread does not see the context
        self.start = self.last = clock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def beat(self, now: Optional[float] = None) -> bool:
        """Print a line if ``interval`` seconds passed since the last progress line; returns whether."""
        now = self.clock() if now is None else now
        quiet_since = max(self.last, _LAST_LINE[0] if self.clock is time.monotonic else self.last)
        if now - quiet_since < self.interval:
            return False
        self.last = now
        _LAST_LINE[0] = time.monotonic()
        self.sink(f"{self.desc} running, elapsed {format_seconds(now - self.start)}")
        return True

    def _loop(self) -> None:
        while not self._stop.wait(min(1.0, self.interval)):
            self.beat()

    def __enter__(self) -> "Heartbeat":
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="tracekit-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (the test ``tqdm.autonotebook`` makes: the ZMQ shell
    is imported, and it is not the Qt console or Spyder). Raises nothing."""
    if "ipykernel.zmqshell" not in sys.modules:
        return False
    if any(k == "QT_API" or k.startswith("SPYDER") for k in os.environ):
        return False
    try:
        shell = sys.modules["IPython"].get_ipython().__class__.__name__.lower()
    except Exception:  # noqa: BLE001 - no IPython shell: not a notebook
        return False
    return "qt" not in shell and "spyder" not in shell


def _has_ipywidgets() -> bool:
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):
        return False


def bar_kind(enabled: bool = True) -> str:
    """Which reporter :func:`progress_bar` gives: ``"notebook"`` (tqdm's widget bar: a Jupyter kernel
    with ipywidgets), ``"text"`` (tqdm's terminal bar) or ``"lines"`` (:class:`LineProgress`: bars
    off, or a Jupyter kernel without ipywidgets). Raises nothing."""
    if not enabled:
        return "lines"
    if in_notebook():
        return "notebook" if _has_ipywidgets() else "lines"
    return "text"


def progress_bar(iterable: Optional[Iterable] = None, *, total: Optional[float] = None, desc: str = "",
                 unit: str = "it", enabled: bool = True, leave: bool = False,
                 interval: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 **tqdm_kwargs: Any) -> Any:
    """A progress reporter for a loop a user waits on: a tqdm bar when ``enabled`` (the caller's
    ``progress``), else throttled lines with an ETA (:class:`LineProgress`); see the module docs.

    Args:
        iterable: wrap this (like ``tqdm(iterable)``), or None and call ``update``.
        total: number of units (None: the iterable's length, or unknown: no ETA).
        desc: what is progressing. unit: the unit's name.
        enabled: bars on (``progress=True``); off: lines every ``interval`` seconds.
        leave: keep the tqdm bar after it closes.
        interval: seconds between lines (default 30, ``TRACEKIT_PROGRESS_INTERVAL``; 5 in a notebook
            without ipywidgets).
        clock: the lines' clock (tests).
        tqdm_kwargs: passed to tqdm (``dynamic_ncols``, ``file``, ...).

    Returns:
        An object with tqdm's ``update``/``close``/``set_postfix_str`` (and iteration when wrapping).
    """
    kind = bar_kind(enabled)
    if kind == "lines":
        if enabled and interval is None:  # a notebook without ipywidgets: bars asked for, lines given
            interval = NOTEBOOK_INTERVAL
        return LineProgress(total=total, desc=desc, unit=unit, interval=interval, clock=clock, iterable=iterable)
    if kind == "notebook":
        from tqdm.notebook import tqdm as bar  # lazy: only in a kernel with ipywidgets
    else:
        from tqdm.std import tqdm as bar  # lazy: tqdm only for a bar
    return bar(iterable, total=total, desc=desc, unit=unit, leave=leave, **tqdm_kwargs)
