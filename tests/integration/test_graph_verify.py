"""Verification of attribution graphs by intervention (tracekit.graphs.verify).

* in the frozen local replacement model with the graph's features held active (linear), the measured
  change of the metric equals the graph's prediction (adjacency propagated through (I - W)^-1) to
  float error, for ablation and scaling, with and without a feature budget, on perturbed GPT-2 and
  Llama (GQA, rotary) with imperfect ReLU / JumpReLU / TopK / skip transcoders;
* the prediction equals a hand-computed chain on a hand-built graph;
* in the real model, on a ReLU GPT-2 whose transcoders are its own MLPs, the report has finite
  numbers, a baseline that reproduces the logits and a high correlation; the seeded sample repeats;
* refusals (unknown mode, target not a logit node) and no state (hooks, gradients) left behind.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from graph_models import IDS, PARIS, ROME, mlp_transcoders, random_transcoders, relu_gpt2  # noqa: E402

from helpers import make_perturbed
from tracekit.core.errors import ConfigError, MethodRefused
from tracekit.graphs.attribution import build_graph
from tracekit.graphs.graph import AttributionGraph
from tracekit.graphs.replacement import LocalReplacementModel
from tracekit.graphs.verify import TABLE_COLUMNS, frozen_changes, predict_changes, verification_frame, verify_graph


def model_state(m) -> tuple:
    hooks = sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in m.hook_dict.values())
    rg = tuple(p.requires_grad for p in m.parameters())
    grads = sum(p.grad is not None for p in m.parameters())
    return hooks, rg, grads


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("foil", [ROME, None])
def test_prediction_equals_frozen_replacement_model(arch, foil):
    m = make_perturbed(arch)
    ds = random_transcoders(m)
    g = build_graph(m, ds, IDS, target=PARIS, foil=foil)
    lrm = LocalReplacementModel(m, ds, IDS)
    nodes = torch.arange(g.n_features)
    for factor in (0.0, 2.0, -0.5):
        deltas = (factor - 1.0) * g.activations.double()[nodes]
        pred = predict_changes(g, nodes, deltas)
        meas = frozen_changes(m, ds, g, nodes, factor, replacement=lrm)
        scale = max(1.0, float(meas.abs().max()))
        assert float((pred - meas).abs().max()) < 2e-4 * scale, (factor, pred[:5], meas[:5])
        # not trivially zero: many features move the metric
        assert int((meas.abs() > 1e-3).sum()) > g.n_features // 4


def test_prediction_with_feature_budget():
    """With max_feature_nodes, features that are not nodes stay at their clean activations in both."""
    m = make_perturbed("llama")
    ds = random_transcoders(m, seed=3)
    full = build_graph(m, ds, IDS, target=PARIS, foil=ROME)
    g = build_graph(m, ds, IDS, target=PARIS, foil=ROME, max_feature_nodes=max(4, full.n_features // 3))
    assert g.n_features < full.n_features
    nodes = torch.arange(g.n_features)
    pred = predict_changes(g, nodes, -g.activations.double())
    meas = frozen_changes(m, ds, g, nodes, 0.0)
    assert float((pred - meas).abs().max()) < 2e-4 * max(1.0, float(meas.abs().max()))


def _hand_graph(foil: bool) -> AttributionGraph:
    # nodes: f0 (L0,p0), f1 (L1,p0) | errors 2 layers x 1 pos | token | logits l0 (target), l1 (foil)
    n = 2 + 2 + 1 + 2
    A = torch.zeros(n, n)
    A[1, 0] = 3.0  # f1 <- f0 (activation of f0 = 2: per unit 1.5)
    A[5, 0] = 4.0  # l0 <- f0 (per unit 2)
    A[5, 1] = 0.5  # l0 <- f1 (activation of f1 = 0.25: per unit 2)
    A[6, 1] = -1.0  # l1 <- f1 (per unit -4)
    A[5, 4] = 7.0  # token edges never move in an intervention
    target = {"id": 10, "token": "a"}
    if foil:
        target.update(foil_id=11, foil_token="b")
    return AttributionGraph(prompt="", token_ids=torch.tensor([1]), tokens=["x"], n_layers=2,
                            features=torch.tensor([[0, 0, 5], [1, 0, 6]]), activations=torch.tensor([2.0, 0.25]),
                            logit_ids=torch.tensor([10, 11]), logit_probs=torch.tensor([0.6, 0.3]),
                            logit_tokens=["a", "b"], adjacency=A, error_norms=torch.zeros(2, 1), target=target)


def test_prediction_by_hand():
    g = _hand_graph(foil=False)
    # ablate f0 (delta -2): l0 changes by 2 * -2 (direct) + 2 * (1.5 * -2) (through f1) = -4 - 6 = -10
    out = predict_changes(g, torch.tensor([0, 1]), torch.tensor([-2.0, -0.25], dtype=torch.float64))
    assert out.tolist() == pytest.approx([-10.0, -0.5], abs=1e-9)
    g = _hand_graph(foil=True)
    # with the foil: f0: l0 -10, l1 -4 * (1.5 * -2) = 12 -> -22; f1: l0 -0.5, l1 -4 * -0.25 = 1 -> -1.5
    out = predict_changes(g, torch.tensor([0, 1]), torch.tensor([-2.0, -0.25], dtype=torch.float64))
    assert out.tolist() == pytest.approx([-22.0, -1.5], abs=1e-9)


def test_target_must_be_a_logit_node():
    g = _hand_graph(foil=False)
    g.target = {"id": 99}
    with pytest.raises(MethodRefused, match="target"):
        predict_changes(g, torch.tensor([0]), torch.tensor([1.0], dtype=torch.float64))
    g.target = {}
    with pytest.raises(ConfigError, match="target"):
        predict_changes(g, torch.tensor([0]), torch.tensor([1.0], dtype=torch.float64))


def test_real_model_with_exact_transcoders():
    m = relu_gpt2()
    ds = mlp_transcoders(m)
    g = build_graph(m, ds, IDS, target=PARIS, foil=ROME, zero_bos=False)
    assert float(g.error_norms.max()) < 1e-4
    before = model_state(m)
    r = verify_graph(m, ds, g, top_k=8, n_random=8, seed=1)
    assert model_state(m) == before
    iv = r["intervention"]
    assert g.verification["intervention"] is iv and "scores" in g.verification
    assert iv["metric"] == "logit_diff" and iv["mode"] == "ablate"
    assert iv["baseline_max_abs_logit_error"] < 1e-4
    assert iv["frozen_max_abs_miss"] < 1e-3
    tab = iv["table"]
    assert len(tab) == 16 and sum(r_["checked_as"] == "top" for r_ in tab) == 8
    for row in tab:
        for k in ("activation", "influence", "predicted", "frozen", "measured", "miss"):
            assert math.isfinite(row[k])
        assert row["miss"] == pytest.approx(row["measured"] - row["predicted"], abs=1e-9)
        assert (int(g.features[row["node"], 0]), int(g.features[row["node"], 1])) == (row["layer"], row["pos"])
    df = verification_frame(r)
    assert list(df.columns) == list(TABLE_COLUMNS) and len(df) == 16
    assert df["influence_rank"].is_monotonic_increasing
    # the top-k are the highest-influence feature nodes
    ranks = sorted(r_["influence_rank"] for r_ in tab if r_["checked_as"] == "top")
    assert ranks == list(range(1, 9))
    s = iv["summary"]
    assert s["n_checked"] == 16 and s["pearson"] is not None and s["pearson"] > 0.5, s
    sc = r["scores"]
    # exact transcoders: no error influence at all
    assert sc["replacement"] == pytest.approx(1.0, abs=1e-4) and sc["completeness"] == pytest.approx(1.0, abs=1e-4)
    assert 0 <= sc["pruned"]["replacement"] <= 1


def test_real_model_random_transcoders_and_seed():
    m = make_perturbed("llama")
    ds = random_transcoders(m)
    g = build_graph(m, ds, IDS, target=PARIS)
    a = verify_graph(m, ds, g, top_k=3, n_random=5, seed=4, mode="scale", scale=0.5)
    b = verify_graph(m, ds, g, top_k=3, n_random=5, seed=4, mode="scale", scale=0.5)
    c = verify_graph(m, ds, g, top_k=3, n_random=5, seed=5, mode="scale", scale=0.5)
    nodes = [r["node"] for r in a["intervention"]["table"]]
    assert nodes == [r["node"] for r in b["intervention"]["table"]]
    assert nodes != [r["node"] for r in c["intervention"]["table"]]
    assert [r["measured"] for r in a["intervention"]["table"]] == [r["measured"] for r in b["intervention"]["table"]]
    assert a["intervention"]["metric"] == "demeaned_logit" and a["intervention"]["scale"] == 0.5
    assert a["intervention"]["baseline_max_abs_logit_error"] < 1e-4
    assert a["intervention"]["frozen_max_abs_miss"] < 1e-3
    for row in a["intervention"]["table"]:
        assert math.isfinite(row["measured"]) and math.isfinite(row["predicted"])
    # batch size does not change the numbers
    d = verify_graph(m, ds, g, top_k=3, n_random=5, seed=4, mode="scale", scale=0.5, batch_size=2)
    got = [r["measured"] for r in d["intervention"]["table"]]
    want = [r["measured"] for r in a["intervention"]["table"]]
    assert got == pytest.approx(want, abs=1e-5)


def test_refusals_and_no_state_left():
    m = make_perturbed("gpt2")
    ds = random_transcoders(m)
    g = build_graph(m, ds, IDS, target=PARIS, foil=ROME)
    with pytest.raises(ConfigError, match="mode"):
        verify_graph(m, ds, g, mode="patch")
    with pytest.raises(ConfigError, match="top_k"):
        verify_graph(m, ds, g, top_k=-1)

    class Boom(RuntimeError):
        pass

    before = model_state(m)
    orig = ds[1].encode
    calls = {"n": 0}

    def encode(x):
        calls["n"] += 1
        if calls["n"] >= 2:  # the first intervened batch (the clean run is the first call)
            raise Boom("mid-run")
        return orig(x)

    ds[1].encode = encode  # type: ignore[method-assign]
    try:
        with pytest.raises(Boom):  # one row per batch: the clean row, then the first intervened batch raises
            verify_graph(m, ds, g, top_k=2, n_random=2, batch_size=1)
    finally:
        del ds[1].encode
    assert calls["n"] >= 2
    assert model_state(m) == before
    assert all(p.grad is None for p in ds[1].parameters())
