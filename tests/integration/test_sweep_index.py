"""The sweep index for analysis (wide + long tables, headline view, load_point, log / rank axes) and
the one-pass target sweep of a logit lens, on tiny random models (single-threaded: bit-identical
numbers between a shared pass and separate runs)."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers import GPT2_BPE, one_thread, quiet, tiny_overrides
from tracekit.errors import ResultLoadError
from tracekit.experiments.logit_lens import LogitLens
from tracekit.experiments.onepass import SharedPasses, shared_passes
from tracekit.sweep import expand_sweep, load_results, run_sweep
from tracekit.sweep.figures import axis_scale, compare
from tracekit.sweep.index import INDEX_META, load_metrics, load_point

PROMPTS = ["The capital of France is", "The river through Paris is the"]
TARGETS = [" Paris", " London", " the"]


def tiny(arch):
    return {"name": arch, "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides(arch, 2),
            "device": "cpu"}


#: 2 kinds x 3 targets on one tiny GPT-2: lens points differing only in target share a pass.
SWEEP = {
    "model": tiny("gpt2"),
    "seed": 1,
    "experiments": [{"kind": "logit_lens", "name": "step", "prompts": PROMPTS, "target": " Paris"}],
    "sweep": {"grid": {"experiments[0].kind": ["logit_lens", "direct_logit_attribution"],
                       "experiments[0].target": TARGETS},
              "compare": ["step/mean_target_prob_by_hidden_state"]},
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "out"
    with one_thread():
        outcome = run_sweep(copy.deepcopy(SWEEP), out, progress=False, log=quiet)
    assert outcome.exit_code == 0
    return out, outcome


def _flat(obj, prefix=""):
    """Every scalar of a summary value with its path (the reference the tables are checked against)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def test_wide_table_holds_the_scalars_of_each_point_summary(sweep):
    out, _ = sweep
    df = load_results(out)
    assert not [c for c in df.columns if "[" in c and c.startswith("step/")]  # no key[i] explosion
    meta = json.loads((out / INDEX_META).read_text())
    for r in df.to_dict("records"):
        summary = json.loads((out / r["run_dir"] / "summary.json").read_text())["steps"]
        assert json.loads(r["summary"]) == summary
        for key, v in summary["step"].items():
            col = f"step/{key}"
            if isinstance(v, (dict, list)):
                assert col not in df.columns  # lists and mappings only in the long table
            elif col in df.columns:
                got = r[col]
                assert (v is None and (got is None or (isinstance(got, float) and math.isnan(got)))) or got == v, col
            else:  # dropped as constant: the one value is in index.json
                assert meta["constant"][col] == v, col
    # a dropped column is constant; a kept metric column is not
    for c in df.columns:
        if c.startswith("step/"):
            assert df[c].dropna().nunique() > 1 or df[c].notna().sum() < 2, c
    assert df.attrs["kinds"] == {"step": ["logit_lens", "direct_logit_attribution"]}


def _resolve(v, element: str, index):
    """The summary value a long-table row names: the outermost list takes ``index``; ``element``'s
    keys and ``[i]`` follow."""
    used = [index is None or pd.isna(index)]

    def at_list(x):
        if isinstance(x, list) and not used[0]:
            used[0] = True
            return x[int(index)]
        return x

    v = at_list(v)
    for part in re.findall(r"\[\d+\]|[^.\[\]]+", element):
        v = v[int(part[1:-1])] if part.startswith("[") else v[part]
        v = at_list(v)
    return v


def test_long_table_equals_the_point_summaries(sweep):
    out, _ = sweep
    df, long = load_results(out), load_metrics(out)
    assert list(long.columns[:3]) == ["point", "experiments[0].kind", "experiments[0].target"]
    for r in df.to_dict("records"):
        summary = json.loads(r["summary"])["step"]
        mine = long[long["point"] == r["point"]]
        assert set(mine["step"]) == {"step"} and set(mine["kind"]) == {r["experiments[0].kind"]}
        assert len(mine) == len(list(_flat(summary)))  # every scalar once
        for m in mine.itertuples():
            want = _resolve(summary[m.metric], m.element, m.index)
            if want is None:
                assert math.isnan(m.value) and pd.isna(m.text)
            elif isinstance(want, (bool, str)):
                assert m.text == str(want) and math.isnan(m.value)
            else:
                assert m.value == float(want) and pd.isna(m.text)
    # a list keeps its order as the index; a ranking's entries their rank and field
    hs = long[(long["point"] == 0) & (long["metric"] == "hidden_states")]
    assert hs["index"].tolist() == [0, 1, 2] and hs["value"].tolist() == [0.0, 1.0, 2.0]
    dla = df[df["experiments[0].kind"] == "direct_logit_attribution"]["point"].iloc[0]
    top = long[(long["point"] == dla) & (long["metric"] == "top_components_mean")]
    assert top["index"].min() == 0 and top["element"].ne("").all()


