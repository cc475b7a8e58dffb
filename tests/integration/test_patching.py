"""Activation patching: exactness against TransformerLens' one-at-a-time patching, the
normalisation invariants, the promised errors/flags, the ablation baselines and hook hygiene.

Numeric invariants run on ``perturbed_model`` (GPT-2 / Llama GQA / tied Llama x weight processing
on/off, perturbed norms and biases, O(1) logits). Tolerance: 2e-5 absolute (float32; batched vs
unbatched matmuls differ by ~1e-6 on these models).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from transformer_lens import patching as tlp

import tracekit as tk
from tracekit import patching as P
from tracekit.errors import ConfigError, PatchingError
from tracekit.metrics import normalize
from tracekit.tokens import TokenizationError, single_token_id, tokenize

TOL = 2e-5

PARIS = {"clean": "The capital of France is", "corrupted": "The capital of Italy is",
         "target": " Paris", "foil": " Rome"}
SPAIN = {"clean": "The capital of Spain is", "corrupted": "The capital of Japan is",
         "target": " Madrid", "foil": " Tokyo"}
GERMANY = {"clean": "The capital of Germany is", "corrupted": "The capital of Egypt is",
           "target": " Berlin", "foil": " Cairo"}
IOI = {"clean": "When John and Mary went to the shops, John gave the bag to",
       "corrupted": "When John and Mary went to the shops, Mary gave the bag to",
       "target": " Mary", "foil": " John"}


def _tl_metric(model, pairs):
    a = torch.tensor([single_token_id(model, p["target"]) for p in pairs])
    w = torch.tensor([single_token_id(model, p["foil"]) for p in pairs])
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
    ("resid_pre", tlp.get_act_patch_resid_pre, P.batched_act_patch_resid_pre),
    ("resid_mid", tlp.get_act_patch_resid_mid, P.batched_act_patch_resid_mid),
    ("attn_out", tlp.get_act_patch_attn_out, P.batched_act_patch_attn_out),
    ("mlp_out", tlp.get_act_patch_mlp_out, P.batched_act_patch_mlp_out),
    ("head_out_by_pos", tlp.get_act_patch_attn_head_out_by_pos, P.batched_act_patch_attn_head_out_by_pos),
    ("head_out", tlp.get_act_patch_attn_head_out_all_pos, P.batched_act_patch_attn_head_out_all_pos),
    ("head_pattern", tlp.get_act_patch_attn_head_pattern_all_pos, P.batched_act_patch_attn_head_pattern_all_pos),
    ("head_v", tlp.get_act_patch_attn_head_v_all_pos,
     lambda *a, **k: P.batched_activation_patch(*a, patch_setter=P.layer_head_vector_setter,
                                                activation_name="head_v", **k)),
]


@pytest.mark.parametrize("name,tl_fn,tk_fn", CASES, ids=[c[0] for c in CASES])
def test_matches_transformer_lens_one_at_a_time(perturbed_model, name, tl_fn, tk_fn):
    """Batched, layer-skipping patching == TransformerLens' one-forward-per-site patching."""
    tiny_model = perturbed_model
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


def test_resid_post_and_neurons_match_generic_tl(perturbed_model):
    """resid_post (patched at the next block's input) and MLP neurons vs TL's generic patcher."""
    tiny_llama = perturbed_model
    pairs = [PARIS]
    clean, corrupted = _tokens(tiny_llama, pairs)
    tl_metric, tk_metric = _tl_metric(tiny_llama, pairs)
    _, cache = tiny_llama.run_with_cache(clean)
    ref = tlp.generic_activation_patch(tiny_llama, corrupted, cache, tl_metric, tlp.layer_pos_patch_setter,
                                       "resid_post", index_axis_names=("layer", "pos")).cpu()
    ours = P.batched_act_patch_resid_post(tiny_llama, corrupted, clean, tk_metric).mean(0)
    assert (ours - ref).abs().max().item() <= TOL
    idf = pd.DataFrame({"layer": [0, 1, 2, 2], "neuron": [0, 5, 7, 127]})

    def neuron_setter(act, index, clean_act):  # TL style: all positions of one neuron
        act[:, :, index[1]] = clean_act[:, :, index[1]]
        return act

    ref_n = tlp.generic_activation_patch(tiny_llama, corrupted, cache, tl_metric, neuron_setter, "post",
                                         index_df=idf).cpu()
    ours_n = P.batched_act_patch_mlp_neuron(tiny_llama, corrupted, clean, tk_metric, index_df=idf).mean(0)
    assert (ours_n - ref_n).abs().max().item() <= TOL


