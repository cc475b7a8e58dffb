# pyright: reportArgumentType=false, reportGeneralTypeIssues=false, reportAttributeAccessIssue=false
"""The tuned lens, its training and cache, the package's on-disk layout, the lens-quality table and
the ``lens: tuned`` option of the logit lens, on tiny perturbed models (tests/helpers.py).

Tolerances: 0 where the same float operations run (an untrained tuned lens adds exact zeros;
save/load moves the same float32 values); 1e-5 nats where two code paths compute the same
log-softmax in float32 (the readout of the last block's output vs the model's logits)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError
from reference.tuned_lens_layout import PackageTranslators, check_unembed_hash, unembedding_hash
from reference.tuned_lens_layout import TunedLensConfig as PackageConfig

import tracekit.lenses.train as train_mod
from helpers import make_perturbed, perturbed_hf
from tracekit.core.errors import ConfigError
from tracekit.experiments.lens_quality import LensQuality
from tracekit.experiments.logit_lens import LogitLens
from tracekit.fastpath import residual_stream
from tracekit.lenses.quality import quality_table
from tracekit.lenses.train import TunedLensSpec, load_or_train_tuned_lens, split_windows, train_tuned_lens
from tracekit.lenses.tuned import TunedLens, lens_log_probs, residual_basis, unembed_hash
from tracekit.logit_lens import lens_points, logit_lens
from tracekit.model.readout import Readout
from tracekit.tokens import pad_ids

PROMPTS = ["The capital of France is", "Hello world, this is a longer prompt"]
SMALL = {"train_tokens": 384, "seq_len": 32, "epochs": 3, "batch_tokens": 64, "held_out_tokens": 128, "lr": 3e-3}


def _random_lens(model, seed: int = 0) -> TunedLens:
    lens = TunedLens.from_model(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lens.parameters():
            p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return lens


def _lens_fields(rows) -> list[torch.Tensor]:
    keys = ("target_log_prob", "target_rank", "entropy", "topk_ids", "topk_probs", "final_log_prob", "final_topk_ids",
            "final_topk_probs", "final_rank", "foil_log_prob", "final_foil_log_prob", "track_log_prob", "track_rank",
            "final_track_log_prob")
    return [getattr(r, k) for r in rows for k in keys]


def test_untrained_tuned_lens_is_the_logit_lens(perturbed_model):
    """Zero-initialised residual translators: every statistic of the logit lens, bit for bit."""
    model = perturbed_model
    lens = TunedLens.from_model(model)
    kw: dict[str, Any] = dict(targets=[" Paris", " the"], foils=[" Rome", " a"], track=[" London"], position="all",
                              top_k=5)
    a = logit_lens(model, PROMPTS, **kw)
    b = logit_lens(model, PROMPTS, translator=lens.transform, **kw)
    for x, y in zip(_lens_fields(a), _lens_fields(b)):
        assert torch.equal(x.nan_to_num(-7.0), y.nan_to_num(-7.0))
    # the differentiable readout used in training is Readout.log_probs
    w = split_windows(model, "stdlib", "train", 20, 16)[0]
    x = residual_stream(model, pad_ids(model, [list(w.ids)]), [lens_points(3, "hidden_states")[1].hook])[0, 0]
    assert torch.allclose(lens_log_probs(model, x), Readout(model).log_probs(x), atol=1e-6, rtol=0)


def test_translator_changes_the_lens_but_not_the_model_output(tiny_llama):
    model = tiny_llama
    lens = _random_lens(model)
    a = logit_lens(model, PROMPTS, targets=" Paris", position="all")
    b = logit_lens(model, PROMPTS, targets=" Paris", position="all", translator=lens.transform)
    assert not torch.allclose(a[0].target_log_prob[:-1], b[0].target_log_prob[:-1])
    for ra, rb in zip(a, b):  # the last hidden state and the model's own output are read as they are
        assert torch.equal(ra.target_log_prob[-1], rb.target_log_prob[-1])
        assert torch.equal(ra.final_log_prob, rb.final_log_prob)


def test_save_load_round_trip_both_layouts(tiny_llama, tmp_path):
    model = tiny_llama
    lens = _random_lens(model, seed=3)
    x = torch.randn(5, model.cfg.d_model)
    ours = TunedLens.load(lens.save(tmp_path / "ours"), model)
    assert ours.record == lens.record and not ours.foreign
    for h in range(lens.n_hidden_states):
        assert torch.equal(ours.transform(x, h), lens.transform(x, h))
    # the package's own loader reads what we save, and computes the same translation
    pkg = PackageTranslators.load(tmp_path / "ours")
    assert set(pkg.layer_translators.state_dict()) == {f"{i}.{w}" for i in range(3) for w in ("weight", "bias")}
    for h in range(3):
        assert torch.equal(pkg.transform_hidden(x, h), lens.transform(x, h))
    # we read what the package saves (no tracekit.json: a foreign lens)
    pkg2 = PackageTranslators(PackageConfig("some/model", int(model.cfg.d_model), 3))
    with torch.no_grad():
        for p in pkg2.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    pkg2.save(tmp_path / "pkg")
    theirs = TunedLens.load(tmp_path / "pkg", model)
    assert theirs.foreign and theirs.config.base_model_name_or_path == "some/model"
    for h in range(3):
        assert torch.equal(theirs.transform(x, h), pkg2.transform_hidden(x, h))
    assert torch.equal(theirs.transform(x, 3), x)


def test_foreign_lens_of_another_width_or_depth_is_refused(tiny_llama, tmp_path):
    d = int(tiny_llama.cfg.d_model)
    PackageTranslators(PackageConfig("other", d // 2, 3)).save(tmp_path / "narrow")
    with pytest.raises(ConfigError, match=r"tuned.path: .*d_model %d" % (d // 2)):
        TunedLens.load(tmp_path / "narrow", tiny_llama)
    PackageTranslators(PackageConfig("other", d, 5)).save(tmp_path / "deep")
    with pytest.raises(ConfigError, match="5 layers"):
        TunedLens.load(tmp_path / "deep", tiny_llama)
    with pytest.raises(ConfigError, match="not a tuned lens folder"):
        TunedLens.load(tmp_path / "missing", tiny_llama)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_unembed_hash_is_the_packages_with_weight_processing(arch, tmp_path, caplog):
    """Weight processing centres the unembedding over the vocabulary (and folds the final norm into
    it); ``unembed_hash`` is still the package's hash of the checkpoint's own output embedding, so
    neither side warns on the other's lens for the same model, and a lens of another model is caught."""
    model = make_perturbed(arch, process_weights=True)
    hf, _ = perturbed_hf(arch)  # the same checkpoint, as the package loads it
    w_u = Readout(model).W_U
    assert w_u.mean(-1).abs().max() < 1e-6  # [d_model, d_vocab]: centred over the vocabulary
    assert (w_u.T - hf.get_output_embeddings().weight).abs().max() > 1e-2  # really another matrix than the checkpoint's
    ref = unembedding_hash(hf)
    assert unembed_hash(model) == ref == unembed_hash(make_perturbed(arch, process_weights=False))
    # tracekit -> package: the package's loader finds the hash it computes itself
    TunedLens.from_model(model).save(tmp_path / "ours")
    cfg = PackageTranslators.load(tmp_path / "ours").config
    assert cfg.unembed_hash == ref
    with caplog.at_level(logging.WARNING):
        check_unembed_hash(cfg, hf)
    assert not [r for r in caplog.records if "hash" in r.getMessage()]
    other = unembedding_hash(perturbed_hf("llama", tied=True)[0])  # same width and depth, another unembedding
    assert other != ref
    with caplog.at_level(logging.WARNING):
        check_unembed_hash(PackageConfig("other", 64, 3, unembed_hash=other), hf)
    assert [r for r in caplog.records if "hash does not match" in r.getMessage()]
    if arch != "llama":  # a package lens on a processed LayerNorm model is refused (basis) before any hash
        return
    # package -> tracekit, weight processing on: no warning
    d = int(model.cfg.d_model)
    PackageTranslators(PackageConfig("tiny-llama", d, 3, unembed_hash=ref)).save(tmp_path / "pkg")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TunedLens.load(tmp_path / "pkg", model)
    # a package lens of another model is caught
    PackageTranslators(PackageConfig("other", d, 3, unembed_hash=other)).save(tmp_path / "other")
    with pytest.warns(UserWarning, match=r"tuned.path: the model's unembed_hash .* differs from the lens'"):
        TunedLens.load(tmp_path / "other", model)


