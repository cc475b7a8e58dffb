"""The attribution-graph engine: local replacement model and adjacency of direct effects.

* a ReLU GPT-2 whose transcoders are its own MLPs: zero error nodes, and every edge equals a direct
  effect computed by hand (attention OV with the clean patterns, frozen LayerNorm scales read from
  the bridge's ``hook_scale``, demeaned unembedding), independently of the engine;
* random (imperfect, skip, JumpReLU, TopK) transcoders on the perturbed tiny models (GPT-2, Llama with
  GQA, tied Llama): the replacement model reproduces the logits, completeness holds per node, the
  frozen norms' Jacobian equals the module's own JVP along directions that keep its scale;
* the graph's predicted effect of scaling a feature (adjacency, linear through features held
  active) equals the effect measured in the frozen local replacement model;
* batched == unbatched rows, budget-chunked == unchunked, refusal before heavy work;
* no hooks, ``requires_grad`` or gradients left behind, after success and after an error.
"""

from __future__ import annotations

import pytest
import torch
from graph_models import IDS, PARIS, ROME, mlp_transcoders, random_transcoders, relu_gpt2  # noqa: E402

from tests.helpers import make_perturbed
from tracekit.core.budget import memory_budget
from tracekit.core.errors import MemoryBudgetError, MethodRefused
from tracekit.dictionaries import Dictionary, DictionarySet
from tracekit.graphs import LocalReplacementModel, build_graph


def _centre(x):
    return x - x.mean(-1, keepdim=True)


# ------------------------------------------------------------------------------------------------
# (a) transcoders = the MLPs: zero errors, edges equal direct effects computed by hand
# ------------------------------------------------------------------------------------------------
def test_mlp_transcoders_give_zero_errors_and_hand_computed_edges():
    m = relu_gpt2()
    assert m.cfg.act_fn == "relu"
    dset = mlp_transcoders(m)
    ids = IDS
    _, c = m.run_with_cache(ids[None])
    # the conventions the hand computation uses, checked on the clean run
    for L in range(m.cfg.n_layers):
        h = c[f"blocks.{L}.mlp.hook_in"]
        assert torch.allclose(dset[L](h), c[f"blocks.{L}.hook_mlp_out"], atol=1e-5)  # hook_in is the MLP's input
        for ln in ("ln1", "ln2"):
            x = c[f"blocks.{L}.{ln}.hook_in"]
            assert torch.allclose(_centre(x) / c[f"blocks.{L}.{ln}.hook_scale"], c[f"blocks.{L}.{ln}.hook_out"], atol=1e-5)
    g = build_graph(m, dset, ids, target=PARIS, foil=ROME, zero_bos=False)
    assert float(g.error_norms.max()) < 1e-4
    assert g.verification["logits_max_abs_error"] < 1e-4
    assert g.verification["completeness_max_abs_error"] < 1e-4

    T, L_n = len(ids), m.cfg.n_layers
    W_U = m.W_U
    ubar = W_U - W_U.mean(-1, keepdim=True)

    def propagate(v, start):
        """Residual writes ``v [S, T, d]`` (one per source) entering block ``start``: the part of each
        later read they reach through attention OV only (clean patterns, frozen LN scales)."""
        reads = {}
        for L in range(start, L_n):
            u = _centre(v) / c[f"blocks.{L}.ln1.hook_scale"]
            vv = torch.einsum("spd,hde->sphe", u, m.W_V[L])
            z = torch.einsum("hqk,skhe->sqhe", c[f"blocks.{L}.attn.hook_pattern"][0], vv)
            v = v + torch.einsum("sqhe,hed->sqd", z, m.W_O[L])
            reads[L] = _centre(v) / c[f"blocks.{L}.ln2.hook_scale"]
        final = _centre(v) / c["ln_final.hook_scale"]
        return reads, final

    fl, fp, ff = (g.features[:, i] for i in range(3))

    def target_values(reads, final):
        """``[n_nodes, S]``: the graph's row targets from each source's propagated write."""
        S = final.shape[0]
        vals = torch.zeros(g.n_nodes, S)
        for L, r in reads.items():
            sel = torch.nonzero(fl == L).flatten()
            pre = torch.einsum("spd,df->spf", r, dset[L].W_enc)  # [S, T, d_sae]
            vals[sel] = pre[:, fp[sel], ff[sel]].T
        vals[g.logit_offset:] = (final[:, -1] @ ubar[:, g.logit_ids]).T
        return vals

    hand = torch.zeros(g.n_nodes, g.n_nodes)
    d_model = m.cfg.d_model
    with torch.no_grad():
        for L in range(L_n):
            src = torch.nonzero(fl == L).flatten()
            v = torch.zeros(len(src), T, d_model)
            v[torch.arange(len(src)), fp[src]] = g.activations[src, None] * dset[L].W_dec[ff[src]]
            hand[:, src] = target_values(*propagate(v, L + 1))
        v = torch.zeros(T, T, d_model)
        v[torch.arange(T), torch.arange(T)] = c["hook_embed"][0]
        hand[:, g.token_offset:g.token_offset + T] = target_values(*propagate(v, 0))
    rows = torch.cat([torch.arange(g.n_features), torch.arange(g.logit_offset, g.n_nodes)])
    assert g.n_features > 20
    scale = max(1.0, float(hand.abs().max()))
    assert torch.allclose(g.adjacency[rows], hand[rows], atol=1e-4 * scale, rtol=0), \
        float((g.adjacency[rows] - hand[rows]).abs().max())
    # error columns are zero (the transcoders are exact)
    assert float(g.adjacency[:, g.error_offset:g.token_offset].abs().max()) < 1e-4