def test_load_point_and_run_dirs_work_from_another_directory(sweep, tmp_path, monkeypatch):
    out, outcome = sweep
    monkeypatch.chdir(tmp_path)
    df = load_results(out)
    for r in df.to_dict("records"):
        res = load_point(out, r["point"])
        assert res.config.kind == r["experiments[0].kind"]
        assert res.summary() == json.loads(r["summary"])["step"]
        assert res.summary() == type(res).load(f"{r['run_dir']}/step").summary()  # run_dir is absolute
    assert list(outcome.index["run_dir"]) == list(df["run_dir"])
    with pytest.raises(ResultLoadError, match="no point 99"):
        load_point(out, 99)
    with pytest.raises(ResultLoadError, match="no step 'nope'"):
        load_point(out, 0, step="nope")


def test_results_cli_shows_the_headline_metrics_and_takes_globs(sweep, capsys):
    from tracekit.cli import main

    out, _ = sweep
    assert main(["results", str(out)]) == 0
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head[:4] == ["point", "experiments[0].kind", "experiments[0].target", "status"]
    assert "step/mean_target_prob_final" in head and "step/mean_logit_diff" in head  # each kind's headline
    assert main(["results", str(out), "--columns", "point,step/mean_*"]) == 0
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head[0] == "point" and all(h.startswith("step/mean_") for h in head[1:]) and len(head) > 2
    assert main(["results", str(out), "--columns", "nosuch*"]) == 2
    assert "no column matches 'nosuch*'" in capsys.readouterr().err


def test_comparison_axes():
    assert axis_scale("lens/target_prob_by_hidden_state", [1e-5, 0.0, 0.5, float("nan")]) == "log"
    assert axis_scale("lens/target_prob_by_hidden_state", [0.2, 0.5]) == "linear"
    assert axis_scale("lens/target_rank_by_hidden_state", [1, 40000]) == "rank"
    assert axis_scale("step/mean_logit_diff", [-3.0, 1e-4, 2.0]) == "linear"
    with pytest.raises(ValueError, match="non-negative"):
        axis_scale("x", [-1.0, 2.0], "log")
    with pytest.raises(ValueError, match="scale"):
        axis_scale("x", [1.0], "logg")


def test_compare_figure_uses_log_and_rank_axes(sweep):
    out, _ = sweep
    fig = compare(out, "step/median_target_rank_by_hidden_state")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.yaxis_inverted()  # rank 1 on top
    assert len(ax.get_lines()) == 3  # one curve per lens point (DLA points have no such key)
    fig = compare(out, "step/mean_logit_diff", scale="linear")
    assert fig.axes[0].get_yscale() == "linear"


def _tables_equal(a, b):
    assert set(a.tables) == set(b.tables)
    for name in a.tables:
        pd.testing.assert_frame_equal(a.tables[name], b.tables[name], check_exact=True)
    assert a.summary() == b.summary()


@pytest.mark.parametrize("arch, extra", [
    ("gpt2", {"track": [" is"], "foil": " Rome"}),
    ("llama", {"position": "all", "layer_convention": "resid_post", "top_k": 3}),
])
def test_a_target_sweep_shares_one_pass_equal_to_separate_runs(arch, extra, tiny_gpt2, tiny_llama):
    model = tiny_gpt2 if arch == "gpt2" else tiny_llama
    steps = [LogitLens(prompts=PROMPTS, target=t, **extra) for t in TARGETS]
    steps.append(LogitLens(prompts=PROMPTS, target=[" Paris", " London"], **extra))  # one target per row
    with one_thread():
        alone = [s.run(model, progress=False) for s in steps]
        with shared_passes(steps) as sp:
            shared = [s.run(model, progress=False) for s in steps]
    assert sp.passes == 1
    for a, b in zip(alone, shared):
        _tables_equal(a, b)


def test_steps_that_differ_elsewhere_or_use_a_tuned_lens_do_not_share():
    a = LogitLens(prompts=PROMPTS, target=" Paris")
    sp = SharedPasses([a, LogitLens(prompts=PROMPTS, target=" London", top_k=3),
                       LogitLens(prompts=PROMPTS[:1], target=" London")])
    assert sp.siblings(a) == []
    b = LogitLens(prompts=PROMPTS, target=" Paris", layer_convention="resid_pre")
    assert SharedPasses([b, b.model_copy(update={"target": " London"})]).siblings(b) == []
    c = LogitLens(prompts=PROMPTS, target=" Paris", name="x")
    assert len(SharedPasses([a, c.model_copy(update={"target": " London"})]).siblings(a)) == 2