def _exp(**kw):
    base = {"pairs": [PARIS], "sites": ["resid_pre_layer", "resid_pre"], "directions": ["denoising", "noising"],
                "min_denominator": 1e-6}
    base.update(kw)
    return tk.ActivationPatching(**base)


def test_clean_is_one_corrupted_is_zero_and_full_layer0_patch(perturbed_model):
    res = _exp().run(perturbed_model, progress=False)
    base = res.tables["baselines"]
    for r in base.itertuples():
        # the normalisation maps the clean and corrupted scores exactly (not approximately) to 1 and 0
        assert normalize(r.clean, r.clean, r.corrupted, 1e-12) == 1.0
        assert normalize(r.corrupted, r.clean, r.corrupted, 1e-12) == 0.0
    df = res.tables["main"]
    full = df[(df["site"] == "resid_pre_layer") & (df["layer"] == 0) & (df["scope"] == "pair")]
    for m in ("logit_diff", "prob", "log_prob", "kl"):
        b = base[base["metric"] == m].iloc[0]
        den = full[(full["intervention"] == "denoising") & (full["metric"] == m)].iloc[0]
        noi = full[(full["intervention"] == "noising") & (full["metric"] == m)].iloc[0]
        # denoising the whole residual stream at layer 0 *is* the clean run; noising it, the corrupted run
        assert abs(den["value"] - b["clean"]) <= TOL
        assert abs(noi["value"] - b["corrupted"]) <= TOL
        if abs(b["denominator"]) > 1e-3:
            assert abs(den["normalized"] - 1) <= TOL / abs(b["denominator"]) + 1e-6
            assert abs(noi["normalized"]) <= TOL / abs(b["denominator"]) + 1e-6


def test_noising_mirrors_denoising(tiny_gpt2):
    """Noising a pair == denoising the pair with clean and corrupted swapped (raw metric values)."""
    swapped = {**PARIS, "clean": PARIS["corrupted"], "corrupted": PARIS["clean"]}
    kw = {"sites": ["resid_pre", "head_out", "mlp_out"], "metrics": ["logit_diff", "prob"]}
    a = _exp(pairs=[PARIS], directions=["noising"], **kw).run(tiny_gpt2, progress=False).to_frame()
    b = _exp(pairs=[swapped], directions=["denoising"], **kw).run(tiny_gpt2, progress=False).to_frame()
    key = ["site", "layer", "position", "head_idx", "metric"]
    a = a[a["scope"] == "pair"].sort_values(key).reset_index(drop=True)
    b = b[b["scope"] == "pair"].sort_values(key).reset_index(drop=True)
    assert len(a) == len(b) > 0
    assert np.abs(a["value"].to_numpy() - b["value"].to_numpy()).max() <= TOL


def test_pairs_of_different_lengths_equal_each_pair_alone(tiny_llama):
    """Pairs of different token lengths run together give each pair's results when run alone
    (position-indexed sites at positions counted from the end, chosen on purpose: without them such
    pairs are refused, test_dataset_patching)."""
    kw = {"sites": ["resid_pre", "attn_out", "head_out_by_pos"], "directions": ["denoising"],
          "metrics": ["logit_diff", "kl"], "batch_size": 16, "positions": [-1, -2, -3]}
    both = _exp(pairs=[PARIS, IOI], **kw).run(tiny_llama, progress=False).to_frame()
    assert both[both["scope"] == "mean"]["position"].isna().all()  # positions do not align across lengths
    key = ["site", "layer", "position", "head_idx", "metric"]
    for i, p in enumerate([PARIS, IOI]):
        alone = _exp(pairs=[p], **kw).run(tiny_llama, progress=False).to_frame()
        alone = alone[alone["scope"] == "pair"].sort_values(key).reset_index(drop=True)
        mine = both[both["pair"] == i].sort_values(key).reset_index(drop=True)
        assert len(alone) == len(mine)
        assert np.abs(alone["value"].to_numpy() - mine["value"].to_numpy()).max() <= TOL


