"""The two unit kinds per dataset row (issue #21: datasets, not single prompts): neuron_attribution
and sae_features.

Every row has its own target and foil; each kind computes all rows in batched passes with padding,
and each row's numbers must equal that row run alone (no padding, its own target): rows of
different lengths, left and right padding, BOS on and off, on perturbed tiny models
(tests/helpers.py ``make_perturbed``: norm weights away from 1, biases, O(1) logits; GPT-2 on the
whole grid, Llama (SwiGLU: negative activations, rotary positions) on one corner). Tolerance 1e-5:
the same float32 arithmetic on the same activations, batched or not, differs by rounding only.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_sae import make_sae_dir

import tracekit as tk
from helpers import TARGET_ROWS, make_perturbed
from tracekit.core.errors import DatasetError
from tracekit.neurons import neuron_intervention
from tracekit.results import shadowing_columns
from tracekit.tokens import encode, single_token_id
from tracekit.units import intervention_summary

ATOL = 1e-5
ROWS = TARGET_ROWS
PROMPTS, TARGETS, FOILS = ([r[i] for r in ROWS] for i in range(3))
SUBJECTS = [" France", " John", " Mary", " Tower"]
VARIANTS = [("gpt2", side, bos) for side in ("left", "right") for bos in (True, False)] + [("llama", "left", True)]
IDS = [f"{a}-{s}-{'bos' if b else 'nobos'}" for a, s, b in VARIANTS]
#: the batched edits: activation-setting verbs (zero, scale; mean for SAE features) and steer (an added row)
NEURON_ABLATION = {"n_random": 1, "k": 3, "modes": ["zero", "scale", "steer"], "scale_factors": [3.0],
                   "steer_values": [2.0], "intervene_at": "position"}
SAE_INTERVENTIONS = {"k": 2, "n_random": 1, "modes": ["zero", "mean", "steer"], "steer_values": [2.0],
                     "intervene_at": "all"}


def by_row(df: pd.DataFrame, row_id: int) -> pd.DataFrame:
    return df[df["row_id"] == row_id].drop(columns="row_id").reset_index(drop=True)


def assert_frames_close(a: pd.DataFrame, b: pd.DataFrame, what: str) -> None:
    """Same columns and rows; numeric columns within ATOL, the others equal."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b), what
    for c in a.columns:
        if pd.api.types.is_float_dtype(a[c]) or pd.api.types.is_float_dtype(b[c]):
            np.testing.assert_allclose(a[c].to_numpy(float), b[c].to_numpy(float), atol=ATOL, rtol=0,
                                       err_msg=f"{what}.{c}")
        elif c == "top_features":  # JSON [[feature, activation rounded to 5 digits], ...]
            for x, y in zip(a[c], b[c]):
                fx, fy = json.loads(x), json.loads(y)
                assert [f for f, _ in fx] == [f for f, _ in fy], f"{what}.{c}"
                np.testing.assert_allclose([v for _, v in fx], [v for _, v in fy], atol=2e-5, rtol=0)
        else:
            assert a[c].tolist() == b[c].tolist(), f"{what}.{c}"


def _dataset_rows() -> list[dict]:
    return [{"prompt": p, "target": t, "foil": f, "group": "a" if i % 2 else "b",
             "positions": {"END": -1, "SUBJ": {"text": subj, "occurrence": 0}}}
            for i, ((p, t, f), subj) in enumerate(zip(ROWS, SUBJECTS))]


def _own_logit_diffs(m, prompt: str, t: str, f: str, prepend_bos=None) -> torch.Tensor:
    """``[pos]`` logit(t) - logit(f) of the row run alone (no padding)."""
    with torch.no_grad():
        lg = m(torch.tensor([encode(m, prompt, prepend_bos)]))[0].float()
    return lg[:, single_token_id(m, t)] - lg[:, single_token_id(m, f)]


# ---------------------------------------------------------------------------------------------
# neuron_attribution


def _neurons(**kw):
    base = {"layers": [1, 2], "top_k": 5, "value_tokens": 0, "contexts": None, "ablation": NEURON_ABLATION,
            "batch_size": 3}
    return tk.NeuronAttribution(**{**base, **kw})


