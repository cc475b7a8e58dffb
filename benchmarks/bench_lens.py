"""Benchmark: tracekit's logit lens vs the same lens done by hand on the raw Hugging Face model.

In one process, on the same weights (the embedded SmolLM2-135M by default, float32, CPU) and the
same 256 prompts (capital-city sentences built here, offline), batched by 64:

* tracekit: ``tracekit.LogitLens(prompts=..., target=" Paris", batch_size=64).run(model)``
  (last position of each prompt, every hidden state; tables included);
* raw HF: ``model(..., output_hidden_states=True)`` on a separate Hugging Face model with the same
  (memory-mapped) weights, then the same readout by hand: final norm + unembedding at each
  prompt's last token, ``log_softmax`` in float32, the target's log-prob;
* fast path (``--fast``, default on): :func:`tracekit.fastpath.lens_readout` over
  :func:`tracekit.fastpath.residual_stream` on the bridge, i.e. what the lens engine can call.

Both sides are warmed up once, then timed ``--repeats`` times (best time kept). Prints each time,
the wall-time ratios and the max abs difference of the target's log-probs at every layer (the
final layer included) between tracekit and raw HF. Last line:
``ratio <tracekit/raw>x max_abs_diff <value>``.

    python benchmarks/bench_lens.py [--model smollm2-135m] [--threads 2] [--n 256] [--batch-size 64]
        [--profile out.prof]   # cProfile of one tracekit run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

COUNTRIES = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
             ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
             ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
             ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
             ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"),
             ("Cuba", "Havana"), ("Thailand", "Bangkok"), ("Turkey", "Ankara"), ("Hungary", "Budapest"),
             ("Belgium", "Brussels"), ("Denmark", "Copenhagen"), ("India", "New Delhi"),
             ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"), ("Iran", "Tehran"),
             ("Vietnam", "Hanoi"), ("Australia", "Canberra")]
TEMPLATES = ["The capital of {c} is", "{c}'s capital city is",
             "The capital of {o} is {oc}. The capital of {c} is",
             "Q: What is the capital of {c}? A: The capital is",
             "I flew to the capital of {c}, which is", "Everyone knows that the capital of {c} is the city of",
             "The government of {c} sits in", "Fact: the capital city of {c} is"]


def build_prompts(n: int) -> list[str]:
    """``n`` varied capital-city prompts (templates x countries, deterministic)."""
    out = []
    i = 0
    while len(out) < n:
        t = TEMPLATES[(i // len(COUNTRIES)) % len(TEMPLATES)]
        c, _ = COUNTRIES[i % len(COUNTRIES)]
        o, oc = COUNTRIES[(i * 7 + 3) % len(COUNTRIES)]
        out.append(t.format(c=c, o=o, oc=oc))
        i += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, same for every side")
    ap.add_argument("--n", type=int, default=256, help="number of prompts")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--target", default=" Paris")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per side (best kept)")
    ap.add_argument("--no-fast", action="store_true", help="skip the tracekit.fastpath variant")
    ap.add_argument("--profile", default=None, help="write a cProfile of one tracekit run to this file")
    a = ap.parse_args(argv)

    import torch

    import tracekit as tk
    from tracekit.model.load import load_model, model_spec_of
    from tracekit.tokens import chunks, single_token_id, tokenize

    torch.set_num_threads(a.threads)
    prompts = build_prompts(a.n)
    t0 = time.perf_counter()
    model = load_model(a.model, device="cpu")
    print(f"model {a.model}: {model.cfg.n_layers} layers, d_model {model.cfg.d_model}, d_vocab {model.cfg.d_vocab} "
          f"(loaded in {time.perf_counter() - t0:.1f} s); torch threads {torch.get_num_threads()}; "
          f"{len(prompts)} prompts, batch {a.batch_size}")
    raw = _raw_hf(model)
    tgt = single_token_id(model, a.target)
    L = model.cfg.n_layers
    spec = model_spec_of(model)

    def run_tracekit():
        return tk.LogitLens(prompts=prompts, target=a.target, batch_size=a.batch_size).run(model, progress=False)

    @torch.no_grad()
    def run_raw():
        """Raw HF: hidden states -> final norm -> lm_head -> log_softmax at each prompt's last token."""
        out = []
        for sl in chunks(len(prompts), a.batch_size):
            batch = tokenize(model, prompts[sl])  # same ids, BOS and padding as tracekit
            o = raw(input_ids=batch.tokens, attention_mask=batch.attention_mask, output_hidden_states=True)
            last = batch.last
            rows = torch.arange(batch.size)
            hs = torch.stack([h[rows, last] for h in o.hidden_states[:-1]])  # [L, b, d]: pre-norm
            lp = torch.log_softmax(raw.lm_head(raw.model.norm(hs)).float(), -1)  # [L, b, vocab]
            final = torch.log_softmax(o.logits[rows, last].float(), -1)  # hidden_states[L] (normed by HF)
            out.append(torch.cat([lp[..., tgt], final[None, :, tgt]]).T)  # [b, L+1]
        return torch.cat(out)

    def run_fast():
        from tracekit.fastpath import lens_readout, residual_stream

        names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(L)]  # hidden_states
        out = []
        for sl in chunks(len(prompts), a.batch_size):
            batch = tokenize(model, prompts[sl])
            resid = residual_stream(model, batch, names, positions=batch.last)  # [L+1, b, d]
            r = lens_readout(model, resid, target_ids=[tgt], top_k=10)
            out.append(r["target_log_prob"][..., 0].T)  # [b, L+1]
        return torch.cat(out)

    def best(fn):
        fn()  # warm-up
        ts = []
        res = None
        for _ in range(a.repeats):
            t = time.perf_counter()
            res = fn()
            ts.append(time.perf_counter() - t)
        return min(ts), res

    t_tk, res = best(run_tracekit)
    t_raw, ref = best(run_raw)
    m = res.tables["main"]
    m = m[m["target"] == a.target].sort_values(["prompt_idx", "layer"])
    ours = torch.tensor(m["log_prob"].to_numpy(), dtype=torch.float32).reshape(len(prompts), L + 1)
    diff = (ours - ref).abs().max().item()
    print(f"tracekit LogitLens: {t_tk:.2f} s; raw HF hidden_states + readout: {t_raw:.2f} s; "
          f"ratio {t_tk / t_raw:.2f}x; max_abs_diff(target log-prob, all layers) {diff:.2e} "
          f"(prepend_bos={spec.prepend_bos})")
    if not a.no_fast:
        t_fast, fast = best(run_fast)
        dfast = (fast - ref).abs().max().item()
        print(f"tracekit.fastpath residual_stream + lens_readout: {t_fast:.2f} s; ratio {t_fast / t_raw:.2f}x; "
              f"max_abs_diff {dfast:.2e}")
    if a.profile:
        import cProfile

        cProfile.runctx("run_tracekit()", globals(), {"run_tracekit": run_tracekit}, a.profile)
        print(f"profile of one tracekit run written to {a.profile}")
    print(f"ratio {t_tk / t_raw:.2f}x max_abs_diff {diff:.2e}")
    return 0


def _raw_hf(model):
    """A plain Hugging Face model with the bridge's weights as loaded (before TransformerLens' weight
    processing): a separate module tree sharing the tensors (tracekit.model.load keeps them per process)."""
    from tracekit.model import load as models
    from tracekit.model.spec import DTYPES

    spec = models.model_spec_of(model)
    entry = models._WEIGHTS.get(spec.weights_key())
    if entry is None:
        raise SystemExit("the raw HF side needs tracekit.model.load's shared weights (load with tracekit.load_model)")
    return models._hf_from_weights(entry, DTYPES[spec.dtype]).eval()


if __name__ == "__main__":
    sys.exit(main())
