"""The on-disk cache of dequantised GGUF weights (tracekit.model.weights_cache).

Fast tests drive the cache with tiny random Hugging Face models standing in for a dequantised GGUF
(the key hashes the file's bytes, so any file stands in for the GGUF); the slow test goes through
``load_model`` on the real embedded GGUF. Every test points ``TRACEKIT_CACHE_DIR`` at a temporary
folder: the user's real cache is never touched.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from helpers import GPT2_BPE
from tracekit.model import weights_cache as cache

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["The capital of France is", " Paris", "héllo wörld\n\n  x"]


def _tiny(arch: str = "llama"):
    """A fresh copy of a tiny random HF causal LM + GPT-2's tokenizer (a stand-in for a dequantised GGUF)."""
    hf, tok = _prototype(arch)
    return copy.deepcopy(hf), tok


@functools.cache
def _prototype(arch: str, seed: int = 0):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPT2TokenizerFast,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tok = GPT2TokenizerFast.from_pretrained(GPT2_BPE)
    torch.manual_seed(seed)
    # tracekit's own GGUF conversion builds eager attention (as the cache does); so does this stand-in
    if arch == "llama":  # tied embeddings, GQA, rotary buffers
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=True, attn_implementation="eager")
        hf = LlamaForCausalLM(cfg)
    else:  # Conv1D, biases, learned positions
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_layer=2, n_embd=32, n_head=4, n_positions=64,
                                        attn_implementation="eager"))
    return hf.eval(), tok


def _logits(hf, tok) -> torch.Tensor:
    ids = torch.tensor([tok("The capital of France is Paris, of Italy Rome")["input_ids"]])
    with torch.no_grad():
        return hf(ids).logits


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "tkcache"
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(root))
    monkeypatch.delenv("TRACEKIT_CACHE", raising=False)
    return root


@pytest.fixture
def fake_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return p


class _Convert:
    """A ``convert`` callable that counts its calls and returns a fresh tiny model each time."""

    def __init__(self, arch: str = "llama"):
        self.arch, self.calls = arch, 0

    def __call__(self):
        self.calls += 1
        return _tiny(self.arch)


