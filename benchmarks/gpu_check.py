"""The prepared GPU check: every kind on CUDA and CPU, float32 and bfloat16, numbers compared.

One command for the day a GPU is lent (about 8 minutes on one GPU with ``--embedded``); on a
machine without CUDA it runs the CPU parts and reports each CUDA part as skipped, with the reason.

Sections (each check is one record: status ``pass`` | ``fail`` | ``error`` | ``skip``):

* ``kinds``: every registered kind, with its small config from ``tests/helpers.py`` KIND_EXAMPLES,
  on a tiny perturbed GPT-2 (3 layers, d_model 64, norms and biases away from 1/0, O(1) logits;
  built on the CPU in float32 from a seed, then cast and moved, so every device holds the same
  weights) and with ``--embedded`` on the embedded SmolLM2-135M. The first configuration
  (CPU, float32) is the reference; every other one (CPU float32 again, CPU bfloat16, CUDA float32,
  CUDA bfloat16) compares the summary numbers listed in :data:`COMPARE` against it, with the
  tolerances of :data:`TOL` (``|x - ref| <= atol + rtol * |ref|``), and checks the kind's own
  invariants (:data:`INVARIANTS`, e.g. DLA's sum error) against a ceiling per dtype.
* ``oom``: the patching engine's out-of-memory halving. CUDA: a real cap
  (``torch.cuda.set_per_process_memory_fraction``) at twice the peak memory of the sweep in batches
  of 16 variants, then the sweep asked to replay everything at once; CPU: the replay raises a simulated
  out-of-memory error above 4 variants. Either way the batch must halve and the numbers equal an
  unforced run.
* ``devices``: ``auto`` resolves to CUDA when present; ``cuda:N`` puts the weights on device N and
  gives the CPU's numbers; ``n_devices: 2`` splits the blocks (needs 2 GPUs); without CUDA,
  ``cuda`` and ``n_devices: 2`` are refused with a message naming the field.
* ``ray``: a 2-point sweep on Ray with one GPU actor (needs ``ray`` and CUDA).
* ``timing``: logit lens (prompts/s), residual-stream patching vs TransformerLens' one-at-a-time
  ``get_act_patch_resid_pre`` (``benchmarks/bench_patching.py``), SAE training tokens/s.
* ``scale``: the scale ladder (``benchmarks/bench_scale.py``, ladder ``gpu``) on CUDA under
  ``--memory-budget`` (default 20GiB), at most :data:`SCALE_SECONDS`: growth exponents per kind and
  axis and the "what fits on 24 GB / 80 GB" table in ``DIR/scale/fits.md`` (docs/scaling.md).

Output: ``--out DIR/gpu_check.json`` (machine, versions, tolerances, records) and
``DIR/gpu_check.md`` (one table). Exit status 1 when any check failed or raised.

    python benchmarks/gpu_check.py --out results/gpu_check              # tiny model, every device here
    python benchmarks/gpu_check.py --embedded --out results/gpu_check   # + SmolLM2-135M (the GPU run)
    python benchmarks/gpu_check.py --quick --out /tmp/gpu_check         # CI: tiny model, CPU float32 only
    python benchmarks/gpu_check.py --sections scale --out results/gpu_check   # the scale ladder only (~8 min)
"""
# Length (~770 lines, over the 600 guide): one self-contained script that a GPU day runs as is; a
# third of it is the comparison tables and their logic, the piece to move out next (gpu_compare.py).

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tests", ROOT / "benchmarks"):  # KIND_EXAMPLES and the tiny-model recipe; bench_* helpers
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

#: Tolerances against the reference (CPU, float32), by the dtype of the run compared and the kind of
#: number: (atol, rtol). ``logit``: logits, log-probs, nats, logit differences, norms; ``prob``:
#: probabilities and attention weights (summaries round them to 6 decimals: atol one unit of the
#: last decimal); ``rounded``: values the summary rounds to 4 digits;
#: ``score``: accuracies, shares, correlations over few items (float32 allows one test row of 20
#: to flip). ``err``: the ceiling of a kind's own invariant error (absolute, logit units).
#: float32 on CUDA differs from the CPU by summation order only (TF32 stays off: PyTorch's default);
#: bfloat16 keeps 8 significand bits, so each matmul carries ~0.4% relative error.
TOL: dict[str, dict[str, tuple[float, float]]] = {
    "float32": {"logit": (1e-3, 1e-3), "prob": (1.1e-6, 1e-3), "rounded": (1.1e-4, 0.0), "score": (0.051, 0.0),
                "err": (1e-3, 0.0)},
    "bfloat16": {"logit": (0.3, 0.05), "prob": (0.02, 0.1), "rounded": (0.05, 0.0), "score": (0.25, 0.0),
                 "err": (0.3, 0.0)},
    # float16 keeps 11 significand bits (~0.05% relative error per matmul); its range is narrower
    "float16": {"logit": (0.1, 0.02), "prob": (0.01, 0.05), "rounded": (0.02, 0.0), "score": (0.25, 0.0),
                "err": (0.1, 0.0)},
}

