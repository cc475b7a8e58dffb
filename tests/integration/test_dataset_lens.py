"""The logit lens over datasets: per-row targets, ``track``, named positions, per-row tables and
aggregates whose meaning does not depend on the number of rows (tiny perturbed models, offline)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import GPT2_BPE, make_perturbed, tiny_overrides
from tracekit.config import parse_config
from tracekit.dataset import DatasetSpec
from tracekit.errors import ConfigError, DatasetError
from tracekit.experiments.logit_lens import LogitLensResult
from tracekit.fastpath import lens_readout, residual_stream
from tracekit.logit_lens import lens_points, logit_lens
from tracekit.results import shadowing_columns
from tracekit.runner import StepFailed, run_config
from tracekit.tokens import encode, tokenize

#: Rows of different lengths, each with its own target; one without a foil; named positions.
ROWS = [
    {"prompt": "The capital of France is", "target": " Paris", "foil": " Rome", "group": "eu",
     "positions": {"SUBJ": " France", "END": -1}},
    {"prompt": "Everyone knows that the capital city of Italy is", "target": " Rome", "foil": " Paris",
     "group": "eu", "positions": {"SUBJ": " Italy", "END": -1}},
    {"prompt": "Japan:", "target": " Tokyo", "group": "asia", "positions": {"SUBJ": "Japan", "END": -1}},
]
SUBJ_TOKENS = [" France", " Italy", "Japan"]
TRACK = [" Paris", " London"]
ATOL = 1e-5


def _lens(rows, **kw) -> tk.LogitLens:
    return tk.LogitLens(dataset={"rows": rows}, **{"batch_size": len(rows), **kw})


def _sorted(df: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    return df.sort_values(key).reset_index(drop=True)


@pytest.mark.parametrize("arch, side, bos", [("gpt2", "left", True), ("gpt2", "right", False),
                                            ("llama", "left", False), ("llama", "right", True)])
def test_per_row_targets_equal_row_by_row_runs(arch, side, bos):
    """Each row scored against its own target in one batched pass equals that row run alone
    (abs 1e-5 on probabilities and natural-log probabilities), for rows of different lengths, left
    and right padding, BOS on and off (each padding side with each BOS setting once)."""
    model = make_perturbed(arch, prepend_bos=bos, padding_side=side)
    exp = _lens(ROWS, position="all")
    res = exp.run(model, progress=False)
    main, rows = res.tables["main"], res.tables["rows"]
    assert main["row_id"].nunique() == 3 and len({len(encode(model, r["prompt"])) for r in ROWS}) == 3
    assert (main["target"] == main["row_id"].map(lambda i: ROWS[i]["target"])).all()
    key = ["position", "hidden_state"]
    for i, row in enumerate(ROWS):
        one = exp.model_copy(update={"dataset": DatasetSpec(rows=[row]), "batch_size": 1}).run(model, progress=False)
        a = _sorted(main[main["prompt_idx"] == i], key)
        b = _sorted(one.tables["main"], key)
        assert len(a) == len(b) == len(encode(model, row["prompt"])) * (model.cfg.n_layers + 1)
        assert (a["token"] == b["token"]).all() and (a["target_id"] == b["target_id"]).all()
        for col in ("prob", "log_prob", "top1_prob"):
            assert np.abs(a[col].to_numpy() - b[col].to_numpy()).max() < ATOL, col
        assert np.abs(a["entropy"].to_numpy() - b["entropy"].to_numpy()).max() < 1e-4  # a float32 sum over the vocabulary
        assert (np.abs(a["vocab_rank"] - b["vocab_rank"]) <= 1).all()  # ties within float noise only
        if "foil" in row:
            assert np.abs(a["logit_diff"].to_numpy() - b["logit_diff"].to_numpy()).max() < ATOL
        else:
            assert a["logit_diff"].isna().all() and (a["foil_id"] == -1).all()
        ra, rb = rows.iloc[i], one.tables["rows"].iloc[0]
        assert ra["target"] == rb["target"] == row["target"]
        assert abs(ra["target_log_prob_final"] - rb["target_log_prob_final"]) < ATOL
        for col in ("emergence_hidden_state", "emergence_layer", "jump_layer", "target_vocab_rank_final"):
            assert (pd.isna(ra[col]) and pd.isna(rb[col])) or ra[col] == rb[col], col
    # the prompts form (target list = one per prompt) gives the same numbers as the dataset form
    plain = tk.LogitLens(prompts=[r["prompt"] for r in ROWS], target=[r["target"] for r in ROWS], position="all",
                         batch_size=3).run(model, progress=False).tables["main"]
    k = ["prompt_idx", "position", "hidden_state"]
    assert np.abs(_sorted(plain, k)["log_prob"].to_numpy() - _sorted(main, k)["log_prob"].to_numpy()).max() < ATOL


def test_per_row_targets_can_fail():
    """The comparison above can fail: another row's target gives other numbers."""
    model = make_perturbed("gpt2")
    a = _lens(ROWS).run(model, progress=False).tables["rows"]
    swapped = [{**ROWS[0], "target": " Rome", "foil": " Paris"}] + ROWS[1:]
    b = _lens(swapped).run(model, progress=False).tables["rows"]
    col = "target_log_prob_final"
    assert abs(a[col].iloc[0] - b[col].iloc[0]) > 100 * ATOL
    assert np.abs(a[col].iloc[1:].to_numpy() - b[col].iloc[1:].to_numpy()).max() < ATOL