@pytest.mark.parametrize("arch,side,bos", VARIANTS, ids=IDS)
def test_neuron_rows_equal_row_by_row_runs(arch, side, bos):
    m = make_perturbed(arch, padding_side=side, prepend_bos=bos)
    assert m.tracekit_spec.padding_side == side
    lengths = [len(encode(m, p)) for p in PROMPTS]
    assert len(set(lengths)) == len(lengths)  # every batch pads
    assert all(n == len(encode(m, p, prepend_bos=False)) + int(bos) for n, p in zip(lengths, PROMPTS))
    res = _neurons(prompts=PROMPTS, target=TARGETS, foil=FOILS).run(m, progress=False)
    rows = res.tables["rows"]
    assert rows["row_id"].tolist() == [0, 1, 2, 3] and rows["target"].tolist() == TARGETS
    assert rows["foil"].tolist() == FOILS and rows["position"].tolist() == [n - 1 for n in lengths]
    lds = rows["logit_diff"].to_numpy()
    assert np.ptp(lds) > 1e-2  # not vacuous: the rows differ
    assert (rows["max_additivity_error"] < 1e-4).all()  # neurons + b_out = MLP, on every row
    assert len(set(rows["top_neuron"])) > 1  # rows have their own top neurons
    for i, (p, t, f) in enumerate(ROWS):
        one = _neurons(prompts=[p], target=t, foil=f, ablation=None).run(m, progress=False)
        for table in ("neurons", "layers", "top_by_row"):
            assert_frames_close(by_row(res.tables[table], i), by_row(one.tables[table], 0), table)
        r1 = one.tables["rows"].drop(columns="row_id").iloc[0]
        assert_frames_close(rows.drop(columns="row_id").iloc[[i]].reset_index(drop=True),
                            r1.to_frame().T.reset_index(drop=True).astype(rows.drop(columns="row_id").dtypes),
                            "rows")
        # the model's own logit difference of the row alone, at its last token
        assert rows["logit_diff"].iloc[i] == pytest.approx(float(_own_logit_diffs(m, p, t, f)[-1]), abs=1e-4)
    # interventions: each row of the table is the single-prompt engine on that row alone (the top set
    # under every verb, the random set under zero)
    iv = res.tables["interventions"]
    assert len(iv) == 4 * 3 * 2 and list(iv.columns)[0] == "row_id"
    assert np.abs(iv["delta_logit_diff"]).max() > 1e-3
    clean: dict = {}
    for r in iv[(iv["set"] == "top") | (iv["verb"] == "zero")].itertuples():
        p, t, f = ROWS[r.row_id]
        units = [tuple(int(x) for x in u.split(".")) for u in json.loads(r.units)]
        kw = {"factor": r.value} if r.verb == "scale" else {"value": r.value} if r.verb in ("clamp", "steer") else {}
        one = neuron_intervention(m, p, t, units, r.verb, foil=f, intervene_at="position",
                                  clean_metrics=clean.get(r.row_id), **kw)
        clean[r.row_id] = one["clean"]
        for col in ("delta_logit_diff", "delta_target_prob", "clean_logit_diff", "patched_target_prob"):
            key = col.split("_", 1)[1]
            src = one["delta"] if col.startswith("delta") else one["clean"] if col.startswith("clean") else one["patched"]
            assert getattr(r, col) == pytest.approx(src[key], abs=ATOL), (r.row_id, r.verb, r.set, col)


