"""Direct logit attribution per dataset row (issue #21: datasets, not single prompts).

Every row has its own target and foil; the kind computes all rows in batched forward passes with
padding, and each row's numbers must equal that row run alone (no padding, its own target): rows of
different lengths, left and right padding, BOS on and off, on perturbed tiny models of two
families: GPT-2 (LayerNorm, learned positions, biases; tests/helpers.py ``make_perturbed``) and
Gemma 2 (final logit soft-cap, pre+post sandwich norms, sliding-window attention, rotary
positions; the perturbed tiny build of tests/conformance, as in test_architecture_fixes.py; the
helpers' ``make_tiny`` builds only GPT-2 and Llama). Tolerance 1e-5: the same float32 arithmetic on
the same activations, batched or not, differs by rounding only (~1e-7 seen).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import GPT2_BPE, TARGET_ROWS, make_perturbed
from tracekit.core.errors import AttributionError, DatasetError, TokenizationError
from tracekit.dla import logit_attribution
from tracekit.results import shadowing_columns
from tracekit.tokens import encode, single_token_id

ATOL = 1e-5
ROWS = TARGET_ROWS
PROMPTS, TARGETS, FOILS = ([r[i] for r in ROWS] for i in range(3))
#: GPT-2 on the whole grid (left/right padding x BOS on/off); Gemma 2 on both sides and both BOS states.
VARIANTS = [("gpt2", side, bos) for side in ("left", "right") for bos in (True, False)] + [
    ("gemma2", "left", False), ("gemma2", "right", True)]

_GEMMA: dict = {}


def model_for(arch: str, padding_side: str, prepend_bos: bool):
    if arch == "gpt2":
        return make_perturbed("gpt2", padding_side=padding_side, prepend_bos=prepend_bos)
    key = (padding_side, prepend_bos)
    if key not in _GEMMA:
        from conformance import harness

        from tracekit.model.load import load_model
        from tracekit.model.spec import ModelSpec

        d = harness.build("Gemma2ForCausalLM")
        _GEMMA[key] = load_model(ModelSpec(name=d, tokenizer=GPT2_BPE, device="cpu", padding_side=padding_side,
                                           prepend_bos=prepend_bos))
    return _GEMMA[key]


def by_row(res, table: str, row_id: int) -> pd.DataFrame:
    df = res.tables[table]
    return df[df["row_id"] == row_id].drop(columns="row_id").reset_index(drop=True)


@pytest.mark.parametrize("arch,side,bos", VARIANTS, ids=[f"{a}-{s}-{'bos' if b else 'nobos'}" for a, s, b in VARIANTS])
def test_per_row_targets_equal_row_by_row_runs(arch, side, bos):
    m = model_for(arch, side, bos)
    assert m.tracekit_spec.padding_side == side
    lengths = [len(encode(m, p)) for p in PROMPTS]
    assert len(set(lengths)) == len(lengths)  # every batch pads
    assert all(n == len(encode(m, p, prepend_bos=False)) + int(bos) for n, p in zip(lengths, PROMPTS))
    res = tk.DirectLogitAttribution(prompts=PROMPTS, target=TARGETS, foil=FOILS, batch_size=4).run(m, progress=False)
    rows = res.tables["rows"]
    assert rows["row_id"].tolist() == [0, 1, 2, 3] and rows["target"].tolist() == TARGETS
    assert rows["foil"].tolist() == FOILS
    lds = rows["logit_diff"].to_numpy()
    assert np.abs(lds).max() > 1e-2 and np.ptp(lds) > 1e-2  # not vacuous: rows differ
    for i, (p, t, f) in enumerate(ROWS):
        one = tk.DirectLogitAttribution(prompts=[p], target=t, foil=f).run(m, progress=False)
        for table in ("components", "heads"):
            a, b = by_row(res, table, i), by_row(one, table, 0)
            pd.testing.assert_frame_equal(a.drop(columns="contribution"), b.drop(columns="contribution"))
            np.testing.assert_allclose(a["contribution"], b["contribution"], atol=ATOL, rtol=0)
        r1 = one.tables["rows"].iloc[0]
        for col in ("logit_diff", "attributed_logit_diff", "sum_of_parts", "final_scale"):
            assert rows.iloc[i][col] == pytest.approx(r1[col], abs=ATOL), col
        assert rows.iloc[i]["position"] == r1["position"] == lengths[i] - 1
        assert rows.iloc[i]["top_component"] == r1["top_component"]
    if arch == "gemma2":  # the soft-cap: the parts add up to the pre-cap logit difference
        assert "soft-cap" in rows["output_transform"].iloc[0]
        assert np.abs(rows["attributed_logit_diff"] - rows["logit_diff"]).max() > 1e-3


def _dataset_rows() -> list[dict]:
    return [{"prompt": p, "target": t, "foil": f, "group": "a" if i % 2 else "b", "source_line": 10 + i,
             "positions": {"END": -1, "SUBJ": {"text": subj, "occurrence": 0}}}
            for i, ((p, t, f), subj) in enumerate(zip(ROWS, [" France", " John", " Mary", " Tower"]))]


@pytest.mark.parametrize("arch,bos", [("gpt2", True), ("gemma2", False)])
def test_named_positions_resolve_per_row_under_left_padding(arch, bos):
    """``END`` and a middle name (``SUBJ``) read each row's own token under left padding: the logit
    difference there is the model's own output for the row alone (counted from the padded start, a
    shorter row would read a pad or another token)."""
    m = model_for(arch, "left", bos)
    ds = {"rows": _dataset_rows()}
    end = tk.DirectLogitAttribution(dataset=ds, position="END", batch_size=4).run(m, progress=False)
    last = tk.DirectLogitAttribution(dataset=ds, position="last", batch_size=4).run(m, progress=False)
    pd.testing.assert_frame_equal(end.tables["components"], last.tables["components"])
    rows = end.tables["rows"]
    n = [len(encode(m, p)) for p in PROMPTS]
    assert rows["position"].tolist() == [k - 1 for k in n] == rows["pos_END"].tolist()
    assert rows["group"].tolist() == ["b", "a", "b", "a"] and rows["source_line"].tolist() == [10, 11, 12, 13]
    subj = tk.DirectLogitAttribution(dataset=ds, position="SUBJ", batch_size=4).run(m, progress=False)
    srows = subj.tables["rows"]
    assert srows["token"].tolist() == [" France", " John", " Mary", " Tower"]
    assert srows["position"].tolist() == srows["pos_SUBJ"].tolist()
    for i, (p, t, f) in enumerate(ROWS):
        k = int(srows["position"].iloc[i])
        assert k < n[i] - 1  # a middle token: counted from the padded start it would read another one
        with torch.no_grad():  # the model's own logits of the row alone, per row its own target and foil
            lg = m(torch.tensor([encode(m, p)]))[0].float()
        t_id, f_id = single_token_id(m, t), single_token_id(m, f)
        assert srows["logit_diff"].iloc[i] == pytest.approx(float(lg[k, t_id] - lg[k, f_id]), abs=1e-4)
        assert rows["logit_diff"].iloc[i] == pytest.approx(float(lg[-1, t_id] - lg[-1, f_id]), abs=1e-4)
    one = tk.DirectLogitAttribution(prompts=[PROMPTS[0]], target=TARGETS[0], foil=FOILS[0],
                                    position=int(srows["position"].iloc[0])).run(m, progress=False)
    np.testing.assert_allclose(by_row(subj, "heads", 0)["contribution"], by_row(one, "heads", 0)["contribution"],
                               atol=ATOL, rtol=0)  # row 0 is the shortest: the most left padding


def test_aggregates_equal_a_hand_computation():
    m = make_perturbed("gpt2", padding_side="left")
    res = tk.DirectLogitAttribution(prompts=PROMPTS, target=TARGETS, foil=FOILS, batch_size=3, top_k=5).run(
        m, progress=False)
    comp, heads, rows = res.tables["components"], res.tables["heads"], res.tables["rows"]
    s = res.summary()
    # per component over rows
    for name, grp in comp.groupby("component"):
        agg = res.tables["components_mean"].set_index("component").loc[name]
        x = grp["contribution"].to_numpy()
        assert agg["mean_contribution"] == pytest.approx(x.mean(), abs=1e-6)
        assert agg["std_contribution"] == pytest.approx(x.std(ddof=1), abs=1e-6)
        assert agg["mean_abs_contribution"] == pytest.approx(np.abs(x).mean(), abs=1e-6)
        assert agg["n_rows"] == len(x) == 4
    # per head over rows, and the summary's top heads by |mean|
    hm = res.tables["heads_mean"].set_index(["layer", "head_idx"])
    means = {}
    for (L, h), grp in heads.groupby(["layer", "head_idx"]):
        assert hm.loc[(L, h), "mean_contribution"] == pytest.approx(grp["contribution"].mean(), abs=1e-6)
        if h >= 0:
            means[(int(L), int(h))] = float(grp["contribution"].mean())
    top = sorted(means.items(), key=lambda kv: -abs(kv[1]))[:5]
    assert [(L, h) for L, h, _ in s["top_heads_mean"]] == [k for k, _ in top]
    np.testing.assert_allclose([v for *_, v in s["top_heads_mean"]], [v for _, v in top], atol=1e-6)
    cm = comp.groupby("component")["contribution"].mean()
    want_c = cm.reindex(cm.abs().sort_values(ascending=False).index).head(5)
    assert [c for c, _ in s["top_components_mean"]] == want_c.index.tolist()
    # row scalars
    assert s["n_rows"] == 4 and s["row_id_by_row"] == [0, 1, 2, 3]
    assert s["logit_diff_by_row"] == pytest.approx(rows["logit_diff"].tolist(), abs=1e-9)
    assert s["mean_logit_diff"] == pytest.approx(float(np.mean(s["logit_diff_by_row"])), abs=1e-9)
    assert s["correct_by_row"] == [x > 0 for x in s["logit_diff_by_row"]]
    assert s["share_rows_correct"] == pytest.approx(np.mean(s["correct_by_row"]))
    per_row_sum = comp.groupby("row_id")["contribution"].sum()
    err = (per_row_sum - rows.set_index("row_id")["attributed_logit_diff"]).abs()
    assert s["max_sum_error"] == pytest.approx(float(err.max()), abs=1e-6)
    for kind, key in (("attn", "mean_attn_by_layer"), ("mlp", "mean_mlp_by_layer")):
        c = comp[comp["kind"] == kind]
        want = [float(c[c["layer"] == L]["contribution"].mean()) for L in range(int(m.cfg.n_layers))]
        np.testing.assert_allclose(s[key], want, atol=1e-6)
        total = c.groupby("row_id")["contribution"].sum().mean()
        assert s[f"mean_{kind}_total"] == pytest.approx(float(total), abs=1e-6)
    emb = comp[comp["kind"] == "embed"].groupby("row_id")["contribution"].sum().mean()
    assert s["mean_embed"] == pytest.approx(float(emb), abs=1e-6)
    for i in range(4):  # each row's top component is its largest |contribution|
        c = comp[comp["row_id"] == i]
        assert rows["top_component"].iloc[i] == c.loc[c["contribution"].abs().idxmax(), "component"]
    assert sorted(s) == sorted(type(res).summary_keys)
    for name, df in res.tables.items():
        assert shadowing_columns(df) == [], name
    assert sorted(res.tables) == sorted(type(res).table_names)


@pytest.mark.parametrize("arch", ["gpt2", "gemma2"])
def test_per_row_sum_check_holds(arch):
    m = model_for(arch, "right", True)
    res = tk.DirectLogitAttribution(prompts=PROMPTS, target=TARGETS, foil=FOILS, batch_size=4).run(m, progress=False)
    comp, heads, rows = res.tables["components"], res.tables["heads"], res.tables["rows"].set_index("row_id")
    for rid, c in comp.groupby("row_id"):
        assert c["contribution"].sum() == pytest.approx(rows.loc[rid, "attributed_logit_diff"], abs=1e-4)
        assert rows.loc[rid, "sum_error"] < 1e-4 and rows.loc[rid, "max_identity_error"] < 1e-4
        h = heads[heads["row_id"] == rid].groupby("layer")["contribution"].sum()  # heads + b_O = attention layer
        a = c[c["kind"] == "attn"].set_index("layer")["contribution"]
        np.testing.assert_allclose(h.sort_index().to_numpy(), a.sort_index().to_numpy(), atol=1e-4, rtol=0)
    assert res.summary()["max_sum_error"] < 1e-4


def test_engine_takes_prepared_rows_and_per_prompt_targets():
    from tracekit.dataset import prepare_rows, rows_from_prompts

    m = make_perturbed("gpt2", padding_side="left")
    listed = logit_attribution(m, PROMPTS, TARGETS, FOILS, batch_size=4)
    data = prepare_rows(m, rows_from_prompts(PROMPTS, TARGETS, FOILS))
    prepared = logit_attribution(m, data, batch_size=2)
    for i, (a, b) in enumerate(zip(listed, prepared)):
        one = logit_attribution(m, PROMPTS[i], TARGETS[i], FOILS[i])[0]
        assert a.target.target == b.target.target == TARGETS[i] and a.row_id == b.row_id == i
        for d in (a, b):
            assert d.logit == pytest.approx(one.logit, abs=ATOL)
            torch.testing.assert_close(d.heads, one.heads, atol=ATOL, rtol=0)
            torch.testing.assert_close(d.mlp, one.mlp, atol=ATOL, rtol=0)
    with pytest.raises(AttributionError, match="one per prompt"):
        logit_attribution(m, PROMPTS, TARGETS[:2])
    with pytest.raises(AttributionError, match="beside a dataset"):
        logit_attribution(m, data, " Paris")
    with pytest.raises(TokenizationError, match=r"target\[1\]"):
        logit_attribution(m, PROMPTS[:2], [" Paris", " Parisian-ish"])


def test_one_target_for_every_prompt_still_works(tmp_path):
    m = make_perturbed("gpt2")
    res = tk.DirectLogitAttribution(prompts=PROMPTS[:2], target=" Paris", foil=" London").run(m, progress=False)
    s = res.summary()
    assert s["target_by_row"] == [" Paris", " Paris"] and s["foil_by_row"] == [" London", " London"]
    assert s["metric"] == "logit(target) - logit(foil)"
    no_foil = tk.DirectLogitAttribution(prompts=PROMPTS[:1], target=" Paris").run(m, progress=False).summary()
    assert no_foil["metric"] == "logit(target)" and no_foil["correct_by_row"] is None
    assert no_foil["share_rows_correct"] is None
    res.save(tmp_path / "r")
    back = tk.Result.load(tmp_path / "r")
    assert json.dumps(back.summary()) == json.dumps(s)


def test_config_errors():
    with pytest.raises(ValueError, match="track"):
        tk.DirectLogitAttribution(prompts=PROMPTS, target=TARGETS[:3])
    with pytest.raises(ValueError, match="beside a dataset"):
        tk.DirectLogitAttribution(dataset={"rows": _dataset_rows()}, target=" Paris")
    with pytest.raises(ValueError, match="target: give"):
        tk.DirectLogitAttribution(prompts=PROMPTS)
    with pytest.raises(ValueError, match="not both"):
        tk.DirectLogitAttribution(prompts=PROMPTS, dataset={"rows": _dataset_rows()})
    m = make_perturbed("gpt2")
    mixed = _dataset_rows()
    del mixed[2]["foil"]
    with pytest.raises(DatasetError, match=r"rows \[2\] have no foil"):
        tk.DirectLogitAttribution(dataset={"rows": mixed}).prepare(m)
    with pytest.raises(DatasetError, match="'IO' is not a named position"):
        tk.DirectLogitAttribution(dataset={"rows": _dataset_rows()}, position="IO").prepare(m)


def test_result_saved_before_datasets_loads(tmp_path):
    """A result saved with the old tables (``prompts``, ``prompt_idx``, ``head``) loads with today's
    tables and summary."""
    from tracekit.results import MANIFEST

    m = make_perturbed("gpt2")
    res = tk.DirectLogitAttribution(prompts=PROMPTS[:2], target=" Paris", foil=" London").run(m, progress=False)
    d = res.save(tmp_path / "r", figures=False)
    rows = res.tables["rows"]
    old = rows[["row_id", "prompt", "position", "token", "metric", "logit_diff", "attributed_logit_diff",
                "output_transform", "sum_of_parts", "final_scale", "tokens"]].rename(
        columns={"row_id": "prompt_idx", "logit_diff": "logit", "attributed_logit_diff": "attributed_logit"})
    for name in ("rows", "components_mean", "heads_mean"):
        (d / f"{name}.parquet").unlink()
    old.to_parquet(d / "prompts.parquet", index=False)
    res.tables["components"].rename(columns={"row_id": "prompt_idx"}).to_parquet(d / "components.parquet", index=False)
    res.tables["heads"].rename(columns={"row_id": "prompt_idx", "head_idx": "head"}).to_parquet(
        d / "heads.parquet", index=False)
    man = json.loads((d / MANIFEST).read_text())
    man["tables"] = ["components", "heads", "prompts"]
    man["files"] = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file() and p.name != MANIFEST}
    (d / MANIFEST).write_text(json.dumps(man))
    back = tk.Result.load(d)
    s, want = back.summary(), res.summary()
    for k in ("n_rows", "target_by_row", "foil_by_row", "logit_diff_by_row", "top_heads_mean", "top_components_mean",
              "max_sum_error", "mean_attn_by_layer", "top_component_by_row"):
        assert s[k] == pytest.approx(want[k]) if isinstance(want[k], float) else s[k] == want[k], k
    assert "direct logit attribution" in back.report() and set(back.figures()) == {"components", "heads"}