# ------------------------------------------------------------------------------------------------
# (b), (c): logits reproduced, completeness per node, on the perturbed tiny models
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tied", [("gpt2", False), ("llama", False), ("llama", True)],
                         ids=["gpt2", "llama-gqa", "llama-tied"])
def test_replacement_reproduces_logits_and_completeness(arch, tied):
    m = make_perturbed(arch, tied=tied)
    dset = random_transcoders(m)
    g = build_graph(m, dset, IDS, target=PARIS, foil=ROME)
    assert g.verification["logits_max_abs_error"] < 1e-4
    assert g.verification["completeness_max_abs_error"] < 1e-4
    assert float(g.error_norms[:, 1:].min()) > 1e-3  # the transcoders are imperfect: errors matter
    rows = torch.cat([torch.arange(g.n_features), torch.arange(g.logit_offset, g.n_nodes)])
    assert g.node_input is not None and g.node_bias is not None
    resid = g.node_input[rows] - g.adjacency[rows].sum(1) - g.node_bias[rows]
    assert float(resid.abs().max()) < 1e-4
    # the error and token nodes carry real edges (completeness is not trivially the bias)
    assert float(g.adjacency[:, g.error_offset:g.logit_offset].abs().max()) > 1e-3
    # graph layout: the target and foil are logit nodes; BOS is not a node (zero_bos)
    assert PARIS in g.logit_ids.tolist() and ROME in g.logit_ids.tolist()
    assert g.settings["bos_zeroed"] and int(g.features[:, 1].min()) >= 1
    assert float(g.adjacency[:, g.token_index(0)].abs().max()) == 0.0
    assert g.target["id"] == PARIS and g.target["foil_id"] == ROME
    # only feature and logit rows are filled
    assert float(g.adjacency[g.error_offset:g.logit_offset].abs().max()) == 0.0
    # edges only go forward: a feature never feeds one in its own or an earlier layer
    fl = g.features[:, 0]
    ff = g.adjacency[:g.n_features, :g.n_features]
    assert float(ff[fl[:, None] <= fl[None, :]].abs().max()) == 0.0


