"""The docs index's method table lists every registered kind, once, with a line on what it computes
and a link to a docs page that exists (issue #36: it listed 6 of the kinds)."""

from __future__ import annotations

import re
from pathlib import Path

from tracekit.core.kinds import BUILTIN_KINDS

ROOT = Path(__file__).resolve().parents[2]


def _kind_rows() -> dict[str, tuple[str, str]]:
    rows: dict[str, tuple[str, str]] = {}
    lines = (ROOT / "docs" / "index.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.replace(" ", "").startswith("|kind|"))
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(\w+)`", cells[0])
        assert m, f"docs/index.md: the first cell of {ln!r} is not a `kind`"
        assert m.group(1) not in rows, f"docs/index.md lists {m.group(1)} twice"
        rows[m.group(1)] = (cells[1], cells[2])
    return rows


def test_index_table_lists_every_registered_kind():
    rows = _kind_rows()
    assert set(rows) == set(BUILTIN_KINDS), (
        f"docs/index.md's kind table: missing {sorted(set(BUILTIN_KINDS) - set(rows))}, "
        f"not registered {sorted(set(rows) - set(BUILTIN_KINDS))}")
    for kind, (what, page) in rows.items():
        assert len(what.split()) >= 5, f"{kind}: say what it computes"
        link = re.fullmatch(r"\[[^\]]+\]\(([\w./-]+?)(#[\w-]+)?\)", page)
        assert link, f"{kind}: the page cell {page!r} is not a Markdown link"
        target = ROOT / "docs" / link.group(1)
        assert target.is_file(), f"{kind}: {target} does not exist"
        assert kind in target.read_text(), f"{kind}: its page {link.group(1)} never names it"
