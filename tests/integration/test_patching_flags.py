"""Issue 36 item 7 (patching): numbers that are easy to misread are flagged.

* A block-0 write at the only changed token that restores the whole clean/corrupted difference is
  trivially complete (an extended embedding), measured, not by name: built here by silencing block
  0's attention and scaling its MLP so that the MLP's write dominates the residual at that token.
* ``top_sites`` reports lines whose bootstrap intervals overlap the first line's as tied.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import make_tiny
from tracekit.experiments.patching import ActivationPatchingResult

PAIRS: list = [{"clean": "The capital of France is", "corrupted": "The capital of Italy is", "target": " Paris",
                "foil": " Rome"},
               {"clean": "The capital of Spain is", "corrupted": "The capital of Japan is", "target": " Madrid",
                "foil": " Tokyo"},
               {"clean": "The capital of Peru is", "corrupted": "The capital of Chile is", "target": " Lima",
                "foil": " Santiago"}]


@pytest.fixture(scope="module")
def mlp0_embedding_model():
    """Block 0's attention writes nothing and its MLP's write is 50x: after block 0 only the changed
    token's position differs, and there the MLP's write is nearly the whole residual."""
    m = make_tiny("gpt2", seed=3)
    with torch.no_grad():
        m.blocks[0].attn.W_O.zero_()
        m.blocks[0].attn.b_O.zero_()
        m.blocks[0].mlp.W_out.mul_(50.0)
    return m


def frame(x) -> pd.DataFrame:
    """A selection typed as a frame (the stubs type ``df[mask]`` loosely)."""
    assert isinstance(x, pd.DataFrame)
    return x


def _run(model, pairs, **kw) -> ActivationPatchingResult:
    r = tk.ActivationPatching(pairs=pairs, sites=["resid_pre", "mlp_out", "attn_out"],
                                 directions=["denoising", "noising"], metrics=["logit_diff"],
                                 min_denominator=1e-6, **kw).run(model, progress=False)
    assert isinstance(r, ActivationPatchingResult)
    return r


def test_block0_mlp_at_the_only_changed_token_is_trivially_complete(mlp0_embedding_model):
    r = _run(mlp0_embedding_model, PAIRS)
    allr = r.top_sites(n=10_000, family="all", trivial=True, intervals=False)
    mlp = frame(allr[allr["site"] == "mlp_out"])
    at = frame(mlp[(mlp["layer"] == 0) & (mlp["pos_from_end"] == -2)])  # ' France' / ' Italy', the only change
    assert len(at) == 2  # denoising and noising
    # the construction works: the MLP's write restores the whole difference within the tolerance
    assert np.abs(np.asarray(at["effect"], dtype=float) - 1).max() < 0.05
    assert bool(np.asarray(at["trivial"]).all())
    assert all("first write after the only changed token" in c for c in at["trivial_cause"])
    # not an unrelated site: block 0's MLP elsewhere, later MLPs at the token, the attention writes
    others = frame(allr[~allr.index.isin(at.index) & allr["site"].isin(["mlp_out", "attn_out"])])
    assert len(others) > 0 and not bool(np.asarray(others["trivial"]).any())
    # left out of the ranking, listed with its cause in the summary and the report
    top = r.top_sites(n=50)
    assert not bool(np.asarray((top["site"] == "mlp_out") & (top["layer"] == 0) & (top["pos_from_end"] == -2)).any())
    s = r.summary()
    causes = {(t["intervention"], t["site"], t["label"]): t["cause"] for t in s["trivial_sites"]}
    assert any(k[1] == "mlp_out" and "L0" in k[2] for k in causes)
    assert "trivially complete" in r.report()


def test_block0_mlp_that_does_not_restore_everything_is_a_finding(tiny_gpt2):
    """Same site and token in an unmodified model: marked only when its measured effect is within
    the tolerance of the whole residual's."""
    from tracekit.experiments.patching_tables import TRIVIAL_TOL

    r = _run(tiny_gpt2, PAIRS)
    allr = r.top_sites(n=10_000, family="all", trivial=True, intervals=False)
    at = frame(allr[(allr["site"] == "mlp_out") & (allr["layer"] == 0) & (allr["pos_from_end"] == -2)])
    assert len(at) == 2
    expect = np.abs(np.asarray(at["effect"], dtype=float) - 1) <= TRIVIAL_TOL
    assert (np.asarray(at["trivial"], dtype=bool) == expect).all()


