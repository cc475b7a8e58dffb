"""Sweeps (tracekit.sweep) on tiny random models: expansion, index, failures, resume after a real
kill of a real ``tracekit sweep`` process, no state shared between points, Ray == local.

Every run here is single-threaded (``torch.set_num_threads(1)`` / ``OMP_NUM_THREADS=1``, as Ray's
one-CPU actors are), so two runs of one sweep give bit-identical numbers whichever executor ran them.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers import GPT2_BPE, one_thread, quiet, start_child, tiny_overrides
from tracekit.errors import ConfigError, ResultLoadError
from tracekit.experiments.base import Result
from tracekit.sweep import (
    derive_seed,
    expand_sweep,
    load_metrics,
    load_results,
    run_sweep,
    stable_columns,
)

ROOT = Path(__file__).resolve().parents[2]


def tiny(arch):
    return {"name": arch, "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides(arch, 2),
            "device": "cpu"}


#: 2 models x 2 kinds x 2 targets = 8 points; the 4 points with target " Paris is" (two tokens) fail.
SWEEP = {
    "model": tiny("gpt2"),
    "seed": 3,
    "experiments": [{"kind": "logit_lens", "name": "step", "prompts": ["The capital of France is"],
                     "target": " Paris"}],
    "sweep": {
        "zip": {"model.name": ["gpt2", "llama"],
                "model.config_overrides": [tiny_overrides("gpt2", 2), tiny_overrides("llama", 2)]},
        "grid": {"experiments[0].kind": ["logit_lens", "direct_logit_attribution"],
                 "experiments[0].target": [" Paris", " Paris is"]},
        "compare": ["step/target_prob_by_hidden_state"],
    },
}
N_POINTS, N_FAILING = 8, 4


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "local"
    with one_thread():
        outcome = run_sweep(SWEEP, out, progress=False, log=quiet)
    return out, outcome


def test_expansion_grid_zip_names_and_seeds():
    points, _ = expand_sweep(SWEEP)
    assert len(points) == N_POINTS
    # grid paths in order (the first varies slowest), then the zip axis
    assert [p.params["model.name"] for p in points[:4]] == ["gpt2", "llama"] * 2
    assert {(p.config.model.name, p.config.model.config_overrides["n_layer" if p.config.model.name == "gpt2"
             else "num_hidden_layers"]) for p in points} == {("gpt2", 2), ("llama", 2)}
    assert points[2].config.experiments[0].target == " Paris is"
    assert [p.config.experiments[0].kind for p in points[3:5]] == ["logit_lens", "direct_logit_attribution"]
    # seeds derive from the sweep seed and the parameters: recorded, stable, distinct
    assert [p.seed for p in points] == [p.config.seed for p in points]
    assert points[0].seed == derive_seed(3, points[0].params) == expand_sweep(SWEEP)[0][0].seed
    assert len({p.seed for p in points}) == N_POINTS
    assert len({p.hash for p in points}) == N_POINTS
    named = copy.deepcopy(SWEEP)
    named["sweep"]["grid"]["experiments[0].prompts"] = {"capitals": ["The capital of France is"],
                                                        "rivers": ["The river in Paris is"]}
    pts, _ = expand_sweep(named)
    assert len(pts) == 2 * N_POINTS
    assert pts[0].names["experiments[0].prompts"] == "capitals"
    assert pts[2].config.experiments[0].prompts == ["The river in Paris is"]
    swept_seed = copy.deepcopy(SWEEP)
    swept_seed["sweep"]["grid"]["seed"] = [5, 6]
    assert {p.seed for p in expand_sweep(swept_seed)[0]} == {5, 6}


@pytest.mark.parametrize("edit, words", [
    (lambda s: s["sweep"]["zip"].update({"model.device": ["cpu"]}), ["same length"]),
    (lambda s: s["sweep"].update({"grd": {}}), ["unknown key", "grd"]),
    (lambda s: s["sweep"]["grid"].update({"experiments[3].target": [" a"]}), ["experiments[3].target",
                                                                             "does not exist"]),
    (lambda s: s["sweep"]["grid"].update({"experiments[0].top_kk": [1, 2]}), ["16 sweep point(s) are invalid",
                                                                             "experiments[0].top_kk"]),
    (lambda s: s["sweep"]["grid"].update({"experiments[0].batch_size": []}), ["non-empty list"]),
    (lambda s: s["sweep"]["grid"].update({"model.name": ["gpt2"]}), ["sweep.grid['model.name']",
                                                                     "sweep.zip['model.name']", "each field once"]),
    (lambda s: s["sweep"]["grid"].update({"experiments[0].batch_size": [4, 4]}), ["are the same config"]),
    (lambda s: s.pop("sweep"), ["sweep: must be a mapping"]),
])
def test_expansion_errors(edit, words):
    bad = copy.deepcopy(SWEEP)
    edit(bad)
    with pytest.raises(ConfigError) as e:
        expand_sweep(bad)
    for w in words:
        assert w in str(e.value), str(e.value)


STEER = {"kind": "steering", "name": "steer", "prompts": ["The capital of France is"], "target": " Paris",
         "layer": 0, "vector": {"source": "probe", "path": "probe", "layer": 0, "class": 0}}


@pytest.mark.parametrize("first, second", [
    ("experiments[0].target", "experiments.0.target"),          # dotted vs bracketed index
    ("experiments[0].target", "experiments[0]['target']"),      # quoted key
    ("experiments[0].target", "experiments[-1].target"),        # negative index, one step
    ("experiments[0]", "experiments[0].target"),                # a step and its field
    ("model", "model.name"),                                    # a mapping and a field inside
])
@pytest.mark.parametrize("where", ["grid", "zip"])
def test_one_field_swept_by_two_paths_is_refused_naming_both(first, second, where):
    """Two paths that set the same config field are refused at validation, naming both: before,
    the point's config took whichever was set last and the index showed the other."""
    cfg = copy.deepcopy(SWEEP)
    base = cfg["experiments"][0]
    # one value for the first path, two distinct ones for the second: every point differs, so
    # nothing else refused the sweep, and the first path's value was silently lost
    one = {"experiments[0]": [dict(base, target=" Rome")], "model": [tiny("gpt2")]}.get(first, [" Paris"])
    two = {"model.name": ["gpt2", "llama"]}.get(second, [" London", " Oslo"])
    cfg["sweep"] = {"grid": {first: one, second: two}} if where == "grid" else {"grid": {first: one},
                                                                                 "zip": {second: two}}
    with pytest.raises(ConfigError) as e:
        expand_sweep(cfg)
    msg = str(e.value)
    assert f"[{first!r}]" in msg and f"[{second!r}]" in msg and "each field once" in msg, msg