def test_track_equals_the_old_cross_product():
    """``track`` reads the same tokens on every row: the numbers of the old target list (every
    target at every prompt: lens_readout over the tracked ids), and equal to a per-row target run
    with that token."""
    model = make_perturbed("llama", padding_side="left")
    prompts = [r["prompt"] for r in ROWS]
    res = tk.LogitLens(prompts=prompts, track=TRACK, batch_size=3).run(model, progress=False)
    tr = res.tables["tracked"]
    assert set(tr["tracked_token"]) == set(TRACK) and len(tr) == 3 * len(TRACK) * (model.cfg.n_layers + 1)
    assert "prob" not in res.tables["main"]  # no target: main holds no target columns
    # the old computation: residuals at each prompt's last token, every tracked id at every prompt
    names = [p.hook for p in lens_points(model.cfg.n_layers, "hidden_states")]
    batch = tokenize(model, prompts)
    resid = residual_stream(model, batch, names, positions=batch.last)  # [H, b, d]
    tids = [tk.tokens.single_token_id(model, t) for t in TRACK]
    old = lens_readout(model, resid, target_ids=tids, top_k=5)  # [H, b, T]
    for r in tr.itertuples():
        j = TRACK.index(r.tracked_token)
        assert r.tracked_id == tids[j]
        assert abs(r.log_prob - old["target_log_prob"][r.hidden_state, r.prompt_idx, j].item()) < ATOL
        assert r.vocab_rank == old["target_rank"][r.hidden_state, r.prompt_idx, j].item()
    # a tracked token equals the same token given as every row's target
    as_target = tk.LogitLens(prompts=prompts, target=TRACK[0], batch_size=3).run(model, progress=False).tables["main"]
    t0 = tr[tr["tracked_token"] == TRACK[0]]
    k = ["prompt_idx", "hidden_state"]
    assert np.abs(_sorted(t0, k)["log_prob"].to_numpy() - _sorted(as_target, k)["log_prob"].to_numpy()).max() < ATOL
    s = res.summary()
    assert s["tracked"] == TRACK and "target_by_row" not in s and "target_prob_final" not in s
    last = t0[t0["hidden_state"] == model.cfg.n_layers]
    assert abs(s["mean_tracked_prob_final"][TRACK[0]] - last["prob"].mean()) < 1e-5


@pytest.mark.parametrize("kw", [
    {"prompts": ["a b", "c d", "e f"], "target": [" Paris", " Rome"]},
    {"prompts": ["The capital of France is"], "target": [" Paris", " Rome"]},  # the old "list of targets"
])
def test_target_list_of_the_wrong_length_names_track(kw, tiny_gpt2):
    with pytest.raises(ValueError) as e:
        tk.LogitLens(**kw)
    assert "track" in str(e.value) and "one per prompt" in str(e.value)
    with pytest.raises(DatasetError, match="track"):  # the notebook engine says the same
        logit_lens(tiny_gpt2, kw["prompts"], targets=kw["target"])


