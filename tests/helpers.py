"""Test model factories (tiers and fixtures: tests/conftest.py).

* :func:`make_tiny`: a tiny randomly initialised GPT-2 or Llama through the loader users use
  (``ModelSpec(random_init=True)``) with GPT-2's real tokenizer tables (built-in ``gpt2-bpe``).
* :func:`make_perturbed`: the same architectures with norm weights away from 1, non-zero biases and
  O(1) logits, so final-norm and folding bugs change numbers (a unit-weight random model hides
  them); ``tied=True`` gives a Llama whose unembedding is its embedding (tie_word_embeddings).
  GPT-2: LayerNorm, biases, learned positions, fused QKV. Llama: RMSNorm, GQA (4 query heads, 2
  key/value heads), SwiGLU, rotary positions, no biases.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
GPT2_BPE = str(ROOT / "tracekit" / "data" / "gpt2-bpe")

_PERTURBED: dict = {}


def load_gpu_check():
    """``benchmarks/gpu_check.py`` as the module ``gpu_check`` (loaded once per process: its COMPARE,
    INVARIANTS and tolerances are what the half-precision and GPU checks compare with)."""
    import importlib.util
    import sys

    if "gpu_check" in sys.modules:
        return sys.modules["gpu_check"]
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def start_child(cmd: list[str], **kw) -> subprocess.Popen:
    """``subprocess.Popen`` for the signal tests: the child never inherits an ignored SIGINT (a test
    runner started as a background job of a non-interactive shell ignores SIGINT, and so would every
    child, which then cannot be interrupted: observed once as three SIGINT tests timing out in one
    run), and has faulthandler on so :func:`communicate_or_dump` can print where it hangs."""
    kw["env"] = {**(kw.get("env") or os.environ), "PYTHONFAULTHANDLER": "1"}
    ignored = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # exec resets it to SIG_DFL in the child
    try:
        return subprocess.Popen(cmd, **kw)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def communicate_or_dump(proc: subprocess.Popen, timeout: float) -> tuple:
    """``proc.communicate(timeout=...)``; past the timeout the child gets SIGABRT (faulthandler prints
    every thread's stack), is killed if still alive, and the test fails with its output."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"the child did not exit within {timeout} s; its output and stacks:\n{out}\n{err}") from None


def tiny_overrides(arch: str, n_layers: int = 3, tied: bool = False) -> dict:
    if arch == "gpt2":
        return {"n_layer": n_layers, "n_embd": 64, "n_head": 4, "n_positions": 128}
    out = {"num_hidden_layers": n_layers}
    if tied:
        out["tie_word_embeddings"] = True
    return out


def make_tiny(arch: str, tokenizer_dir: str = GPT2_BPE, process_weights: bool = True, prepend_bos=True,
              padding_side: str = "right", n_layers: int = 3, seed: int = 0, tied: bool = False):
    """A tiny random model through the same loader users use (ModelSpec random_init)."""
    from tracekit.model.load import load_model
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name=arch, random_init=True, tokenizer=tokenizer_dir,
                     config_overrides=tiny_overrides(arch, n_layers, tied), process_weights=process_weights,
                     prepend_bos=prepend_bos, padding_side=padding_side, seed=seed, device="cpu")
    return load_model(spec)