def test_neuron_named_positions_resolve_per_row_under_left_padding():
    """``END`` reads each row's own last token under left padding (the same tables as ``last``), and a
    middle name (``SUBJ``) reads the row's own token there: the logit difference equals the model's
    own output for the row alone at that token (counted from the padded start, a shorter row would
    read a pad or another token)."""
    m = make_perturbed("gpt2", padding_side="left", prepend_bos=True)
    ds = {"rows": _dataset_rows()}
    kw = {"ablation": {**NEURON_ABLATION, "modes": ["zero"]}, "batch_size": 4}
    end = _neurons(dataset=ds, position="END", **kw).run(m, progress=False)
    last = _neurons(dataset=ds, position="last", **kw).run(m, progress=False)
    for t in ("neurons", "layers", "top_by_row", "interventions"):
        pd.testing.assert_frame_equal(end.tables[t], last.tables[t])
    n = [len(encode(m, p)) for p in PROMPTS]
    rows = end.tables["rows"]
    assert rows["position"].tolist() == [k - 1 for k in n] == rows["pos_END"].tolist()
    assert rows["group"].tolist() == ["b", "a", "b", "a"]
    subj = _neurons(dataset=ds, position="SUBJ", **kw).run(m, progress=False)
    srows = subj.tables["rows"]
    assert srows["token"].tolist() == SUBJECTS and srows["position"].tolist() == srows["pos_SUBJ"].tolist()
    for i, (p, t, f) in enumerate(ROWS):
        k = int(srows["position"].iloc[i])
        assert k < n[i] - 1  # a middle token
        own = _own_logit_diffs(m, p, t, f)
        assert srows["logit_diff"].iloc[i] == pytest.approx(float(own[k]), abs=1e-4)
        assert rows["logit_diff"].iloc[i] == pytest.approx(float(own[-1]), abs=1e-4)
    # the interventions read and edit each row at its own SUBJ token: the engine on the row alone
    iv = subj.tables["interventions"]
    r = iv[(iv["row_id"] == 0) & (iv["set"] == "top")].iloc[0]
    units = [tuple(int(x) for x in u.split(".")) for u in json.loads(r["units"])]
    one = neuron_intervention(m, PROMPTS[0], TARGETS[0], units, "zero", foil=FOILS[0],
                              position=int(srows["position"].iloc[0]))
    assert r["delta_logit_diff"] == pytest.approx(one["delta"]["logit_diff"], abs=ATOL)


def test_neuron_aggregates_equal_a_hand_computation():
    m = make_perturbed("gpt2", padding_side="left")
    res = _neurons(prompts=PROMPTS, target=TARGETS, foil=FOILS, top_k=4, rank_by="abs").run(m, progress=False)
    s = res.summary()
    neu, lay, rows, top = (res.tables[k] for k in ("neurons", "layers", "rows", "top"))
    mean = neu.groupby(["layer", "neuron"])["contribution"].mean()
    want = mean.reindex(mean.abs().sort_values(ascending=False).index).head(4)
    overall = top[top["scope"] == "overall"].sort_values("top_rank")
    assert [(int(a), int(b)) for a, b in zip(overall["layer"], overall["neuron"])] == list(want.index)
    np.testing.assert_allclose(overall["mean_contribution"], want.to_numpy(), atol=1e-9)
    for r in overall.itertuples():
        x = neu[(neu["layer"] == r.layer) & (neu["neuron"] == r.neuron)]
        assert r.mean_activation == pytest.approx(x["activation"].mean(), abs=1e-9)
        assert r.std_contribution == pytest.approx(x["contribution"].std(ddof=1), abs=1e-9)
        assert r.n_rows == len(x) == 4
    assert [t["neuron"] for t in s["top_neurons_mean"]] == [f"{a}.{b}" for a, b in want.index]
    assert s["top_mean_contribution_sum"] == pytest.approx(float(want.sum()), abs=1e-5)
    for L in (1, 2):  # per layer, ranked by |mean|
        ml = mean.loc[L]
        wl = ml.reindex(ml.abs().sort_values(ascending=False).index).head(4)
        assert s["top_mean_by_layer"][str(L)] == [f"{L}.{n}" for n in wl.index]
    assert s["mean_mlp_attribution_by_layer"] == pytest.approx(
        [float(lay[lay["layer"] == L]["mlp"].mean()) for L in (1, 2)], abs=1e-5)
    assert s["max_additivity_error"] == pytest.approx(
        float((lay["neuron_sum"] + lay["mlp_bias"] - lay["mlp"]).abs().max()), abs=1e-12)
    assert s["logit_diff_by_row"] == pytest.approx(rows["logit_diff"].tolist(), abs=1e-12)
    assert s["mean_logit_diff"] == pytest.approx(float(np.mean(s["logit_diff_by_row"])), abs=1e-12)
    for i in range(4):  # each row's own top neuron: its largest |contribution|
        x = neu[neu["row_id"] == i]
        best = x.loc[x["contribution"].abs().idxmax()]
        assert s["top_neuron_by_row"][i] == f"{int(best.layer)}.{int(best.neuron)}"
        assert s["top_neuron_contribution_by_row"][i] == pytest.approx(float(best.contribution), abs=1e-5)
    iv = res.tables["interventions"]
    z = iv[iv["verb"] == "zero"]
    assert s["interventions"]["zero"]["top_delta_target_prob"] == pytest.approx(
        float(z[z["set"] == "top"]["delta_target_prob"].mean()), abs=1e-6)
    assert s["interventions"]["zero"]["random_delta_logit_diff_mean"] == pytest.approx(
        float(z[z["set"] == "random"]["delta_logit_diff"].mean()), abs=1e-6)
    assert s["interventions"] == intervention_summary(iv)
    assert set(s) == set(type(res).summary_keys)
    assert set(res.tables) <= set(type(res).table_names)
    for name, df in res.tables.items():
        assert shadowing_columns(df) == [], name


