"""Faults found by a breaker (issue: stale answers): results computed from a data file are keyed by
what the file holds, not its path, and every run records each input file's sha256. A real edited
file between two runs: a resumed sweep reruns its points; the SAE cache trains a new SAE."""

from __future__ import annotations

import json

import pandas as pd

from helpers import GPT2_BPE, TINY_SAE_TRAIN, tiny_overrides
from tracekit.inputs import content_hash, input_files
from tracekit.sweep import run_sweep

MODEL = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2", 2),
         "device": "cpu"}


def quiet(*a, **k):
    pass


def _pairs(path, corrupted):
    path.write_text("\n".join(json.dumps({"clean": "The capital of France is", "corrupted": c, "target": " Paris",
                                          "foil": " Rome"}) for c in corrupted) + "\n")


def test_a_resumed_sweep_reruns_points_whose_pairs_file_changed(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    _pairs(pairs, ["The capital of Italy is"])
    cfg = {"model": MODEL, "seed": 0,
           "experiments": [{"kind": "activation_patching", "name": "patch", "pairs_file": str(pairs),
                            "sites": ["resid_pre"], "layers": [0]}],
           "sweep": {"grid": {"experiments[0].directions": [["denoising"], ["noising"]]}}}
    out = tmp_path / "sweep"
    first = run_sweep(cfg, out, progress=False, log=quiet)
    assert sorted(first.ran) == [0, 1] and first.exit_code == 0
    again = run_sweep(cfg, out, progress=False, log=quiet)
    assert sorted(again.skipped) == [0, 1] and not again.ran  # unchanged file: resumed, nothing redone
    _pairs(pairs, ["The capital of Spain is", "The capital of Japan is"])  # edited in place, same path
    third = run_sweep(cfg, out, progress=False, log=quiet)
    assert sorted(third.ran) == [0, 1], "an edited pairs_file must not reuse the old pairs' results"
    for run_dir in third.index["run_dir"]:
        d = out / run_dir
        env = json.loads((d / "environment.json").read_text())
        rec = env["inputs"]["experiments[0].pairs_file"]  # the run's own record reproduces its inputs
        assert rec["sha256"] == content_hash(pairs) and rec["path"] == str(pairs.resolve())
        base = pd.read_parquet(d / "patch" / "baselines.parquet")
        assert base["pair"].nunique() == 2  # the new pairs (the old file had one)


def test_an_edited_corpus_trains_a_new_sae(tiny_gpt2, tmp_path):
    from tracekit.sae import SAETrainSpec, train_sae

    corpus = tmp_path / "corpus.txt"
    text = " ".join(f"The number {i} is followed by {i + 1}." for i in range(400))
    corpus.write_text(text)
    spec = SAETrainSpec(**{**TINY_SAE_TRAIN, "corpus": str(corpus)})
    d1, hit1, _ = train_sae(tiny_gpt2, spec, cache_dir=tmp_path / "saes")
    d2, hit2, _ = train_sae(tiny_gpt2, spec, cache_dir=tmp_path / "saes")
    assert not hit1 and hit2 and d1 == d2
    corpus.write_text(text.replace("followed", "preceded"))  # same path, new contents
    d3, hit3, _ = train_sae(tiny_gpt2, spec, cache_dir=tmp_path / "saes")
    assert not hit3 and d3 != d1, "an SAE trained on the old corpus must not be a cache hit"


def test_input_files_finds_every_file_field(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text("x")
    d = tmp_path / "docs"
    d.mkdir()
    (d / "one.txt").write_text("hello")
    raw = {"experiments": [{"pairs_file": str(f)}, {"contexts": {"corpus": [str(d), "stdlib"]}},
                           {"sae": {"path": {"from": "train", "path": "sae"}}}, {"corpus": "stdlib"}]}
    got = input_files(raw)
    assert set(got) == {"experiments[0].pairs_file", "experiments[1].contexts.corpus[0]"}
    before = got["experiments[1].contexts.corpus[0]"]["sha256"]
    (d / "one.txt").write_text("hello!")
    assert input_files(raw)["experiments[1].contexts.corpus[0]"]["sha256"] != before
