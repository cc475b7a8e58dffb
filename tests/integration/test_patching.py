"""Activation patching: exactness against TransformerLens' one-at-a-time patching, the
normalisation invariants, and the promised errors/flags.

Tolerances: results must equal one-at-a-time patching within 1e-4 (the issue's bound); in float32
batched vs unbatched matmuls differ by ~1e-6 on these models.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from transformer_lens import patching as tlp

import tracekit as tk
from tracekit import patching as P
from tracekit.tokens import TokenizationError, single_token_id, tokenize

TOL = 1e-4

PARIS = {"clean": "The capital of France is", "corrupted": "The capital of Italy is",
         "answer": " Paris", "wrong": " Rome"}
SPAIN = {"clean": "The capital of Spain is", "corrupted": "The capital of Japan is",
         "answer": " Madrid", "wrong": " Tokyo"}
IOI = {"clean": "When John and Mary went to the shops, John gave the bag to",
       "corrupted": "When John and Mary went to the shops, Mary gave the bag to",
       "answer": " Mary", "wrong": " John"}


def _tl_metric(model, pairs):
    a = torch.tensor([single_token_id(model, p["answer"]) for p in pairs])
    w = torch.tensor([single_token_id(model, p["wrong"]) for p in pairs])
    b = torch.arange(len(pairs))

    def tl_metric(logits):  # TransformerLens: [batch, pos, vocab] -> scalar
        return (logits[b, -1, a] - logits[b, -1, w]).mean()

    def tk_metric(logits, prompt):  # tracekit: [rows, vocab] at the last position -> [rows]
        r = torch.arange(len(prompt))
        return logits[r, a[prompt]] - logits[r, w[prompt]]

    return tl_metric, tk_metric


def _tokens(model, pairs):
    return (tokenize(model, [p["clean"] for p in pairs]).tokens,
            tokenize(model, [p["corrupted"] for p in pairs]).tokens)


CASES = [
    ("resid_pre", tlp.get_act_patch_resid_pre, P.get_act_patch_resid_pre),
    ("resid_mid", tlp.get_act_patch_resid_mid, P.get_act_patch_resid_mid),
    ("attn_out", tlp.get_act_patch_attn_out, P.get_act_patch_attn_out),
    ("mlp_out", tlp.get_act_patch_mlp_out, P.get_act_patch_mlp_out),
    ("head_out_by_pos", tlp.get_act_patch_attn_head_out_by_pos, P.get_act_patch_attn_head_out_by_pos),
    ("head_out", tlp.get_act_patch_attn_head_out_all_pos, P.get_act_patch_attn_head_out_all_pos),
    ("head_pattern", tlp.get_act_patch_attn_head_pattern_all_pos, P.get_act_patch_attn_head_pattern_all_pos),
    ("head_v", tlp.get_act_patch_attn_head_v_all_pos,
     lambda *a, **k: P.generic_activation_patch(*a, patch_setter=P.layer_head_vector_setter,
                                                activation_name="head_v", **k)),
]


@pytest.mark.parametrize("name,tl_fn,tk_fn", CASES, ids=[c[0] for c in CASES])
def test_matches_transformer_lens_one_at_a_time(tiny_model, name, tl_fn, tk_fn):
    """Batched, layer-skipping patching == TransformerLens' one-forward-per-site patching."""
    pairs = [PARIS, SPAIN]
    clean, corrupted = _tokens(tiny_model, pairs)
    tl_metric, tk_metric = _tl_metric(tiny_model, pairs)
    _, clean_cache = tiny_model.run_with_cache(clean)
    ref = tl_fn(tiny_model, corrupted, clean_cache, tl_metric).cpu()
    # small batches: chunks span several start layers (exercises the staircase replay)
    ours = tk_fn(tiny_model, corrupted, clean, tk_metric, batch_size=5).mean(0)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL
    assert ref.abs().max() > 0  # the comparison is not vacuous
    if name == "resid_pre":  # also without skipping no-op patches
        ours2 = tk_fn(tiny_model, corrupted, clean, tk_metric, skip_unchanged=False, batch_size=7).mean(0)
        assert (ours2 - ref).abs().max().item() <= TOL