def test_neuron_config_errors_and_one_target_for_every_prompt(tmp_path):
    with pytest.raises(ValueError, match="track"):
        tk.NeuronAttribution(prompts=PROMPTS, target=TARGETS[:3])
    with pytest.raises(ValueError, match="beside a dataset"):
        tk.NeuronAttribution(dataset={"rows": _dataset_rows()}, target=" Paris")
    with pytest.raises(ValueError, match="target: give"):
        tk.NeuronAttribution(prompts=PROMPTS)
    m = make_perturbed("gpt2")
    mixed = _dataset_rows()
    del mixed[2]["foil"]
    with pytest.raises(DatasetError, match=r"rows \[2\] have no foil"):
        tk.NeuronAttribution(dataset={"rows": mixed}).prepare(m)
    with pytest.raises(DatasetError, match="'IO' is not a named position"):
        tk.NeuronAttribution(dataset={"rows": _dataset_rows()}, position="IO").prepare(m)
    res = _neurons(prompts=PROMPTS[:2], target=" Paris", foil=" London").run(m, progress=False)
    s = res.summary()
    assert s["target_by_row"] == [" Paris", " Paris"] and s["metric"] == "logit(target) - logit(foil)"
    res.save(tmp_path / "r")
    assert tk.Result.load(tmp_path / "r").summary() == s


# ---------------------------------------------------------------------------------------------
# sae_features


def _sae(path, **kw):
    base = {"sae": {"path": str(path)}, "top_k": 4, "interventions": SAE_INTERVENTIONS, "batch_size": 3}
    return tk.SAEFeatures(**{**base, **kw})


@pytest.mark.parametrize("arch,side,bos", VARIANTS, ids=IDS)
def test_sae_rows_equal_row_by_row_runs(arch, side, bos, tmp_path):
    m = make_perturbed(arch, padding_side=side, prepend_bos=bos)
    d = make_sae_dir(tmp_path, m, "blocks.2.hook_resid_pre", d_sae=64)
    res = _sae(d, prompts=PROMPTS, target=TARGETS, foil=FOILS).run(m, progress=False)
    rows = res.tables["rows"]
    lengths = [len(encode(m, p)) for p in PROMPTS]
    assert rows["position"].tolist() == [n - 1 for n in lengths] and rows["target"].tolist() == TARGETS
    assert np.ptp(rows["logit_diff"].to_numpy()) > 1e-2
    assert (rows["sum_error"] < 1e-3).all()
    t0 = res.tables["features"]
    assert t0["direct"].notna().all() and np.abs(t0["direct"]).max() > 1e-3
    for i, (p, t, f) in enumerate(ROWS):
        one = _sae(d, prompts=[p], target=t, foil=f).run(m, progress=False)
        for table in ("features", "terms", "tokens", "interventions"):
            assert_frames_close(by_row(res.tables[table], i), by_row(one.tables[table], 0), table)
        a = rows.drop(columns="row_id").iloc[[i]].reset_index(drop=True)
        b = one.tables["rows"].drop(columns="row_id").reset_index(drop=True)
        assert_frames_close(a, b.astype(a.dtypes), "rows")
        assert rows["logit_diff"].iloc[i] == pytest.approx(float(_own_logit_diffs(m, p, t, f)[-1]), abs=1e-4)
    iv = res.tables["interventions"]
    assert set(iv["verb"]) == {"zero", "mean", "steer"} and np.abs(iv["delta_logit_diff"]).max() > 1e-4


