"""Activation patching over datasets (``kind: activation_patching`` with ``dataset:``): a dataset
equals the same rows given as ``pairs`` (identical numbers) and each row run alone (rows of
different lengths, BOS on and off, left and right padding sides); named positions resolve to each
row's own token (checked against a plain ``run_with_hooks`` patch); rows without a corrupted
prompt; rows of different lengths or templates are never averaged by index (named positions, or
refused); aggregates equal a hand computation from the per-row table; no table column shadows a
DataFrame attribute; old column names of saved results are renamed on load.

Numbers come from perturbed tiny models (O(1) logits, non-trivial norms and biases: a wrong
position or a wrong row changes them).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import make_perturbed, make_tiny
from tracekit.core.errors import DatasetError
from tracekit.metrics import normalize
from tracekit.results import shadowing_columns
from tracekit.tokens import encode, single_token_id, token_index_of_substring

TOL = 1e-5

#: Rows of three token lengths; S2 sits at a different index, from the start and from the end, in each.
ROWS = [
    {"prompt": "When John and Mary went to the shops, John gave the bag to",
     "corrupted": "When John and Mary went to the shops, Mary gave the bag to", "target": " Mary", "foil": " John",
     "positions": {"S2": {"text": " John", "occurrence": -1}, "IO": {"text": " Mary", "occurrence": 0}, "END": -1}},
    {"prompt": "After Tom and Ann left, Tom gave it to", "corrupted": "After Tom and Ann left, Ann gave it to",
     "target": " Ann", "foil": " Tom",
     "positions": {"S2": {"text": " Tom", "occurrence": -1}, "IO": {"text": " Ann", "occurrence": 0}, "END": -1}},
    {"prompt": "The capital of France is", "corrupted": "The capital of Italy is", "target": " Paris", "foil": " Rome",
     "positions": {"S2": " France", "IO": " France", "END": -1}},
    {"prompt": "Then Kate and Sam argued loudly, and Sam said to",
     "corrupted": "Then Kate and Sam argued loudly, and Kate said to",
     "target": " Kate", "foil": " Sam",
     "positions": {"S2": {"text": " Sam", "occurrence": -1}, "IO": {"text": " Kate", "occurrence": 0}, "END": -1}},
]

#: As long as ROWS[0] (one equal-length group), its S2 at another index.
SAME_LENGTH = {"prompt": "Then John and Mary had a long argument, and afterwards John said to",
               "corrupted": "Then John and Mary had a long argument, and afterwards Mary said to",
               "target": " Mary", "foil": " John",
               "positions": {"S2": {"text": " John", "occurrence": -1}, "END": -1}}

MODELS = [("gpt2", True, "right"), ("llama", False, "left")]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{a}-bos{int(b)}-{p}" for a, b, p in MODELS])
def model(request):
    arch, bos, side = request.param
    return make_perturbed(arch, prepend_bos=bos, padding_side=side)


def _pairs(rows):
    return [{"clean": r["prompt"], "corrupted": r["corrupted"], "target": r["target"], "foil": r["foil"]} for r in rows]


KW = {"sites": ["resid_pre", "head_out"], "directions": ["denoising"], "ablations": ["zero"],
      "metrics": ["logit_diff", "prob"], "min_denominator": 1e-6}


def _per_row(res) -> pd.DataFrame:
    df = res.tables["main"]
    key = ["intervention", "site", "layer", "position", "head_idx", "metric"]
    return df[df["scope"] == "pair"].sort_values(key).reset_index(drop=True)


def test_dataset_equals_pairs_and_each_row_alone(model):
    """The same rows as a dataset and as pairs give identical tables; each row run alone gives its
    lines of the run over all rows (rows of three lengths: separate equal-length groups)."""
    assert len({len(encode(model, r["prompt"])) for r in ROWS}) == len(ROWS)
    # rows of different lengths: position-indexed sites need positions (pairs name none)
    kw = {**KW, "positions": [-1, -2]}
    ds = tk.ActivationPatching(dataset={"rows": ROWS}, **kw).run(model, progress=False)
    pr = tk.ActivationPatching(pairs=_pairs(ROWS), **kw).run(model, progress=False)
    pd.testing.assert_frame_equal(ds.tables["main"], pr.tables["main"], check_exact=True)
    pd.testing.assert_frame_equal(ds.tables["baselines"], pr.tables["baselines"], check_exact=True)
    rows = ds.tables["rows"]
    assert rows["row_id"].tolist() == [0, 1, 2, 3]
    # each row's own target and foil: the clean logit difference is logit(target) - logit(foil) of that row
    for i, r in enumerate(ROWS):
        lg = model(torch.tensor([encode(model, r["prompt"])]))[0, -1].float()
        ref = float(lg[single_token_id(model, r["target"])] - lg[single_token_id(model, r["foil"])])
        assert abs(rows.loc[i, "clean_logit_diff"] - ref) <= TOL
    assert rows["clean_logit_diff"].abs().min() > 1e-2  # the rows' answers differ: not vacuous
    both = ds.tables["main"]
    for i, r in enumerate(ROWS):
        alone = _per_row(tk.ActivationPatching(dataset={"rows": [r]}, **kw).run(model, progress=False))
        mine = both[(both["scope"] == "pair") & (both["pair"] == i)]
        mine = mine.sort_values(["intervention", "site", "layer", "position", "head_idx", "metric"])
        assert len(alone) == len(mine) > 0
        assert (mine["row_id"] == i).all()
        diff = np.abs(alone["value"].to_numpy() - mine["value"].to_numpy())
        assert diff.max() <= TOL, (i, diff.max())
        assert alone["value"].std() > 1e-3  # the sites' values differ from one another


def test_named_positions_are_each_rows_own_token(model):
    """``positions: [S2, END]`` patches each row at its own S2 / last token (BOS counted), which is
    neither row 0's index nor an index counted from a padded start: checked against the run over
    every position and against a plain run_with_hooks patch."""
    rows = ROWS[:2] + ROWS[3:] + [SAME_LENGTH]
    kw = {"sites": ["resid_pre", "head_out_by_pos"], "directions": ["denoising"], "metrics": ["logit_diff"],
          "min_denominator": 1e-6}
    named = tk.ActivationPatching(dataset={"rows": rows}, positions=["S2", "END"], **kw).run(model, progress=False)
    # every position of each row: each row alone (over rows of different lengths, no positions means
    # the named ones)
    refs = [_per_row(tk.ActivationPatching(dataset={"rows": [r]}, **kw).run(model, progress=False)) for r in rows]
    df = named.tables["main"]
    bos = len(encode(model, ""))
    lengths = [len(encode(model, r["prompt"])) for r in rows]
    own = []
    for r in rows:
        s2 = token_index_of_substring(model, r["prompt"], r["positions"]["S2"]["text"], encode(model, r["prompt"]))
        own.append({"S2": s2, "END": len(encode(model, r["prompt"])) - 1})
    # S2 is at another index in every row (row 0's index is wrong for the others); rows 0 and 3 share a
    # length (one group: each member its own index); a left-padded index would add each shorter row's pad
    assert len({o["S2"] for o in own}) == len(rows)
    assert lengths[0] == lengths[3] and len(set(lengths)) == 3
    assert named.tables["rows"]["pos_S2"].tolist() == [o["S2"] for o in own]
    assert own[0]["S2"] == bos + 9  # "When John and Mary went to the shops, John": " John" is text token 9
    pr = df[df["scope"] == "pair"]
    assert set(pr["position_name"]) == {"S2", "END"}
    for i, o in enumerate(own):
        for name in ("S2", "END"):
            mine = pr[(pr["pair"] == i) & (pr["position_name"] == name)]
            assert (mine["position"] == o[name]).all()
            assert (mine["pos_from_end"] == o[name] - lengths[i]).all()
            want = refs[i][refs[i]["position"] == o[name]]
            key = ["site", "layer", "head_idx"]
            a = mine.sort_values(key)["value"].to_numpy()
            b = want.sort_values(key)["value"].to_numpy()
            assert len(a) == len(b) > 0 and np.abs(a - b).max() <= TOL
    # row 1's S2 at row 0's index would give another number (the check above can fail)
    r1 = refs[1][(refs[1]["site"] == "resid_pre") & (refs[1]["layer"] == 1)]
    at = r1.set_index("position")["value"]
    assert abs(at[own[1]["S2"]] - at[own[0]["S2"]]) > 1e-4
    # independent of the engine: denoise resid_pre of layer 1 at row 1's S2 with run_with_hooks
    r = rows[1]
    hook = "blocks.1.hook_resid_pre"
    _, cache = model.run_with_cache(torch.tensor([encode(model, r["prompt"])]), names_filter=lambda n: n == hook)
    p = own[1]["S2"]

    def put(act, hook):  # noqa: ARG001 - TransformerLens hook signature
        act[:, p] = cache["blocks.1.hook_resid_pre"][:, p]
        return act

    with torch.no_grad():
        lg = model.run_with_hooks(torch.tensor([encode(model, r["corrupted"])]), fwd_hooks=[(hook, put)])[0, -1]
    expect = float(lg[single_token_id(model, r["target"])] - lg[single_token_id(model, r["foil"])])
    got = pr[(pr["pair"] == 1) & (pr["site"] == "resid_pre") & (pr["layer"] == 1) & (pr["position_name"] == "S2")]
    assert abs(float(got["value"].item()) - expect) <= 2e-5
    # mean lines align rows of different lengths by name
    mean = df[(df["scope"] == "mean") & (df["site"] == "resid_pre") & (df["layer"] == 1)]
    s2 = mean[mean["position_name"] == "S2"]
    assert abs(float(s2["value"].item()) - pr[(pr["site"] == "resid_pre") & (pr["layer"] == 1)
                                               & (pr["position_name"] == "S2")]["value"].mean()) <= 1e-6
    assert named.summary()["positions"] == ["S2", "END"]


def test_index_positions_and_missing_names():
    m = make_tiny("gpt2")
    res = tk.ActivationPatching(pairs=_pairs(ROWS[:2]), sites=["resid_pre"], positions=[-1, "last"],
                                metrics=["logit_diff"]).run(m, progress=False)
    df = res.tables["main"]
    lengths = res.tables["rows"]["n_tokens"].tolist()
    for i, n in enumerate(lengths):
        assert set(df[(df["pair"] == i)]["position"]) == {n - 1}
    with pytest.raises(DatasetError, match=r"'S2' is not a named position of row 0"):
        tk.ActivationPatching(pairs=_pairs(ROWS[:1]), sites=["resid_pre"], positions=["S2"]).check(m)
    with pytest.raises(ValueError, match="positions: none of the sites"):
        tk.ActivationPatching(pairs=_pairs(ROWS[:1]), sites=["head_out"], positions=["END"])
    with pytest.raises(ValueError, match="given twice"):
        tk.ActivationPatching(pairs=_pairs(ROWS[:1]), sites=["resid_pre"], positions=["END", "END"])


@pytest.mark.parametrize("kind", ["activation_patching", "attribution_patching"])
def test_rows_of_different_lengths_or_templates_never_average_roles_by_index(kind):
    """Without ``positions``, rows whose token at one index (or one index from the end) plays
    different roles (different lengths, or named positions at different indices: another template)
    are patched at the dataset's named positions and averaged by name, as with ``positions`` given;
    without named positions the run is refused naming ``positions:``. Rows of one template and
    length still patch every position."""
    from tracekit.core.errors import PatchingError

    m = make_perturbed("gpt2")
    cls = tk.ActivationPatching if kind == "activation_patching" else tk.AttributionPatching
    kw = {"sites": ["resid_pre", "head_out_by_pos"], "directions": ["denoising"], "metrics": ["logit_diff"],
          "min_denominator": 1e-6, **({"verify": {"top_k": 3, "n_random": 3}} if kind == "attribution_patching" else {})}
    names = ["S2", "IO", "END"]
    # 1. three lengths: S2 is -5, -3 and -4 from the end; a mean at "pos -4" would mix roles
    rows = [ROWS[0], ROWS[1], ROWS[3]]
    auto = cls(dataset={"rows": rows}, **kw).run(m, progress=False)
    given = cls(dataset={"rows": rows}, positions=names, **kw).run(m, progress=False)
    a, g = auto.tables["main"], given.tables["main"]
    assert auto.summary()["positions"] == names and "different token lengths" in auto.summary()["positions_auto"]
    assert given.summary()["positions_auto"] is None
    pd.testing.assert_frame_equal(a, g)
    mean = a[(a["scope"] == "mean") & (a["site"] == "resid_pre")]
    assert set(mean["position_name"]) == set(names) and mean["pos_from_end"].isna().any()
    pr = a[(a["scope"] == "pair") & (a["site"] == "resid_pre")]
    for _, line in mean.iterrows():  # each name's mean is over each row's own token of that role
        own = pr[(pr["layer"] == line["layer"]) & (pr["position_name"] == line["position_name"])]
        assert len(own) == len(rows) and abs(own["value"].astype(float).mean() - line["value"]) <= 1e-6
    assert pr["value"].std() > 1e-3
    if kind == "attribution_patching":
        assert auto.summary()["verification"]["denoising"]["n_checked"] == 6
        assert set(auto.tables["verification"]["pos_key"].dropna()) <= set(names)
    # 2. the same rows without named positions: refused, naming positions:
    with pytest.raises(PatchingError, match=r"positions: the rows have different token lengths .*positions: \[-1\]"):
        cls(pairs=_pairs(rows), **kw).check(m)
    with pytest.raises(PatchingError, match="positions:"):
        cls(pairs=_pairs(rows), **kw).run(m, progress=False)
    # indices from the end chosen on purpose, or whole-layer sites: run
    assert cls(pairs=_pairs(rows), positions=[-1], **kw).run(m, progress=False).summary()["positions"] == ["-1"]
    # 3. one length, two templates (S2 at different indices): named positions too
    two = [ROWS[0], SAME_LENGTH]
    res = cls(dataset={"rows": two}, **kw).run(m, progress=False)
    assert res.summary()["positions"] == ["S2", "END"] and "different templates" in res.summary()["positions_auto"]
    # 4. one length, one template: every position, as before
    one = [ROWS[0], {**ROWS[0], "target": " John", "foil": " Mary"}]
    res = cls(dataset={"rows": one}, **kw).run(m, progress=False)
    assert res.summary()["positions"] is None and res.summary()["positions_auto"] is None
    n = len(encode(m, ROWS[0]["prompt"]))
    assert set(res.tables["main"].query("site == 'resid_pre'")["position"].dropna()) == set(range(n))


def test_row_without_corrupted_fails_naming_it_unless_ablation_only():
    m = make_tiny("gpt2")
    rows = [dict(ROWS[0]), {k: v for k, v in ROWS[1].items() if k != "corrupted"}]
    with pytest.raises(DatasetError, match=r"dataset row 1 \('After Tom.*no corrupted prompt"):
        tk.ActivationPatching(dataset={"rows": rows}, sites=["resid_pre"]).check(m)
    # ablation-only: some rows with, some without is refused; none at all runs, ranked by delta
    with pytest.raises(DatasetError, match=r"dataset row 1 .*while other rows have one"):
        tk.ActivationPatching(dataset={"rows": rows}, sites=["resid_pre"], directions=[], ablations=["zero"]).check(m)
    bare = [{k: v for k, v in r.items() if k != "corrupted"} for r in ROWS[:2]]
    res = tk.ActivationPatching(dataset={"rows": bare}, sites=["mlp_out"], directions=[], ablations=["zero"],
                                metrics=["logit_diff"]).run(m, progress=False)
    s = res.summary()
    assert s["ranked_by"] == "delta" and s["mean_corrupted"] == {"logit_diff": None}
    assert s["top_sites"] and all(t["mean_delta"] is not None for t in s["top_sites"])
    df = res.tables["main"]
    assert df["normalized"].isna().all() and df["delta"].abs().max() > 1e-6
    assert res.tables["baselines"]["corrupted"].isna().all()
    assert "no corrupted prompts" in res.report()
    # a row without a target (or, for logit_diff, a foil) is named too
    with pytest.raises(DatasetError, match=r"dataset row 0 .*no foil"):
        tk.ActivationPatching(dataset={"rows": [{k: v for k, v in ROWS[0].items() if k != "foil"}]},
                              sites=["resid_pre"]).check(m)


def test_aggregates_equal_a_hand_computation_from_the_rows_table(tmp_path):
    """Summary aggregates and the mean lines of ``main`` from the per-row tables."""
    m = make_perturbed("gpt2")
    res = tk.ActivationPatching(dataset={"rows": ROWS}, sites=["resid_pre", "head_out"], positions=["S2", "END"],
                                directions=["denoising", "noising"], metrics=["logit_diff", "prob"],
                                min_denominator=1e-6).run(m, progress=False)
    s, rows, base, main = res.summary(), res.tables["rows"], res.tables["baselines"], res.tables["main"]
    assert s["n_rows"] == len(rows) == 4 and s["row_id_by_row"] == rows["row_id"].tolist()
    assert s["clean_logit_diff_by_row"] == rows["clean_logit_diff"].tolist()
    assert s["corrupted_logit_diff_by_row"] == rows["corrupted_logit_diff"].tolist()
    assert s["correct_by_row"] == (rows["clean_logit_diff"] > 0).tolist()
    assert rows["clean_logit_diff"].std() > 1e-2  # rows differ: the per-row lists are not one value repeated
    assert s["share_rows_correct"] == pytest.approx((rows["clean_logit_diff"] > 0).mean(), abs=1e-12)
    for mt in ("logit_diff", "prob"):
        assert s["mean_clean"][mt] == pytest.approx(rows[f"clean_{mt}"].mean(), abs=1e-12)
        assert s["mean_corrupted"][mt] == pytest.approx(rows[f"corrupted_{mt}"].mean(), abs=1e-12)
    assert s["n_rows_flagged"] == int(rows["flagged"].sum()) == 0
    # mean lines: mean over the unflagged rows of the raw values, normalised by their mean clean / corrupted scores
    pr, mean = main[(main["scope"] == "pair") & ~main["flagged"]], main[main["scope"] == "mean"]
    assert len(pr) > len(mean) > 0
    key = ["intervention", "site", "layer", "position_name", "head_idx", "metric"]
    hand = pr.groupby(key, dropna=False).agg(value=("value", "mean")).reset_index()
    good = base[~base["flagged"]]
    hand["clean"] = hand["metric"].map(good.groupby("metric")["clean"].mean())
    hand["corr"] = hand["metric"].map(good.groupby("metric")["corrupted"].mean())
    got = mean.merge(hand, on=key, suffixes=("", "_hand"))
    assert len(got) == len(mean) == len(hand)
    assert np.abs(got["value"] - got["value_hand"]).max() <= 1e-9
    want = normalize(got["value_hand"].to_numpy(), got["clean"].to_numpy(), got["corr"].to_numpy(), 1e-6)
    assert np.nanmax(np.abs(got["normalized"].to_numpy() - want)) <= 1e-9
    assert np.abs(got["delta"] - (got["value_hand"] - got["clean"])).max() <= 1e-9
    top = s["top_sites"][0]
    line = mean[(mean["intervention"] == top["intervention"]) & (mean["site"] == top["site"])
                & (mean["layer"] == top["layer"]) & (mean["metric"] == "logit_diff")]
    line = line[line["effect"].abs() == line["effect"].abs().max()]
    assert top["mean_effect"] == pytest.approx(float(line["effect"].iloc[0]), abs=1e-6)
    ranked = mean[mean["metric"] == "logit_diff"]["effect"].abs().max()
    assert abs(top["mean_effect"]) == pytest.approx(ranked, abs=1e-6)


def test_no_column_shadows_and_old_columns_are_renamed_on_load(tmp_path):
    m = make_tiny("gpt2")
    res = tk.ActivationPatching(dataset={"generator": {"name": "ioi", "n": 4}}, sites=["head_out", "resid_pre"],
                                positions=["S2", "END"], ablations=["zero"],
                                metrics=["prob", "kl"], main_metric="prob").run(m, progress=False)
    for name, df in res.tables.items():
        assert shadowing_columns(df) == [], name
    assert {"intervention", "head_idx", "row_id", "position_name"} <= set(res.tables["main"].columns)
    rows = res.tables["rows"]
    assert len(rows) == 4 and {"pos_S2", "pos_IO", "io_name", "clean_logit_diff", "correct"} <= set(rows.columns)
    assert "logit_diff" not in set(res.tables["main"]["metric"])  # scored for the rows table only
    d = res.save(tmp_path / "r", figures=False)
    back = tk.Result.load(d)
    assert back.summary() == res.summary()
    assert back.config.dataset.generator.n == 4
    # a result saved before the renames: direction / head columns come back as intervention / head_idx
    old = pd.read_parquet(d / "main.parquet").rename(columns={"intervention": "direction", "head_idx": "head"})
    old.to_parquet(d / "main.parquet", index=False)
    man = json.loads((d / "manifest.json").read_text())
    man["files"]["main.parquet"] = (d / "main.parquet").stat().st_size
    (d / "manifest.json").write_text(json.dumps(man))
    again = tk.Result.load(d)
    assert {"intervention", "head_idx"} <= set(again.tables["main"].columns)
    assert again.summary() == res.summary()


def test_yaml_dataset_block_and_multi_target_pairs():
    from tracekit.config import parse_config

    cfg = parse_config({"experiments": [{"kind": "activation_patching", "dataset": {"generator": {"name": "ioi", "n": 8}},
                                         "sites": ["head_out"], "directions": ["denoising"],
                                         "metrics": ["logit_diff"]}]})
    assert cfg.experiments[0].dataset.generator.name == "ioi"
    with pytest.raises(Exception, match="not pairs and dataset|one of 'pairs', 'pairs_file', 'dataset'"):
        tk.ActivationPatching(pairs=_pairs(ROWS[:1]), dataset={"rows": ROWS[:1]})
    m = make_tiny("gpt2")
    two = {"clean": ROWS[0]["prompt"], "corrupted": ROWS[0]["corrupted"], "target": [" Mary", " her"],
           "foil": [" John", " him"]}
    res = tk.ActivationPatching(pairs=[two], sites=["resid_pre"], metrics=["logit_diff"]).run(m, progress=False)
    assert json.loads(res.tables["rows"]["target"].item()) == [" Mary", " her"]


@pytest.mark.slow
def test_ioi_head_patching_on_the_embedded_model(embedded_model):
    """The IOI block of experiments/ioi_smollm2.yaml (head_out, per head, all positions) end to end on
    SmolLM2-135M, restricted to two layers to stay fast: the model does the task on the clean rows,
    the corruption reverses it, and heads of those layers restore part of it."""
    res = tk.ActivationPatching(dataset={"generator": {"name": "ioi", "n": 8}}, sites=["head_out"],
                                directions=["denoising"], metrics=["logit_diff"], layers=[20, 23]
                                ).run(embedded_model, progress=False)
    s = res.summary()
    assert s["n_rows"] == 8 and len(set(res.tables["rows"]["n_tokens"])) > 1  # rows of several lengths
    assert s["mean_clean"]["logit_diff"] > 1.0 and s["mean_corrupted"]["logit_diff"] < -1.0
    assert s["share_rows_correct"] >= 0.75
    df = res.tables["main"]
    assert set(df["layer"]) == {20, 23} and df["head_idx"].notna().all()
    assert s["top_sites"][0]["mean_effect"] > 0.2
