"""SAE training from an activation store (``sae.train.store``, :mod:`tracekit.sae.store`).

A packed corpus store (``corpus: {packed: true}``) holds exactly the windows SAE training packs
(:func:`tracekit.sae._corpus_windows`) and, at every position (BOS included), exactly the
activations training caches by running the model (atol 0: same windows, same batches of 16). An SAE
trained from it equals the SAE trained from the model: SAELens sees the same cached-activations
dataset and the same seed, so the weights are equal (atol 0; float32 on CPU, deterministic). Stores
that cannot stand in are refused naming ``sae.train.store``; a tuned lens refuses a packed store.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers import make_perturbed
from tracekit.activations import ActivationStore, StoreError
from tracekit.experiments.activations import CacheActivations
from tracekit.fastpath import residual_stream
from tracekit.sae import SAETrainSpec, _corpus_windows, _train_key, train_sae
from tracekit.tokens import pad_ids

HOOK = "blocks.1.hook_resid_pre"
TRAIN = {"hook": HOOK, "d_sae": 32, "k": 4, "training_tokens": 1024, "dataset_tokens": 512, "eval_tokens": 128,
         "context_size": 32, "train_batch_size_tokens": 128}


@pytest.fixture(scope="module")
def model():
    """Tiny GPT-2 with perturbed norms and biases, processed weights, BOS prepended."""
    return make_perturbed("gpt2")


def _store(model, path, *, packed=True, seq_len=32, max_tokens=1024, hooks=(HOOK,), source="stdlib", **kw):
    cfg = {"path": str(path), "corpus": {"source": source, "seq_len": seq_len, "max_tokens": max_tokens,
                                         "packed": packed},
           "hooks": list(hooks), "batch_size": 16, "shard_mb": 0.05, **kw}
    CacheActivations.model_validate(cfg).run(model, progress=False)
    return str(path)


def test_packed_store_holds_the_sae_windows_and_activations(model, tmp_path):
    store = ActivationStore(_store(model, tmp_path / "st"))
    wins = _corpus_windows(model, "stdlib", 32, 0, 1024, "corpus")
    assert len(wins) == int(store.manifest["n_rows"]) and len(store) == len(wins) * 32 and len(store.files) > 1
    assert store.token_ids.tolist() == [t for w in wins for t in w]  # BOS included, every position
    assert store.positions.tolist() == list(range(32)) * len(wins)
    direct = torch.cat([residual_stream(model, pad_ids(model, wins[i:i + 16]), [HOOK])[0].reshape(-1, int(model.cfg.d_model))
                        for i in range(0, len(wins), 16)])
    assert torch.equal(store.get(HOOK), direct)


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
@pytest.mark.parametrize("arch, processed", [("gpt2", True), ("llama", False)], ids=["gpt2-processed", "llama-raw"])
def test_sae_from_store_equals_sae_from_model(arch, processed, tmp_path, monkeypatch):
    """Perturbed GPT-2 (LayerNorm, biases; weights processed) and Llama (RMSNorm, GQA; raw)."""
    model = make_perturbed(arch, process_weights=processed)
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    path = _store(model, tmp_path / "st")
    d_store, hit, s_store = train_sae(model, SAETrainSpec(**TRAIN, store=path))
    assert hit is False and s_store["activations_from"] == "store" and s_store["store_manifest_sha256"]
    d_model, _, s_model = train_sae(model, SAETrainSpec(**TRAIN))
    assert s_model["activations_from"] == "model" and d_store != d_model  # the store is part of the key
    assert s_store["dataset_tokens"] == s_model["dataset_tokens"] and s_store["train_windows"] == s_model["train_windows"]
    w_store, w_model = load_file(f"{d_store}/sae_weights.safetensors"), load_file(f"{d_model}/sae_weights.safetensors")
    assert set(w_store) == set(w_model)
    for k in w_store:
        assert torch.equal(w_store[k], w_model[k]), k
    assert not any(p.name.startswith(".") for p in d_store.iterdir())  # no scratch left in the published SAE
    # a second run is a cache hit; the same store at another path is the same entry
    again = tmp_path / "moved"
    (tmp_path / "st").rename(again)
    d2, hit2, _ = train_sae(model, SAETrainSpec(**TRAIN, store=str(again)))
    assert hit2 is True and d2 == d_store


@pytest.mark.sae_train  # the training's cache key (it names the trainer's version)
def test_store_key_follows_content(model, tmp_path):
    a = _store(model, tmp_path / "a")
    b = _store(model, tmp_path / "b", max_tokens=2048)
    from tracekit.sae.store import store_windows

    wins = _corpus_windows(model, "stdlib", 32, 0, 512, "corpus")
    ka = store_windows(model, SAETrainSpec(**TRAIN, store=a), wins).manifest_sha256
    kb = store_windows(model, SAETrainSpec(**TRAIN, store=b), wins).manifest_sha256
    assert ka != kb and _train_key(model, SAETrainSpec(**TRAIN), ka) != _train_key(model, SAETrainSpec(**TRAIN), kb)


@pytest.mark.parametrize("case, match", [
    ("per_document", "packed corpus windows"),
    ("seq_len", "context_size"),
    ("other_corpus", "corpus"),
    ("missing_hook", "has no"),
    ("too_small", "fewer than"),
    ("other_model", "another model"),
])
@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
def test_store_refused(model, tmp_path, case, match, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    train = dict(TRAIN)
    if case == "per_document":
        path = _store(model, tmp_path / "st", packed=False)
    elif case == "seq_len":
        path = _store(model, tmp_path / "st", seq_len=16)
    elif case == "other_corpus":
        text = tmp_path / "c.txt"
        text.write_text("\n\n".join(f"Paragraph {i} is about the river and the old stone bridge." for i in range(200)))
        path = _store(model, tmp_path / "st", source=str(text))
    elif case == "missing_hook":
        path = _store(model, tmp_path / "st", hooks=("blocks.0.hook_resid_pre",))
    elif case == "too_small":
        path = _store(model, tmp_path / "st", max_tokens=256)
    else:
        path = _store(make_perturbed("llama"), tmp_path / "st")
    with pytest.raises(StoreError, match=match) as e:
        train_sae(model, SAETrainSpec(**train, store=path))
    assert "sae.train.store" in str(e.value)
    assert not (tmp_path / "cache" / "saes").exists() or not any((tmp_path / "cache" / "saes").iterdir())


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
def test_changed_corpus_refused(model, tmp_path, monkeypatch):
    """The corpus file changed after the store was written: its windows are not the store's."""
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "c.txt"
    text.write_text("\n\n".join(f"Paragraph {i} is about the river and the old stone bridge." for i in range(200)))
    path = _store(model, tmp_path / "st", source=str(text))
    text.write_text("\n\n".join(f"Chapter {i} tells of a winter market near the harbour." for i in range(200)))
    with pytest.raises(StoreError, match="changed since the store was written"):
        train_sae(model, SAETrainSpec(**{**TRAIN, "corpus": str(text)}, store=path))


