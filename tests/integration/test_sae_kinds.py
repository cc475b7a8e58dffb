"""SAE kinds (sae_features, sae_eval, sae_train) end to end on a tiny model: tables, save/load,
dashboards, training through SAELens' runner and its cache."""

from __future__ import annotations

import json

import pytest
import torch
from test_sae import PROMPT, make_sae_dir

from tracekit import Result, SAEEval, SAEFeatures, SAETrain
from tracekit.sae import SAESpec, load_sae


def test_sae_features_run_save_load_dashboards(tmp_path, tiny_gpt2):
    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.2.hook_resid_pre", arch="topk", d_sae=64)
    exp = SAEFeatures(sae={"path": str(d)}, prompts=[PROMPT, "Paris is in"], target=" Paris", foil=" London",
                      top_k=4, interventions={"k": 2, "n_random": 2, "modes": ["zero", "clamp", "steer"],
                                              "clamp_value": 1.0, "steer_values": [5.0]},
                      dashboards={"features": 2, "max_tokens": 600, "seq_len": 32, "top_n": 3})
    res = exp.run(tiny_gpt2, progress=False)
    s = res.summary()
    assert len(s["top_features_mean"]) == 4 and s["max_sum_error"] < 1e-3
    assert s["n_rows"] == 2 and [len(f) for f in s["top_features_by_row"]] == [4, 4]
    terms = res.tables["terms"]
    t0 = terms[terms["row_id"] == 0].set_index("term")["total"]
    assert abs(t0["features"] + t0["error"] + t0["bias"] + t0["special_tokens"] - t0["activation"]) < 1e-3
    iv = res.tables["interventions"]
    assert set(iv["verb"]) == {"zero", "clamp", "steer"} and set(iv["set"]) == {"top", "random"}
    assert set(s["interventions"]) == {"zero", "clamp_x1", "steer_x5"}
    assert {"vocab", "contexts", "density"} <= set(res.tables)
    assert "promotes" in s["top_features_mean"][0]
    out = res.save(tmp_path / "run" / "step")
    html = sorted(out.glob("dashboard_feature_*.html"))
    assert len(html) == 2
    page = html[0].read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page  # self-contained
    assert "<svg" in page and "<table class=prompts>" in page  # density (SVG, prompt marked), the rows' tokens
    back = Result.load(out)
    assert back.summary() == json.loads(json.dumps(s, default=float)) or back.summary()["top_features_mean"] == s["top_features_mean"]
    assert set(back.dashboards()) == set(res.dashboards())
    assert res.report()


def test_sae_eval_run(tmp_path, tiny_gpt2):
    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre")
    res = SAEEval(sae={"path": str(d)}, corpus="stdlib", max_tokens=300, seq_len=32).run(tiny_gpt2, progress=False)
    s = res.summary()
    for k in ("mse", "explained_variance", "l0", "ce_loss_recovered", "ce_loss_recovered_mean", "kl", "n_dead"):
        assert k in s and s[k] is not None, k
    assert len(res.tables["features"]) == 48
    out = res.save(tmp_path / "ev")
    assert Result.load(out).summary() == s


def test_sae_train_cache_and_reload(tmp_path, tiny_gpt2, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    train = {"hook": "blocks.1.hook_resid_pre", "d_sae": 32, "k": 4, "training_tokens": 1024, "eval_tokens": 128,
             "context_size": 32, "train_batch_size_tokens": 128}
    r1 = SAETrain(sae={"train": train}).run(tiny_gpt2, progress=False)
    s1 = r1.summary()
    assert s1["cache_hit"] is False and s1["train_tokens"] >= 1024
    path = s1["path"]
    assert str(tmp_path / "cache" / "saes") in path
    r2 = SAETrain(sae={"train": train}).run(tiny_gpt2, progress=False)
    assert r2.summary()["cache_hit"] is True and r2.summary()["path"] == path
    assert r2.summary()["explained_variance"] == s1["explained_variance"]
    h = load_sae(SAESpec(path=path), tiny_gpt2)  # loads back identically as a plain SAELens directory
    state = load_file(f"{path}/sae_weights.safetensors")
    for k, v in state.items():
        assert torch.equal(h.sae.state_dict()[k], v), k
    assert h.info.fingerprint is not None and h.info.processed is True
    # a different training config is another cache entry
    from tracekit.sae import SAETrainSpec, _train_key

    assert _train_key(tiny_gpt2, SAETrainSpec(**{**train, "k": 3})) != _train_key(tiny_gpt2, SAETrainSpec(**train))


def test_trained_sae_refused_on_raw_model(tmp_path, monkeypatch):
    """An SAE trained on a processed model is refused on the same weights loaded without
    processing (another residual basis), before any forward pass."""
    from helpers import make_tiny
    from tracekit.errors import SAEError

    m = make_tiny("gpt2")
    raw = make_tiny("gpt2", process_weights=False)
    d = make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre")
    with pytest.raises(SAEError, match="process_weights"):
        load_sae(SAESpec(path=str(d)), raw)


def test_sae_train_needs_train_block():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="train"):
        SAETrain(sae={"path": "x"})
