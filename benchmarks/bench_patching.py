"""Benchmark: tracekit's batched, layer-skipping activation patching vs TransformerLens' one-at-a-time.

In one process, on the same model and inputs (the embedded SmolLM2-135M by default; clean
"The capital of France is", corrupted "The capital of Italy is", metric logit(' Paris') - logit(' Rome')):

1. residual stream, every layer x position: ``tracekit.patching.batched_act_patch_resid_pre`` vs
   ``transformer_lens.patching.get_act_patch_resid_pre``;
2. head outputs (hook_z), every layer x position x head: tracekit's
   ``batched_act_patch_attn_head_out_by_pos`` vs TransformerLens' ``get_act_patch_attn_head_out_by_pos``
   (``--head-layers`` restricts both to the same layers via ``index_df``).

Prints each wall-time ratio and the max abs difference of the results; tracekit's time includes
its own cached run. The last line is ``speedup <ratio>x max_abs_diff <value>`` for the residual
sweep. ``--no-skip`` also times tracekit without skipping bit-exact no-op patches.

What the ratio depends on besides the code (measured; see docs/gpu.md "Patching speed"):

* the number of positions. TransformerLens runs one forward pass per site; tracekit replays only
  the variants whose patch changes something (positions before the first differing token are
  bit-exact no-ops). Since the BOS default became ``auto`` (SmolLM2's tokenizer adds none) the
  prompts are 5 tokens instead of 6: TransformerLens runs 150 passes instead of 180 while tracekit
  still replays the same 60 variants, so the same code shows 5/6 of the old ratio.
  ``--prepend-bos true`` reproduces the 6-token setting of the first measurement (51.0x).
* machine load. With other processes on the cores, torch's thread pool waits on busy cores, and
  many small forward passes (TransformerLens) and few batched ones (tracekit) slow down by different
  factors; measure on a quiet machine (``uptime``), and compare code versions interleaved.

    python benchmarks/bench_patching.py [--model smollm2-135m] [--threads 2] [--head-layers 30]
        [--prepend-bos auto|true|false]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, cast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def time_resid_pre(model, clean, corrupted, target: int, foil: int, batch_size: int | str = "auto", clean_cache=None,
                   skip_unchanged: bool = True) -> dict:
    """Time the residual-stream sweep (every layer x position) both ways on one pair of prompts.

    TransformerLens' ``get_act_patch_resid_pre`` (one forward pass per site, metric on the full
    logits) against tracekit's ``batched_act_patch_resid_pre`` (one cached run, then batched,
    layer-skipping replays; its time includes its own cached run). Metric: logit(target) -
    logit(foil) at the last position.

    Args:
        model: the loaded bridge (any device).
        clean: ``[1, pos]`` clean token ids, on the model's device.
        corrupted: ``[1, pos]`` corrupted token ids (same length).
        target: token id of the answer.
        foil: token id of the alternative.
        batch_size: tracekit's variants per replay batch, or ``auto``.
        clean_cache: TransformerLens' cache of the clean run (made here when None; not timed).
        skip_unchanged: tracekit takes the cached run's metric for bit-exact no-op patches.

    Returns:
        ``{"tl_seconds", "tracekit_seconds", "ratio", "max_abs_diff", "sites", "replayed", "reference"}``:
        ``sites`` = TransformerLens' forward passes (layers x positions), ``replayed`` = the variants
        tracekit replays (positions from the first differing token on), ``reference`` ``[layers, pos]``.
    """
    import torch
    from transformer_lens import patching as tlp

    from tracekit import patching as tkp

    def tl_metric(logits):  # TransformerLens: full logits [batch, pos, vocab] -> scalar
        return (logits[:, -1, target] - logits[:, -1, foil]).mean()

    def tk_metric(logits, prompt):  # tracekit: last-position logits [rows, vocab] -> [rows]
        return logits[:, target] - logits[:, foil]

    if clean_cache is None:
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(clean)
    t = time.perf_counter()
    ref = tlp.get_act_patch_resid_pre(model, corrupted, clean_cache, tl_metric).float().cpu()
    t_tl = time.perf_counter() - t
    t = time.perf_counter()
    ours = tkp.batched_act_patch_resid_pre(model, corrupted, clean, tk_metric, batch_size=batch_size,
                                           skip_unchanged=skip_unchanged).mean(0).float().cpu()
    t_tk = time.perf_counter() - t
    differs = (clean != corrupted).any(0).nonzero().flatten()
    first = int(differs[0]) if len(differs) else clean.shape[1]  # earlier positions: bit-exact no-op patches
    replayed = model.cfg.n_layers * (clean.shape[1] - first) if skip_unchanged else ref.numel()
    return {"tl_seconds": t_tl, "tracekit_seconds": t_tk, "ratio": t_tl / t_tk,
            "max_abs_diff": (ref - ours).abs().max().item(), "sites": ref.numel(), "replayed": replayed,
            "reference": ref}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="tracekit's batched activation patching vs TransformerLens' one-at-a-time.")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, same for both sides")
    ap.add_argument("--clean", default="The capital of France is")
    ap.add_argument("--corrupted", default="The capital of Italy is")
    ap.add_argument("--target", default=" Paris")
    ap.add_argument("--foil", default=" Rome")
    ap.add_argument("--head-layers", type=int, default=None,
                    help="head sweep over the last N layers only (both sides); default: all layers")
    ap.add_argument("--skip-heads", action="store_true", help="only the residual sweep")
    ap.add_argument("--no-skip", action="store_true", help="also time tracekit with skip_unchanged=False")
    ap.add_argument("--batch-size", default="auto")
    ap.add_argument("--prepend-bos", choices=["auto", "true", "false"], default="auto",
                    help="model.prepend_bos (true: the 6-token prompts of the first measurement)")
    a = ap.parse_args(argv)

    import pandas as pd
    import torch
    from transformer_lens import patching as tlp

    from tracekit import patching as tkp
    from tracekit.model.load import load_model
    from tracekit.tokens import single_token_id, tokenize

    torch.set_num_threads(a.threads)
    bs = a.batch_size if a.batch_size == "auto" else int(a.batch_size)
    t0 = time.perf_counter()
    bos = {"auto": "auto", "true": True, "false": False}[a.prepend_bos]
    model = load_model(a.model, device=a.device, prepend_bos=bos)
    print(f"model {a.model}: {model.cfg.n_layers} layers, d_model {model.cfg.d_model}, {model.cfg.n_heads} heads "
          f"(loaded in {time.perf_counter() - t0:.1f} s); torch threads {torch.get_num_threads()}")
    clean = tokenize(model, [a.clean]).tokens
    corrupted = tokenize(model, [a.corrupted]).tokens
    if clean.shape != corrupted.shape:
        print("clean and corrupted prompts tokenize to different lengths", file=sys.stderr)
        return 2
    target, foil = single_token_id(model, a.target), single_token_id(model, a.foil)

    def tl_metric(logits):  # TransformerLens: full logits [batch, pos, vocab] -> scalar
        return (logits[:, -1, target] - logits[:, -1, foil]).mean()

    def tk_metric(logits, prompt):  # tracekit: last-position logits [rows, vocab] -> [rows]
        return logits[:, target] - logits[:, foil]

    with torch.no_grad():
        model(clean)  # warm-up, both sides
        model(corrupted)
        _, clean_cache = model.run_with_cache(clean)

    # 1. residual stream, all layers x positions
    r = time_resid_pre(model, clean, corrupted, target, foil, bs, clean_cache)
    t_tl, t_tk, diff = r["tl_seconds"], r["tracekit_seconds"], r["max_abs_diff"]
    ref = r["reference"]
    print(f"resid_pre {tuple(ref.shape)} ({r['sites']} sites, {r['replayed']} replayed by tracekit): TransformerLens {t_tl:.2f} s, tracekit {t_tk:.2f} s, "
          f"ratio {t_tl / t_tk:.1f}x, max_abs_diff {diff:.2e}")
    if a.no_skip:
        t = time.perf_counter()
        ours2 = tkp.batched_act_patch_resid_pre(model, corrupted, clean, tk_metric, batch_size=bs,
                                                skip_unchanged=False).mean(0).cpu()
        t2 = time.perf_counter() - t
        print(f"resid_pre without skipping no-op patches: tracekit {t2:.2f} s, ratio {t_tl / t2:.1f}x, "
              f"max_abs_diff {(ref - ours2).abs().max().item():.2e}")

    # 2. head outputs per position
    if not a.skip_heads:
        n_layers, n_pos, n_heads = model.cfg.n_layers, clean.shape[1], model.cfg.n_heads
        first = 0 if a.head_layers is None else max(0, n_layers - a.head_layers)
        import itertools

        idf = pd.DataFrame(list(itertools.product(range(first, n_layers), range(n_pos), range(n_heads))),
                           columns=["layer", "pos", "head_index"])
        t = time.perf_counter()
        ref_h = tlp.get_act_patch_attn_head_out_by_pos(cast(Any, model), corrupted, clean_cache, tl_metric,
                                                       index_axis_names=None, index_df=idf).cpu()
        th_tl = time.perf_counter() - t
        t = time.perf_counter()
        ours_h = tkp.batched_act_patch_attn_head_out_by_pos(
            model, corrupted, clean, tk_metric, index_df=idf.rename(columns={"head_index": "head"}),
            batch_size=bs).mean(0)
        th_tk = time.perf_counter() - t
        print(f"head_out_by_pos ({len(idf)} sites, layers {first}..{n_layers - 1}): TransformerLens {th_tl:.2f} s, "
              f"tracekit {th_tk:.2f} s, ratio {th_tl / th_tk:.1f}x, "
              f"max_abs_diff {(ref_h - ours_h).abs().max().item():.2e}")

    print(f"speedup {t_tl / t_tk:.1f}x max_abs_diff {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