def test_ablations_run_and_zero_differs(tiny_gpt2):
    res = _exp(pairs=[PARIS, SPAIN, GERMANY], sites=["mlp_out"], directions=[], ablations=["zero", "mean", "resample"],
               metrics=["logit_diff"]).run(tiny_gpt2, progress=False)
    df = res.to_frame()
    assert set(df["intervention"]) == {"zero", "mean", "resample"}
    assert df["value"].notna().all()
    z = df[(df["intervention"] == "zero") & (df["scope"] == "pair")]
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
    monkeypatch.setattr(P.run, "cache_run", lambda *a, **k: called.append(1))
    with pytest.raises(TokenizationError):
        _exp(pairs=[PARIS, {**PARIS, "corrupted": "The capital of Kyrgyzstan is"}]).run(tiny_gpt2, progress=False)
    assert not called


def test_multi_token_answer_error(tiny_gpt2):
    with pytest.raises(TokenizationError, match=r"pairs\[0\]\.target"):
        _exp(pairs=[{**PARIS, "target": " Parisianism"}]).check(tiny_gpt2)
    with pytest.raises(PatchingError, match=r"pairs\[0\]\.foil"):
        _exp(pairs=[{**PARIS, "foil": None}]).check(tiny_gpt2)


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
    assert s["n_rows_flagged"] == 1 and s["flagged_rows"][0]["pair"] == 1 and s["flagged_rows"][0]["row_id"] == 1
    assert "FLAGGED" in res.report()
    # the mean rows use only the unflagged pair
    m = df[(df["scope"] == "mean")].sort_values(["layer", "position"])["value"].to_numpy()
    p0 = df[(df["pair"] == 0)].sort_values(["layer", "position"])["value"].to_numpy()
    assert np.allclose(m, p0)
    assert math.isnan(normalize(1.0, 0.5, 0.5 + 1e-9, 1e-3))


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
        assert [p.target for p in exp.all_pairs()] == [" Paris", " Madrid"]
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
    assert {"site", "layer", "position", "head_idx", "pair", "row_id", "metric", "value", "normalized"} <= set(df.columns)
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
    for name in ("paris_patching.yaml", "paris_patching_gpt2.yaml", "ioi_patching.yaml"):
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
    toks = res.tables["tokens"]
    toks = toks[(toks["pair"] == 0) & (toks["prompt"] == "clean")]["token"].tolist()
    fr, last = toks.index(" France"), len(toks) - 1  # BOS follows the tokenizer (none for SmolLM2)
    # layer 0: ' France' is the only differing position, so patching it *is* the clean run
    assert abs(grid.loc[0, fr] - 1) < 1e-3
    assert (grid.loc[0, [p for p in range(len(toks)) if p != fr]].abs() < 1e-6).all()  # no-op patches
    assert grid.loc[29, last] > 0.9 and abs(grid.loc[29, fr]) < 0.1  # late: the answer has moved to ' is'
    clean, corrupted = _tokens(m, [PARIS])
    _, cache = m.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_resid_pre"))
    a, w = single_token_id(m, " Paris"), single_token_id(m, " Rome")
    for L, p in [(3, fr), (17, last), (25, fr)]:
        def hook(act, hook, p=p, L=L):
            act[:, p] = cache[f"blocks.{L}.hook_resid_pre"][:, p]
            return act

        lg = m.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.{L}.hook_resid_pre", hook)])
        ref = (lg[0, -1, a] - lg[0, -1, w]).item()
        ours = df[(df["layer"] == L) & (df["position"] == p)]["value"].iloc[0]
        assert abs(ours - ref) <= TOL


# ---------------------------------------------------------------------------------------------
# Engine / names / vocabulary
# ---------------------------------------------------------------------------------------------

