"""Benchmark: ``tracekit sweep`` against the hardware limit and against a shell loop of ``tracekit run``.

A 12-point sweep on the embedded model (SmolLM2-135M by default): 2 prompt sets x 3 targets x
2 kinds (``logit_lens`` and ``direct_logit_attribution``). Three processes-worth of work, each timed
as a whole process (interpreter start and imports included) with the same torch thread count:

* **sweep**: ``tracekit sweep`` (one model load; lens points differing only in target share one
  pass; no per-point figures; index rewritten after every point);
* **limit**: one process that imports tracekit, loads the model once and runs each point's steps
  alone (``step.run(model)``: compute only, nothing written), each point timed; the floor any
  one-process sweep of these points can reach without sharing work between points;
* **loop**: one ``tracekit run`` process per point (one model load per point), as a shell loop.

``max_abs_diff``: the largest difference between any summary number of the sweep and the same
point run by the loop and by the limit process (0 when the shared lens pass is exact).
Optionally (``--ray``) the same sweep on Ray (``--ray-workers`` CPU actors) against the local one.
The last line is ``sweep_over_limit <ratio> speedup_vs_loop <ratio> max_abs_diff <value>``.

    python benchmarks/bench_sweep.py [--model smollm2-135m] [--threads 2] [--no-loop] [--ray --ray-workers 2]
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


def limit_process(cfg: str, dest: str) -> int:
    """The limit (run in its own process by :func:`main`): import, load the model once, run each
    point's steps alone (compute only), write the timings and summaries to ``dest`` (JSON)."""
    t0 = time.perf_counter()
    from tracekit.model.load import load_model
    from tracekit.runner import seed_everything
    from tracekit.sweep import expand_sweep

    points, _ = expand_sweep(cfg)
    t_import = time.perf_counter() - t0
    t = time.perf_counter()
    model = load_model(points[0].config.model)
    t_load = time.perf_counter() - t
    per_point, summaries = [], {}
    for p in points:
        t = time.perf_counter()
        steps = {}
        for step in p.config.experiments:
            seed_everything(p.config.seed)
            steps[step.step_name] = step.run(model, progress=False).summary()
        per_point.append(time.perf_counter() - t)
        summaries[p.index] = steps
    Path(dest).write_text(json.dumps({"import_s": t_import, "load_s": t_load, "point_s": per_point,
                                      "summaries": summaries}, default=str))
    return 0


def _limit(cfg: Path, work: Path, env: dict) -> tuple[float, dict]:
    dest = work / "limit.json"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--limit-process", str(cfg), str(dest)], check=False, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"limit process failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0, json.loads(dest.read_text())


def _loop(points, work: Path, env: dict, index) -> tuple[float, float]:
    """A shell-style loop of ``tracekit run``: total seconds and the max abs diff against the sweep."""
    t_loop, diffs = 0.0, []
    for p in points:
        pc = work / "points" / f"p{p.index:03d}.yaml"
        pc.parent.mkdir(exist_ok=True)
        pc.write_text(yaml.safe_dump(p.raw, sort_keys=False))
        out = work / "loop" / f"p{p.index:03d}"
        t_loop += _cli(["run", str(pc), "--out", str(out), "--no-progress"], env)
        run_dir = next(out.iterdir())
        loop_summary = json.loads((run_dir / "summary.json").read_text())["steps"]
        sweep_summary = json.loads(index.loc[index["point"] == p.index, "summary"].iloc[0])
        diffs.append(max_abs_diff(sweep_summary, loop_summary))
    return t_loop, max(diffs)


def _ray(cfg: Path, work: Path, env: dict, index, workers: int, t_loop: float) -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("ray: not installed (pip install 'tracekit[sweeps]'); skipped")
        return
    from tracekit.sweep import load_results

    t_ray = _cli(["sweep", str(cfg), "--out", str(work / "ray"), "--no-progress", "--executor", "ray",
                  "--workers", str(workers)], env)
    ray_index = load_results(work / "ray")
    pairs = zip(index.sort_values("point")["summary"], ray_index.sort_values("point")["summary"])
    rdiff = max(max_abs_diff(json.loads(a), json.loads(b)) for a, b in pairs)
    print(f"tracekit sweep on Ray:   {t_ray:8.1f} s  ({workers} CPU actors, Ray start-up included); "
          f"ratio loop / ray {t_loop / t_ray:.2f}x; max abs diff vs the local sweep {rdiff:.3g}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--limit-process"]:
        return limit_process(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every process (all sides)")
    ap.add_argument("--no-loop", action="store_true", help="skip the loop of tracekit run (speedup_vs_loop nan)")
    ap.add_argument("--ray", action="store_true", help="also run the sweep on Ray")
    ap.add_argument("--ray-workers", type=int, default=2)
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

    t_limit, lim = _limit(cfg, work, env)
    print(f"limit (one process):     {t_limit:8.1f} s  = start-up+imports {lim['import_s']:.1f} s + model load "
          f"{lim['load_s']:.1f} s + sum of {len(points)} points alone {sum(lim['point_s']):.1f} s "
          f"(+ {t_limit - lim['import_s'] - lim['load_s'] - sum(lim['point_s']):.1f} s interpreter)")
    t_sweep = _cli(["sweep", str(cfg), "--out", str(work / "sweep"), "--no-progress"], env)
    index = load_results(work / "sweep")
    diff = max(max_abs_diff(json.loads(index.loc[index["point"] == int(k), "summary"].iloc[0]), v)
               for k, v in lim["summaries"].items())
    print(f"tracekit sweep:          {t_sweep:8.1f} s  ({t_sweep / t_limit:.2f}x the limit; max abs diff vs the "
          f"limit's summaries {diff:.3g})")
    t_loop = math.nan
    if not args.no_loop:
        t_loop, ldiff = _loop(points, work, env, index)
        diff = max(diff, ldiff)
        print(f"loop of tracekit run:    {t_loop:8.1f} s  ({len(points)} processes; {t_loop / t_sweep:.2f}x the sweep; "
              f"max abs diff vs the sweep {ldiff:.3g})")
    if args.ray:
        _ray(cfg, work, env, index, args.ray_workers, t_loop)
    print(f"sweep_over_limit {t_sweep / t_limit:.3f} speedup_vs_loop {t_loop / t_sweep:.2f} max_abs_diff {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
