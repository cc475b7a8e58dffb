"""Shared fixtures. Tiers (as TransformerLens' tests/AGENTS.md):

* ``tests/unit``: no model, or a tiny one built in milliseconds; pure functions (positions, metrics,
  config parsing, splits).
* ``tests/integration``: tiny random GPT-2 / Llama models (tests/helpers.py), including perturbed
  norms and biases, tied embeddings and GQA, with weight processing on and off.
* ``tests/acceptance``: the real embedded model (SmolLM2-135M), marked ``slow``.

The ``slow`` tier (the real embedded model, fresh interpreters, the slower kinds' displays) is left out
by ``make test`` (``-m "not slow"``) and run by ``make test-slow`` (``-m slow``); CI runs both, and the
whole suite again on TransformerLens 4 (``make test-tl4``). The embedded model is loaded once per
session (:func:`embedded_model`).

GPT-2's real tokenizer tables are vendored in ``tracekit/data/gpt2-bpe`` (nothing outside the repo
is read).
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
# Tests never write the user's weight cache (tracekit.model.weights_cache): a temp folder shared by test sessions
# (warm starts across runs); TRACEKIT_TEST_CACHE_DIR chooses another.
os.environ["TRACEKIT_CACHE_DIR"] = os.environ.get(
    "TRACEKIT_TEST_CACHE_DIR", os.path.join(__import__("tempfile").gettempdir(), "tracekit-test-cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import GPT2_BPE, PERTURBED_IDS, PERTURBED_VARIANTS, make_perturbed, make_tiny  # noqa: E402
from tracekit.compat import sae_lens_status  # noqa: E402

torch.set_num_threads(2)

# --- SAELens is optional (the [sae] extra; it pins transformer-lens<4, SAELens issue #738) -------------
#: SAE test files that run in both environments: SAELens directories are read without SAELens
#: (tracekit.dictionaries), so only their tests marked ``sae`` (a comparison against SAELens itself, a
#: pretrained release) need SAELens, and their trainings need a trainer (:func:`sae_trainer_status`).
SAE_BOTH_ENVS = {"test_sae.py", "test_sae_kinds.py", "test_faults_sae.py", "test_dashboard.py", "test_sae_store.py"}
#: Files that are SAE tests throughout and still need SAELens.
SAE_FILES = {"test_export.py"}  # export: SAELens directories and an SAE kind's tables


#: Files that test the SAELens-missing case itself (they run in both environments).
NOT_SAE_FILES = {"test_compat.py"}


def needs_sae_lens(item) -> bool:
    """A test that needs SAELens: marked ``sae``; outside :data:`SAE_BOTH_ENVS`, also one in an SAE
    file, named for SAEs (the word ``sae`` in ``test_..._sae_...``), parametrized with an SAE kind
    (``[sae_features]``), or using an SAE fixture (``sae_handle``)."""
    if item.path.name in NOT_SAE_FILES:
        return False
    if item.get_closest_marker("sae") is not None:
        return True
    if item.path.name in SAE_BOTH_ENVS:
        return False
    names = [getattr(item, "originalname", item.name), getattr(getattr(item, "callspec", None), "id", ""),
             *getattr(item, "fixturenames", ())]
    words = set(re.split(r"[^a-z0-9]+", " ".join(names).lower()))
    return item.path.name in SAE_FILES or "sae" in words


def sae_trainer_status() -> str | None:
    """Why ``tracekit.sae.train_sae`` cannot train here, or None: it trains with SAELens' runner
    where SAELens imports, elsewhere with tracekit's own trainer
    (``tracekit.dictionaries.fit.fit_dictionary``, when ``tracekit.sae.train`` uses it)."""
    reason = sae_lens_status(import_check=False)
    if reason is None:
        return None
    from tracekit.sae import train as sae_train

    if getattr(sae_train, "fit_dictionary", None) is not None:
        return None
    return (f"SAE training without SAELens needs tracekit's own SAE trainer (tracekit/sae/train.py), which this "
            f"tree does not have; SAELens is not usable here: {reason}")


def pytest_configure(config):
    config.addinivalue_line("markers", "sae_train: trains an SAE (tracekit.sae.train_sae); skipped, saying why, "
                                       "where neither SAELens' runner nor tracekit's own trainer is available")


def pytest_collection_modifyitems(config, items):
    reason = sae_lens_status(import_check=False)  # metadata only: a broken sae_lens import must fail loudly
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"SAE test skipped: {reason}; run it in the default env (make test)")
    train_reason = None
    for item in items:
        if needs_sae_lens(item):
            item.add_marker(skip)
        elif item.get_closest_marker("sae_train") is not None:
            train_reason = train_reason or sae_trainer_status()
            if train_reason is not None:
                item.add_marker(pytest.mark.skip(reason=train_reason))


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir() -> str:
    return GPT2_BPE


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def tiny_model(request):
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def tiny_gpt2():
    return make_tiny("gpt2")


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny("llama")


@pytest.fixture(scope="session", params=[(a, t, pw) for a, t in PERTURBED_VARIANTS for pw in (True, False)],
                ids=[f"{i}-{'processed' if pw else 'raw'}" for i in PERTURBED_IDS for pw in (True, False)])
def perturbed_model(request):
    """Tiny GPT-2 / Llama / tied-embedding Llama with perturbed norms and biases, weight processing
    on and off (6 variants)."""
    arch, tied, pw = request.param
    return make_perturbed(arch, process_weights=pw, tied=tied)


@pytest.fixture(scope="session")
def embedded_model():
    """The real embedded model (SmolLM2-135M, float32). Loaded once per test session."""
    from tracekit.model.load import load_model

    return load_model("smollm2-135m", device="cpu")