def test_ray_units_keep_the_points_sharing_a_pass_together():
    """The Ray executor hands an actor every point of a one-pass group at once (so the pass is shared
    there too); the other points go alone."""
    from tracekit.sweep.executors import _Scheduler, _units

    points, _ = expand_sweep(copy.deepcopy(SWEEP))
    units = _units(points)
    lens = sorted(p.index for p in points if p.config.experiments[0].kind == "logit_lens")
    assert sorted(len(u) for u in units) == [1, 1, 1, 3]
    assert [sorted(p.index for p in u) for u in units if len(u) == 3] == [lens]
    sched = _Scheduler(points, 2)
    got = [sched.next_unit(a % 2) for a in range(5)]
    assert got[-1] is None and sorted(p.index for u in got if u for p in u) == sorted(p.index for p in points)


def test_sweep_groups_the_target_points_and_matches_a_sweep_without_grouping(sweep, tmp_path):
    out, outcome = sweep
    assert outcome.shared_passes == 1  # 3 lens targets, one pass
    df = load_results(out)
    lens = df[df["experiments[0].kind"] == "logit_lens"]
    with one_thread():
        for r in lens.to_dict("records"):
            point = expand_sweep(copy.deepcopy(SWEEP))[0][r["point"]]
            alone = point.config.experiments[0].run(_model_for(point), progress=False)
            saved = alone.save(tmp_path / f"p{r['point']}", figures=False)
            _tables_equal(type(alone).load(saved), load_point(out, r["point"]))
    # per-point figures are off by default in a sweep; the comparison figure is written
    run_dir = df["run_dir"].iloc[0]
    assert not list(Path(run_dir).glob("step/*.png"))
    assert (out / "compare-step_mean_target_prob_by_hidden_state.png").stat().st_size > 0


_MODELS: dict = {}


def _model_for(point):
    from tracekit.model.load import load_model

    key = point.model_key
    if key not in _MODELS:
        _MODELS[key] = load_model(point.config.model)
    return _MODELS[key]


def test_sweep_figures_flag(tmp_path):
    from tracekit.errors import ConfigError

    bad = copy.deepcopy(SWEEP)
    bad["sweep"]["figures"] = "yes"
    with pytest.raises(ConfigError, match="sweep.figures"):
        run_sweep(bad, tmp_path / "bad", progress=False, log=quiet)
    cfg = copy.deepcopy(SWEEP)
    cfg["sweep"] = {"grid": {"experiments[0].target": TARGETS[:1]}, "figures": True}
    with one_thread():
        outcome = run_sweep(cfg, tmp_path / "figs", progress=False, log=quiet)
    assert outcome.exit_code == 0
    assert list(Path(outcome.index["run_dir"].iloc[0]).glob("step/*.png"))
    assert np.isfinite(outcome.index["seconds"]).all()


def test_a_run_folder_deleted_after_the_sweep_is_reported_missing(tmp_path, capsys):
    """The index on disk says ``complete``; the run folder of point 0 is deleted, the step folder of
    point 1 too: both read as ``missing`` (no metric reported from a result that is not on disk),
    ``load_point`` says so, and rerunning the sweep redoes them."""
    import shutil

    from tracekit.cli import main

    cfg = {**copy.deepcopy(SWEEP), "sweep": {"grid": {"experiments[0].target": TARGETS}}}
    out = tmp_path / "out"
    with one_thread():
        assert run_sweep(copy.deepcopy(cfg), out, progress=False, log=quiet).exit_code == 0
    before = load_results(out)
    assert (before["status"] == "complete").all()
    gone_run, gone_step = Path(before.loc[0, "run_dir"]), Path(before.loc[1, "run_dir"]) / "step"
    shutil.rmtree(gone_run)
    shutil.rmtree(gone_step)
    df = load_results(out)
    assert df["status"].tolist() == ["missing", "missing", "complete"]
    for i, gone in ((0, gone_run), (1, gone_step)):
        assert str(gone) in df.loc[i, "error"] and "rerun" in df.loc[i, "error"]
        assert pd.isna(df.loc[i, "summary"])
        assert all(pd.isna(df.loc[i, c]) for c in df.columns if c.startswith("step/"))
        with pytest.raises(ResultLoadError, match="missing"):
            load_point(out, i)
    kept = [c for c in before.columns if c.startswith("step/")]
    assert kept and df.loc[2, kept].tolist() == before.loc[2, kept].tolist()
    assert load_point(out, 2).summary() == json.loads(df.loc[2, "summary"])["step"]
    assert main(["results", str(out), "--columns", "point,status"]) == 0
    assert capsys.readouterr().out.split().count("missing") == 2
    with one_thread():
        again = run_sweep(copy.deepcopy(cfg), out, progress=False, log=quiet)
    assert sorted(again.ran) == [0, 1] and again.skipped == [2]
    assert (load_results(out)["status"] == "complete").all()
