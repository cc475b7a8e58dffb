"""Shared fixtures: tiny randomly initialised models of GPT-2 and Llama architecture, built offline
with GPT-2's real tokenizer tables (../shared/data/gpt2-bpe), and the embedded model (slow)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

torch.set_num_threads(2)

ROOT = Path(__file__).resolve().parents[1]
GPT2_BPE = ROOT.parent / "shared" / "data" / "gpt2-bpe"
if not GPT2_BPE.exists():  # a copy inside the repo, if someone vendors it
    GPT2_BPE = ROOT / "tests" / "data" / "gpt2-bpe"


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> str:
    if not (GPT2_BPE / "vocab.json").exists():
        pytest.fail(f"GPT-2 tokenizer tables not found at {GPT2_BPE}")
    return str(GPT2_BPE)


def make_tiny(arch: str, tokenizer_dir: str, process_weights: bool = True, prepend_bos: bool = True,
              padding_side: str = "right", n_layers: int = 3, seed: int = 0):
    """A tiny random model through the same loader users use (ModelSpec random_init)."""
    from tracekit.models import ModelSpec, load_model

    overrides = ({"n_layer": n_layers, "n_embd": 64, "n_head": 4, "n_positions": 128}
                 if arch == "gpt2" else {"num_hidden_layers": n_layers})
    spec = ModelSpec(name=arch, random_init=True, tokenizer=tokenizer_dir, config_overrides=overrides,
                     process_weights=process_weights, prepend_bos=prepend_bos, padding_side=padding_side,
                     seed=seed, device="cpu")
    return load_model(spec)


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def tiny_model(request, gpt2_tokenizer_dir):
    return make_tiny(request.param, gpt2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_gpt2(gpt2_tokenizer_dir):
    return make_tiny("gpt2", gpt2_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_llama(gpt2_tokenizer_dir):
    return make_tiny("llama", gpt2_tokenizer_dir)


@pytest.fixture(scope="session")
def embedded_model():
    """The real embedded model (SmolLM2-135M, float32). Loaded once per test session."""
    from tracekit.models import load_model

    return load_model("smollm2-135m", device="cpu")