#: Per kind: the summary numbers compared across devices and dtypes (dotted path, class of
#: :data:`TOL`). Numbers that depend on a device's random stream (causal tracing's noise, an SAE or
#: tuned lens trained on that device) or on a discrete choice (top heads, argmax layers) are left out.
COMPARE: dict[str, list[tuple[str, str]]] = {
    "logit_lens": [("mean_entropy_by_hidden_state", "logit"), ("mean_target_prob_by_hidden_state", "prob"),
                   ("target_prob_final_by_row", "prob")],
    "linear_probe": [("accuracy_by_layer", "score"), ("embedding_accuracy", "score")],
    "activation_patching": [("mean_clean.logit_diff", "logit"), ("mean_clean.log_prob", "logit"),
                            ("mean_corrupted.logit_diff", "logit"), ("mean_corrupted.kl", "logit"),
                            ("clean_logit_diff_by_row", "logit"), ("corrupted_logit_diff_by_row", "logit")],
    "direct_logit_attribution": [("logit_diff_by_row", "logit"), ("mean_embed", "logit"),
                                 ("mean_attn_by_layer", "logit"), ("mean_mlp_by_layer", "logit")],
    "neuron_attribution": [("logit_diff_by_row", "logit"), ("mean_mlp_attribution_by_layer", "logit")],
    "attention_pattern": [("mean_attention_by_key", "prob")],
    "head_scan": [("max_induction_score", "rounded")],
    "attribution_patching": [("mean_clean.logit_diff", "logit"), ("mean_corrupted.logit_diff", "logit"),
                             ("verification.denoising.pearson", "score")],
    "edge_attribution": [("mean_clean", "logit"), ("mean_corrupted", "logit"), ("verification.pearson", "score")],
    "path_patching": [("mean_clean", "logit"), ("mean_corrupted", "logit"), ("effects", "logit")],
    "circuit": [("mean_clean", "logit"), ("mean_corrupted", "logit"), ("mean_empty", "logit")],
    "lens_quality": [("kl_by_hidden_state.logit", "logit"), ("cross_entropy_by_hidden_state.logit", "logit"),
                     ("top1_agreement_by_hidden_state.logit", "score")],
    "patchscope": [("target_prob_by_hidden_state", "prob")],
    "steering": [("vector_norm", "logit"), ("mean_clean_target_prob", "prob"), ("mean_logit_diff_by_alpha", "logit")],
    "causal_tracing": [("mean_p_clean", "prob"), ("embedding_std", "logit")],
    "token_trace": [("target_prob", "prob"), ("logit", "logit"), ("target_prob_by_hidden_state", "rounded")],
    "sae_train": [("ce_loss_clean", "logit"), ("ce_loss_zero", "logit")],
    "sae_eval": [("ce_loss_clean", "logit"), ("ce_loss_zero", "logit")],
    "sae_features": [("logit_diff_by_row", "logit")],
}

#: Per kind: summary numbers that are a method's own exactness error (must stay under ``err``).
INVARIANTS: dict[str, list[str]] = {
    "direct_logit_attribution": ["max_sum_error", "max_identity_error"],
    "neuron_attribution": ["max_additivity_error"],
    "attention_pattern": ["max_abs_row_sum_error"],
    "steering": ["alpha0_max_abs_error"],
    "sae_features": ["max_sum_error"],
}

EMBEDDED = "smollm2-135m"


# ---------------------------------------------------------------------------------------------
# Records.
# ---------------------------------------------------------------------------------------------

