"""The config reference generator (docs/gen_config_reference.py): every field of every kind with type,
default, constraints and description; an undocumented field fails the generation."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import Field

from tracekit.experiments import REGISTRY
from tracekit.experiments.base import Experiment, Result

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docstring_fields_parser():
    class K(Experiment):
        """A kind.

        Fields:
            alpha: first line
                continued.
            beta, gamma: shared text.
        """

        kind: Literal["k_test"] = "k_test"
        alpha: int = 1
        beta: int = 2
        gamma: int = Field(default=3, ge=0)

    d = _gen().docstring_fields(K)
    assert d["alpha"] == "first line continued."
    assert d["beta"] == d["gamma"] == "shared text."


def test_undocumented_field_fails(monkeypatch):
    class Bad(Experiment):
        """A kind whose field has no description."""

        kind: Literal["bad_test"] = "bad_test"
        mystery: int = Field(default=0, ge=0)
        result_class = Result

    gen = _gen()
    monkeypatch.setitem(REGISTRY, "bad_test", Bad)
    text, missing = gen.generate()
    assert "Bad.mystery" in missing
    assert gen.main(["--check"]) == 1


def test_token_trace_fully_documented():
    gen = _gen()
    text, missing = gen.generate()
    assert not [m for m in missing if m.startswith("TokenTrace.")]
    sec = text.split("`kind: token_trace`")[1].split("\n## ")[0]
    for name in REGISTRY["token_trace"].model_fields:
        assert f"| `{name}` |" in sec
    assert "| `top_neurons` | `int` | `5` | >= 1, <= 100 |" in sec
    assert "| `dataset` |" in sec and "| `row` |" in sec  # prompts or one dataset row
    assert "**required**" in text  # required fields are marked (GeneratorSpec.name, Row.prompt...)


def test_every_config_field_is_documented():
    _, missing = _gen().generate()
    assert missing == []


def test_committed_reference_is_current():
    """docs/reference/config.md is committed (linked from the index, quickstart and tutorial, so it must
    exist without a docs build) and equals what the generator writes now."""
    page = ROOT / "docs" / "reference" / "config.md"
    assert page.is_file(), "docs/reference/config.md is missing: run `make schema` (docs/gen_config_reference.py)"
    ignored = [ln.strip() for ln in (ROOT / ".gitignore").read_text().splitlines()]
    assert "docs/reference/config.md" not in ignored, "docs/reference/config.md is committed, not ignored"
    text, _ = _gen().generate()
    assert page.read_text(encoding="utf-8") == text, \
        "docs/reference/config.md is out of date: regenerate it with `make schema` (python docs/gen_config_reference.py)"
