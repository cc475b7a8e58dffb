"""Transcoder training (tracekit.dictionaries.train): seeded, resumable after a kill, cached by
content, refusing a store of another model or without a hook; quality exact on a transcoder that is
the MLP itself (tracekit.dictionaries.quality); the kind transcoder_train."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import GPT2_BPE, ROOT, communicate_or_dump, make_perturbed, perturb_params, start_child
from tracekit.activations import StoreError, corpus_rows, write_store
from tracekit.core.errors import SAEError
from tracekit.dictionaries import Dictionary, DictionarySet
from tracekit.dictionaries.fit import DictTrainSettings, fit_dictionary, to_dictionary
from tracekit.dictionaries.quality import transcoder_quality
from tracekit.dictionaries.spec import TranscoderSpec, TranscoderTrainSpec
from tracekit.dictionaries.train import load_transcoders, train_transcoders

TINY: dict[str, Any] = dict(training_tokens=2048, dataset_tokens=1024, eval_tokens=256, context_size=32, train_batch_size_tokens=128,
            k=4, expansion_factor=2, checkpoint_every=4)


def _params(dset: DictionarySet) -> dict[str, torch.Tensor]:
    return {f"{L}.{n}": p.detach().clone() for L in dset.layers for n, p in dset[L].named_parameters()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def llama():
    return make_perturbed("llama")


def test_seeded_cached_and_loaded_equal(llama, tmp_path):
    spec = TranscoderSpec.model_validate(dict(train=TINY))
    a = load_transcoders(spec, llama, cache_dir=tmp_path / "a")
    b = load_transcoders(spec, llama, cache_dir=tmp_path / "b")
    assert not a.cache_hit and not b.cache_hit
    assert _equal(_params(a.dictionaries), _params(b.dictionaries))  # same seed, same weights
    again = load_transcoders(spec, llama, cache_dir=tmp_path / "a")
    assert again.cache_hit and again.path == a.path
    assert _equal(_params(a.dictionaries), _params(again.dictionaries))
    other = load_transcoders(TranscoderSpec.model_validate(dict(train={**TINY, "seed": 1})), llama, cache_dir=tmp_path / "a")
    assert not other.cache_hit and other.path != a.path
    assert not _equal(_params(a.dictionaries), _params(other.dictionaries))
    assert a.dictionaries.layers == [0, 1, 2]
    d = a.dictionaries[1]
    assert (d.hook_in, d.hook_out, d.activation, d.k) == ("blocks.1.mlp.hook_in", "blocks.1.hook_mlp_out", "topk", 4)
    assert set(a.stats["per_layer"]) == {"0", "1", "2"}
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "a").iterdir())  # checkpoints removed


def test_trained_transcoders_beat_the_mean(llama, tmp_path):
    spec = TranscoderSpec.model_validate(dict(train={**TINY, "training_tokens": 8192, "lr": 3e-3}))
    lt = load_transcoders(spec, llama, cache_dir=tmp_path)
    t = spec.train
    assert t is not None
    from tracekit.dictionaries.train import training_windows

    _, held = training_windows(llama, t.corpus, t.context_size, t.dataset_tokens or 0, t.eval_tokens, "x")
    per_layer, overall = transcoder_quality(llama, lt.dictionaries, held)
    assert bool((per_layer["fvu"] < 0.97).all()), per_layer  # better than the mean (a random tiny model's MLP is dense)
    untrained = load_transcoders(TranscoderSpec.model_validate(dict(train={**TINY, "training_tokens": 128, "train_batch_size_tokens": 128})),
                                 llama, cache_dir=tmp_path)
    before, _ = transcoder_quality(llama, untrained.dictionaries, held)
    assert bool((per_layer["fvu"].to_numpy() < before["fvu"].to_numpy() - 0.02).all()), (before, per_layer)
    assert bool((per_layer["l0"] <= t.k + 1e-9).all())
    assert overall["kl"] >= 0 and overall["n_predictions"] == len(held) * (t.context_size - 1)


def test_jumprelu_and_skip_train(llama, tmp_path):
    lt = load_transcoders(TranscoderSpec.model_validate(dict(train={**TINY, "architecture": "jumprelu", "skip": True, "layers": [0, 1]})),
                          llama, cache_dir=tmp_path)
    d = lt.dictionaries[1]
    assert d.activation == "jumprelu" and d.W_skip is not None and d.threshold is not None
    assert bool((d.threshold >= 0).all()) and float(d.W_skip.abs().sum()) > 0
    assert lt.dictionaries.layers == [0, 1]


def _synthetic(n: int = 4096, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(n, 16, generator=g) + 1.0
    A = torch.randn(16, 12, generator=g)
    return x, 5.0 * (x @ A) + 2.0


@pytest.mark.parametrize("activation", ["topk", "jumprelu"])
def test_fit_folds_scales_and_norms(activation):
    """A linear target learnt by the skip matrix: the saved (folded) weights reproduce it, so the
    input/output scales and the decoder norms are folded back exactly; the same seed gives the same
    weights."""
    x, y = _synthetic()
    s = DictTrainSettings(activation=activation, d_sae=8, k=2, steps=400, batch=256, lr=1e-2, dead_feature_window=50,
                          seed=0, skip=True, l0_coefficient=1e-4)
    params, stats = fit_dictionary(x, y, s)
    d = Dictionary(16, 8, 12, activation=activation, k=2, skip=True)
    with torch.no_grad():
        for k, v in params.items():
            getattr(d, k).copy_(v)
    with torch.no_grad():
        fvu = float((d(x) - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    assert fvu < 0.02, fvu
    again, _ = fit_dictionary(x, y, s)
    assert _equal(params, again)
    assert stats["steps"] == 400


def test_fit_autoencoder_with_b_dec_applied_to_its_input():
    """An SAE (x -> x, SAELens' apply_b_dec_to_input) on data that is sparse in a dictionary, offset
    and scaled: the saved weights (scales and b_dec folded) reconstruct it."""
    g = torch.Generator().manual_seed(0)
    D = torch.randn(64, 32, generator=g)
    D = D / D.norm(dim=-1, keepdim=True)
    codes = torch.zeros(8192, 64).scatter_(1, torch.randint(0, 64, (8192, 3), generator=g),
                                           torch.rand(8192, 3, generator=g) * 4 + 1)
    x = 7.0 * (codes @ D) + 3.0
    s = DictTrainSettings(activation="topk", d_sae=128, k=4, steps=600, batch=256, lr=3e-3, dead_feature_window=20,
                          seed=0, apply_b_dec_to_input=True)
    params, _ = fit_dictionary(x, x, s)
    d = to_dictionary(params, s, "blocks.0.hook_resid_pre", "blocks.0.hook_resid_pre")
    assert d.apply_b_dec_to_input
    with torch.no_grad():
        fvu = float((d(x) - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    assert fvu < 0.1, fvu


def test_fit_refuses_too_few_tokens():
    x, y = _synthetic(64)
    with pytest.raises(SAEError, match="train_batch_size_tokens"):
        fit_dictionary(x, y, DictTrainSettings(activation="topk", d_sae=8, k=2, steps=1, batch=128, lr=1e-3,
                                               dead_feature_window=5, seed=0))


# ---- resume after a kill ------------------------------------------------------------------------

_CHILD = """
import os, signal, sys, json
sys.path.insert(0, {tests!r})
import torch
from helpers import make_perturbed
from tracekit.dictionaries.spec import TranscoderTrainSpec
from tracekit.dictionaries.train import train_transcoders
kill_after = int(sys.argv[2])
if kill_after > 0:
    step = torch.optim.Adam.step
    count = [0]
    def counted(self, *a, **k):
        out = step(self, *a, **k)
        count[0] += 1
        if count[0] == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    torch.optim.Adam.step = counted
m = make_perturbed("llama")
path, hit, stats = train_transcoders(m, TranscoderTrainSpec(**json.loads(sys.argv[3])), cache_dir=sys.argv[1])
print(path)
"""


def _child(cache: Path, kill_after: int, spec: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = start_child([sys.executable, "-c", _CHILD.format(tests=str(ROOT / "tests")), str(cache), str(kill_after),
                        json.dumps(spec)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = communicate_or_dump(proc, 600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_resume_after_kill_gives_the_uninterrupted_weights(tmp_path):
    spec = {**TINY, "training_tokens": 1536}  # 12 steps per layer, a checkpoint every 4
    killed = _child(tmp_path / "k", 12 + 6, spec)  # layer 0 done, layer 1 killed after step 6 (checkpoint at 4)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    partial = [p for p in (tmp_path / "k").iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1
    assert (partial[0] / "layer_0.pt").is_file() and (partial[0] / "ckpt_1.pt").is_file()
    assert not (partial[0] / "layer_1.pt").exists()
    resumed = _child(tmp_path / "k", 0, spec)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = _child(tmp_path / "w", 0, spec)
    assert whole.returncode == 0, whole.stderr[-2000:]
    from safetensors.torch import load_file

    pk, pw = Path(resumed.stdout.strip().splitlines()[-1]), Path(whole.stdout.strip().splitlines()[-1])
    assert pk.name == pw.name  # the same content key
    for L in range(3):
        a, b = load_file(str(pk / f"layer_{L}.safetensors")), load_file(str(pw / f"layer_{L}.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), L


# ---- the store ----------------------------------------------------------------------------------


def _write(model, path: Path, hooks: list[str], t: TranscoderTrainSpec) -> None:
    n = t.dataset_tokens or t.training_tokens
    rows = corpus_rows(model, t.corpus, t.context_size, n, "all", packed=True)
    write_store(model, rows, hooks, path, position="all", dtype="float32",
                source={"kind": "corpus", "source": t.corpus, "seq_len": t.context_size, "max_tokens": n,
                        "packed": True})


def test_store_given_same_weights_and_refusals(llama, tmp_path):
    t = TranscoderTrainSpec.model_validate({**TINY, "layers": [0, 1]})
    hooks = ["blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out", "blocks.1.mlp.hook_in", "blocks.1.hook_mlp_out"]
    _write(llama, tmp_path / "store", hooks, t)
    own = load_transcoders(TranscoderSpec.model_validate(dict(train=t)), llama, cache_dir=tmp_path / "c1")
    given = load_transcoders(TranscoderSpec.model_validate(dict(train=t.model_copy(update={"store": str(tmp_path / "store")}))), llama,
                             cache_dir=tmp_path / "c2")
    assert _equal(_params(own.dictionaries), _params(given.dictionaries))
    other = make_perturbed("llama", tied=True)
    with pytest.raises(StoreError, match=r"transcoders\.train\.store.*another model"):
        train_transcoders(other, t.model_copy(update={"store": str(tmp_path / "store")}), cache_dir=tmp_path / "c3")
    _write(llama, tmp_path / "half", hooks[:3], t)
    with pytest.raises(StoreError, match=r"transcoders\.train\.store.*blocks\.1\.hook_mlp_out"):
        train_transcoders(llama, t.model_copy(update={"store": str(tmp_path / "half")}), cache_dir=tmp_path / "c3")
    with pytest.raises(StoreError, match="context_size"):
        train_transcoders(llama, t.model_copy(update={"store": str(tmp_path / "store"), "context_size": 16}),
                          cache_dir=tmp_path / "c3")


def test_a_set_for_another_model_is_refused(llama, tmp_path):
    lt = load_transcoders(TranscoderSpec.model_validate(dict(train={**TINY, "layers": [0]})), llama, cache_dir=tmp_path)
    other = make_perturbed("llama", tied=True)
    with pytest.raises(SAEError, match="another model"):
        load_transcoders(TranscoderSpec(path=lt.path), other)
    back = load_transcoders(TranscoderSpec(path=lt.path), llama)
    assert back.cache_hit and _equal(_params(back.dictionaries), _params(lt.dictionaries))


# ---- quality: a transcoder that is the MLP ------------------------------------------------------


def _relu_gpt2(process_weights: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    from tracekit.model.load import wrap_hf_model
    from tracekit.model.source import _load_tokenizer
    from tracekit.model.spec import ModelSpec

    cfg = GPT2Config(vocab_size=50304, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64,
                     activation_function="relu")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(cfg).eval()
    perturb_params(hf)
    spec = ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE, process_weights=process_weights,
                     device="cpu", seed=0)
    return wrap_hf_model(hf, _load_tokenizer(GPT2_BPE), spec, bridge_name="gpt2")


def _mlp_as_transcoders(model, scale: float = 1.0) -> DictionarySet:
    out = {}
    for L in range(int(model.cfg.n_layers)):
        mlp = model.blocks[L].mlp
        d = Dictionary(32, 64, 32, activation="relu", hook_in=f"blocks.{L}.mlp.hook_in",
                       hook_out=f"blocks.{L}.hook_mlp_out", layer=L)
        with torch.no_grad():
            d.W_enc.copy_(mlp.W_in)
            d.b_enc.copy_(mlp.b_in)
            d.W_dec.copy_(mlp.W_out * scale)
            d.b_dec.copy_(mlp.b_out)
        out[L] = d
    return DictionarySet(out)


@pytest.mark.parametrize("process_weights", [True, False])
def test_quality_of_the_mlp_itself_is_exact(process_weights):
    model = _relu_gpt2(process_weights)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 50000, (3, 16), generator=g)
    toks[:, 0] = 50256
    per_layer, overall = transcoder_quality(model, _mlp_as_transcoders(model), toks, batch_size=2)
    assert np.abs(per_layer["fvu"].to_numpy()).max() < 1e-10 and np.abs(per_layer["mse"].to_numpy()).max() < 1e-10
    assert abs(overall["kl"]) < 1e-10 and abs(overall["ce_delta"]) < 1e-10
    assert overall["n_tokens"] == 48 and overall["n_predictions"] == 45
    wrong_l, wrong_o = transcoder_quality(model, _mlp_as_transcoders(model, scale=1.5), toks)
    assert bool((wrong_l["fvu"] > 1e-3).all()) and wrong_o["kl"] > 1e-6  # the replacement is really spliced in
    # FVU by hand on layer 0 (the model's own activations)
    got = {}
    model.run_with_hooks(toks, fwd_hooks=[(h, lambda a, hook: got.__setitem__(hook.name, a.detach()))
                                          for h in ("blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out")])
    d = _mlp_as_transcoders(model, scale=1.5)[0]
    y, y_hat = got["blocks.0.hook_mlp_out"].double(), d(got["blocks.0.mlp.hook_in"]).double()
    fvu = float((y - y_hat).pow(2).sum() / (y - y.reshape(-1, 32).mean(0)).pow(2).sum())
    assert abs(fvu - float(wrong_l["fvu"].iloc[0])) < 1e-9


def test_quality_leaves_no_hooks_behind_when_it_fails():
    model = _relu_gpt2(True)
    bad = _mlp_as_transcoders(model)
    bad.dictionaries[1] = Dictionary(16, 8, 32, hook_in="blocks.1.mlp.hook_in", hook_out="blocks.1.hook_mlp_out",
                                     layer=1)  # the wrong input width: the matmul fails mid-run
    with pytest.raises(RuntimeError):
        transcoder_quality(model, bad, torch.tensor([[50256, 464, 3139]]))
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())


# ---- the kind -----------------------------------------------------------------------------------


def test_kind_trains_then_loads(llama, tmp_path, monkeypatch):
    from tracekit.experiments.transcoders import TranscoderTrain

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path))
    exp = TranscoderTrain.model_validate({"transcoders": {"train": {**TINY, "layers": [0, 1]}}})
    r = exp.run(llama, progress=False)
    s = r.summary()
    assert not s["cache_hit"] and s["n_layers"] == 2 and len(s["fvu_by_layer"]) == 2
    assert list(r.tables["layers"]["layer"]) == [0, 1]
    assert {"ce_model", "ce_replacement", "kl", "fvu_mean"} <= set(r.tables["overall"].columns)
    assert "FVU" in r.report()
    r2 = exp.run(llama, progress=False)
    assert r2.summary()["cache_hit"]
    assert r2.tables["layers"]["fvu"].tolist() == r.tables["layers"]["fvu"].tolist()
    with pytest.raises(ValueError, match="train"):
        TranscoderTrain.model_validate({"transcoders": {"path": "x"}})


# ---- plain SAEs without SAELens (the TransformerLens 4 environment) -----------------------------


def test_autoencoder_train_without_the_package_writes_its_dir(tiny_gpt2, tmp_path, monkeypatch):
    """Where SAELens cannot be imported, train_sae trains with tracekit's trainer (seeded) and writes
    SAELens' directory format, cached under another key than SAELens' runner would use."""
    import tracekit.sae.train as sae_train
    from tracekit.compat import has_sae_lens
    from tracekit.dictionaries.formats import load_saelens_dir
    from tracekit.fastpath import residual_stream
    from tracekit.sae.spec import SAETrainSpec
    from tracekit.tokens import pad_ids

    installed = has_sae_lens()
    monkeypatch.setattr(sae_train, "has_sae_lens", lambda: False)
    t = SAETrainSpec(hook="blocks.1.hook_resid_pre", training_tokens=8192, dataset_tokens=2048, eval_tokens=256,
                     context_size=32, train_batch_size_tokens=256, k=8, expansion_factor=2, dead_feature_window=8)
    path, hit, stats = sae_train.train_sae(tiny_gpt2, t, cache_dir=tmp_path / "a")
    assert not hit and stats["trainer"].startswith("tracekit-")
    assert {"cfg.json", "sae_weights.safetensors", "tracekit_train.json"} <= {p.name for p in path.iterdir()}
    cfg = json.loads((path / "cfg.json").read_text())
    assert cfg["architecture"] == "topk" and cfg["k"] == 8 and cfg["metadata"]["hook_name"] == t.hook
    again, hit2, _ = sae_train.train_sae(tiny_gpt2, t, cache_dir=tmp_path / "a")
    assert hit2 and again == path
    other, _, _ = sae_train.train_sae(tiny_gpt2, t, cache_dir=tmp_path / "b")  # same seed: same weights
    a, b = load_saelens_dir(path), load_saelens_dir(other)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    toks = pad_ids(tiny_gpt2, [[50256] + list(range(1000, 1031))])
    x = residual_stream(tiny_gpt2, toks, [t.hook])[0].reshape(-1, 64)[1:]
    with torch.no_grad():
        fvu = float((a(x) - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
    assert fvu < 0.95, fvu  # better than the mean on a random tiny model's residual stream
    if installed:
        monkeypatch.setattr(sae_train, "has_sae_lens", lambda: True)
        assert sae_train._train_key(tiny_gpt2, t) != path.name  # SAELens' runner keys another entry


def test_a_layer_over_the_budget_is_refused_before_the_store(llama, tmp_path):
    import tracekit
    from tracekit.core.errors import MemoryBudgetError

    with tracekit.memory_budget("64KiB"), pytest.raises(MemoryBudgetError, match="transcoder training"):
        train_transcoders(llama, TranscoderTrainSpec.model_validate(TINY), cache_dir=tmp_path)
    assert not (tmp_path / "stores").exists()  # nothing written, no forward pass


def test_models_differing_only_in_bos_get_their_own_stores(tmp_path):
    """The trainer's own store is keyed by the whole model identity (BOS, basis, dtype), as the store's
    write plan: the same weights loaded without BOS write another store instead of being refused."""
    t = TranscoderTrainSpec.model_validate({**TINY, "layers": [0]})
    a, _, _ = train_transcoders(make_perturbed("llama", prepend_bos=True), t, cache_dir=tmp_path)
    b, _, _ = train_transcoders(make_perturbed("llama", prepend_bos=False), t, cache_dir=tmp_path)
    assert a != b and len(list((tmp_path / "stores").iterdir())) == 2
