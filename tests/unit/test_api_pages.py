"""Every public module has an API reference page (docs/api/<module>.md, written by docs/gen_api.py)
and no page names a module that is gone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gen():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_api"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_every_public_module_has_a_page():
    gen = _gen()
    mods = gen.public_modules()
    assert "tracekit.core.paths" in mods and "tracekit.model.load" in mods
    pages = {p.stem for p in (ROOT / "docs" / "api").glob("*.md")} - {"index"}
    missing = sorted(set(mods) - pages)
    stale = sorted(pages - set(mods))
    assert not missing, f"no API page for {missing}: run python docs/gen_api.py"
    assert not stale, f"API pages for modules that are gone: {stale}: run python docs/gen_api.py"
    index = (ROOT / "docs" / "api" / "index.md").read_text()
    for m in mods:
        assert f"({m}.md)" in index, f"docs/api/index.md does not link {m}: run python docs/gen_api.py"
        assert f"::: {m}" in (ROOT / "docs" / "api" / f"{m}.md").read_text()
