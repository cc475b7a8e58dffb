"""benchmarks/gpu_check.py --quick on the CPU (what CI runs): it finishes, its CUDA parts are skipped
with a reason in the JSON, and its CPU-vs-CPU comparisons and forced out-of-memory halving pass.

A subset of kinds keeps this test short; every kind's run is covered by tests/integration/test_kinds.py,
and ``python benchmarks/gpu_check.py --quick --out DIR`` runs them all (about 1.5 min on 2 cores)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from helpers import ROOT

KINDS = ["logit_lens", "activation_patching", "direct_logit_attribution"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("gpu_check")
    threads = torch.get_num_threads()
    try:
        rc = mod.main(["--quick", "--out", str(out), "--kinds", ",".join(KINDS)])
    finally:
        torch.set_num_threads(threads)
        mod.QUICK["on"] = False
    return rc, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_quick_passes_and_writes_both_outputs(quick_run):
    rc, doc, md = quick_run
    bad = [r for r in doc["records"] if r["status"] in ("fail", "error")]
    assert rc == 0 and not bad, bad
    assert md.splitlines()[2].startswith("| section | check |")
    assert f"{doc['counts']['pass']} passed" in md
    assert doc["tolerances"]["float32"]["logit"] == [1e-3, 1e-3]


def test_cuda_parts_are_skipped_with_a_reason(quick_run):
    _, doc, _ = quick_run
    cuda = [r for r in doc["records"] if str(r["device"]).startswith("cuda")]
    assert {r["section"] for r in cuda} >= {"kinds", "oom", "timing"}
    for r in cuda:
        assert r["status"] == "skip" and ("CUDA" in r["detail"] or "--quick" in r["detail"]), r
    for section, check in [("ray", "GPU actor"), ("devices", "cuda:N"), ("devices", "n_devices=2")]:
        (r,) = [r for r in doc["records"] if (r["section"], r["check"]) == (section, check)]
        assert r["status"] == "skip" and r["detail"], r
    assert doc["machine"]["cuda_skipped"]


def test_cpu_vs_cpu_comparisons_pass(quick_run):
    _, doc, _ = quick_run
    rep = [r for r in doc["records"] if r["section"] == "kinds" and r["detail"].startswith("repeat:")]
    assert sorted(r["check"] for r in rep) == sorted(KINDS)
    for r in rep:
        assert r["status"] == "pass" and r["data"]["compared"] > 0 and not r["data"]["outside"], r


def test_forced_oom_halves_and_keeps_the_numbers(quick_run):
    _, doc, _ = quick_run
    (r,) = [r for r in doc["records"] if r["section"] == "oom" and r["device"] == "cpu"]
    assert r["status"] == "pass" and r["data"]["halvings"] >= 1 and r["data"]["max_abs_diff"] <= 1e-4, r


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are checked where CUDA is absent")
def test_absent_devices_are_refused_by_field(quick_run):
    _, doc, _ = quick_run
    got = {r["check"]: r for r in doc["records"] if r["section"] == "devices"}
    assert got["auto"]["status"] == "pass"
    assert got["model.device refused"]["status"] == "pass"
    assert got["model.n_devices refused"]["status"] == "pass"
