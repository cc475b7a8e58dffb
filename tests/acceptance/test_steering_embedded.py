"""Steering on the real embedded model (SmolLM2-135M): the shipped config's vector (Italy - France,
contrastive prompts, block 10's input at the country token) moves ' Paris' to ' Rome' far beyond
random directions of the same norm, alpha 0 is the clean run, and greedy generation with the KV
cache equals the no-cache loop on this architecture (with and without steering).

The asserted bounds are properties of a working steering vector (an effect well above the best norm
matched control), not values copied from a run (docs/steering.md has the measured numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tracekit.experiments.steering import Steering
from tracekit.steering import Steer, generate
from tracekit.tokens import encode

CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "steering_smollm2.yaml"


@pytest.mark.slow
def test_shipped_steering_config_on_the_embedded_model(embedded_model):
    step = yaml.safe_load(CONFIG.read_text())["experiments"][0]
    step = {k: v for k, v in step.items() if k not in ("expect", "name")}
    step["generate"] = {**step["generate"], "max_new_tokens": 3, "max_prompts": 1}
    r = Steering(**step).run(embedded_model, progress=False)
    s = r.summary()
    assert s["alpha0_max_abs_error"] <= 1e-6
    assert s["mean_clean_target_prob"] < 0.01  # the model answers ' Paris'
    # the direction, not the norm: at alpha 2 ' Rome' wins by far over the best random direction
    assert s["top_alpha_mean_target_prob"] > 0.5
    assert s["effect_vs_random_max_by_alpha"][-1] > 0.3
    assert s["mean_logit_diff_by_alpha"][-1] > 0 > s["mean_logit_diff_by_alpha"][0]
    assert s["steered_first_token_by_row"][0] == " Rome" and s["unsteered_first_token_by_row"][0] == " Paris"

    # the KV cache on the real architecture: cached = full-sequence loop, token for token
    ids = encode(embedded_model, step["prompts"][0])
    v = r.arrays["vector"]
    at = tuple(r.meta["steered_positions"][0])
    for steering in (None, Steer(v, s["hook"], 1.0, at, True)):
        a = generate(embedded_model, ids, 6, steering=steering, use_kv_cache=True, stop_at_eos=False)
        b = generate(embedded_model, ids, 6, steering=steering, use_kv_cache=False, stop_at_eos=False)
        assert a.new_ids == b.new_ids
