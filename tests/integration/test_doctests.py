"""Doctests: every ``>>>`` example in tracekit's docstrings runs (``doctest`` over every module).

The "Notebook use" examples name ``model``; here it is a tiny random Llama (and ``tk.load_model()``
returns it), so they check the interface in seconds; the acceptance tier runs the real model.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import matplotlib.pyplot as plt
import pytest

import tracekit as tk
from helpers import make_tiny


def _modules() -> list[str]:
    names = ["tracekit"]
    for m in pkgutil.walk_packages(tk.__path__, "tracekit."):
        names.append(m.name)
    return sorted(set(names))


def _with_examples() -> list[str]:
    out = []
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in _modules():
        mod = importlib.import_module(name)
        if any(t.examples for t in finder.find(mod, name)):
            out.append(name)
    return out


MODULES = _with_examples()


def test_doctests_exist_where_promised():
    for name in ("tracekit", "tracekit.logit_lens", "tracekit.trace", "tracekit.probing", "tracekit.core.paths",
                 "tracekit.core.strict"):
        assert name in MODULES, f"{name} lost its doctest"


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama")


@pytest.mark.parametrize("name", MODULES)
def test_doctests_run(name, tiny, monkeypatch, tmp_path):
    monkeypatch.setattr(tk, "load_model", lambda spec=None, **kw: tiny)
    monkeypatch.chdir(tmp_path)
    mod = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(mod, name, globs={"model": tiny, "tk": tk, **vars(mod)}):
        runner.run(test)
    plt.close("all")
    res = runner.summarize(verbose=False)
    assert res.failed == 0, f"{res.failed} of {res.attempted} doctest examples in {name} failed (output above)"
