"""The memory budget (``run.memory_budget``) in the engines that produce activations: the activation
store's write, SAE decomposition and SAE training's activation cache, tuned-lens residual caching
and probing extraction (:mod:`tracekit.activations.chunking`).

Each runs on a tiny model under a budget far below the naive need, so the user's batches run as
many chunks of rows (counted through ``chunking.run_chunked``), and the result equals the
unbudgeted run exactly: the stores byte for byte (every shard's sha256), the decomposition tables
with ``DataFrame.equals``, the trained SAE / tuned lens weights with ``torch.equal`` (same seed: the
optimiser's batches are the user's, only the forward passes that produce activations are chunked).
A budget below one row is refused with ``MemoryBudgetError`` before any forward pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracekit
from tracekit.activations import ActivationStore, chunking, prompt_rows, write_store
from tracekit.core.errors import MemoryBudgetError

PROMPTS = ["The capital of France is", "The capital city of Japan, as everyone knows, is", "In the capital",
           "A capital letter", "Our capital of Spain is nice", "The capital of Italy is", "Some capital here",
           "Money and capital"]
HOOKS = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.1.mlp.hook_post", "blocks.0.attn.hook_z"]


@pytest.fixture
def chunks(monkeypatch):
    """Counts the chunks every engine runs: ``calls[what]`` = the number of ``fn(slice)`` calls of the
    batches that were split (a batch run in one pass is not counted)."""
    calls: dict[str, int] = {}
    real = chunking.run_chunked

    def counting(fn, n, chunk, align=1, what="tracekit"):
        if chunk >= n:  # one pass: not chunked
            return real(fn, n, chunk, align, what)

        def counted(sl):
            calls[what] = calls.get(what, 0) + 1
            fn(sl)
        return real(counted, n, chunk, align, what)

    monkeypatch.setattr(chunking, "run_chunked", counting)
    return calls


def _store(model, path, position="all", **kw):
    return write_store(model, prompt_rows(model, PROMPTS, position), HOOKS, path, position=position,
                       source={"kind": "prompts"}, batch_size=4, shard_mb=0.004, **kw)


@pytest.mark.parametrize("position, budget", [("all", "300KiB"), ("last", "200KiB"), ("mean", "300KiB")])
def test_store_write_chunked_equals_unchunked_byte_for_byte(tiny_model, tmp_path, chunks, position, budget):
    _store(tiny_model, tmp_path / "free", position)
    assert not chunks
    # one row (up to 13 tokens) needs ~90 KiB (last) to ~130 KiB (all, mean: every token read), a
    # write batch of 4 rows 0.35-0.5 MiB: 2 rows per forward pass
    with tracekit.memory_budget(budget):
        _store(tiny_model, tmp_path / "tight", position)
    assert chunks["activation store write"] >= 2  # the longer write batch in forward passes of 2 rows
    a, b = ActivationStore(tmp_path / "free"), ActivationStore(tmp_path / "tight")
    assert [s["sha256"] for s in a.manifest["shards"]] == [s["sha256"] for s in b.manifest["shards"]]
    assert len(a.manifest["shards"]) > 1
    for h in HOOKS:
        assert torch.equal(a.get(h), b.get(h))


def test_store_write_refuses_a_row_that_does_not_fit(tiny_gpt2, tmp_path):
    with tracekit.memory_budget("4KiB"), pytest.raises(MemoryBudgetError) as e:
        _store(tiny_gpt2, tmp_path / "st")
    msg = str(e.value)
    assert "activation store write" in msg and "run.memory_budget" in msg and "shorten the rows" in msg
    assert not list((tmp_path / "st").glob("shard-*"))


# ---------------------------------------------------------------------------------------------
# SAE decomposition (sae_features) and SAE training


SAE_PROMPTS = ["The capital of France is the city of", "Paris is in", "In Paris the capital", "Rome is the capital of",
               "The city of", "Our capital", "France and Paris, as everyone knows, and", "A"]


def _sae_features(model, d):
    from tracekit import SAEFeatures

    return SAEFeatures(sae={"path": str(d)}, prompts=SAE_PROMPTS, target=" Paris", foil=" London", top_k=4,
                       batch_size=8).run(model, progress=False)


def test_sae_decomposition_chunked_equals_unchunked(tiny_gpt2, tmp_path, chunks):
    from test_sae import make_sae_dir

    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre", arch="topk", d_sae=64)
    free = _sae_features(tiny_gpt2, d)
    assert "SAE feature decomposition" not in chunks
    # one row (<= 10 tokens) keeps its graph and logits (~7 MiB: the 50k vocabulary) for the backward
    # pass; the batch of 8 rows needs ~56 MiB
    with tracekit.memory_budget("20MiB"):
        tight = _sae_features(tiny_gpt2, d)
    assert chunks["SAE feature decomposition"] == 4
    assert set(free.tables) == set(tight.tables)
    for name in free.tables:
        assert free.tables[name].equals(tight.tables[name]), name
    with tracekit.memory_budget("1MiB"), pytest.raises(MemoryBudgetError, match="SAE feature decomposition"):
        _sae_features(tiny_gpt2, d)


TRAIN = {"hook": "blocks.1.hook_resid_pre", "d_sae": 32, "k": 4, "training_tokens": 1024, "dataset_tokens": 512,
         "eval_tokens": 128, "context_size": 32, "train_batch_size_tokens": 128}


def test_sae_training_under_a_budget_gives_the_same_sae(tiny_gpt2, tmp_path, monkeypatch, chunks):
    from safetensors.torch import load_file

    from tracekit.sae import SAETrainSpec, train_sae
    from tracekit.sae.train import training_bytes

    spec = SAETrainSpec(**TRAIN)
    need = training_bytes(spec, 64, 32)
    assert need < 1.5 * 2 ** 20  # one optimiser step (SAELens' buffer included) fits the budget below
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "free"))
    d_free, hit, _ = train_sae(tiny_gpt2, spec)
    assert not hit and "SAE training activations" not in chunks
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "tight"))
    # one 32-token window's forward pass ~0.27 MiB; a batch of 16 windows ~4.3 MiB
    with tracekit.memory_budget("1.5MiB"):
        d_tight, hit, _ = train_sae(tiny_gpt2, spec)
    assert not hit and chunks["SAE training activations"] >= 3
    a, b = load_file(str(d_free / "sae_weights.safetensors")), load_file(str(d_tight / "sae_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "refused"))
    with tracekit.memory_budget("512KiB"), pytest.raises(MemoryBudgetError, match="SAE training") as e:
        train_sae(tiny_gpt2, spec)
    assert "train_batch_size_tokens" in str(e.value)
    assert not (tmp_path / "refused" / "saes").exists() or not any((tmp_path / "refused" / "saes").iterdir())


# ---------------------------------------------------------------------------------------------
# tuned lens


LENS = {"train_tokens": 1024, "seq_len": 128, "epochs": 1, "batch_tokens": 4, "held_out_tokens": 0, "lr": 3e-3,
        "batch_size": 8, "cache": False}


def test_tuned_lens_residual_cache_chunked_equals_unchunked(tiny_llama, tmp_path, chunks):
    from tracekit.lenses.train import TunedLensSpec, cache_residuals, split_windows

    spec = TunedLensSpec(**LENS)
    wins = split_windows(tiny_llama, spec.corpus, "train", 600, 40)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    free = cache_residuals(tiny_llama, wins, tmp_path / "a", batch_size=8)
    with tracekit.memory_budget("1MiB"):  # one 40-token window ~0.4 MiB, the batch of 8 ~3 MiB
        tight = cache_residuals(tiny_llama, wins, tmp_path / "b", batch_size=8)
    assert chunks["tuned lens residual cache"] >= 2 * len(wins) // 8
    assert np.array_equal(free.acts, tight.acts) and np.array_equal(free.next_ids, tight.next_ids)


def test_tuned_lens_training_under_a_budget_gives_the_same_lens(tiny_gpt2, chunks):
    from tracekit.lenses.train import TunedLensSpec, train_tuned_lens, training_bytes

    spec = TunedLensSpec(**LENS)
    assert training_bytes(tiny_gpt2, spec, False) < 6 * 2 ** 20  # one step (4 tokens x 50k vocabulary)
    free = train_tuned_lens(tiny_gpt2, spec)
    assert "tuned lens residual cache" not in chunks
    # one 128-token window ~1.8 MiB (attention grows with its square); a batch of 8 ~15 MiB
    with tracekit.memory_budget("6MiB"):
        tight = train_tuned_lens(tiny_gpt2, spec)
    assert chunks["tuned lens residual cache"] >= 2 * free.record["train_windows"] // 8
    a, b = free.layer_translators.state_dict(), tight.layer_translators.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert free.record["train_kl"] == tight.record["train_kl"]
    with tracekit.memory_budget("2MiB"), pytest.raises(MemoryBudgetError, match="tuned lens training") as e:
        train_tuned_lens(tiny_gpt2, spec)
    assert "batch_tokens" in str(e.value)


# ---------------------------------------------------------------------------------------------
# probing extraction


@pytest.mark.parametrize("position", ["last", "all", "mean"])
def test_probing_extraction_chunked_equals_unchunked(tiny_model, chunks, position):
    from tracekit.probing import extract_activations

    with extract_activations(tiny_model, PROMPTS, HOOKS, position, batch_size=8) as free:
        want = {h: free.get(h) for h in HOOKS}
        rows, positions = free.rows, free.positions
    assert "probing extraction" not in chunks
    # one prompt (<= 13 tokens) with its logits ~5 MiB (the 50k vocabulary); the batch ~40 MiB
    with tracekit.memory_budget("10MiB"), extract_activations(tiny_model, PROMPTS, HOOKS, position,
                                                              batch_size=8) as tight:
        assert np.array_equal(rows, tight.rows) and np.array_equal(positions, tight.positions)
        for h in HOOKS:
            assert torch.equal(want[h], tight.get(h)), h
    assert chunks["probing extraction"] >= 4
    with tracekit.memory_budget("1MiB"), pytest.raises(MemoryBudgetError, match="probing extraction"):
        extract_activations(tiny_model, PROMPTS, HOOKS, position, batch_size=8)


def test_cache_activations_cli_obeys_run_memory_budget(tmp_path, capsys):
    """``tracekit cache-activations`` runs its steps under the config's ``run.memory_budget`` (as the
    runner does): a budget below one row is refused (exit 2) naming the setting, before any shard."""
    import argparse

    import yaml

    from helpers import GPT2_BPE, tiny_overrides
    from tracekit.activations_cli import add_commands, main

    model = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
             "device": "cpu"}
    step = {"kind": "activations", "path": str(tmp_path / "st"), "hooks": ["blocks.0.hook_resid_post"],
            "prompts": PROMPTS, "position": "all"}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": model, "run": {"memory_budget": "4KiB"}, "experiments": [step]}))
    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers(dest="cmd"))
    assert main(p.parse_args(["cache-activations", str(cfg), "--no-progress"])) == 2
    err = capsys.readouterr().err
    assert "activation store write: one row needs" in err and "run.memory_budget" in err
    assert not list((tmp_path / "st").glob("shard-*"))
    assert main(p.parse_args(["cache-activations", str(cfg), "--no-progress", "--set", "run.memory_budget=auto"])) == 0
    assert list((tmp_path / "st").glob("shard-*"))


def test_sae_feature_contexts_chunked_equal_unchunked(tiny_gpt2, tmp_path, monkeypatch):
    from test_sae import make_sae_dir

    import tracekit.sae.dashboard as dash
    from tracekit.sae import SAESpec, _corpus_windows, load_sae

    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre", arch="topk", d_sae=64)
    h = load_sae(SAESpec(path=str(d)), tiny_gpt2)
    wins = _corpus_windows(tiny_gpt2, "stdlib", 32, 0, 512, "corpus")
    assert len(wins) >= 16
    free = dash.top_activating_contexts(tiny_gpt2, h, [0, 5, 9], wins, top_n=4, batch_size=8)
    passes = []
    real = dash.row_slice
    monkeypatch.setattr(dash, "row_slice", lambda batch, sl: passes.append(sl.stop - sl.start) or real(batch, sl))
    # one 32-token window with its logits ~13 MiB (the 50k vocabulary); a batch of 8 ~105 MiB
    with tracekit.memory_budget("30MiB"):
        tight = dash.top_activating_contexts(tiny_gpt2, h, [0, 5, 9], wins, top_n=4, batch_size=8)
    assert len(passes) >= 4 * (len(wins) // 8) and max(passes) == 2  # passes of 2 windows
    assert free[0].equals(tight[0])
    assert free[1].keys() == tight[1].keys() and all(np.array_equal(free[1][f], tight[1][f]) for f in free[1])
