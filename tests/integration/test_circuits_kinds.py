"""The circuit kinds (``attribution_patching``, ``edge_attribution``, ``path_patching``, ``circuit``)
through their public classes, each checked against an independent exact computation:

* AtP's verification table holds real exact runs: its ``exact_effect`` is the mean effect
  :class:`tracekit.ActivationPatching` reports for the same site (whole heads, and heads at named
  positions); an estimate broken on purpose (negated) is caught by the verification's numbers;
* EdgeAttribution's verification is exact path patching of each checked edge, and its ``nodes``
  table is the sum of each node's outgoing edges; its summary records the EAP-IG rule and sign;
* Circuit: the full circuit is the clean run, the empty one the corrupted run (``corrupted``
  ablation), a hand-listed single edge's faithfulness is what :func:`evaluate_circuits` gives, the
  MIB area is the trapezoid over the curve;
* PathPatching into every receiver of a head is activation patching of that head (GPT-2 and Llama
  with GQA); glob senders expand and senders writing after a receiver are skipped;
* bad inputs fail naming the field, and a run leaves the model as it was.

Rows: three IOI-like prompts of the same token length (so ``mean`` ablation has a population)
whose corrupted prompt swaps the second subject *and* the last token, with a target/foil chosen so
the perturbed GPT-2's clean/corrupted logit-difference gap is about 1.2 (a middle token alone moves
this random model's last-position logits by ~0.01, and normalised effects would then amplify float
noise a hundredfold). Tolerances are absolute; every comparison also checks that what is compared
is not tiny.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

import tracekit as tk
import tracekit.experiments.attribution as attribution_kind
from helpers import hook_keys, make_perturbed
from tracekit import ActivationPatching, AttributionPatching, Circuit, EdgeAttribution, PathPatching
from tracekit.circuits.faithfulness import circuit_from_edges, evaluate_circuits
from tracekit.circuits.graph import build_graph
from tracekit.circuits.paths import path_patch
from tracekit.core.errors import DatasetError
from tracekit.errors import CircuitError, MethodRefused


def _row(clean: str, corrupted: str, target: str, io: str, s: str) -> dict:
    return {"prompt": clean, "corrupted": corrupted, "target": target, "foil": " with",
            "positions": {"IO": {"text": io, "occurrence": 0}, "S2": {"text": s, "occurrence": -1}, "END": -1}}


#: 15 tokens each (BOS counted); clean - corrupted logit difference ~1.2 on the perturbed GPT-2.
ROWS = [
    _row("When Mary and John went to the store, John gave a drink to",
         "When Mary and John went to the store, Mary gave a drink with", " ain", " Mary", " John"),
    _row("When Anna and Tom went to the park, Tom gave a book to",
         "When Anna and Tom went to the park, Anna gave a book with", " tre", " Anna", " Tom"),
    _row("When Sarah and Paul went to the shop, Paul gave a ball to",
         "When Sarah and Paul went to the shop, Sarah gave a ball with", " tre", " Sarah", " Paul"),
]
DS = {"rows": ROWS}
VERIFY = {"top_k": 6, "n_random": 6}  # 12 checked sites: every head of the 3-layer, 4-head GPT-2


@pytest.fixture(scope="module")
def gpt2():
    return make_perturbed("gpt2")


_ATP: dict = {}


def _atp(model, sites: list[str], positions: list[str] | None):
    """The intact AtP run of ``sites`` (cached: tests 1 and 2 share it)."""
    key = (tuple(sites), tuple(positions or ()))
    if key not in _ATP:
        _ATP[key] = AttributionPatching(dataset=DS, sites=sites, positions=positions, directions=["denoising"],
                                        verify=VERIFY).run(model, progress=False)
    return _ATP[key]


def _mean_lines(res) -> pd.DataFrame:
    main = res.tables["main"]
    return main[(main["scope"] == "mean") & (main["metric"] == "logit_diff")]


def _by_site(df: pd.DataFrame, pos_col: str) -> dict:
    """``{(site, layer, head, position name or None): effect}``."""
    out = {}
    for _, r in df.iterrows():
        pos = r[pos_col]
        out[(r["site"], int(r["layer"]), int(r["head_idx"]), None if pos is None or pd.isna(pos) else str(pos))] = \
            float(r["effect"])
    return out


# -- 1. AtP verification: the exact side is activation patching ------------------------------------------


@pytest.mark.parametrize("sites,positions", [(["head_out"], None), (["head_out_by_pos"], ["S2", "END"])],
                         ids=["head_out", "head_out_by_pos-S2-END"])
def test_atp_verification_exact_effect_is_activation_patching(gpt2, sites, positions):
    res = _atp(gpt2, sites, positions)
    ver = res.tables["verification"]
    assert list(ver["checked"]).count("top") == 6 and list(ver["checked"]).count("random") == 6
    assert sorted(ver.loc[ver["checked"] == "top", "approx_rank"]) == [1, 2, 3, 4, 5, 6]
    ex = ActivationPatching(dataset=DS, sites=sites, positions=positions,
                            directions=["denoising"]).run(gpt2, progress=False)
    mean = _mean_lines(ex)
    assert not mean["flagged"].any()
    exact = _by_site(mean, "position_name")
    est = _by_site(_mean_lines(res), "position_name")
    assert len(exact) == (12 if positions is None else 24)
    for _, r in ver.iterrows():
        pos = None if r["pos_key"] is None or pd.isna(r["pos_key"]) else str(r["pos_key"])
        key = (r["site"], int(r["layer"]), int(r["head_idx"]), pos)
        assert abs(r["exact_effect"] - exact[key]) < 1e-5, (key, r["exact_effect"], exact[key])
        assert abs(r["approx_effect"] - est[key]) < 1e-5, (key, r["approx_effect"], est[key])  # the result's own
    assert ver["exact_effect"].abs().max() > 0.01  # 1000x the tolerance
    if positions is not None:
        assert set(ver["pos_key"]) == {"S2", "END"}  # the random sample reaches the other position too
    # the summary's numbers are the table's
    stats = res.summary()["verification"]["denoising"]
    a, e = ver["approx_effect"].to_numpy(float), ver["exact_effect"].to_numpy(float)
    assert stats["n_checked"] == 12
    assert abs(stats["pearson"] - np.corrcoef(a, e)[0, 1]) < 1e-9
    assert abs(stats["max_abs_error"] - np.abs(a - e).max()) < 1e-9


# -- 2. a broken estimate is caught ----------------------------------------------------------------------


def test_verification_catches_a_broken_estimate(gpt2, monkeypatch):
    intact_res = _atp(gpt2, ["head_out"], None)
    intact = intact_res.summary()["verification"]["denoising"]
    assert intact["pearson"] > 0.8 and intact["sign_agreement"] > 0.9 and intact["top_k_recall"] > 0.8
    real = attribution_kind.attribution_patch

    def negated(*args, **kwargs):
        """The real estimate reflected about the base run: every estimated effect changes sign."""
        out = real(*args, **kwargs)
        for job in out.jobs:
            base = (out.corrupted if job.mode == "denoising" else out.clean)[job.pairs]  # [g, n_metrics]
            vals = job.values.reshape(len(job.index), len(job.pairs), -1)
            job.values = (2 * base[None] - vals).reshape(job.values.shape)
        return out

    monkeypatch.setattr(attribution_kind, "attribution_patch", negated)
    broken_res = AttributionPatching(dataset=DS, sites=["head_out"], directions=["denoising"],
                                     verify=VERIFY).run(gpt2, progress=False)
    broken = broken_res.summary()["verification"]["denoising"]
    assert broken["pearson"] < 0.3, broken
    assert broken["pearson"] < -0.9  # an exact reflection: the estimate is minus the (good) original
    assert broken["sign_agreement"] < intact["sign_agreement"] - 0.5, (broken, intact)
    # same |effect| ranking, so the same sites were checked, and the exact side did not move
    cols = ["site", "layer", "head_idx"]
    a = intact_res.tables["verification"].sort_values(cols).reset_index(drop=True)
    b = broken_res.tables["verification"].sort_values(cols).reset_index(drop=True)
    assert a[cols].equals(b[cols])
    assert np.abs(a["exact_effect"].to_numpy(float) - b["exact_effect"].to_numpy(float)).max() < 1e-6
    assert np.abs(a["approx_effect"].to_numpy(float) + b["approx_effect"].to_numpy(float)).max() < 1e-5


# -- 3. EdgeAttribution ------------------------------------------------------------------------------------


def test_edge_attribution_verification_is_path_patching_and_nodes_sum_edges(gpt2):
    cfg = EdgeAttribution(dataset=DS, method="eap", verify={"top_k": 3, "n_random": 5})
    res = cfg.run(gpt2, progress=False)
    graph = build_graph(gpt2)
    ver, edges, nodes = res.tables["verification"], res.tables["edges"], res.tables["nodes"]
    assert len(ver) == 8 and len(edges) == graph.n_edges
    clean, corr, tgt, foil = cfg.ids(cfg.prepare(gpt2))
    pairs = [e.split("->") for e in ver["edge"]]
    pr = path_patch(gpt2, clean, corr, [[u] for u, _ in pairs], [[v] for _, v in pairs], tgt, foil)
    exact = (pr.values[:, :, 0] - pr.corrupted[None, :, 0]).mean(1).numpy()
    err = np.abs(ver["exact_score"].to_numpy(float) - exact)
    assert err.max() < 1e-5, list(zip(ver["edge"], err))
    assert np.abs(exact).max() > 0.1
    score = edges.set_index("edge")["score"]
    assert np.abs(ver["approx_score"].to_numpy(float) - score[ver["edge"]].to_numpy(float)).max() < 1e-7
    # nodes: each upstream node's score is the sum of its outgoing edges' scores
    sums = edges.groupby("upstream")["score"].sum()
    assert sorted(nodes["node"]) == sorted(graph.upstream)
    heads = nodes[nodes["node"].str.match(r"^a\d+\.h\d+$")]
    assert len(heads) == 12
    for _, r in nodes.iterrows():
        assert abs(r["score"] - sums[r["node"]]) < 1e-5, (r["node"], r["score"], sums[r["node"]])
    assert heads["score"].abs().max() > 1e-3
    rows = res.tables["rows"]
    assert np.abs(rows["clean_logit_diff"].to_numpy() - pr.clean[:, 0].numpy()).max() < 1e-5
    assert np.abs(rows["corrupted_logit_diff"].to_numpy() - pr.corrupted[:, 0].numpy()).max() < 1e-5


@pytest.mark.parametrize("rule", [None, "midpoint"])
def test_edge_attribution_records_the_ig_rule_and_sign(gpt2, rule):
    """The EAP-IG rule (default: the eap package's left rule) and the sign convention are in the
    summary, the scores are those of the engine at that rule, and a circuit that computes EAP-IG
    scores itself records its rule too."""
    from tracekit.circuits.edges import edge_attribution

    kw = {} if rule is None else {"ig_rule": rule}
    cfg = EdgeAttribution(dataset=DS, method="eap_ig", ig_steps=2, verify={"enabled": False}, **kw)
    res = cfg.run(gpt2, progress=False)
    s = res.summary()
    assert s["ig_rule"] == (rule or "left") and s["ig_steps"] == 2
    assert "corrupted - clean" in s["sign_convention"] and "eap package" in s["sign_convention"]
    clean, corr, tgt, foil = cfg.ids(cfg.prepare(gpt2))
    es = edge_attribution(gpt2, clean, corr, tgt, foil, method="eap_ig", ig_steps=2, ig_rule=rule or "left")
    score = res.tables["edges"].set_index("edge")["score"]
    ref = es.frame().set_index("edge")["score"]
    assert np.abs(score[ref.index].to_numpy(float) - ref.to_numpy(float)).max() < 1e-7
    assert np.abs(ref.to_numpy(float)).max() > 1e-3
    assert EdgeAttribution(dataset=DS, method="eap", verify={"enabled": False}).run(
        gpt2, progress=False).summary()["ig_rule"] is None
    if rule is not None:
        circ = Circuit(dataset=DS, scores={"method": "eap_ig", "ig_steps": 2, "ig_rule": rule}, sizes=[0.5],
                       bootstrap=0).run(gpt2, progress=False)
        assert circ.summary()["ig_rule"] == rule


# -- 4. Circuit ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranked_circuit(gpt2):
    """A ranked edge circuit run, with the model's parameters and hooks before and after it."""
    params = {n: p.detach().clone() for n, p in gpt2.named_parameters()}
    grads = {n: (p.requires_grad, p.grad) for n, p in gpt2.named_parameters()}
    hooks = hook_keys(gpt2)
    res = Circuit(dataset=DS, scores={"method": "eap"}, sizes=[0.05, 0.5, 1.0], bootstrap=20).run(gpt2, progress=False)
    return res, (params, grads, hooks)


def test_circuit_full_and_empty_are_clean_and_corrupted(ranked_circuit):
    res, _ = ranked_circuit
    s = res.summary()
    assert s["level"] == "edges" and s["ablation"] == "corrupted" and s["n_candidates"] == s["n_graph_edges"] == 262
    assert abs(s["full_faithfulness"] - 1) < 1e-6
    assert abs(s["mean_empty"] - s["mean_corrupted"]) < 1e-5
    assert abs(s["mean_clean"] - s["mean_corrupted"]) > 0.5
    curve = res.tables["curve"]
    assert list(curve["circuit_size"]) == [13, 131, 262] and list(curve["n_edges"]) == [13, 131, 262]
    last = curve[curve["fraction"] == 1.0].iloc[0]
    assert abs(last["faithfulness"] - 1) < 1e-6
    assert abs(last["metric"] - s["mean_clean"]) < 1e-5  # every edge kept: the clean run
    # the MIB areas are trapezoids over the curve (x = 0 added with f = 0)
    x = np.r_[0.0, curve["fraction"].to_numpy(float)]
    f = np.r_[0.0, curve["faithfulness"].to_numpy(float)]
    assert abs(s["cpr"] - np.trapezoid(f, x)) < 1e-9
    assert abs(s["cmd"] - np.trapezoid(np.abs(1 - f), x)) < 1e-9
    assert s["cpr_ci"][0] <= s["cpr"] <= s["cpr_ci"][1]
    rows = res.tables["rows"]
    assert np.abs(rows["empty_logit_diff"] - rows["corrupted_logit_diff"]).max() < 1e-5


def test_circuit_run_leaves_the_model_untouched(gpt2, ranked_circuit):
    _, (params, grads, hooks) = ranked_circuit
    for n, p in gpt2.named_parameters():
        assert torch.equal(p, params[n]), n
        assert (p.requires_grad, p.grad) == grads[n], n
    assert hook_keys(gpt2) == hooks


def _all_nodes(graph) -> list[str]:
    return [u for u in graph.upstream if u != "input"]


@pytest.mark.parametrize("ablation", ["corrupted", "mean", "zero"])
def test_hand_listed_circuit_of_every_node_is_the_full_model(gpt2, ablation):
    graph = build_graph(gpt2)
    res = Circuit(dataset=DS, level="nodes", nodes=_all_nodes(graph), ablation=ablation,
                  bootstrap=10).run(gpt2, progress=False)
    s = res.summary()
    assert s["method"] == "hand" and s["n_candidates"] == 15
    assert abs(s["full_faithfulness"] - 1) < 1e-6
    curve = res.tables["curve"]
    assert len(curve) == 1 and curve["n_edges"].iloc[0] == graph.n_edges and curve["fraction"].iloc[0] == 1.0
    assert abs(curve["faithfulness"].iloc[0] - 1) < 1e-5
    assert abs(curve["metric"].iloc[0] - s["mean_clean"]) < 1e-5
    assert s["cpr"] is None and s["cmd"] is None and s["cpr_ci"] is None and s["cmd_ci"] is None
    if ablation == "corrupted":
        assert abs(s["mean_empty"] - s["mean_corrupted"]) < 1e-5
    else:  # another empty run than the corrupted one (mean: the clean prompts' mean write, near the clean run
        # here, as every clean prompt ends in the same token)
        assert abs(s["mean_empty"] - s["mean_corrupted"]) > 0.1


def test_hand_listed_edge_faithfulness_is_evaluate_circuits(gpt2):
    edge = "input->logits"
    cfg = Circuit(dataset=DS, edges=[edge], bootstrap=0)
    res = cfg.run(gpt2, progress=False)
    graph = build_graph(gpt2)
    clean, corr, tgt, foil = cfg.ids(cfg.prepare(gpt2))
    circ = circuit_from_edges(graph, [edge])
    assert int(circ.sum()) == 1
    run = evaluate_circuits(gpt2, clean, corr, torch.stack([circ, graph.mask, torch.zeros_like(graph.mask)]), tgt, foil)
    m, m_full, m_empty = (run.values[i, :, 0].mean().item() for i in range(3))
    want = (m - m_empty) / (m_full - m_empty)
    curve = res.tables["curve"]
    assert len(curve) == 1 and curve["n_edges"].iloc[0] == 1
    assert abs(curve["faithfulness"].iloc[0] - want) < 1e-5, (curve["faithfulness"].iloc[0], want)
    assert 0.05 < abs(want) and abs(want - 1) > 0.05  # neither empty nor full
    s = res.summary()
    assert s["cpr"] is None and s["cmd"] is None and s["circuit_edges"] == [edge] and s["circuit_mlps"] == [] and s["circuit_heads"] == []
    assert np.abs(res.tables["rows"]["circuit_logit_diff"].to_numpy() - run.values[0, :, 0].numpy()).max() < 1e-5


def test_full_faithfulness_detects_a_full_circuit_that_is_not_the_clean_run(gpt2, monkeypatch):
    import tracekit.circuits.curves as circuit_kind

    real = circuit_kind.evaluate_circuits

    def broken(*args, **kwargs):  # the full circuit (second to last) scores 0.3 above the clean run
        run = real(*args, **kwargs)
        run.values[-2] += 0.3
        return run

    monkeypatch.setattr(circuit_kind, "evaluate_circuits", broken)
    res = Circuit(dataset=DS, edges=["input->logits"], bootstrap=0).run(gpt2, progress=False)
    assert abs(res.summary()["full_faithfulness"] - 1) > 0.1, res.summary()["full_faithfulness"]


# -- 5. PathPatching -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_path_patching_into_every_receiver_is_activation_patching(arch):
    m = make_perturbed(arch)
    g = build_graph(m)
    recv = [d for d in g.downstream if g.mask[g.down_index[d], g.up_index["a0.h1"]]]
    pp = PathPatching(dataset=DS, senders=["a0.h1"], receivers=recv, recipe="live").run(m, progress=False)
    s = pp.summary()
    assert s["receivers"] == recv and s["n_variants"] == 1 and s["skipped"] == [] and s["recipe"] == "live"
    main = pp.tables["main"]
    got = main[main["scope"] == "row"].sort_values("pair")
    ap = ActivationPatching(dataset=DS, sites=["head_out"], layers=[0], directions=["denoising"]).run(m, progress=False)
    am = ap.tables["main"]
    want = am[(am["scope"] == "pair") & (am["metric"] == "logit_diff") & (am["head_idx"] == 1)].sort_values("pair")
    assert list(got["pair"]) == list(want["pair"]) == [0, 1, 2]
    assert np.abs(got["value"].to_numpy(float) - want["value"].to_numpy(float)).max() < 1e-5
    assert np.abs(got["value"].to_numpy(float) - got["base"].to_numpy(float)).max() > 1e-3


def test_path_patching_globs_expand_and_skip_late_senders(gpt2):
    cfg = PathPatching(dataset=DS, senders=["a0.h*", "m?"], receivers=["a1.h2"])
    res = cfg.run(gpt2, progress=False)
    s = res.summary()
    assert s["receivers"] == ["a1.h2<q>", "a1.h2<k>", "a1.h2<v>"]
    assert s["skipped"] == ["m1", "m2"]  # they write after block 1's attention reads
    senders = ["a0.h0", "a0.h1", "a0.h2", "a0.h3", "m0"]
    assert sorted(e["senders"] for e in s["effects"]) == senders and s["n_variants"] == 5
    clean, corr, tgt, foil = cfg.ids(cfg.prepare(gpt2))
    pr = path_patch(gpt2, clean, corr, [[x] for x in senders], [s["receivers"]] * 5, tgt, foil)
    main = res.tables["main"]
    for j, snd in enumerate(senders):
        got = main[(main["scope"] == "row") & (main["senders"] == snd)].sort_values("pair")["value"].to_numpy(float)
        assert np.abs(got - pr.values[j, :, 0].numpy()).max() < 1e-5, snd
    assert (pr.values[:, :, 0] - pr.corrupted[None, :, 0]).abs().max() > 1e-4


def test_llama_graph_groups_keys_and_values():
    m = make_perturbed("llama")
    g = build_graph(m)
    assert (g.n_heads, g.n_kv_heads) == (4, 2)
    assert g.receivers_of("a1.h3") == ["a1.h3<q>", "a1.h1<k>", "a1.h1<v>"]
    assert "a1.h2<k>" not in g.down_index


def test_gqa_kv_receiver_named_by_a_query_head_is_refused_with_the_right_name():
    """#36: a k/v receiver counts key/value heads; a query head's number there is refused naming the
    key/value head that query head reads (and the query heads sharing it), for receivers and edges."""
    m = make_perturbed("llama")
    g = build_graph(m)
    group = g.n_heads // g.n_kv_heads
    q = g.n_heads - 1  # a query head that is not also a key/value head's number
    kv = q // group
    share = ", ".join(str(h) for h in range(kv * group, (kv + 1) * group))
    with pytest.raises(CircuitError, match=re.escape(f"key/value head {kv}: write 'a1.h{kv}<v>' (query heads {share}")):
        PathPatching(dataset=DS, senders=["a0.h1"], receivers=[f"a1.h{q}<v>"]).check(m)
    with pytest.raises(CircuitError, match=re.escape(f"edges[0]: 'a1.h{q}<k>': query head {q}'s k input is key/value head {kv}")):
        Circuit(dataset=DS, edges=[f"a0.h1->a1.h{q}<k>"]).check(m)


def test_gqa_receivers_table_maps_kv_heads_to_the_query_heads_reading_them(tmp_path):
    """The receivers table (and summary) list, per k/v receiver, the query heads sharing it; checked
    against the model: noise added to key/value head G's value input changes exactly those heads' z."""
    from tracekit.core.sites import hook
    from tracekit.hooks import enabled_hooks, fwd_hooks
    from tracekit.tokens import forward_kwargs, tokenize

    m = make_perturbed("llama")
    g = build_graph(m)
    assert g.n_kv_heads < g.n_heads
    recv = [f"a1.h{kv}<v>" for kv in range(g.n_kv_heads)] + ["a1.h0<q>", "m1"]
    res = PathPatching(dataset=DS, senders=["a0.h1"], receivers=recv).run(m, progress=False)
    tab = res.tables["receivers"].set_index("receiver")
    batch = tokenize(m, [ROWS[0]["prompt"]])
    zs = {}
    for kv in [None, *range(g.n_kv_heads)]:
        def add(act, hook=None, kv=kv):
            if kv is not None:
                act = act.clone()
                act[:, :, kv] += torch.randn(act[:, :, kv].shape, generator=torch.Generator().manual_seed(0))
            return act

        def keep(act, hook=None, kv=kv):
            zs[kv] = act.detach().clone()

        with enabled_hooks(m, [hook("head_v_input", 1)]), torch.no_grad(), \
                fwd_hooks(m, [(hook("head_v_input", 1), add), (hook("head_out", 1), keep)]):
            m(batch.tokens, **forward_kwargs(batch))
    for kv in range(g.n_kv_heads):
        changed = [h for h in range(g.n_heads) if (zs[kv][:, :, h] - zs[None][:, :, h]).abs().max() > 1e-4]
        row = tab.loc[f"a1.h{kv}<v>"]
        assert row["head_numbering"] == "key_value" and int(row["head_idx"]) == kv
        assert row["query_heads"] == ",".join(str(h) for h in changed) and len(changed) == g.n_heads // g.n_kv_heads
        assert res.summary()["receiver_query_heads"][f"a1.h{kv}<v>"] == changed
    assert tab.loc["a1.h0<q>", "query_heads"] == "0" and tab.loc["a1.h0<q>", "head_numbering"] == "query"
    assert tab.loc["m1", "query_heads"] == "" and tab.loc["m1", "input"] == "mlp"
    s = res.summary()
    assert f"H // {g.n_heads // g.n_kv_heads}" in s["head_numbering"]
    assert "k/v receivers -> query heads sharing them: a1.h0<v> -> " in res.report()
    loaded = tk.Result.load(res.save(tmp_path / "pp"))
    assert loaded.summary()["receiver_query_heads"] == s["receiver_query_heads"]


# -- 6. bad inputs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: AttributionPatching(dataset=DS, sites=["head_out"], ablations=["zero"]), "ablations"),
    (lambda: Circuit(dataset=DS, edges=["m0->logits"], nodes=["m0"]), "edges and nodes"),
    (lambda: Circuit(dataset=DS, sizes=[0]), "sizes: 0"),
    (lambda: Circuit(dataset=DS, sizes=[2.5]), "sizes: 2.5"),
    (lambda: Circuit(dataset=DS, nodes=["m0"]), "level"),
], ids=["atp-ablations", "circuit-edges-and-nodes", "circuit-size-0", "circuit-size-2.5", "circuit-nodes-level"])
def test_bad_configs_are_refused_naming_the_field(make, match):
    with pytest.raises(ValidationError, match=match):
        make()