class Report:
    """The check's records, written as JSON and one markdown table."""

    def __init__(self, echo: bool = True):
        self.records: list[dict] = []
        self.echo = echo

    def add(self, section: str, check: str, status: str, detail: str = "", *, model: str = "-", device: str = "-",
            dtype: str = "-", seconds: float | None = None, **data: Any) -> dict:
        rec = {"section": section, "check": check, "model": model, "device": device, "dtype": dtype,
               "status": status, "detail": detail, "seconds": None if seconds is None else round(seconds, 3)}
        if data:
            rec["data"] = data
        self.records.append(rec)
        if self.echo:
            print(f"[{status:5}] {section}/{check} {model} {device} {dtype}: {detail}", flush=True)
        return rec

    def counts(self) -> dict[str, int]:
        out = {"pass": 0, "fail": 0, "error": 0, "skip": 0}
        for r in self.records:
            out[r["status"]] = out.get(r["status"], 0) + 1
        return out

    def markdown(self) -> str:
        lines = ["| section | check | model | device | dtype | status | result | s |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in self.records:
            det = str(r["detail"]).replace("|", "\\|").replace("\n", " ")
            sec = "" if r["seconds"] is None else f"{r['seconds']:.2f}"
            lines.append(f"| {r['section']} | {r['check']} | {r['model']} | {r['device']} | {r['dtype']} | "
                         f"{r['status']} | {det} | {sec} |")
        c = self.counts()
        lines.append("")
        lines.append(f"{c['pass']} passed, {c['fail']} failed, {c['error']} errors, {c['skip']} skipped")
        return "\n".join(lines) + "\n"


def _guarded(rep: Report, section: str, check: str, fn: Callable[[], None], **where: Any) -> None:
    """Run one check; anything it raises becomes an ``error`` record (the check goes on)."""
    t = time.perf_counter()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - every failure is reported, the other checks still run
        rep.add(section, check, "error", f"{type(e).__name__}: {e}"[:400], seconds=time.perf_counter() - t,
                traceback=traceback.format_exc()[-2000:], **where)


# ---------------------------------------------------------------------------------------------
# Comparing summaries.
# ---------------------------------------------------------------------------------------------

def leaves(v, path: str = "") -> dict[str, float]:
    """The numbers in a JSON-able value, by path (``a.b[2]``); strings, booleans and None are left out."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return {}
    if isinstance(v, (int, float)):
        return {path: float(v)}
    out: dict[str, float] = {}
    if isinstance(v, dict):
        for k, u in v.items():
            out.update(leaves(u, f"{path}.{k}" if path else str(k)))
    elif isinstance(v, (list, tuple)):
        for i, u in enumerate(v):
            out.update(leaves(u, f"{path}[{i}]"))
    return out


def pick(summary: dict, path: str):
    """The value at a dotted path of a summary (KeyError when absent)."""
    v = summary
    for part in path.split("."):
        v = v[part]
    return v


def compare_summaries(kind: str, ref: dict, other: dict, dtype: str) -> tuple[bool, str, dict]:
    """Compare the :data:`COMPARE` numbers of ``other`` with ``ref`` under ``TOL[dtype]``.

    Returns:
        ``(ok, one-line detail, data)``; ``data`` holds the worst difference per class and any
        value present on one side only (a failure in float32; reported only in bfloat16, where a
        discrete choice such as which heads are shown may flip).
    """
    tol = TOL[dtype]
    worst: dict[str, tuple[float, str, float]] = {}  # class -> (excess ratio, path, abs diff)
    bad: list[str] = []
    one_side: list[str] = []
    n = 0
    for path, cls in COMPARE[kind]:
        try:
            a, b = leaves(pick(ref, path), path), leaves(pick(other, path), path)
        except (KeyError, TypeError):
            bad.append(f"{path}: missing")
            continue
        atol, rtol = tol[cls]
        one_side += sorted(set(a) ^ set(b))
        for k in set(a) & set(b):
            x, y = a[k], b[k]
            n += 1
            if math.isnan(x) and math.isnan(y):
                continue
            d = abs(x - y)
            lim = atol + rtol * abs(x)
            ratio = d / lim if lim > 0 else (0.0 if d == 0 else math.inf)
            if math.isnan(d) or ratio > 1:
                bad.append(f"{k}: {y:.6g} vs {x:.6g} (|diff| {d:.3g} > {lim:.3g})")
            if cls not in worst or ratio > worst[cls][0] or math.isnan(d):
                worst[cls] = (ratio, k, d)
    if one_side and dtype == "float32":
        bad.append(f"values on one side only: {one_side[:4]}")
    diffs = ", ".join(f"{c} max|diff| {w[2]:.2g} ({w[1]})" for c, w in sorted(worst.items()))
    detail = (f"{n} numbers within tolerance; {diffs}" if not bad else f"{len(bad)} outside tolerance: "
              + "; ".join(bad[:3]))
    if one_side and dtype != "float32":
        detail += f"; {len(one_side)} value(s) on one side only (discrete choice)"
    data = {"compared": n, "worst": {c: {"path": w[1], "abs_diff": w[2], "excess": w[0]} for c, w in worst.items()},
            "outside": bad, "one_side": one_side}
    return not bad, detail, data


def check_invariants(kind: str, summary: dict, dtype: str) -> list[str]:
    """The kind's invariant errors above the ``err`` ceiling of ``dtype`` (empty: all hold)."""
    ceiling = TOL[dtype]["err"][0]
    out = []
    for path in INVARIANTS.get(kind, []):
        try:
            v = float(cast(Any, pick(summary, path)))
        except (KeyError, TypeError, ValueError):
            out.append(f"{path}: missing")
            continue
        if not v <= ceiling:
            out.append(f"{path} {v:.3g} > {ceiling:g}")
    return out


# ---------------------------------------------------------------------------------------------
# Models and configurations.
# ---------------------------------------------------------------------------------------------

#: Set by ``--quick``: the CUDA parts are skipped even where CUDA is present.
QUICK = {"on": False}


def cuda_reason() -> str | None:
    """None when the CUDA parts run, else why not (the reason every skipped CUDA record gives)."""
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda or "none (a CPU build)"
        return f"CUDA not available (torch {torch.__version__}, CUDA build: {build})"
    if QUICK["on"]:
        return "--quick runs the CPU parts only (CUDA is present: run without --quick)"
    return None


def tiny_model(device: str = "cpu", dtype: str = "float32"):
    """The tiny perturbed GPT-2 (tests/helpers.py recipe) on ``device`` in ``dtype``: weights made
    on the CPU in float32 from seed 7 and perturbed, then cast and moved, so every device and dtype
    holds the same weights (bfloat16: rounded)."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import GPT2_BPE, perturb_params, tiny_overrides
    from tracekit.model.load import wrap_hf_model
    from tracekit.model.source import _load_tokenizer, _random_config
    from tracekit.model.spec import DTYPES, ModelSpec

    spec = ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE, config_overrides=tiny_overrides("gpt2"),
                     device=device, dtype=cast(Any, dtype), seed=7)
    tok = _load_tokenizer(GPT2_BPE)
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(_random_config(spec), dtype=torch.float32, attn_implementation="eager")
    if hf.config.vocab_size < len(tok):
        hf.resize_token_embeddings(len(tok), mean_resizing=False)
    perturb_params(hf)
    hf = hf.to(DTYPES[dtype])
    return wrap_hf_model(hf, tok, spec, bridge_name="gpt2")


def build_model(name: str, device: str, dtype: str):
    from tracekit.model.load import load_model

    if name == "tiny":
        return tiny_model(device, dtype)
    return load_model(name, device=device, dtype=dtype)


def _free() -> None:
    """Give memory back after the caller dropped its model."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def configurations(quick: bool, cpu_bf16: bool, repeat: bool = True) -> list[tuple[str, str, str]]:
    """``(device, dtype, label)``; the first is the reference; ``repeat``: the reference again on a
    freshly built model (the CPU-vs-CPU comparison: same numbers, bit for bit in practice)."""
    out = [("cpu", "float32", "reference")] + ([("cpu", "float32", "repeat")] if repeat else [])
    if cpu_bf16 and not quick:
        out.append(("cpu", "bfloat16", "vs reference"))
    return out + [("cuda", "float32", "vs reference"), ("cuda", "bfloat16", "vs reference")]


# ---------------------------------------------------------------------------------------------
# Sections.
# ---------------------------------------------------------------------------------------------

def run_kinds(rep: Report, model_name: str, configs: list[tuple[str, str, str]], kinds: list[str]) -> None:
    """Every kind in ``kinds`` under every configuration; see the module docstring."""
    from helpers import KIND_EXAMPLES

    ref: dict[str, dict] = {}
    no_cuda = cuda_reason()
    for device, dtype, label in configs:
        where: dict[str, Any] = {"model": model_name, "device": device, "dtype": dtype}
        if device.startswith("cuda") and no_cuda:
            rep.add("kinds", f"all {len(kinds)} kinds", "skip", no_cuda, **where)
            continue
        t = time.perf_counter()
        try:
            model = build_model(model_name, device, dtype)
        except Exception as e:  # noqa: BLE001
            rep.add("kinds", "load", "error", f"{type(e).__name__}: {e}"[:400], seconds=time.perf_counter() - t,
                    **where)
            continue
        rep.add("kinds", "load", "pass", f"loaded ({label})", seconds=time.perf_counter() - t, **where)
        for kind in kinds:
            if kind not in KIND_EXAMPLES:
                rep.add("kinds", kind, "skip", "no example config in tests/helpers.py KIND_EXAMPLES", **where)
                continue
            if kind.startswith("sae_") and _version("sae-lens") is None:
                rep.add("kinds", kind, "skip", "sae-lens not installed (the TransformerLens 4 environment)", **where)
                continue

            _guarded(rep, "kinds", kind, partial(_run_kind, rep, model, kind, label, ref, where), **where)
        del model
        _free()


def _run_kind(rep: Report, model, kind: str, label: str, ref: dict[str, dict], where: dict) -> None:
    """One kind on one model: the reference run (``label == "reference"``) stores its summary in
    ``ref``; any other run is compared with it (:func:`compare_summaries`)."""
    from helpers import KIND_EXAMPLES
    from tracekit.core.io import jsonable
    from tracekit.experiments.base import REGISTRY

    t0 = time.perf_counter()
    dtype = where["dtype"]
    exp = REGISTRY[kind].model_validate({"kind": kind, **KIND_EXAMPLES[kind]})
    summary = jsonable(exp.run(model, progress=False).summary())
    sec = time.perf_counter() - t0
    inv = check_invariants(kind, summary, dtype)
    if label == "reference":
        ref[kind] = summary
        hold = f"; invariants hold ({', '.join(INVARIANTS[kind])})" if kind in INVARIANTS else ""
        rep.add("kinds", kind, "fail" if inv else "pass", "reference run" + (f"; invariants: {inv}" if inv else hold),
                seconds=sec, **where)
    elif kind not in ref:
        rep.add("kinds", kind, "skip", "no reference run to compare with", seconds=sec, **where)
    elif kind not in COMPARE:
        rep.add("kinds", kind, "pass", "ran; no comparison list for this kind (add it to COMPARE)", seconds=sec,
                **where)
    else:
        ok, detail, data = compare_summaries(kind, ref[kind], summary, dtype)
        if inv:
            detail = f"invariants: {inv}; {detail}"
        rep.add("kinds", kind, "pass" if ok and not inv else "fail", f"{label}: {detail}", seconds=sec, **where,
                **data)


def _resid_pre_inputs(model, n_rows: int = 1):
    from tracekit.tokens import single_token_id, tokenize

    clean = tokenize(model, ["The capital of France is"] * n_rows).tokens
    corrupted = tokenize(model, ["The capital of Italy is"] * n_rows).tokens
    return clean, corrupted, single_token_id(model, " Paris"), single_token_id(model, " Rome")


def _halving_sweep(model, batch_size: int, n_rows: int):
    """Residual patching of every layer x position of ``n_rows`` prompt pairs (no-op patches not
    skipped, so every variant is replayed); returns ``(result [n_rows, layers, pos], halvings)``."""
    from tracekit import patching as tkp

    clean, corrupted, tgt, foil = _resid_pre_inputs(model, n_rows)
    records: list[logging.LogRecord] = []

    class _Catch(logging.Handler):
        def emit(self, record):
            if "halving" in record.getMessage():
                records.append(record)

    h = _Catch()
    lg = logging.getLogger("tracekit")  # the halving is logged by tracekit.core.budget (run_chunked): any tracekit.* logger
    lg.addHandler(h)
    try:
        out = tkp.batched_act_patch_resid_pre(model, corrupted, clean, lambda lg_, p: lg_[:, tgt] - lg_[:, foil],
                                              batch_size=batch_size, skip_unchanged=False)
    finally:
        lg.removeHandler(h)
    return out.float().cpu(), len(records)


def check_oom(rep: Report, model_name: str, device: str) -> None:
    """Out-of-memory halving, forced (CUDA: a memory cap; CPU: a simulated error above 4 variants)."""
    import torch

    from tracekit.patching import engine

    where: dict[str, Any] = {"model": model_name, "device": device, "dtype": "float32"}
    if device.startswith("cuda") and cuda_reason():
        rep.add("oom", "memory cap", "skip", str(cuda_reason()), **where)
        return
    model = build_model(model_name, device, "float32")
    cuda = device.startswith("cuda")
    # CUDA: 8 prompt pairs, reference in batches of 16, cap 2x that run's peak; CPU: few variants
    n_rows, ref_bs = (8, 16) if cuda else ((2, 4) if model_name == "tiny" else (1, 4))
    t = time.perf_counter()
    if cuda:
        dev = torch.device(device)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    ref, _ = _halving_sweep(model, ref_bs, n_rows)
    n_var = ref.numel()
    if not cuda:
        real = engine._replay
        cap = 4

        def fake(model_, run, jobs, rows):
            if len(rows) > cap:
                raise RuntimeError(f"CUDA out of memory (simulated by gpu_check: {len(rows)} variants > {cap})")
            return real(model_, run, jobs, rows)

        engine._replay = fake
        try:
            got, halvings = _halving_sweep(model, n_var, n_rows)
        finally:
            engine._replay = real
        how = f"simulated error above {cap} variants"
    else:
        peak = torch.cuda.max_memory_allocated(dev) - base
        total = torch.cuda.get_device_properties(dev).total_memory
        cap_bytes = torch.cuda.memory_allocated(dev) + 2 * peak
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), dev)
        try:
            got, halvings = _halving_sweep(model, n_var, n_rows)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
            torch.cuda.empty_cache()
        how = f"memory cap {cap_bytes / 2**20:.0f} MiB (2x the peak of batches of {ref_bs}: {peak / 2**20:.1f} MiB)"
    diff = (got - ref).abs().max().item()
    ok = halvings > 0 and diff <= 1e-4
    rep.add("oom", "halving", "pass" if ok else "fail",
            f"{n_var} variants asked in one batch, {how}: {halvings} halving(s); max|diff| vs batches of {ref_bs} "
            f"{diff:.2g} (tol 1e-4)" + ("" if halvings else "; no out-of-memory was triggered"),
            seconds=time.perf_counter() - t, halvings=halvings, max_abs_diff=diff, **where)


