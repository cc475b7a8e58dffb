"""Generate ``docs/reference/config.md`` from the pydantic schemas of every registered kind.

Every field of every kind (and of the nested config models they use, plus the run config and the
model spec) is listed with its type, default, constraints and description. The description is the
field's ``Field(description=...)`` or, failing that, its entry in the class docstring's ``Fields:``
/ ``Attributes:`` section (Google style). A field with neither fails the generation (exit 1, one
line per field), so ``make docs`` / ``mkdocs build`` cannot ship an undocumented key.

Usage::

    python docs/gen_config_reference.py            # writes docs/reference/config.md
    python docs/gen_config_reference.py --check    # only report undocumented fields
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

OUT = Path(__file__).resolve().parent / "reference" / "config.md"

#: The fields every kind inherits from ``Experiment`` (documented once here; the base class's
#: docstring names them).
COMMON = {
    "kind": "The experiment kind (registry name); selects the class.",
    "name": "Step name, unique in a config (default: the kind); names the step's folder in the run directory.",
    "expect": "Reference values checked after the run (list of expectations, see Expectation below).",
}
_SECTION = re.compile(r"^(\s*)(Fields|Attributes|Args)\s*:\s*$")


def docstring_fields(cls: type) -> dict[str, str]:
    """``name -> description`` from the ``Fields:`` / ``Attributes:`` sections of ``cls``'s docstring
    (and its bases'). An entry ``a, b: text`` documents both ``a`` and ``b``."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.getdoc(klass) if klass.__dict__.get("__doc__") else None
        if not doc:
            continue
        lines = doc.splitlines()
        i = 0
        while i < len(lines):
            m = _SECTION.match(lines[i])
            if not m:
                i += 1
                continue
            base = len(m.group(1))
            i += 1
            entry_indent = None
            cur: list[str] = []
            names: list[str] = []

            while i < len(lines):
                line = lines[i]
                if not line.strip():
                    i += 1
                    continue
                ind = len(line) - len(line.lstrip())
                if ind <= base:
                    break
                if entry_indent is None:
                    entry_indent = ind
                em = re.match(r"^([A-Za-z_][\w]*(?:\s*(?:,|/)\s*[A-Za-z_][\w]*)*)\s*(?:\([^)]*\))?\s*:\s*(.*)$",
                              line.strip())
                if ind == entry_indent and em:
                    _flush(out, names, cur)
                    names = [n.strip() for n in re.split(r"[,/]", em.group(1))]
                    cur = [em.group(2)]
                else:
                    cur.append(line)
                i += 1
            _flush(out, names, cur)
    return out


def _flush(out: dict, names: list[str], cur: list[str]) -> None:
    text = " ".join(s.strip() for s in cur).strip()
    for n in names:
        out[n] = text


def _type_name(t) -> str:
    from tracekit.config import _type_name as type_name  # the one renderer (also `tracekit kinds KIND`)

    return type_name(t)


def _default(f) -> str:
    if f.default_factory is not None:
        try:
            return f"`{f.default_factory()!r}`"
        except TypeError:
            return "(computed)"
    if f.default is PydanticUndefined:
        return "**required**"
    return f"`{f.default!r}`"


def _constraints(f) -> str:
    parts = []
    for m in f.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "min length"),
                          ("max_length", "max length"), ("pattern", "pattern")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v}")
    return ", ".join(parts)


def _nested(t, seen: set) -> list[type]:
    out = []
    if isinstance(t, type) and issubclass(t, BaseModel):
        if t not in seen:
            seen.add(t)
            out.append(t)
            for f in t.model_fields.values():
                out += _nested(f.annotation, seen)
        return out
    for a in typing.get_args(t):
        out += _nested(a, seen)
    return out


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def model_section(cls: type, title: str, missing: list[str], common: bool) -> list[str]:
    docs = docstring_fields(cls)
    lines = [f"## {title}", ""]
    summary = (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")
    if summary:
        lines += [summary, ""]
    lines += ["| field | type | default | constraints | description |", "|---|---|---|---|---|"]
    for name, f in cls.model_fields.items():
        desc = f.description or docs.get(name) or (COMMON.get(name) if common else None)
        if not desc:
            missing.append(f"{cls.__name__}.{name}")
            desc = "**undocumented**"
        lines.append(f"| `{name}` | `{_esc(_type_name(f.annotation))}` | {_esc(_default(f))} | "
                     f"{_esc(_constraints(f))} | {_esc(desc)} |")
    retired = getattr(cls, "retired", None)
    if retired:
        lines += ["", "Retired keys (fail with an error naming the new key): "
                  + ", ".join(f"`{k}` -> `{v.split(';')[0]}`" for k, v in retired.items()), ""]
    return lines + [""]


def generate() -> tuple[str, list[str]]:
    """The reference page's Markdown and the undocumented fields (``Class.field``)."""
    from tracekit.config import RunConfig, RunSettings
    from tracekit.experiments import REGISTRY
    from tracekit.model.spec import ModelSpec

    missing: list[str] = []
    out = ["# Configuration reference", "",
           "Generated by `docs/gen_config_reference.py` from the pydantic schemas (do not edit by hand). "
           "A config is a YAML mapping with `model` (a model spec) and `experiments` (a list of steps, each "
           "with a `kind`). Unknown keys are errors; non-finite floats are refused.", ""]
    out += model_section(RunConfig, "Run config (top level)", missing, common=False)
    out += model_section(ModelSpec, "Model spec (`model:`)", missing, common=False)
    out += model_section(RunSettings, "Run settings (`run:`)", missing, common=False)
    seen: set = {RunConfig, ModelSpec, RunSettings}
    nested: list[type] = []
    for kind in sorted(REGISTRY):
        cls = REGISTRY[kind]
        out += model_section(cls, f"`kind: {kind}` ({cls.__name__})", missing, common=True)
        for f in cls.model_fields.values():
            nested += _nested(f.annotation, seen)
    for cls in nested:
        out += model_section(cls, f"{cls.__name__} (nested)", missing, common=False)
    return "\n".join(out).rstrip() + "\n", missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report undocumented fields")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    text, missing = generate()
    if missing:
        print("undocumented config fields (add Field(description=...) or a 'Fields:' docstring entry):",
              file=sys.stderr)
        for m in missing:
            print(f"  {m}", file=sys.stderr)
        return 1
    if not args.check:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
