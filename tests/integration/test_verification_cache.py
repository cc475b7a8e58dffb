"""The load-time verification's cached result (tracekit.model.load: ``verification-<key>.json`` in a
weight-cache entry). A record is reused only under the same key (weights, probe, dtype, device,
processing, tolerances, versions) and bridge-weight digest; anything else recomputes the checks, so a
real mismatch is never hidden. Tiny random Llama models stand in for a cached GGUF; every test points
``TRACEKIT_CACHE_DIR`` at a temporary folder.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from helpers import GPT2_BPE
from tracekit.core.errors import ModelLoadError
from tracekit.model import load as load_mod
from tracekit.model.checks import Check
from tracekit.model.spec import ModelSpec
from tracekit.model.state import state_of


@functools.cache
def _prototype():
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM  # pyright: ignore[reportAttributeAccessIssue]

    tok = GPT2TokenizerFast.from_pretrained(GPT2_BPE)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)  # wrap_hf_model switches it to eager attention
    return LlamaForCausalLM(cfg).eval(), tok


def _wrap(entry, process_weights: bool = True, hf=None):
    proto, tok = _prototype()
    spec = ModelSpec(name="tiny-llama", verify=True, process_weights=process_weights)
    return load_mod.wrap_hf_model(hf if hf is not None else copy.deepcopy(proto), tok, spec, cache_entry=entry)


@pytest.fixture
def entry(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "tkcache"))
    monkeypatch.delenv("TRACEKIT_CACHE", raising=False)
    d = tmp_path / "tkcache" / "gguf" / "entry"
    d.mkdir(parents=True)
    return d


def _ver(model) -> dict:
    v = state_of(model).verification
    assert v is not None
    return v


def _records(entry):
    return sorted(entry.glob("verification-*.json"))


def test_second_load_reuses_the_record(entry):
    first = _ver(_wrap(entry))
    assert first["passed"] and "cached" not in first
    assert len(_records(entry)) == 1
    second = _ver(_wrap(entry))
    assert second["cached"] is True
    assert {k: v for k, v in second.items() if k != "cached"} == first  # the same checks and values


def test_other_weights_recompute_and_a_real_mismatch_is_not_hidden(entry):
    _wrap(entry)
    proto, _ = _prototype()
    other = copy.deepcopy(proto)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1e-3)  # every element: another model under the same entry
    # The entry's processed weights (keyed by names and shapes) are the first model's, so this bridge
    # is wrong: the record of the first model must not vouch for it; the recomputed checks refuse it.
    with pytest.raises(ModelLoadError, match="different log-probabilities"):
        _wrap(entry, hf=other)
    v = _ver(_wrap(entry, process_weights=False))  # other processing: another key
    assert v["passed"] and "cached" not in v
    assert len(_records(entry)) == 2  # one record per passing key


def test_record_with_another_bridge_digest_is_not_trusted(entry, monkeypatch):
    fresh = _ver(_wrap(entry))
    (rec,) = _records(entry)
    data = json.loads(rec.read_text())
    data["bridge"] = "0" * 64  # as if the processed weights had changed under the same key
    rec.write_text(json.dumps(data))
    v = _ver(_wrap(entry))  # the reference is rebuilt from the same tensors
    assert "cached" not in v and v["passed"]
    for a, b in zip(v["checks"], fresh["checks"]):
        assert a["name"] == b["name"] and a["value"] == pytest.approx(b["value"], abs=1e-6)
    # ... and a failing check under such a record is raised, not hidden
    data = json.loads(rec.read_text())
    data["bridge"] = "0" * 64
    rec.write_text(json.dumps(data))
    monkeypatch.setattr(load_mod, "load_checks", lambda *a: [Check("forward", "load", 1.0, 1e-3, "fail")])
    with pytest.raises(ModelLoadError, match="different log-probabilities"):
        _wrap(entry)


def test_version_change_recomputes_and_a_real_failure_raises(entry, monkeypatch):
    _wrap(entry)
    monkeypatch.setattr(torch, "__version__", "0.0-other")
    monkeypatch.setattr(load_mod, "load_checks", lambda *a: [Check("forward", "load", 1.0, 1e-3, "fail")])
    with pytest.raises(ModelLoadError, match="different log-probabilities"):
        _wrap(entry)


def test_cache_off_writes_nothing(entry, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE", "off")
    for _ in range(2):
        v = _ver(_wrap(entry))
        assert v["passed"] and "cached" not in v
    assert _records(entry) == []
