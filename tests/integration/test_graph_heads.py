"""Attention in the attribution graph (tracekit.graphs.heads) on perturbed GPT-2, Llama (GQA with 4 query
heads over 2 key/value heads, rotary) and tied Llama, with imperfect transcoders:

* the head loadings plus the residual term sum to the graph's edge (to 1e-5 relative);
* a last-block head's loading equals, independently, the edge minus the edge recomputed with that
  head's output at the target position cut from the gradient;
* the QK parts sum to the model's own attention score on each side; a token's query-side part equals
  the change of ``q . k`` when that token's embedding is removed from the frozen model;
* refusals (malformed head names, positions, node kinds) and no state left behind.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_graph_verify import IDS, PARIS, ROME, model_state, random_transcoders

from helpers import make_perturbed
from tracekit.core.errors import ConfigError
from tracekit.graphs.attribution import build_graph
from tracekit.graphs.heads import parse_head, qk_attribution, split_edges_by_head
from tracekit.graphs.replacement import LocalReplacementModel

VARIANTS = [("gpt2", False), ("llama", False), ("llama", True)]
IDS_ = ["gpt2", "llama", "llama-tied"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _setup(arch, tied):
    m = make_perturbed(arch, tied=tied)
    ds = random_transcoders(m, seed=2)
    g = build_graph(m, ds, IDS, target=PARIS, foil=ROME, zero_bos=False)
    return m, ds, g


def _edges(g, targets, per=5):
    out = []
    for t in targets:
        row = g.adjacency[t]
        nz = torch.nonzero(row).flatten()
        for s in nz[torch.argsort(-row[nz].abs())][:per].tolist():
            out.append((t, s))
    return out


@pytest.mark.parametrize("arch,tied", VARIANTS, ids=IDS_)
def test_head_loadings_sum_to_the_edge(arch, tied):
    m, ds, g = _setup(arch, tied)
    last_layer_feats = [i for i in range(g.n_features) if int(g.features[i, 0]) == m.cfg.n_layers - 1]
    mid_feats = [i for i in range(g.n_features) if int(g.features[i, 0]) == 1]
    targets = [last_layer_feats[-1], mid_feats[0], g.logit_offset, g.logit_offset + 1]
    edges = _edges(g, targets)
    # make sure sources of every kind are there (a token at another position: a pure-attention edge)
    tok0 = g.token_index(1)
    edges += [(g.logit_offset, tok0)]
    before = model_state(m)
    df = split_edges_by_head(m, ds, g, edges)
    assert model_state(m) == before
    sums = df.groupby(["target", "source"]).agg(total=("loading", "sum"), edge=("edge", "first"))
    assert len(sums) == len(set(edges))
    for (t, s), r in sums.iterrows():
        assert float(g.adjacency[t, s]) == r["edge"]
        assert abs(r["total"] - r["edge"]) <= 1e-5 * max(abs(r["edge"]), 1.0), (t, s, r["total"], r["edge"])
    # heads are query heads (4 for GQA Llama with 2 key/value heads), named LxHy
    comps = set(df["component"]) - {"resid"}
    assert {parse_head(c)[1] for c in comps if not c.endswith("SKIP")} == set(range(m.cfg.n_heads))
    # layer 1's transcoder has a skip matrix: its skip term is a path of its own (and carries something)
    skip = df[df.component == "L1SKIP"]
    assert len(skip) and skip["loading"].abs().max() > 1e-6
    # the token at position 1 reaches the last position only through attention
    r = df[(df.source == tok0) & (df.component == "resid")]
    assert float(r["loading"].iloc[0]) == 0.0
    assert df[(df.source == tok0)]["loading"].abs().sum() > 1e-6
    # heads cannot carry a source forward from a block at or after it
    src_layer = {s: int(g.features[s, 0]) for _, s in edges if s < g.n_features}
    for _, row in df[df.component != "resid"].iterrows():
        if row["source"] in src_layer:
            assert row["layer"] > src_layer[row["source"]]


@pytest.mark.parametrize("arch,tied", VARIANTS[:2], ids=IDS_[:2])
def test_last_block_loading_equals_cut_gradient(arch, tied):
    """Independent check: for a logit target, a last-block head is necessarily the last head on its
    paths, so its loading is the edge minus the edge with that head's output at the last position
    removed from the gradient (detached)."""
    m, ds, g = _setup(arch, tied)
    lrm = LocalReplacementModel(m, ds, IDS)
    L = m.cfg.n_layers - 1
    t = g.logit_offset + g.logit_ids.tolist().index(PARIS)
    edges = _edges(g, [t], per=6)
    df = split_edges_by_head(m, ds, g, edges, replacement=lrm)
    assert df[df.component.str.startswith(f"L{L}H")]["loading"].abs().max() > 1e-3  # the check has teeth
    W_U = m.W_U.detach().float()
    u = W_U[:, PARIS] - W_U.mean(1)
    p = g.n_pos - 1
    for h in range(m.cfg.n_heads):
        def cut(act, hook, h=h):
            act = act.clone()
            act[:, p, h] = act[:, p, h].detach()
            return act
        run = lrm.run(batch=1, grad=True, stop_at_final=True, extra_hooks=[(f"blocks.{L}.attn.hook_z", cut)])
        total = run.final[0, -1].float() @ u
        keys = list(run.leaves)
        grads = dict(zip(keys, torch.autograd.grad(total, [run.leaves[k] for k in keys], allow_unused=True)))
        for _, s in edges:
            kind = g.node_type(s)
            if kind == "feature":
                Ls, ps, f = g.features[s].tolist()
                w, key = g.activations[s] * ds[Ls].W_dec.detach()[f], Ls
            elif kind == "error":
                j = s - g.error_offset
                Ls, ps = j // g.n_pos, j % g.n_pos
                w, key = lrm.errors[Ls][ps], Ls
            else:
                ps = s - g.token_offset
                w, key = lrm.embed[ps], "tokens"
            gr = grads.get(key)
            cut_edge = 0.0 if gr is None else float(gr[0, ps].float() @ w.float())
            want = float(g.adjacency[t, s]) - cut_edge
            got = df[(df.source == s) & (df.component == f"L{L}H{h}")]["loading"]
            got_v = float(got.iloc[0]) if len(got) else 0.0
            assert got_v == pytest.approx(want, abs=1e-5 * max(1.0, abs(float(g.adjacency[t, s])))), (h, s)


@pytest.mark.parametrize("arch,tied", VARIANTS, ids=IDS_)
def test_qk_parts_sum_to_the_score(arch, tied):
    m, ds, g = _setup(arch, tied)
    heads = ["L1H1", "L2H3", "L0H2"]
    before = model_state(m)
    df = qk_attribution(m, ds, g, heads)
    assert model_state(m) == before
    # the model's own scores (clean run)
    _, cache = m.run_with_cache(IDS[None])
    qp = g.n_pos - 1
    sums = df.groupby(["head", "key_pos", "side"]).agg(total=("contribution", "sum"), score=("score", "first"))
    assert len(sums) == len(heads) * g.n_pos * 2
    for (head, k, side), r in sums.iterrows():
        L, h = parse_head(head)
        model_score = float(cache[f"blocks.{L}.attn.hook_attn_scores"][0, h, qp, k])
        assert r["score"] == pytest.approx(model_score, abs=1e-4)
        assert abs(r["total"] - r["score"]) <= 1e-5 * max(1.0, abs(r["score"])), (head, k, side)
    # nodes after the key (key side) or written in this block or later never contribute
    key_side = df[(df.side == "key") & (df.node_type != "bias")]
    assert (key_side["node_pos"] <= key_side["key_pos"]).all()
    assert (df[df.node_type.isin(["feature", "error"])]["node_layer"] < df[df.node_type.isin(["feature", "error"])]["layer"]).all()
    # every kind of node appears
    assert {"feature", "error", "token", "bias"} <= set(df["node_type"])


def test_qk_token_part_equals_removing_the_token():
    """Independent check: a token node's query-side part is the change of q . k / sqrt(d_head) when its
    embedding is removed from the frozen model (q is affine in the writes)."""
    m, ds, g = _setup("llama", False)
    lrm = LocalReplacementModel(m, ds, IDS)
    L, h, k = 2, 3, 2
    df = qk_attribution(m, ds, g, [f"L{L}H{h}"], key_pos=k, replacement=lrm)
    qp = g.n_pos - 1
    store = {}

    def grab(name):
        def fn(act, hook):
            store[name] = act.detach()
            return act
        return fn

    hooks = [(f"blocks.{L}.attn.hook_rot_q", grab("q")), (f"blocks.{L}.attn.hook_rot_k", grab("k"))]
    lrm.run(batch=1, stop_at_final=True, extra_hooks=hooks)
    q_clean, k_clean = store["q"].clone(), store["k"].clone()
    G = m.cfg.n_heads // k_clean.shape[2]
    d_head = q_clean.shape[-1]
    for p in (0, 3, qp):
        ts = torch.ones(g.n_pos)
        ts[p] = 0.0
        lrm.run(batch=1, stop_at_final=True, token_scale=ts, extra_hooks=hooks)
        want = float((q_clean[0, qp, h] - store["q"][0, qp, h]) @ k_clean[0, k, h // G]) / d_head ** 0.5
        got = df[(df.side == "query") & (df.node_type == "token") & (df.node_pos == p)]["contribution"]
        assert float(got.iloc[0]) == pytest.approx(want, abs=1e-5)
        want_k = float(q_clean[0, qp, h] @ (k_clean[0, k, h // G] - store["k"][0, k, h // G])) / d_head ** 0.5
        got_k = df[(df.side == "key") & (df.node_type == "token") & (df.node_pos == p)]["contribution"]
        assert (float(got_k.iloc[0]) if len(got_k) else 0.0) == pytest.approx(want_k, abs=1e-5)


def test_refusals():
    m, ds, g = _setup("gpt2", False)
    with pytest.raises(ConfigError, match="LxHy"):
        qk_attribution(m, ds, g, ["layer1head2"])
    with pytest.raises(ConfigError, match="L9H0"):
        qk_attribution(m, ds, g, ["L9H0"])
    with pytest.raises(ConfigError, match="key positions"):
        qk_attribution(m, ds, g, ["L1H0"], query_pos=2, key_pos=4)
    with pytest.raises(ConfigError, match="token"):
        split_edges_by_head(m, ds, g, [(g.token_index(0), g.token_index(1))])
    with pytest.raises(ConfigError, match="logit"):
        split_edges_by_head(m, ds, g, [(g.logit_offset, g.logit_offset + 1)])
    gz = build_graph(m, ds, IDS, target=PARIS, foil=ROME)  # zero_bos: BOS nodes have no edges
    assert gz.settings["bos_zeroed"]
    with pytest.raises(ConfigError, match="zero_bos"):
        split_edges_by_head(m, ds, gz, [(gz.logit_offset, gz.token_index(0))])
    with pytest.raises(ConfigError, match="zero_bos"):
        split_edges_by_head(m, ds, gz, [(gz.logit_offset, gz.error_index(1, 0))])


def test_no_state_left_when_raising(monkeypatch):
    import tracekit.graphs.heads as heads_mod

    m, ds, g = _setup("llama", False)
    before = model_state(m)

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(heads_mod, "_W_O", boom)  # raised inside the backward's autograd scope
    with pytest.raises(RuntimeError, match="boom"):
        split_edges_by_head(m, ds, g, _edges(g, [g.logit_offset], per=2))
    assert model_state(m) == before

    def raising_hooks(layers, q_hook, k_hook, store):
        return [(f"blocks.{layers[0]}.attn.{q_hook}", boom)]  # raised inside a hooked forward pass

    monkeypatch.setattr(heads_mod, "_grab_qk", raising_hooks)
    with pytest.raises(RuntimeError, match="boom"):
        qk_attribution(m, ds, g, ["L1H0"])
    assert model_state(m) == before
    assert all(p.grad is None for d in ds.dictionaries.values() for p in d.parameters())


def test_budget_chunked_equals_unchunked_and_refusal():
    from tracekit.core.budget import memory_budget
    from tracekit.core.errors import MemoryBudgetError
    from tracekit.graphs.attribution import backward_row_bytes

    m, ds, g = _setup("llama", False)
    edges = _edges(g, [g.logit_offset], per=3)
    full = split_edges_by_head(m, ds, g, edges)
    row = backward_row_bytes(m, g.n_pos)
    with memory_budget(3 * row):  # 3 head rows per backward pass instead of all 12
        chunked = split_edges_by_head(m, ds, g, edges)
        q_chunked = qk_attribution(m, ds, g, ["L1H2"], key_pos=[0, 3])
    assert chunked["loading"].to_numpy() == pytest.approx(full["loading"].to_numpy(), abs=1e-6)
    q_full = qk_attribution(m, ds, g, ["L1H2"], key_pos=[0, 3])
    assert q_chunked["contribution"].to_numpy() == pytest.approx(q_full["contribution"].to_numpy(), abs=1e-6)
    with memory_budget(row // 2):
        with pytest.raises(MemoryBudgetError, match="edge split by head"):
            split_edges_by_head(m, ds, g, edges)