def test_target_beside_a_dataset_or_a_name_without_one_is_refused():
    with pytest.raises(ValueError, match="track"):
        tk.LogitLens(dataset={"rows": ROWS}, target=" Paris")
    with pytest.raises(ValueError, match="position.*needs a dataset"):
        tk.LogitLens(prompts=["a b"], position="END")
    with pytest.raises(ValueError, match=r"'IO' is not a named position of dataset.rows\[0\]"):
        tk.LogitLens(dataset={"rows": ROWS}, position="IO")


def test_a_named_position_a_generated_row_lacks_fails_at_check(tiny_gpt2):
    exp = tk.LogitLens(dataset={"generator": {"name": "capitals", "n": 3}}, position="IO")
    with pytest.raises(DatasetError, match=r"position: 'IO' is not a named position of row 0.*END.*SUBJ"):
        exp.check(tiny_gpt2)


def test_a_result_saved_before_per_row_tables_loads_with_the_same_summary():
    """The shipped example (saved with a ``rank`` column and no ``rows`` table) loads: ``rank`` is
    ``vocab_rank``, and the single-row summary equals the one saved then."""
    import json
    from pathlib import Path

    d = Path(__file__).resolve().parents[2] / "results/examples/paris_logit_lens_smollm2/paris"
    res = tk.Result.load(d)
    assert "vocab_rank" in res.tables["main"] and "rank" not in res.tables["main"] and len(res.tables["rows"]) == 1
    s, saved = res.summary(), json.loads((d / "summary.json").read_text())
    for key in ("final_top1", "target", "emergence_hidden_state", "emergence_layer", "jump_layer",
                "target_rank_by_hidden_state", "hidden_states", "hooks"):
        assert s[key] == saved[key], key
    assert s["target_prob_final"] == pytest.approx(saved["target_prob_final"], abs=1e-6)
    assert s["target_prob_by_hidden_state"] == pytest.approx(saved["target_prob_by_hidden_state"], abs=1e-6)
    assert s["target_prob_final_by_row"] == [pytest.approx(saved["target_prob_final"], abs=1e-6)]
    assert "largest jump: h29 -> h30" in res.report()


