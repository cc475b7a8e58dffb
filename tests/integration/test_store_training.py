"""Tuned-lens training from an activation store (``tuned.store``): the lens trained from a store equals
the lens trained by running the model on the same tokens; a store from another model, without a
hidden state's hook, not of corpus tokens at position ``all``, or too small is refused naming
``tuned.store``; the cache key includes the store's manifest.

Tolerance: atol 1e-6 on the translators' parameters. The store and the model path read the same
residuals of the same windows, but in other padded batches (store batch_size 8 of other windows vs the lens's 8), so
they could differ in the last float32 bit (~1e-7 relative), which the training (same seed, same token
order) would carry through two epochs of Adam; measured: 0.0 on both models (parameters up to 0.015)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from helpers import make_perturbed
from tracekit.activations import StoreError, prompt_rows, write_store
from tracekit.experiments.activations import CacheActivations
from tracekit.lenses.train import TunedLensSpec, load_or_train_tuned_lens, store_tokens, train_tuned_lens
from tracekit.logit_lens import lens_points

SPEC = {"train_tokens": 256, "seq_len": 32, "epochs": 2, "batch_tokens": 64, "held_out_tokens": 64, "lr": 3e-3}
WORDS = ("the river city north market stone bridge light evening winter people build small old road near "
         "water trade grew long after king wrote letters about gardens").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """A JSONL corpus of 24 documents of ~40 words (two 32-token windows each; ~20% held out)."""
    gen = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(gen.choice(WORDS) for _ in range(40)) + "."}) + "\n"
                            for _ in range(24)))
    return {"source": str(path), "seq_len": 32, "max_tokens": None}


@pytest.fixture(scope="module", params=[("gpt2", True), ("llama", False)], ids=["gpt2-processed", "llama-raw"])
def model(request):
    arch, pw = request.param
    return make_perturbed(arch, process_weights=pw)


def _store(model, path, corpus, **kw):
    cfg = {"path": str(path), "corpus": corpus, "sites": ["resid_post"], "layers": "all", "batch_size": 8,
           "shard_mb": 0.05, **kw}
    CacheActivations.model_validate(cfg).run(model, progress=False)
    return str(path)


def test_lens_from_store_equals_lens_from_model(model, corpus, tmp_path):
    path = _store(model, tmp_path / "st", corpus)
    from_store = train_tuned_lens(model, TunedLensSpec(**SPEC, store=path))
    from_model = train_tuned_lens(model, TunedLensSpec(**SPEC, corpus=corpus["source"]))
    rs, rm = from_store.record, from_model.record
    assert rs is not None and rm is not None
    # the same windows (split by document, cut at the same token) -> the same training tokens
    assert rs["tokens_sha256"] == rm["tokens_sha256"] and rs["train_tokens"] == rm["train_tokens"] == 256
    assert rs["store"]["dtype"] == "float32" and "store" not in rm
    ps, pm = dict(from_store.named_parameters()), dict(from_model.named_parameters())
    assert ps.keys() == pm.keys()
    moved = max(float(p.abs().max()) for p in pm.values())
    assert moved > 1e-3  # the lens did train (translators start at zero)
    for k in ps:
        torch.testing.assert_close(ps[k], pm[k], atol=1e-6, rtol=0, msg=k)
    for key in ("held_out_kl", "held_out_kl_logit", "train_kl"):
        assert rs[key] == pytest.approx(rm[key], abs=1e-5), key


def test_cache_key_includes_the_store(tiny_llama, corpus, tmp_path):
    a = _store(tiny_llama, tmp_path / "a", corpus)
    b = _store(tiny_llama, tmp_path / "b", {**corpus, "max_tokens": 800})  # another manifest, the same tokens used
    spec = TunedLensSpec(**{**SPEC, "epochs": 1}, store=a, corpus=corpus["source"])
    first = load_or_train_tuned_lens(tiny_llama, spec, cache_dir=tmp_path / "c")
    again = load_or_train_tuned_lens(tiny_llama, spec, cache_dir=tmp_path / "c")
    other = load_or_train_tuned_lens(tiny_llama, spec.model_copy(update={"store": b}), cache_dir=tmp_path / "c")
    direct = load_or_train_tuned_lens(tiny_llama, spec.model_copy(update={"store": None}), cache_dir=tmp_path / "c")
    assert first.source["from"] == "trained" and again.source["from"] == "cache"
    assert again.source["key"] == first.source["key"]
    assert len({first.source["key"], other.source["key"], direct.source["key"]}) == 3
    assert other.source["from"] == direct.source["from"] == "trained"


def test_refusals_name_the_field(tiny_llama, tiny_gpt2, corpus, tmp_path):
    good = _store(tiny_llama, tmp_path / "good", corpus)

    def refused(model, path, *match, **spec):
        with pytest.raises(StoreError) as e:
            store_tokens(model, TunedLensSpec(**{**SPEC, **spec}, store=str(path)))
        msg = str(e.value)
        assert msg.startswith("tuned.store:"), msg
        for m in match:
            assert m in msg, msg

    refused(tiny_gpt2, good, "another model")
    refused(tiny_llama, tmp_path / "nothing", "no activation store")
    n = tiny_llama.cfg.n_layers
    hooks = [p.hook for p in lens_points(n, "hidden_states")]
    few = {**corpus, "max_tokens": 40}  # refused before its tokens are counted
    part = _store(tiny_llama, tmp_path / "part", few, sites=[], layers="all", hooks=hooks[:-1])
    refused(tiny_llama, part, hooks[-1])
    last = _store(tiny_llama, tmp_path / "last", few, position="last")
    refused(tiny_llama, last, "position 'last'", "position: all")
    prompts = tmp_path / "prompts"
    write_store(tiny_llama, prompt_rows(tiny_llama, ["The capital of France is"], "all"), hooks, prompts,
                position="all", source={"kind": "prompts"})
    refused(tiny_llama, prompts, "'prompts'")
    refused(tiny_llama, good, "tuned.train_tokens", "fewer than", train_tokens=5000)
    refused(tiny_llama, good, "tuned.held_out_tokens", held_out_tokens=5000)
