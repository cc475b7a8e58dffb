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

import pytest
import torch

import tracekit
from tracekit.activations import ActivationStore, prompt_rows, write_store
from tracekit.activations import chunking
from tracekit.core.errors import MemoryBudgetError

PROMPTS = ["The capital of France is", "The capital city of Japan, as everyone knows, is", "In the capital",
           "A capital letter", "Our capital of Spain is nice", "The capital of Italy is", "Some capital here",
           "Money and capital"]
HOOKS = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.1.mlp.hook_post", "blocks.0.attn.hook_z"]


@pytest.fixture
def chunks(monkeypatch):
    """Counts the chunks every engine runs: ``calls[what]`` = the number of ``fn(slice)`` calls."""
    calls: dict[str, int] = {}
    real = chunking.run_chunked

    def counting(fn, n, chunk, align=1, what="tracekit"):
        def counted(sl):
            calls[what] = calls.get(what, 0) + 1
            fn(sl)
        return real(counted, n, chunk, align, what)

    monkeypatch.setattr(chunking, "run_chunked", counting)
    return calls


def _store(model, path, position="all", **kw):
    return write_store(model, prompt_rows(model, PROMPTS, position), HOOKS, path, position=position,
                       source={"kind": "prompts"}, batch_size=4, shard_mb=0.004, **kw)


@pytest.mark.parametrize("position, budget", [("all", "200KiB"), ("last", "120KiB"), ("mean", "200KiB")])
def test_store_write_chunked_equals_unchunked_byte_for_byte(tiny_model, tmp_path, chunks, position, budget):
    _store(tiny_model, tmp_path / "free", position)
    assert not chunks
    # one row (up to 13 tokens) needs ~90 KiB (last) to ~130 KiB (all, mean: every token read), a
    # write batch of 4 rows 0.35-0.5 MiB: 1-2 rows per forward pass
    with tracekit.memory_budget(budget):
        _store(tiny_model, tmp_path / "tight", position)
    assert chunks["activation store write"] >= 4  # 2 write batches, each in 2 or more forward passes
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
