"""benchmarks/bench_graph.py: the ``--quick`` run (tiny random GPT-2, random transcoders) prints one
line per prompt and the agreed last line; the long prompt has the asked number of tokens and ends
in the Paris question; the figures it prints are those of the engines."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys

import pytest

from helpers import ROOT

LAST = re.compile(r"^graph_s (\d+\.\d+) peak_gib (\d+\.\d+) verify_spearman (-?\d+\.\d+|nan)$")


@pytest.fixture(scope="module")
def bg():
    spec = importlib.util.spec_from_file_location("bench_graph", ROOT / "benchmarks" / "bench_graph.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_graph"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_prints_every_prompt_and_the_last_line(bg, tmp_path, capsys):
    out = tmp_path / "graph.json"
    assert bg.main(["--quick", "--lengths", "paris,24", "--top-k", "3", "--n-random", "2", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    m = LAST.match(lines[-1])
    assert m, lines[-1]
    pts = json.loads(out.read_text())["points"]
    assert [p["prompt"] for p in pts] == ["paris", "24"] and pts[1]["n_tokens"] == 24
    for p in pts:
        assert p["total_s"] >= p["build_s"] > 0 and p["peak_gib"] >= 0
        assert 0 < p["pruned_nodes"] <= p["n_nodes"] and p["n_features"] > 0
        assert p["logits_max_abs_error"] < 1e-3 and p["completeness_max_abs_error"] < 1e-3  # exact by construction
        assert p["replacement_score"] is None or 0 <= p["replacement_score"] <= 1 + 1e-6
    longest = max(pts, key=lambda p: p["n_tokens"])
    assert float(m.group(1)) == pytest.approx(longest["total_s"], abs=0.01)
    assert float(m.group(2)) == pytest.approx(max(p["peak_gib"] for p in pts), abs=0.001)
    sp = [p["spearman"] for p in pts if p["spearman"] is not None and math.isfinite(p["spearman"])]
    if sp:
        assert float(m.group(3)) == pytest.approx(min(sp), abs=0.001)


def test_long_prompt_has_the_asked_length_and_the_question(bg):
    model, _ = bg.quick_setup("cpu")
    from tracekit.tokens import encode

    for n in (24, 100):
        p = bg.long_prompt(model, n)
        assert len(encode(model, p)) == n and p.endswith(bg.TAIL)