def test_sae_named_positions_with_its_own_bos_under_left_padding(tmp_path):
    """An SAE trained with a BOS on a model that prepends none: the rows are tokenized with the SAE's
    BOS and the named positions shifted with it; ``END`` / ``SUBJ`` read each row's own token under left
    padding, and the metric there is the model's own for the row alone (with the SAE's BOS)."""
    m = make_perturbed("gpt2", padding_side="left", prepend_bos=False)
    d = make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre", prepend_bos=True)
    ds = {"rows": _dataset_rows()}
    kw = {"interventions": {**SAE_INTERVENTIONS, "modes": ["zero"], "intervene_at": "position"}}
    end = _sae(d, dataset=ds, position="END", **kw).run(m, progress=False)
    last = _sae(d, dataset=ds, position="last", **kw).run(m, progress=False)
    for t in ("features", "terms", "interventions"):
        pd.testing.assert_frame_equal(end.tables[t], last.tables[t])
    n = [len(encode(m, p, prepend_bos=True)) for p in PROMPTS]
    rows = end.tables["rows"]
    assert rows["position"].tolist() == [k - 1 for k in n] == rows["pos_END"].tolist()
    subj = _sae(d, dataset=ds, position="SUBJ", **kw).run(m, progress=False)
    srows = subj.tables["rows"]
    assert srows["token"].tolist() == SUBJECTS and srows["position"].tolist() == srows["pos_SUBJ"].tolist()
    for i, (p, t, f) in enumerate(ROWS):
        own = _own_logit_diffs(m, p, t, f, prepend_bos=True)
        k = int(srows["position"].iloc[i])
        assert 0 < k < n[i] - 1
        assert srows["logit_diff"].iloc[i] == pytest.approx(float(own[k]), abs=1e-4)
        assert rows["logit_diff"].iloc[i] == pytest.approx(float(own[-1]), abs=1e-4)
    one = _sae(d, prompts=[PROMPTS[2]], target=TARGETS[2], foil=FOILS[2], position=int(srows["position"].iloc[2]),
               **kw).run(m, progress=False)
    assert_frames_close(by_row(subj.tables["features"], 2), by_row(one.tables["features"], 0), "features")
    assert_frames_close(by_row(subj.tables["interventions"], 2), by_row(one.tables["interventions"], 0),
                        "interventions")


