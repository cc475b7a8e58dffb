"""docs/glossary.md is followed: no retired name is used as a config key in experiments/, and no
function or class in tracekit/ takes a retired name or a TransformerLens name with another contract."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tracekit.config import yaml_load

ROOT = Path(__file__).resolve().parents[2]
RETIRED_KEYS = {"answer", "wrong", "incorrect", "positions", "amplify"}
RETIRED_DEFS = {"generic_activation_patch", "direct_logit_attribution", "AttentionPatterns", "HeadError",
                "answer_prob", "answer_log_prob", "resolve_query"}


def _keys(obj, out, in_rows: bool = False):
    """Every key used; a dataset row's ``positions`` (named positions, tracekit.dataset) is not the
    retired ``positions`` of the lens and ablation fields."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not (in_rows and k == "positions"):
                out.add(k)
            _keys(v, out, in_rows=k == "rows" and isinstance(v, list))
    elif isinstance(obj, list):
        for v in obj:
            _keys(v, out, in_rows)
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "experiments").glob("*.yaml")), ids=lambda p: p.name)
def test_configs_use_the_glossary(path):
    from tracekit.experiments import REGISTRY

    data = yaml_load(path.read_text(), str(path))
    used = _keys({k: v for k, v in data.items() if k != "experiments"}, set()) & RETIRED_KEYS
    for step in data.get("experiments", []):  # a kind whose own field has the name (patching's positions) is not retired
        cls = REGISTRY.get(step.get("kind"))
        own = set(getattr(cls, "model_fields", {})) if cls is not None else set()
        used |= {k for k in _keys(step, set()) & RETIRED_KEYS if not (k in step and k in own)}
    assert not used, f"{path.name} uses retired keys {used} (docs/glossary.md)"
    for step in data.get("experiments", []):
        if step.get("kind") == "logit_lens":
            assert "layers" not in step, "the lens's numbering is layer_convention"


def test_no_retired_or_clashing_names_are_defined():
    found = []
    for f in (ROOT / "tracekit").rglob("*.py"):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            name = getattr(node, "name", None)
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and name in RETIRED_DEFS:
                found.append(f"{f.relative_to(ROOT)}:{node.lineno} {name}")
            if isinstance(node, ast.FunctionDef) and name and name.startswith("get_act_patch_"):
                found.append(f"{f.relative_to(ROOT)}:{node.lineno} {name}")
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name) and (t.id in RETIRED_DEFS or t.id.startswith("get_act_patch_")):
                        found.append(f"{f.relative_to(ROOT)}:{node.lineno} {t.id}")
    assert not found, found


def test_every_kind_is_in_the_glossary():
    from tracekit.experiments.base import REGISTRY

    text = (ROOT / "docs" / "glossary.md").read_text()
    for kind, cls in REGISTRY.items():
        assert f"`{kind}`" in text and f"`{cls.__name__}`" in text, kind