def test_residual_basis_rmsnorm_unaffected_layernorm_centred(tmp_path):
    """Weight processing leaves an RMSNorm model's hidden states as they are and centres a LayerNorm
    model's: a lens is refused on a model in another basis than it was made for."""
    ids = [464, 3139, 286, 4881, 318, 6342, 290]
    hooks = [p.hook for p in lens_points(3, "hidden_states")]
    res = {}
    for arch in ("llama", "gpt2"):
        for pw in (True, False):
            m = make_perturbed(arch, process_weights=pw)
            res[arch, pw] = residual_stream(m, pad_ids(m, [ids]), hooks)
    assert (res["llama", True] - res["llama", False]).abs().max() < 1e-5
    raw = res["gpt2", False]
    assert (res["gpt2", True] - (raw - raw.mean(-1, keepdim=True))).abs().max() < 1e-5
    assert (res["gpt2", True] - raw).abs().max() > 1e-2  # really another basis
    assert residual_basis(make_perturbed("llama", process_weights=True)) == "hf"
    assert residual_basis(make_perturbed("gpt2", process_weights=False)) == "hf"
    g_proc, g_raw = make_perturbed("gpt2", process_weights=True), make_perturbed("gpt2", process_weights=False)
    assert residual_basis(g_proc) == "centred"
    PackageTranslators(PackageConfig("gpt2", 64, 3)).save(tmp_path / "pkg")
    TunedLens.load(tmp_path / "pkg", g_raw)  # Hugging Face basis: fine
    with pytest.raises(ConfigError, match="process_weights: false"):
        TunedLens.load(tmp_path / "pkg", g_proc)
    TunedLens.from_model(g_proc).save(tmp_path / "ours")
    with pytest.raises(ConfigError, match="basis 'centred'.*process_weights: true"):
        TunedLens.load(tmp_path / "ours", g_raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TunedLens.load(tmp_path / "ours", g_proc)


def test_training_lowers_held_out_kl():
    model = make_perturbed("llama", process_weights=True)
    lens = train_tuned_lens(model, TunedLensSpec(**SMALL))
    r = lens.record
    assert r is not None
    logit, tuned = np.asarray(r["held_out_kl_logit"]), np.asarray(r["held_out_kl"])
    assert r["train_tokens"] == SMALL["train_tokens"] and r["held_out_tokens"] == SMALL["held_out_tokens"]
    assert abs(logit[-1]) < 1e-5 and abs(tuned[-1]) < 1e-5  # the last hidden state is the model's output
    # held-out text (other documents) is predicted better at every translated hidden state
    assert (tuned[:-1] < logit[:-1] - 0.02).all(), (logit, tuned)
    assert all(p.requires_grad is False for p in model.parameters())


def test_document_split_is_disjoint(tiny_llama):
    tr = split_windows(tiny_llama, "stdlib", "train", 2000, 64)
    held = split_windows(tiny_llama, "stdlib", "held_out", 2000, 64)
    assert not {w.doc_id.split("#")[0] for w in tr} & {w.doc_id.split("#")[0] for w in held}
    assert sum(len(w.ids) - w.n_prefix for w in held) == 2000


def test_cache_hit_miss_and_path(tiny_llama, tmp_path, monkeypatch):
    spec = TunedLensSpec(**{**SMALL, "epochs": 1, "held_out_tokens": 0})
    first = load_or_train_tuned_lens(tiny_llama, spec, cache_dir=tmp_path)
    assert first.source["from"] == "trained"
    calls = []
    real = train_mod.train_tuned_lens
    monkeypatch.setattr(train_mod, "train_tuned_lens", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = load_or_train_tuned_lens(tiny_llama, spec, cache_dir=tmp_path)
    assert second.source == {**first.source, "from": "cache"} and calls == []
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a.cpu(), b.cpu())
    third = load_or_train_tuned_lens(tiny_llama, spec.model_copy(update={"seed": 1}), cache_dir=tmp_path)
    assert third.source["from"] == "trained" and third.source["key"] != first.source["key"] and calls == [1]
    by_path = load_or_train_tuned_lens(tiny_llama, TunedLensSpec(path=first.source["path"]))
    assert by_path.source["from"] == "path" and by_path.record == first.record


@pytest.mark.parametrize(("arch", "processed"), [("llama", False), ("gpt2", True)])
def test_quality_table_invariants_and_hand_cross_entropy(arch, processed):
    model = make_perturbed(arch, process_weights=processed)
    wins = split_windows(model, "stdlib", "held_out", 120, 24)
    untrained = TunedLens.from_model(model)
    q = quality_table(model, wins, ["logit", "tuned"], untrained, batch_size=3)
    H = int(model.cfg.n_layers) + 1
    assert list(q["lens"]) == ["logit"] * H + ["tuned"] * H
    lg, tu = q[q["lens"] == "logit"].reset_index(drop=True), q[q["lens"] == "tuned"].reset_index(drop=True)
    pd.testing.assert_frame_equal(lg.drop(columns="lens"), tu.drop(columns="lens"), check_exact=True)
    last = lg.iloc[-1]
    assert abs(last["kl"]) < 1e-5 and last["top1_agreement"] == 1.0
    n = sum(len(w.ids) - w.n_prefix - 1 for w in wins)
    assert (lg["n_tokens"] == n).all()
    # cross-entropy by hand: the model's own logits at the last hidden state, the readout of the
    # embedding output at h = 0
    ce_final, ce0, tot = 0.0, 0.0, 0
    for w in wins:
        toks = torch.tensor([w.ids])
        lp = torch.log_softmax(model(toks).float(), -1)[0]
        emb = residual_stream(model, pad_ids(model, [list(w.ids)]),
                              [lens_points(3, "hidden_states")[0].hook])[0, 0]
        lp0 = Readout(model).log_probs(emb)
        for p in range(w.n_prefix, len(w.ids) - 1):
            ce_final -= float(lp[p, w.ids[p + 1]])
            ce0 -= float(lp0[p, w.ids[p + 1]])
            tot += 1
    assert tot == n
    assert abs(last["cross_entropy"] - ce_final / n) < 1e-4
    assert abs(lg.iloc[0]["cross_entropy"] - ce0 / n) < 1e-4


def test_patchscope_in_the_quality_table(tiny_llama):
    wins = split_windows(tiny_llama, "stdlib", "held_out", 60, 24)
    q = quality_table(tiny_llama, wins, ["logit", "patchscope"], patchscope_positions=5, seed=1)
    ps = q[q["lens"] == "patchscope"]
    assert (ps["n_tokens"] == 5).all() and len(ps) == 4
    # the last hidden state patched into the identity prompt at the same hidden state is the model's output
    assert abs(ps["kl"].iloc[-1]) < 1e-4 and ps["top1_agreement"].iloc[-1] == 1.0


def test_lens_quality_kind_round_trip(tmp_path):
    """On a LayerNorm model with weight processing (the centred basis): trained, scored, saved, loaded."""
    from tracekit.results import Result

    model = make_perturbed("gpt2", process_weights=True)
    exp = LensQuality(tuned=TunedLensSpec(**SMALL), eval={"n_tokens": 150, "seq_len": 32},
                      expect=[{"metric": "kl_gain_by_hidden_state[1]", "min": 0.0}])
    res = exp.run(model, progress=False)
    assert res.meta["residual_basis"] == "centred" and res.meta["tuned"]["record"]["residual_basis"] == "centred"
    s = res.summary()
    assert s["lenses"] == ["logit", "tuned"] and s["hidden_states"] == [0, 1, 2, 3]
    assert s["tuned"]["from"] in ("trained", "cache") and len(s["kl_by_hidden_state"]["tuned"]) == 4
    assert s["tuned_better_hidden_states"] == [0, 1, 2] and "3 of 3" in s["headline"]
    assert all(r["met"] for r in res.check_expectations())
    loaded = Result.load(res.save(tmp_path / "q"))
    pd.testing.assert_frame_equal(loaded.tables["quality"], res.tables["quality"])
    assert loaded.summary() == s
    assert "KL logit" in res.report()
    with pytest.raises(ValidationError, match="lists a lens twice"):
        LensQuality(lenses=["logit", "logit"])


def test_logit_lens_kind_with_the_tuned_lens(tiny_llama, tmp_path):
    base = {"prompts": PROMPTS, "target": " Paris", "position": "all"}
    TunedLens.from_model(tiny_llama).save(tmp_path / "zero")
    plain = LogitLens(**base).run(tiny_llama, progress=False)
    tuned0 = LogitLens(**base, lens="tuned", tuned={"path": str(tmp_path / "zero")}).run(tiny_llama, progress=False)
    for name in ("main", "rows", "topk", "final"):
        pd.testing.assert_frame_equal(plain.tables[name], tuned0.tables[name], check_exact=True)
    assert tuned0.meta["lens"] == "tuned" and tuned0.meta["tuned"]["from"] == "path"
    assert tuned0.report().startswith("tuned lens [")
    _random_lens(tiny_llama).save(tmp_path / "rand")
    tuned = LogitLens(**base, lens="tuned", tuned={"path": str(tmp_path / "rand")}).run(tiny_llama, progress=False)
    assert not np.allclose(tuned.tables["main"]["log_prob"], plain.tables["main"]["log_prob"])
    with pytest.raises(ValidationError, match="only read with lens: tuned"):
        LogitLens(**base, tuned={"path": "x"})


def test_seq_len_past_the_context_is_refused_at_check(tiny_gpt2, tmp_path, monkeypatch):
    """``eval.seq_len`` and (a lens to train) ``tuned.seq_len`` above the model's context are refused
    by the kinds' check and by the training entry point before any residual is cached (on GPT-2 a
    long document's window was an IndexError in the position table; RoPE models ran past it)."""
    m = tiny_gpt2
    assert int(m.cfg.n_ctx) == 128
    LensQuality(lenses=["logit"], eval={"n_tokens": 50, "seq_len": 128}).check(m)
    with pytest.raises(ConfigError, match=r"^eval\.seq_len: windows of 129 tokens need 129 positions, more than "
                                          r"model 'gpt2''s context of 128 tokens .*set eval\.seq_len to at most 128$"):
        LensQuality(lenses=["logit"], eval={"n_tokens": 50, "seq_len": 129}).check(m)
    with pytest.raises(ConfigError, match=r"^tuned\.seq_len: windows of 129 .*set tuned\.seq_len to at most 128$"):
        LensQuality(tuned={"seq_len": 129}, eval={"n_tokens": 50, "seq_len": 32}).check(m)
    LensQuality(lenses=["logit"], tuned={"seq_len": 129}, eval={"n_tokens": 50, "seq_len": 32}).check(m)  # not read
    with pytest.raises(ConfigError, match=r"^tuned\.seq_len: windows of 129"):
        LogitLens(prompts=PROMPTS, target=" Paris", lens="tuned", tuned={"seq_len": 129}).check(m)
    monkeypatch.setattr(train_mod, "cache_residuals", lambda *a, **k: pytest.fail("residuals cached"))
    with pytest.raises(ConfigError, match=r"^tuned\.seq_len: windows of 129"):
        load_or_train_tuned_lens(m, TunedLensSpec(seq_len=129, train_tokens=64, held_out_tokens=0), cache_dir=tmp_path)
