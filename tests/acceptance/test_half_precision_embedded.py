"""Every kind on the real embedded model (SmolLM2-135M) in float16 and bfloat16, against the float32
run of the same config (issue #33 items 10 and 16: half precision was refused at load; the logit
lens in half precision had passed before, so this guards it as a regression).

Each kind runs its small config from ``tests/helpers.py`` ``KIND_EXAMPLES`` once per dtype (one model
per dtype, loaded once per module) and once in float32 (the session's ``embedded_model``). The
summary numbers ``benchmarks/gpu_check.py`` ``COMPARE`` lists for the kind must agree with the
float32 run within ``TOL[dtype]`` (``|x - ref| <= atol + rtol |ref|``; float16 keeps 11 significand
bits, bfloat16 8: their columns are stated there), and the kind's own exactness errors
(``INVARIANTS``) must stay under the dtype's ceiling. A kind that cannot run in half precision must
refuse with a TracekitError naming the dtype (``REFUSED_IN_HALF``), never crash.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest

from helpers import KIND_EXAMPLES, load_gpu_check
from tracekit.compat import sae_lens_status
from tracekit.core.io import jsonable
from tracekit.errors import TracekitError
from tracekit.experiments.base import REGISTRY

HALF = ["float16", "bfloat16"]

#: Kinds that refuse a float16 / bfloat16 model by name (none: every kind runs in half precision).
REFUSED_IN_HALF: dict[str, set[str]] = {"float16": set(), "bfloat16": set()}

#: The logit lens' prompt and answer (one short prompt: the lens runs every hidden state).
PROMPT, ANSWER = "The capital of China is Beijing. The capital of France is", " Paris"




@pytest.fixture(scope="module", params=HALF)
def half_model(request):
    """The embedded model in float16 / bfloat16 on the CPU (passes the load-time verification)."""
    from tracekit.model.load import load_model

    return load_model("smollm2-135m", device="cpu", dtype=request.param)


_F32: dict[str, dict] = {}


#: Smaller configs than KIND_EXAMPLES' for the 30-block model (the same summary numbers are compared).
EMBEDDED_OVERRIDES: dict[str, dict] = {
    "activation_patching": {"sites": ["resid_pre"], "positions": [-1], "ablations": ["zero"]},
}


def _run(kind: str, model) -> dict:
    exp = REGISTRY[kind].model_validate({"kind": kind, **KIND_EXAMPLES[kind], **EMBEDDED_OVERRIDES.get(kind, {})})
    return jsonable(exp.run(model, progress=False).summary())


@pytest.mark.slow
def test_half_precision_loads_and_records_the_rule(half_model):
    """The load-time verification passes in half precision and records the float32-reference rule."""
    from tracekit.model.state import state_of

    dtype = str(next(half_model.parameters()).dtype).replace("torch.", "")
    v = state_of(half_model).verification
    assert v is not None and v["passed"] is True
    checks = {c["name"]: c for c in v["checks"]}
    assert {"forward", "forward_mean", "lens_final"} <= set(checks)
    for c in checks.values():
        assert c["status"] == "pass" and c["value"] <= c["tolerance"], c
    assert "float32" in checks["forward"]["detail"] and dtype in checks["forward"]["detail"]


@pytest.mark.slow
def test_logit_lens_in_half_precision_matches_float32(half_model, embedded_model):
    """The logit lens in half precision: same final top-1 (' Paris'), same top-1 token at every hidden
    state and position for >= 95% (float16) / 85% (bfloat16) of them (the lens of early hidden states has
    near-ties), every probability within 0.02 / 0.1, and the answer's log-probability at the final
    hidden state within 0.05 / 0.25 nats of float32's."""
    import tracekit as tk

    dtype = str(next(half_model.parameters()).dtype).replace("torch.", "")
    lens = tk.LogitLens(prompts=[PROMPT], target=ANSWER, position="all")
    ref, got = lens.run(embedded_model, progress=False), lens.run(half_model, progress=False)
    assert got.summary()["final_top1"] == ref.summary()["final_top1"] == ANSWER
    a, b = ref.to_frame(), got.to_frame()
    key = ["prompt_idx", "position", "hidden_state", "target"]
    m = a.merge(b, on=key, suffixes=("_32", "_h"))
    assert len(m) == len(a) == len(b)
    bound = {"float16": 0.05, "bfloat16": 0.25}[dtype]
    hs, pos = m["hidden_state"].to_numpy(), m["position"].to_numpy()
    last = (hs == hs.max()) & (pos == pos.max())  # the answer's row at the final hidden state
    d = float(np.abs(m["log_prob_32"].to_numpy(float)[last] - m["log_prob_h"].to_numpy(float)[last]).max())
    assert d <= bound, f"answer log-prob at the final hidden state differs by {d:.3g} nats"
    agree = float(np.mean(m["top1_32"].to_numpy() == m["top1_h"].to_numpy()))
    dp = float(np.abs(m["prob_32"].to_numpy(float) - m["prob_h"].to_numpy(float)).max())
    print(f"[half] logit_lens {dtype}: final |d log p| {d:.3g}, top-1 agreement {agree:.3f}, max |d prob| {dp:.3g}")
    assert agree >= {"float16": 0.95, "bfloat16": 0.85}[dtype]  # measured 0.995 / 0.914 (early-layer near-ties)
    assert dp <= {"float16": 0.02, "bfloat16": 0.1}[dtype]


#: The every-kind tier costs ~25-30 min of CPU on 2 cores (float16 has no fast CPU kernels; lens_quality
#: alone 273 s), more than the README's test command and CI can carry today: it runs when
#: ``TRACEKIT_HALF_TIER=1`` (``make test-half``) and on a GPU through ``benchmarks/gpu_check.py``, which
#: compares the same numbers with the same tolerances. The load check and the logit-lens regression above
#: run in every slow tier.
HALF_TIER = os.environ.get("TRACEKIT_HALF_TIER") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not HALF_TIER, reason="every kind in float16/bfloat16 on the embedded model (~25-30 min of "
                                          "CPU): set TRACEKIT_HALF_TIER=1 or run `make test-half`")
@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_every_kind_in_half_precision_matches_float32(kind, half_model, embedded_model):
    gc = load_gpu_check()
    dtype = str(next(half_model.parameters()).dtype).replace("torch.", "")
    if kind.startswith("sae_") and sae_lens_status(import_check=False) is not None:
        pytest.skip("sae-lens is not installed")
    if kind in REFUSED_IN_HALF[dtype]:
        with pytest.raises(TracekitError, match=dtype):
            _run(kind, half_model)
        return
    if kind not in _F32:
        _F32[kind] = _run(kind, embedded_model)
    t = time.perf_counter()
    got = _run(kind, half_model)
    sec = time.perf_counter() - t
    assert got, f"{kind}: empty summary"
    inv = gc.check_invariants(kind, got, dtype)
    if kind not in gc.COMPARE:  # no number of it is comparable across dtypes (a store's paths and counts)
        bad = [k for k, v in gc.leaves(got).items() if not math.isfinite(v)]
        print(f"[half] {kind} {dtype} {sec:.1f}s: ran (not compared); invariants: {inv or 'ok'}")
        assert not bad and not inv, f"{kind} in {dtype}: non-finite {bad[:4]}; invariants: {inv}"
        return
    ok, detail, data = gc.compare_summaries(kind, _F32[kind], got, dtype)
    print(f"[half] {kind} {dtype} {sec:.1f}s: {detail}; invariants: {inv or 'ok'}")
    assert ok and not inv, f"{kind} in {dtype}: {detail}; invariants: {inv}"
    assert data["compared"] > 0
