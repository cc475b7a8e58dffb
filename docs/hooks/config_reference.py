"""MkDocs hook: regenerate ``docs/reference/config.md`` from the schemas before every build.

An undocumented config field fails the build (the generator's message lists the fields). Set
``TRACEKIT_DOCS_ALLOW_UNDOCUMENTED=1`` to preview the site anyway (the fields are marked
"undocumented" on the page).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mkdocs.exceptions import PluginError

_GEN = Path(__file__).resolve().parents[1] / "gen_config_reference.py"


def on_pre_build(config, **kwargs):
    spec = importlib.util.spec_from_file_location("gen_config_reference", _GEN)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text, missing = gen.generate()
    if missing and os.environ.get("TRACEKIT_DOCS_ALLOW_UNDOCUMENTED") != "1":
        raise PluginError("undocumented config fields (add Field(description=...) or a 'Fields:' docstring "
                          "entry): " + ", ".join(missing))
    out = Path(config["docs_dir"]) / "reference" / "config.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        out.write_text(text, encoding="utf-8")