def test_packed_needs_position_all_and_tuned_lens_refuses_it(model, tmp_path):
    from tracekit.errors import ConfigError
    from tracekit.lenses.train import TunedLensSpec, store_tokens

    with pytest.raises((ConfigError, ValueError), match="position: all"):
        CacheActivations.model_validate({"path": str(tmp_path / "x"), "corpus": {"packed": True}, "hooks": [HOOK],
                                         "position": "last"})
    path = _store(model, tmp_path / "st")
    with pytest.raises(StoreError, match="packed"):
        store_tokens(model, TunedLensSpec(train_tokens=64, held_out_tokens=64, store=path))


@pytest.mark.sae_train  # trains an SAE: SAELens' runner or tracekit's own trainer
def test_sae_training_follows_its_seed_and_keeps_the_callers_rng(model, tmp_path):
    """SAELens' runner does not seed torch: tracekit seeds it with ``sae.train.seed`` (the same seed
    gives the same SAE whatever the global RNG state; another seed another SAE) and restores the
    caller's RNG state."""
    def weights(seed, cache, burn):
        torch.manual_seed(burn)
        state = torch.random.get_rng_state()
        d, _, _ = train_sae(model, SAETrainSpec(**{**TRAIN, "seed": seed}), cache_dir=tmp_path / cache)
        assert torch.equal(torch.random.get_rng_state(), state)  # the caller's RNG untouched
        return load_file(f"{d}/sae_weights.safetensors")

    a, b, c = weights(0, "a", 1), weights(0, "b", 2), weights(1, "c", 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["W_dec"], c["W_dec"])