def _lens_probs(model) -> Any:
    import tracekit as tk

    res = tk.LogitLens(prompts=["The capital of France is"], target=" Paris").run(model, progress=False)
    return res.tables["main"]["log_prob"].to_numpy()


def check_devices(rep: Report) -> None:
    """device auto / cuda:N / n_devices, and the refusals where CUDA is absent."""
    import numpy as np
    import torch

    from tracekit.model.load import model_device
    from tracekit.model.spec import resolve_device

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = cuda_reason()
    want = "cuda" if n_gpu else "cpu"
    got = resolve_device("auto")
    rep.add("devices", "auto", "pass" if got == want else "fail", f"auto -> {got} (expected {want}; {n_gpu} GPU(s))")
    ref = None

    def lens_on(**kw):
        from helpers import GPT2_BPE, tiny_overrides
        from tracekit.model.load import load_model
        from tracekit.model.spec import ModelSpec

        spec = ModelSpec(name="gpt2", random_init=True, tokenizer=GPT2_BPE, config_overrides=tiny_overrides("gpt2"),
                         seed=3, **kw)
        m = load_model(spec)
        return m, _lens_probs(m)

    def refused(field: str, **kw):
        try:
            lens_on(**kw)
        except Exception as e:  # noqa: BLE001 - the refusal must name the field
            ok = field in str(e)
            rep.add("devices", f"{field} refused", "pass" if ok else "fail",
                    f"{kw} without the devices: {type(e).__name__}: {str(e)[:160]}")
            return
        rep.add("devices", f"{field} refused", "fail", f"{kw} loaded without the devices")

    if why:
        if not n_gpu:
            refused("model.device", device="cuda")
            refused("model.n_devices", n_devices=2, device="auto")
        rep.add("devices", "cuda:N", "skip", why)
        rep.add("devices", "n_devices=2", "skip", why)
        return
    m, ref = lens_on(device="cpu")
    del m
    _free()
    last = f"cuda:{n_gpu - 1}"
    m, probs = lens_on(device=last)
    dev = model_device(m)
    diff = float(np.abs(probs - ref).max())
    ok = str(dev) == last and diff <= TOL["float32"]["logit"][0]
    rep.add("devices", "cuda:N", "pass" if ok else "fail", f"{last}: weights on {dev}; lens log-probs max|diff| vs CPU "
            f"{diff:.2g}", device=last)
    del m
    _free()
    if n_gpu < 2:
        rep.add("devices", "n_devices=2", "skip", f"needs 2 CUDA devices, {n_gpu} visible")
        return
    m, probs = lens_on(n_devices=2, device="cuda")
    devs = sorted({str(p.device) for p in m.parameters()})
    diff = float(np.abs(probs - ref).max())
    ok = len(devs) >= 2 and diff <= TOL["float32"]["logit"][0]
    rep.add("devices", "n_devices=2", "pass" if ok else "fail", f"parameters on {devs}; lens max|diff| vs CPU {diff:.2g}")
    del m
    _free()


