"""``tracekit export``: a trained SAE as a SAELens directory with a hub model id (SAELens loads it and
encodes identically), a run's tables as CSV / Parquet, and SAE features as SAEDashboard's
Neuronpedia batch JSON; bad arguments give exit code 2 and a message naming the argument."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_sae import PROMPT, make_sae_dir

from tracekit import Result, SAEFeatures
from tracekit.export import add_commands, export_tables, main
from tracekit.model.spec import EMBEDDED_HUB_NAME
from tracekit.sae import SAETrainSpec, train_sae
from tracekit.sae.export import export_sae, hub_model_id

HOOK = "blocks.1.hook_resid_pre"
#: The record every export writes into its folder (tracekit.core.exportdir.MARKER, docs/sae.md).
MARKER = ".tracekit-export.json"
#: values in the batch JSON are rounded to 3 decimals, as SAEDashboard writes them: at most 5e-4 off
#: (plus float rounding of the half-way case)
R3 = 5e-4 + 1e-9

#: SAEDashboard's NeuronpediaDashboardFeature.to_dict keys (jbloomAus/SAEDashboard,
#: sae_dashboard/neuronpedia/neuronpedia_dashboard.py), written out here independently of tracekit.
FEATURE_KEYS = {
    "feature_index", "neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1",
    "correlated_neurons_indices", "correlated_neurons_l1", "correlated_neurons_pearson", "correlated_features_indices",
    "correlated_features_l1", "correlated_features_pearson", "neg_str", "neg_values", "pos_str", "pos_values",
    "frac_nonzero", "freq_hist_data_bar_values", "freq_hist_data_bar_heights", "logits_hist_data_bar_heights",
    "logits_hist_data_bar_values", "n_prompts_total", "n_tokens_in_prompt", "dataset", "decoder_weights_dist",
    "activations"}


def cli(argv: list[str]) -> int:
    """``tracekit export ...`` through this module's own parser (as tracekit.cli wires it)."""
    p = argparse.ArgumentParser(prog="tracekit")
    add_commands(p.add_subparsers(dest="cmd", required=True))
    return main(p.parse_args(argv))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_gpt2):
    """A real tracekit training (SAELens' runner) in a private cache: ``(cache_dir, path, key)``."""
    cache = tmp_path_factory.mktemp("cache") / "saes"
    t = SAETrainSpec(hook=HOOK, d_sae=32, k=4, training_tokens=1024, eval_tokens=128, context_size=32,
                     train_batch_size_tokens=128)
    path, hit, stats = train_sae(tiny_gpt2, t, cache_dir=cache)
    assert not hit
    return cache, path, stats["key"]


def _encode_same(a_dir, b_dir) -> None:
    from sae_lens import SAE

    a = SAE.load_from_disk(str(a_dir), device="cpu")
    b = SAE.load_from_disk(str(b_dir), device="cpu")
    x = torch.randn(16, int(a.cfg.d_in), generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        assert torch.allclose(a.encode(x), b.encode(x), atol=1e-6, rtol=0)
        assert torch.allclose(a.decode(a.encode(x)), b.decode(b.encode(x)), atol=1e-6, rtol=0)
    assert int((a.encode(x) != 0).sum()) > 0  # the check compares something


def test_export_trained_sae_by_hash_round_trip(trained, tmp_path, capsys):
    cache, path, key = trained
    out = tmp_path / "exported"
    rc = main_with_cache(cache, ["export", "sae", key[:8], "--to", str(out)])
    assert rc == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "cfg.json", "sae_weights.safetensors",
                                                     "sparsity.safetensors"]
    cfg = json.loads((out / "cfg.json").read_text())
    # tiny_gpt2 is a random-init "gpt2": its hub id is "gpt2"; tracekit's training hash recorded
    assert cfg["metadata"]["model_name"] == "gpt2" and cfg["metadata"]["tracekit_training_hash"] == key
    assert (out / "sae_weights.safetensors").read_bytes() == (path / "sae_weights.safetensors").read_bytes()
    _encode_same(path, out)
    # --model-name wins; a non-empty DIR is refused without --force, replaced with it
    assert main_with_cache(cache, ["export", "sae", str(path), "--to", str(out), "--model-name", "org/m"]) == 2
    assert "--to" in capsys.readouterr().err
    assert main_with_cache(cache, ["export", "sae", str(path), "--to", str(out), "--model-name", "org/m",
                                   "--force"]) == 0
    assert json.loads((out / "cfg.json").read_text())["metadata"]["model_name"] == "org/m"
    _encode_same(path, out)


