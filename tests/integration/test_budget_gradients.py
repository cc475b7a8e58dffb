"""The gradient-based circuit engines (AtP / AtP*, EAP, EAP-IG) and the neuron engines under a
memory budget far below their naive need: they run in many chunks and give exactly the numbers of
the unbudgeted run (``torch.equal`` / ``==``), and a budget one row does not fit refuses before any
forward pass.

The budgets are set from the engines' own per-row estimates (a couple of rows' worth) rather than a
fixed "64KiB": an honest estimate of one row of these tiny models already counts its logits
(``[pos, 50257]`` float32, ~200 KB per token), so a fixed tiny budget would refuse instead of
chunking. Each test asserts the budget is several times below the unchunked run's need.

Rows are chunked two (or more) at a time: a one-row batch gives numbers that differ in the last
bits from the same row in a larger batch (GPT-2's ``hook_z`` of block 0 already; the model's
kernels, not the engines), so the one-row test (on the Llama model, grouped query attention)
states its tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tracekit
import tracekit.circuits.attribution as A
import tracekit.circuits.edges as E
import tracekit.neurons as N
import tracekit.units as U
from helpers import make_perturbed
from tracekit.circuits.graph import build_graph
from tracekit.core.errors import MemoryBudgetError
from tracekit.patching.request import check_request
from tracekit.patching.setters import SITES

ARCHS = ["gpt2", "llama"]


def _pairs(lengths=(8, 8, 7, 8, 7, 7, 8, 7), seed=0):
    """Clean/corrupted rows of two lengths (two length groups of 4), targets and foils."""
    g = torch.Generator().manual_seed(seed)
    clean = [torch.randint(100, 5000, (n,), generator=g).tolist() for n in lengths]
    corr = [r[:] for r in clean]
    for r in corr:
        r[2] = (r[2] + 17) % 4000 + 100
        r[-2] = (r[-2] + 5) % 4000 + 100
    tgt = torch.randint(100, 5000, (len(lengths),), generator=g).tolist()
    foil = torch.randint(100, 5000, (len(lengths),), generator=g).tolist()
    return clean, corr, tgt, foil


def _same_edges(a, b):
    assert torch.equal(a.scores, b.scores), (a.scores - b.scores).abs().max()
    assert torch.equal(a.clean, b.clean) and torch.equal(a.corrupted, b.corrupted)
    assert a.frame().equals(b.frame())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["eap", "eap_ig"])
def test_edge_attribution_chunked_equals_unchunked(arch, method):
    m = make_perturbed(arch)
    clean, corr, tgt, foil = _pairs()
    steps = 5 if method == "eap_ig" else 0
    _, held, per_pass, _ = E._plan(m, build_graph(m), 8, 4, method, steps, 64, torch.device("cpu"))
    budget = int(2.2 * (held + per_pass))  # two rows of the longer group (and of the shorter one)
    naive = 4 * (held + 5 * per_pass)  # one length group, its 5 steps in one pass (the unbudgeted run)
    assert 3 * budget < naive
    ref = E.edge_attribution(m, clean, corr, tgt, foil, method=method, ig_steps=5)
    assert ref.chunks["rows"] == [4, 4]
    with tracekit.memory_budget(budget):
        got = E.edge_attribution(m, clean, corr, tgt, foil, method=method, ig_steps=5)
    assert got.chunks["rows"] == [2, 2]  # 2 groups x 2 chunks
    if method == "eap_ig":
        assert ref.chunks["ig_steps"] == [5, 5]
        assert got.chunks["ig_steps"] == [1, 1, 1, 1]  # one interpolation step per backward pass
    _same_edges(ref, got)


def test_eap_ig_steps_chunked_equals_unchunked():
    """The rows fit, the interpolation steps do not: passes of 2, 2 and 1 steps, the same scores
    (the steps are stacked and summed in the same blocks whatever the passes)."""
    m = make_perturbed("gpt2")
    clean, corr, tgt, foil = _pairs(lengths=(8,) * 4)
    _, held, per_pass, block = E._plan(m, build_graph(m), 8, 4, "eap_ig", 5, 64, torch.device("cpu"))
    assert block == 5
    ref = E.edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=5)
    with tracekit.memory_budget(4 * held + 2 * 4 * per_pass + 1000):
        got = E.edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=5)
    assert ref.chunks == {"rows": [4], "ig_steps": [5]}
    assert got.chunks == {"rows": [4], "ig_steps": [2]}
    _same_edges(ref, got)


def test_edge_attribution_one_row_chunks_gqa():
    """Chunks of one row on the grouped-query-attention model (4 query heads, 2 key/value heads).

    Not bit-exact: a one-row batch runs the model's matmuls with other kernels than a batch of
    several rows (a property of the model's forward/backward, not of the engine: chunks of two rows
    are exact above, and the per-row einsum is batch-invariant), which moves the scores by ~5e-7 on
    scores of order 0.1-1; the tightest tolerance that holds is 1e-6."""
    m = make_perturbed("llama")
    assert m.cfg.n_key_value_heads == 2 and m.cfg.n_heads == 4
    clean, corr, tgt, foil = _pairs(lengths=(8, 8, 8))
    _, held, per_pass, _ = E._plan(m, build_graph(m), 8, 3, "eap_ig", 2, 64, torch.device("cpu"))
    ref = E.edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=2, ig_rule="midpoint")
    with tracekit.memory_budget(int(1.1 * (held + per_pass))):
        got = E.edge_attribution(m, clean, corr, tgt, foil, method="eap_ig", ig_steps=2, ig_rule="midpoint")
    assert got.chunks["rows"] == [1] and got.chunks["ig_steps"] == [1] * 3
    torch.testing.assert_close(got.scores, ref.scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.clean, ref.clean, atol=1e-6, rtol=0)


def _atp_args(m, n=8):
    clean, corr, tgt, foil = _pairs(lengths=(7,) * n, seed=3)
    sites = ["head_out", "head_k_by_pos", "neuron", "resid_pre", "head_pattern"]
    kw: dict[str, Any] = dict(neuron_layers=[1], neurons=[0, 3, 5])
    return (clean, corr, sites, ["denoising", "noising"], ["logit_diff", "kl"], [[t] for t in tgt],
            [[f] for f in foil]), kw


@pytest.mark.parametrize("arch,qk_fix", [("gpt2", False), ("llama", True)])
def test_attribution_patching_chunked_equals_unchunked(arch, qk_fix, monkeypatch):
    m = make_perturbed(arch)
    args, kw = _atp_args(m)
    clean, _, sites, modes, metrics, tgt, foil = args
    req = check_request(m, len(clean), sites, modes, metrics, tgt, foil, None, [1], [0, 3, 5])
    hooks = sorted({SITES[s].hook_name(L) for s in req.sites for L in req.site_layers(s)})
    per_row = A.atp_row_bytes(m, req, hooks, 7, qk_fix)
    ref = A.attribution_patch(m, *args, qk_fix=qk_fix, **kw)
    calls: list[int] = []
    group = A._group

    def spy(*a, **k):
        calls.append(int(a[2].shape[0]))  # rows of the chunk
        return group(*a, **k)

    monkeypatch.setattr(A, "_group", spy)
    budget = int(2.5 * per_row)
    assert 3 * budget < 8 * per_row
    with tracekit.memory_budget(budget):
        got = A.attribution_patch(m, *args, qk_fix=qk_fix, **kw)
    assert calls == [2, 2, 2, 2]
    assert torch.equal(ref.clean, got.clean) and torch.equal(ref.corrupted, got.corrupted)
    assert len(ref.jobs) == len(got.jobs) == len(modes) * len(sites)
    for x, y in zip(ref.jobs, got.jobs):
        assert (x.mode, x.site.name, x.pairs, x.n_pos) == (y.mode, y.site.name, y.pairs, y.n_pos)
        assert x.index.equals(y.index)
        assert torch.equal(x.values, y.values), (x.site.name, (x.values - y.values).abs().max())


def test_gradient_engines_refuse_before_any_pass(monkeypatch):
    m = make_perturbed("llama")
    clean, corr, tgt, foil = _pairs()

    def no_pass(*a, **k):
        raise AssertionError("a forward pass ran before the refusal")

    monkeypatch.setattr(E, "gradient_pass", no_pass)
    monkeypatch.setattr(A, "gradient_pass", no_pass)
    with tracekit.memory_budget("64KiB"):
        for method in ("eap", "eap_ig"):
            with pytest.raises(MemoryBudgetError, match=r"edge attribution \(.*\): one row needs about .*run\.memory_budget"):
                E.edge_attribution(m, clean, corr, tgt, foil, method=method)
        with pytest.raises(MemoryBudgetError, match="attribution patching: one row needs about .*shorten the prompts"):
            A.attribution_patch(m, clean, corr, ["head_out"], ["denoising"], ["logit_diff"], [[t] for t in tgt],
                                [[f] for f in foil])


PROMPTS = ["The cat sat on the mat and", "A dog", "Paris is the capital of", "one two three four five six seven",
           "x y", "Hello world, this is", "The quick brown fox jumps", "To be or not"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("freeze", [False, True])
def test_neuron_interventions_chunked_equals_unchunked(arch, freeze, monkeypatch):
    m = make_perturbed(arch)
    tg = [" the"] * len(PROMPTS)
    kw: dict[str, Any] = dict(mode="zero", freeze_downstream=freeze, intervene_at="all", batch_size=8)
    ref = N.neuron_interventions(m, PROMPTS, tg, ["1.3", "2.7"], **kw)
    sizes: list[int] = []
    rows = N._intervene_rows

    def spy(model, edits, batch, *a, **k):
        sizes.append(batch.size)
        return rows(model, edits, batch, *a, **k)

    monkeypatch.setattr(N, "_intervene_rows", spy)
    n_pos = 12  # >= the longest prompt's tokens
    per_row = N.pass_bytes(m, n_pos, backward=False) + n_pos * m.cfg.d_vocab * 4
    with tracekit.memory_budget(int(2.5 * per_row)):
        got = N.neuron_interventions(m, PROMPTS, tg, ["1.3", "2.7"], **kw)
    assert sizes == [3, 3, 2]  # one padded batch of 8, run in 3 parts
    assert got == ref


@pytest.mark.parametrize("arch", ARCHS)
def test_neuron_means_and_key_readout_chunked_equal_unchunked(arch, monkeypatch, tmp_path):
    m = make_perturbed(arch)
    ref = N.prompt_means(m, PROMPTS, ["1.3", "2.7", "0.1"])
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(PROMPTS * 3))
    kr_kw: dict[str, Any] = dict(top_n=3, seq_len=10, batch_size=8, max_tokens=None, progress=False, signs=[1, -1])
    kr = N.key_readout(m, ["1.3", "2.7"], str(corpus), **kr_kw)
    calls: list[int] = []
    values = U.hook_values

    def spy(model, batch, *a, **k):
        calls.append(batch.size)
        return values(model, batch, *a, **k)

    monkeypatch.setattr(U, "hook_values", spy)
    with tracekit.memory_budget(int(2.5 * N.pass_bytes(m, 12, backward=False))):
        got = N.prompt_means(m, PROMPTS, ["1.3", "2.7", "0.1"])
        kg = N.key_readout(m, ["1.3", "2.7"], str(corpus), **kr_kw)
    assert got == ref
    assert len(calls) > 2 and max(calls) < 8  # key readout's padded batches of 8 ran in parts
    assert kg.contexts.equals(kr.contexts) and kg.means == kr.means and kg.n_tokens == kr.n_tokens


def test_neuron_engines_refuse_before_any_pass(monkeypatch):
    m = make_perturbed("llama")

    def no_pass(*a, **k):
        raise AssertionError("a forward pass ran before the refusal")

    monkeypatch.setattr(N, "_intervene_rows", no_pass)
    monkeypatch.setattr(N, "run_with_cache", no_pass)
    with tracekit.memory_budget("64KiB"):
        with pytest.raises(MemoryBudgetError, match="neuron interventions: one row needs about"):
            N.neuron_interventions(m, PROMPTS, [" the"] * len(PROMPTS), ["1.3"])
        with pytest.raises(MemoryBudgetError, match="neuron prompt means: one row needs about"):
            N.prompt_means(m, PROMPTS, ["1.3"])
