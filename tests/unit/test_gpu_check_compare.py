"""benchmarks/gpu_check.py's comparison logic: numbers within tolerance pass, a number moved past
its tolerance fails (float32 tight, bfloat16 loose), missing numbers fail, invariants have ceilings."""

from __future__ import annotations

import copy

import pytest

from helpers import load_gpu_check


@pytest.fixture(scope="module")
def gc_mod():
    return load_gpu_check()


LENS = {"mean_entropy_by_hidden_state": [3.5, 2.25, 1.0], "mean_target_prob_by_hidden_state": [0.01, 0.2, 0.6],
        "target_prob_final_by_row": [0.6, 0.5], "hooks": ["a", "b"], "share_rows_emerged": 1.0}


def test_leaves_and_pick(gc_mod):
    s = {"a": {"b": [1, 2.5, None, "x", True]}, "c": 3}
    assert gc_mod.leaves(s) == {"a.b[0]": 1.0, "a.b[1]": 2.5, "c": 3.0}
    assert gc_mod.pick(s, "a.b") == [1, 2.5, None, "x", True]
    with pytest.raises(KeyError):
        gc_mod.pick(s, "a.z")


def test_identical_summaries_pass(gc_mod):
    ok, detail, data = gc_mod.compare_summaries("logit_lens", LENS, copy.deepcopy(LENS), "float32")
    assert ok, detail
    assert data["compared"] == 8 and not data["outside"]


@pytest.mark.parametrize(("shift", "dtype", "ok"), [
    (5e-4, "float32", True),    # within atol 1e-3 + rtol 1e-3 * 2.25
    (5e-3, "float32", False),   # past it
    (5e-3, "bfloat16", True),   # bfloat16's tolerance is looser (0.3 + 0.05 * 2.25)
    (0.5, "bfloat16", False),
])
def test_a_moved_logit_scale_number_is_caught(gc_mod, shift, dtype, ok):
    other = copy.deepcopy(LENS)
    other["mean_entropy_by_hidden_state"][1] += shift
    got, detail, data = gc_mod.compare_summaries("logit_lens", LENS, other, dtype)
    assert got is ok, detail
    if not ok:
        assert "mean_entropy_by_hidden_state[1]" in detail


def test_a_moved_probability_is_caught_in_float32(gc_mod):
    other = copy.deepcopy(LENS)
    other["target_prob_final_by_row"][0] = 0.601  # |diff| 1e-3 > 1.1e-6 + 1e-3 * 0.6
    ok, detail, _ = gc_mod.compare_summaries("logit_lens", LENS, other, "float32")
    assert not ok and "target_prob_final_by_row[0]" in detail


def test_missing_numbers_fail(gc_mod):
    other = copy.deepcopy(LENS)
    del other["target_prob_final_by_row"]
    ok, detail, _ = gc_mod.compare_summaries("logit_lens", LENS, other, "float32")
    assert not ok and "missing" in detail
    other = copy.deepcopy(LENS)
    other["target_prob_final_by_row"] = [0.6]  # a row on one side only
    assert not gc_mod.compare_summaries("logit_lens", LENS, other, "float32")[0]
    # in bfloat16 a discrete choice may differ (reported, not failed)
    ok, detail, data = gc_mod.compare_summaries("logit_lens", LENS, other, "bfloat16")
    assert ok and data["one_side"] == ["target_prob_final_by_row[1]"]


def test_nan_on_one_side_fails(gc_mod):
    other = copy.deepcopy(LENS)
    other["mean_entropy_by_hidden_state"][0] = float("nan")
    assert not gc_mod.compare_summaries("logit_lens", LENS, other, "bfloat16")[0]


def test_invariant_ceilings(gc_mod):
    assert gc_mod.check_invariants("direct_logit_attribution", {"max_sum_error": 1e-6, "max_identity_error": 0.0},
                                   "float32") == []
    bad = gc_mod.check_invariants("direct_logit_attribution", {"max_sum_error": 0.01, "max_identity_error": 0.0},
                                  "float32")
    assert len(bad) == 1 and "max_sum_error" in bad[0]
    assert gc_mod.check_invariants("direct_logit_attribution", {"max_sum_error": 0.01, "max_identity_error": 0.0},
                                   "bfloat16") == []
    assert "missing" in gc_mod.check_invariants("steering", {}, "float32")[0]


def test_every_compared_path_uses_a_known_class(gc_mod):
    for kind, paths in gc_mod.COMPARE.items():
        for path, cls in paths:
            for dtype in gc_mod.TOL:
                assert cls in gc_mod.TOL[dtype], (kind, path, cls)