IOI_B = {"clean": "When Tom and James went to the park, James gave the ball to",
         "corrupted": "When Tom and James went to the park, Tom gave the ball to", "target": " Tom", "foil": " James"}
IOI_C = {"clean": "When Dan and Sid went to the shops, Sid gave an apple to",
         "corrupted": "When Dan and Sid went to the shops, Dan gave an apple to", "target": " Dan", "foil": " Sid"}


def _ids(model, pairs):
    from tracekit.tokens import encode

    return ([encode(model, p["clean"]) for p in pairs], [encode(model, p["corrupted"]) for p in pairs],
            [[single_token_id(model, p["target"])] for p in pairs],
            [[single_token_id(model, p["foil"])] for p in pairs])


def test_transformer_lens_names_are_not_reused():
    import inspect

    for old in ("generic_activation_patch", "get_act_patch_resid_pre", "get_act_patch_attn_head_out_by_pos",
                "get_act_patch_mlp_neuron", "answer_prob", "answer_log_prob", "row_metric"):
        assert not hasattr(P, old), old
    assert "index_axis_names" not in inspect.signature(P.batched_activation_patch).parameters
    assert "batched_act_patch_resid_pre" in P.__all__ and "run_patching" in P.__all__


def test_metrics_come_from_tracekit_metrics(tiny_gpt2, monkeypatch):
    """The kind scores runs with tracekit.metrics.METRICS (no re-implementation): replacing 'prob'
    there changes every prob value of the table."""
    import tracekit.metrics as M

    monkeypatch.setitem(M.METRICS, "prob", lambda lg, m: torch.full((lg.shape[0],), 0.25))
    res = _exp(sites=["resid_pre"], metrics=["logit_diff", "prob"]).run(tiny_gpt2, progress=False)
    df = res.tables["main"]
    assert (df[df["metric"] == "prob"]["value"] == 0.25).all()
    assert (res.tables["baselines"].query("metric == 'prob'")[["clean", "corrupted"]] == 0.25).all().all()
    assert (df[df["metric"] == "logit_diff"]["value"] != 0.25).any()


def test_experiment_table_is_the_engine_result(tiny_llama):
    """ActivationPatching._run only shapes tables: its values are run_patching's."""
    pairs = [PARIS, SPAIN]
    res = _exp(pairs=pairs, sites=["attn_out", "head_out"], directions=["denoising", "noising"],
               metrics=["logit_diff", "kl"]).run(tiny_llama, progress=False)
    c, x, t, f = _ids(tiny_llama, pairs)
    out = P.run_patching(tiny_llama, c, x, ["attn_out", "head_out"], ["denoising", "noising"], ["logit_diff", "kl"],
                         t, f)
    df = res.tables["main"]
    for job in out.jobs:
        rows = df[(df["scope"] == "pair") & (df["intervention"] == job.mode) & (df["site"] == job.site.name)
                  & (df["metric"] == "kl")]
        assert np.array_equal(np.sort(rows["value"].to_numpy()), np.sort(job.values[:, 1].numpy()))
    assert torch.equal(out.clean[:, 0], torch.tensor(res.tables["baselines"].query("metric == 'logit_diff'")
                                                     .sort_values("pair")["clean"].to_numpy(), dtype=torch.float32))


def test_retired_pair_keys_name_the_new_key(tmp_path):
    from tracekit.config import parse_config
    from tracekit.experiments.patching import load_pairs

    for old, new in (("answer", "target"), ("wrong", "foil")):
        pair = {k: v for k, v in PARIS.items() if k != new}
        pair[old] = PARIS[new]
        with pytest.raises(ConfigError, match=rf"experiments\[0\]\.pairs\[0\]\.{old}: '{old}' was renamed to '{new}'"):
            parse_config({"experiments": [{"kind": "activation_patching", "pairs": [pair]}]})
        with pytest.raises(ValueError, match=f"renamed to '{new}'"):
            tk.ActivationPatching(pairs=[pair])
        f = tmp_path / f"{old}.jsonl"
        f.write_text(json.dumps(pair) + "\n")
        with pytest.raises(ConfigError, match=f"renamed to '{new}'"):
            load_pairs(f)


