"""The package is layered: no module imports a module of a higher layer (docs/design.md, "Map").

Every ``import``/``from ... import`` of a tracekit module is read from the source (at module top
*and* inside functions, so a hidden import cannot hide an upward edge). A module may import its
own layer or lower ones. ``tracekit/core`` imports nothing else of tracekit.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "tracekit"

#: Lowest first. A module's layer is the first prefix (of its dotted name) found here.
LAYERS: list[tuple[str, ...]] = [
    ("tracekit.core", "tracekit.errors", "tracekit.compat"),  # compat: TL 3.9/4.x + optional SAELens; tracekit.errors: the old path of core.errors (a re-export)
    ("tracekit.model",),
    ("tracekit.tokens", "tracekit.hooks", "tracekit.dataset", "tracekit.metrics", "tracekit.fastpath", "tracekit.corpus",
     "tracekit.resources", "tracekit.scratch", "tracekit.plotting", "tracekit.inputs", "tracekit.units"),
    ("tracekit.logit_lens", "tracekit.dla", "tracekit.attention", "tracekit.attention_tables", "tracekit.neurons",
     "tracekit.neuron_tables", "tracekit.patching",
     "tracekit.circuits", "tracekit.lenses", "tracekit.steering", "tracekit.causal_tracing",
     "tracekit.sae", "tracekit.dictionaries", "tracekit.graphs", "tracekit.probing", "tracekit.activations", "tracekit.trace", "tracekit.verify", "tracekit.results"),
    ("tracekit.experiments",),
    ("tracekit.runner", "tracekit.pipeline", "tracekit.config", "tracekit.sweep", "tracekit.export", "tracekit.activations_cli",
     "tracekit.cache_cli"),
    ("tracekit.cli", "tracekit.__main__", "tracekit"),  # the package root re-exports everything
]
#: Compatibility shims: old module paths re-exporting a lower module.
SHIMS = {"tracekit.errors"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer(mod: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if mod == p or mod.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    if best is None:
        raise AssertionError(f"{mod} is in no layer: add it to LAYERS in tests/unit/test_layers.py")
    return best[0]


def _from_target(node: ast.ImportFrom, pkg: str) -> str:
    """The absolute module a ``from ... import`` reads (relative levels resolved against ``pkg``)."""
    if not node.level:
        return node.module or ""
    base = pkg.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(path: Path, mod: str | None = None) -> list[tuple[str, int]]:
    """Absolute tracekit modules ``path`` (module ``mod``) imports (``from . import x`` counts as ``pkg.x``)."""
    mod = mod or _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("tracekit")]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, pkg)
            if not target.startswith("tracekit"):
                continue
            if node.module is None or (PKG.parent / target.replace(".", "/")).is_dir():
                # from pkg import sub: each name may be a submodule
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    is_mod = (PKG.parent / (sub.replace(".", "/") + ".py")).exists() or \
                        (PKG.parent / sub.replace(".", "/")).is_dir()
                    out.append((sub if is_mod else target, node.lineno))
            else:
                out.append((target, node.lineno))
    return out


MODULES = sorted(PKG.rglob("*.py"))


def test_every_module_has_a_layer():
    for p in MODULES:
        layer(_module_name(p))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG.parent)))
def test_no_upward_import(path):
    mod = _module_name(path)
    if mod in SHIMS:
        return
    mine = layer(mod)
    bad = [f"line {ln}: {target} (layer {layer(target)})" for target, ln in imports_of(path)
           if layer(target) > mine and not mod.startswith(target + ".")]
    assert not bad, f"{mod} (layer {mine}) imports upward: {bad}"


def test_core_imports_nothing_else_of_tracekit():
    for p in (PKG / "core").rglob("*.py"):
        outside = [t for t, _ in imports_of(p) if not t.startswith("tracekit.core")]
        assert not outside, f"{p.name} imports {outside}"


def test_the_checker_catches_an_upward_import(tmp_path):
    """The tests above can fail: a core module importing a kind inside a function is caught."""
    assert layer("tracekit.dla") < layer("tracekit.experiments.dla")
    assert layer("tracekit.core.sites") < layer("tracekit.model.load") < layer("tracekit.tokens")
    p = tmp_path / "paths.py"
    p.write_text((PKG / "core" / "paths.py").read_text() + "\n\ndef f():\n    from ..experiments import base\n")
    found = imports_of(p, "tracekit.core.paths")
    assert ("tracekit.experiments.base", found[-1][1]) in found
    assert layer("tracekit.experiments.base") > layer("tracekit.core.paths")


def test_model_state_is_the_one_attribute_tracekit_writes_on_a_model():
    """What tracekit keeps on a loaded model lives in ``ModelState`` (``state_of(model)``); the only
    other keys written into a model's ``__dict__`` are the two spec attributes a ``ModelInfo`` has too
    (set in ``wrap_hf_model``) and the loader's markers on the transformers model (``tracekit.model``)."""
    import re

    allowed = {"tracekit/model/load.py": {"tracekit_spec", "tracekit_requested_spec", "_tracekit_wrapped",
                                          "_tracekit_cache_entry"},
               "tracekit/model/weights_cache.py": {"_tracekit_cache_entry"},
               "tracekit/model/state.py": set()}
    found = []
    for p in MODULES:
        rel = str(p.relative_to(PKG.parent))
        for key in re.findall(r"__dict__\[\s*[\"']([^\"']+)[\"']\s*\]\s*=(?!=)", p.read_text()):
            if key not in allowed.get(rel, set()):
                found.append(f"{rel}: {key}")
    assert not found, found