def test_swept_paths_are_compared_as_the_field_they_set():
    """:func:`canonical_path`: spellings, negative indices and aliases (YAML ``class`` is the field
    ``class_`` of a probe vector) give the field's one spelling."""
    from tracekit.sweep.expand import canonical_path

    base = {"experiments": [STEER, copy.deepcopy(SWEEP["experiments"][0])], "model": tiny("gpt2")}
    want = ("experiments", 0, "vector", "class_")
    for p in ("experiments[0].vector.class", "experiments.0.vector['class']", "experiments[-2].vector.class_"):
        assert canonical_path(p, base) == want, p
    assert canonical_path("experiments[-1].target", base) == ("experiments", 1, "target")
    assert canonical_path("model.config_overrides.n_layer", base) == ("model", "config_overrides", "n_layer")
    cfg = {**copy.deepcopy(SWEEP), "experiments": [copy.deepcopy(STEER)],
           "sweep": {"grid": {"experiments[0].vector.class": [0], "experiments.0.vector['class']": [1, 2]}}}
    with pytest.raises(ConfigError, match="each field once"):
        expand_sweep(cfg)


def test_tracekit_run_refuses_a_sweep_config(tmp_path):
    from tracekit.config import parse_config

    with pytest.raises(ConfigError, match="tracekit sweep CONFIG"):
        parse_config(copy.deepcopy(SWEEP))


