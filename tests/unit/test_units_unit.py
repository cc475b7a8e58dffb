"""tracekit.units without a model: the verbs, their checks, random controls and the running top-n."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracekit.errors import AttributionError, SAEError
from tracekit.units import (
    RETIRED_VERBS,
    VERBS,
    RunningTop,
    UnitBasis,
    UnitEdit,
    UnitError,
    canonical_verb,
    new_activations,
    random_units,
    steer_vector,
    verb_key,
)


class FakeBasis:
    """A basis of 6 units on a made-up hook (only what the checks read)."""

    name = "fake"
    hook = "blocks.0.hook_fake"
    n_units = 6
    verbs = VERBS

    def check(self, units, field="units"):
        bad = [u for u in units if not 0 <= int(u) < self.n_units]
        if bad:
            raise UnitError(f"{field}: unit {bad[0]} out of range")
        return [int(u) for u in units]

    def activations(self, value):
        return value

    def decoder_rows(self, units):
        return torch.eye(self.n_units)[list(units)]

    def hook_rows(self, units):
        return 2.0 * torch.eye(self.n_units)[list(units)]

    def edit_hook(self, units, edit, add, where, start=None):
        return lambda act, hook=None: act


class ZeroOnly(FakeBasis):
    name = "zero_only"
    verbs = ("zero",)


def test_fake_basis_is_a_unit_basis():
    assert isinstance(FakeBasis(), UnitBasis)


def test_verbs_compute_the_new_activations():
    cur = torch.tensor([[[1.0, -2.0, 3.0]]])
    assert torch.equal(new_activations("zero", cur), torch.zeros_like(cur))
    assert torch.equal(new_activations("clamp", cur, 0.5), torch.full_like(cur, 0.5))
    assert torch.equal(new_activations("scale", cur, 2.0), 2.0 * cur)
    assert torch.equal(new_activations("scale", cur, 1.0), cur)
    m = torch.tensor([0.1, 0.2, 0.3])
    assert torch.equal(new_activations("mean", cur, means=m), m.expand_as(cur))
    with pytest.raises(UnitError, match="steer"):
        new_activations("steer", cur, 1.0)
    with pytest.raises(UnitError, match="means"):
        new_activations("mean", cur)


def test_steer_adds_value_times_the_rows():
    b = FakeBasis()
    v = steer_vector(b, [1, 4], 3.0)
    assert v.tolist() == [0.0, 6.0, 0.0, 0.0, 6.0, 0.0]
    assert torch.equal(steer_vector(b, [2], 0.0), torch.zeros(6))


def test_retired_verbs_map_to_the_one_set():
    assert RETIRED_VERBS == {"ablate": "zero", "amplify": "scale"}
    assert canonical_verb("ablate") == "zero" and canonical_verb("amplify") == "scale"
    assert [canonical_verb(v) for v in VERBS] == list(VERBS)
    with pytest.raises(UnitError, match=r"mode: 'erase' is not one of zero, mean, clamp, scale, steer"):
        canonical_verb("erase")


def test_unit_edit_checks_name_the_field():
    b = FakeBasis()
    assert UnitEdit(b, [1, 2], "ablate").verb == "zero"
    with pytest.raises(UnitError, match=r"mode: a zero_only basis cannot 'steer' \(it supports zero\)"):
        UnitEdit(ZeroOnly(), [1], "steer", value=1.0)
    with pytest.raises(UnitError, match="factor: inf is not a finite number"):
        UnitEdit(b, [1], "scale", value=float("inf"))
    with pytest.raises(UnitError, match="value: nan is not a finite number"):
        UnitEdit(b, [1], "clamp", value=float("nan"))
    with pytest.raises(UnitError, match="means: verb 'mean' needs"):
        UnitEdit(b, [1], "mean")
    with pytest.raises(UnitError, match="means: 1 means for 2 units"):
        UnitEdit(b, [1, 2], "mean", means=[0.5])
    with pytest.raises(UnitError, match="means: .* not finite"):
        UnitEdit(b, [1, 2], "mean", means=[0.5, float("nan")])
    with pytest.raises(UnitError, match="features: unit 9 out of range"):
        UnitEdit(b, [9], "zero", field="features")
    e = UnitEdit(b, [1, 2], "mean", means=torch.tensor([0.5, 0.25], dtype=torch.float64))
    assert e.means.dtype == torch.float32 and e.means.tolist() == [0.5, 0.25]


def test_unit_error_is_each_engines_error():
    assert issubclass(UnitError, AttributionError) and issubclass(UnitError, SAEError)


@pytest.mark.parametrize("seed", range(8))
def test_random_units_avoid_exclude_and_repeat_by_seed(seed):
    ex = {0, 3, 5, 7}
    r = random_units(20, 6, ex, rng=seed)
    assert len(r) == 6 == len(set(r)) and not set(r) & ex and all(0 <= u < 20 for u in r)
    assert r == random_units(20, 6, ex, rng=seed)
    # from the pool when it has enough units outside exclude, else from all
    pool = [1, 2, 3, 4, 6, 8, 9]
    rp = random_units(20, 4, ex, pool, rng=seed)
    assert set(rp) <= set(pool) - ex and len(rp) == 4
    rf = random_units(20, 6, ex, pool, rng=seed)
    assert len(rf) == 6 and not set(rf) & ex
    # fewer when fewer remain; none when everything is excluded
    assert sorted(random_units(5, 10, {1}, rng=seed)) == [0, 2, 3, 4]
    assert random_units(3, 2, {0, 1, 2}, rng=seed) == []


def test_random_units_share_a_generator():
    g1, g2 = np.random.default_rng(4), np.random.default_rng(4)
    a = [random_units(50, 3, rng=g1) for _ in range(3)]
    b = [random_units(50, 3, rng=g2) for _ in range(3)]
    assert a == b and a[0] != a[1]


def test_random_wrappers_are_random_units():
    from tracekit.neurons import random_neurons
    from tracekit.sae import random_features

    class M:  # only cfg is read (the rest: what a HookedModel has, checked at run time)
        class cfg:
            d_mlp = 40
        tokenizer = None
        hook_dict: dict = {}

        def run_with_cache(self, *a, **k): ...

        run_with_hooks = hooks = run_with_cache

    like = [(0, 1), (2, 5), (2, 6)]
    g = np.random.default_rng(11)
    want = [(0, u) for u in random_units(40, 1, {1}, rng=g)] + [(2, u) for u in random_units(40, 2, {5, 6}, rng=g)]
    assert random_neurons(M, like, seed=11) == want
    assert random_features(64, 5, [1, 2], [1, 2, 3, 4, 5, 6, 7], seed=2) == sorted(
        random_units(64, 5, [1, 2], [1, 2, 3, 4, 5, 6, 7], rng=2))


def test_running_top_orders_ties_by_window_then_position_and_ignores_batching():
    g = torch.Generator().manual_seed(0)
    vals = torch.randint(0, 4, (7, 5, 3), generator=g).float()  # many exact ties
    vals[2, 1, 0] = float("-inf")
    whole = RunningTop(3, 6)
    whole.update(vals, list(range(10, 17)))
    split = RunningTop(3, 6)
    for s in range(0, 7, 2):
        split.update(vals[s:s + 2], list(range(10 + s, 10 + min(7, s + 2))))
    for t in (whole, split):
        for j in range(3):
            got = [(-float(v), int(w), int(p)) for v, w, p in zip(t.values[j], t.windows[j], t.positions[j])]
            want = sorted((-float(vals[b, p, j]), 10 + b, p) for b in range(7) for p in range(5)
                          if torch.isfinite(vals[b, p, j]))[:6]
            assert got == want
    assert whole.kept_windows() == split.kept_windows()


# ---------------------------------------------------------------------------------------------
# the one config vocabulary of the unit kinds, and the top-vs-random summary


def _configs():
    from tracekit.experiments.neurons import AblationConfig
    from tracekit.experiments.sae import SAEInterventionConfig

    return [AblationConfig, SAEInterventionConfig]


@pytest.mark.parametrize("cls", _configs(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("old,new", sorted(RETIRED_VERBS.items()))
def test_retired_verbs_in_modes_name_the_new_one(cls, old, new):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=rf"modes\[1\]: '{old}' was renamed to '{new}'"):
        cls(modes=["zero", old])
    with pytest.raises(ValidationError, match=rf"modes: '{old}' was renamed to '{new}'"):
        cls(modes=old)


@pytest.mark.parametrize("cls", _configs(), ids=lambda c: c.__name__)
def test_retired_amplify_field_names_scale_factors(cls):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"'amplify' was renamed to 'scale_factors' \(and add 'scale' to modes\)"):
        cls(amplify=[2.0])


def test_verb_config_defaults_and_plans():
    from tracekit.experiments.neurons import AblationConfig
    from tracekit.experiments.sae import SAEInterventionConfig

    a, s = AblationConfig(), SAEInterventionConfig()
    assert a.modes == ["zero", "mean", "scale"] and s.modes == ["zero", "steer"]
    for c in (a, s):
        assert c.scale_factors == [2.0] and c.clamp_value == 0.0 and c.steer_values == [10.0]
    assert [(m, v) for m, v in a.plans() if m == "scale"] == [("scale", 2.0)]
    assert [m for m, _ in a.plans()] == ["zero", "mean", "scale"]
    assert s.plans()[1] == ("steer", 10.0) and np.isnan(s.plans()[0][1])
    full = AblationConfig(modes=list(VERBS), scale_factors=3, clamp_value=0.5, steer_values=[-2.0, 4.0])
    assert [verb_key(m, v) for m, v in full.plans()] == ["zero", "mean", "clamp_x0.5", "scale_x3", "steer_x-2",
                                                          "steer_x4"]
    for c in (a, s, full):  # a saved config (every field written) validates again (Result.load)
        assert type(c).model_validate(c.model_dump(mode="json")) == c


@pytest.mark.parametrize("cls", _configs(), ids=lambda c: c.__name__)
def test_verb_config_errors_name_the_field(cls):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="scale_factors: mode 'scale' needs at least one value"):
        cls(modes=["scale"], scale_factors=[])
    with pytest.raises(ValidationError, match="steer_values: mode 'steer' needs at least one value"):
        cls(modes=["steer"], steer_values=[])
    with pytest.raises(ValidationError, match="modes: 'zero' is listed twice"):
        cls(modes=["zero", "zero"])
    with pytest.raises(ValidationError, match="scale_factors: 2.0 is listed twice"):
        cls(modes=["scale"], scale_factors=[2.0, 2.0])
    with pytest.raises(ValidationError, match="modes"):
        cls(modes=["erase"])
    with pytest.raises(ValidationError, match="scale_factors"):
        cls(scale_factors=[float("inf")])


def test_verb_keys_follow_one_rule():
    assert verb_key("zero") == "zero" and verb_key("mean", float("nan")) == "mean"
    assert verb_key("clamp", 0.0) == "clamp_x0" and verb_key("scale", 2.0) == "scale_x2"
    assert verb_key("steer", -20.0) == "steer_x-20" and verb_key("scale", 0.5) == "scale_x0.5"


def _row(prompt, set_, draw, mode, value, k, clean, patched, clean_ld, patched_ld):
    return {"row_id": prompt, "set": set_, "draw": draw, "verb": mode, "value": value, "k": k, "units": "[]",
            "clean_target_prob": clean, "patched_target_prob": patched, "delta_target_prob": patched - clean,
            "clean_logit_diff": clean_ld, "patched_logit_diff": patched_ld,
            "delta_logit_diff": patched_ld - clean_ld, "delta_target_log_prob": 0.0}


def test_intervention_summary_is_the_hand_computation():
    import pandas as pd

    from tracekit.units import INTERVENTION_COLUMNS, intervention_summary

    nan = float("nan")
    rows = [
        # zero: top set (2 prompts), random draws 1 and 2 (2 prompts each)
        _row(0, "top", 0, "zero", nan, 2, 0.50, 0.30, 1.0, 0.2),
        _row(1, "top", 0, "zero", nan, 1, 0.40, 0.10, 2.0, 1.0),
        _row(0, "random", 1, "zero", nan, 2, 0.50, 0.45, 1.0, 0.9),
        _row(1, "random", 1, "zero", nan, 2, 0.40, 0.41, 2.0, 2.1),
        _row(0, "random", 2, "zero", nan, 2, 0.50, 0.50, 1.0, 1.0),
        _row(1, "random", 2, "zero", nan, 2, 0.40, 0.30, 2.0, 1.5),
        # scale x2 and steer x-3: top only
        _row(0, "top", 0, "scale", 2.0, 2, 0.50, 0.70, 1.0, 1.8),
        _row(0, "top", 0, "steer", -3.0, 2, 0.50, 0.20, 1.0, -1.0),
    ]
    table = pd.DataFrame(rows)
    assert list(table.columns) == list(INTERVENTION_COLUMNS)
    s = intervention_summary(table, decimals=None)
    assert list(s) == ["zero", "scale_x2", "steer_x-3"]
    z = s["zero"]
    # random prob deltas: draw 1: -0.05, +0.01 (mean -0.02); draw 2: 0.0, -0.10 (mean -0.05)
    # random logit-diff deltas: draw 1: -0.1, +0.1 (mean 0); draw 2: 0.0, -0.5 (mean -0.25)
    want = {"k": 2, "clean_target_prob": 0.45, "patched_target_prob": 0.20, "top_delta_target_prob": -0.25,
            "top_delta_logit_diff": -0.9, "n_random": 2, "random_delta_target_prob_mean": -0.035,
            "random_delta_target_prob_std": 0.015, "random_delta_logit_diff_mean": -0.125,
            "random_delta_logit_diff_std": 0.125}
    assert set(z) == set(want)
    for key, v in want.items():
        assert z[key] == pytest.approx(v, abs=1e-12), key
    for key in ("scale_x2", "steer_x-3"):
        e = s[key]
        assert e["n_random"] == 0 and e["k"] == 2
        assert e["random_delta_target_prob_mean"] is None and e["random_delta_logit_diff_std"] is None
    assert s["scale_x2"]["top_delta_target_prob"] == pytest.approx(0.2, abs=1e-12)
    assert s["steer_x-3"]["top_delta_logit_diff"] == pytest.approx(-2.0, abs=1e-12)
    rounded = intervention_summary(table)  # default: 6 decimals
    assert rounded["zero"]["random_delta_target_prob_mean"] == pytest.approx(-0.035, abs=1e-6)
    assert intervention_summary(table.iloc[:0]) == {} and intervention_summary(None) == {}