@pytest.mark.parametrize("make,error,match", [
    (lambda: PathPatching(dataset=DS, senders=["a99.h0"], receivers=["logits"]), MethodRefused,
     r"senders\[0\]: 'a99.h0' is not an upstream node"),
    (lambda: PathPatching(dataset=DS, senders=["a2.h0"], receivers=["a1.h0<q>"]), MethodRefused,
     r"senders\[0\]: a2.h0 writes after a receiver reads"),
    (lambda: PathPatching(dataset=DS, senders=["m0", ["a0.h1", "a2.h0"]], receivers=["a1.h0<q>"]), MethodRefused,
     r"senders\[1\]: a2.h0 writes after a receiver reads"),
    (lambda: PathPatching(dataset=DS, senders=["a*.h9"], receivers=["logits"]), MethodRefused,
     r"senders\[0\]: 'a\*.h9' matches no upstream node"),
    (lambda: PathPatching(dataset=DS, senders=["a0.h0"], receivers=["a1.h0<x>"]), CircuitError, "receivers"),
    (lambda: Circuit(dataset=DS, edges=["a2.h0->a1.h0<q>"]), CircuitError,
     r"edges\[0\]: 'a2.h0->a1.h0<q>' is not an edge: a2.h0 writes after a1.h0<q> reads"),
    (lambda: Circuit(dataset=DS, level="nodes", nodes=["m1", "a0.h9"]), CircuitError, r"nodes\[1\]: 'a0.h9'"),
    (lambda: EdgeAttribution(dataset={"rows": [{k: v for k, v in r.items() if k != "corrupted"} for r in ROWS]}),
     DatasetError, "corrupted"),
    # one duplicate policy: a repeated entry is refused, naming the field and the entry
    (lambda: PathPatching(dataset=DS, senders=["m0", ["a0.h1", "a0.h1"]], receivers=["logits"]), MethodRefused,
     r"senders\[1\]: 'a0.h1' is listed twice"),
    (lambda: PathPatching(dataset=DS, senders=["a0.h*", "a0.h2"], receivers=["logits"]), MethodRefused,
     r"senders\[1\]: a0.h2 is also given by senders\[0\]"),
    (lambda: PathPatching(dataset=DS, senders=[["a0.h1", "m0"], ["m0", "a0.h1"]], receivers=["logits"]), MethodRefused,
     r"senders\[1\]: m0\+a0.h1 is also given by senders\[0\]"),
    (lambda: PathPatching(dataset=DS, senders=["a0.h1"], receivers=["a2.h0<q>", "logits", "a2.h0<q>"]), MethodRefused,
     r"receivers: 'a2.h0<q>' is listed twice"),
    (lambda: Circuit(dataset=DS, edges=["m0->logits", "a0.h1->m1", "m0 -> logits"]), CircuitError,
     r"edges\[2\]: 'm0 -> logits' is listed twice \(also edges\[0\]\)"),
    (lambda: Circuit(dataset=DS, level="nodes", nodes=["m1", "a0.h2", "m1"]), CircuitError,
     r"nodes\[2\]: 'm1' is listed twice \(also nodes\[0\]\)"),
], ids=["unknown-sender", "sender-after-receiver", "listed-sender-after-receiver", "glob-no-match", "unknown-receiver", "circuit-not-an-edge",
        "circuit-unknown-node", "edges-without-corrupted", "sender-twice-in-group", "sender-twice-by-glob",
        "sender-group-twice", "receiver-twice", "circuit-edge-twice", "circuit-node-twice"])
