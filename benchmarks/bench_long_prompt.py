"""Long prompts: the bridge's forward, the lens and the heavy kinds on one 2,048-token prompt.

On one prompt of ``--tokens`` tokens (Python-docs prose from :mod:`tracekit.corpus`, then
"The capital of France is"), in one process, each timed ``--repeats`` times (best kept) after one
warm-up, with its working memory (peak RSS polled every 2 ms minus the RSS before it; see
``bench_scale.Peak``):

* ``hf_sdpa`` / ``hf_eager``: a plain ``transformers`` model of the same weights (the dequantised
  GGUF from tracekit's weight cache, a Hugging Face folder) with ``output_hidden_states=True``, with
  PyTorch's fused attention (transformers' default) and with eager attention (what tracekit loads);
* ``bridge_forward``: ``model(tokens)`` on the TransformerBridge; ``bridge_no_hooks``: the bridge's
  wrapped HF model called directly (the bridge's own per-module overhead left out);
  ``run_with_cache``: every hook cached;
* ``lens``: ``tracekit.LogitLens`` (last position, every hidden state); ``trace``, ``patching``
  (resid_pre at the last position of the first and last blocks: 2 replays), ``atp`` (attribution patching, head_out + resid_pre) and
  ``backward`` (an attribution-style pass: gradients of the logit difference at every block's
  resid_pre, all positions) with ``--kinds``.

``--profile DIR`` writes the torch.profiler table of one bridge forward and one raw eager / sdpa
forward (top ops by self CPU time). Last line: ``lens_vs_hf_sdpa <x> lens_vs_hf_eager <y>``.

    python benchmarks/bench_long_prompt.py [--model smollm2-135m] [--tokens 2048] [--profile /tmp/prof]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scale import GEMMA_GGUF, Peak, filler_ids  # noqa: E402

KINDS = ["lens", "trace", "patching", "atp", "backward"]


def hf_folder(model_name: str) -> Path:
    """tracekit's weight-cache folder of a GGUF model (config.json + model.safetensors, float32)."""
    import torch

    from tracekit.model.source import embedded_gguf_path
    from tracekit.model.weights_cache import entry_path, gguf_cache_key

    path = GEMMA_GGUF if "gemma" in model_name else embedded_gguf_path()
    return entry_path(gguf_cache_key(path, torch.float32)[0])


