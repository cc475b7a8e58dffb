"""The one context-length check (tracekit.model.context): the context a config reads, and the exact
rules for windows (``seq_len <= n_ctx``) and generation (``prompt + max_new_tokens - 1 <= n_ctx``).
Models are stand-ins with a TransformerLens-like ``cfg``: no weights needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tracekit.core.errors import ConfigError, SAEError
from tracekit.model.context import check_generation, check_window, context_length


def _model(n_ctx, **cfg):
    return SimpleNamespace(cfg=SimpleNamespace(n_ctx=n_ctx, model_name="m", **cfg))


def test_context_length_reads_n_ctx_and_scaled_rope():
    assert context_length(_model(1024)) == 1024  # GPT-2: n_positions
    assert context_length(_model(8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5})) == 8192
    # Qwen2's YaRN recipe keeps max_position_embeddings at the original: factor x original is served
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(_model(32768, rope_parameters=yarn)) == 131072
    # Llama 3.1 already states the scaled length: never lowered
    l3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert context_length(_model(131072, rope_parameters=l3)) == 131072
    # transformers 5: one dict per layer type; HF <5 name rope_scaling with "type"
    assert context_length(_model(4096, rope_parameters={"full_attention": yarn, "sliding_attention": {}})) == 131072
    assert context_length(_model(4096, rope_scaling={"type": "linear", "factor": 2, "original_max_position_embeddings": 4096})) == 8192
    assert context_length(SimpleNamespace(cfg=SimpleNamespace())) is None
    assert context_length(object()) is None


def test_window_rule_is_seq_len_at_most_n_ctx():
    m = _model(16)
    check_window(m, 16, "corpus.seq_len")
    with pytest.raises(ConfigError, match=r"^corpus\.seq_len: windows of 17 tokens need 17 positions, more than "
                                          r"model 'm''s context of 16 tokens .*set corpus\.seq_len to at most 16$"):
        check_window(m, 17, "corpus.seq_len")
    with pytest.raises(SAEError):
        check_window(m, 17, "x", SAEError)
    check_window(SimpleNamespace(cfg=SimpleNamespace()), 10 ** 9)  # context unknown: nothing to check


def test_generation_rule_is_prompt_plus_new_minus_one():
    m = _model(10)
    check_generation(m, 5, 6, "generate.max_new_tokens", "prompts[0]")  # runs at most 5 + 6 - 1 = 10 positions
    with pytest.raises(ConfigError, match=r"^generate\.max_new_tokens: prompts\[0\] \(5 tokens\) then 7 generated "
                                          r"tokens need 11 positions, more than model 'm''s context of 10 tokens .*"
                                          r"set generate\.max_new_tokens to at most 6 or shorten prompts\[0\]$"):
        check_generation(m, 5, 7, "generate.max_new_tokens", "prompts[0]")
    with pytest.raises(ConfigError, match=r"shorten target_prompt to at most 10 tokens$"):
        check_generation(m, 12, 1, "n_generate", "target_prompt")
    check_generation(m, 12, 0, "n_generate")  # nothing generated: the prompt's own check applies
