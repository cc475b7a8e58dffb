"""The activation store (tracekit.activations): written -> read equals a direct extraction, a killed
write resumes to the same store, another model's store is refused, probing from a store equals
probing from the model. Tiny models (tests/helpers.py); several shards are forced with a small
``shard_mb`` so that shard boundaries, resumes and lazy reads are exercised."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from tracekit.activations import ActivationStore, StoreError, corpus_rows, prompt_rows, write_store
from tracekit.activations import write as store_write
from tracekit.core.io import file_sha256
from tracekit.experiments.activations import CacheActivations
from tracekit.experiments.probing import LinearProbe
from tracekit.probing import extract_activations
from tracekit.results import Result
from tracekit.tokens import TokenizationError, encode

PROMPTS = ["The capital of France is", "The capital city of Japan, as everyone knows, is", "In the capital",
           "A capital letter", "Our capital of Spain is nice", "The capital of Italy is", "Some capital here",
           "Money and capital"]
#: residual, MLP-internal, per-head (attn.hook_z: [n_heads, d_head] flattened) and a gated hook.
HOOKS = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.1.mlp.hook_post", "blocks.0.attn.hook_z",
         "blocks.1.hook_mlp_in"]
SMALL = 0.004  # MiB: a few examples per shard


def _write(model, path, position="last", prompts=PROMPTS, hooks=HOOKS, **kw):
    kw = {"batch_size": 3, "shard_mb": SMALL, **kw}
    return write_store(model, prompt_rows(model, prompts, position), hooks, path, position=str(position),
                       source={"kind": "prompts", "n": len(prompts)}, **kw)


@pytest.mark.parametrize("position", ["last", "all", "mean", "token: capital"])
def test_written_store_reads_back_the_direct_extraction(tiny_llama, tmp_path, position):
    # atol 0 and the same dtype: the store runs the same padded batches (batch_size 3) as probing's
    # extraction and keeps the model's float32; nothing but reading differs.
    info = _write(tiny_llama, tmp_path, position)
    store = ActivationStore(tmp_path)
    assert info["n_shards"] > 1 and store.manifest["complete"]
    with extract_activations(tiny_llama, PROMPTS, HOOKS, position, batch_size=3) as acts:
        assert np.array_equal(store.rows, acts.rows) and np.array_equal(store.positions, acts.positions)
        for h in HOOKS:
            got, want = store.get(h), acts.get(h)
            assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
            assert torch.equal(got, want), h
            parts = list(store.iter_batches(h, 5))  # lazy batches: at most 5 rows each, same values
            assert max(p.shape[0] for p in parts) <= 5 and torch.equal(torch.cat(parts), want)
    ids = [encode(tiny_llama, p) for p in PROMPTS]
    expect_tok = [-1 if p < 0 else ids[r][p] for r, p in zip(store.rows, store.positions)]
    assert store.token_ids.tolist() == expect_tok
    for s in store.manifest["shards"]:
        assert file_sha256(tmp_path / s["file"], memo=False) == s["sha256"]


def test_named_dataset_position_and_the_kind(tiny_gpt2, tmp_path):
    exp = CacheActivations.model_validate({"path": str(tmp_path / "st"), "dataset": {"generator": "capitals", "limit": 12},
                                           "position": "SUBJ", "sites": ["resid_post"], "layers": [0, -1],
                                           "batch_size": 4, "shard_mb": SMALL})
    inputs = exp.check(tiny_gpt2)
    res = exp.run(tiny_gpt2, progress=False)
    s = res.summary()
    assert s["hooks"] == ["blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.2.hook_resid_post"]
    assert s["n_examples"] == s["n_rows"] == len(inputs.rows) and s["shards_written"] == s["n_shards"] > 1
    data = inputs.data
    subj = [str(p) for p in data.position("SUBJ")]
    store = ActivationStore(tmp_path / "st")
    assert store.row_ids == [e.row_id for e in data.examples]
    with extract_activations(tiny_gpt2, data.prompts, s["hooks"], "SUBJ", batch_size=4, fields=subj) as acts:
        for h in s["hooks"]:
            assert torch.equal(store.get(h), acts.get(h))
    again = exp.run(tiny_gpt2, progress=False).summary()  # the same plan: up to date, no forward pass
    assert again["up_to_date"] and again["shards_written"] == 0
    assert len(res.tables["shards"]) == s["n_shards"] and res.report()
    back = Result.load(res.save(tmp_path / "result"))
    assert back.summary() == s and back.tables["hooks"].equals(res.tables["hooks"])


def test_corpus_rows_all_positions(tiny_gpt2, tmp_path):
    text = tmp_path / "c.txt"
    text.write_text("one two three four five six seven eight nine ten\n\nalpha beta gamma delta epsilon zeta eta")
    rows = list(corpus_rows(tiny_gpt2, str(text), seq_len=6, max_tokens=None, position="all"))
    assert all(r.read == tuple(range(1, len(r.ids))) for r in rows)  # BOS never read
    write_store(tiny_gpt2, iter(rows), ["blocks.1.hook_resid_post"], tmp_path / "st", position="all",
                source={"kind": "corpus"}, batch_size=2, shard_mb=SMALL)
    store = ActivationStore(tmp_path / "st")
    assert len(store) == sum(len(r.read) for r in rows) and store.row_ids == [r.row_id for r in rows]
    assert store.token_ids.tolist() == [r.ids[p] for r in rows for p in r.read]


def test_killed_write_resumes_to_the_same_store(tiny_gpt2, tmp_path, monkeypatch):
    prompts = PROMPTS * 2
    ref = _write(tiny_gpt2, tmp_path / "ref", "all", prompts, batch_size=2)
    n = ref["n_shards"]
    assert n >= 5
    real_write, real_read = store_write._write_shard, store_write._read_batch
    written: list[Path] = []

    def dies_after_three(path, tensors):
        if len(written) == 3:
            raise KeyboardInterrupt("killed")
        real_write(path, tensors)
        written.append(path)

    monkeypatch.setattr(store_write, "_write_shard", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        _write(tiny_gpt2, tmp_path / "s", "all", prompts, batch_size=2)
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert not man["complete"] and len(man["shards"]) == 3
    with pytest.raises(StoreError, match="store: the store at .* is unfinished .*rerun"):
        ActivationStore(tmp_path / "s")
    (tmp_path / "s" / man["shards"][2]["file"]).write_bytes(b"truncated")  # a damaged shard is written again
    monkeypatch.setattr(store_write, "_write_shard", real_write)
    batches = []
    monkeypatch.setattr(store_write, "_read_batch", lambda *a: batches.append(len(a[2])) or real_read(*a))
    out = _write(tiny_gpt2, tmp_path / "s", "all", prompts, batch_size=2)
    assert out["shards_reused"] == 2 and out["shards_written"] == n - 2
    assert sum(batches) == len(prompts) - man["shards"][1]["rows"][1]  # rows of reused shards are not run
    ref_files = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ref_files  # no temporary files left
    for f in ref_files:
        if f != "manifest.json":
            assert (tmp_path / "s" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("s", "ref"))
    assert a["complete"] and a == b
    assert _write(tiny_gpt2, tmp_path / "s", "all", prompts, batch_size=2)["up_to_date"]


def test_another_models_store_and_other_plans_are_refused(tiny_gpt2, tiny_llama, tmp_path):
    _write(tiny_gpt2, tmp_path / "g")
    store = ActivationStore(tmp_path / "g")
    store.check_model(tiny_gpt2)
    with pytest.raises(StoreError, match=r"store: the store at .* was made from another model .*fingerprint.*"
                                         r"write a store with this model"):
        store.check_model(tiny_llama)
    with pytest.raises(StoreError, match="path: .* holds another activation store .*overwrite: true"):
        _write(tiny_gpt2, tmp_path / "g", hooks=HOOKS[:2])
    with pytest.raises(StoreError, match="path: the complete store at .* is being read .*overwrite: true .*wait"):
        _write(tiny_gpt2, tmp_path / "g", hooks=HOOKS[:2], overwrite=True)  # `store` has it open
    assert store.get(HOOKS[0]).shape[0] == len(PROMPTS)  # and it still reads
    store.close()
    assert _write(tiny_gpt2, tmp_path / "g", hooks=HOOKS[:2], overwrite=True)["n_examples"] == len(PROMPTS)
    with pytest.raises(StoreError, match="no activation store at"):
        ActivationStore(tmp_path / "none")
    with pytest.raises(StoreError, match=r"has no \['blocks.1.mlp.hook_post'\]"):
        next(ActivationStore(tmp_path / "g").iter_batches("blocks.1.mlp.hook_post"))


PROBE = {"dataset": {"generator": "capitals", "label": "group", "group": "country", "drop_small_classes": True},
         "position": "SUBJ", "layers": [0, 1], "bootstrap": 20, "Cs": [1.0], "inner_folds": 2}


def test_probing_from_a_store_equals_probing_from_the_model(tiny_gpt2, tiny_llama, tmp_path):
    path = str(tmp_path / "st")
    CacheActivations.model_validate({"path": path, "dataset": {"generator": "capitals"}, "position": "SUBJ",
                                     "sites": ["resid_post"], "layers": [0, 1], "shard_mb": SMALL}
                                    ).run(tiny_gpt2, progress=False)
    direct = LinearProbe(**PROBE).run(tiny_gpt2, progress=False)
    stored = LinearProbe(**PROBE, store=path).run(tiny_gpt2, progress=False)
    assert stored.meta["activations_from"] == path
    # The probe keeps a subset of the stored rows (drop_small_classes) in other batches; the tiny
    # model's activations at a row's real tokens do not depend on the batch's padding here, so
    # every accuracy, prediction and weight is equal.
    for t in ("main", "predictions", "split"):
        pd.testing.assert_frame_equal(direct.tables[t], stored.tables[t])
    assert direct.arrays.keys() == stored.arrays.keys()
    for k in direct.arrays:
        assert torch.equal(direct.arrays[k], stored.arrays[k]), k
    with pytest.raises(StoreError, match="store: .* was made from another model"):
        LinearProbe(**PROBE, store=path).run(tiny_llama, progress=False)
    with pytest.raises(StoreError, match=r"store: .* has no \['blocks.2.hook_resid_post'\]"):
        LinearProbe(**{**PROBE, "layers": [0, 2]}, store=path).check(tiny_gpt2)
    with pytest.raises(StoreError, match="store: .* does not hold .* rows .* at these positions"):
        LinearProbe(**{**PROBE, "position": "last"}, store=path).check(tiny_gpt2)
    with pytest.raises(ValueError, match="give one of store and cache_dir"):
        LinearProbe(**PROBE, store=path, cache_dir=str(tmp_path / "c"))


def test_cli_refuses_a_config_without_activations_steps(tmp_path, capsys):
    import argparse

    from tracekit.activations_cli import add_commands, main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("experiments:\n  - kind: logit_lens\n    prompts: hi\n")
    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers(dest="cmd"))
    assert main(p.parse_args(["cache-activations", str(cfg)])) == 2
    assert "no step of kind 'activations'" in capsys.readouterr().err


def test_left_padding_reads_the_same_tokens(tmp_path):
    # Left padding shifts each row by its own pad count (Batch.offsets); the store must read the same
    # tokens as probing's extraction (atol 0, same batches).
    from helpers import make_tiny

    model = make_tiny("gpt2", padding_side="left")
    for position in ("last", "all"):
        _write(model, tmp_path / position, position, hooks=HOOKS[:2])
        store = ActivationStore(tmp_path / position)
        with extract_activations(model, PROMPTS, HOOKS[:2], position, batch_size=3) as acts:
            for h in HOOKS[:2]:
                assert torch.equal(store.get(h), acts.get(h))


def _kind(model, path, **kw):
    cfg = {"path": str(path), "hooks": HOOKS[:2], "shard_mb": SMALL, "batch_size": 3, **kw}
    return CacheActivations.model_validate(cfg).run(model, progress=False).summary()


def test_edited_inputs_are_another_plan_and_overwrite_writes_afresh(tiny_gpt2, tmp_path):
    """A complete store is "up to date" only for the same rows: an edited corpus file or other prompts
    (same count) are another plan, refused at the same path; overwrite: true always writes afresh."""
    text = tmp_path / "c.txt"
    text.write_text("\n\n".join(f"Paragraph {i} tells of the river and the old stone bridge." for i in range(20)))
    corpus = {"source": str(text), "seq_len": 16, "max_tokens": 200}
    first = _kind(tiny_gpt2, tmp_path / "st", corpus=corpus)
    assert _kind(tiny_gpt2, tmp_path / "st", corpus=corpus)["up_to_date"] is True
    before = ActivationStore(tmp_path / "st").token_ids
    text.write_text("\n\n".join(f"Chapter {i} speaks of a winter market by the harbour." for i in range(20)))
    with pytest.raises(StoreError, match="holds another activation store .*overwrite: true"):
        _kind(tiny_gpt2, tmp_path / "st", corpus=corpus)
    again = _kind(tiny_gpt2, tmp_path / "st", corpus=corpus, overwrite=True)
    assert again["up_to_date"] is False and again["shards_written"] == again["n_shards"] >= 1
    assert not np.array_equal(ActivationStore(tmp_path / "st").token_ids, before)
    # overwrite on an up-to-date store of the same plan writes it again too
    assert _kind(tiny_gpt2, tmp_path / "st", corpus=corpus, overwrite=True)["up_to_date"] is False
    assert first["n_shards"] >= 1
    # prompts: other prompts of the same count are another plan
    _kind(tiny_gpt2, tmp_path / "p", prompts=PROMPTS)
    with pytest.raises(StoreError, match="holds another activation store"):
        _kind(tiny_gpt2, tmp_path / "p", prompts=PROMPTS[::-1])


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_shards_are_refused_on_read_and_rewritten(tiny_gpt2, tmp_path, damage):
    _kind(tiny_gpt2, tmp_path / "st", prompts=PROMPTS, position="all")
    man = json.loads((tmp_path / "st" / "manifest.json").read_text())
    f = tmp_path / "st" / man["shards"][1]["file"]
    good = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(good[: len(good) // 2])
    elif damage == "flip":
        raw = bytearray(good)
        raw[-3] ^= 0x01  # one bit of the last activation
        f.write_bytes(bytes(raw))
    else:
        f.unlink()
    why = {"truncate": "bytes, not the", "flip": "does not match its recorded sha256", "delete": "is missing"}[damage]
    with pytest.raises(StoreError, match=f"store: shard {f.name} of the store at .* {why}.*rerun the step"):
        ActivationStore(tmp_path / "st")
    fixed = _kind(tiny_gpt2, tmp_path / "st", prompts=PROMPTS, position="all")  # the same step repairs it
    assert fixed["up_to_date"] is False and fixed["shards_reused"] == 1  # shard 0 kept; 1 on rewritten
    assert f.read_bytes() == good
    ActivationStore(tmp_path / "st")


def test_store_written_with_another_bos_setting_is_refused_naming_it(tmp_path):
    from helpers import make_tiny

    with_bos, without = make_tiny("gpt2"), make_tiny("gpt2", prepend_bos=False)
    _write(without, tmp_path / "st")
    with pytest.raises(StoreError, match="written with model.prepend_bos False .* set model.prepend_bos: false"):
        ActivationStore(tmp_path / "st").check_model(with_bos)


def test_validate_refuses_a_missing_store_before_loading_a_model(tmp_path, tiny_gpt2):
    """A step reading a store that is neither on disk nor written by an earlier activations step is
    refused by check_config (tracekit validate / run), before any model is loaded."""
    from tracekit.config import parse_config
    from tracekit.errors import ConfigError
    from tracekit.runner import check_config

    probe = {"kind": "linear_probe", **PROBE, "store": str(tmp_path / "st")}
    writes = {"kind": "activations", "path": str(tmp_path / "st"), "dataset": {"generator": "capitals"},
              "position": "SUBJ", "sites": ["resid_post"], "layers": [0, 1]}
    with pytest.raises(ConfigError, match=r"store: no activation store at .* no earlier `activations` step"):
        check_config(parse_config({"experiments": [probe]}), model=tiny_gpt2)
    check_config(parse_config({"experiments": [writes, probe]}), model=tiny_gpt2)  # written first: fine
    with pytest.raises(ConfigError, match="no activation store"):  # written after the reader: refused
        check_config(parse_config({"experiments": [probe, writes]}), model=tiny_gpt2)
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "manifest.json").write_text(json.dumps({"complete": False}))
    with pytest.raises(ConfigError, match="unfinished"):
        check_config(parse_config({"experiments": [probe]}), model=tiny_gpt2)
    lens = {"kind": "logit_lens", "prompts": ["The capital of France is"], "lens": "tuned",
            "tuned": {"store": str(tmp_path / "nope")}}
    with pytest.raises(ConfigError, match=r"tuned\.store: no activation store"):
        check_config(parse_config({"experiments": [lens]}), model=tiny_gpt2)


class _Flag(logging.Handler):
    """Sets an event when the logger logs (a writer saying it waits for another)."""

    def __init__(self, event: threading.Event):
        super().__init__()
        self.event, self.messages = event, []

    def emit(self, record):
        self.messages.append(record.getMessage())
        self.event.set()


def test_a_second_writer_never_disturbs_a_run_reading_the_complete_store(tiny_gpt2, tmp_path, monkeypatch):
    """Issue #33 item 12. Writer A is writing a store when writer B (another run: the same plan, its
    own model with the same weights) starts. B waits for A's lock; once A has finished and a run
    reads the complete store, B finds it up to date and touches nothing, so the run's next step
    (opening the store again) still reads the same store. (Without the lock B resumed the store
    alongside A and rewrote the manifest as unfinished under the reader.)"""
    from helpers import make_tiny

    other = make_tiny("gpt2")  # the same weights (seed 0): the same plan; its own hooks (two threads)
    prompts = PROMPTS * 2
    ref = _write(tiny_gpt2, tmp_path / "ref", "all", prompts, batch_size=2)
    assert ref["n_shards"] >= 5
    path = tmp_path / "st"
    real = store_write._write_shard
    calls = {"A": 0, "B": 0}
    a_paused, a_go = threading.Event(), threading.Event()
    b_stopped, b_go, b_stopped2, b_go2 = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def gated(p, tensors):
        who = threading.current_thread().name
        calls[who] += 1
        if who == "A" and calls["A"] == 2:  # A: one shard on disk, the second being written
            a_paused.set()
            assert a_go.wait(120)
        if who == "B" and calls["B"] == 2:
            b_stopped.set()
            assert b_go.wait(120)
        if who == "B" and calls["B"] == 3:
            b_stopped2.set()
            assert b_go2.wait(120)
        real(p, tensors)

    monkeypatch.setattr(store_write, "_write_shard", gated)
    waits = _Flag(b_stopped)  # B waiting for A's lock (the fix) stops B as well as B pausing in a write
    logging.getLogger("tracekit.activations").addHandler(waits)
    out, errors = {}, []

    def writer(name, model):
        try:
            out[name] = _write(model, path, "all", prompts, batch_size=2)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append((name, e))

    threads = {n: threading.Thread(target=writer, args=(n, m), name=n) for n, m in (("A", tiny_gpt2), ("B", other))}
    try:
        threads["A"].start()
        assert a_paused.wait(120)
        threads["B"].start()
        assert b_stopped.wait(120)  # B waits for A (fixed) or resumed alongside A (before)
        a_go.set()
        threads["A"].join(120)
        assert not errors and out["A"]["n_shards"] == ref["n_shards"]
        reader = ActivationStore(path)  # a run reading the complete store A wrote
        first = reader.get(HOOKS[1])
        b_go.set()
        while threads["B"].is_alive() and not b_stopped2.wait(0.05):
            pass
        # the run's next step opens the store again: still complete, the same data
        again = ActivationStore(path)
        assert torch.equal(again.get(HOOKS[1]), first) and torch.equal(reader.get(HOOKS[1]), first)
        b_go2.set()
        threads["B"].join(120)
    finally:
        for e in (a_go, b_go, b_go2):
            e.set()
        for t in threads.values():
            t.join(120)
        logging.getLogger("tracekit.activations").removeHandler(waits)
    assert not errors, errors
    assert out["B"]["up_to_date"] and out["B"]["shards_written"] == 0 and calls["B"] == 0
    assert any("is writing the activation store at" in m and f"pid {os.getpid()}" in m for m in waits.messages)
    for f in sorted(p.name for p in (tmp_path / "ref").glob("shard-*")):
        assert (path / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    # a reader opening a store while a writer rewrites it is told so (not "unfinished")
    from tracekit.core.locks import acquire, release

    assert acquire(path / ".read.lock") is None  # the open readers keep a rewrite out
    reader.close()
    again.close()
    held = acquire(path / ".read.lock")
    assert held is not None
    try:
        with pytest.raises(StoreError, match="store: the store at .* is being rewritten now .*wait for it"):
            ActivationStore(path)
    finally:
        release(held)


def _kind_spec(path, **kw):
    return {"path": str(path), "prompts": PROMPTS, "hooks": HOOKS[:2], "position": "all", "shard_mb": SMALL,
            "batch_size": 2, **kw}


@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_a_full_disk_while_a_store_is_written_names_the_store_and_keeps_what_is_done(tiny_gpt2, tmp_path, monkeypatch,
                                                                                       where):
    """Issue #33 item 15: ENOSPC while the activations kind writes a shard (safetensors reports it
    as a SafetensorError "... (os error 28)") or the manifest is an OutputError naming the store,
    the reason and the fix, not a traceback; the manifest lists only finished shards (the partial
    shard is gone) and a rerun resumes to the store an uninterrupted write gives."""
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    from tracekit.core.errors import OutputError

    CacheActivations.model_validate(_kind_spec(tmp_path / "ref")).run(tiny_gpt2, progress=False)
    calls = {"n": 0}
    if where == "shard":
        real_save = safetensors.torch.save_file

        def full_disk(tensors, filename, *a, **k):
            calls["n"] += 1
            if calls["n"] == 3:
                Path(filename).write_bytes(b"\0" * 100)  # what reached the disk before it filled up
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real_save(tensors, filename, *a, **k)

        monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    else:
        real_json = store_write.write_json

        def full_disk(p, obj):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(p))
            return real_json(p, obj)

        monkeypatch.setattr(store_write, "write_json", full_disk)
    exp = CacheActivations.model_validate(_kind_spec(tmp_path / "st"))
    with pytest.raises(OutputError) as e:
        exp.run(tiny_gpt2, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"path: cannot write {str(tmp_path / 'st')!r}") and "no space is left on the disk (ENOSPC)" in msg
    assert "free space" in msg and "rerun the same step" in msg
    man = json.loads((tmp_path / "st" / "manifest.json").read_text())
    assert not man["complete"] and len(man["shards"]) == (2 if where == "shard" else 1)
    assert all(store_write._shard_ok(tmp_path / "st", s) for s in man["shards"])
    assert not [p for p in (tmp_path / "st").iterdir() if ".tmp-" in p.name]  # no partial file left
    with pytest.raises(StoreError, match="unfinished"):
        ActivationStore(tmp_path / "st")
    monkeypatch.undo()
    res = exp.run(tiny_gpt2, progress=False).summary()
    assert res["shards_reused"] == len(man["shards"]) and not res["up_to_date"]
    for f in sorted(p.name for p in (tmp_path / "ref").glob("shard-*")):
        assert (tmp_path / "st" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
    (tmp_path / "file").write_text("x")  # a store path under a regular file
    with pytest.raises(OutputError, match=r"path: cannot write .*file/st.* a part of the path is a file, not a folder"):
        CacheActivations.model_validate(_kind_spec(tmp_path / "file" / "st" / "inner")).run(tiny_gpt2, progress=False)


def test_a_file_size_limit_in_cache_activations_is_an_error_naming_the_store(tmp_path):
    """Issue #33 item 15: a real file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: the write fails
    with EFBIG) while `tracekit cache-activations` writes a shard: exit code 2 and one line naming
    the store, the limit and the fix (no traceback); without the limit the same command completes."""
    import yaml

    from helpers import GPT2_BPE, tiny_overrides

    model = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
             "device": "cpu"}
    store = tmp_path / "st"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": model, "experiments": [
        {"kind": "activations", "path": str(store), "prompts": PROMPTS, "hooks": HOOKS, "position": "all",
         "shard_mb": 1.0}]}))
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from tracekit.cli import main
        import tracekit.activations.write, safetensors.torch  # imported before the limit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), not the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        sys.exit(main(["cache-activations", {str(cfg)!r}, "--no-progress"]))
    """)
    env = {**os.environ, "TRACEKIT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"error: path: cannot write {str(store)!r}" in r.stderr and "file-size limit" in r.stderr, r.stderr[-3000:]
    assert "(EFBIG)" in r.stderr and "smaller shard_mb" in r.stderr and "rerun" in r.stderr
    man = json.loads((store / "manifest.json").read_text())
    assert not man["complete"] and man["shards"] == []  # the one shard did not fit: nothing looks done
    assert not [p for p in store.iterdir() if p.name.startswith("shard-") or ".tmp-" in p.name]
    import argparse

    from tracekit.activations_cli import add_commands, main

    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers(dest="cmd"))
    assert main(p.parse_args(["cache-activations", str(cfg), "--no-progress"])) == 0  # no limit: it completes
    assert ActivationStore(store).manifest["complete"]