def check_ray(rep: Report, tmp: Path) -> None:
    """A 2-point logit-lens sweep on Ray: one GPU actor, both points complete, numbers = CPU."""
    try:
        import ray  # noqa: F401  # lazy: optional (the `sweeps` extra)
    except ImportError:
        rep.add("ray", "GPU actor", "skip", "ray not installed (pip install 'tracekit[sweeps]')")
        return
    if cuda_reason():
        rep.add("ray", "GPU actor", "skip", str(cuda_reason()))
        return
    from helpers import GPT2_BPE, KIND_EXAMPLES, tiny_overrides
    from tracekit.sweep.run import run_sweep

    model = {"name": "gpt2", "random_init": True, "tokenizer": GPT2_BPE, "config_overrides": tiny_overrides("gpt2"),
             "seed": 3, "device": "cuda"}
    cfg = {"model": model, "experiments": [{"kind": "logit_lens", "name": "lens", **KIND_EXAMPLES["logit_lens"]}],
           "sweep": {"grid": {"experiments[0].target": [" Paris", " Rome"]}}}
    lines: list[str] = []
    t = time.perf_counter()
    outcome = run_sweep(cfg, tmp / "ray_sweep", executor="ray", progress=False, log=lines.append)
    gpu_line = [s for s in lines if s.startswith("ray:")]
    ok = outcome.exit_code == 0 and any("GPU actor" in s for s in gpu_line)
    rep.add("ray", "GPU actor", "pass" if ok else "fail", f"exit {outcome.exit_code}; {'; '.join(gpu_line)}",
            seconds=time.perf_counter() - t, device="cuda")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_lens(rep: Report, model, n: int, where: dict) -> None:
    """Logit lens over ``n`` capital-city prompts (batch 64), warmed up once; prompts/s."""
    from bench_lens import build_prompts

    import tracekit as tk

    prompts = build_prompts(n)
    lens = tk.LogitLens(prompts=prompts, target=" Paris", batch_size=64)
    lens.run(model, progress=False)
    _sync()
    t = time.perf_counter()
    lens.run(model, progress=False)
    _sync()
    sec = time.perf_counter() - t
    rep.add("timing", "logit lens", "pass", f"{n} prompts in {sec:.2f} s ({n / sec:.0f} prompts/s)", seconds=sec,
            prompts_per_s=n / sec, **where)


