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


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
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


def test_windows_past_the_context_are_refused_at_check(tmp_path, tiny_gpt2, monkeypatch):
    """``sae.train.context_size`` (training windows), ``seq_len`` (sae_eval) and ``dashboards.seq_len``
    (sae_features) above the model's context are refused by the kinds' check, and training is
    refused before any window is cut (on GPT-2 these were IndexErrors in the position table)."""
    from tracekit.errors import ConfigError
    from tracekit.experiments.steering import Steering
    from tracekit.sae import SAETrainSpec, train_sae

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    m = tiny_gpt2
    train = {"hook": "blocks.1.hook_resid_pre", "d_sae": 32, "k": 4, "training_tokens": 1024, "eval_tokens": 128,
             "context_size": 129, "train_batch_size_tokens": 128}
    msg = r"windows of 129 tokens need 129 positions, more than model 'gpt2''s context of 128 tokens"
    SAETrain(sae={"train": {**train, "context_size": 128}}).check(m)
    with pytest.raises(ConfigError, match=rf"^sae\.train\.context_size: {msg} .*at most 128$"):
        SAETrain(sae={"train": train}).check(m)
    with pytest.raises(ConfigError, match=r"^sae\.train\.context_size: windows of 129"):
        train_sae(m, SAETrainSpec(**train), cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with pytest.raises(ConfigError, match=rf"^seq_len: {msg} .*set seq_len to at most 128$"):
        SAEEval(sae={"train": {**train, "context_size": 32}}, corpus="stdlib", seq_len=129).check(m)
    d = make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre")
    SAEEval(sae={"path": str(d)}, corpus="stdlib", seq_len=128).check(m)
    with pytest.raises(ConfigError, match=rf"^seq_len: {msg}"):
        SAEEval(sae={"path": str(d)}, corpus="stdlib", seq_len=129).check(m)
    with pytest.raises(ConfigError, match=rf"^dashboards\.seq_len: {msg}"):
        SAEFeatures(sae={"path": str(d)}, prompts=[PROMPT], target=" Paris", dashboards={"seq_len": 129}).check(m)
    steer = {"prompts": [PROMPT], "target": " Paris", "vector": {"source": "sae", "sae": {"train": train}, "feature": 0}}
    with pytest.raises(ConfigError, match=rf"^vector\.sae\.train\.context_size: {msg}"):
        Steering(**steer).check(m)