def timed(fn, long, short, repeats: int) -> tuple[float, int]:
    """``(best seconds, largest working memory in bytes)`` of ``fn(long)`` over ``repeats`` runs after
    one warm-up ``fn(short)`` (lazy imports and hook wiring; a short input keeps it cheap)."""
    fn(short)
    best, work = float("inf"), 0
    for _ in range(repeats):
        gc.collect()
        with Peak("cpu") as m:
            t = time.perf_counter()
            fn(long)
            best = min(best, time.perf_counter() - t)
        work = max(work, m.work)
    return best, work


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--profile", default=None)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import tracekit as tk

    if a.threads:
        torch.set_num_threads(a.threads)
    model = tk.load_model(a.model if "gemma" not in a.model else GEMMA_GGUF)
    prompt = model.tokenizer.decode(filler_ids(model, a.tokens - 7)) + "\nThe capital of France is"
    tokens = model.to_tokens(prompt)
    short_prompt = model.tokenizer.decode(filler_ids(model, 16)) + "\nThe capital of France is"
    short = model.to_tokens(short_prompt)
    T = tokens.shape[1]
    print(f"model {a.model} tokens {T} threads {torch.get_num_threads()}", flush=True)
    res: dict[str, dict] = {}

    def show(name: str, fn, long=tokens, shorter=short) -> None:
        s, w = timed(fn, long, shorter, a.repeats)
        res[name] = {"seconds": round(s, 3), "work_mib": round(w / 2**20, 1)}
        print(f"{name:18s} {s:8.3f} s  working memory {w / 2**20:8.1f} MiB", flush=True)

    folder = hf_folder(a.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = {impl: AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=impl)
              for impl in ("sdpa", "eager")}
    with torch.no_grad():
        for impl, m in hf.items():
            show(f"hf_{impl}", lambda t, m=m: m(t, output_hidden_states=True))
        show("bridge_forward", lambda t: model(t))
        inner = model.original_model
        show("bridge_no_hooks", lambda t: inner(t, output_hidden_states=True))
        show("run_with_cache", lambda t: model.run_with_cache(t))
    kinds = a.kinds.split(",")
    from tracekit.experiments.base import REGISTRY

    def ds(text: str) -> dict:
        return {"dataset": {"rows": [{"prompt": text, "target": " Paris", "foil": " Rome",
                                      "corrupted": text[: -len("France is")] + "Italy is"}]}}

    configs = {
        "lens": {"kind": "logit_lens", "target": " Paris"},
        "trace": {"kind": "token_trace", "key_max_tokens": 128, "top_neurons": 2,
                  "key_contexts": 1, "n_samples": 1},
        "patching": {"kind": "activation_patching", "sites": ["resid_pre"], "directions": ["denoising"],
                     "positions": [-1], "layers": [0, -1]},
        "atp": {"kind": "attribution_patching", "sites": ["head_out", "resid_pre"], "verify": {"enabled": False}},
    }
    for name, cfg in configs.items():
        if name not in kinds:
            continue
        kind = cfg["kind"]
        source = (lambda text: {"prompts": [text]}) if kind == "logit_lens" else ds

        def run_kind(text: str, kind: str = kind, cfg: dict = cfg, source=source) -> None:
            REGISTRY[kind].model_validate({**cfg, **source(text)}).run(model, progress=False)

        show(name, run_kind, prompt, short_prompt)
    if "backward" in kinds:
        names = [f"blocks.{i}.hook_resid_pre" for i in range(model.cfg.n_layers)]
        p_id, r_id = model.to_single_token(" Paris"), model.to_single_token(" Rome")

        def backward(toks):
            acts = {}

            def keep(act, hook):
                if not act.requires_grad:  # the first: a leaf every later activation depends on
                    act = act.detach().requires_grad_(True)
                act.retain_grad()
                acts[hook.name] = act
                return act

            with torch.enable_grad():
                model.zero_grad(set_to_none=True)
                logits = model.run_with_hooks(toks, fwd_hooks=[(n, keep) for n in names])
                (logits[0, -1, p_id] - logits[0, -1, r_id]).backward()
            return [acts[n].grad for n in names]

        for p in model.parameters():
            p.requires_grad_(False)
        show("backward", backward)
    base = res["hf_sdpa"]["seconds"]
    for v in res.values():
        v["vs_hf_sdpa"] = round(v["seconds"] / base, 2)
    if a.profile:
        profile(model, hf, tokens, Path(a.profile))
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "tokens": T, "results": res}, indent=1))
    lens = res.get("lens", res["bridge_forward"])["seconds"]
    print(f"lens_vs_hf_sdpa {lens / base:.2f} lens_vs_hf_eager {lens / res['hf_eager']['seconds']:.2f}")
    return 0


def profile(model, hf: dict, tokens, out: Path) -> None:
    """torch.profiler tables (top 25 ops by self CPU time) of one forward each: bridge, HF eager, HF sdpa."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    out.mkdir(parents=True, exist_ok=True)
    runs = {"bridge": lambda: model(tokens), "hf_eager": lambda: hf["eager"](tokens, output_hidden_states=True),
            "hf_sdpa": lambda: hf["sdpa"](tokens, output_hidden_states=True)}
    with torch.no_grad():
        for name, fn in runs.items():
            fn()
            with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                fn()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            (out / f"{name}.txt").write_text(table)
            print(f"--- {name}\n" + "\n".join(table.splitlines()[:16]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
