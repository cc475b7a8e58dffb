"""The config schema without the kinds' code: ``tracekit kinds`` and ``tracekit validate --schema-only``
read a generated file instead of importing the kind classes (which import torch).

``tracekit/data/kinds_schema.json`` is written by :func:`tracekit.config.write_kinds_schema` from the
pydantic classes (the same field rows as ``docs/reference/config.md``: type, default, constraints,
description) plus each class's JSON schema for validation. ``tests/unit/test_cli_schema.py`` fails when
the file is out of date. At run time the file is used only while the source files it was made from are
unchanged (their sha256 is recorded in it; :func:`load_schema` returns ``None`` otherwise), so a stale
file is never believed: the callers then import the kinds (seconds) and use the live classes.

What :func:`check_raw` checks: unknown / retired keys (with close matches), unknown kinds, required
fields, JSON types, enums, numeric bounds, string lengths and patterns, unique step names. It accepts
everything pydantic (lax mode) accepts: fields with a "before" validator are not checked here (they
may convert their input), and a step-reference mapping (``{from: ...}``) matches any field. What only
the kinds' code can check (their validators, the tokenizer) is left to the full ``tracekit validate``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Optional

from . import paths

__all__ = ["SCHEMA_FILE", "load_schema", "source_hashes", "check_raw", "close_matches"]

#: The generated file (package data).
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "data" / "kinds_schema.json"
_PKG_ROOT = Path(__file__).resolve().parents[2]


def source_hashes(files: list[str]) -> dict[str, str]:
    """``path -> sha256`` (first 16 hex digits) of source files, paths relative to the package's
    parent folder (``tracekit/experiments/dla.py``); a missing file hashes to ``"missing"``."""
    out = {}
    for f in sorted(set(files)):
        p = _PKG_ROOT / f
        out[f] = hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "missing"
    return out


def load_schema(path: Path = SCHEMA_FILE) -> Optional[dict]:
    """The generated schema, or ``None`` when it is missing, unreadable or made from source files
    that have changed since (then the caller uses the live classes)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != 1:
        return None
    now = source_hashes(list(data.get("sources", {})))
    if not now or "missing" in now.values() or now != data.get("sources"):
        return None
    return data


def close_matches(word: Any, options, n: int = 3) -> str:
    """``"; did you mean 'a' or 'b'?"`` (empty when nothing is close)."""
    m = difflib.get_close_matches(str(word), list(options), n=n, cutoff=0.6)
    if not m:
        return ""
    return "; did you mean " + " or ".join(repr(x) for x in m) + "?"


# ---- a JSON-schema subset, lenient where pydantic's lax mode converts ------------------------------

_INT_STR = re.compile(r"^\s*[-+]?\d+\s*$")
_BOOL_STR = {"0", "1", "true", "false", "yes", "no", "on", "off", "t", "f", "y", "n"}


def _is_type(v: Any, t: str) -> bool:
    if t == "null":
        return v is None
    if t == "boolean":
        return isinstance(v, bool) or v in (0, 1) or (isinstance(v, str) and v.lower() in _BOOL_STR)
    if t == "integer":
        return (isinstance(v, int) or (isinstance(v, float) and v.is_integer())
                or (isinstance(v, str) and bool(_INT_STR.match(v))))
    if t == "number":
        if isinstance(v, (int, float)):
            return True
        try:
            float(v)
            return isinstance(v, str)
        except (TypeError, ValueError):
            return False
    if t == "string":
        return isinstance(v, str)
    if t == "array":
        return isinstance(v, list)
    if t == "object":
        return isinstance(v, dict)
    return True


def _is_reference(v: Any) -> bool:
    return isinstance(v, dict) and "from" in v and any(k in v for k in ("key", "table", "path"))


def _num(v: Any) -> Optional[float]:
    try:
        return float(v) if not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


