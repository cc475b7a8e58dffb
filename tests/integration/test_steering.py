"""Invariants of steering vectors (:mod:`tracekit.steering`) and the ``steering`` kind, on tiny models:

* alpha 0 is the clean run (the hook adds exactly 0); random controls have exactly the vector's norm;
* the batched dose-response equals one steered forward pass per (direction, alpha, row);
* steering is causal: at one position it changes nothing before it, and something at it;
* generation: unsteered equals TransformerLens' own no-cache greedy generation token for token, and
  steered generation with the KV cache equals the no-cache loop token for token (greedy and seeded
  sampling), because the hook adds at absolute positions whatever the cache feeds;
* vectors: the mean difference equals a hand computation; probe, file and SAE sources load the right row;
* hooks are removed whatever is raised; bad input fails clearly.

Tolerances are absolute (float32, with the reason at each).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from helpers import make_perturbed
from tracekit.errors import ConfigError, HookError
from tracekit.experiments.steering import Steering
from tracekit.results import Result
from tracekit.steering import (
    Steer,
    SteeringError,
    SteeringVector,
    SteerRow,
    StepClock,
    check_vector,
    dose_response,
    file_vector,
    generate,
    mean_difference,
    probe_vector,
    random_directions,
    sae_vector,
    steer,
)
from tracekit.steering import generation as G
from tracekit.tokens import encode

PROMPTS = ["The capital of France is", "Hello, my name is John and I live in"]
HOOK = "blocks.1.hook_resid_pre"


def _vec(model, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(int(model.cfg.d_model), generator=g)


def _rows(model):
    out = []
    for p, t, f in zip(PROMPTS, (" Paris", " London"), (" Rome", " Paris")):
        ids = tuple(encode(model, p))
        out.append(SteerRow(ids, encode(model, t, False)[0], encode(model, f, False)[0], len(ids) - 1,
                            tuple(range(1, len(ids)))))
    return out


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@torch.no_grad()
def _clean_metrics(model, row):
    lg = model(torch.tensor([row.ids]), return_type="logits")[0, row.read_at].float()
    lp = torch.log_softmax(lg, -1)
    return float(lp[row.target_id].exp()), float(lg[row.target_id] - lg[row.foil_id])


# ---------------------------------------------------------------------------------------------
# dose-response


def test_alpha_zero_is_clean_and_controls_match_norm(perturbed_model):
    m = perturbed_model
    rows = _rows(m)
    v = _vec(m)
    dr = dose_response(m, rows, v, HOOK, [0.0, 2.0], n_random=3, seed=7)
    t = dr.table
    assert len(t) == 4 * 2 * 2 and set(t["direction"]) == {"steer", "random_0", "random_1", "random_2"}
    for i, r in enumerate(rows):
        p, ld = _clean_metrics(m, r)
        z = t[(t["alpha"] == 0.0) & (t["row"] == i)]
        # alpha 0 adds exactly 0.0; 1e-6 allows for a different batch shape in the matmuls
        assert np.allclose(z["target_prob"], p, atol=1e-6, rtol=0)
        assert np.allclose(z["logit_diff"], ld, atol=1e-5, rtol=0)
    norms = dr.directions.double().norm(dim=-1)
    assert torch.allclose(norms, torch.full_like(norms, float(v.double().norm())), rtol=1e-6, atol=0)
    assert dr.vector_norm == pytest.approx(float(v.double().norm()), rel=1e-12)
    # the controls are distinct directions, and a real effect is measured (not all zeros)
    cos = torch.nn.functional.cosine_similarity(dr.directions[1:, None], dr.directions[None, 1:], dim=-1)
    assert (cos - torch.eye(3)).abs().max() < 0.9
    a2 = np.asarray(t.loc[(t["alpha"] == 2.0) & (t["direction"] == "steer"), "logit_diff"], dtype=float)
    a0 = np.asarray(t.loc[(t["alpha"] == 0.0) & (t["direction"] == "steer"), "logit_diff"], dtype=float)
    assert np.abs(a2 - a0).max() > 1e-3


def test_random_directions_seeded_exact_norm():
    a = random_directions(4, 64, 12.5, seed=3)
    assert torch.allclose(a.double().norm(dim=-1), torch.full((4,), 12.5, dtype=torch.float64), rtol=1e-6, atol=0)
    assert torch.equal(a, random_directions(4, 64, 12.5, seed=3))
    assert not torch.equal(a, random_directions(4, 64, 12.5, seed=4))


def test_batched_dose_response_equals_single_steered_runs(tiny_llama):
    m = tiny_llama
    rows = _rows(m)
    v = _vec(m, 1)
    dr = dose_response(m, rows, v, HOOK, [1.5, -3.0], n_random=1, seed=0, batch_size=3)
    t = dr.table
    for rec in t.to_dict("records"):
        r = rows[int(rec["row"])]
        direction = dr.directions[int(rec["draw"]) + 1]
        with steer(m, Steer(direction, HOOK, float(rec["alpha"]), r.at), len(r.ids)):
            lg = m(torch.tensor([r.ids]), return_type="logits")[0, r.read_at].float()
        # padded batch of 5 (mixed lengths) vs one unpadded sequence: float32 reassociation only
        assert float(torch.log_softmax(lg, -1)[r.target_id]) == pytest.approx(rec["target_log_prob"], abs=1e-4)
        assert float(lg[r.target_id] - lg[r.foil_id]) == pytest.approx(rec["logit_diff"], abs=1e-4)


def test_steering_is_causal_in_position(tiny_gpt2):
    m = tiny_gpt2
    ids = torch.tensor([encode(m, PROMPTS[1])])
    n = ids.shape[1]
    clean = m(ids, return_type="logits")
    k = 4
    with steer(m, Steer(_vec(m), HOOK, 5.0, (k,)), n):
        st = m(ids, return_type="logits")
    # positions before k never see the edit (causal attention): identical up to float32 kernels
    assert (st[0, :k] - clean[0, :k]).abs().max() < 1e-6
    assert (st[0, k:] - clean[0, k:]).abs().max() > 1e-2
    # negative index counts from the prompt's end
    with steer(m, Steer(_vec(m), HOOK, 5.0, (-1,)), n):
        st2 = m(ids, return_type="logits")
    assert (st2[0, :-1] - clean[0, :-1]).abs().max() < 1e-6 and (st2[0, -1] - clean[0, -1]).abs().max() > 1e-2


def test_clock_offset_selects_absolute_positions(tiny_gpt2):
    """A KV-cached step feeds one token at absolute position ``offset``: the hook adds only when that
    position is wanted (a prompt index, or a generated position)."""
    m = tiny_gpt2
    v = _vec(m)
    tok = torch.tensor([[11]])
    plain = m.run_with_cache(tok, names_filter=[HOOK])[1][HOOK][0, 0]
    for at, generated, offset, added in [((3,), False, 3, True), ((3,), False, 2, False), ((), True, 6, True),
                                         ((), True, 5, False)]:
        with steer(m, Steer(v, HOOK, 2.0, at, generated), 6) as clock:
            assert isinstance(clock, StepClock)
            clock.offset = offset
            got = m.run_with_cache(tok, names_filter=[HOOK])[1][HOOK][0, 0]  # cached after the steering hook
        # the steered hook's own value: input + 2 v exactly, up to one float32 rounding of the sum
        assert torch.allclose(got - plain, 2.0 * v if added else torch.zeros_like(v), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# generation


#: Generation tests run on two of the perturbed variants (Llama processed, GPT-2 raw): each generated
#: token is a forward pass, and the other variants add no new code path to the loop.
GEN_MODELS = [("llama", True), ("gpt2", False)]


@pytest.mark.parametrize("arch,pw", GEN_MODELS)
def test_unsteered_generation_equals_transformerlens_greedy(arch, pw):
    m = make_perturbed(arch, process_weights=pw)
    ids = encode(m, PROMPTS[0])
    out = m.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, use_past_kv_cache=False,
                     stop_at_eos=False, verbose=False)
    assert isinstance(out, torch.Tensor)
    ref = out[0, len(ids):].tolist()
    assert list(generate(m, ids, 5, use_kv_cache=True, stop_at_eos=False).new_ids) == ref


@pytest.mark.parametrize("arch,pw", GEN_MODELS)
@pytest.mark.parametrize("kind,gen", [("all", True), ("index", False), ("none", True)])
def test_steered_generation_kv_cache_equals_no_cache(arch, pw, kind, gen):
    m = make_perturbed(arch, process_weights=pw)
    ids = encode(m, PROMPTS[0])
    at = {"all": tuple(range(1, len(ids))), "index": (2,), "none": ()}[kind]
    s = Steer(_vec(m, 2, scale=4.0), HOOK, 20.0, at, gen)
    a = generate(m, ids, 5, steering=s, use_kv_cache=True, stop_at_eos=False)
    b = generate(m, ids, 5, steering=s, use_kv_cache=False, stop_at_eos=False)
    assert a.new_ids == b.new_ids
    if arch == "llama":  # the steering changes the text (the perturbed GPT-2 repeats one token whatever is added)
        plain = generate(m, ids, 5, stop_at_eos=False)
        assert a.new_ids != plain.new_ids
        if kind == "none":  # generated positions only: the prompt pass is not steered, so the first token is the same
            assert a.new_ids[0] == plain.new_ids[0]


def test_sampled_generation_seeded_and_cache_invariant(tiny_llama):
    m = tiny_llama
    ids = encode(m, PROMPTS[1])
    s = Steer(_vec(m), HOOK, 1.0, (), True)
    kw = {"do_sample": True, "temperature": 1.5, "top_p": 0.9, "seed": 5, "stop_at_eos": False, "steering": s}
    a = generate(m, ids, 5, use_kv_cache=True, **kw)
    assert a.new_ids == generate(m, ids, 5, use_kv_cache=True, **kw).new_ids
    assert a.new_ids == generate(m, ids, 5, use_kv_cache=False, **kw).new_ids
    assert a.new_ids != generate(m, ids, 5, use_kv_cache=True, **{**kw, "seed": 6}).new_ids


def test_hooks_removed_after_exception(tiny_gpt2, monkeypatch):
    m = tiny_gpt2
    before = _hook_count(m)
    with pytest.raises(RuntimeError, match="boom"):
        with steer(m, Steer(_vec(m), HOOK, 1.0, (0,)), 4):
            assert _hook_count(m) > before
            raise RuntimeError("boom")
    assert _hook_count(m) == before
    calls = {"n": 0}
    real = G._pick

    def pick(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(G, "_pick", pick)
    with pytest.raises(KeyboardInterrupt):
        generate(m, encode(m, PROMPTS[0]), 6, steering=Steer(_vec(m), HOOK, 1.0, (), True), stop_at_eos=False)
    assert _hook_count(m) == before  # steering hook and the KV-cache keyword pre-hooks are gone


# ---------------------------------------------------------------------------------------------
# vectors


def test_mean_difference_equals_hand_computation(tiny_llama):
    m = tiny_llama
    pos = [encode(m, p) for p in ("The capital of Italy", "Rome is a city in Italy and")]
    neg = [encode(m, p) for p in ("The capital of France", "Paris is")]
    for read in ("last", "mean"):
        v = mean_difference(m, pos, neg, HOOK, read, batch_size=1 if read == "mean" else 4)
        hand = []
        for group in (pos, neg):
            acts = []
            for ids in group:
                a = m.run_with_cache(torch.tensor([ids]), names_filter=[HOOK])[1][HOOK][0].double()
                acts.append(a[-1] if read == "last" else a[1:].mean(0))  # BOS (prepended) not counted
            hand.append(torch.stack(acts).mean(0))
        # padded batches vs single sequences: float32 reassociation only
        assert torch.allclose(v.vector.double(), hand[0] - hand[1], atol=1e-5, rtol=0)
        assert v.hook == HOOK and v.source["source"] == "mean_difference"


def test_file_probe_and_sae_sources(tmp_path, tiny_gpt2):
    from safetensors.torch import save_file

    m = tiny_gpt2
    d = int(m.cfg.d_model)
    w = torch.randn(3, d)
    torch.save(w[0], tmp_path / "a.pt")
    torch.save({"x": w[1], "y": w[2]}, tmp_path / "b.pt")
    np.save(tmp_path / "c.npy", w[2].numpy())
    save_file({"u": w[0].contiguous(), "z": w[1].contiguous()}, str(tmp_path / "d.safetensors"))
    assert torch.equal(file_vector(tmp_path / "a.pt").vector, w[0])
    assert torch.equal(file_vector(tmp_path / "b.pt", "y").vector, w[2])
    assert torch.equal(file_vector(tmp_path / "c.npy").vector, w[2])
    assert torch.equal(file_vector(tmp_path / "d.safetensors", "z").vector, w[1])
    with pytest.raises(SteeringError, match="key"):
        file_vector(tmp_path / "d.safetensors")
    # a linear_probe step directory: arrays.safetensors + meta.json with the classes
    pdir = tmp_path / "probe"
    pdir.mkdir()
    save_file({"probe.resid_post.1.weight": w.contiguous(), "probe.resid_post.1.bias": torch.zeros(3)},
              str(pdir / "arrays.safetensors"))
    (pdir / "meta.json").write_text(json.dumps({"classes": ["France", "Italy", "Spain"]}))
    pv = probe_vector(pdir, 1, "Italy")
    assert torch.equal(pv.vector, w[1]) and pv.hook == "blocks.1.hook_resid_post"
    assert torch.equal(probe_vector(pdir, 1, 2).vector, w[2])
    with pytest.raises(SteeringError, match="Germany"):
        probe_vector(pdir, 1, "Germany")
    # an SAE saved in SAELens' format: the feature's decoder row
    from sae_lens import StandardSAE, StandardSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    from tracekit.model.load import model_spec_of
    from tracekit.sae.spec import SAESpec

    spec = model_spec_of(m)
    sae = StandardSAE(StandardSAEConfig(d_in=d, d_sae=16, metadata=SAEMetadata(
        hook_name=HOOK, model_name=spec.name, prepend_bos=bool(spec.prepend_bos), context_size=128,
        tracekit_process_weights=bool(spec.process_weights))))
    with torch.no_grad():
        sae.W_dec.copy_(torch.randn(16, d))
    sae.save_model(tmp_path / "sae")
    sv = sae_vector(m, SAESpec(path=str(tmp_path / "sae")), 5)
    assert torch.equal(sv.vector, sae.W_dec[5].detach()) and sv.hook == HOOK
    with pytest.raises(SteeringError, match="out of range"):
        sae_vector(m, SAESpec(path=str(tmp_path / "sae")), 16)


def test_bad_inputs(tiny_gpt2):
    m = tiny_gpt2
    rows = _rows(m)
    with pytest.raises(SteeringError, match="width 7 but blocks.1.hook_resid_pre is 64 wide"):
        dose_response(m, rows, torch.ones(7), HOOK, [1.0])
    with pytest.raises(HookError, match="unknown hook"):
        check_vector(m, _vec(m), "blocks.1.hook_resid_nope")
    with pytest.raises(SteeringError, match="alphas"):
        dose_response(m, rows, _vec(m), HOOK, [])
    with pytest.raises(SteeringError, match="not a \\[batch, pos, d\\] hook"):
        check_vector(m, torch.ones(64), "blocks.1.attn.hook_z")
    with pytest.raises(SteeringError, match="outside a prompt"):
        with steer(m, Steer(_vec(m), HOOK, 1.0, (9,)), 5):
            pass
    with pytest.raises(SteeringError, match="zero"):
        SteeringVector(torch.zeros(4)).normalized()


# ---------------------------------------------------------------------------------------------
# the kind


KIND_CFG = {"prompts": PROMPTS, "target": [" Rome", " Rome"], "foil": [" Paris", " Paris"],
            "vector": {"source": "mean_difference", "positive": ["The capital of Italy"],
                       "negative": ["The capital of France"]},
            "layer": 1, "steer_at": ["all", "generated"], "alphas": [0, 2, 8], "controls": {"n_random": 2, "seed": 1},
            "generate": {"max_new_tokens": 3}}


def test_kind_runs_saves_and_loads(tmp_path, tiny_gpt2):
    r = Steering(**KIND_CFG).run(tiny_gpt2, progress=False)
    s = r.summary()
    assert s["hook"] == HOOK and s["alphas"] == [0.0, 2.0, 8.0] and s["n_random"] == 2
    assert s["alpha0_max_abs_error"] <= 1e-6  # alpha 0 adds exactly 0 (batch shapes may differ)
    assert s["mean_target_prob_by_alpha"][0] == pytest.approx(s["mean_clean_target_prob"], abs=1e-6)
    dr = r.tables["dose_response"]
    assert len(dr) == 3 * 3 and set(np.asarray(dr["n_rows"]).tolist()) == {2}
    assert torch.allclose(r.arrays["random_directions"].double().norm(dim=-1),
                          torch.full((2,), s["vector_norm"], dtype=torch.float64), rtol=1e-6, atol=0)
    g = r.tables["generations"]
    assert list(g["alpha"]) == [8.0, 8.0] and g["unsteered_text"].str.len().min() > 0
    assert "steering" in r.report() and "dose_response" in r.figures()
    r.save(tmp_path / "out")
    back = Result.load(tmp_path / "out")
    assert back.summary() == s


def test_kind_config_errors(tmp_path, tiny_gpt2):
    with pytest.raises(ValidationError, match="alphas"):
        Steering(**{**KIND_CFG, "alphas": []})
    with pytest.raises(ValidationError, match="listed twice"):
        Steering(**{**KIND_CFG, "alphas": [0, 2, 2]})
    with pytest.raises(ValidationError, match="hook or layer"):
        Steering(**{**KIND_CFG, "hook": HOOK})
    with pytest.raises(ValidationError, match="say where to steer"):
        Steering(**{k: v for k, v in KIND_CFG.items() if k != "layer"})
    with pytest.raises(ValidationError, match="source"):
        Steering(**{**KIND_CFG, "vector": {"source": "nope"}})
    with pytest.raises(SteeringError, match="no prompt position"):
        Steering(**{**KIND_CFG, "steer_at": "generated"}).check(tiny_gpt2)
    torch.save(torch.ones(64), tmp_path / "v.pt")
    file_cfg = {**KIND_CFG, "layer": None, "hook": "blocks.1.mlp.hook_post",
                "vector": {"source": "file", "path": str(tmp_path / "v.pt")}}
    with pytest.raises(SteeringError, match="width 64 but blocks.1.mlp.hook_post is 256 wide"):
        Steering(**file_cfg).check(tiny_gpt2)


def test_kind_on_dataset_rows_steers_named_positions(tiny_gpt2):
    from helpers import DATASET_ROWS

    cfg = {k: v for k, v in KIND_CFG.items() if k not in ("prompts", "target", "foil", "generate")}
    r = Steering(**{**cfg, "dataset": {"rows": DATASET_ROWS}, "position": "END", "steer_at": ["IO", "S2"],
                    "alphas": [0, 3]}).run(tiny_gpt2, progress=False)
    data = Steering(**{**cfg, "dataset": {"rows": DATASET_ROWS}, "steer_at": ["IO"]}).prepare(tiny_gpt2).data
    want = [sorted({e.positions["IO"], e.positions["S2"]}) for e in data.examples]
    assert r.meta["steered_positions"] == want and not r.meta["steer_generated"]
    rows = r.tables["rows"]
    assert sorted(set(rows["target"])) == sorted({row["target"] for row in DATASET_ROWS})
    assert r.summary()["alpha0_max_abs_error"] <= 1e-6


def test_damaged_or_foreign_vector_files_name_the_file_and_how_to_make_one(tmp_path):
    """Issue #33: a damaged .npy advised allow_pickle; a damaged .pt / .safetensors raised torch's or
    safetensors' own error. Each is a SteeringError naming vector.path, the file and how to save a
    vector, and never advises unpickling (allow_pickle / weights_only=False)."""
    cases = {
        "damaged.npy": b"\x93NUMPY\x01\x00garbage",
        "text.npy": b"not an array at all",
        "damaged.pt": b"PK\x03\x04 broken zip",
        "damaged.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}",
    }
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(tmp_path / "strings.npy", np.array(["a", "b"]))
    np.save(tmp_path / "empty.npy", np.zeros(0, dtype=np.float32))
    torch.save({"v": [1.0, 2.0]}, tmp_path / "list.pt")
    import fractions

    torch.save({"v": fractions.Fraction(1, 3)}, tmp_path / "pickled.pt")  # weights-only loading refuses it
    for f in sorted(tmp_path.iterdir()):
        with pytest.raises(SteeringError) as err:
            file_vector(f, "v" if f.name == "list.pt" else None)
        msg = str(err.value)
        assert msg.startswith(f"vector.path: {f.name}") or msg.startswith("vector.key:"), msg
        assert "allow_pickle" not in msg and "weights_only" not in msg, msg
        if f.suffix == ".npy":
            assert "numpy.save" in msg, msg
        elif f.suffix == ".pt":
            assert "torch.save" in msg, msg


# ---------------------------------------------------------------------------------------------
# the model's context (tracekit.model.context.check_generation)


def test_generation_past_the_context_is_refused_before_any_forward(tiny_gpt2, monkeypatch):
    """A prompt of n tokens and g new tokens run at most n + g - 1 positions: exactly the context
    generates; one more token is a ConfigError naming max_new_tokens and the largest that fits,
    raised before the model runs (on GPT-2 it was an IndexError in the position table)."""
    m = tiny_gpt2
    n_ctx = int(m.cfg.n_ctx)
    assert n_ctx == 128
    ids = encode(m, PROMPTS[1])
    room = n_ctx - len(ids) + 1
    out = generate(m, ids, room, stop_at_eos=False)
    assert len(out.new_ids) == room
    calls = []
    monkeypatch.setattr(G, "_pick", lambda *a: calls.append(1) or 0)
    with pytest.raises(ConfigError, match=rf"^max_new_tokens: prompt_ids \({len(ids)} tokens\) then {room + 1} "
                                          rf"generated tokens need {n_ctx + 1} positions, more than model 'gpt2''s "
                                          rf"context of {n_ctx} tokens .*set max_new_tokens to at most {room} "):
        generate(m, ids, room + 1, stop_at_eos=False)
    assert not calls


def test_kind_refuses_generation_past_the_context_at_check(tiny_gpt2):
    """The kind checks every generated row's prompt + generate.max_new_tokens in prepare (config
    check time), not after the dose-response has run."""
    n = len(encode(tiny_gpt2, PROMPTS[1]))
    room = int(tiny_gpt2.cfg.n_ctx) - n + 1
    ok = Steering(**{**KIND_CFG, "generate": {"max_new_tokens": room}})
    ok.check(tiny_gpt2)
    bad = Steering(**{**KIND_CFG, "generate": {"max_new_tokens": room + 1}})
    with pytest.raises(ConfigError, match=rf"^generate\.max_new_tokens: prompts\[1\] \({n} tokens\) .* at most {room} "
                                          r"or shorten prompts\[1\]$"):
        bad.check(tiny_gpt2)
    with pytest.raises(ConfigError, match=r"generate\.max_new_tokens"):
        bad.run(tiny_gpt2, progress=False)
    # only the rows that generate count
    Steering(**{**KIND_CFG, "generate": {"max_new_tokens": room + 1, "max_prompts": 1}}).check(tiny_gpt2)


def test_default_controls_spread_and_vector_rank(tiny_gpt2):
    """Issue 36 item 7: 3 random controls left their spread unknown. The default is now at least
    16, the controls table and summary give their mean, percentile band and max, and the vector's
    rank among them is the count of controls above it, checked here from the dose_response table."""
    import inspect

    assert inspect.signature(dose_response).parameters["n_random"].default >= 16
    cfg = {k: v for k, v in KIND_CFG.items() if k not in ("controls", "generate")}
    spec = Steering(**cfg)
    assert spec.controls.n_random >= 16
    r = spec.run(tiny_gpt2, progress=False)
    s = r.summary()
    n = s["n_random"]
    assert n == spec.controls.n_random
    ctl = r.tables["controls"]
    for c in ("random_mean", "random_p5", "random_p95", "random_max", "vector_rank", "vector_percentile"):
        assert c in ctl.columns
    dr = r.tables["dose_response"]
    for i, a in enumerate(s["alphas"]):
        at = dr[dr["alpha"] == a]
        vec = float(np.asarray(at[at["direction"] == "steer"]["target_prob"], dtype=float)[0])
        rnd = np.asarray(at[at["direction"] != "steer"]["target_prob"], dtype=float)
        assert len(rnd) == n
        assert s["vector_rank_by_alpha"][i] == 1 + int((rnd > vec).sum())
        assert s["vector_percentile_by_alpha"][i] == pytest.approx(
            100 * ((rnd < vec).sum() + 0.5 * (rnd == vec).sum()) / n)
        assert s["random_target_prob_p5_by_alpha"][i] == pytest.approx(np.percentile(rnd, 5))
        assert s["random_target_prob_p95_by_alpha"][i] == pytest.approx(np.percentile(rnd, 95))
        assert int(ctl.loc[i, "vector_rank"]) == s["vector_rank_by_alpha"][i]
    # alpha 0 adds nothing: the vector and every control tie (percentile 50, rank 1)
    assert s["vector_percentile_by_alpha"][0] == pytest.approx(50.0) and s["vector_rank_by_alpha"][0] == 1
    assert "random p5-p95" in r.report() and "vector rank" in r.report()