def test_layers_are_block_indices_negative_from_the_end(tiny_gpt2):
    a = _exp(sites=["mlp_out"], layers=[-1]).run(tiny_gpt2, progress=False).to_frame()
    b = _exp(sites=["mlp_out"], layers=[2]).run(tiny_gpt2, progress=False).to_frame()
    assert set(a["layer"]) == {2} and np.array_equal(a["value"].to_numpy(), b["value"].to_numpy())
    with pytest.raises(PatchingError, match=r"layers\[0\]: layer 3 out of range"):
        _exp(sites=["mlp_out"], layers=[3]).check(tiny_gpt2)
    with pytest.raises(PatchingError, match=r"neurons\[0\]"):
        _exp(sites=["neuron"], neuron_layers=[0], neurons=[10_000]).check(tiny_gpt2)


def _model_info(model):
    from tracekit.model.info import ModelInfo, _info_from_config
    from tracekit.model.load import model_spec_of
    from tracekit.model.source import _load_config_and_tokenizer

    spec = model_spec_of(model)
    cfg, tok, bridge = _load_config_and_tokenizer(spec)
    info = _info_from_config(spec, cfg, tok, bridge)
    assert isinstance(info, ModelInfo)
    return info


def test_check_works_on_model_info(tiny_gpt2):
    """check() needs only the tokenizer and config: it runs on a ModelInfo and refuses the same inputs."""
    info = _model_info(tiny_gpt2)
    _exp(pairs=[PARIS, SPAIN, GERMANY], ablations=["mean", "resample"], layers=[-1]).check(info)
    with pytest.raises(PatchingError, match="baseline_prompts"):
        _exp(pairs=[PARIS, SPAIN], ablations=["mean"]).check(info)
    with pytest.raises(TokenizationError, match="same length"):
        _exp(pairs=[{**PARIS, "corrupted": "The capital of Kyrgyzstan is"}]).check(info)
    with pytest.raises(PatchingError, match="layers"):
        _exp(layers=[7]).check(info)


# ---------------------------------------------------------------------------------------------
# Ablation baselines: a stated population, never the prompt itself
# ---------------------------------------------------------------------------------------------

def _patched_logit_diff(model, text, target, foil, hook, values):
    """Reference: one plain run_with_hooks forward of ``text`` with ``hook``'s activation replaced
    position by position by ``values`` ([pos, ...])."""
    toks = tokenize(model, [text]).tokens

    def fn(act, hook):
        act[0] = values.to(act.dtype)
        return act

    with torch.no_grad():
        lg = model.run_with_hooks(toks, fwd_hooks=[(hook, fn)])[0, -1].float()
    return (lg[single_token_id(model, target)] - lg[single_token_id(model, foil)]).item()


def _acts(model, text, hook):
    with torch.no_grad():
        _, cache = model.run_with_cache(tokenize(model, [text]).tokens, names_filter=lambda n: n == hook)
    return cache[hook][0]