def test_resid_post_and_neurons_match_generic_tl(tiny_llama):
    """resid_post (patched at the next block's input) and MLP neurons vs TL's generic patcher."""
    pairs = [PARIS]
    clean, corrupted = _tokens(tiny_llama, pairs)
    tl_metric, tk_metric = _tl_metric(tiny_llama, pairs)
    _, cache = tiny_llama.run_with_cache(clean)
    ref = tlp.generic_activation_patch(tiny_llama, corrupted, cache, tl_metric, tlp.layer_pos_patch_setter,
                                       "resid_post", index_axis_names=("layer", "pos")).cpu()
    ours = P.get_act_patch_resid_post(tiny_llama, corrupted, clean, tk_metric).mean(0)
    assert (ours - ref).abs().max().item() <= TOL
    idf = pd.DataFrame({"layer": [0, 1, 2, 2], "neuron": [0, 5, 7, 127]})

    def neuron_setter(act, index, clean_act):  # TL style: all positions of one neuron
        act[:, :, index[1]] = clean_act[:, :, index[1]]
        return act

    ref_n = tlp.generic_activation_patch(tiny_llama, corrupted, cache, tl_metric, neuron_setter, "post",
                                         index_df=idf).cpu()
    ours_n = P.get_act_patch_mlp_neuron(tiny_llama, corrupted, clean, tk_metric, index_df=idf).mean(0)
    assert (ours_n - ref_n).abs().max().item() <= TOL


def _exp(**kw):
    base = dict(pairs=[PARIS], sites=["resid_pre_layer", "resid_pre"], directions=["denoising", "noising"],
                min_denominator=1e-6)
    base.update(kw)
    return tk.ActivationPatching(**base)


def test_clean_is_one_corrupted_is_zero_and_full_layer0_patch(tiny_model):
    res = _exp().run(tiny_model, progress=False)
    base = res.tables["baselines"]
    for r in base.itertuples():
        # the normalisation maps the clean and corrupted scores exactly (not approximately) to 1 and 0
        assert P.normalize(r.clean, r.clean, r.corrupted, 1e-12) == 1.0
        assert P.normalize(r.corrupted, r.clean, r.corrupted, 1e-12) == 0.0
    df = res.tables["main"]
    full = df[(df["site"] == "resid_pre_layer") & (df["layer"] == 0) & (df["scope"] == "pair")]
    for m in ("logit_diff", "prob", "log_prob", "kl"):
        b = base[base["metric"] == m].iloc[0]
        den = full[(full["direction"] == "denoising") & (full["metric"] == m)].iloc[0]
        noi = full[(full["direction"] == "noising") & (full["metric"] == m)].iloc[0]
        # denoising the whole residual stream at layer 0 *is* the clean run; noising it, the corrupted run
        assert abs(den["value"] - b["clean"]) <= TOL
        assert abs(noi["value"] - b["corrupted"]) <= TOL
        if abs(b["denominator"]) > 1e-3:
            assert abs(den["normalized"] - 1) <= TOL / abs(b["denominator"]) + 1e-6
            assert abs(noi["normalized"]) <= TOL / abs(b["denominator"]) + 1e-6


def test_noising_mirrors_denoising(tiny_gpt2):
    """Noising a pair == denoising the pair with clean and corrupted swapped (raw metric values)."""
    swapped = {**PARIS, "clean": PARIS["corrupted"], "corrupted": PARIS["clean"]}
    kw = dict(sites=["resid_pre", "head_out", "mlp_out"], metrics=["logit_diff", "prob"])
    a = _exp(pairs=[PARIS], directions=["noising"], **kw).run(tiny_gpt2, progress=False).to_frame()
    b = _exp(pairs=[swapped], directions=["denoising"], **kw).run(tiny_gpt2, progress=False).to_frame()
    key = ["site", "layer", "position", "head", "metric"]
    a = a[a["scope"] == "pair"].sort_values(key).reset_index(drop=True)
    b = b[b["scope"] == "pair"].sort_values(key).reset_index(drop=True)
    assert len(a) == len(b) > 0
    assert np.abs(a["value"].to_numpy() - b["value"].to_numpy()).max() <= TOL


def test_pairs_of_different_lengths_equal_each_pair_alone(tiny_llama):
    """Pairs of different token lengths run together give each pair's results when run alone."""
    kw = dict(sites=["resid_pre", "attn_out", "head_out_by_pos"], directions=["denoising"],
              metrics=["logit_diff", "kl"], batch_size=16)
    both = _exp(pairs=[PARIS, IOI], **kw).run(tiny_llama, progress=False).to_frame()
    assert both[both["scope"] == "mean"]["position"].isna().all()  # positions do not align across lengths
    key = ["site", "layer", "position", "head", "metric"]
    for i, p in enumerate([PARIS, IOI]):
        alone = _exp(pairs=[p], **kw).run(tiny_llama, progress=False).to_frame()
        alone = alone[alone["scope"] == "pair"].sort_values(key).reset_index(drop=True)
        mine = both[both["pair"] == i].sort_values(key).reset_index(drop=True)
        assert len(alone) == len(mine)
        assert np.abs(alone["value"].to_numpy() - mine["value"].to_numpy()).max() <= TOL


