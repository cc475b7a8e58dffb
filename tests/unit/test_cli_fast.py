"""The torch-free CLI paths (issue #24 "The CLI", #25 "Start-up"): ``tracekit --help``, ``kinds [KIND]``
and ``validate --schema-only`` import neither torch nor TransformerLens (checked in a subprocess), read
the generated schema (``tracekit/data/kinds_schema.json``, in sync with the kinds), and the schema's
verdicts never contradict the pydantic classes (a config the classes accept is accepted)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from helpers import KIND_DATASET_EXAMPLES, KIND_EXAMPLES
from tracekit.cli import PLUGIN_COMMANDS, _parser, main
from tracekit.config import ConfigError, _unannotate, kinds_schema, parse_config
from tracekit.core import schema_check
from tracekit.core.yamlconf import load_raw
from tracekit.experiments import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
REGEN = 'python -c "import tracekit.config as c; c.write_kinds_schema()"'


def _fresh_schema() -> dict:
    data = schema_check.load_schema()
    assert data is not None, f"tracekit/data/kinds_schema.json is out of date: regenerate it with {REGEN}"
    return data


def test_schema_file_in_sync_with_the_kinds():
    """The shipped file equals what the classes give now (else the fast paths fall back to importing)."""
    live = json.loads(json.dumps(kinds_schema()))
    shipped = json.loads(schema_check.SCHEMA_FILE.read_text())
    assert shipped == live, f"tracekit/data/kinds_schema.json is out of date: regenerate it with {REGEN}"
    assert set(shipped["kinds"]) == set(REGISTRY)


def test_field_rows_match_the_config_reference():
    """`tracekit kinds KIND` shows the rows of docs/reference/config.md (docs/gen_config_reference.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_ref", ROOT / "docs" / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rows = kinds_schema()["kinds"]
    for kind, cls in REGISTRY.items():
        docs = gen.docstring_fields(cls)
        for row, (name, f) in zip(rows[kind]["fields"], cls.model_fields.items(), strict=True):
            assert row["name"] == name
            # the docs page keeps nested Annotated[T, <validator at 0x...>] (an address that changes per run)
            assert row["type"] == _unannotate(gen._type_name(f.annotation))
            assert row["default"] == gen._default(f).strip("`").replace("**required**", "required")
            assert row["constraints"] == gen._constraints(f)
            assert row["description"] == (f.description or docs.get(name) or gen.COMMON.get(name) or "")


def _no_heavy_imports(args: list[str]) -> dict:
    code = textwrap.dedent(f"""
        import json, sys
        from tracekit.cli import main
        try:
            rc = main({args!r})
        except SystemExit as e:
            rc = e.code
        heavy = sorted(m for m in ("torch", "transformer_lens", "transformers", "sae_lens") if m in sys.modules)
        sys.stderr.write("\\nRESULT " + json.dumps({{"rc": rc, "heavy": heavy}}) + "\\n")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    line = [x for x in r.stderr.splitlines() if x.startswith("RESULT ")]
    assert line, r.stderr[-2000:]
    return {**json.loads(line[-1][7:]), "out": r.stdout, "err": r.stderr}


@pytest.mark.parametrize("args", [["--help"], ["kinds"], ["kinds", "logit_lens"], ["kinds", "logit_lenz"],
                                  ["validate", "--schema-only", "experiments/paris_logit_lens_smollm2.yaml"],
                                  ["validate", "--help"]])
def test_fast_commands_import_no_torch(args):
    """--help, kinds and validate --schema-only: neither torch nor TransformerLens (nor transformers)."""
    if args[0] in ("kinds", "validate"):
        _fresh_schema()
    r = _no_heavy_imports(args)
    assert r["heavy"] == [], r
    assert r["rc"] == (2 if args == ["kinds", "logit_lenz"] else 0), r
    if args == ["--help"]:
        for name in [*PLUGIN_COMMANDS, "run", "validate", "kinds", "show"]:
            assert name in r["out"]


def test_kinds_lists_every_kind_and_every_field(capsys):
    """`tracekit kinds` names each kind; `tracekit kinds KIND` prints each field with its type, default
    and description, for every registered kind."""
    schema = kinds_schema()
    assert main(["kinds"]) == 0
    out = capsys.readouterr().out
    for kind in REGISTRY:
        assert f"\n{kind} " in "\n" + out
    for kind, cls in REGISTRY.items():
        assert main(["kinds", kind]) == 0
        out = capsys.readouterr().out
        text = " ".join(out.split())
        assert out.startswith(f"kind: {kind}  ({cls.__name__})")
        for row in schema["kinds"][kind]["fields"]:
            assert f"  {row['name']}: {row['type']}  (" in out, (kind, row["name"])
            assert row["default"] in out
            assert row["description"], f"{kind}.{row['name']} is undocumented"
            words = " ".join(row["description"].replace("``", "").split())[:30]
            assert words.split(":")[0][:20] in text, (kind, row["name"])


def test_unknown_kind_names_close_matches(capsys):
    assert main(["kinds", "logit_lense"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment kind 'logit_lense'" in err and "did you mean 'logit_lens'" in err


BAD3 = """
model: {name: smollm2-135m, dtyp: float32}
experiments:
  - {kind: logit_lens, name: lens, prompts: "The capital of France is", target: " Paris", top_kk: 5}
  - {kind: direct_logit_attribution, name: dla, prompts: ["The capital of France is"], target: " Paris", top_k: 0}
  - {kind: logit_lenz, name: third}
"""


@pytest.mark.parametrize("schema_only", [True, False])
def test_validate_lists_every_error_in_one_pass(tmp_path, capsys, schema_only):
    """Three bad steps (and a bad model key): all four reported, each with its step, field and fix; exit 2."""
    p = tmp_path / "bad.yaml"
    p.write_text(BAD3)
    assert main(["validate", str(p)] + (["--schema-only"] if schema_only else [])) == 2
    err = capsys.readouterr().err
    assert "model.dtyp" in err and "did you mean 'dtype'" in err
    assert "experiments[0].top_kk (step 'lens', kind logit_lens)" in err and "did you mean 'top_k'" in err
    assert "experiments[1].top_k (step 'dla', kind direct_logit_attribution)" in err
    assert ">= 1" in err or "greater than or equal to 1" in err
    assert "experiments[2].kind (step 'third', kind logit_lenz)" in err and "did you mean 'logit_lens'" in err


def _mutations(kind: str, example: dict):
    """Small edits of a valid step: an unknown key, a missing field, wrong types, out-of-range numbers."""
    yield {**example, "not_a_field": 1}
    for k in example:
        yield {x: v for x, v in example.items() if x != k}
    for k, v in example.items():
        for bad in (-1, 0, 10**9, "text", [1, "a"], {"a": 1}, None, True, 2.5):
            if bad != v:
                yield {**example, k: bad}
    for name in REGISTRY[kind].model_fields:
        if name not in example and name not in ("kind", "name", "expect"):
            for bad in (-1, 0, "zz", [], None):
                yield {**example, name: bad}


def test_schema_check_never_refuses_what_the_classes_accept():
    """Differential: every example config passes the fast check; on hundreds of edits of them, whenever the
    fast check reports a problem, pydantic refuses the config too (no false alarm), and an unknown key or
    kind is caught by both."""
    schema = kinds_schema()
    n = caught = 0
    for kind, example in KIND_EXAMPLES.items():
        ok = {"experiments": [{"kind": kind, **copy.deepcopy(example)}]}
        assert schema_check.check_raw(ok, schema) == [], kind
        for step in _mutations(kind, example):
            raw = {"experiments": [{"kind": kind, **copy.deepcopy(step)}]}
            fast = schema_check.check_raw(raw, schema)
            try:
                parse_config(copy.deepcopy(raw))
                slow = None
            except ConfigError as e:
                slow = str(e)
            except (TypeError, ValueError) as e:  # a kind's validator crashing on a bad value refuses it too
                slow = f"{type(e).__name__}: {e}"
            n += 1
            if fast:
                caught += 1
                assert slow is not None, (kind, step, fast)
            if "not_a_field" in step:
                assert fast and slow, kind
    assert n > 300 and caught > n // 4, (n, caught)
    for kind, example in KIND_DATASET_EXAMPLES.items():  # the dataset forms of the kinds pass too
        assert schema_check.check_raw({"experiments": [{"kind": kind, **copy.deepcopy(example)}]}, schema) == [], kind


def test_shipped_configs_pass_the_fast_check():
    """Every shipped config the classes accept passes the fast check (a sweep's base config included)."""
    schema = kinds_schema()
    n = 0
    for p in sorted((ROOT / "experiments").glob("*.yaml")):
        raw = load_raw(p)
        raw.pop("sweep", None)
        try:
            parse_config(copy.deepcopy(raw))
        except ConfigError:
            continue  # e.g. a kind registered by a module not imported here
        n += 1
        assert schema_check.check_raw(raw, schema) == [], p.name
    assert n >= 5


def test_plugin_commands_help_matches_their_modules():
    """The help text `tracekit --help` lists for a lazily imported command equals the module's own."""
    for name, (module, help_text) in PLUGIN_COMMANDS.items():
        real: Any = _parser([name])._subparsers._group_actions[0]  # type: ignore[union-attr]
        helps = {a.dest: a.help for a in real._choices_actions}
        assert helps[name] == help_text, f"PLUGIN_COMMANDS[{name!r}] help differs from {module}'s"


def test_stale_schema_is_not_believed(tmp_path, monkeypatch):
    """A schema whose recorded source hashes differ from the files is ignored (callers use the classes)."""
    data = json.loads(schema_check.SCHEMA_FILE.read_text())
    first = next(iter(data["sources"]))
    data["sources"][first] = "0" * 16
    p = tmp_path / "kinds_schema.json"
    p.write_text(json.dumps(data))
    assert schema_check.load_schema(p) is None
    monkeypatch.setattr(schema_check, "load_schema", lambda *a: None)
    assert main(["kinds", "logit_lens"]) == 0  # falls back to the live classes


def test_python_dash_m_tracekit_is_the_cli():
    """``python -m tracekit`` runs the same command line as the ``tracekit`` script."""
    out = subprocess.run([sys.executable, "-m", "tracekit", "kinds"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "activation_patching" in out.stdout