def test_mean_and_resample_use_other_prompts_aligned_from_the_end(tiny_model):
    """A pair alone in its length group (old fault: 'mean' replaced its site by its own activation,
    effect exactly 0) is ablated to the mean over the other clean prompts, aligned from the end;
    resample takes another prompt's activation, recorded in baseline_source."""
    m = tiny_model
    pairs = [PARIS, IOI, IOI_B, IOI_C]
    res = _exp(pairs=pairs, sites=["mlp_out_layer", "mlp_out"], layers=[1], directions=[], positions=[-1],
               ablations=["mean", "resample"], metrics=["logit_diff"], seed=3).run(m, progress=False)
    df = res.tables["main"]
    df = df[df["scope"] == "pair"]
    hook = "blocks.1.hook_mlp_out"
    clean_acts = [_acts(m, p["clean"], hook) for p in pairs]
    base = res.tables["baselines"].set_index("pair")["clean"]
    for i, p in enumerate(pairs):
        n = clean_acts[i].shape[0]
        others = [a[-n:] for j, a in enumerate(clean_acts) if j != i and a.shape[0] >= n]
        mean_rows = df[(df["intervention"] == "mean") & (df["pair"] == i)]
        assert set(mean_rows["baseline_n"]) == {len(others)} and len(others) >= 2
        assert mean_rows["baseline_source"].isna().all()
        mean = torch.stack(others).mean(0)
        whole = mean_rows[mean_rows["site"] == "mlp_out_layer"]["value"].item()
        assert abs(whole - _patched_logit_diff(m, p["clean"], p["target"], p["foil"], hook, mean)) <= TOL
        assert abs(whole - base[i]) > 1e-4  # the ablation changes the run (old code: exactly 0 for pair 0)
        last = mean_rows[(mean_rows["site"] == "mlp_out") & (mean_rows["pos_from_end"] == -1)]["value"].item()
        one = clean_acts[i].clone()
        one[-1] = mean[-1]
        assert abs(last - _patched_logit_diff(m, p["clean"], p["target"], p["foil"], hook, one)) <= TOL
        rs = df[(df["intervention"] == "resample") & (df["pair"] == i)]
        (src,) = set(rs["baseline_source"])
        assert src != i and clean_acts[src].shape[0] >= n and set(rs["baseline_n"]) == {1}
        whole = rs[rs["site"] == "mlp_out_layer"]["value"].item()
        ref = _patched_logit_diff(m, p["clean"], p["target"], p["foil"], hook, clean_acts[src][-n:])
        assert abs(whole - ref) <= TOL
    assert res.meta["baseline_population"]["size"] == 4


def test_baseline_prompts_population(tiny_gpt2):
    pop = ["The capital of Spain is", "The capital of Japan is", "Hi", "The capital of France is"]
    res = _exp(pairs=[PARIS], sites=["resid_pre_layer"], layers=[1], directions=[], ablations=["mean", "resample"],
               baseline_prompts=pop, metrics=["logit_diff"]).run(tiny_gpt2, progress=False)
    df = res.tables["main"]
    df = df[df["scope"] == "pair"]
    hook = "blocks.1.hook_resid_pre"
    # 'Hi' is shorter than the pair and the last prompt *is* the pair's clean prompt: neither counts
    mean = (_acts(tiny_gpt2, pop[0], hook) + _acts(tiny_gpt2, pop[1], hook)) / 2
    row = df[df["intervention"] == "mean"]
    assert row["baseline_n"].item() == 2
    ref = _patched_logit_diff(tiny_gpt2, PARIS["clean"], " Paris", " Rome", hook, mean)
    assert abs(row["value"].item() - ref) <= TOL
    assert df[df["intervention"] == "resample"]["baseline_source"].item() in (0, 1)
    assert res.meta["baseline_population"]["source"] == "baseline_prompts"
    with pytest.raises(ValueError, match="baseline_prompts"):
        _exp(pairs=[PARIS], baseline_prompts=pop)  # no ablation uses it


def test_too_small_baseline_population_is_refused(tiny_gpt2, monkeypatch):
    called = []
    monkeypatch.setattr(P.run, "cache_run", lambda *a, **k: called.append(1))
    cases = [([PARIS, SPAIN], "mean"),          # one other prompt: a 'mean' of one
             ([PARIS, IOI], "mean"),            # pairs alone in their length group
             ([PARIS], "resample"),              # nothing to draw from
             ([PARIS, {**PARIS}], "resample")]   # the only other prompt is the same prompt
    for pairs, mode in cases:
        with pytest.raises(PatchingError, match=rf"ablations: '{mode}' ablation of pairs\[\d\].*baseline_prompts"):
            _exp(pairs=pairs, sites=["resid_pre_layer"], directions=[], ablations=[mode]).run(tiny_gpt2, progress=False)
    assert not called
    clean = tokenize(tiny_gpt2, [PARIS["clean"], SPAIN["clean"]]).tokens
    with pytest.raises(PatchingError, match="source"):
        P.batched_act_patch_resid_pre(tiny_gpt2, clean, None, lambda lg, b: lg[:, 0], source="mean")


# ---------------------------------------------------------------------------------------------
# Hooks never outlive a call
# ---------------------------------------------------------------------------------------------

