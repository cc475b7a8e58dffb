"""The README's notebook snippets (and the docs' ```python blocks marked runnable) run as tests.

They run as written except that ``tk.load_model()`` (the embedded model) is replaced by a tiny
random model of the same interface, so the check is fast; the acceptance tier runs the real model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import make_tiny

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [b for b in BLOCK.findall(text) if "# not run" not in b]


README_BLOCKS = _blocks(ROOT / "README.md")


@pytest.mark.parametrize("code", README_BLOCKS, ids=[f"readme-{i}" for i in range(len(README_BLOCKS))])
def test_readme_python_blocks_run(code, monkeypatch, tmp_path):
    import matplotlib.pyplot as plt

    import tracekit as tk

    tiny = make_tiny("llama")
    real = tk.load_model
    monkeypatch.setattr(tk, "load_model", lambda spec=None, **kw: tiny if spec is None and not kw else real(spec, **kw))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    plt.close("all")


def test_readme_has_python_examples():
    assert README_BLOCKS, "README.md should show notebook use"
