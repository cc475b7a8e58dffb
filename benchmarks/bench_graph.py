"""Attribution graphs at three prompt lengths: wall time, backward passes, peak memory, pruned size, verification.

For each prompt (``--lengths``: ``paris`` = the seed prompt "The capital of China is Beijing. The
capital of France is" -> " Paris" vs " Beijing"; an integer N = N tokens: Python-docs prose from
:mod:`tracekit.corpus` ahead of " The capital of France is", so the target and foil are the same):

* ``build_s``: :func:`tracekit.graphs.attribution.build_graph` wall time (the adjacency: batched
  backward passes through the frozen local replacement model); ``backward_passes`` (the engine's
  count, ``graph.settings``);
* ``prune_s`` / ``verify_s``: :func:`tracekit.graphs.prune.prune_graph` + ``graph_scores``, and
  :func:`tracekit.graphs.verify.verify_graph` (top-k + random features ablated in the real model);
* ``peak_gib``: CPU: the process' RSS polled every 2 ms by a thread (psutil), peak minus the RSS
  before the graph (the graph's working memory), plus the absolute peak; CUDA:
  ``torch.cuda.max_memory_allocated`` minus the memory allocated before;
* ``n_features`` / ``n_nodes`` and ``pruned_nodes`` / ``pruned_edges`` after pruning (node
  threshold 0.8, edge threshold 0.98, as circuit-tracer);
* verification: ``logits_max_abs_error``, ``completeness_max_abs_error``, ``pearson``,
  ``spearman``, ``sign_agreement``, ``replacement_score`` / ``completeness_score`` (pruned).

Each prompt is measured once (one run; a graph is minutes on the real model, and the first run of a
process pays the lazy imports: ``--warmup`` builds the Paris graph once before). The last printed
line is ``graph_s <s> peak_gib <g> verify_spearman <r>``: the build + prune + verify seconds of the
longest prompt measured, the largest working-memory peak over the prompts (GiB), and the smallest
Spearman correlation of predicted vs measured effects over the prompts (the worst case of each).

Models: the real run uses the embedded SmolLM2-135M and the transcoders of
``experiments/transcoders_smollm2.yaml`` (trained on first use and cached; later runs load them);
``--quick`` uses a tiny random GPT-2 (3 layers, d_model 64) and random TopK transcoders, in seconds
(what ``tests/unit/test_bench_graph.py`` runs).

    python benchmarks/bench_graph.py --quick
    python benchmarks/bench_graph.py --lengths paris,256            # real model, CPU
    python benchmarks/bench_graph.py --device cuda --lengths paris,256,1024 --json results/graph.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARIS = "The capital of China is Beijing. The capital of France is"
TAIL = " The capital of France is"
TARGET, FOIL = " Paris", " Beijing"
GIB = 1024 ** 3


class Peak:
    """Peak memory of a block: CUDA ``max_memory_allocated``, else the polled RSS (psutil)."""

    def __init__(self, device: str):
        self.device = device
        self.base = self.peak = self.work = 0

    def __enter__(self) -> "Peak":
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        import psutil

        self._proc = psutil.Process()
        self.base = self._max = self._proc.memory_info().rss
        self._stop = threading.Event()

        def poll():
            while not self._stop.is_set():
                self._max = max(self._max, self._proc.memory_info().rss)
                self._stop.wait(0.002)

        self._t = threading.Thread(target=poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._t.join()
            self.peak = max(self._max, self._proc.memory_info().rss)
        self.work = max(self.peak - self.base, 0)


def long_prompt(model, n_tokens: int) -> str:
    """``n_tokens`` tokens (BOS included when the model prepends one) of stdlib prose ending in
    :data:`TAIL`."""
    from tracekit.corpus import stdlib_documents
    from tracekit.tokens import encode

    tail = len(encode(model, TAIL, prepend_bos=False))
    bos = len(encode(model, "x")) - len(encode(model, "x", prepend_bos=False))
    need = n_tokens - tail - bos
    text, ids = "", []
    for _, doc in stdlib_documents():
        text += doc + "\n\n"
        ids = encode(model, text, prepend_bos=False)
        if len(ids) >= need:
            break
    body = model.tokenizer.decode(ids[:need])
    # a decode/encode round trip may merge tokens differently: trim until the prompt has n_tokens
    for _ in range(8):
        got = len(encode(model, body + TAIL))
        if got == n_tokens:
            break
        cut = encode(model, body, prepend_bos=False)
        body = model.tokenizer.decode(cut[:len(cut) - (got - n_tokens)] if got > n_tokens else cut)
        if got < n_tokens:
            break
    return body + TAIL


def quick_setup(device: str):
    """A tiny random GPT-2 (3 layers, d_model 64, context 256) and random TopK transcoders (96
    features, 4 active per token) on every block, seeded."""

    from tracekit.model.load import load_model
    from tracekit.model.spec import ModelSpec

    spec = ModelSpec(name="gpt2", random_init=True, tokenizer=str(ROOT / "tracekit" / "data" / "gpt2-bpe"),
                     config_overrides={"n_layer": 3, "n_embd": 64, "n_head": 4, "n_positions": 256},
                     prepend_bos=True, seed=0, device=device)
    model = load_model(spec)
    return model, random_transcoders(model, d_sae=96, seed=0)


def random_transcoders(model, d_sae: int, seed: int = 0, k: int = 4):
    """A seeded random TopK (``k`` active features per token, skip-less) transcoder per block, reading and writing the hooks the
    transcoder trainer uses (:func:`tracekit.dictionaries.spec.transcoder_hooks`, the default pair)."""
    import torch

    from tracekit.dictionaries import Dictionary, DictionarySet
    from tracekit.dictionaries.spec import TranscoderTrainSpec, transcoder_hooks

    g = torch.Generator().manual_seed(seed)
    d_model = int(model.cfg.d_model)
    dev = next(model.parameters()).device
    out = {}
    for layer in range(int(model.cfg.n_layers)):
        hook_in, hook_out = transcoder_hooks(model, layer, TranscoderTrainSpec())
        d = Dictionary(d_model, d_sae, d_model, activation="topk", k=k, hook_in=hook_in, hook_out=hook_out,
                       layer=layer)
        with torch.no_grad():
            d.W_enc.copy_(torch.randn(d_model, d_sae, generator=g) / math.sqrt(d_model))
            d.b_enc.copy_(0.1 * torch.randn(d_sae, generator=g))
            d.W_dec.copy_(torch.randn(d_sae, d_model, generator=g) / math.sqrt(d_sae))
            d.b_dec.copy_(0.1 * torch.randn(d_model, generator=g))
        out[layer] = d.to(dev)
    return DictionarySet(out, {"kind": "random", "seed": seed, "d_sae": d_sae})


def real_setup(device: str, progress: bool):
    """The model of ``experiments/paris_graph_smollm2.yaml`` (the embedded SmolLM2-135M, its spec:
    BOS, dtype, on ``device``) and the transcoders of its ``transcoders`` block, the same training
    spec as ``experiments/transcoders_smollm2.yaml``: trained on first use, then loaded from the
    cache that both configs share (its key holds the model spec, so the model is loaded as they do)."""
    import tracekit as tk
    from tracekit.dictionaries.spec import TranscoderSpec
    from tracekit.dictionaries.train import load_transcoders

    cfg = shipped_config()
    model = tk.load_model({**cfg["model"], "device": device})
    spec = TranscoderSpec.model_validate(shipped_transcoder_spec())
    t0 = time.perf_counter()
    loaded = load_transcoders(spec, model, progress=progress)
    print(f"transcoders {'loaded from the cache' if loaded.cache_hit else 'trained'} in "
          f"{time.perf_counter() - t0:.1f} s: {loaded.path}", flush=True)
    return model, loaded.dictionaries


def shipped_config() -> dict:
    """``experiments/paris_graph_smollm2.yaml`` as a dict."""
    import yaml

    return yaml.safe_load((ROOT / "experiments" / "paris_graph_smollm2.yaml").read_text())


def shipped_transcoder_spec() -> dict:
    """The ``transcoders`` block of ``experiments/paris_graph_smollm2.yaml`` (the same training spec
    as ``experiments/transcoders_smollm2.yaml``, so they share the cache)."""
    step = next(s for s in shipped_config()["experiments"] if s.get("kind") == "attribution_graph")
    return step["transcoders"]


def measure(model, dset, prompt: str, label: str, device: str, *, top_k: int, n_random: int,
            max_feature_nodes: Optional[int], batch_size: Optional[int]) -> dict:
    """One graph: built, pruned, scored and verified, each timed; memory over the whole."""
    import gc

    import torch

    from tracekit.graphs.attribution import build_graph
    from tracekit.graphs.prune import graph_scores, prune_graph
    from tracekit.graphs.verify import verify_graph
    from tracekit.tokens import encode, single_token_id

    ids = torch.tensor(encode(model, prompt), dtype=torch.long)
    target, foil = single_token_id(model, TARGET), single_token_id(model, FOIL)
    gc.collect()
    with Peak(device) as mem:
        t0 = time.perf_counter()
        g = build_graph(model, dset, ids, prompt=prompt, target=target, foil=foil,
                        max_feature_nodes=max_feature_nodes, batch_size=batch_size)
        t1 = time.perf_counter()
        pr = prune_graph(g, node_threshold=0.8, edge_threshold=0.98)
        scores = graph_scores(g, pr)
        t2 = time.perf_counter()
        v = verify_graph(model, dset, g, top_k=top_k, n_random=n_random, seed=0, mode="ablate")
        t3 = time.perf_counter()
    summ = (v.get("intervention") or {}).get("summary") or {}
    pruned = scores.get("pruned") or {}
    rec = {"prompt": label, "n_tokens": int(ids.numel()), "max_feature_nodes": max_feature_nodes, "build_s": t1 - t0, "prune_s": t2 - t1,
           "verify_s": t3 - t2, "total_s": t3 - t0,
           "backward_passes": _first(g.settings, ("backward_passes", "n_backward", "n_backward_passes")),
           "peak_gib": mem.work / GIB, "peak_abs_gib": mem.peak / GIB,
           "n_features": g.n_features, "n_nodes": g.n_nodes,
           "pruned_nodes": int(torch.as_tensor(pr.node_mask).sum()),
           "pruned_edges": pruned.get("n_edges", int(torch.as_tensor(pr.edge_mask).sum())),
           "logits_max_abs_error": g.verification.get("logits_max_abs_error"),
           "completeness_max_abs_error": g.verification.get("completeness_max_abs_error"),
           "pearson": summ.get("pearson"), "spearman": summ.get("spearman"),
           "sign_agreement": summ.get("sign_agreement"), "n_checked": len((v.get("intervention") or {}).get("table", [])),
           "replacement_score": pruned.get("replacement"), "completeness_score": pruned.get("completeness"),
           "replacement_score_unpruned": scores.get("replacement"),
           "completeness_score_unpruned": scores.get("completeness")}
    del g, pr
    return rec


def _first(d: dict, keys) -> Any:
    for k in keys:
        if k in d:
            return d[k]
    return None


def _fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random GPT-2 + random transcoders (seconds)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--lengths", default=None,
                    help="comma-separated: 'paris' and/or token counts (default: paris,256,1024; quick: paris,48)")
    ap.add_argument("--top-k", type=int, default=10, help="verification: top features by influence ablated")
    ap.add_argument("--n-random", type=int, default=10, help="verification: random features ablated")
    ap.add_argument("--max-feature-nodes", type=int, default=None,
                    help="cap on feature nodes (default: 2048 on the real model, as the shipped config; all in --quick)")
    ap.add_argument("--batch-size", type=int, default=None, help="backward-pass batch (default: the budget's)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--warmup", action="store_true", help="build the Paris graph once before measuring")
    ap.add_argument("--json", default=None, help="write every measurement to this JSON file")
    a = ap.parse_args(argv)

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    lengths = (a.lengths or ("paris,48" if a.quick else "paris,256,1024")).split(",")
    t0 = time.perf_counter()
    model, dset = quick_setup(a.device) if a.quick else real_setup(a.device, progress=True)
    print(f"model {getattr(model.cfg, 'model_name', '?')} ({int(model.cfg.n_layers)} layers, d_model "
          f"{int(model.cfg.d_model)}) and {len(dset)} transcoders ready in {time.perf_counter() - t0:.1f} s on "
          f"{a.device}", flush=True)
    mfn = a.max_feature_nodes if a.max_feature_nodes is not None else (None if a.quick else 2048)
    kw = dict(top_k=a.top_k, n_random=a.n_random, max_feature_nodes=mfn, batch_size=a.batch_size)
    if a.warmup:
        measure(model, dset, PARIS, "warmup", a.device, **kw)
    recs = []
    for item in lengths:
        item = item.strip()
        prompt = PARIS if item == "paris" else long_prompt(model, int(item))
        rec = measure(model, dset, prompt, item, a.device, **kw)
        recs.append(rec)
        print(" ".join(f"{k} {_fmt(v)}" for k, v in rec.items()), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"device": a.device, "quick": a.quick, "points": recs}, indent=2))
    longest = max(recs, key=lambda r: r["n_tokens"])
    sp = [r["spearman"] for r in recs if r["spearman"] is not None and math.isfinite(r["spearman"])]
    spearman = min(sp) if sp else float("nan")
    print(f"graph_s {longest['total_s']:.2f} peak_gib {max(r['peak_gib'] for r in recs):.3f} "
          f"verify_spearman {spearman:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