def _hook_count(model) -> int:
    """Hooks on the model, not counting the libraries' own lazy capture hooks (TransformerLens wires
    those on the first forward pass that needs them and keeps them for good: tracekit.hooks)."""
    from tracekit.hooks import _library_internal

    def own(d):
        return sum(1 for fn in d.values() if not _library_internal(fn))
    return sum(own(mod._forward_hooks) + own(mod._forward_pre_hooks) + len(getattr(mod, "fwd_hooks", []) or [])
               for mod in model.modules())


def _fail_staircase_cat(monkeypatch, exc, times=10**9):
    """torch.cat raises ``exc`` when _replay grows a staircase batch (after it registered hooks)."""
    real = torch.cat
    left = [times]

    def cat(tensors, *a, **k):
        if sys._getframe(1).f_code.co_name == "_replay" and tensors[0].ndim == 3 and left[0] > 0:
            left[0] -= 1
            raise exc
        return real(tensors, *a, **k)

    monkeypatch.setattr(torch, "cat", cat)


@pytest.mark.parametrize("entry", ["batched", "run_patching"])
def test_out_of_memory_in_the_staircase_leaves_no_hook(tiny_gpt2, monkeypatch, entry):
    """OOM while growing the batch (hooks for the joining rows already registered): the batch is
    halved and retried, the results are unchanged, and no hook is left on the model."""
    m = tiny_gpt2
    clean, corrupted = _tokens(m, [PARIS, SPAIN])
    _, tk_metric = _tl_metric(m, [PARIS, SPAIN])
    c, x, t, f = _ids(m, [PARIS, SPAIN])

    def call():
        if entry == "batched":
            return P.batched_act_patch_attn_out(m, corrupted, clean, tk_metric, batch_size=64, skip_unchanged=False)
        out = P.run_patching(m, c, x, ["attn_out", "head_out"], ["denoising", "zero"], ["logit_diff"], t, f,
                             batch_size=64, skip_unchanged=False)
        return torch.cat([j.values for j in out.jobs])

    with torch.no_grad():
        plain = m(corrupted)
    hooks = _hook_count(m)
    ref = call()
    _fail_staircase_cat(monkeypatch, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), times=3)
    got = call()
    monkeypatch.undo()
    assert _hook_count(m) == hooks
    assert (got - ref).abs().max().item() <= TOL
    with torch.no_grad():
        assert torch.equal(m(corrupted), plain)


@pytest.mark.parametrize("where", ["staircase", "cache_run", "metric"])
def test_interrupt_or_bad_metric_leaves_no_hook(tiny_llama, monkeypatch, where):
    m = tiny_llama
    clean, corrupted = _tokens(m, [PARIS])
    _, tk_metric = _tl_metric(m, [PARIS])
    with torch.no_grad():
        plain = m(clean)
    hooks = _hook_count(m)
    metric, exc = tk_metric, KeyboardInterrupt
    if where == "staircase":
        _fail_staircase_cat(monkeypatch, KeyboardInterrupt())
    elif where == "cache_run":
        def boom(*a, **k):
            raise KeyboardInterrupt

        monkeypatch.setattr(m, "run_with_cache", boom)
    else:
        exc = ValueError

        def metric(logits, prompt):
            raise ValueError("bad metric")

    with pytest.raises(exc):
        P.batched_act_patch_mlp_out(m, corrupted, clean, metric, batch_size=64, skip_unchanged=False)
    monkeypatch.undo()
    assert _hook_count(m) == hooks
    with torch.no_grad():
        assert torch.equal(m(clean), plain)


# ---------------------------------------------------------------------------------------------
# Inputs: no padded batches; whole-residual invariant; batched == unbatched
# ---------------------------------------------------------------------------------------------