def test_index_records_every_point_and_failures_do_not_stop_the_sweep(local_sweep):
    out, outcome = local_sweep
    df, long = load_results(out), load_metrics(out)
    assert len(df) == N_POINTS and df["point"].tolist() == list(range(N_POINTS))
    failed = df[df["status"] == "failed"]
    assert len(failed) == N_FAILING and (failed["experiments[0].target"] == " Paris is").all()
    assert failed["error"].str.contains("TokenizationError").all()
    assert sorted(outcome.failed) == failed["point"].tolist() and outcome.exit_code == 1
    ok = df[df["status"] == "complete"]
    assert len(ok) == N_POINTS - N_FAILING
    for _, r in ok.iterrows():
        run_dir = out / r["run_dir"]
        summary = json.loads((run_dir / "summary.json").read_text())["steps"]
        assert json.loads(r["summary"]) == summary
        assert run_dir.parent.name == r["config_hash"]
        assert yaml.safe_load((run_dir / "config.resolved.yaml").read_text())["seed"] == r["seed"]
        if r["experiments[0].kind"] == "logit_lens":
            assert r["step/target_prob_final"] == summary["step"]["target_prob_final"]
            curve = long[(long["point"] == r["point"]) & (long["metric"] == "target_prob_by_hidden_state")]
            assert curve.sort_values("index")["value"].tolist() == summary["step"]["target_prob_by_hidden_state"]
        else:
            assert r["step/mean_logit_diff"] == summary["step"]["mean_logit_diff"]
        assert r["seconds"] > 0
    # one torch and device in every point: constant columns, kept once in index.json
    assert df.attrs["constant"]["env/device"] == "cpu" and df.attrs["constant"]["env/torch"]
    assert (out / "compare-step_target_prob_by_hidden_state.png").stat().st_size > 0


def test_rerun_skips_complete_points_and_retries_failed_ones(local_sweep, tmp_path):
    out, first = local_sweep
    before = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/p[0-9]*")}
    with one_thread():
        again = run_sweep(SWEEP, out, progress=False, log=quiet)
    assert sorted(again.skipped) == sorted(set(range(N_POINTS)) - set(first.failed))
    assert sorted(again.ran) == sorted(first.failed) and again.exit_code == 1
    after = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/p[0-9]*")}
    done = {k: v for k, v in before.items() if k in after}
    assert len(done) >= N_POINTS - N_FAILING and all(after[k] == v for k, v in done.items())
    pd.testing.assert_frame_equal(stable_columns(first.index), stable_columns(again.index))


def test_results_cli_prints_index_and_draws_comparison(local_sweep, tmp_path, capsys):
    from tracekit.cli import main

    out, _ = local_sweep
    fig = tmp_path / "cmp.png"
    assert main(["results", str(out), "--plot", "target_prob_by_hidden_state", "--by", "model.name", "--output",
                 str(fig)]) == 0
    text = capsys.readouterr().out
    assert "failed" in text and "complete" in text and fig.stat().st_size > 0
    assert main(["results", str(out), "--plot", "nosuch"]) == 2
    assert "no point has the summary metric 'nosuch'" in capsys.readouterr().err
    with pytest.raises(ResultLoadError):
        load_results(tmp_path)


