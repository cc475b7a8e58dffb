"""The replay engines obey ``run.memory_budget``: activation patching (both front-ends and the
kind), path patching, circuit evaluation, causal tracing and the steering dose-response run in many
small chunks under a budget far below what running every variant at once needs, with results equal
to the unbudgeted run's, and refuse by name (before the cached run is made) when the cached run
plus one variant does not fit.

Exactness: chunked and unchunked runs are compared with ``torch.equal`` / ``DataFrame.equals`` on
one thread (:class:`helpers.one_thread`). On several threads MKL splits a float32 matrix product's
rows between threads by the product's row count, so a row's last bit can depend on how many rows
share its product (measured here: row counts under 12 that are not multiples of 4, on 2 threads);
on one thread only products of 1-3 rows sum in another order, and the engines run their readout on
at least 4 rows for that reason (:data:`tracekit.patching.engine.MIN_READOUT_ROWS`).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import make_perturbed, one_thread
from tracekit import patching as P
from tracekit.causal_tracing import causal_trace, subject_span
from tracekit.circuits.faithfulness import circuit_bytes, evaluate_circuits, top_k_circuits
from tracekit.circuits.graph import build_graph, upstream_hooks
from tracekit.circuits.paths import path_patch, path_patch_bytes
from tracekit.core.budget import MemoryBudgetError, bytes_of, format_bytes
from tracekit.dataset.pairs import PromptPair
from tracekit.steering import SteerRow, dose_response, sequence_bytes
from tracekit.tokens import encode, single_token_id

PAIRS = [("The capital of France is", "The capital of Italy is", " Paris", " Rome"),
         ("The capital of Spain is", "The capital of Japan is", " Madrid", " Tokyo")]
SITES = ["resid_pre", "head_out", "mlp_out"]
MODES = ["denoising", "zero"]
METRICS = ["logit_diff", "kl"]


@pytest.fixture(scope="module")
def model():
    return make_perturbed("gpt2")


def _ids(m):
    c = [encode(m, p[0]) for p in PAIRS]
    x = [encode(m, p[1]) for p in PAIRS]
    return c, x, [single_token_id(m, p[2]) for p in PAIRS], [single_token_id(m, p[3]) for p in PAIRS]


def _hooks(m):
    return sorted({P.SITES[s].hook_name(L) for s in P.expand_sites(SITES) for L in range(m.cfg.n_layers)})


def _patching(m, **kw):
    c, x, t, f = _ids(m)
    return P.run_patching(m, c, x, SITES, MODES, METRICS, t, f, **kw)


def _patching_budget(m) -> int:
    """A budget that holds the cached run (as estimated before it is made) and one variant: far
    below running every variant at once."""
    c, _, _, _ = _ids(m)
    n_pos = len(c[0])
    return P.cached_run_bytes(m, 2 * len(c), n_pos, _hooks(m)) + P.replay_row_bytes(m, n_pos)


def test_patching_under_a_tiny_budget_runs_many_chunks_and_equals_the_unbudgeted_run(model):
    m = model
    budget = _patching_budget(m)
    with one_thread():
        ref = _patching(m)
        with tk.memory_budget(budget):
            got = _patching(m)
    n_variants = sum(len(j.values) for j in ref.jobs)
    n_pos = len(_ids(m)[0][0])
    naive = n_variants * P.replay_row_bytes(m, n_pos)
    assert naive > 10 * budget  # the budget is far below running every variant at once
    assert ref.batch_sizes == [P.AUTO_CAP] or ref.batch_sizes[0] >= 100
    assert 1 <= got.batch_sizes[0] <= 12 and n_variants > 20 * got.batch_sizes[0]
    assert len(ref.jobs) == len(got.jobs)
    for a, b in zip(ref.jobs, got.jobs):
        assert (a.mode, a.site.name) == (b.mode, b.site.name)
        assert torch.equal(a.values, b.values), (a.mode, a.site.name)
    assert torch.equal(ref.clean, got.clean) and torch.equal(ref.corrupted, got.corrupted)


def test_explicit_batch_size_caps_the_budget(model):
    out = _patching(model, batch_size=3, skip_unchanged=False)
    assert out.batch_sizes == [3]
    with tk.memory_budget(_patching_budget(model)):
        small = _patching(model, batch_size=10_000, skip_unchanged=False)
    assert small.batch_sizes[0] < 100


def test_patching_refuses_before_the_cached_run_when_one_variant_does_not_fit(model, monkeypatch):
    m = model

    def no_cache(*a, **k):
        raise AssertionError("the cached run was made before the refusal")

    monkeypatch.setattr(P.run, "cache_run", no_cache)
    need = _patching_budget(m)
    for budget in (need - 1, "64KiB"):
        with tk.memory_budget(budget), pytest.raises(MemoryBudgetError) as e:
            _patching(m)
        msg = str(e.value)
        assert "activation patching replay" in msg and "run.memory_budget" in msg
        assert f"needs about {format_bytes(need)}" in msg
    c, x, _, _ = _ids(m)
    metric = lambda lg, b: lg[:, 0]  # noqa: E731
    with tk.memory_budget("64KiB"), pytest.raises(MemoryBudgetError, match="run.memory_budget"):
        P.batched_act_patch_resid_pre(m, torch.tensor(x), torch.tensor(c), metric)


def test_batched_activation_patch_under_a_tiny_budget(model):
    m = model
    c, x, t, f = _ids(m)
    ct, xt = torch.tensor(c), torch.tensor(x)
    tt, ft = torch.tensor(t), torch.tensor(f)

    def metric(lg, b):
        r = torch.arange(len(b))
        return lg[r, tt[b]] - lg[r, ft[b]]

    n_pos = ct.shape[1]
    budget = (P.cached_run_bytes(m, 2 * len(c), n_pos, [f"blocks.{L}.hook_attn_out" for L in range(3)])
              + P.replay_row_bytes(m, n_pos))
    with one_thread():
        ref = P.batched_act_patch_attn_out(m, xt, ct, metric, skip_unchanged=False)
        with tk.memory_budget(budget):
            got = P.batched_act_patch_attn_out(m, xt, ct, metric, skip_unchanged=False)
    assert torch.equal(ref, got)


def test_patching_kind_under_a_tiny_budget(model):
    pairs = [PromptPair(clean=c, corrupted=x, target=t, foil=f) for c, x, t, f in PAIRS]
    kind = tk.ActivationPatching(pairs=pairs, sites=["resid_pre", "attn_out"], metrics=["logit_diff"])
    with one_thread():
        ref = kind.run(model, progress=False)
        with tk.memory_budget(_patching_budget(model)):
            got = kind.run(model, progress=False)
    for name in ("main", "baselines"):
        assert ref.tables[name].equals(got.tables[name]), name
    small = got.summary()["chunks"]["activation patching replay"]["variants"]
    assert small[0] <= 12 and ref.summary()["chunks"]["activation patching replay"]["variants"][0] > small[0]


def test_run_chunked_still_halves_on_out_of_memory_under_a_budget(model, monkeypatch):
    """An out-of-memory error in a budgeted replay halves the chunk, and the results are unchanged."""
    from tracekit.patching import engine as E

    real = E._replay
    calls = {"n": 0}

    def flaky(model, run, jobs, rows):
        if len(rows) > 1 and calls["n"] < 2:
            calls["n"] += 1
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, run, jobs, rows)

    with one_thread():
        with tk.memory_budget(_patching_budget(model)):
            ref = _patching(model)
        monkeypatch.setattr(E, "_replay", flaky)
        with tk.memory_budget(_patching_budget(model)):
            got = _patching(model)
    assert calls["n"] == 2
    assert ref.batch_sizes[0] >= 4 and got.batch_sizes[0] == ref.batch_sizes[0] // 2 // 2
    for a, b in zip(ref.jobs, got.jobs):
        assert torch.equal(a.values, b.values)


# ---- path patching and circuit evaluation ---------------------------------------------------------

def _rand_pairs(n_rows=3, n_pos=7):
    torch.manual_seed(0)
    clean = torch.randint(100, 5000, (n_rows, n_pos)).tolist()
    corr = [c[:] for c in clean]
    for i, c in enumerate(corr):
        c[2 + i % 3] += 17
    return clean, corr, [11 + i for i in range(n_rows)], [21 + i for i in range(n_rows)]


def test_path_patching_under_a_tiny_budget(model):
    m = model
    clean, corr, tgt, foil = _rand_pairs()
    graph = build_graph(m)
    senders = [[u] for u in graph.upstream[:-1]]  # every node but the last MLP
    receivers = [["logits"]] * len(senders)
    V, g, n_pos = len(senders), len(clean), len(clean[0])
    per, writes = path_patch_bytes(m, graph, g, n_pos, V)
    budget = P.cached_run_bytes(m, 2 * g, n_pos, upstream_hooks(graph)) + writes + per
    with one_thread():
        ref = path_patch(m, clean, corr, senders, receivers, tgt, foil)
        with tk.memory_budget(budget):
            got = path_patch(m, clean, corr, senders, receivers, tgt, foil)
        with tk.memory_budget(budget - 1), pytest.raises(MemoryBudgetError, match="path patching replay.*run.memory_budget"):
            path_patch(m, clean, corr, senders, receivers, tgt, foil)
    assert ref.batch_sizes[0] == V and got.batch_sizes[0] <= 4 and V > 3 * got.batch_sizes[0]
    assert torch.equal(ref.values, got.values)


def test_circuit_evaluation_under_a_tiny_budget(model):
    m = model
    clean, corr, tgt, foil = _rand_pairs()
    graph = build_graph(m)
    scores = torch.randn(graph.mask.shape, generator=torch.Generator().manual_seed(1))
    sizes = list(range(1, int(graph.n_edges), max(1, int(graph.n_edges) // 12)))
    circuits = top_k_circuits(graph, scores, sizes)
    C, g, n_pos = len(sizes), len(clean), len(clean[0])
    per, writes = circuit_bytes(m, graph, g, n_pos)
    budget = (P.cached_run_bytes(m, 2 * g, n_pos, upstream_hooks(graph)) + writes
              + P.tensor_bytes(graph.mask[None].expand(C, -1, -1).float()) + per)
    with one_thread():
        ref = evaluate_circuits(m, clean, corr, circuits, tgt, foil, ablation="mean")
        with tk.memory_budget(budget):
            got = evaluate_circuits(m, clean, corr, circuits, tgt, foil, ablation="mean")
        with tk.memory_budget(per), pytest.raises(MemoryBudgetError, match="one circuit needs about"):
            evaluate_circuits(m, clean, corr, circuits, tgt, foil, ablation="mean")
    assert ref.batch_sizes[0] == C and got.batch_sizes[0] <= 3 and C > 3 * got.batch_sizes[0]
    assert torch.equal(ref.values, got.values)


# ---- causal tracing and steering -------------------------------------------------------------------

def test_causal_tracing_under_a_tiny_budget(model):
    m = model
    prompt = "The capital of France is in the"
    ids = encode(m, prompt)
    subj = subject_span(m, prompt, " capital of France", ids)
    kw = {"kinds": ("resid", "mlp"), "window": 2, "noise_std": 1.0, "n_samples": 2, "seed": 3}
    names = [f"blocks.{L}.hook_mlp_out" for L in range(m.cfg.n_layers)]
    budget = P.cached_run_bytes(m, 3, len(ids), names) + P.replay_row_bytes(m, len(ids))
    with one_thread():
        ref = causal_trace(m, ids, subj, **kw)
        with tk.memory_budget(budget):
            got = causal_trace(m, ids, subj, **kw)
        with tk.memory_budget(budget - 1), pytest.raises(MemoryBudgetError,
                                                         match="causal tracing replay: one replay row.*n_samples"):
            causal_trace(m, ids, subj, **kw)
    n_rows = got.p_restored_by_sample.numel()
    assert got.batch_size <= 12 and n_rows > 5 * got.batch_size and ref.batch_size > got.batch_size
    assert torch.equal(ref.p_restored_by_sample, got.p_restored_by_sample)
    assert torch.equal(ref.p_corrupted_by_sample, got.p_corrupted_by_sample) and ref.p_clean == got.p_clean


def test_steering_dose_response_under_a_tiny_budget(model):
    m = model
    prompts = ["The capital of France is", "The capital of Spain is"]  # one length: no padding
    rows = []
    for p in prompts:
        ids = tuple(encode(m, p))
        rows.append(SteerRow(ids, single_token_id(m, " Paris"), single_token_id(m, " Rome"), len(ids) - 1,
                             tuple(range(1, len(ids)))))
    v = 3.0 * torch.randn(int(m.cfg.d_model), generator=torch.Generator().manual_seed(0))
    hook, alphas = "blocks.1.hook_resid_pre", [0.0, 1.5, -3.0, 6.0]
    per = sequence_bytes(m, len(rows[0].ids))
    with one_thread():
        ref = dose_response(m, rows, v, hook, alphas, n_random=2)
        with tk.memory_budget(2 * per):
            got = dose_response(m, rows, v, hook, alphas, n_random=2)
        with tk.memory_budget(per - 1), pytest.raises(MemoryBudgetError, match="steering dose-response: one sequence"):
            dose_response(m, rows, v, hook, alphas, n_random=2)
    assert ref.batch_size == len(ref.table) == 24 and got.batch_size == 2
    assert isinstance(got.table, pd.DataFrame) and ref.table.equals(got.table)
    assert per > bytes_of(len(rows[0].ids), int(m.cfg.d_vocab))  # counts every position's logits