def test_corpus_seq_len_past_the_context_is_refused_before_the_store(tiny_gpt2, tmp_path, capsys):
    """``corpus.seq_len`` above the model's context: refused by the kind's check, by corpus_rows when
    called (not at the first window) and by ``tracekit cache-activations`` against the model's
    config alone (exit 2), before any store folder is made (it was an IndexError mid-write on GPT-2)."""
    import argparse

    import yaml

    from helpers import GPT2_BPE, tiny_overrides
    from tracekit.activations_cli import add_commands, main
    from tracekit.errors import ConfigError

    m = tiny_gpt2
    step = {"path": str(tmp_path / "st"), "hooks": ["blocks.0.hook_resid_post"], "position": "all",
            "corpus": {"source": "stdlib", "seq_len": 129, "max_tokens": 64}}
    CacheActivations(**{**step, "corpus": {**step["corpus"], "seq_len": 128}}).check(m)
    msg = r"^corpus\.seq_len: windows of 129 tokens need 129 positions, more than .*context of 128 tokens .*at most 128$"
    with pytest.raises(ConfigError, match=msg):
        CacheActivations(**step).check(m)
    with pytest.raises(ConfigError, match=r"corpus\.seq_len"):
        CacheActivations(**step).run(m, progress=False)
    for packed in (False, True):
        with pytest.raises(ConfigError, match=r"^seq_len: windows of 129"):
            corpus_rows(m, "stdlib", seq_len=129, max_tokens=64, packed=packed)
    long = {k: v for k, v in step.items() if k != "corpus"}
    with pytest.raises(TokenizationError, match=r"^prompts\[1\] .* is 130 tokens, longer than the model's context of 128"):
        CacheActivations(**long, prompts=["a b", " word" * 129]).check(m)
    cfg = tmp_path / "c.yaml"
    model = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
             "device": "cpu"}
    cfg.write_text(yaml.safe_dump({"model": model, "experiments": [{"kind": "activations", **step}]}))
    p = argparse.ArgumentParser()
    add_commands(p.add_subparsers(dest="cmd"))
    assert main(p.parse_args(["cache-activations", str(cfg), "--no-progress"])) == 2
    err = capsys.readouterr().err
    assert "experiments[0] (activations): corpus.seq_len: windows of 129 tokens" in err and "at most 128" in err
    assert not (tmp_path / "st").exists()
