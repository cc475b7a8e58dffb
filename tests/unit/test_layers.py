"""The package is layered: no module imports a module of a higher layer (docs/design.md, "Map").

Every ``import``/``from ... import`` of a tracekit module is read from the source (at module top
*and* inside functions, so a hidden import cannot hide an upward edge). A module may import its
own layer or lower ones. ``tracekit/core`` imports nothing else of tracekit.
"""

from __future__ import annotations

import ast
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
     "tracekit.sae", "tracekit.probing", "tracekit.activations", "tracekit.trace", "tracekit.verify", "tracekit.results"),
    ("tracekit.experiments",),
    ("tracekit.runner", "tracekit.pipeline", "tracekit.config", "tracekit.sweep", "tracekit.export", "tracekit.activations_cli"),
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


def imports_of(path: Path, mod: str | None = None) -> list[tuple[str, int]]:
    """Absolute tracekit modules ``path`` (module ``mod``) imports (``from . import x`` counts as ``pkg.x``)."""
    mod = mod or _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("tracekit")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
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
