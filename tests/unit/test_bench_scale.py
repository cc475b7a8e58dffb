"""benchmarks/bench_scale.py's arithmetic: the growth-exponent fit, the flagging of a kind that grows
faster than its method must, the "what fits" extrapolation and the job plan (no model is run)."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from helpers import ROOT


@pytest.fixture(scope="module")
def bs():
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "benchmarks" / "bench_scale.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_fit_exponent_recovers_power_laws(bs):
    xs = [8, 16, 32, 64]
    assert bs.fit_exponent(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert bs.fit_exponent(xs, [0.5 * x**2 for x in xs]) == pytest.approx(2.0)
    assert bs.fit_exponent(xs, [7.0] * 4) == pytest.approx(0.0)
    assert bs.fit_exponent([8], [1.0]) is None and bs.fit_exponent([8, 8], [1.0, 2.0]) is None
    assert bs.fit_exponent([8, 16, 32], [0.0, 2.0, 4.0]) == pytest.approx(1.0)  # a non-positive value is dropped


def _pt(kind, axis, x, seconds, work, **kw):
    p = {"kind": kind, "axis": axis, "model": "smollm2-135m", "dtype": "float32", "ok": True, "rows": 1,
         "length": 16, "tokens": 16, "params": 135e6, "bytes_per_param": 4, "seconds": seconds,
         "work_bytes": work, "base_bytes": int(1.5e9), **kw}
    p[{"rows": "rows", "length": "tokens", "model": "params"}[axis]] = x
    return p


def test_exponents_flag_only_growth_beyond_the_method(bs):
    mib = 2**20
    pts = [_pt("logit_lens", "length", t, 0.01 * t, 64 * mib * t // 16) for t in (16, 64, 256)]  # linear: fine
    pts += [_pt("attention_pattern", "length", t, 1e-4 * t * t, mib * t * t // 16) for t in (16, 64, 256)]  # T^2: its cost
    pts += [_pt("direct_logit_attribution", "length", t, 1e-4 * t * t, 64 * mib) for t in (16, 64, 256)]  # T^2 time: flagged
    pts += [_pt("activations", "rows", r, 0.1 * r, mib, ) for r in (8, 16, 32)]  # memory under resolution: not fitted
    ex = {(e["kind"], e["axis"]): e for e in bs.exponents(pts)}
    assert ex["logit_lens", "length"]["memory_exponent"] == pytest.approx(1.0, abs=1e-3)
    assert not ex["logit_lens", "length"]["flag"]
    assert ex["attention_pattern", "length"]["expected"] == 2.0 and not ex["attention_pattern", "length"]["flag"]
    dla = ex["direct_logit_attribution", "length"]
    assert dla["time_exponent"] == pytest.approx(2.0, abs=1e-3) and dla["excess"] == pytest.approx(1.0, abs=1e-3)
    assert dla["flag"]
    assert ex["activations", "rows"]["memory_exponent"] is None and not ex["activations", "rows"]["flag"]


def test_what_fits_extrapolates_the_fits(bs):
    gib = 2**30
    # working memory 1 GiB per row at 16 tokens, linear in rows and tokens; 1.5 GB resident at 135M fp32
    pts = [_pt("edge_attribution", "rows", r, r, r * gib, tokens=16) for r in (1, 2, 4)]
    pts += [_pt("edge_attribution", "length", t, t, gib * t // 16, rows=1) for t in (16, 32, 64)]
    fits = bs.what_fits(pts, bs.exponents(pts), budgets_gb=(24,))
    row = next(f for f in fits if f["model"] == "135M fp32")
    # 24e9 - 1.5e9 bytes left; one row at 128 tokens needs 8 GiB: 2 rows; one row: 16 * 22.5e9 / GiB tokens
    assert row["max_rows"] == 2
    assert row["max_tokens"] == math.floor(16 * (24e9 - 1.5e9) / gib)
    big = next(f for f in fits if f["model"] == "8B bf16")
    assert big["max_rows"] is None  # 16 GB of weights plus one row's 8 GiB x (8B/135M) do not fit
    md = bs.markdown_tables(bs.exponents(pts), fits)
    assert "| edge_attribution | 135M fp32 | 2 |" in md


def test_job_plans(bs):
    ladder = {"rows": [8, 16], "length": [16, 512], "model": ["tiny-random", "smollm2-135m"]}
    per_model = bs.jobs_for(["causal_tracing", "token_trace"], ["rows", "length", "model"], ladder, "model")
    assert [j["model"] for j in per_model] == ["smollm2-135m", "tiny-random"]
    tasks = {(t["kind"], t["axis"]): t["points"] for t in per_model[0]["tasks"]}
    assert ("token_trace", "rows") not in tasks  # one row by design
    assert [p["length"] for p in tasks["causal_tracing", "length"]] == [16]  # capped (quadratic replays)
    quick = bs.jobs_for(["causal_tracing"], ["rows"], ladder, "model", bs.QUICK_LADDER)
    assert [p["rows"] for p in quick[0]["tasks"][0]["points"]] == bs.QUICK_LADDER["causal_tracing"]["rows"]
    per_point = bs.jobs_for(["logit_lens"], ["rows"], ladder, "point")
    assert len(per_point) == 2 and all(len(j["tasks"][0]["points"]) == 1 for j in per_point)
