"""One test over every registered kind: validate -> check on a ModelInfo -> run on a tiny model ->
save -> load -> equal tables, equal JSON-able summary, figures render, no state left on the model."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import KIND_DATASET_EXAMPLES, KIND_EXAMPLES, kind_run, make_tiny
from tracekit.compat import sae_lens_status
from tracekit.experiments.base import REGISTRY, jsonable
from tracekit.results import shadowing_columns


def test_every_registered_kind_has_an_example():
    assert sorted(KIND_EXAMPLES) == sorted(REGISTRY), "add a small config for the new kind to tests/helpers.py"


def _param_checksum(model) -> float:
    return float(sum(p.double().sum() for p in model.parameters()))


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_kind_roundtrip(kind, tmp_path):
    if kind not in KIND_EXAMPLES:
        pytest.fail(f"no example config for kind {kind!r} in tests/helpers.py KIND_EXAMPLES")
    model = make_tiny("gpt2")
    exp = REGISTRY[kind].model_validate({"kind": kind, **KIND_EXAMPLES[kind]})
    info = tk.load_model_info(tk.model_spec_of(model).model_copy())
    exp.check(info)  # the tokenizer/config-only check works without weights
    # the run (after the bridge's first forward) is shared with test_prepare_once / test_notebook
    # (helpers.kind_run): its checksum and hooks before and after are recorded around exp.run
    run = kind_run(kind)
    res, before, hooks = run.result, run.checksum_before, run.hooks_before
    assert run.checksum_after == before
    assert run.hooks_after == hooks
    summary = res.summary()
    json.dumps(jsonable(summary))
    res.save(tmp_path / "r")
    back = tk.Result.load(tmp_path / "r")
    assert type(back) is type(res)
    for name, df in res.tables.items():
        pd.testing.assert_frame_equal(df.reset_index(drop=True), back.tables[name].reset_index(drop=True),
                                      check_dtype=False)
    assert jsonable(back.summary()) == jsonable(summary)
    for k, v in res.arrays.items():
        assert torch.equal(v.cpu(), back.arrays[k])
    for name, df in res.tables.items():
        assert not shadowing_columns(df), f"{kind} table {name!r}: columns {shadowing_columns(df)} shadow DataFrame " \
                                          "attributes (df.head is a method); rename them (tracekit.results)"
    figs = back.figures()
    for f in figs.values():
        f.canvas.draw()
    plt.close("all")
    assert isinstance(res.report(), str) and res.report()


def test_every_kind_in_one_config_leaves_no_state(tmp_path):
    """A config that runs every kind and then the logit lens again: the second lens table is identical
    to the first, the parameters' checksum is unchanged, no hook and no gated-hook setting remains."""
    from tracekit.config import parse_config
    from tracekit.runner import run_config

    model = make_tiny("gpt2")
    lens = {"kind": "logit_lens", **KIND_EXAMPLES["logit_lens"]}
    steps = [{**lens, "name": "lens_first"}]
    sae_ok = sae_lens_status(import_check=False) is None  # without SAELens the SAE kinds are refused at parse
    steps += [{"kind": k, "name": f"step_{k}", **v} for k, v in sorted(KIND_EXAMPLES.items())
              if k != "logit_lens" and (sae_ok or not k.startswith("sae_"))]
    steps += [{**lens, "name": "lens_again"}]
    cfg = parse_config({"model": tk.model_spec_of(model).model_dump(mode="json"), "experiments": steps})
    before = _param_checksum(model)
    flags = {f: getattr(model.cfg, f) for f in ("use_attn_result", "use_hook_mlp_in", "use_split_qkv_input")}
    run_dir, _ = run_config(cfg, tmp_path, stem="all", model=model, progress=False, log=lambda *_: None)
    a = tk.Result.load(run_dir / "lens_first").tables["main"]
    b = tk.Result.load(run_dir / "lens_again").tables["main"]
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert _param_checksum(model) == before
    assert {f: getattr(model.cfg, f) for f in flags} == flags
    assert all(not getattr(m, "fwd_hooks", []) for m in model.modules())  # no TransformerLens hook left


#: Kinds that read no prompts (they train or evaluate on a corpus).
NO_ROWS = {"sae_train", "sae_eval", "lens_quality", "transcoder_train"}  # corpus text, not prompt rows
#: kinds that take dataset rows but write no per-row table (a store keeps its rows in its shards)
NO_ROWS_TABLE = {"activations"}


def test_every_kind_that_reads_prompts_takes_a_dataset():
    assert sorted(KIND_DATASET_EXAMPLES) == sorted(set(REGISTRY) - NO_ROWS)


@pytest.mark.parametrize("kind", sorted(KIND_DATASET_EXAMPLES))
def test_kind_runs_on_a_dataset_with_per_row_targets(kind, tmp_path):
    """Every kind on two rows of different lengths, each with its own target/foil and named positions:
    check on a ModelInfo, run, save, load; per-row tables carry both rows' ids; no column shadows a
    DataFrame attribute."""
    model = make_tiny("gpt2", padding_side="left")
    exp = REGISTRY[kind].model_validate({"kind": kind, **KIND_DATASET_EXAMPLES[kind]})
    exp.check(tk.load_model_info(tk.model_spec_of(model).model_copy()))
    res = exp.run(model, progress=False)
    res.save(tmp_path / "r")
    back = tk.Result.load(tmp_path / "r")
    for name, df in res.tables.items():
        assert not shadowing_columns(df), (kind, name, shadowing_columns(df))

        def missing_as_none(f: pd.DataFrame) -> pd.DataFrame:  # NaN and None both mean "no value" in a table
            return f.reset_index(drop=True).astype(object).where(f.reset_index(drop=True).notna(), None)

        pd.testing.assert_frame_equal(missing_as_none(df), missing_as_none(back.tables[name]), check_dtype=False)
    if kind == "token_trace":
        assert res.meta["row_id"] == 1
    elif kind == "head_scan":  # heads labelled on each row
        assert sorted(set(res.tables["labels"]["row_id"])) == [0, 1]
    elif kind in NO_ROWS_TABLE:  # the store records each example's row id
        from tracekit.activations.store import ActivationStore

        assert sorted(set(ActivationStore(exp.path).rows.tolist())) == [0, 1]
    elif kind != "linear_probe":
        assert "rows" in res.tables, f"{kind} writes no per-row table 'rows'"
        assert sorted(set(res.tables["rows"]["row_id"])) == [0, 1]
    json.dumps(jsonable(res.summary()))