def test_frozen_norms_match_the_modules_jvp():
    """J of every frozen norm equals the module's own JVP along directions that leave sigma unchanged."""
    m = make_perturbed("gpt2")
    rep = LocalReplacementModel(m, random_transcoders(m), IDS)
    mods = dict(rep._norm_modules)
    g = torch.Generator().manual_seed(3)
    assert len(rep.norms) == 2 * m.cfg.n_layers + 1
    for s in rep.norms:
        x = s.x_clean
        d = torch.randn(x.shape, generator=g)
        cx = s.norm.centre(x)
        d = s.norm.centre(d)
        d = d - (d * cx).sum(-1, keepdim=True) / (cx * cx).sum(-1, keepdim=True) * cx  # keep sigma: d perp centre(x)
        jvp = torch.func.jvp(mods[s.name], (x,), (d,))[1]
        assert torch.allclose(s.linear(d), jvp, atol=1e-4), s.name
        # and the frozen map is affine: frozen(x + d) - frozen(x) == J d exactly (for any d)
        d2 = torch.randn(x.shape, generator=g)
        assert torch.allclose(s.frozen(x + d2) - s.frozen(x), s.linear(d2), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# (d): predicted effect of scaling a feature == measured in the frozen local replacement model
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_predicted_feature_effect_equals_measured_scaling(arch):
    m = make_perturbed(arch)
    dset = random_transcoders(m, seed=1)
    g = build_graph(m, dset, IDS, target=PARIS)
    rep = LocalReplacementModel(m, dset, IDS)
    nF = g.n_features
    acts = g.activations.double()
    A = g.adjacency.double()
    M_ff = A[:nF, :nF] / acts[None, :]
    M_lf = A[g.logit_offset:, :nF] / acts[None, :]
    # node features as positions in each layer's ActiveFeatures
    where = {}
    for layer in range(m.cfg.n_layers):
        af = rep.active[layer]
        for k, (p, f) in enumerate(zip(af.pos.tolist(), af.feat.tolist())):
            where[(layer, p, f)] = k
    masks = {layer: torch.zeros(rep.active[layer].pos.shape[0], dtype=torch.bool) for layer in range(m.cfg.n_layers)}
    for L, p, f in g.features.tolist():
        masks[L][where[(L, p, f)]] = True
    base = rep.run(linear_features=masks).pre_logits[0].double()
    ids = g.logit_ids
    base_d = base[ids] - base.mean()
    eps = 0.5
    top = torch.argsort(A[g.logit_offset, :nF].abs(), descending=True)[:4].tolist()
    for s in top + [nF // 2, nF - 1]:
        L, p, f = g.features[s].tolist()
        scale = {layer: torch.ones(rep.active[layer].pos.shape[0]) for layer in range(m.cfg.n_layers)}
        scale[L][where[(L, p, f)]] = 1 + eps
        out = rep.run(linear_features=masks, feature_scale=scale).pre_logits[0].double()
        measured = (out[ids] - out.mean()) - base_d
        e = torch.zeros(nF, dtype=torch.float64)
        e[s] = eps * acts[s]
        da = torch.linalg.solve(torch.eye(nF, dtype=torch.float64) - M_ff, e)
        predicted = M_lf @ da
        assert torch.allclose(measured, predicted, atol=2e-4 * max(1.0, float(predicted.abs().max()))), \
            (s, measured, predicted)
    # the multi-hop part matters: the direct edge alone misses it
    assert float((M_lf @ torch.linalg.solve(torch.eye(nF, dtype=torch.float64) - M_ff, acts) - M_lf @ acts).abs().max()) > 1e-3


# ------------------------------------------------------------------------------------------------
# (e): batching and the memory budget
# ------------------------------------------------------------------------------------------------
def test_batched_equals_unbatched_and_budget_chunks():
    m = make_perturbed("llama")
    dset = random_transcoders(m, d_sae=12)
    ids = IDS[:5]
    one = build_graph(m, dset, ids, target=PARIS, batch_size=1)
    many = build_graph(m, dset, ids, target=PARIS)
    seven = build_graph(m, dset, ids, target=PARIS, batch_size=7)
    assert one.settings["batch_size"] == 1 and many.settings["batch_size"] > 7
    assert one.settings["backward_passes"] > many.settings["backward_passes"]
    tol = 1e-6 * max(1.0, float(one.adjacency.abs().max()))  # matmul kernels differ in the last bits by batch size
    for g in (many, seven):
        assert torch.allclose(one.adjacency, g.adjacency, atol=tol, rtol=0)
    per_row = many.settings["backward_row_bytes"]
    assert per_row > 0
    fixed = 6 * 4 * m.cfg.n_layers * len(ids) * m.cfg.d_model
    with memory_budget(int(3.5 * per_row) + fixed):  # three rows per backward pass
        chunked = build_graph(m, dset, ids, target=PARIS)
    assert chunked.settings["batch_size"] == 3
    assert torch.allclose(one.adjacency, chunked.adjacency, atol=tol, rtol=0)
    calls = {"n": 0}
    real = torch.autograd.grad

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    import unittest.mock

    with memory_budget(per_row // 2), unittest.mock.patch.object(torch.autograd, "grad", counting):
        with pytest.raises(MemoryBudgetError, match="memory budget allows"):
            build_graph(m, dset, ids, target=PARIS)
    assert calls["n"] == 0  # refused before any backward pass


def test_max_feature_nodes_keeps_exact_edges_and_completeness():
    m = make_perturbed("gpt2")
    dset = random_transcoders(m)
    full = build_graph(m, dset, IDS, target=PARIS)
    part = build_graph(m, dset, IDS, target=PARIS, max_feature_nodes=15, batch_size=4)
    assert part.n_features == 15
    assert part.verification["completeness_max_abs_error"] < 1e-4
    idx = torch.tensor([full.feature_node(*map(int, r)) for r in part.features])
    assert torch.allclose(part.adjacency[:15, :15], full.adjacency[idx][:, idx], atol=1e-6)
    assert torch.allclose(part.adjacency[part.logit_offset:, :15], full.adjacency[full.logit_offset:, idx], atol=1e-6)
    # the chosen features are the most influential ones on the logits first (the top direct one is in)
    top = int(torch.argmax(full.adjacency[full.logit_offset:, :full.n_features].abs().sum(0)))
    assert top in idx.tolist()


# ------------------------------------------------------------------------------------------------
# refusals and state
# ------------------------------------------------------------------------------------------------
def test_refusals_name_what_is_unsupported():
    m = make_perturbed("gpt2")
    dset = random_transcoders(m)
    missing = DictionarySet({L: dset[L] for L in dset.layers[:-1]})
    with pytest.raises(MethodRefused, match=r"blocks \[2\] have no transcoder"):
        build_graph(m, missing, IDS)
    bad = random_transcoders(m)
    bad[1].hook_in = "blocks.1.hook_resid_pre"
    with pytest.raises(MethodRefused, match="blocks.1.hook_resid_pre"):
        build_graph(m, bad, IDS)
    d = int(m.cfg.d_model)
    gated = DictionarySet({L: Dictionary(d, 8, d, activation="gated", hook_in=f"blocks.{L}.mlp.hook_in",
                                         hook_out=f"blocks.{L}.hook_mlp_out", layer=L) for L in range(m.cfg.n_layers)})
    with pytest.raises(MethodRefused, match="gated"):
        build_graph(m, gated, IDS)


def _state(model):
    hooks = 0
    for mod in model.modules():
        for dname in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            hooks += len(getattr(mod, dname, {}) or {})
        hooks += len(getattr(mod, "fwd_hooks", []) or []) + len(getattr(mod, "bwd_hooks", []) or [])
    req = tuple(p.requires_grad for p in model.parameters())
    grads = sum(p.grad is not None for p in model.parameters())
    return hooks, req, grads, getattr(model, "context_level", None)


def test_no_state_left_behind(monkeypatch):
    m = make_perturbed("llama")
    dset = random_transcoders(m)
    before = _state(m)
    dparams = [p for L in dset.layers for p in dset[L].parameters()]
    dreq = [p.requires_grad for p in dparams]
    build_graph(m, dset, IDS, target=PARIS)
    assert _state(m) == before
    assert all(p.grad is None for p in dparams) and [p.requires_grad for p in dparams] == dreq
    calls = {"n": 0}
    real = torch.autograd.grad

    def boom(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure mid-build")
        return real(*a, **kw)

    monkeypatch.setattr(torch.autograd, "grad", boom)
    with pytest.raises(RuntimeError, match="injected"):
        build_graph(m, dset, IDS, target=PARIS, batch_size=2)
    monkeypatch.undo()
    assert calls["n"] == 2
    assert _state(m) == before
    assert all(p.grad is None for p in dparams)
    # and the model still gives its own logits
    g = build_graph(m, dset, IDS, target=PARIS)
    assert g.verification["logits_max_abs_error"] < 1e-4


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_other_input_sites(arch):
    """``ln2.hook_normalized`` is read as the MLP input where it is the same tensor (else refused by
    name); a transcoder on the residual (``hook_resid_mid``) is linear as it is."""
    m = make_perturbed(arch)
    base = random_transcoders(m)
    ref = build_graph(m, base, IDS, target=PARIS)
    norm_in = random_transcoders(m)
    for L in norm_in.layers:
        norm_in[L].hook_in = f"blocks.{L}.ln2.hook_normalized"
    _, c = m.run_with_cache(IDS[None])
    same = all(torch.equal(c[f"blocks.{L}.ln2.hook_normalized"], c[f"blocks.{L}.mlp.hook_in"]) for L in norm_in.layers)
    if same:
        g = build_graph(m, norm_in, IDS, target=PARIS)
        assert torch.equal(g.adjacency, ref.adjacency)
    else:
        with pytest.raises(MethodRefused, match="ln2.hook_normalized"):
            build_graph(m, norm_in, IDS, target=PARIS)
    resid = random_transcoders(m)
    for L in resid.layers:
        resid[L].hook_in = f"blocks.{L}.hook_resid_mid"
    g = build_graph(m, resid, IDS, target=PARIS)
    assert g.verification["logits_max_abs_error"] < 1e-4
    assert g.verification["completeness_max_abs_error"] < 1e-4