# -- Gates of the rows restructuring (#37): what docs/design.md promises, counted from the source --------------

def _package(mod: str) -> str:
    """The package a module belongs to for the private-import rule: ``tracekit.<first part>``."""
    return ".".join(mod.split(".")[:2])


def private_imports() -> list[str]:
    """Every ``from X import _name`` (or ``from X._mod import y``) that crosses packages.

    A ``_private`` name is shared inside its package only; a name another package needs is public,
    with a docstring. Counts what issue #37's note reports: ``python -c "from tests.unit.test_layers
    import private_imports as f; print(len(f()))"``.
    """
    out = []
    for p in MODULES:
        mod = _module_name(p)
        pkg = mod if p.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _from_target(node, pkg)
            if not target.startswith("tracekit") or _package(target) == _package(mod):
                continue
            for a in node.names:
                parts = f"{target}.{a.name}".split(".")[1:]
                if any(s.startswith("_") and not s.startswith("__") for s in parts):
                    out.append(f"{mod}:{node.lineno} from {target} import {a.name}")
    return out


def untyped_model_params() -> list[str]:
    """Every function parameter named ``model`` without an annotation (the type is
    :class:`tracekit.model.info.HookedModel`, or the union a function accepts)."""
    out = []
    for p in MODULES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                out += [f"{p.relative_to(PKG.parent)}:{node.lineno} {node.name}" for a in args
                        if a.arg == "model" and a.annotation is None]
    return out


def pyright_opt_outs() -> list[str]:
    """Files that switch pyright categories off at their top (``# pyright: report...=false``)."""
    return [str(p.relative_to(PKG.parent)) for p in MODULES
            if any(line.startswith("# pyright:") for line in p.read_text().splitlines()[:5])]


def test_no_private_name_imported_across_packages():
    bad = private_imports()
    assert not bad, "a _private name crosses packages (make it public, with a docstring):\n" + "\n".join(bad)


def test_every_model_parameter_is_typed():
    bad = untyped_model_params()
    assert not bad, "untyped `model` parameters (model: HookedModel):\n" + "\n".join(bad)


def test_no_file_switches_pyright_categories_off():
    bad = pyright_opt_outs()
    assert not bad, f"file-level pyright opt-outs (type the code instead): {bad}"


def test_long_modules_say_why():
    """No module over ~600 lines without a reason at its top (docs/design.md, Conventions)."""
    bad = []
    for p in MODULES:
        text = p.read_text()
        if text.count("\n") > 600 and "over 600 lines" not in "\n".join(text.splitlines()[:30]).lower():
            bad.append(f"{p.relative_to(PKG.parent)} ({text.count(chr(10))} lines)")
    assert not bad, f"modules over 600 lines without a reason in their first 30 lines: {bad}"


def test_the_gates_can_fail(tmp_path, monkeypatch):
    """Each gate catches its fault on a planted module."""
    planted = tmp_path / "tracekit" / "zz_planted.py"
    planted.parent.mkdir()
    planted.write_text("# pyright: reportArgumentType=false\nfrom tracekit.tokens import _tok\n\n\n"
                       "def f(model):\n    return model\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", [planted])
    monkeypatch.setattr(sys.modules[__name__], "PKG", planted.parent)
    assert private_imports() == ["tracekit.zz_planted:2 from tracekit.tokens import _tok"]
    assert untyped_model_params() == ["tracekit/zz_planted.py:5 f"]
    assert pyright_opt_outs() == ["tracekit/zz_planted.py"]