def test_sae_aggregates_equal_a_hand_computation(tmp_path):
    m = make_perturbed("gpt2", padding_side="right")
    d = make_sae_dir(tmp_path, m, "blocks.2.hook_resid_pre", d_sae=64)
    res = _sae(d, prompts=PROMPTS, target=TARGETS, foil=FOILS).run(m, progress=False)
    s = res.summary()
    feats, fm, terms, toks, rows = (res.tables[k] for k in ("features", "features_mean", "terms", "tokens", "rows"))
    # per feature: the sum over rows (0 where inactive) over the number of rows
    grid = feats.pivot(index="row_id", columns="feature", values="direct").reindex(range(4)).fillna(0.0)
    mean_direct = grid.mean()
    want = mean_direct.reindex(mean_direct.abs().sort_values(ascending=False).index).head(4)
    assert [t["feature"] for t in s["top_features_mean"]] == [int(f) for f in want.index]
    np.testing.assert_allclose([t["mean_direct"] for t in s["top_features_mean"]], want.to_numpy(), atol=1e-5)
    fmi = fm.set_index("feature")
    for f in want.index:
        x = feats[feats["feature"] == f]
        assert fmi.loc[f, "mean_total"] == pytest.approx(x["total"].sum() / 4, abs=1e-6)
        assert fmi.loc[f, "mean_activation"] == pytest.approx(x["activation"].sum() / 4, abs=1e-6)
        assert fmi.loc[f, "n_rows_active"] == len(x)
    for term, g in terms.groupby("term"):
        assert s["mean_total_by_term"][term] == pytest.approx(g["total"].mean(), abs=1e-5)
        assert s["mean_direct_by_term"][term] == pytest.approx(g["direct"].mean(), abs=1e-5)
    for i in range(4):
        tk_i = toks[(toks["row_id"] == i) & ~toks["special"]]
        assert s["l0_by_row"][i] == pytest.approx(tk_i["l0"].mean(), abs=1e-4)
        assert s["relative_error_norm_by_row"][i] == pytest.approx((tk_i["error_norm"] / tk_i["x_norm"]).mean(),
                                                                   abs=1e-5)
        f_i = feats[feats["row_id"] == i]
        own = f_i.reindex(f_i["direct"].abs().sort_values(ascending=False).index)["feature"].head(4).tolist()
        assert s["top_features_by_row"][i] == own and s["top_feature_by_row"][i] == own[0]
        t_i = terms[terms["row_id"] == i].set_index("term")["total"]
        err = abs(t_i["features"] + t_i["error"] + t_i["bias"] + t_i["special_tokens"] - t_i["activation"])
        assert rows["sum_error"].iloc[i] >= err - 1e-12
    assert s["mean_l0"] == pytest.approx(float(np.mean(s["l0_by_row"])), abs=1e-4)
    assert s["max_sum_error"] == pytest.approx(float(rows["sum_error"].max()), abs=1e-12)
    assert s["mean_logit_diff"] == pytest.approx(float(rows["logit_diff"].mean()), abs=1e-6)
    iv = res.tables["interventions"]
    top = iv[(iv["verb"] == "zero") & (iv["set"] == "top")]
    assert top["row_id"].tolist() == [0, 1, 2, 3]
    assert [json.loads(u) for u in top["units"]] == [f[:2] for f in s["top_features_by_row"]]  # each row's own top
    assert s["interventions"]["zero"]["top_delta_logit_diff"] == pytest.approx(float(top["delta_logit_diff"].mean()),
                                                                               abs=1e-6)
    assert set(s) == set(type(res).summary_keys) and set(res.tables) <= set(type(res).table_names)
    for name, df in res.tables.items():
        assert shadowing_columns(df) == [], name


def test_sae_dashboards_tables_have_no_shadowing_columns(tmp_path):
    m = make_perturbed("gpt2")
    d = make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre")
    res = _sae(d, prompts=PROMPTS[:2], target=TARGETS[:2], foil=FOILS[:2], interventions=None,
               dashboards={"features": 2, "max_tokens": 200, "seq_len": 32, "top_n": 2}).run(m, progress=False)
    assert {"vocab", "contexts", "density"} <= set(res.tables)
    for name, df in res.tables.items():
        assert shadowing_columns(df) == [], name
    assert "top_rank" in res.tables["vocab"] and "top_rank" in res.tables["contexts"]
    assert len(res.dashboards()) == 2
    out = res.save(tmp_path / "r")
    assert tk.Result.load(out).summary() == json.loads(json.dumps(res.summary()))


def test_old_saved_columns_load_with_the_new_names(tmp_path):
    """A neuron result saved with ``prompt_idx`` / ``rank`` / the old ``top`` columns loads with
    ``row_id`` / ``top_rank`` / ``mean_*``."""
    from tracekit.results import MANIFEST

    m = make_perturbed("gpt2")
    res = _neurons(prompts=PROMPTS[:2], target=" Paris", foil=" London", ablation=None).run(m, progress=False)
    d = res.save(tmp_path / "r", figures=False)
    top = res.tables["top"].rename(columns={"top_rank": "rank", "mean_activation": "activation",
                                            "mean_contribution": "contribution"})
    top.to_parquet(d / "top.parquet", index=False)
    res.tables["neurons"].rename(columns={"row_id": "prompt_idx"}).to_parquet(d / "neurons.parquet", index=False)
    man = json.loads((d / MANIFEST).read_text())
    man["files"] = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}
    (d / MANIFEST).write_text(json.dumps(man))
    back = tk.Result.load(d)
    assert "top_rank" in back.tables["top"] and "mean_contribution" in back.tables["top"]
    assert "row_id" in back.tables["neurons"]
    assert back.summary() == json.loads(json.dumps(res.summary()))
