"""One test over every registered kind: validate -> check on a ModelInfo -> run on a tiny model ->
save -> load -> equal tables, equal JSON-able summary, figures render, no state left on the model."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch

import tracekit as tk
from helpers import KIND_EXAMPLES, make_tiny
from tracekit.experiments.base import REGISTRY, jsonable


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
    before = _param_checksum(model)
    res = exp.run(model, progress=False)
    assert _param_checksum(model) == before
    assert all(not getattr(m, "_forward_hooks", {}) for m in model.modules())
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
    figs = back.figures()
    for f in figs.values():
        f.canvas.draw()
    plt.close("all")
    assert isinstance(res.report(), str) and res.report()