def time_patching(rep: Report, model, where: dict) -> None:
    """Residual-stream patching (every layer x position) vs TransformerLens one-at-a-time."""
    import torch
    from bench_patching import time_resid_pre

    clean, corrupted, tgt, foil = _resid_pre_inputs(model)
    with torch.no_grad():
        model(clean)  # warm-up, both sides
        model(corrupted)
    r = time_resid_pre(model, clean, corrupted, tgt, foil)
    tol = TOL[where.get("dtype", "float32")]["logit"][0]
    ok = r["max_abs_diff"] <= tol
    rep.add("timing", "patching vs TransformerLens", "pass" if ok else "fail",
            f"resid_pre {r['sites']} sites ({r['replayed']} replayed): TransformerLens {r['tl_seconds']:.2f} s, tracekit "
            f"{r['tracekit_seconds']:.2f} s, ratio {r['ratio']:.1f}x, max|diff| {r['max_abs_diff']:.2g} (tol {tol:g})",
            seconds=r["tl_seconds"] + r["tracekit_seconds"], ratio=r["ratio"], max_abs_diff=r["max_abs_diff"],
            **where)


def time_sae(rep: Report, model, train: dict, tmp: Path, where: dict) -> None:
    """SAE training throughput (SAELens' runner on this model; a fresh cache folder, so it trains)."""
    try:
        import sae_lens  # noqa: F401  # lazy: optional on TransformerLens 4

        from tracekit.sae.spec import SAETrainSpec
        from tracekit.sae.train import train_sae
    except ImportError as e:
        rep.add("timing", "SAE training", "skip", f"sae-lens not importable: {e}", **where)
        return
    if QUICK["on"]:
        train = {**train, "training_tokens": min(train["training_tokens"], 1024)}
    t = time.perf_counter()
    _, hit, stats = train_sae(model, SAETrainSpec(**train), cache_dir=tmp / f"sae-{where.get('device')}")
    sec = time.perf_counter() - t
    tps = stats["train_tokens"] / stats["train_seconds"]
    rep.add("timing", "SAE training", "fail" if hit else "pass",
            f"{stats['train_tokens']} tokens, d_in {stats['d_in']}, d_sae {stats['d_sae']}: {stats['train_seconds']:.1f} s "
            f"({tps:.0f} tokens/s; activations {stats['activation_seconds']:.1f} s)" + ("; cache hit" if hit else ""),
            seconds=sec, tokens_per_s=tps, **where)