def test_top_sites_ties_within_the_bootstrap_interval(tiny_gpt2):
    # identical rows: every resample is the same, the intervals are points; only lines with exactly
    # the leader's effect (resid_post L -> resid_pre L+1 is one activation) overlap it
    same = _run(tiny_gpt2, [PAIRS[0]] * 3, top_k=8)
    t = same.top_sites(family="resid")
    eff = t["effect"].to_numpy(dtype=float)
    assert np.allclose(t["ci_low"].to_numpy(dtype=float), eff, atol=1e-9)
    assert np.allclose(t["ci_high"].to_numpy(dtype=float), eff, atol=1e-9)
    equal = np.abs(np.abs(eff) - abs(eff[0])) <= 1e-9
    equal[0] = False
    assert (t["tied_with_top"].to_numpy() == equal).all()
    assert not t["tied_with_top"].to_numpy()[~equal].any() and (~equal[1:]).any()  # separated lines exist
    assert (t["rank"].to_numpy()[equal] == 1).all()
    # different rows: intervals of width > 0 around each line's effect; the tie flag is their overlap
    varied = _run(tiny_gpt2, PAIRS, top_k=8)
    v = varied.top_sites(family="resid")
    lo, hi = v["ci_low"].to_numpy(dtype=float), v["ci_high"].to_numpy(dtype=float)
    e = v["effect"].to_numpy(dtype=float)
    assert (lo <= e + 1e-9).all() and (e <= hi + 1e-9).all() and (hi - lo > 0).any()
    s = varied.summary()
    tied = [f"{r['site']} {r['label']}" for r in s["top_resid_sites"] if r["tied_with_top"]]
    assert s["top_resid_sites_tied"] == tied
    if tied:
        assert "tied (within the 95% bootstrap interval)" in varied.report()


#: Two-token countries swapped for two-token countries (GPT-2: ' New' ' Zealand', ' South' ' Africa',
#: ' Costa' ' Rica', ' Sri' ' Lanka'): two changed positions per row, as some generated capitals rows
#: (the targets are any single tokens: the model is random).
TWO_TOKEN_PAIRS: list = [{"clean": "The capital of New Zealand is", "corrupted": "The capital of South Africa is",
                          "target": " Paris", "foil": " Rome"},
                         {"clean": "The capital of Costa Rica is", "corrupted": "The capital of Sri Lanka is",
                          "target": " Madrid", "foil": " Tokyo"}]


def test_block0_write_where_several_tokens_differ_is_marked_against_the_measured_residual(mlp0_embedding_model):
    """Two changed tokens: block 0's MLP at the last one is compared with the measured block-0
    residual at that position (not with 1: the other changed token is not restored), and marked
    only when it restores as much."""
    from tracekit.experiments.patching_tables import TRIVIAL_TOL

    r = _run(mlp0_embedding_model, TWO_TOKEN_PAIRS)
    allr = r.top_sites(n=10_000, family="all", trivial=True, intervals=False)
    at0 = (allr["layer"] == 0) & (allr["pos_from_end"] == -2)
    mlp = frame(allr[at0 & (allr["site"] == "mlp_out")]).set_index("intervention")
    res = frame(allr[at0 & (allr["site"] == "resid_pre")]).set_index("intervention")
    assert len(mlp) == len(res) == 2
    # the block-0 residual at one of two changed tokens is not trivially complete: a finding
    assert not bool(np.asarray(res["trivial"]).any())
    close = (mlp["effect"].astype(float) - res.loc[mlp.index, "effect"].astype(float)).abs() <= TRIVIAL_TOL
    assert bool(close.any())  # the construction makes the MLP's write the whole residual there
    assert (mlp["trivial"].astype(bool) == close).all()
    for c in mlp.loc[close[close].index, "trivial_cause"]:
        assert "other tokens differ too" in c
