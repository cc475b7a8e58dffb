"""Write one API reference page per public tracekit module (docs/api/<module>.md) and the index
(docs/api/index.md). Run after adding or renaming a module: ``python docs/gen_api.py``;
``tests/unit/test_api_pages.py`` fails while a public module has no page or a page names a module
that is gone.

A module is public unless a part of its dotted name starts with ``_``; the package faces
(``__init__``) get a page when they define or document something of their own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tracekit"
OUT = ROOT / "docs" / "api"

#: Layer titles, in the order of docs/design.md's map.
GROUPS = [
    ("Core (imports nothing else of tracekit)", ("tracekit.core", "tracekit.compat")),
    ("Model", ("tracekit.model",)),
    ("Running a model", ("tracekit.tokens", "tracekit.hooks", "tracekit.fastpath", "tracekit.metrics",
                         "tracekit.corpus", "tracekit.resources", "tracekit.scratch", "tracekit.plotting",
                         "tracekit.inputs", "tracekit.units", "tracekit.errors")),
    ("Method engines", ("tracekit.logit_lens", "tracekit.dla", "tracekit.attention", "tracekit.neurons",
                        "tracekit.patching", "tracekit.circuits", "tracekit.lenses", "tracekit.steering",
                        "tracekit.causal_tracing", "tracekit.sae", "tracekit.dictionaries", "tracekit.graphs", "tracekit.probing", "tracekit.activations", "tracekit.trace",
                        "tracekit.verify")),
    ("Results and experiment kinds", ("tracekit.results", "tracekit.experiments")),
    ("Runs, pipelines, sweeps, CLI", ("tracekit.runner", "tracekit.pipeline", "tracekit.config", "tracekit.sweep",
                                      "tracekit.export", "tracekit.activations_cli", "tracekit.cli")),
]


def public_modules() -> list[str]:
    out = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            if len(parts) == 1:
                continue  # the package root: the API page's own index says what it exports
        if any(x.startswith("_") for x in parts) or parts[-1] == "__main__":
            continue
        out.append(".".join(parts))
    return out


def _summary(mod: str) -> str:
    p = PKG.parent / (mod.replace(".", "/") + ".py")
    if not p.exists():
        p = PKG.parent / mod.replace(".", "/") / "__init__.py"
    doc = ast.get_docstring(ast.parse(p.read_text())) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _is_face(mod: str) -> bool:
    """A package's ``__init__`` or a compatibility path: its members are documented where they live."""
    return (PKG.parent / mod.replace(".", "/")).is_dir() or mod in SHIMS


#: Old module paths kept as re-exports.
SHIMS = {"tracekit.errors"}


def page(mod: str) -> str:
    members = "      members: false\n" if _is_face(mod) else "      members_order: source\n"
    return (f"# `{mod}`\n\n"
            f"::: {mod}\n"
            "    options:\n"
            "      show_root_heading: false\n"
            "      show_submodules: false\n" + members)


def group_of(mod: str) -> str:
    best = ("Other", 0)
    for title, prefixes in GROUPS:
        for pre in prefixes:
            if (mod == pre or mod.startswith(pre + ".")) and len(pre) > best[1]:
                best = (title, len(pre))
    return best[0]


def index(mods: list[str]) -> str:
    lines = ["# API reference", "",
             "One page per public module, generated from the docstrings (`python docs/gen_api.py`). The "
             "experiment kinds are documented field by field in the [configuration reference](../reference/config.md); "
             "the layers are described in the [design notes](../design.md).", ""]
    for title, _ in GROUPS + [("Other", ())]:
        members = [m for m in mods if group_of(m) == title]
        if not members:
            continue
        lines += [f"## {title}", ""]
        for m in members:
            lines.append(f"- [`{m}`]({m}.md): {_summary(m)}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    mods = public_modules()
    for old in OUT.glob("*.md"):
        if old.stem not in mods and old.name != "index.md":
            old.unlink()
    for m in mods:
        (OUT / f"{m}.md").write_text(page(m))
    (OUT / "index.md").write_text(index(mods))
    print(f"wrote {len(mods)} module pages to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