def perturb_params(hf, norm_gain=lambda name: 1.0, seed: int = 11) -> None:
    """Norm weights ``gain(name) * (1 + 0.3 noise)``, biases ``0.3 noise``, matrices x4 (seeded), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        seen = set()
        for name, p in hf.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and ("ln" in name or "norm" in name) and "bias" not in name:
                p.copy_(norm_gain(name) * (1.0 + 0.3 * noise))
            elif p.ndim == 1:
                p.copy_(0.3 * noise)
            else:
                p.mul_(4.0)


def perturbed_hf(arch: str, tied: bool = False, n_layers: int = 3):
    """The Hugging Face model (and tokenizer) :func:`make_perturbed` wraps, built afresh (same seed,
    same weights): the checkpoint as the Hugging Face side (e.g. the tuned-lens package) sees it."""
    from transformers import AutoModelForCausalLM

    from tracekit.model.source import _load_tokenizer, _random_config
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name=arch, random_init=True, tokenizer=GPT2_BPE,
                     config_overrides=tiny_overrides(arch, n_layers, tied), device="cpu", seed=7)
    tok = _load_tokenizer(GPT2_BPE)
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(_random_config(spec), dtype=torch.float32)
    if hf.config.vocab_size < len(tok):
        hf.resize_token_embeddings(len(tok), mean_resizing=False)
    perturb_params(hf)
    if tied:
        assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    return hf, tok


def make_perturbed(arch: str, process_weights: bool = True, tied: bool = False, prepend_bos=True,
                   padding_side: str = "right", n_layers: int = 3):
    """A tiny random model with non-trivial norm weights, biases and O(1) logits (cached)."""
    key = (arch, process_weights, tied, prepend_bos, padding_side, n_layers)
    if key in _PERTURBED:
        return _PERTURBED[key]
    from tracekit.model.load import wrap_hf_model
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name=arch, random_init=True, tokenizer=GPT2_BPE,
                     config_overrides=tiny_overrides(arch, n_layers, tied), process_weights=process_weights,
                     prepend_bos=prepend_bos, padding_side=padding_side, device="cpu", seed=7)
    hf, tok = perturbed_hf(arch, tied=tied, n_layers=n_layers)
    bridge = wrap_hf_model(hf, tok, spec, bridge_name="gpt2" if arch == "gpt2" else "meta-llama/Llama-3.2-1B")
    _PERTURBED[key] = bridge
    return bridge


#: (arch, tied) variants every numeric invariant runs on, with ids.
PERTURBED_VARIANTS = [("gpt2", False), ("llama", False), ("llama", True)]
PERTURBED_IDS = ["gpt2", "llama", "llama-tied"]


#: A small, fast config of every registered kind for a tiny model (tests/integration/test_kinds.py
#: runs each: validate, run, save, load, equal tables, JSON-able summary, figures render).
KIND_EXAMPLES: dict[str, dict] = {
    "logit_lens": {"prompts": ["The capital of France is", "Hello world"], "target": " Paris", "position": "all"},
    "linear_probe": {"dataset": {"builtin": "countries", "templates": ["The capital city of {country} is"]},
                     "layers": [0, 1], "bootstrap": 20, "test_size": 0.4},
    "activation_patching": {"pairs": [{"clean": "The capital of France is", "corrupted": "The capital of Italy is",
                                       "target": " Paris", "foil": " Rome"},
                                      {"clean": "The capital of Spain is", "corrupted": "The capital of Japan is",
                                       "target": " Madrid", "foil": " Tokyo"},
                                      {"clean": "The capital of China is", "corrupted": "The capital of Egypt is",
                                       "target": " Beijing", "foil": " Cairo"}],
                            "sites": ["resid_pre", "head_out"], "directions": ["denoising", "noising"],
                            "ablations": ["zero", "mean", "resample"]},
    "direct_logit_attribution": {"prompts": ["The capital of France is"], "target": " Paris", "foil": " Rome"},
    "neuron_attribution": {"prompts": ["The capital of France is"], "target": " Paris", "layers": [1],
                           "contexts": {"max_tokens": 128, "top_n": 2}, "ablation": {"n_random": 2}},
    "attention_pattern": {"prompts": ["The capital of France is"], "layer": 0, "position": "token: is"},
    "head_scan": {"seq_len": 8, "n_seqs": 2, "prompts": ["The capital of France is"]},
}
#: A tiny SAE trained by SAELens' runner on the tiny GPT-2 (cached by its config hash after the first test).
TINY_SAE_TRAIN = {"hook": "blocks.1.hook_resid_pre", "d_sae": 32, "k": 4, "training_tokens": 1024,
                  "eval_tokens": 128, "context_size": 32, "train_batch_size_tokens": 128}
#: kind activations writes a store folder: one per test process (removed with the temp folder).
_STORE_DIR = Path(tempfile.gettempdir()) / f"tracekit-test-store-{os.getpid()}"
#: A tiny transcoder set (one per block) the graph kinds train on the spot.
TINY_TC = {"k": 4, "d_sae": 32, "training_tokens": 1024, "eval_tokens": 128, "context_size": 32,
           "train_batch_size_tokens": 128}
KIND_EXAMPLES.update({
    "attribution_patching": {"pairs": KIND_EXAMPLES["activation_patching"]["pairs"], "sites": ["head_out"],
                             "verify": {"top_k": 3, "n_random": 3}},
    "edge_attribution": {"pairs": KIND_EXAMPLES["activation_patching"]["pairs"], "method": "eap",
                         "verify": {"top_k": 3, "n_random": 3}},
    "path_patching": {"pairs": KIND_EXAMPLES["activation_patching"]["pairs"], "senders": ["a0.h*"],
                      "receivers": ["a1.h0<q>"]},
    "circuit": {"pairs": KIND_EXAMPLES["activation_patching"]["pairs"], "level": "nodes",
                "scores": {"method": "atp"}, "bootstrap": 10},
    "lens_quality": {"tuned": {"train_tokens": 128, "seq_len": 32, "epochs": 1, "batch_tokens": 64,
                               "held_out_tokens": 0}, "eval": {"n_tokens": 64, "seq_len": 32}},
    "patchscope": {"prompts": ["The capital of France is"], "target": " Paris", "hidden_states": [0, 1, 3],
                   "top_k": 3, "n_generate": 2},
    "activations": {"prompts": ["The capital of France is", "Hello world"], "hooks": ["blocks.0.hook_resid_post"],
                    "path": str(_STORE_DIR), "overwrite": True},
    "steering": {"prompts": ["The capital of France is", "Hello world"], "target": " Rome", "foil": " Paris",
                 "vector": {"source": "mean_difference", "positive": ["The capital of Italy"],
                            "negative": ["The capital of France"]},
                 "layer": 1, "steer_at": ["all", "generated"], "alphas": [0, 4], "controls": {"n_random": 2},
                 "generate": {"max_new_tokens": 3}},
    "causal_tracing": {"prompts": ["The capital of France is"], "subject": "France", "target": " Paris", "window": 2,
                       "n_samples": 2},
    "token_trace": {"prompts": ["The capital of France is"], "target": " Paris", "key_max_tokens": 128,
                    "top_neurons": 2, "key_contexts": 1},
    "sae_train": {"sae": {"train": TINY_SAE_TRAIN}, "max_tokens": 128},
    "transcoder_train": {"transcoders": {"train": {"training_tokens": 256, "dataset_tokens": 256, "eval_tokens": 64,
                                                   "context_size": 32, "train_batch_size_tokens": 128, "k": 4,
                                                   "d_sae": 32}}},
    "attribution_graph": {"transcoders": {"train": TINY_TC}, "prompts": ["The capital of France is"],
                          "target": " Paris", "foil": " Rome", "verify": {"top_k": 2, "n_random": 2},
                          "cards": {"features": 2, "contexts": 1, "corpus_tokens": 128}, "heads": ["L1H0"],
                          "head_split_edges": 2, "main_path": 3},
    "sae_eval": {"sae": {"train": TINY_SAE_TRAIN}, "max_tokens": 200, "seq_len": 32},
    "sae_features": {"sae": {"train": TINY_SAE_TRAIN}, "prompts": ["The capital of France is"], "target": " Paris",
                     "top_k": 3, "interventions": {"k": 1, "n_random": 1, "modes": ["zero"]},
                     "dashboards": {"features": 1, "max_tokens": 200, "seq_len": 32, "top_n": 2}},
})


#: Rows of different lengths, each with its own target and foil (single GPT-2 tokens): (prompt, target, foil).
TARGET_ROWS = [("The capital of France is", " Paris", " Rome"),
               ("Hello, my name is John and I live in", " London", " Paris"),
               ("When Mary and John went to the store, John gave a drink to", " Mary", " John"),
               ("The Eiffel Tower is in", " Paris", " Berlin")]

#: Two dataset rows of different lengths, each with its own target, foil, corrupted prompt and named
#: positions: every kind that reads prompts runs on them (tests/integration/test_kinds.py).
DATASET_ROWS = [
    {"prompt": "When Mary and John went to the store, John gave a drink to", "target": " Mary", "foil": " John",
     "corrupted": "When Mary and John went to the store, Mary gave a drink to", "group": "ABBA",
     "positions": {"IO": {"text": " Mary", "occurrence": 0}, "S1": {"text": " John", "occurrence": 0},
                   "S2": {"text": " John", "occurrence": -1}, "END": -1}},
    {"prompt": "Then, Tom and Anna met. Tom said to", "target": " Anna", "foil": " Tom",
     "corrupted": "Then, Tom and Anna met. Anna said to", "group": "BABA",
     "positions": {"IO": {"text": " Anna", "occurrence": 0}, "S1": {"text": " Tom", "occurrence": 0},
                   "S2": {"text": " Tom", "occurrence": -1}, "END": -1}},
]
_ROWS = {"dataset": {"rows": DATASET_ROWS}}
#: Each kind that reads prompts, on :data:`DATASET_ROWS` (per-row targets, named positions).
KIND_DATASET_EXAMPLES: dict[str, dict] = {
    "logit_lens": {**_ROWS, "position": "END"},
    "direct_logit_attribution": {**_ROWS, "position": "END"},
    "neuron_attribution": {**_ROWS, "position": "END", "layers": [1], "contexts": None, "ablation": {"n_random": 1}},
    "attention_pattern": {**_ROWS, "query": "END", "keys": ["IO", "S1", "S2"]},
    "activation_patching": {**_ROWS, "sites": ["head_out"], "directions": ["denoising"]},
    "linear_probe": {"dataset": {"generator": "capitals", "label": "group", "group": "country",
                                 "drop_small_classes": True}, "position": "SUBJ", "layers": [0, 1], "bootstrap": 20},
    "token_trace": {**_ROWS, "row": 1, "key_max_tokens": 128, "top_neurons": 2, "key_contexts": 1},
    "sae_features": {**_ROWS, "position": "END", "sae": {"train": TINY_SAE_TRAIN}, "top_k": 3},
    "attribution_graph": {**_ROWS, "transcoders": {"train": TINY_TC}, "verify": {"top_k": 2, "n_random": 2},
                          "cards": {"features": 2, "contexts": 1, "corpus_tokens": 128}, "main_path": 3},
    "head_scan": {**_ROWS, "seq_len": 8, "n_seqs": 2},
    "attribution_patching": {**_ROWS, "sites": ["head_out", "resid_pre"], "positions": ["S2", "END"],
                             "verify": {"top_k": 3, "n_random": 3}},
    "edge_attribution": {**_ROWS, "method": "eap_ig", "ig_steps": 2, "verify": {"top_k": 3, "n_random": 3}},
    "path_patching": {**_ROWS, "senders": ["a0.h*", ["a0.h1", "m0"]], "receivers": ["a2.h1", "logits"]},
    "circuit": {**_ROWS, "scores": {"method": "eap"}, "sizes": [0.05, 0.2, 0.5], "bootstrap": 20},
    "patchscope": {**_ROWS, "position": "S2", "hidden_states": [0, 3], "top_k": 3, "n_generate": 2},
    "activations": {**_ROWS, "position": "END", "hooks": ["blocks.0.hook_resid_post"],
                    "path": str(_STORE_DIR) + "-rows", "overwrite": True},
    "steering": {**_ROWS, "position": "END", "steer_at": ["IO"],
                 "vector": {"source": "mean_difference", "positive": ["The capital of Italy"],
                            "negative": ["The capital of France"]}, "layer": 1, "alphas": [0, 2],
                 "controls": {"n_random": 1}},
    "causal_tracing": {**_ROWS, "subject": {"position": "S2"}, "window": 2, "n_samples": 1},
}


def where_encoded() -> tuple[bool, str]:
    """For :func:`counting_encodes`: ``(inside a kind's prepare, module of the first caller outside
    tracekit.tokens)`` of the ``encode`` call being counted."""
    f = sys._getframe(2)
    caller = None
    in_prepare = False
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if caller is None and mod != "tracekit.tokens":
            caller = mod
        if f.f_code.co_name == "prepare" and mod.startswith("tracekit.experiments"):
            in_prepare = True
        f = f.f_back
    return in_prepare, caller or "?"


def counting_encodes(mp) -> list[tuple[str, bool, str]]:
    """Count every tokenization of a text (through ``mp``, a ``pytest.MonkeyPatch``): every call of
    :func:`tracekit.tokens.text_ids`, the one place a text meets the tokenizer (``encode`` and the
    dataset door call it); a list of ``(text, in_prepare, caller module)``, one per call, that grows
    while ``mp`` is active."""
    import tracekit.tokens as T

    orig = T.text_ids
    calls: list[tuple[str, bool, str]] = []

    def counting(model, text, *args, **kwargs):
        calls.append((text, *where_encoded()))
        return orig(model, text, *args, **kwargs)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("tracekit") and getattr(mod, "text_ids", None) is orig:
            mp.setattr(mod, "text_ids", counting)
    return calls


def param_checksum(model) -> float:
    """The sum of every parameter, in float64 (unchanged by a run that leaves the weights alone)."""
    return float(sum(p.double().sum() for p in model.parameters()))


@dataclass
class KindRun:
    """One run of a kind's :data:`KIND_EXAMPLES` config on the tiny GPT-2 (:func:`kind_run`), shared by
    the tests that assert on it: the result, the parameters' checksum and the hooks before and after,
    and every ``encode`` call during the run (:func:`counting_encodes`)."""

    result: Any
    checksum_before: float
    checksum_after: float
    hooks_before: dict
    hooks_after: dict
    encodes: list = field(default_factory=list)


_KIND_RUNS: dict[str, KindRun] = {}


def kind_run(kind: str) -> KindRun:
    """Run ``kind``'s :data:`KIND_EXAMPLES` config once per test session on ``make_tiny("gpt2")`` (a
    fresh validated config, after the bridge's first forward, as a run without a check), recording the
    checksum, hooks and ``encode`` calls around it. tests/integration/test_kinds.py (round trip, no
    state left), test_prepare_once.py (tokenized once) and test_notebook.py (display) assert on it."""
    if kind in _KIND_RUNS:
        return _KIND_RUNS[kind]
    import pytest

    from tracekit.experiments.base import REGISTRY

    model = make_tiny("gpt2")
    exp = REGISTRY[kind].model_validate({"kind": kind, **KIND_EXAMPLES[kind]})
    model(torch.tensor([[464, 3139]]))  # the bridge wires its own capture hooks on a first forward
    before, hooks = param_checksum(model), hook_keys(model)
    with pytest.MonkeyPatch.context() as mp:
        calls = counting_encodes(mp)
        res = exp.run(model, progress=False)
    _KIND_RUNS[kind] = KindRun(res, before, param_checksum(model), hooks, hook_keys(model), list(calls))
    return _KIND_RUNS[kind]


def hook_keys(model) -> dict:
    """Every torch hook registered on every module (for before/after comparisons)."""
    from tracekit.hooks import _library_internal  # the libraries' own lazily wired hooks are not ours

    out = {}
    for name, mod in model.named_modules():
        keys = set()
        for d in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            keys |= {(d, k) for k, fn in (getattr(mod, d, {}) or {}).items() if not _library_internal(fn)}
        tl = getattr(mod, "fwd_hooks", None)
        if tl:
            keys |= {("tl", id(h)) for h in tl}
        out[name] = keys
    return out


def quiet(*a, **k):
    """A ``log`` that prints nothing."""


class one_thread:
    """``with one_thread():`` torch on one thread (sweep tests time points against each other)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)