def test_padded_batches_are_refused(tiny_gpt2):
    m = tiny_gpt2
    _, tk_metric = _tl_metric(m, [PARIS, IOI])
    texts_c, texts_x = [PARIS["clean"], IOI["clean"]], [PARIS["corrupted"], IOI["corrupted"]]
    for side, what in (("right", "right-padded"), ("left", "left-padded")):
        c, x = tokenize(m, texts_c, padding_side=side), tokenize(m, texts_x, padding_side=side)
        with pytest.raises(PatchingError, match="base_tokens: a padded batch"):
            P.batched_act_patch_resid_pre(m, x, c, tk_metric)
        with pytest.raises(PatchingError, match=f"base_tokens: .*{what}"):
            P.batched_act_patch_resid_pre(m, x.tokens, c.tokens, tk_metric)
        with pytest.raises(PatchingError, match=f"base_tokens: .*{what}"):
            P.batched_act_patch_resid_pre(m, x.tokens, None, tk_metric, source="zero")
    with pytest.raises(PatchingError, match="attention_mask"):
        P.check_unpadded(m, torch.tensor([[1, 2, 3]]), "tokens", attention_mask=torch.tensor([[0, 1, 1]]))
    # an unpadded Batch is fine and equals the tensor call
    c, x = tokenize(m, [PARIS["clean"]]), tokenize(m, [PARIS["corrupted"]])
    a = P.batched_act_patch_resid_pre(m, x, c, _tl_metric(m, [PARIS])[1])
    b = P.batched_act_patch_resid_pre(m, x.tokens, c.tokens, _tl_metric(m, [PARIS])[1])
    assert torch.equal(a, b)


METRIC_NAMES = ["logit_diff", "prob", "log_prob", "kl"]


def test_whole_residual_patch_gives_the_other_run(perturbed_model):
    """Denoising the whole residual (resid_pre / resid_mid / resid_post of every layer, all
    positions) gives the clean metric, noising it the corrupted one; references come from
    independent plain forward passes, not from the cached run the patches were taken from."""
    import tracekit.metrics as M

    m = perturbed_model
    pairs = [PARIS, SPAIN]
    clean, corrupted = _tokens(m, pairs)
    c, x, t, f = _ids(m, pairs)
    with torch.no_grad():
        lc, lx = m(clean)[:, -1].float().clone(), m(corrupted)[:, -1].float().clone()
    inputs = M.MetricInputs(torch.tensor(t), torch.tensor(f), torch.log_softmax(lc, -1))
    ref_clean, ref_corr = M.compute_metrics(METRIC_NAMES, lc, inputs), M.compute_metrics(METRIC_NAMES, lx, inputs)
    assert (ref_clean[:, 0] - ref_corr[:, 0]).abs().min() > 1e-2  # the pairs differ: not vacuous
    sites = ["resid_pre_layer", "resid_mid_layer", "resid_post_layer"]
    out = P.run_patching(m, c, x, sites, ["denoising", "noising"], METRIC_NAMES, t, f, skip_unchanged=False,
                         batch_size=5)
    assert len(out.jobs) == 6
    for job in out.jobs:
        V = len(job.index)
        assert V == m.cfg.n_layers
        vals = job.values.reshape(V, len(pairs), len(METRIC_NAMES))
        ref = ref_clean if job.mode == "denoising" else ref_corr
        assert (vals - ref[None]).abs().max().item() <= TOL, (job.mode, job.site.name)
    assert (out.clean - ref_clean).abs().max().item() <= TOL
    assert (out.corrupted - ref_corr).abs().max().item() <= TOL


def test_batched_equals_unbatched(perturbed_model):
    m = perturbed_model
    pairs = [PARIS, SPAIN, GERMANY]
    c, x, t, f = _ids(m, pairs)
    kw = {"sites": ["resid_pre", "head_out", "mlp_out", "head_v"],
              "modes": ["denoising", "noising", "zero", "mean", "resample"], "metrics": METRIC_NAMES,
              "target_ids": t, "foil_ids": f}
    one = P.run_patching(m, c, x, batch_size=1, skip_unchanged=False, **kw)
    many = P.run_patching(m, c, x, batch_size=512, **kw)
    for a, b in zip(one.jobs, many.jobs):
        assert (a.mode, a.site.name, a.baseline_source) == (b.mode, b.site.name, b.baseline_source)
        assert (a.values - b.values).abs().max().item() <= TOL, (a.mode, a.site.name)