def test_bad_inputs_are_refused_before_running(gpt2, monkeypatch, make, error, match):
    cfg = make()

    def no_run(*a, **k):  # the error must come from the checks, before any patching
        raise AssertionError("ran")

    monkeypatch.setattr(type(cfg), "_run", no_run)
    with pytest.raises(error, match=match):
        cfg.run(gpt2, progress=False)


def test_rows_without_corrupted_prompts_error_names_only_fields_of_the_kind(gpt2):
    rows = [{k: v for k, v in r.items() if k != "corrupted"} for r in ROWS]
    with pytest.raises(DatasetError) as e:
        EdgeAttribution(dataset={"rows": rows}).run(gpt2, progress=False)
    assert "directions" not in str(e.value) and "ablations" not in str(e.value), str(e.value)


def test_circuit_reads_saved_edge_scores(gpt2, tmp_path):
    """scores.edges_file (a saved edge_attribution table) gives the circuit the scores computed in place;
    a table naming edges this model lacks is refused naming the field."""
    eap = EdgeAttribution(dataset=DS, method="eap", verify={"enabled": False}).run(gpt2, progress=False)
    eap.tables["edges"].to_parquet(tmp_path / "edges.parquet")
    sizes = [0.05, 0.2]
    direct = Circuit(dataset=DS, scores={"method": "eap"}, sizes=sizes, bootstrap=0).run(gpt2, progress=False)
    read = Circuit(dataset=DS, scores={"method": "eap", "edges_file": str(tmp_path / "edges.parquet")}, sizes=sizes,
                   bootstrap=0).run(gpt2, progress=False)
    pd.testing.assert_frame_equal(direct.tables["curve"], read.tables["curve"], atol=1e-6)
    assert direct.summary()["circuit_edges"] == read.summary()["circuit_edges"]
    bad = eap.tables["edges"].copy()
    bad.loc[0, "edge"] = "a9.h0->logits"
    bad.to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(DatasetError, match="scores.edges_file"):
        Circuit(dataset=DS, scores={"edges_file": str(tmp_path / "bad.csv")}, sizes=sizes).run(gpt2, progress=False)