def test_points_sharing_a_model_do_not_leak_state(tmp_path):
    """One model runs a lens point first, then patching (hooks, caches) and DLA, then the same lens
    point again: the tables of the first and the last are identical."""
    prompt = "The capital of France is"
    lens = {"kind": "logit_lens", "prompts": [prompt], "target": " Paris", "position": "all"}
    patch = {"kind": "activation_patching", "pairs": [{"clean": prompt, "corrupted": "The capital of Italy is",
                                                       "target": " Paris", "foil": " Rome"}],
             "sites": ["resid_pre", "head_out"], "directions": ["denoising", "noising"], "ablations": ["zero"]}
    dla = {"kind": "direct_logit_attribution", "prompts": [prompt], "target": " Paris"}
    cfg = {"model": tiny("gpt2"), "seed": 0, "experiments": [lens],
           "sweep": {"zip": {"experiments": {"first": [{**lens, "name": "first"}],
                                             "middle": [patch, dla],
                                             "last": [{**lens, "name": "last"}]}}}}
    with one_thread():
        outcome = run_sweep(cfg, tmp_path, progress=False, log=quiet)
    assert outcome.exit_code == 0
    df = outcome.index
    first = Result.load(tmp_path / df.loc[0, "run_dir"] / "first")
    last = Result.load(tmp_path / df.loc[2, "run_dir"] / "last")
    assert df.loc[0, "started"] <= df.loc[2, "started"] and set(first.tables) == set(last.tables)
    for name in first.tables:
        pd.testing.assert_frame_equal(first.tables[name], last.tables[name], check_exact=True)


def _cli(config: Path, out: Path, *extra) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return start_child([sys.executable, "-m", "tracekit.cli", "sweep", str(config), "--out", str(out),
                        "--no-progress", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)


def _records(out: Path) -> dict:
    recs = {}
    for f in (out / "runs").glob("*/point.json"):
        try:
            r = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        recs[r["point"]] = r
    return recs


def _wait_for(proc, out: Path, n_done: int, timeout: float = 240) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        recs = {k: r for k, r in _records(out).items() if r["status"] in ("complete", "failed")}
        if len(recs) >= n_done:
            return recs
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended before {n_done} points: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("timed out waiting for the sweep")


@pytest.mark.slow
def test_killed_sweep_resumes_without_redoing_finished_points(local_sweep, tmp_path):
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    out = tmp_path / "out"
    # 1) Ctrl-C after 3 points: exit 130, the index says which points are done
    proc = _cli(cfg, out)
    _wait_for(proc, out, 3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    idx = load_results(out)
    finished = {r.point: r.run_dir for r in idx.itertuples() if r.status in ("complete", "failed")}
    assert 3 <= len(finished) < N_POINTS and (idx["status"] == "pending").any()
    # 2) SIGKILL a few points later (no handler runs)
    proc = _cli(cfg, out)
    recs = _wait_for(proc, out, min(len(finished) + 1, N_POINTS - 1))
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    done_before = {k: r for k, r in _records(out).items() if r["status"] == "complete"}
    assert len(recs) > len(finished)
    # 3) continue to the end: finished points are not redone, the index equals an uninterrupted run's
    proc = _cli(cfg, out)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err  # the failing points
    assert f"{N_FAILING} point(s) failed" in err
    final = load_results(out)
    for k, r in done_before.items():
        assert final.loc[k, "run_dir"] == str(out / r["run_dir"]) and final.loc[k, "started"] == r["started"]
    for h in final["config_hash"]:
        assert len([p for p in (out / "runs" / h).iterdir() if p.is_dir()]) <= 1  # partial runs were removed
    _, uninterrupted = local_sweep
    pd.testing.assert_frame_equal(stable_columns(final), stable_columns(uninterrupted.index))


@pytest.mark.slow
def test_ray_executor_gives_the_local_index(local_sweep, tmp_path):
    pytest.importorskip("ray")
    _, local = local_sweep
    outcome = run_sweep(SWEEP, tmp_path / "ray", executor="ray", workers=2, progress=False, log=quiet)
    assert outcome.exit_code == 1 and sorted(outcome.failed) == sorted(local.failed)
    assert outcome.shared_passes == local.shared_passes  # target points share their lens pass on Ray too
    pd.testing.assert_frame_equal(stable_columns(outcome.index), stable_columns(local.index))


def test_shipped_sweep_config_expands():
    points, _ = expand_sweep(ROOT / "experiments" / "paris_sweep.yaml")
    assert len(points) == 6 and len({p.model_key for p in points}) == 1
    assert {p.names["experiments[0].prompts"] for p in points} == {"bare", "example"}
