"""The ``transcoders:`` block: one source, fields that mean what they say, hook pairs checked on the model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tracekit.core.errors import SAEError
from tracekit.dictionaries.spec import TranscoderSpec, TranscoderTrainSpec, hook_name, transcoder_hooks


def test_defaults_are_the_mlp_pair_topk():
    t = TranscoderTrainSpec()
    assert (t.hook_in, t.hook_out, t.architecture, t.skip) == ("mlp.hook_in", "hook_mlp_out", "topk", False)
    assert t.layers is None and t.corpus == "stdlib"
    assert t.d_sae_for(64) == 64 * t.expansion_factor
    assert TranscoderTrainSpec(d_sae=100).d_sae_for(64) == 100
    assert hook_name("mlp.hook_in", 3) == "blocks.3.mlp.hook_in"


def test_exactly_one_source():
    with pytest.raises(ValidationError, match="exactly one transcoder source"):
        TranscoderSpec()
    with pytest.raises(ValidationError, match="exactly one transcoder source"):
        TranscoderSpec(path="x", train=TranscoderTrainSpec())
    assert TranscoderSpec(path="x").describe() == "x"
    assert TranscoderSpec.model_validate({"train": {}}).train is not None


@pytest.mark.parametrize("kw, field", [
    ({"k": 65, "d_sae": 64}, "k"),
    ({"training_tokens": 512, "train_batch_size_tokens": 1024}, "training_tokens"),
    ({"layers": []}, "layers"),
    ({"layers": [1, 1]}, "layers"),
    ({"layers": [0, 2]}, "layers"),
    ({"hook_in": "blocks.0.mlp.hook_in"}, "hook_in"),
    ({"architecture": "gated"}, "architecture"),
    ({"unknown_field": 1}, "unknown_field"),
])
def test_refusals_name_the_field(kw, field):
    with pytest.raises(ValidationError, match=field):
        TranscoderTrainSpec(**kw)


def test_cache_key_fields_leave_out_store_and_checkpoints():
    a = TranscoderTrainSpec(store="/somewhere", checkpoint_every=7).training_fields()
    b = TranscoderTrainSpec().training_fields()
    assert a == b
    assert TranscoderTrainSpec(seed=1).training_fields() != b


def test_transcoder_hooks_on_a_model(tiny_gpt2):
    t = TranscoderTrainSpec()
    assert transcoder_hooks(tiny_gpt2, 1, t) == ("blocks.1.mlp.hook_in", "blocks.1.hook_mlp_out")
    n = int(tiny_gpt2.cfg.n_layers)
    with pytest.raises(SAEError, match=r"transcoders\.train\.layers"):
        transcoder_hooks(tiny_gpt2, n, t)
    with pytest.raises(SAEError, match=r"transcoders\.train\.hook_out"):
        transcoder_hooks(tiny_gpt2, 0, TranscoderTrainSpec(hook_out="hook_nothing_here"))