def test_ablations_run_and_zero_differs(tiny_gpt2):
    res = _exp(pairs=[PARIS, SPAIN], sites=["mlp_out"], directions=[], ablations=["zero", "mean", "resample"],
               metrics=["logit_diff"]).run(tiny_gpt2, progress=False)
    df = res.to_frame()
    assert set(df["direction"]) == {"zero", "mean", "resample"}
    assert df["value"].notna().all()
    z = df[(df["direction"] == "zero") & (df["scope"] == "pair")]
    base = res.tables["baselines"].set_index("pair")["clean"]
    # zeroing an MLP output at the last position changes the clean run
    assert (z["value"] - z["pair"].map(base)).abs().max() > 1e-6


def test_length_mismatch_error_shows_both_tokenizations(tiny_gpt2):
    exp = _exp(pairs=[{**PARIS, "corrupted": "The capital of Kyrgyzstan is"}])
    with pytest.raises(TokenizationError) as e:
        exp.check(tiny_gpt2)
    msg = str(e.value)
    assert "pairs[0]" in msg and "same length" in msg and "clean" in msg and "corrupted" in msg
    assert "' France'" in msg and "' Ky'" in msg or "Ky" in msg
    assert "<-" in msg  # the differing positions are marked side by side


def test_length_mismatch_stops_before_model_work(tiny_gpt2, monkeypatch):
    called = []
    monkeypatch.setattr(P, "cache_run", lambda *a, **k: called.append(1))
    with pytest.raises(TokenizationError):
        _exp(pairs=[PARIS, {**PARIS, "corrupted": "The capital of Kyrgyzstan is"}]).run(tiny_gpt2, progress=False)
    assert not called


def test_multi_token_answer_error(tiny_gpt2):
    with pytest.raises(TokenizationError, match=r"pairs\[0\]\.answer"):
        _exp(pairs=[{**PARIS, "answer": " Parisianism"}]).check(tiny_gpt2)
    with pytest.raises(ValueError, match=r"pairs\[0\]\.wrong"):
        _exp(pairs=[{**PARIS, "wrong": None}]).check(tiny_gpt2)


def test_near_zero_denominator_is_flagged_not_divided(tiny_gpt2):
    same = {**PARIS, "corrupted": PARIS["clean"]}  # clean == corrupted: a gap of exactly 0
    res = _exp(pairs=[PARIS, same], min_denominator=1e-3, sites=["resid_pre"],
               metrics=["logit_diff"]).run(tiny_gpt2, progress=False)
    base = res.tables["baselines"]
    assert bool(base[base["pair"] == 1]["flagged"].iloc[0])
    df = res.to_frame()
    flagged_rows = df[df["pair"] == 1]
    assert flagged_rows["normalized"].isna().all() and flagged_rows["flagged"].all()
    s = res.summary()
    assert s["n_flagged"] == 1 and s["flagged_pairs"][0]["pair"] == 1
    assert "FLAGGED" in res.report()
    # the mean rows use only the unflagged pair
    m = df[(df["scope"] == "mean")].sort_values(["layer", "position"])["value"].to_numpy()
    p0 = df[(df["pair"] == 0)].sort_values(["layer", "position"])["value"].to_numpy()
    assert np.allclose(m, p0)
    assert math.isnan(P.normalize(1.0, 0.5, 0.5 + 1e-9, 1e-3))


def test_run_chunked_halves_on_oom():
    seen = []

    def fn(sl):
        if sl.stop - sl.start > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        seen.extend(range(sl.start, sl.stop))

    assert P.run_chunked(fn, 19, 16) == 4
    assert seen == list(range(19))
    with pytest.raises(ValueError):
        P.run_chunked(lambda sl: (_ for _ in ()).throw(ValueError("not memory")), 3, 2)
    assert P.auto_batch_size  # exists; returns a positive int
    assert P.is_oom(RuntimeError("CUDA error: out of memory"))


