"""The experiment registry: explicit imports, duplicates refused, template-method run."""

from __future__ import annotations

from typing import Literal

import pytest

import tracekit as tk
from tracekit.experiments.base import REGISTRY, Experiment, Result, register


def test_duplicate_kind_is_refused():
    class Again(Experiment):
        kind: Literal["logit_lens"] = "logit_lens"
        result_class = Result

    with pytest.raises(ValueError, match="already registered"):
        register(Again)
    assert REGISTRY["logit_lens"] is tk.LogitLens


def test_kinds_cannot_override_run():
    class Custom(Experiment):
        kind: Literal["custom_kind_for_test"] = "custom_kind_for_test"
        result_class = Result

        def run(self, model=None, progress=True, *, check=True):  # noqa: D401
            return None

    with pytest.raises(TypeError, match="_run"):
        register(Custom)
    assert "custom_kind_for_test" not in REGISTRY


def test_every_kind_is_exported_explicitly():
    for kind, cls in REGISTRY.items():
        assert getattr(tk, cls.__name__) is cls, kind
        assert cls.__name__ in tk.__all__


def test_one_error_root():
    import tracekit.errors as E

    for name in E.__all__:
        cls = getattr(E, name)
        assert issubclass(cls, E.TracekitError)
        if cls is not E.TracekitError:
            assert len(cls.__mro__) > 3  # also a built-in type (ValueError, OSError, RuntimeError)


def test_builtin_kind_table_matches_the_registry():
    """tracekit.results.KINDS (kind -> "module:Class", imported on demand) names every registered kind."""
    from tracekit.results import KINDS

    assert sorted(KINDS) == sorted(REGISTRY)
    for kind, target in KINDS.items():
        cls = REGISTRY[kind]
        assert f"{cls.__module__}:{cls.__name__}" == target, kind


def test_loading_a_result_needs_no_kind_registered_first(tmp_path, monkeypatch):
    import pandas as pd

    from tracekit.results import RESULTS

    tk.Result(tk.LogitLens(prompts=["x"]), {"main": pd.DataFrame({"a": [1]})}).save(tmp_path / "r", figures=False)
    monkeypatch.delitem(REGISTRY, "logit_lens")
    monkeypatch.delitem(RESULTS, "logit_lens")
    assert not dict.__contains__(REGISTRY, "logit_lens")  # (`in` sees every built-in kind)
    back = tk.Result.load(tmp_path / "r")
    assert type(back) is tk.LogitLensResult and isinstance(back.config, tk.LogitLens)
    assert REGISTRY["logit_lens"] is tk.LogitLens and RESULTS["logit_lens"] is tk.LogitLensResult


def test_unknown_kinds_are_not_found():
    from tracekit.results import RESULTS, experiment_class

    assert REGISTRY.get("no_such_kind") is None and RESULTS.get("no_such_kind") is None
    assert experiment_class(None) is None
    with pytest.raises(KeyError):
        REGISTRY["no_such_kind"]


def _type_checking_names(path) -> set[str]:
    """The names the ``if TYPE_CHECKING:`` block of a package face imports."""
    import ast

    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom):
                    names |= {a.asname or a.name for a in imp.names}
    return names


def test_one_kinds_table_registers_every_kind():
    """tracekit.core.kinds.BUILTIN_KINDS is the one registration place: the lazy exports and ``__all__``
    of tracekit and tracekit.experiments are generated from it, and their TYPE_CHECKING blocks (for
    type checkers) name the same classes."""
    from pathlib import Path

    import tracekit.experiments as X
    from tracekit.core.kinds import BUILTIN_KINDS, KIND_MODULE_NAMES, package_exports

    root = Path(tk.__file__).parent
    for kind, e in BUILTIN_KINDS.items():
        cls = REGISTRY[kind]
        assert (cls.__name__, cls.result_class.__name__) == (e.experiment, e.result), kind
        for name in (e.experiment, e.result):
            assert getattr(X, name) is getattr(tk, name) and name in X.__all__ and name in tk.__all__, name
    for name, (_, at_root) in KIND_MODULE_NAMES.items():
        assert name in X.__all__ and (name in tk.__all__) == at_root, name
    assert set(package_exports()) <= _type_checking_names(root / "__init__.py")
    assert set(X._LAZY) <= _type_checking_names(root / "experiments" / "__init__.py")