def _in_mapping(t: torch.Tensor, path: Path) -> bool:
    """Whether a tensor's bytes lie in a memory mapping of ``path`` (Linux /proc/self/maps)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    ptr = t.data_ptr()
    for line in maps.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[-1] == str(path.resolve()):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def _entry(fake_gguf) -> Path:
    key, _ = cache.gguf_cache_key(fake_gguf, torch.float32)
    return cache.entry_path(key)


def test_cache_dir_location(monkeypatch, tmp_path):
    monkeypatch.delenv("TRACEKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "tracekit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == Path.home() / ".cache" / "tracekit"
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_first_load_writes_second_reads_bit_identical(cache_root, fake_gguf, arch):
    conv = _Convert(arch)
    hf1, tok1 = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 1
    entry = _entry(fake_gguf)
    man = json.loads((entry / "manifest.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer/tokenizer.json"} <= set(man["files"])
    assert man["identity"]["gguf_sha256"] == cache.file_sha256(fake_gguf)
    assert set(man["identity"]["versions"]) == {"transformers", "gguf", "torch"}

    hf2, tok2 = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 1, "the second load must read the cache, not convert"
    assert type(hf2) is type(hf1)
    assert torch.equal(_logits(hf1, tok1), _logits(hf2, tok2))
    for (n1, t1), (n2, t2) in zip(sorted(hf1.state_dict().items()), sorted(hf2.state_dict().items())):
        assert n1 == n2 and torch.equal(t1, t2), n1
    for (n1, b1), (n2, b2) in zip(sorted(hf1.named_buffers()), sorted(hf2.named_buffers())):
        assert n1 == n2 and torch.equal(b1, b2), n1
    for s in TEXTS:
        assert tok1(s)["input_ids"] == tok2(s)["input_ids"]
    assert (tok1.bos_token, tok1.eos_token, len(tok1)) == (tok2.bos_token, tok2.eos_token, len(tok2))
    if arch == "llama":  # tied: one tensor, as in the original
        assert hf2.lm_head.weight is hf2.model.embed_tokens.weight
    # memory-mapped from the entry's file, not copied
    assert all(_in_mapping(p, _entry(fake_gguf) / "model.safetensors") for p in hf2.parameters())


def test_writes_to_loaded_weights_never_reach_the_file(cache_root, fake_gguf):
    conv = _Convert()
    hf1, tok = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    ref = _logits(hf1, tok)
    hf2, _ = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    with torch.no_grad():
        for p in hf2.parameters():
            p.add_(1.0)
    hf3, _ = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 1
    assert torch.equal(_logits(hf3, tok), ref)


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "drop_manifest", "edit_manifest", "drop_tokenizer"])
def test_corrupt_entry_is_detected_and_rebuilt(cache_root, fake_gguf, damage):
    conv = _Convert()
    hf1, tok = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    ref = _logits(hf1, tok)
    entry = _entry(fake_gguf)
    weights = entry / "model.safetensors"
    if damage == "truncate":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "flip_byte":  # same size: only the sha256 catches it
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "drop_manifest":
        (entry / "manifest.json").unlink()
    elif damage == "edit_manifest":  # an entry recorded for another GGUF under this key
        man = json.loads((entry / "manifest.json").read_text())
        man["identity"]["gguf_sha256"] = "0" * 64
        (entry / "manifest.json").write_text(json.dumps(man))
    else:
        (entry / "tokenizer" / "tokenizer.json").unlink()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        hf2, tok2 = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 2, "a damaged entry must be rebuilt, never used"
    assert any("invalid" in str(x.message) for x in w)
    assert torch.equal(_logits(hf2, tok2), ref)
    hf3, tok3 = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)  # the rebuilt entry is good
    assert conv.calls == 2
    assert torch.equal(_logits(hf3, tok3), ref)


def test_version_change_or_other_gguf_or_dtype_is_a_miss(cache_root, fake_gguf, monkeypatch):
    conv = _Convert()
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    k0, _ = cache.gguf_cache_key(fake_gguf, torch.float32)
    assert cache.gguf_cache_key(fake_gguf, torch.bfloat16)[0] != k0
    real = cache.conversion_versions()
    monkeypatch.setattr(cache, "conversion_versions", lambda: {**real, "transformers": "0.0.0"})
    assert cache.gguf_cache_key(fake_gguf, torch.float32)[0] != k0
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 2
    monkeypatch.setattr(cache, "conversion_versions", lambda: real)
    with open(fake_gguf, "ab") as f:  # same path, new content
        f.write(b"x")
    assert cache.gguf_cache_key(fake_gguf, torch.float32)[0] != k0
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 3


def test_cache_off_and_unwritable_dir(cache_root, fake_gguf, monkeypatch, tmp_path):
    conv = _Convert()
    monkeypatch.setenv("TRACEKIT_CACHE", "off")
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 2 and not cache_root.exists()
    monkeypatch.delenv("TRACEKIT_CACHE")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(blocker / "sub"))
    with pytest.warns(UserWarning, match="could not write its weight cache"):
        hf, _ = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 3 and hf is not None


_WRITER = textwrap.dedent("""
    import hashlib, sys, time
    from pathlib import Path
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests", sys.argv[1] + "/tests/integration"]
    import torch
    from tracekit.model import weights_cache as cache
    from test_cache import _tiny, _logits
    barrier = Path(sys.argv[3])
    (barrier / f"ready-{sys.argv[4]}").touch()
    t0 = time.time()
    while len(list(barrier.glob("ready-*"))) < 2 and time.time() - t0 < 120:
        time.sleep(0.05)
    calls = []
    def convert():
        calls.append(1)
        time.sleep(0.5)  # widen the window in which both processes write
        return _tiny("llama")
    hf, tok = cache.load_or_convert_gguf(sys.argv[2], torch.float32, convert)
    lg = _logits(hf, tok)
    print("converted", len(calls), "logits", hashlib.sha256(lg.numpy().tobytes()).hexdigest())
