"""Benchmark: attribution patching (AtP) vs exact activation patching of every head at every position.

In one process, on the embedded model (``tracekit.load_model()``: SmolLM2-135M, 30 layers x 9 heads,
float32, CPU) and its IOI rows (``DatasetSpec(generator={"name": "ioi", "n": N}, filter="correct")``;
only the rows of the most common token length are kept, so every side runs one equal-length batch):

* AtP: ``tracekit.circuits.attribution.attribution_patch(model, clean, corrupted, ["head_out_by_pos"],
  ["denoising"], ["logit_diff"], targets, foils)``: two forward passes and one backward pass, a
  first-order estimate of every (layer, position, head) patch;
* exact: ``tracekit.patching.run_patching(...)`` with the same arguments: tracekit's batched,
  layer-skipping engine, every site patched for real;
* TransformerLens: ``transformer_lens.patching.get_act_patch_attn_head_out_by_pos(model,
  corrupted_tokens, clean_cache, metric)`` with ``metric`` = the logit difference averaged over rows:
  one forward pass of the batch per (layer, position, head). ``--tl-layers N`` runs only the last N
  layers (``index_df``) and scales the time to all layers (the output says when it is scaled).
* one plain forward pass of the batch (``model(tokens)``): AtP's cost in forward-pass equivalents.

AtP, exact and the forward pass are warmed up once, then timed ``--repeats`` times, interleaved
(best time kept; the machine's load moves single timings a lot); TransformerLens is timed once.
Checks: Pearson correlation of AtP's per-site mean over rows with the exact engine's (the estimate
is first order: it is not expected to be 1), and the max abs difference between the exact engine
and TransformerLens on the layers TransformerLens ran (~1e-5: both are exact). Last line:
``speedup <exact/AtP>x pearson <r>``.

    python benchmarks/bench_attribution.py [--threads 2] [--n 16] [--repeats 3] [--tl-layers N] [--no-tl]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads, same for every side")
    ap.add_argument("--n", type=int, default=16, help="IOI rows generated (before filter: correct and the length filter)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of AtP, exact and the forward pass (best kept)")
    ap.add_argument("--tl-layers", type=int, default=None,
                    help="TransformerLens over the last N layers only, time scaled to all layers; default: all")
    ap.add_argument("--no-tl", action="store_true", help="skip TransformerLens")
    a = ap.parse_args(argv)

    import pandas as pd
    import torch
    from transformer_lens import patching as tlp

    import tracekit as tk
    from tracekit.circuits.attribution import attribution_patch
    from tracekit.dataset import DatasetSpec
    from tracekit.patching import run_patching

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    model = tk.load_model()
    n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
    print(f"model loaded in {time.perf_counter() - t0:.1f}s: {n_layers} layers x {n_heads} heads; "
          f"torch threads {torch.get_num_threads()}")
    data = DatasetSpec(generator={"name": "ioi", "n": a.n}, filter="correct").prepare(model, "dataset")
    ex = [e for e in data.examples if e.corrupted_ids is not None and len(e.corrupted_ids) == len(e.ids)]
    if not ex:
        print("no IOI row with a corrupted prompt of the clean prompt's length", file=sys.stderr)
        return 2
    length, _ = Counter(len(e.ids) for e in ex).most_common(1)[0]
    ex = [e for e in ex if len(e.ids) == length]
    clean = [list(e.ids) for e in ex]
    corr = [list(e.corrupted_ids) for e in ex]
    tgt = [int(e.target_id) for e in ex]
    foil = [int(e.foil_id) for e in ex]
    g = len(ex)
    n_sites = n_layers * length * n_heads
    print(f"{len(data)} correct IOI rows of {a.n}; {g} of length {length} kept (one batch); "
          f"{n_sites} sites (layer x position x head)")

    clean_t, corr_t = torch.tensor(clean), torch.tensor(corr)
    rows = torch.arange(g)
    args = (model, clean, corr, ["head_out_by_pos"], ["denoising"], ["logit_diff"],
            [[t] for t in tgt], [[f] for f in foil])

    def run_atp():
        return attribution_patch(*args)

    def run_exact():
        return run_patching(*args)

    @torch.no_grad()
    def run_forward():
        return model(clean_t)

    def per_site(run) -> torch.Tensor:
        """``[layer, pos, head]`` mean over rows of one job's patched logit difference."""
        job = run.jobs[0]
        v = job.values[:, 0].reshape(len(job.index), -1).mean(1)
        out = torch.full((n_layers, length, n_heads), float("nan"))
        idx = job.index
        out[torch.tensor(idx["layer"].to_numpy(copy=True)), torch.tensor(idx["pos"].to_numpy(copy=True)),
            torch.tensor(idx["head"].to_numpy(copy=True))] = v.float()
        return out

    sides = {"atp": run_atp, "exact": run_exact, "forward": run_forward}
    out = {name: fn() for name, fn in sides.items()}  # warm-up
    best = {name: float("inf") for name in sides}
    for _ in range(a.repeats):
        for name, fn in sides.items():
            t = time.perf_counter()
            out[name] = fn()
            best[name] = min(best[name], time.perf_counter() - t)
    atp, exact = per_site(out["atp"]), per_site(out["exact"])
    r = torch.corrcoef(torch.stack([atp.flatten(), exact.flatten()]).double())[0, 1].item()

    tl_line = None
    if not a.no_tl:
        k = n_layers if a.tl_layers is None else max(1, min(n_layers, a.tl_layers))
        first = n_layers - k
        import itertools

        idf = pd.DataFrame(list(itertools.product(range(first, n_layers), range(length), range(n_heads))),
                           columns=["layer", "pos", "head_index"])

        def tl_metric(logits):  # TransformerLens: full logits -> scalar (mean logit difference over rows)
            return (logits[rows, -1, tgt] - logits[rows, -1, foil]).mean()

        with torch.no_grad():
            _, clean_cache = model.run_with_cache(clean_t)
        t = time.perf_counter()
        ref = tlp.get_act_patch_attn_head_out_by_pos(model, corr_t, clean_cache, tl_metric,
                                                     index_axis_names=None, index_df=idf).cpu().float()
        t_tl = time.perf_counter() - t
        del clean_cache
        ours = exact[idf["layer"].tolist(), idf["pos"].tolist(), idf["head_index"].tolist()]
        diff = (ref.flatten() - ours).abs().max().item()
        scaled = k < n_layers
        best["transformer_lens"] = t_tl * n_layers / k
        tl_line = (f"TransformerLens: {len(idf)} forward passes (layers {first}..{n_layers - 1}) in {t_tl:.2f} s"
                   + (f"; scaled to {n_layers} layers: {best['transformer_lens']:.2f} s (estimated)" if scaled
                      else " (all layers, not scaled)")
                   + f"; max_abs_diff exact vs TransformerLens {diff:.2e} (values in "
                   f"[{ref.min().item():+.3f}, {ref.max().item():+.3f}])")

    for name, t in best.items():
        note = " (scaled)" if name == "transformer_lens" and a.tl_layers is not None and a.tl_layers < n_layers else ""
        print(f"{name:>17}: {t:8.3f} s{note}")
    if tl_line:
        print(tl_line)
    speed = best["exact"] / best["atp"]
    print(f"exact / atp: {speed:.1f}x")
    if "transformer_lens" in best:
        print(f"transformer_lens / exact: {best['transformer_lens'] / best['exact']:.1f}x; "
              f"transformer_lens / atp: {best['transformer_lens'] / best['atp']:.1f}x")
    print(f"atp = {best['atp'] / best['forward']:.1f} forward-pass equivalents "
          f"(one forward of the {g} x {length} batch: {best['forward'] * 1e3:.1f} ms)")
    print(f"pearson (AtP vs exact, per-site mean over rows, {n_sites} sites): {r:.4f}")
    print(f"speedup {speed:.1f}x pearson {r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