def test_pairs_file_jsonl_and_csv(tmp_path, tiny_gpt2):
    j = tmp_path / "pairs.jsonl"
    j.write_text("\n".join(json.dumps(p) for p in [PARIS, SPAIN]))
    c = tmp_path / "pairs.csv"
    pd.DataFrame([PARIS, SPAIN]).to_csv(c, index=False)
    for f in (j, c):
        exp = tk.ActivationPatching(pairs_file=str(f), sites=["attn_out"], layers=[-1], metrics=["logit_diff"])
        exp.check(tiny_gpt2)
        assert [p.answer for p in exp.all_pairs()] == [" Paris", " Madrid"]
    with pytest.raises(ValueError, match="pairs_file"):
        tk.ActivationPatching(pairs_file=str(tmp_path / "nope.jsonl")).check(tiny_gpt2)
    with pytest.raises(ValueError, match="pairs"):
        tk.ActivationPatching()
    with pytest.raises(ValueError, match="neuron_layers"):
        tk.ActivationPatching(pairs=[PARIS], sites=["neuron"])
    with pytest.raises(ValueError, match="unknown site"):
        tk.ActivationPatching(pairs=[PARIS], sites=["resid_pr"])


def test_result_tables_figures_and_roundtrip(tiny_gpt2, tmp_path):
    res = _exp(pairs=[PARIS, SPAIN], sites=["block_every", "head_out", "head_out_by_pos"],
               directions=["denoising"], min_denominator=1e-6).run(tiny_gpt2, progress=False)
    df = res.to_frame()
    assert {"site", "layer", "position", "head", "pair", "metric", "value", "normalized"} <= set(df.columns)
    s = res.summary()
    assert len(s["top_sites"]) == 10 and "denoising/resid_pre" in s["top_by_site"]
    figs = res.figures()
    assert {"denoising_resid_pre", "denoising_head_out", "denoising_head_out_by_pos"} <= set(figs)
    labels = [t.get_text() for t in figs["denoising_resid_pre"].axes[0].get_xticklabels()]
    assert any("France/ Italy" in t or "France/ Spain" in t for t in labels), labels
    import matplotlib.pyplot as plt

    plt.close("all")
    d = res.save(tmp_path / "r", figures=False)
    back = tk.experiments.base.Result.load(d)
    assert back.summary() == s


def test_configs_validate():
    from pathlib import Path

    from tracekit.config import load_config

    root = Path(__file__).resolve().parents[2] / "experiments"
    for name in ("paris_patching.yaml", "ioi_patching.yaml"):
        cfg, _ = load_config(root / name)
        assert cfg.experiments[0].kind == "activation_patching"
    cfg, _ = load_config(root / "ioi_patching.yaml")
    assert len(cfg.experiments[0].pairs) == 8


@pytest.mark.slow
def test_embedded_model_paris(embedded_model):
    """On SmolLM2-135M: the ' France' position carries the answer early, the last position late;
    a sample of sites equals plain one-site run_with_hooks patching."""
    m = embedded_model
    res = _exp(pairs=[PARIS], sites=["resid_pre"], directions=["denoising"], metrics=["logit_diff"],
               min_denominator=1e-3).run(m, progress=False)
    base = res.tables["baselines"].iloc[0]
    assert base["clean"] > 1 and base["corrupted"] < 0  # ' Paris' over ' Rome' only for France
    df = res.to_frame()
    df = df[df["scope"] == "pair"]
    grid = df.pivot_table(index="layer", columns="position", values="normalized")
    # layer 0: ' France' is the only differing position, so patching it *is* the clean run
    assert abs(grid.loc[0, 4] - 1) < 1e-3
    assert (grid.loc[0, [0, 1, 2, 3, 5]].abs() < 1e-6).all()  # identical positions: no-op patches
    assert grid.loc[29, 5] > 0.9 and abs(grid.loc[29, 4]) < 0.1  # late: the answer has moved to ' is'
    clean, corrupted = _tokens(m, [PARIS])
    _, cache = m.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
    a, w = single_token_id(m, " Paris"), single_token_id(m, " Rome")
    for L, p in [(3, 4), (17, 5), (25, 4)]:
        def hook(act, hook, p=p, L=L):
            act[:, p] = cache[f"blocks.{L}.hook_resid_pre"][:, p]
            return act

        lg = m.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.{L}.hook_resid_pre", hook)])
        ref = (lg[0, -1, a] - lg[0, -1, w]).item()
        ours = df[(df["layer"] == L) & (df["position"] == p)]["value"].iloc[0]
        assert abs(ours - ref) <= TOL