TIMED_SAE = {
    "tiny": {"hook": "blocks.1.hook_resid_pre", "d_sae": 64, "k": 8, "training_tokens": 4096, "eval_tokens": 128,
             "context_size": 32, "train_batch_size_tokens": 256},
    EMBEDDED: {"hook": "blocks.10.hook_resid_pre", "d_sae": 2304, "k": 32, "training_tokens": 32_768,
               "eval_tokens": 1024, "context_size": 128, "train_batch_size_tokens": 2048},
}


def run_timings(rep: Report, model_name: str, devices: list[str], tmp: Path) -> None:
    for device in devices:
        where: dict[str, Any] = {"model": model_name, "device": device, "dtype": "float32"}
        if device.startswith("cuda") and cuda_reason():
            rep.add("timing", "lens, patching, SAE", "skip", str(cuda_reason()), **where)
            continue
        t = time.perf_counter()
        try:
            model = build_model(model_name, device, "float32")
        except Exception as e:  # noqa: BLE001
            rep.add("timing", "load", "error", f"{type(e).__name__}: {e}"[:400], seconds=time.perf_counter() - t,
                    **where)
            continue
        n = (16 if QUICK["on"] else 64) if model_name == "tiny" else 256
        _guarded(rep, "timing", "logit lens", partial(time_lens, rep, model, n, where), **where)
        _guarded(rep, "timing", "patching vs TransformerLens", partial(time_patching, rep, model, where), **where)
        _guarded(rep, "timing", "SAE training", partial(time_sae, rep, model, TIMED_SAE[model_name], tmp, where),
                 **where)
        del model
        _free()


#: The scale section's wall-clock allowance (seconds): jobs not started by then are skipped, named.
SCALE_SECONDS = 8 * 60
#: Per measured point, in the scale section's children (seconds).
SCALE_POINT_TIMEOUT = 90


