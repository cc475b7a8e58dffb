"""The progress reporter (tracekit.core.progress): throttled lines with an ETA when bars are off, a
fake clock, no sleeps; the bar kind picked in a Jupyter kernel with and without ipywidgets."""

from __future__ import annotations

import re

import pytest

from tracekit.core import progress as P


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lines_are_throttled_and_give_the_eta():
    clock, lines = Clock(), []
    bar = P.LineProgress(total=10, desc="activation patching", unit="variant", interval=30, clock=clock,
                         sink=lines.append)
    for _ in range(3):  # 3 units in 20 s: under the interval, nothing printed
        clock.t += 20 / 3
        bar.update(1)
    assert lines == []
    clock.t = 100.0 + 40  # 4 units after 40 s: 10 s a unit, 6 left -> ETA 60 s
    bar.update(1)
    assert lines == ["[activation patching] 4/10 variant (40%), elapsed 40.0 s, ETA 1m00s"]
    clock.t += 10  # 10 s after the last line: still throttled
    bar.update(1)
    assert len(lines) == 1
    clock.t = 100.0 + 75  # 75 s, 6 done: 12.5 s a unit, 4 left -> 50 s
    bar.update(1)
    assert lines[-1] == "[activation patching] 6/10 variant (60%), elapsed 1m15s, ETA 50.0 s"
    clock.t += 3600
    bar.update(4)  # done: no ETA
    assert lines[-1].startswith("[activation patching] 10/10 variant (100%), elapsed 1h01m")
    assert "ETA" not in lines[-1]


def test_unknown_total_no_eta_and_postfix():
    clock, lines = Clock(), []
    bar = P.LineProgress(desc="activations", unit="row", interval=5, clock=clock, sink=lines.append)
    bar.set_postfix_str("layer 3")
    clock.t += 6
    bar.update(7)
    assert lines == ["[activations] 7 row, elapsed 6.0 s (layer 3)"]


def test_interval_from_the_environment_and_the_sink_of_the_block(monkeypatch):
    monkeypatch.setenv("TRACEKIT_PROGRESS_INTERVAL", "0")
    got: list[str] = []
    with P.progress_sink(got.append):
        bar = P.progress_bar(total=2, desc="tuned lens", unit="step", enabled=False)
        assert isinstance(bar, P.LineProgress) and bar.interval == 0
        bar.update(1)
        bar.update(1)
    assert [re.sub(r"elapsed .*", "", s) for s in got] == ["[tuned lens] 1/2 step (50%), ",
                                                           "[tuned lens] 2/2 step (100%), "]
    monkeypatch.delenv("TRACEKIT_PROGRESS_INTERVAL")
    assert P.LineProgress(total=1).interval == P.DEFAULT_INTERVAL


def test_wrapping_an_iterable_counts_its_items():
    clock, lines = Clock(), []
    bar = P.LineProgress(iterable=range(0, 6, 2), desc="batches", interval=0, clock=clock, sink=lines.append)
    assert list(bar) == [0, 2, 4] and bar.total == 3 and bar.n == 3 and len(lines) == 3


def test_bars_on_in_a_terminal_give_tqdm():
    from tqdm.std import tqdm

    bar = P.progress_bar(total=3, desc="x", enabled=True)
    try:
        assert isinstance(bar, tqdm) and type(bar).__module__ == "tqdm.std"
    finally:
        bar.close()


def test_notebook_without_ipywidgets_gets_lines_not_repeated_bars(monkeypatch):
    """tqdm.auto in a Jupyter kernel without ipywidgets falls back to the terminal bar, which notebook
    front ends show as one new line per refresh: there the reporter prints throttled lines."""
    monkeypatch.setattr(P, "in_notebook", lambda: True)
    monkeypatch.setattr(P, "_has_ipywidgets", lambda: False)
    assert P.bar_kind(True) == "lines"
    bar = P.progress_bar(total=5, desc="lens quality", enabled=True)
    assert isinstance(bar, P.LineProgress) and bar.interval == P.NOTEBOOK_INTERVAL
    # with ipywidgets: the widget bar; bars off: lines at the default interval
    monkeypatch.setattr(P, "_has_ipywidgets", lambda: True)
    assert P.bar_kind(True) == "notebook"
    assert P.bar_kind(False) == "lines"


def test_in_notebook_detection(monkeypatch):
    import sys
    import types

    monkeypatch.delitem(sys.modules, "ipykernel.zmqshell", raising=False)
    assert not P.in_notebook()

    class ZMQInteractiveShell:
        pass

    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    fake_ipython = types.ModuleType("IPython")
    fake_ipython.get_ipython = lambda: ZMQInteractiveShell()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython)
    for k in [k for k in __import__("os").environ if k == "QT_API" or k.startswith("SPYDER")]:
        monkeypatch.delenv(k)
    assert P.in_notebook()
    monkeypatch.setenv("QT_API", "pyqt5")
    assert not P.in_notebook()


def test_sweep_points_report_lines_when_bars_are_off():
    from tracekit.sweep.executors import _progress

    assert isinstance(_progress(4, False), P.LineProgress)


@pytest.mark.parametrize("s,text", [(0.04, "0.0 s"), (41.24, "41.2 s"), (185, "3m05s"), (3725, "1h02m")])
def test_format_seconds(s, text):
    assert P.format_seconds(s) == text


def test_heartbeat_speaks_only_after_a_silence(monkeypatch):
    """Work without a loop to count (a circuit's scores, a model load): a line after ``interval``
    seconds in which no other progress line was printed."""
    import time

    lines: list[str] = []
    monkeypatch.setattr(P, "_LAST_LINE", [float("-inf")])
    hb = P.Heartbeat("[step 2/3 circuit]", interval=60, sink=lines.append, clock=time.monotonic)
    t0 = hb.start
    assert not hb.beat(t0 + 59) and lines == []
    assert hb.beat(t0 + 61) and lines == ["[step 2/3 circuit] running, elapsed 1m01s"]
    P._LAST_LINE[0] = t0 + 100  # a loop's own progress line
    assert not hb.beat(t0 + 150)
    assert hb.beat(t0 + 161) and lines[-1] == "[step 2/3 circuit] running, elapsed 2m41s"
    with P.Heartbeat("x", enabled=False) as off:  # bars on: no thread, no line
        assert off._thread is None