""")


@pytest.mark.slow  # two fresh interpreters importing transformers: ~20 s of CPU
def test_concurrent_writers_do_not_corrupt(cache_root, fake_gguf, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    env = {**os.environ, "TRACEKIT_CACHE_DIR": str(cache_root), "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(script), str(ROOT), str(fake_gguf), str(barrier), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(out.strip().splitlines()[-1])
    hashes = {o.split()[-1] for o in outs}
    assert len(hashes) == 1, outs
    root = cache_root / "gguf"
    assert [d.name for d in root.iterdir() if d.name.startswith(".")] == [], "temporary folders left behind"
    assert len(list(root.iterdir())) == 1
    conv = _Convert()
    hf, tok = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 0, "the entry the two writers left must be valid"
    import hashlib

    assert hashlib.sha256(_logits(hf, tok).numpy().tobytes()).hexdigest() in hashes


def test_cli_cache_list_and_clear(cache_root, fake_gguf, capsys):
    from tracekit.cli import main

    assert main(["cache"]) == 0
    assert "(empty)" in capsys.readouterr().out
    cache.load_or_convert_gguf(fake_gguf, torch.float32, _Convert())
    key, _ = cache.gguf_cache_key(fake_gguf, torch.float32)
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert key in out and "MiB" in out and "float32" in out and "created" in out and "invalid" not in out
    assert main(["cache", "clear"]) == 0
    assert "weights: 1 entry" in capsys.readouterr().out
    assert cache.list_entries() == []


def test_peak_memory_reports_the_high_water_mark():
    """In a fresh interpreter (small baseline): touching 200 MiB raises the peak by about that."""
    code = ("import importlib.util as u, json, sys; s = u.spec_from_file_location('r', sys.argv[1]); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "b = m.peak_memory(); x = b\"\\x01\" * (200 * 2**20); a = m.peak_memory(); print(json.dumps([b, a]))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "tracekit" / "resources.py")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    before, after = json.loads(r.stdout)
    assert 0 < before["rss_mib"] <= before["peak_rss_mib"] + 1
    assert 190 <= after["peak_rss_mib"] - before["peak_rss_mib"] <= 230
    assert "cuda_peak_mib" not in after  # CUDA never initialised here


@pytest.mark.slow
def test_embedded_model_warm_load_is_bit_identical_and_fast(tmp_path, monkeypatch):
    """Through load_model on the real GGUF: the cold load writes the entry, a warm load (fresh
    in-process caches) reads it and gives bit-identical logits, faster."""
    from tracekit.model import load as models
    from tracekit.tokens import tokenize

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "c"))
    saved = dict(models._CACHE), dict(models._WEIGHTS)
    try:
        models.clear_cache()
        t0 = time.perf_counter()
        cold = models.load_model("smollm2-135m", device="cpu")
        t_cold = time.perf_counter() - t0
        assert len(cache.list_entries()) == 1
        models.clear_cache()
        t0 = time.perf_counter()
        warm = models.load_model("smollm2-135m", device="cpu")
        t_warm = time.perf_counter() - t0
        assert warm is not cold
        toks = tokenize(warm, ["The capital of China is Beijing. The capital of France is"]).tokens
        assert torch.equal(toks, tokenize(cold, ["The capital of China is Beijing. The capital of France is"]).tokens)
        with torch.no_grad():
            assert torch.equal(cold(toks), warm(toks))
        # specs differing only in process_weights still share the (memory-mapped) weights in-process
        raw = models.load_model("smollm2-135m", device="cpu", process_weights=False)
        state = models._WEIGHTS[raw.tracekit_spec.weights_key()][1]
        entry = Path(cache.list_entries()[0]["path"])
        assert _in_mapping(state["model.embed_tokens.weight"], entry / "model.safetensors")
        with torch.no_grad():
            torch.testing.assert_close(raw(toks).log_softmax(-1), warm(toks).log_softmax(-1), atol=1e-4, rtol=0)
        assert t_warm < t_cold, (t_cold, t_warm)  # loose: shared CI machines; benchmarks/bench_load.py measures
    finally:
        models.clear_cache()
        models._CACHE.update(saved[0])
        models._WEIGHTS.update(saved[1])


def test_runner_records_peak_memory(tmp_path, tiny_gpt2):
    """environment.json carries the process's peak memory (tracekit.resources.peak_memory)."""
    from tracekit.config import parse_config
    from tracekit.runner import run_config

    cfg = parse_config({"model": {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "device": "cpu"},
                        "experiments": [{"kind": "logit_lens", "prompts": "The capital of France is"}]})
    run_dir, _ = run_config(cfg, tmp_path, model=tiny_gpt2, progress=False, log=lambda *a: None)
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["peak_memory"]["peak_rss_mib"] > 0
    assert env["peak_memory"]["peak_rss_mib"] + 1 >= env["peak_memory"]["rss_mib"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_processed_weights_cache_gives_the_same_bridge(cache_root, fake_gguf, arch):
    """TransformerLens' processed weights, stored next to the entry on the first bridge and
    memory-mapped on the next, give a bridge with bit-identical parameters and logits; the original
    weights' file is never written; a damaged processed cache is recomputed, never used."""
    from tracekit.model.load import wrap_hf_model
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name="tiny-cached", process_weights=True)
    conv = _Convert(arch)
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)  # writes the entry
    entry = _entry(fake_gguf)
    before = cache.file_sha256(entry / "model.safetensors", memo=False)

    def bridge(expect_hit: bool):
        hf, tok = cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
        assert hf.__dict__["_tracekit_cache_entry"] == str(entry)
        from tracekit.model import load as c

        seen = {}
        real = c.processed_weights_cache

        class Spy(real):
            def __exit__(self, *exc):
                seen["hits"], seen["stores"] = self.hits, self.stores
                return super().__exit__(*exc)
        c.processed_weights_cache = Spy
        try:
            b = wrap_hf_model(hf, tok, spec)
        finally:
            c.processed_weights_cache = real
        assert seen == ({"hits": 1, "stores": 0} if expect_hit else {"hits": 0, "stores": 1}), seen
        return b

    b1 = bridge(expect_hit=False)
    (proc,) = list(entry.glob("processed-*"))
    b2 = bridge(expect_hit=True)
    hf_ref, tok = _tiny(arch)  # processed without any cache
    ref = wrap_hf_model(hf_ref, tok, spec, cache_entry=None)
    ids = torch.tensor([tok("The capital of France is Paris, of Italy Rome")["input_ids"]])
    with torch.no_grad():
        want = ref(ids)
        for b in (b1, b2):
            sd, sr = b.state_dict(), ref.state_dict()
            assert sorted(sd) == sorted(sr)
            for k in sr:
                assert torch.equal(sd[k], sr[k]), k
            assert torch.equal(b(ids), want)
    assert cache.file_sha256(entry / "model.safetensors", memo=False) == before
    # damage the processed weights: detected, recomputed (a store, not a hit), same result
    with open(proc / "weights.safetensors", "r+b") as f:
        f.seek(-16, os.SEEK_END)
        f.write(b"\xff" * 16)
    b3 = bridge(expect_hit=False)
    with torch.no_grad():
        assert torch.equal(b3(ids), want)


def test_deferred_checks_catch_a_damaged_entry(cache_root, fake_gguf):
    """Under ``deferred_checks`` (what load_model uses) the weights' sha256 is checked in the
    background; an intact entry passes, a damaged one fails all_ok(), is removed, and the next
    load converts again."""
    conv = _Convert("llama")
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    entry = _entry(fake_gguf)
    with cache.deferred_checks() as checks:
        cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert len(checks.checks) == 1 and checks.all_ok() and conv.calls == 1
    with open(entry / "model.safetensors", "r+b") as f:  # same size, other bytes
        f.seek(-16, os.SEEK_END)
        f.write(b"\xff" * 16)
    with cache.deferred_checks() as checks:
        cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 1  # returned before the check finished
    with pytest.warns(UserWarning, match="sha256"):
        assert not checks.all_ok()
    assert not entry.exists()
    cache.load_or_convert_gguf(fake_gguf, torch.float32, conv)
    assert conv.calls == 2
