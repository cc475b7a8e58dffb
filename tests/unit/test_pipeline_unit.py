"""Pipeline pieces that need no model: resolving a step's references computes the record and writes
nothing (the runner alone writes the run directory's files)."""

from __future__ import annotations

import json

from tracekit.config import parse_config
from tracekit.pipeline import PendingStep, Resolution, resolve, resolve_step
from tracekit.runner import resolved_config


def _saved_step(run_dir, name="lens", summary=None):
    d = run_dir / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(summary or {"k": 3}))
    (d / "manifest.json").write_text(json.dumps({"kind": "logit_lens", "files": {}, "tables": []}))


def test_resolve_returns_the_step_and_its_record_and_writes_nothing(tmp_path):
    _saved_step(tmp_path)
    raw = {"kind": "logit_lens", "name": "again", "prompts": ["a"], "top_k": {"from": "lens", "key": "k"}}
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    res = resolve(PendingStep(raw, 1), tmp_path)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert isinstance(res, Resolution) and res.index == 1 and res.step.top_k == 3
    assert res.record == [{"field": "experiments[1].top_k", "from": {"from": "lens", "key": "k"}, "value": 3}]
    assert res.entry["top_k"] == 3 and res.entry["kind"] == "logit_lens"
    assert resolve_step(PendingStep(raw, 1), tmp_path).top_k == 3
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_resolved_config_keeps_references_until_the_step_runs():
    cfg = parse_config({"experiments": [
        {"kind": "logit_lens", "name": "lens", "prompts": ["a"]},
        {"kind": "logit_lens", "name": "again", "prompts": ["a"], "top_k": {"from": "lens", "key": "n_prompts"}}]})
    out = resolved_config(cfg)
    assert out["experiments"][1]["top_k"] == {"from": "lens", "key": "n_prompts"}
    assert out["experiments"][0]["prompts"] == ["a"] and "model" in out and "seed" in out