def check_scale(rep: Report, out: Path, budget: str | None, seconds: float = SCALE_SECONDS) -> None:
    """The scale ladder on CUDA (``benchmarks/bench_scale.py``, ladder ``gpu``: rows 8/64/512, prompts of
    16/256/2,048 tokens, SmolLM2-135M, Gemma 3 270M and random SmolLM2-1.7B / Llama 3.2 3B in
    bfloat16), one child process per model, under the memory budget ``budget`` (default ``20GiB``,
    so the "24 GB" row of the table is a run, not only a fit). Records: one per (kind, axis) with its
    growth exponents (``fail`` when faster than the method must cost, bench_scale's SLACK), one for
    the runs over the budget, one per failed point; writes ``out/scale/`` (points, exponents, the
    "what fits on 24 GB / 80 GB" table ``fits.md``, plots). Without CUDA (or with ``--quick``): one
    ``skip`` record with the reason (the CPU ladder is ``bench_scale.py --quick``)."""
    where: dict[str, Any] = {"model": "ladder", "device": "cuda", "dtype": "float32+bfloat16"}
    reason = cuda_reason()
    if reason:
        rep.add("scale", "ladder", "skip", f"{reason}; the CPU ladder: python benchmarks/bench_scale.py --quick",
                **where)
        return
    import bench_scale as bs

    from tracekit.core.budget import parse_budget

    budget = budget or "20GiB"
    t0 = time.perf_counter()
    points: list[dict] = []
    skipped: list[str] = []
    for job in bs.jobs_for(list(bs.KINDS), ["rows", "length", "model"], bs.LADDERS["gpu"], "model"):
        if time.perf_counter() - t0 > seconds:
            skipped.append(job["model"])
            continue
        job.update(device="cuda", budget=budget, threads=0, sae_context=max(bs.LADDERS["gpu"]["length"]))
        points += bs.run_job(job, SCALE_POINT_TIMEOUT)
    exps, _, _, worst, over = bs.summarize(points, out / "scale", parse_budget(budget)[0])
    for e in exps:
        rep.add("scale", f"{e['kind']} / {e['axis']}", "fail" if e["flag"] else "pass",
                f"time exponent {e['time_exponent']}, memory exponent {e['memory_exponent']}, expected "
                f"{e['expected']}", **where, **e)
    for p in points:
        if not p.get("ok"):
            rep.add("scale", f"{p['kind']} / {p['axis']}", "error", str(p.get("error"))[:400],
                    **{**where, "model": p["model"]}, rows=p["rows"], length=p["length"])
    rep.add("scale", "memory budget", "fail" if over else "pass",
            f"{over} of {len(points)} runs over {budget}; worst excess exponent {worst:.2f}; "
            f"table: {out / 'scale' / 'fits.md'}" + (f"; not started (time): {skipped}" if skipped else ""),
            seconds=time.perf_counter() - t0, **where, over_budget=over, worst_excess_exponent=worst)


# ---------------------------------------------------------------------------------------------
# Main.
# ---------------------------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        rev = ""
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "transformer_lens": _version("transformer-lens"), "sae_lens": _version("sae-lens"),
            "ray": _version("ray"), "gpus": gpus, "git": rev,
            "torch_threads": torch.get_num_threads(), "cuda_skipped": cuda_reason()}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="The prepared GPU check (benchmarks/gpu_check.py; see docs/gpu.md).")
    ap.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--quick", action="store_true", help="CI: tiny model, CPU float32 (reference + repeat), CPU parts")
    ap.add_argument("--embedded", action="store_true", help=f"also the embedded model ({EMBEDDED})")
    ap.add_argument("--cpu-bf16", action="store_true", help="also bfloat16 on the CPU (slow on the embedded model; "
                    "on by default for the tiny model)")
    ap.add_argument("--kinds", default=None, help="comma-separated kinds (default: every registered kind)")
    ap.add_argument("--sections", default="kinds,oom,devices,ray,timing,scale", help="comma-separated sections to run")
    ap.add_argument("--memory-budget", default=None, help="the scale section's run.memory_budget (default 20GiB)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    import tracekit.experiments  # noqa: F401  # registers every kind
    from tracekit.experiments.base import REGISTRY

    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(a.sections.split(","))
    kinds = sorted(REGISTRY) if not a.kinds else [k.strip() for k in a.kinds.split(",")]
    unknown = [k for k in kinds if k not in REGISTRY]
    if unknown:
        print(f"--kinds: unknown kind(s) {unknown}; registered: {sorted(REGISTRY)}", file=sys.stderr)
        return 2
    rep = Report()
    models = ["tiny"] + ([EMBEDDED] if a.embedded and not a.quick else [])
    QUICK["on"] = a.quick
    devices = ["cpu", "cuda"]
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        for name in models:
            if "kinds" in sections:
                run_kinds(rep, name, configurations(a.quick, a.cpu_bf16 or name == "tiny", repeat=name == "tiny"), kinds)
            if "oom" in sections:
                for device in devices:
                    _guarded(rep, "oom", "halving", partial(check_oom, rep, name, device), model=name, device=device)
            if "timing" in sections:
                run_timings(rep, name, devices, Path(tmp))
        if "devices" in sections:
            _guarded(rep, "devices", "devices", lambda: check_devices(rep))
        if "ray" in sections:
            _guarded(rep, "ray", "GPU actor", lambda: check_ray(rep, Path(tmp)))
        if "scale" in sections:
            _guarded(rep, "scale", "ladder", lambda: check_scale(rep, out, a.memory_budget))
    wall = time.perf_counter() - t0
    doc = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "wall_seconds": round(wall, 1),
           "args": vars(a), "machine": machine(), "tolerances": TOL, "compared": COMPARE, "invariants": INVARIANTS,
           "counts": rep.counts(), "records": rep.records}
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str))
    m = machine()
    head = (f"# gpu_check {doc['date']} on {m['host']} ({', '.join(m['gpus']) or 'no GPU'}; {m['cpus']} CPUs; "
            f"torch {m['torch']}, TransformerLens {m['transformer_lens']}; git {m['git']}); {wall:.0f} s\n\n")
    (out / "gpu_check.md").write_text(head + rep.markdown())
    c = rep.counts()
    print(f"gpu_check: {c['pass']} passed, {c['fail']} failed, {c['error']} errors, {c['skip']} skipped in {wall:.0f} s; "
          f"{out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    return 1 if c["fail"] or c["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
