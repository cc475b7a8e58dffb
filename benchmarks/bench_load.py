"""Benchmark: cold vs warm load of a GGUF model (the embedded SmolLM2-135M by default).

Each load runs in a fresh interpreter (what a user's ``tracekit run`` pays), against a fresh,
empty temporary cache folder (``TRACEKIT_CACHE_DIR``; the user's cache is never touched):

* cold: the cache is empty, ``transformers`` dequantises the GGUF and converts its tokenizer, the
  entry is written;
* warm: the entry exists, weights are memory-mapped, the tokenizer is read from ``tokenizer.json``.

The time of one load is ``tracekit.load_model(...)`` inside the child (imports excluded, reported
apart), plus the child's whole wall time. Also prints the child's peak RSS against the weights'
float32 size. Last line: ``warm_over_cold <ratio>`` (load times; target <= 0.2).

    python benchmarks/bench_load.py [--model smollm2-135m] [--threads 2] [--warm-runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(int(sys.argv[2]))
import tracekit
from tracekit.model.load import load_model
from tracekit.resources import peak_memory, weights_bytes
t1 = time.perf_counter()
m = load_model(sys.argv[1], device="cpu")
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "weights_mib": weights_bytes(m) / 2**20,
                  **peak_memory()}))
"""


def _child(model: str, threads: int, cache: str) -> dict:
    env = {**os.environ, "TRACEKIT_CACHE_DIR": cache, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, model, str(threads)], capture_output=True, text=True,
                       env=env, check=False)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"child failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm-runs", type=int, default=2, help="warm loads timed (best kept)")
    a = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tracekit-bench-cache-") as cache:
        cold = _child(a.model, a.threads, cache)
        warm = min((_child(a.model, a.threads, cache) for _ in range(max(1, a.warm_runs))),
                   key=lambda r: r["load_s"])
    for name, r in (("cold", cold), ("warm", warm)):
        print(f"{name}: load_model {r['load_s']:.2f} s (imports {r['import_s']:.2f} s, whole process "
              f"{r['process_s']:.2f} s); peak RSS {r['peak_rss_mib']:.0f} MiB "
              f"({r['peak_rss_mib'] / r['weights_mib']:.2f}x the {r['weights_mib']:.0f} MiB of parameters)")
    print(f"warm_over_cold {warm['load_s'] / cold['load_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
