"""Circuit discovery on the real embedded model (SmolLM2-135M-Instruct): IOI rows, AtP checked
against exact patching, EAP checked against exact path patching, a faithful circuit, and the
S-inhibition-like heads found by path patching into the name movers' queries.

The numbers asserted are properties any correct implementation has on this model (clean logit
difference positive on the rows kept, the full circuit is the clean run, the estimate agrees with
exact patching on the heads it ranks first), not values copied from a run."""

from __future__ import annotations

import pytest

import tracekit as tk

ROWS = {"generator": {"name": "ioi", "n": 6, "seed": 0, "corrupt": "swap_s2"}, "filter": "correct"}


@pytest.mark.slow
def test_ioi_circuit_on_the_embedded_model(embedded_model):
    atp = tk.AttributionPatching(dataset=ROWS, sites=["head_out"], metrics=["logit_diff"],
                                 verify={"top_k": 8, "n_random": 8}).run(embedded_model, progress=False)
    s = atp.summary()
    assert s["share_rows_correct"] == 1.0
    v = s["verification"]["denoising"]
    assert v["n_checked"] == 16
    # exact effects of the checked heads come from real exact runs: the ranking agrees at the top
    assert v["spearman"] > 0.7 and v["sign_agreement"] >= 0.8
    ver = atp.tables["verification"]
    assert ver["exact_effect"].abs().max() > 0.1

    eap = tk.EdgeAttribution(dataset=ROWS, method="eap", verify={"top_k": 6, "n_random": 4}).run(
        embedded_model, progress=False)
    e = eap.summary()
    assert e["n_edges"] > 50_000
    assert e["verification"]["pearson"] > 0.8

    circ = tk.Circuit(dataset=ROWS, scores={"method": "eap"}, sizes=[0.001, 0.01], bootstrap=50).run(
        embedded_model, progress=False)
    c = circ.summary()
    assert abs(c["full_faithfulness"] - 1.0) < 1e-4
    assert abs(c["mean_empty"] - c["mean_corrupted"]) < 1e-3  # corrupted ablation: the empty circuit is the corrupted run
    curve = circ.tables["curve"]
    assert curve["faithfulness"].iloc[-1] > 0.5  # 1% of the edges carry most of the logit difference

    paths = tk.PathPatching(dataset=ROWS, senders=["a19.h*", "a20.h*"],
                            receivers=["a23.h3<q>", "a23.h0<q>", "a23.h1<q>", "a29.h1<q>"]).run(
        embedded_model, progress=False)
    top = paths.summary()["effects"][0]
    assert top["mean_effect"] > 0.05  # some head in blocks 19-20 drives the name movers' queries