class _Checker:
    def __init__(self, defs: dict, hint: str):
        self.defs, self.hint = defs, hint

    def resolve(self, s: dict) -> dict:
        while "$ref" in s:
            s = {**self.defs[s["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in s.items() if k != "$ref"}}
        return s

    def check(self, v: Any, s: dict, at: tuple) -> list[str]:
        if not s or _is_reference(v):
            return []
        s = self.resolve(s)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.any_of(v, s[key], at)
        errs: list[str] = []
        for sub in s.get("allOf", []):
            errs += self.check(v, sub, at)
        if "const" in s and v != s["const"]:
            return errs + [f"{paths.fmt(at)}: must be {s['const']!r} (got {v!r})"]
        if "enum" in s and v not in s["enum"]:
            return errs + [f"{paths.fmt(at)}: must be one of {s['enum']}{close_matches(v, map(str, s['enum']))} "
                           f"(got {v!r})"]
        t = s.get("type")
        if t is not None and not any(_is_type(v, x) for x in ([t] if isinstance(t, str) else t)):
            return errs + [f"{paths.fmt(at)}: expected {_type_word(s)} (got {v!r})"]
        return errs + self.bounds(v, s, at) + self.containers(v, s, at)

    def any_of(self, v: Any, options: list, at: tuple) -> list[str]:
        results = [self.check(v, o, at) for o in options]
        if any(not r for r in results):
            return []
        typed = [r for o, r in zip(options, results) if _type_fits(v, self.resolve(o))]
        if len(typed) == 1:
            return typed[0]
        words = " or ".join(dict.fromkeys(_type_word(self.resolve(o)) for o in options))
        return [f"{paths.fmt(at)}: expected {words} (got {v!r})"]

    def bounds(self, v: Any, s: dict, at: tuple) -> list[str]:
        errs = []
        x = _num(v) if not isinstance(v, (list, dict)) else None
        for key, ok, word in (("minimum", lambda a, b: a >= b, ">="), ("maximum", lambda a, b: a <= b, "<="),
                              ("exclusiveMinimum", lambda a, b: a > b, ">"),
                              ("exclusiveMaximum", lambda a, b: a < b, "<")):
            if key in s and x is not None and not ok(x, s[key]):
                errs.append(f"{paths.fmt(at)}: must be {word} {s[key]} (got {v!r})")
        n = len(v) if isinstance(v, (str, list, dict)) else None
        for key, ok, word in (("minLength", lambda a, b: a >= b, "at least"), ("minItems", lambda a, b: a >= b,
                              "at least"), ("maxLength", lambda a, b: a <= b, "at most"),
                              ("maxItems", lambda a, b: a <= b, "at most")):
            if key in s and n is not None and not ok(n, s[key]):
                what = "characters" if isinstance(v, str) else "items"
                errs.append(f"{paths.fmt(at)}: must have {word} {s[key]} {what} (got {n})")
        if "pattern" in s and isinstance(v, str) and not re.search(s["pattern"], v):
            errs.append(f"{paths.fmt(at)}: must match the pattern {s['pattern']!r} (got {v!r})")
        return errs

    def containers(self, v: Any, s: dict, at: tuple) -> list[str]:
        errs: list[str] = []
        if isinstance(v, list):
            pre = s.get("prefixItems", [])
            for i, x in enumerate(v):
                sub = pre[i] if i < len(pre) else s.get("items", {})
                errs += self.check(x, sub if isinstance(sub, dict) else {}, at + (i,))
        if isinstance(v, dict) and (s.get("type") == "object" or "properties" in s):
            props = s.get("properties", {})
            retired = s.get("x-retired", {})
            for k in s.get("required", []):
                if k not in v:
                    errs.append(f"{paths.fmt(at + (k,))}: required field is missing")
            for k, x in v.items():
                if k in props:
                    errs += self.check(x, props[k], at + (k,))
                elif k in retired:
                    new, _, note = str(retired[k]).partition("; ")
                    errs.append(f"{paths.fmt(at + (k,))}: '{k}' was renamed to '{new}'" + (f" ({note})" if note else ""))
                elif s.get("additionalProperties") is False:
                    errs.append(f"{paths.fmt(at + (k,))}: unknown key{close_matches(k, props)} ({self.hint})")
                elif isinstance(s.get("additionalProperties"), dict):
                    errs += self.check(x, s["additionalProperties"], at + (k,))
        return errs


def _type_fits(v: Any, s: dict) -> bool:
    t = s.get("type")
    if t is None:
        return "const" in s or "enum" in s
    return any(_is_type(v, x) for x in ([t] if isinstance(t, str) else t))


def _type_word(s: dict) -> str:
    t = s.get("type")
    if t == "array":
        return "a list"
    if t == "object":
        return "a mapping"
    if isinstance(t, str):
        return {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true/false",
                "null": "null"}.get(t, t)
    if "enum" in s:
        return f"one of {s['enum']}"
    if "const" in s:
        return repr(s["const"])
    return "a value of another type"


def check_raw(raw: Any, schema: dict) -> list[str]:
    """Every problem of a raw (YAML-loaded) config that the generated schema can see, one line each,
    each starting with its YAML path (``experiments[2].top_k: must be >= 1 (got 0)``); ``[]`` when
    none. Kinds not in the schema are reported by the caller's fallback (``schema["kinds"]`` names
    the known ones)."""
    if not isinstance(raw, dict):
        return ["the top level must be a mapping with 'model' and 'experiments'"]
    problems: list[str] = []
    if "sweep" in raw:
        problems.append("sweep: a config with a sweep block runs with `tracekit sweep CONFIG --out DIR`")
        raw = {k: v for k, v in raw.items() if k != "sweep"}
    run = schema["run"]
    top = _Checker(run.get("$defs", {}), "see the run config in docs/reference/config.md")
    problems += [p for p in top.check({k: v for k, v in raw.items() if k != "experiments"}, run, ())]
    steps = raw.get("experiments")
    if steps is None:
        return problems + ["experiments: required field is missing (a list of steps, each with a 'kind')"]
    if not isinstance(steps, list) or not steps:
        return problems + ["experiments: must be a non-empty list of steps"]
    kinds = schema["kinds"]
    names = []
    for i, step in enumerate(steps):
        at = ("experiments", i)
        if not isinstance(step, dict):
            problems.append(f"{paths.fmt(at)}: must be a mapping with a 'kind'")
            continue
        kind = step.get("kind")
        names.append(step.get("name", kind))
        if kind not in kinds:
            problems.append(f"{paths.fmt(at + ('kind',))}: unknown experiment kind {kind!r}"
                            f"{close_matches(kind, kinds)} (`tracekit kinds` lists them)")
            continue
        s = kinds[kind]["schema"]
        problems += _Checker(s.get("$defs", {}), f"`tracekit kinds {kind}` lists its fields").check(step, s, at)
    dup = sorted({str(n) for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"experiments: step names must be unique, repeated: {dup}; give each step a 'name'")
    return problems