def test_circuit_refuses_a_bad_edges_file(gpt2, tmp_path):
    """scores.edges_file: a NaN score, an edge scored twice and scores saved with another model (same
    graph shape) are refused naming the file, the row(s) or both models; the same model's saved result
    folder is read."""
    from helpers import make_tiny

    eap = EdgeAttribution(dataset=DS, method="eap", verify={"enabled": False}).run(gpt2, progress=False)
    saved = eap.save(tmp_path / "eap")  # edges.parquet + meta.json recording the model
    sizes = [0.05, 0.2]

    def circuit(path, model=gpt2):
        return Circuit(dataset=DS, scores={"method": "eap", "edges_file": str(path)}, sizes=sizes,
                       bootstrap=0).run(model, progress=False)

    direct = Circuit(dataset=DS, scores={"method": "eap"}, sizes=sizes, bootstrap=0).run(gpt2, progress=False)
    read = circuit(saved / "edges.parquet")
    pd.testing.assert_frame_equal(direct.tables["curve"], read.tables["curve"], atol=1e-6)
    assert read.meta["scores_file_model"]["fingerprint"] == eap.meta["model_fingerprint"]
    edges = eap.tables["edges"]
    nan = edges.copy()
    nan.loc[3, "score"] = np.nan
    nan.to_parquet(tmp_path / "nan.parquet")
    with pytest.raises(DatasetError, match=r"nan.parquet' row 3 \(.*\) has score nan, not a finite number"):
        circuit(tmp_path / "nan.parquet")
    twice = pd.concat([edges, edges.iloc[[1]].assign(score=99.0)], ignore_index=True)
    twice.to_csv(tmp_path / "twice.csv", index=False)
    with pytest.raises(DatasetError, match=rf"rows 1 and {len(edges)} both score edge {edges['edge'][1]}"):
        circuit(tmp_path / "twice.csv")
    other = make_tiny("gpt2", seed=1)
    assert build_graph(other).edge_names() == build_graph(gpt2).edge_names()
    with pytest.raises(DatasetError, match=r"holds scores of model 'gpt2' \(fingerprint [0-9a-f]+.*this run's model "
                                           r"is 'gpt2' \(fingerprint [0-9a-f]+\); compute the scores on this model"):
        circuit(saved / "edges.parquet", other)