def main_with_cache(cache, argv: list[str]) -> int:
    """:func:`cli` with the trained SAEs' cache at ``cache`` (TRACEKIT_CACHE_DIR's ``saes``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACEKIT_CACHE_DIR", str(cache.parent))
        return cli(argv)


def test_export_maps_the_embedded_model_to_its_hub_id(tmp_path, tiny_gpt2):
    src = make_sae_dir(tmp_path, tiny_gpt2, HOOK, model_name="smollm2-135m")
    out = export_sae(src, tmp_path / "out")
    md = json.loads((out / "cfg.json").read_text())["metadata"]
    assert md["model_name"] == EMBEDDED_HUB_NAME and md["tracekit_model"] == "smollm2-135m"
    _encode_same(src, out)
    assert hub_model_id("gpt2") == "gpt2" and hub_model_id("org/name") == "org/name"
    assert hub_model_id("/models/x.gguf") is None and hub_model_id(str(tmp_path)) is None


def test_export_sae_errors_name_the_argument(tmp_path, tiny_gpt2, capsys):
    assert cli(["export", "sae", "deadbeef", "--to", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "SOURCE" in err and "tracekit cache list" in err
    (tmp_path / "empty").mkdir()
    assert cli(["export", "sae", str(tmp_path / "empty"), "--to", str(tmp_path / "o")]) == 2
    assert "sae_weights.safetensors" in capsys.readouterr().err
    local = make_sae_dir(tmp_path, tiny_gpt2, HOOK, model_name=str(tmp_path))  # a model from a local folder
    assert cli(["export", "sae", str(local), "--to", str(tmp_path / "o")]) == 2
    assert "--model-name" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing half-written
    assert cli(["export", "sae", str(local), "--to", str(local)]) == 2  # onto itself (non-empty) refused
    assert "--to" in capsys.readouterr().err


@pytest.fixture(scope="module")
def features_run(tmp_path_factory, tiny_gpt2):
    d = make_sae_dir(tmp_path_factory.mktemp("feat"), tiny_gpt2, "blocks.2.hook_resid_pre", arch="topk", d_sae=64)
    res = SAEFeatures(sae={"path": str(d)}, prompts=[PROMPT, "Paris is in"], target=" Paris", foil=" London", top_k=3,
                      dashboards={"features": 2, "max_tokens": 300, "seq_len": 32, "top_n": 3}).run(
                          tiny_gpt2, progress=False)
    run = tmp_path_factory.mktemp("run")
    res.save(run / "features")
    (run / "environment.json").write_text(json.dumps({"model": {"name": "gpt2"}}))
    return res, run


def test_export_tables_csv_and_parquet(features_run, tmp_path, capsys):
    res, run = features_run
    assert cli(["export", "tables", str(run / "features"), "--to", str(tmp_path / "csv")]) == 0
    back = Result.load(run / "features")
    assert sorted(p.stem for p in (tmp_path / "csv").glob("*.csv")) == sorted(back.tables)
    for name, df in back.tables.items():
        got = pd.read_csv(tmp_path / "csv" / f"{name}.csv", keep_default_na=False, na_values=[""])
        assert list(got.columns) == list(df.columns), name
        assert len(got) == len(df), name
        for c in df.columns:
            if df[c].dtype.kind in "fi":
                assert np.allclose(got[c].to_numpy(float), df[c].to_numpy(float), atol=1e-12, equal_nan=True), (name, c)
    # the run directory form: one folder per step; parquet equal to the saved tables
    files = export_tables(run, tmp_path / "pq", "parquet")
    assert {f.parent.name for f in files} == {"features"}
    for name, df in back.tables.items():
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "pq" / "features" / f"{name}.parquet"), df)
    assert cli(["export", "tables", str(tmp_path / "nothing"), "--to", str(tmp_path / "x")]) == 2
    assert "RUN_DIR" in capsys.readouterr().err


def test_export_features_neuronpedia_batch(features_run, tmp_path):
    res, run = features_run
    assert cli(["export", "features", str(run / "features"), "--to", str(tmp_path / "np")]) == 0
    batch = json.loads((tmp_path / "np" / "batch-0.json").read_text())
    assert set(batch) == {"model_id", "layer", "sae_set", "features"}
    assert batch["model_id"] == "gpt2" and batch["layer"] == 2 and batch["sae_set"] == "tracekit"
    feats = res.meta["dashboard_features"]
    assert [f["feature_index"] for f in batch["features"]] == feats
    ctx, vocab, dens = res.tables["contexts"], res.tables["vocab"], res.tables["density"]
    for f in batch["features"]:
        assert set(f) == FEATURE_KEYS
        i = f["feature_index"]
        v = vocab[vocab["feature"] == i]
        assert f["pos_str"] == v[v["side"] == "promoted"].sort_values("top_rank")["token"].tolist()
        assert f["neg_values"] == pytest.approx(v[v["side"] == "suppressed"].sort_values("top_rank")["logit"].tolist(),
                                                abs=R3)
        n_act = int((dens["feature"] == i).sum())
        assert f["frac_nonzero"] == pytest.approx(n_act / res.meta["dashboard_tokens"], abs=1e-12)
        assert sum(f["freq_hist_data_bar_heights"]) == n_act
        c = ctx[ctx["feature"] == i].sort_values("top_rank")
        assert [a["tokens"] for a in f["activations"]] == [json.loads(t) for t in c["tokens"]]
        for a, acts in zip(f["activations"], c["token_acts"]):
            assert set(a) == {"bin_min", "bin_max", "bin_contains", "tokens", "values"}
            assert a["bin_min"] == -1 and a["bin_contains"] == -1 and len(a["values"]) == len(a["tokens"])
            assert a["values"] == pytest.approx(json.loads(acts), abs=R3)
        assert f["n_tokens_in_prompt"] == 32 and f["n_prompts_total"] >= 1 and f["dataset"] == "stdlib"


def _tree(d):
    """Every file under ``d`` with its bytes."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_export_never_writes_into_over_or_around_its_source(features_run, trained, tmp_path, capsys):
    """Issue #33 item 11: `--to` equal to the source, inside it, or containing it (a run, the step's
    run, the SAE cache; through a symlink too) is refused even with --force, and the source is
    untouched (it used to be deleted)."""
    _, run0 = features_run
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    (tmp_path / "link").symlink_to(run)
    before = _tree(run)
    step = run / "features"
    cases = [(step, run, "contains the SOURCE"), (run, run, "is the SOURCE itself"), (step, step, "SOURCE itself"),
             (step, step / "sub", "is inside the SOURCE"), (run, tmp_path / "link", "SOURCE itself"),
             (step, tmp_path / "link", "contains the SOURCE"), (step, tmp_path, "contains the SOURCE")]
    for src, to, why in cases:
        for what in ("tables", "features"):
            assert cli(["export", what, str(src), "--to", str(to), "--force"]) == 2, (what, src, to)
            err = capsys.readouterr().err
            assert err.startswith("error: --to: ") and why in err, (what, src, to, err)
    assert _tree(run) == before and Result.load(step).tables
    # the trained SAEs' cache: its folder, the cache, the cache's parent
    cache0, path0, key = trained
    cache = tmp_path / "c" / "saes"
    shutil.copytree(cache0, cache)
    sae_before = _tree(cache)
    for to in (cache / path0.name, cache, cache.parent):
        assert main_with_cache(cache, ["export", "sae", key[:8], "--to", str(to), "--force"]) == 2, to
        assert "--to: " in capsys.readouterr().err
    assert _tree(cache) == sae_before


