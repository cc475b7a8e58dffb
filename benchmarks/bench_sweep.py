"""Benchmark: ``tracekit sweep`` (one process, each model loaded once) vs a shell loop of
``tracekit run`` (one process and one model load per point), and the same sweep on Ray.

A 12-point sweep on the embedded model (SmolLM2-135M by default): 2 prompt sets x 3 targets x
2 kinds (``logit_lens`` and ``direct_logit_attribution``). Both sides run the same point configs
(``tracekit.sweep.expand_sweep`` writes each point's YAML for the loop, derived seed included)
with the same torch thread count. Prints both wall times, their ratio and the max abs difference
of every summary number; then the Ray sweep (``--ray-workers`` CPU actors) against the local one.
The last line is ``speedup <ratio>x max_abs_diff <value>`` (loop time / sweep time; the largest
difference between the sweep's and the loop's summary numbers).

    python benchmarks/bench_sweep.py [--model smollm2-135m] [--threads 2] [--ray-workers 2] [--no-ray]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def sweep_config(model: str) -> dict:
    return {
        "model": {"name": model, "device": "cpu", "dtype": "float32"},
        "seed": 0,
        "experiments": [{"kind": "logit_lens", "name": "step", "prompts": ["The capital of France is"],
                         "target": " Paris"}],
        "sweep": {"grid": {
            "experiments[0].kind": ["logit_lens", "direct_logit_attribution"],
            "experiments[0].prompts": {
                "bare": ["The capital of France is", "France's capital city is"],
                "example": ["The capital of China is Beijing. The capital of France is",
                            "Beijing is in China. Paris is in"]},
            "experiments[0].target": [" Paris", " Beijing", " London"]}},
    }


def _numbers(obj, prefix="", out=None) -> dict:
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            _numbers(v, f"{prefix}.{k}", out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _numbers(v, f"{prefix}[{i}]", out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix] = float(obj)
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over the summary numbers of two runs (inf when their keys differ)."""
    na, nb = _numbers(a), _numbers(b)
    if set(na) != set(nb):
        return math.inf
    d = [abs(na[k] - nb[k]) for k in na if not (math.isnan(na[k]) and math.isnan(nb[k]))]
    return max(d, default=0.0)


def _cli(args: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", *args], check=False, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tracekit {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every process (both sides)")
    ap.add_argument("--ray-workers", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--keep", default=None, help="keep the outputs in this folder (default: a temporary one)")
    args = ap.parse_args(argv)

    from tracekit.sweep import expand_sweep, load_results

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg",
           "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench_sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "sweep.yaml"
    cfg.write_text(yaml.safe_dump(sweep_config(args.model), sort_keys=False))
    points, _ = expand_sweep(cfg)
    print(f"{len(points)} points on {args.model}, {args.threads} thread(s); outputs in {work}")

    t_sweep = _cli(["sweep", str(cfg), "--out", str(work / "sweep"), "--no-progress"], env)
    index = load_results(work / "sweep")
    print(f"tracekit sweep:          {t_sweep:8.1f} s")

    loop_dir = work / "loop"
    t_loop = 0.0
    diffs = []
    for p in points:
        pc = work / "points" / f"p{p.index:03d}.yaml"
        pc.parent.mkdir(exist_ok=True)
        pc.write_text(yaml.safe_dump(p.raw, sort_keys=False))
        out = loop_dir / f"p{p.index:03d}"
        t_loop += _cli(["run", str(pc), "--out", str(out), "--no-progress"], env)
        run_dir = next(out.iterdir())
        loop_summary = json.loads((run_dir / "summary.json").read_text())["steps"]
        sweep_summary = json.loads(index.loc[index["point"] == p.index, "summary"].iloc[0])
        diffs.append(max_abs_diff(sweep_summary, loop_summary))
    diff = max(diffs)
    print(f"loop of tracekit run:    {t_loop:8.1f} s  ({len(points)} processes)")
    print(f"ratio loop / sweep:      {t_loop / t_sweep:8.2f}x; max abs diff of summary numbers {diff:.3g}")

    if not args.no_ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("ray: not installed (pip install 'tracekit[sweeps]'); skipped")
        else:
            t_ray = _cli(["sweep", str(cfg), "--out", str(work / "ray"), "--no-progress", "--executor", "ray",
                          "--workers", str(args.ray_workers)], env)
            ray_index = load_results(work / "ray")
            pairs = zip(index.sort_values("point")["summary"], ray_index.sort_values("point")["summary"])
            rdiff = max(max_abs_diff(json.loads(a), json.loads(b)) for a, b in pairs)
            print(f"tracekit sweep on Ray:   {t_ray:8.1f} s  ({args.ray_workers} CPU actors, Ray start-up included); "
                  f"ratio loop / ray {t_loop / t_ray:.2f}x; max abs diff vs the local sweep {rdiff:.3g}")
    print(f"speedup {t_loop / t_sweep:.2f}x max_abs_diff {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