@pytest.mark.parametrize("name, expected", [("END", None), ("SUBJ", SUBJ_TOKENS)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_named_position_reads_the_right_token_under_padding_and_bos(name, expected, side):
    """``position: END`` / ``SUBJ`` resolve per row after BOS and padding: the token read is the
    row's own (counting from the padded start would read a pad or another token under left
    padding and BOS), and its numbers equal an explicit per-row index."""
    model = make_perturbed("gpt2", prepend_bos=True, padding_side=side)
    res = _lens(ROWS, position=name).run(model, progress=False)
    main, rows = res.tables["main"], res.tables["rows"]
    ids = [encode(model, r["prompt"]) for r in ROWS]
    assert all(i[0] == model.tokenizer.bos_token_id for i in ids) and len({len(i) for i in ids}) == 3
    toks = main.drop_duplicates("prompt_idx").sort_values("prompt_idx")["token"].tolist()
    want = expected or [tk.tokens.str_tokens(model, i)[-1] for i in ids]
    assert toks == want == rows["token"].tolist()
    assert rows["position"].tolist() == rows[f"pos_{name}"].tolist()
    if name == "END":
        assert rows["position"].tolist() == [len(i) - 1 for i in ids]
    for i, row in enumerate(ROWS):
        at = int(rows["position"].iloc[i])
        one = tk.LogitLens(prompts=[row["prompt"]], target=row["target"], position=at).run(model, progress=False)
        a = _sorted(main[main["prompt_idx"] == i], ["hidden_state"])
        b = _sorted(one.tables["main"], ["hidden_state"])
        assert np.abs(a["log_prob"].to_numpy() - b["log_prob"].to_numpy()).max() < ATOL
        assert (a["top1"] == b["top1"]).all()


def test_rows_table_and_aggregates_equal_a_hand_computation():
    """Every aggregate is recomputed here from the ``rows`` (and ``main``) table. Half the rows take
    the model's own top-1 as target, so some rows emerge and others do not."""
    model = make_perturbed("llama")
    prompts = ["The capital of France is", "One two three four", "Hello world, this is a longer prompt", "Japan:",
               "A B C"]
    top1 = tk.LogitLens(prompts=prompts).run(model, progress=False).summary()["final_top1_by_row"]
    targets = [top1[0], " Paris", top1[2], " Tokyo", top1[4]]
    res = tk.LogitLens(prompts=prompts, target=targets, foil=" London", batch_size=2).run(model, progress=False)
    rows, main = res.tables["rows"], res.tables["main"]
    for name, df in res.tables.items():
        assert not shadowing_columns(df), (name, shadowing_columns(df))
    assert rows["row_id"].tolist() == list(range(5)) and rows["target"].tolist() == targets
    assert rows["prompt"].tolist() == prompts and rows["final_top1"].tolist() == top1
    s = res.summary()
    assert s["n_rows"] == 5
    assert s["target_by_row"] == targets and s["final_top1_by_row"] == top1
    assert s["target_prob_final_by_row"] == pytest.approx(rows["target_prob_final"].tolist(), abs=1e-6)
    assert s["mean_target_prob_final"] == pytest.approx(rows["target_prob_final"].mean(), abs=1e-6)
    assert s["top1_accuracy_final"] == pytest.approx((rows["target_vocab_rank_final"] == 1).mean())
    assert s["top1_accuracy_final"] == pytest.approx(3 / 5)
    em = rows["emergence_hidden_state"]
    assert s["emergence_hidden_state_by_row"] == [None if pd.isna(v) else int(v) for v in em]
    assert s["emergence_layer_by_row"] == [None if pd.isna(v) else int(v) for v in rows["emergence_layer"]]
    assert s["share_rows_emerged"] == pytest.approx(em.notna().mean())
    assert 0 < s["share_rows_emerged"] < 1
    assert s["median_emergence_layer"] == pytest.approx(rows["emergence_layer"].dropna().astype(float).median())
    assert s["jump_layer_by_row"] == [None if pd.isna(v) else int(v) for v in rows["jump_layer"]]
    assert s["mean_logit_diff_final"] == pytest.approx(rows["logit_diff_final"].mean(), abs=1e-6)
    # each row's landmarks from its own curve in main
    last = main[main["is_last"]]
    for r in rows.itertuples():
        g = last[last["prompt_idx"] == r.prompt_idx].sort_values("hidden_state")
        lm = tk.logit_lens.landmarks(g["hidden_state"].tolist(), g["prob"].tolist(), g["vocab_rank"].tolist())
        assert lm["emergence_hidden_state"] == (None if pd.isna(r.emergence_hidden_state) else r.emergence_hidden_state)
        assert lm["jump_layer"] == r.jump_layer
    # the curves: mean over rows of each row's own target probability, median vocab rank
    for h in range(model.cfg.n_layers + 1):
        g = last[last["hidden_state"] == h]
        assert s["mean_target_prob_by_hidden_state"][h] == pytest.approx(g["prob"].astype(float).mean(), abs=1e-6)
        assert s["median_target_rank_by_hidden_state"][h] == g["vocab_rank"].median()
    assert res.tables["rows"]["target_prob_final"].tolist() == pytest.approx(
        last[last["hidden_state"] == model.cfg.n_layers].sort_values("prompt_idx")["prob"].tolist(), abs=1e-5)
    report = res.report()
    assert "median emergence layer" in report and all(repr(t) in report for t in targets)
    figs = res.figures()
    assert {"target_by_layer", "emergence", "top1_grid"} <= set(figs)
    labels = [t.get_text() for t in figs["target_by_layer"].axes[0].get_legend().get_texts()]
    assert any("France is" in lab for lab in labels) and not any("prompt 0" in lab for lab in labels)
    import matplotlib.pyplot as plt

    plt.close("all")


def test_summary_keys_keep_their_meaning_from_one_to_three_rows():
    """Keys present for 1 and for 3 rows mean the same; single-row keys exist only for one row and
    are then exactly that row's values."""
    model = make_perturbed("gpt2")
    three = _lens(ROWS).run(model, progress=False).summary()
    ones = [_lens([r]).run(model, progress=False).summary() for r in ROWS]
    single = set(LogitLensResult.single_row_keys)
    assert not single & set(three)
    assert set(ones[0]) - single == set(three)
    assert set(ones[0]) <= set(LogitLensResult.summary_keys) and set(three) <= set(LogitLensResult.summary_keys)
    for key in three:
        if key.endswith("_by_row"):
            assert len(three[key]) == 3
            for i, one in enumerate(ones):
                if key not in one:  # a foil key: present when a row has a foil, whatever the number of rows
                    assert "foil" not in ROWS[i] and "logit_diff" in key
                    assert three[key][i] is None
                    continue
                assert three[key][i] == pytest.approx(one[key][0], abs=1e-5) if isinstance(one[key][0], float) \
                    else three[key][i] == one[key][0], key
    mean = float(np.mean([o["mean_target_prob_final"] for o in ones]))
    assert three["mean_target_prob_final"] == pytest.approx(mean, abs=1e-5)
    assert three["top1_accuracy_final"] == pytest.approx(np.mean([o["top1_accuracy_final"] for o in ones]))
    for o in ones:  # one row: the aggregates are that row's values, and so are the single-row keys
        assert o["n_rows"] == 1
        assert o["mean_target_prob_final"] == pytest.approx(o["target_prob_final_by_row"][0], abs=1e-6)
        assert o["target_prob_final"] == pytest.approx(o["target_prob_final_by_row"][0], abs=1e-6)
        assert o["emergence_layer"] == o["emergence_layer_by_row"][0]
        assert o["jump_layer"] == o["jump_layer_by_row"][0] and o["final_top1"] == o["final_top1_by_row"][0]
        assert o["target_prob_by_hidden_state"] == pytest.approx(o["mean_target_prob_by_hidden_state"], abs=1e-6)
        assert o["target_rank_by_hidden_state"] == o["median_target_rank_by_hidden_state"]


def test_old_rank_column_in_a_pipeline_reference_names_vocab_rank(tiny_gpt2, tmp_path):
    model = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
             "device": "cpu"}
    lens = {"kind": "logit_lens", "name": "lens", "prompts": ["The capital of France is"], "target": " Paris"}
    att = {"kind": "attention_pattern", "name": "att", "prompts": ["The capital of France is"],
           "layer": {"from": "lens", "table": "main", "column": "rank", "row": 0}}
    cfg = parse_config({"model": model, "seed": 0, "experiments": [lens, att]})
    with pytest.raises(StepFailed) as e:
        run_config(cfg, tmp_path, "old", model=tiny_gpt2, progress=False, log=lambda *a, **k: None)
    cause = e.value.__cause__
    assert isinstance(cause, ConfigError)
    assert "'rank' was renamed to 'vocab_rank'" in str(cause) and "experiments[1].layer.column" in str(cause)
    assert LogitLensResult.renamed_column("main", "rank") == "vocab_rank"


def test_capitals_generator_rows_carry_their_groups_and_extras(tiny_gpt2):
    """A generated dataset: the rows table keeps the generator's group and extra columns; the
    summary is per row; many rows are drawn as a mean curve with a band."""
    res = tk.LogitLens(dataset={"generator": {"name": "capitals", "n": 14, "few_shot": True}}, position="END",
                       batch_size=16).run(tiny_gpt2, progress=False)
    rows = res.tables["rows"]
    assert len(rows) == 14 and {"group", "country", "pos_SUBJ", "pos_END"} <= set(rows.columns)
    assert rows["target"].nunique() == 14 and rows["token"].eq(" is").all()
    s = res.summary()
    assert len(s["target_prob_final_by_row"]) == 14 and "target_prob_final" not in s
    fig = res.figures()["target_by_layer"]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any("mean over rows" in lab for lab in labels) and any("10-90%" in lab for lab in labels)
    import matplotlib.pyplot as plt

    plt.close("all")


def test_engine_takes_ids_and_a_prepared_dataset(tiny_gpt2):
    """The notebook engine accepts strings, prepared ids and a PreparedDataset, with equal numbers."""
    data = DatasetSpec(rows=ROWS).prepare(tiny_gpt2)
    by_data = logit_lens(tiny_gpt2, data, position="SUBJ")
    reads = [[i] for i in data.position("SUBJ")]
    by_ids = logit_lens(tiny_gpt2, data.ids, targets=[r["target"] for r in ROWS], reads=reads)
    by_text = logit_lens(tiny_gpt2, data.prompts, targets=[r["target"] for r in ROWS], reads=reads)
    for a, b, c in zip(by_data, by_ids, by_text):
        assert a.positions == b.positions == c.positions and a.target_ids == b.target_ids == c.target_ids
        assert torch.equal(a.target_log_prob, b.target_log_prob) and torch.equal(a.target_log_prob, c.target_log_prob)
    assert [a.tokens[a.positions[0]] for a in by_data] == SUBJ_TOKENS
