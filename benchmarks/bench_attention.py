"""Benchmark: the attention_pattern kind over every layer of a dataset vs one batched forward pass
that caches every layer's attention pattern.

In one process, on the embedded model (``tracekit.load_model()``: SmolLM2-135M, 30 layers x 9 heads,
float32, CPU) and 12 IOI rows (``DatasetSpec(generator={"name": "ioi", "n": 12})``):

* kind: ``tracekit.AttentionPattern(dataset=..., query="END", keys=["IO", "S1", "S2"]).run(model)``
  (every layer and head; dataset prepared, tables built; figures not drawn);
* baseline: ``model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))`` on
  the same padded batch of the 12 rows (the patterns only: no tables, no per-row positions);
* old (``--old``, default on): the previous kind's approach for ONE layer, ``attention_pattern(model,
  prompt, layer)`` per prompt (one forward pass per prompt and per layer; 30 layers cost 30x this).

The kind and the baseline are warmed up once, then timed ``--repeats`` times, interleaved (best
time kept; the machine's load moves single timings a lot); the old approach is timed once. The kind's
weights are checked against the baseline's cache (max abs difference at every row's END query over
its real keys). Last line: ``ratio <kind/baseline>x max_abs_diff <value>``.

    python benchmarks/bench_attention.py [--threads 2] [--n 12] [--repeats 3] [--no-old]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads, same for every side")
    ap.add_argument("--n", type=int, default=12, help="IOI rows")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of the kind and the baseline (best kept)")
    ap.add_argument("--no-old", action="store_true", help="skip the per-layer (old) approach")
    a = ap.parse_args(argv)

    import torch

    import tracekit as tk
    from tracekit.attention import attention_pattern, padded_batch
    from tracekit.dataset import DatasetSpec

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = tk.load_model()
    print(f"model loaded in {time.perf_counter() - t0:.1f}s: {model.cfg.n_layers} layers x {model.cfg.n_heads} heads")
    spec = {"generator": {"name": "ioi", "n": a.n}}
    data = DatasetSpec(**spec).prepare(model)
    batch = padded_batch(model, data.ids)
    kw = {"attention_mask": batch.attention_mask} if batch.needs_mask else {}
    print(f"{len(data)} IOI rows, padded batch {tuple(batch.tokens.shape)} ({batch.padding_side} padding)")
    kind = tk.AttentionPattern(dataset=spec, query="END", keys=["IO", "S1", "S2"])

    def run_kind():
        return kind.run(model, progress=False)

    @torch.no_grad()
    def run_baseline():
        return model.run_with_cache(batch.tokens, names_filter=lambda n: n.endswith("hook_pattern"), **kw)

    def run_old():
        return [attention_pattern(model, p, 0) for p in data.prompts]

    sides = {"kind": run_kind, "baseline": run_baseline}
    out = {name: fn() for name, fn in sides.items()}  # warm-up
    best = {name: float("inf") for name in sides}
    for _ in range(a.repeats):
        for name, fn in sides.items():
            t = time.perf_counter()
            out[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t)
    if not a.no_old:  # slow: timed once (its first call above was no warm-up of the kind's own code)
        t = time.perf_counter()
        run_old()
        best["old, one layer"] = time.perf_counter() - t

    # the same numbers: the kind's END row vs the baseline's cache at each row's END (real keys)
    res, (_, cache) = out["kind"], out["baseline"]
    pat = res.tables["pattern"]
    diff = 0.0
    for i, e in enumerate(data.examples):
        o, q = batch.offsets[i], e.positions["END"]
        mine = pat[pat["row_id"] == e.row_id]
        for L in range(int(model.cfg.n_layers)):
            want = cache[f"blocks.{L}.attn.hook_pattern"][i, :, o + q, o: o + q + 1].float().cpu()
            got = torch.tensor(mine[mine["layer"] == L].pivot(index="head_idx", columns="key_pos",
                                                               values="weight").to_numpy())
            diff = max(diff, float((got - want).abs().max()))
    for name, t in best.items():
        print(f"{name:>16}: {t:7.2f} s")
    if "old, one layer" in best:
        n_l = int(model.cfg.n_layers)
        print(f"{'old, all layers':>16}: ~{best['old, one layer'] * n_l:7.1f} s (one layer x {n_l}, estimated)")
    ratio = best["kind"] / best["baseline"]
    print(f"ratio {ratio:.2f}x max_abs_diff {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