def test_export_force_replaces_only_an_earlier_export(features_run, tmp_path, capsys):
    """Issue #33 item 11: --force replaces a folder an earlier export wrote (its .tracekit-export.json
    lists its files), never another folder, nor an export folder holding files the export did not
    write."""
    _, run = features_run
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    assert cli(["export", "tables", str(run / "features"), "--to", str(mine), "--force"]) == 2
    assert MARKER in capsys.readouterr().err and (mine / "notes.txt").read_text() == "my notes"
    out = tmp_path / "out"
    assert cli(["export", "tables", str(run / "features"), "--to", str(out)]) == 0
    rec = json.loads((out / MARKER).read_text())
    assert rec["what"] == "tables" and set(rec["files"]) == set(_tree(out)) - {MARKER}
    assert cli(["export", "tables", str(run), "--to", str(out), "--force"]) == 0  # an earlier export: replaced
    assert (out / "features").is_dir() and not list(out.glob("*.csv"))
    (out / "features" / "keep.txt").write_text("mine")
    assert cli(["export", "tables", str(run / "features"), "--to", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "did not write" in err and "features/keep.txt" in err and (out / "features" / "keep.txt").is_file()


def test_export_write_failures_name_the_target_and_keep_it(features_run, tmp_path, capsys, monkeypatch):
    """Issue #33 item 15: an export under a regular file (ENOTDIR, EEXIST), into a read-only folder
    (EROFS) or one without permission (EACCES), or onto a full disk (ENOSPC) is exit code 2 with a
    message naming --to, the reason and the fix (not a traceback); an earlier export there is kept."""
    _, run = features_run
    step = str(run / "features")
    f = tmp_path / "file"
    f.write_text("x")
    for to, why in ((f / "out", "(EEXIST)"), (f / "out" / "deeper", "a part of the path is a file, not a folder")):
        for what in ("tables", "features"):
            assert cli(["export", what, step, "--to", str(to)]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"error: --to: cannot write {str(to)!r}") and why in err, err
    assert f.read_text() == "x"
    real_mkdir = Path.mkdir
    for code, why in ((errno.EROFS, "read-only (EROFS)"), (errno.EACCES, "permission is denied (EACCES)")):
        ro = tmp_path / f"ro-{code}"
        real_mkdir(ro)

        def refused(self, *a, _ro=ro, _code=code, **k):
            if self.parent == _ro:
                raise OSError(_code, os.strerror(_code), str(self))
            return real_mkdir(self, *a, **k)

        with monkeypatch.context() as m:
            m.setattr(Path, "mkdir", refused)
            assert cli(["export", "tables", step, "--to", str(ro / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --to: cannot write {str(ro / 'out')!r}") and why in err, err
        assert "choose a folder" in err and not list(ro.iterdir())
    out = tmp_path / "out"
    assert cli(["export", "tables", step, "--to", str(out)]) == 0
    kept = _tree(out)

    def full(self, path, *a, **k):
        Path(path).write_text("half a ta")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    with monkeypatch.context() as m:
        m.setattr(pd.DataFrame, "to_csv", full)
        assert cli(["export", "tables", step, "--to", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --to: cannot write {str(out)!r}") and "no space is left on the disk (ENOSPC)" in err
    assert "was left as it was" in err and _tree(out) == kept
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []
