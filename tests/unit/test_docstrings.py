"""Every public docstring parses as the docs build reads it (griffe, Google style, unknown
parameters warned): `mkdocs build --strict` fails on any such warning, and this finds it in seconds
during `make test` instead of at the end of CI."""

from __future__ import annotations

import logging
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parents[2]


def _public(obj, out: list) -> None:
    for name, member in obj.members.items():
        if name.startswith("_") or member.is_alias:
            continue
        if member.is_function or member.is_class:
            out.append(member)
        if member.is_class or member.is_module:
            _public(member, out)


def test_public_docstrings_parse_without_warnings(caplog):
    pkg = griffe.load("tracekit", search_paths=[str(ROOT)], docstring_parser="google",
                      docstring_options={"warn_missing_types": False, "warn_unknown_params": True})
    objs: list = []
    _public(pkg, objs)
    assert len(objs) > 200  # the walk reached the package (hundreds of public functions and classes)
    with caplog.at_level(logging.WARNING):
        for obj in objs:
            if obj.docstring is not None:
                obj.docstring.parse("google", warn_missing_types=False, warn_unknown_params=True)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warned, "docstrings the docs build refuses (fix the Args entries):\n" + "\n".join(warned)
