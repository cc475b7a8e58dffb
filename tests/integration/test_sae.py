"""SAE engine (tracekit.sae) on tiny random models with tiny random SAEs in SAELens' format.

The SAEs are written with SAELens' own ``save_model`` where SAELens imports (the default
environment), else with tracekit's writer (:func:`tracekit.dictionaries.formats.save_saelens_dir`):
every test here runs in both environments except those marked ``sae``, which compare with SAELens
itself (its ``encode``/``decode``, its evals, its activation store).

Numeric invariants run on ``perturbed_model`` (GPT-2 / Llama / tied Llama x processed / raw):
splice with the error term == clean logits; a feature edit moves the activation by exactly
(new - old) x its decoder row; features + error + bias (+ special tokens) == the activation's
attribution; the direct contribution at the last block == the exact effect of zeroing the feature
with the final-norm scale frozen.
"""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
import torch

from tracekit.compat import sae_lens_status
from tracekit.errors import SAEError
from tracekit.model.load import model_fingerprint, model_spec_of
from tracekit.sae import (
    SAESpec,
    feature_decomposition,
    feature_intervention,
    load_sae,
    sae_quality,
    sae_terms,
    splice_hook,
)

PROMPT = "The capital of France is the city of"


#: Whether SAELens imports here (else the SAEs are written by tracekit's own SAELens-format writer).
HAS_SAE_LENS = sae_lens_status(import_check=False) is None


def save_sae(d, md: dict, weights: dict, arch: str = "standard", normalize: str = "none", k: int = 6):
    """Write an SAE (``weights``: ``W_enc [d_in, d_sae]``, ``W_dec``, ``b_enc``, ``b_dec``; ``md``: SAELens
    metadata) as a SAELens directory: with SAELens' ``save_model`` where it imports, else with
    :func:`tracekit.dictionaries.formats.save_saelens_dir` (the same cfg.json fields: architecture,
    ``apply_b_dec_to_input`` true, ``normalize_activations``, ``k``, metadata)."""
    d_in, d_sae = weights["W_enc"].shape
    sae: Any
    if HAS_SAE_LENS:
        from sae_lens import StandardSAE, StandardSAEConfig, TopKSAE, TopKSAEConfig
        from sae_lens.saes.sae import SAEMetadata

        if arch == "topk":
            sae = TopKSAE(TopKSAEConfig(d_in=d_in, d_sae=d_sae, k=k, normalize_activations=cast(Any, normalize),
                                        metadata=SAEMetadata(**md)))
        else:
            sae = StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=d_sae, normalize_activations=cast(Any, normalize),
                                                metadata=SAEMetadata(**md)))
    else:
        from tracekit.dictionaries import Dictionary

        sae = Dictionary(d_in, d_sae, activation="topk" if arch == "topk" else "relu", k=k if arch == "topk" else None,
                         hook_in=md["hook_name"], apply_b_dec_to_input=True, normalize_activations=normalize,
                         metadata={k_: v for k_, v in md.items() if k_ != "model_name"})
    with torch.no_grad():
        for name, w in weights.items():
            getattr(sae, name).copy_(w)
    if HAS_SAE_LENS:
        sae.save_model(d)
    else:
        from tracekit.dictionaries.formats import save_saelens_dir

        save_saelens_dir(sae, d, model_name=md["model_name"])
    return d


def make_sae_dir(tmp_path, model, hook, d_sae=48, arch="standard", seed=0, normalize="none", fingerprint=True,
                 **meta):
    """A random SAE on ``hook`` in SAELens' format (cfg.json + safetensors; :func:`save_sae`)."""
    d_in = int(model.cfg.d_model)
    spec = model_spec_of(model)
    md = {"hook_name": hook, "model_name": spec.name, "prepend_bos": bool(spec.prepend_bos), "context_size": 128,
          "tracekit_process_weights": bool(spec.process_weights)}
    if fingerprint:
        md["tracekit_fingerprint"] = model_fingerprint(model)
    md.update(meta)
    g = torch.Generator().manual_seed(seed)
    # scale the encoder to the activation's size so a fair share of features fire
    weights = {"W_enc": torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5,
               "W_dec": torch.randn(d_sae, d_in, generator=g) / d_in ** 0.5,
               "b_dec": 0.1 * torch.randn(d_in, generator=g), "b_enc": 0.2 * torch.randn(d_sae, generator=g)}
    return save_sae(tmp_path / f"sae-{arch}-{normalize}-{seed}", md, weights, arch, normalize)


def last_resid(model):
    return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"


# ---------------------------------------------------------------------------------------------
# loading


def test_load_from_directory_device_dtype_and_state(tmp_path, tiny_gpt2):
    from safetensors.torch import load_file

    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre")
    cfg = json.loads((d / "cfg.json").read_text())
    cfg["dtype"] = "float16"  # whatever cfg.json says, the SAE follows the model
    (d / "cfg.json").write_text(json.dumps(cfg))
    h = load_sae(SAESpec(path=str(d)), tiny_gpt2)
    assert h.sae.W_dec.dtype == torch.float32 and h.sae.W_dec.device.type == "cpu"
    state = load_file(str(d / "sae_weights.safetensors"))
    for k, v in state.items():
        assert torch.equal(h.sae.state_dict()[k], v), k  # bit-identical after save -> load
    assert h.hook == "blocks.1.hook_resid_pre"


def test_old_field_names_load(tmp_path, tiny_gpt2):
    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre")
    cfg = json.loads((d / "cfg.json").read_text())
    meta = cfg.pop("metadata")
    old = {k: v for k, v in cfg.items() if k != "architecture"}
    old.update({"hook_point": meta["hook_name"], "model_name": meta["model_name"], "prepend_bos": True,
                "context_size": 128, "sae_lens_version": "3.0.0", "hook_point_head_index": None})
    (d / "cfg.json").write_text(json.dumps(old))
    h = load_sae(SAESpec(path=str(d)), tiny_gpt2)
    assert h.hook == "blocks.1.hook_resid_pre"


def test_missing_hook_name_is_an_error_naming_the_key(tmp_path, tiny_gpt2):
    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre")
    cfg = json.loads((d / "cfg.json").read_text())
    cfg["metadata"].pop("hook_name")
    (d / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(SAEError, match="hook_name"):
        load_sae(SAESpec(path=str(d)), tiny_gpt2)


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, tiny_gpt2):
    """A SAELens directory whose weights hold NaN/inf is refused at load, naming the tensor."""
    from safetensors.torch import load_file, save_file

    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre")
    state = load_file(str(d / "sae_weights.safetensors"))
    state["W_dec"][3, 5] = float("nan")
    save_file(state, str(d / "sae_weights.safetensors"))
    with pytest.raises(SAEError, match=r"W_dec holds 1 non-finite value\(s\) \(NaN/inf\)"):
        load_sae(SAESpec(path=str(d)), tiny_gpt2)


@pytest.mark.sae  # a SAELens pretrained release: SAELens' registry
def test_release_offline_is_a_clear_error_without_waiting(tiny_gpt2, monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.time()
    with pytest.raises(SAEError, match="offline"):
        load_sae(SAESpec(release="gpt2-small-res-jb", id="blocks.8.hook_resid_pre"), tiny_gpt2)
    assert time.time() - t < 10
    with pytest.raises(SAEError, match="not in release"):
        load_sae(SAESpec(release="gpt2-small-res-jb", id="blocks.99.hook_resid_pre"), tiny_gpt2)
    with pytest.raises(SAEError, match="not a SAELens pretrained release"):
        load_sae(SAESpec(release="gpt2-small-res-jbb", id="x"), tiny_gpt2)


def test_spec_needs_one_source():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="exactly one"):
        SAESpec()
    with pytest.raises(ValidationError, match="exactly one"):
        SAESpec(path="x", release="r", id="i")
    with pytest.raises(ValidationError, match="go together"):
        SAESpec(release="gpt2-small-res-jb")
    with pytest.raises(ValidationError, match="renamed to 'id'"):
        SAESpec.model_validate({"release": "r", "sae_id": "i"})


# ---------------------------------------------------------------------------------------------
# checks, each its own error before any forward pass


def _no_forward(model, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a forward pass ran before the check")
    monkeypatch.setattr(model, "forward", boom)


def test_check_errors(tmp_path, tiny_gpt2, tiny_llama, monkeypatch):
    def edit(**upd):
        d = make_sae_dir(tmp_path / str(len(list(tmp_path.iterdir()))), tiny_gpt2, "blocks.1.hook_resid_pre")
        cfg = json.loads((d / "cfg.json").read_text())
        for k, v in upd.items():
            if k in ("d_in", "normalize_activations"):
                cfg[k] = v
            else:
                cfg["metadata"][k] = v
        (d / "cfg.json").write_text(json.dumps(cfg))
        return SAESpec(path=str(d))

    (tmp_path / "0").mkdir()
    cases = [
        (edit(hook_name="blocks.9.hook_resid_pre"), "does not have"),
        (edit(d_in=32), "width d_in=32"),
        (edit(tracekit_fingerprint="0123456789abcdef"), "another model"),
        (edit(tracekit_fingerprint=None, model_name="pythia-70m"), "trained on model 'pythia-70m'"),
        (edit(tracekit_process_weights=False), "unprocessed activations"),
        (edit(normalize_activations="covariance_whitening"), "normalisation"),
        (edit(hook_head_index=2), "head"),
    ]
    for spec, msg in cases:
        with pytest.raises(SAEError, match=msg):
            load_sae(spec, tiny_gpt2)


def test_checks_run_before_any_forward_pass(tmp_path, tiny_gpt2, monkeypatch):
    from tracekit.experiments.sae import SAEFeatures

    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre")
    cfg = json.loads((d / "cfg.json").read_text())
    cfg["d_in"] = 32
    (d / "cfg.json").write_text(json.dumps(cfg))
    calls = []
    monkeypatch.setattr(type(tiny_gpt2), "run_with_hooks", lambda *a, **k: calls.append(1))
    with pytest.raises(SAEError, match="width"):
        SAEFeatures(sae={"path": str(d)}, prompts=PROMPT, target=" Paris").run(tiny_gpt2, progress=False)
    assert not calls


# ---------------------------------------------------------------------------------------------
# numeric invariants


@pytest.mark.parametrize("arch,normalize", [("standard", "none"), ("topk", "none"), ("standard", "layer_norm")])
def test_terms_match_saelens_decode(tmp_path, tiny_gpt2, arch, normalize):
    from tracekit.tokens import run_with_cache, tokenize

    d = make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre", arch=arch, normalize=normalize)
    h = load_sae(SAESpec(path=str(d)), tiny_gpt2)
    _, cache = run_with_cache(tiny_gpt2, tokenize(tiny_gpt2, [PROMPT]), [h.hook])
    x = cache[h.hook]
    t = sae_terms(h, x)
    ref = h.sae.decode(h.sae.encode(x))
    assert (t.recon - ref).abs().max() < 1e-5
    parts = (t.scale * t.acts)[..., None] * t.W_eff  # [b, pos, d_sae, d_in]
    assert (parts.sum(-2) + t.bias_term + t.error - x).abs().max() < 1e-5


def test_splice_with_error_equals_clean_logits(tmp_path, perturbed_model):
    m = perturbed_model
    d = make_sae_dir(tmp_path, m, "blocks.1.hook_resid_mid")
    h = load_sae(SAESpec(path=str(d)), m)
    from tracekit.tokens import tokenize

    b = tokenize(m, [PROMPT, "One two"])
    clean = m(b.tokens, attention_mask=b.attention_mask)
    spliced = m.run_with_hooks(b.tokens, attention_mask=b.attention_mask,
                               fwd_hooks=[(h.hook, splice_hook(h, use_error=True))])
    assert (clean - spliced).abs().max() < 1e-5
    no_err = m.run_with_hooks(b.tokens, attention_mask=b.attention_mask,
                              fwd_hooks=[(h.hook, splice_hook(h, use_error=False))])
    assert (clean - no_err).abs().max() > 1e-3  # the reconstruction is not exact: the test can fail


def test_feature_edit_moves_activation_by_its_decoder_row(tmp_path, perturbed_model):
    m = perturbed_model
    hook = "blocks.1.hook_resid_pre"
    h = load_sae(SAESpec(path=str(make_sae_dir(tmp_path, m, hook))), m)
    from tracekit.tokens import tokenize

    b = tokenize(m, [PROMPT])
    t0 = sae_terms(h, _cache(m, b, hook))
    f = int(t0.acts[0, -1].argmax())
    old = float(t0.acts[0, -1, f])
    new = old + 2.5

    def edit(a):
        a[0, -1, f] = new
        return a

    out = splice_hook(h, edit=edit)(t0.x.clone())
    delta = out - t0.x
    assert (delta[0, -1] - (new - old) * h.sae.W_dec[f]).abs().max() < 1e-5
    assert delta[0, :-1].abs().max() == 0


def _cache(m, b, hook):
    from tracekit.tokens import run_with_cache

    _, c = run_with_cache(m, b, [hook])
    return c[hook]


def test_attributions_sum_to_total(tmp_path, perturbed_model):
    m = perturbed_model
    h = load_sae(SAESpec(path=str(make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre"))), m)
    dec = feature_decomposition(m, h, PROMPT, " Paris", " London")
    tot = float(dec.total.sum()) + dec.total_error + dec.total_bias + dec.total_special
    assert abs(tot - dec.total_activation) < 1e-4 * max(1.0, abs(dec.total_activation))
    direct = float(dec.direct.sum()) + dec.direct_error + dec.direct_bias
    assert abs(direct - dec.direct_total) < 1e-4 * max(1.0, abs(dec.direct_total))
    assert dec.special[0] and not any(dec.special[1:])  # BOS masked by id
    assert dec.acts.shape == (len(dec.ids), h.d_sae)


def test_direct_equals_zeroing_effect_at_last_block(tmp_path, perturbed_model):
    """At the last block's output, the direct contribution of a feature is exactly the change of
    the logit difference when it is zeroed (error term kept) with the final-norm scale frozen."""
    m = perturbed_model
    hook = last_resid(m)
    h = load_sae(SAESpec(path=str(make_sae_dir(tmp_path, m, hook))), m)
    dec = feature_decomposition(m, h, PROMPT, " Paris", " London")
    from tracekit.dla import resolve_target
    from tracekit.tokens import encode, pad_ids

    tgt = resolve_target(m, " Paris", " London")
    b = pad_ids(m, [encode(m, PROMPT)])
    st = {}
    m.run_with_hooks(b.tokens, fwd_hooks=[("ln_final.hook_scale", lambda a, hook: st.__setitem__("s", a.detach()))])
    active = torch.nonzero(dec.acts[-1]).flatten().tolist()
    assert active
    for f in active[:4]:
        def edit(a, f=f):
            a[0, -1, f] = 0.0
            return a
        lg = m.run_with_hooks(b.tokens, fwd_hooks=[(hook, splice_hook(h, edit=edit)),
                                                   ("ln_final.hook_scale", lambda a, hook: st["s"])])
        ld = float(lg[0, -1, tgt.target_id] - lg[0, -1, tgt.foil_id])
        assert abs((dec.metric - ld) - float(dec.direct[f])) < 1e-4, f


def test_intervention_ablate_steer(tmp_path, tiny_gpt2):
    m = tiny_gpt2
    h = load_sae(SAESpec(path=str(make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre"))), m)
    r0 = feature_intervention(m, h, PROMPT, " Paris", None, [0], "steer", 0.0)
    assert abs(r0["delta_logit"]) < 1e-5 and abs(r0["delta_prob"]) < 1e-7
    r1 = feature_intervention(m, h, PROMPT, " Paris", None, [0, 1], "steer", 5.0, intervene_at=[-1])
    assert abs(r1["delta_logit"]) > 1e-4


# ---------------------------------------------------------------------------------------------
# quality


def test_quality_hand_worked(tmp_path, tiny_gpt2):
    """An SAE whose decoder reproduces x exactly (identity dictionary, ReLU on +x and -x) has
    explained variance 1, mse 0, CE recovered 1, KL 0; L0 = number of non-zero coordinates."""
    m = tiny_gpt2
    d = int(m.cfg.d_model)
    hook = "blocks.1.hook_resid_pre"
    spec = model_spec_of(m)
    md = {"hook_name": hook, "model_name": spec.name, "prepend_bos": True, "tracekit_fingerprint": model_fingerprint(m),
          "tracekit_process_weights": bool(spec.process_weights)}
    eye = torch.eye(d)
    save_sae(tmp_path / "id", md, {"W_enc": torch.cat([eye, -eye, torch.zeros(d, 1)], 1),
                                   "W_dec": torch.cat([eye, -eye, torch.zeros(1, d)], 0),
                                   "b_enc": torch.zeros(2 * d + 1), "b_dec": torch.zeros(d)})
    h = load_sae(SAESpec(path=str(tmp_path / "id")), m)
    from tracekit.tokens import encode, pad_ids

    wins = [encode(m, "The quick brown fox jumps over the lazy dog")]
    q = sae_quality(m, h, wins)
    assert q.metrics["mse"] < 1e-8
    assert abs(q.metrics["explained_variance"] - 1) < 1e-6
    assert abs(q.metrics["ce_loss_recovered"] - 1) < 1e-6
    assert q.metrics["kl"] < 1e-6
    assert abs(q.metrics["l0"] - d) < 1e-9  # each coordinate is active on exactly one side
    x = _cache(m, pad_ids(m, wins), hook)[0, 1:]  # BOS excluded
    never = [i for i in range(d) if not (x[:, i] > 0).any()] + [d + i for i in range(d) if not (x[:, i] < 0).any()]
    assert q.dead() == never + [2 * d]  # a coordinate's +/- feature never fires when it never has that sign


def test_dead_features_same_at_any_batch_size(tmp_path, tiny_gpt2):
    m = tiny_gpt2
    h = load_sae(SAESpec(path=str(make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre", arch="topk", d_sae=96))), m)
    from tracekit.tokens import encode

    texts = ["The cat sat.", "A much longer sentence about the capital of France and Paris.", "Hi", "x y z w"]
    wins = [encode(m, t) for t in texts] * 2
    q1 = sae_quality(m, h, wins, batch_size=1)
    q8 = sae_quality(m, h, wins, batch_size=8)
    assert q1.dead() == q8.dead() and 0 < len(q1.dead()) < h.d_sae
    for k in ("mse", "explained_variance", "l0", "ce_loss_recovered", "kl"):
        assert abs(q1.metrics[k] - q8.metrics[k]) < 1e-4, k


@pytest.mark.sae  # compares with SAELens' own evals
def test_quality_agrees_with_sae_lens_evals(tmp_path):
    """Same SAE, same tokens (no BOS, no padding: nothing masked) -> sae_lens.evals' numbers (run on
    SAELens' own SAE, loaded from the same directory)."""
    from sae_lens import SAE
    from sae_lens.evals import get_recons_loss, get_sparsity_and_variance_metrics
    from sae_lens.training.activation_scaler import ActivationScaler

    from helpers import make_tiny

    m = make_tiny("gpt2", prepend_bos=False)
    d = make_sae_dir(tmp_path, m, "blocks.1.hook_resid_pre")
    h = load_sae(SAESpec(path=str(d)), m)
    ref_sae = SAE.load_from_disk(str(d), device="cpu")
    from tracekit.corpus import iter_documents, token_windows

    wins = [list(w.ids) for w in token_windows(m, iter_documents("stdlib"), seq_len=16, max_tokens=2000)
            if len(w.ids) == 16][:12]
    toks = torch.tensor(wins)
    ours = sae_quality(m, h, wins, batch_size=4).metrics

    class Store:
        def __init__(self):
            self.i = 0

        def get_batch_tokens(self, n):
            b = toks[self.i:self.i + 4]
            self.i += 4
            return b

    sv, _ = get_sparsity_and_variance_metrics(ref_sae, m, Store(), ActivationScaler(), n_batches=3,
                                              compute_l2_norms=False, compute_sparsity_metrics=True,
                                              compute_variance_metrics=True,
                                              compute_featurewise_density_statistics=True,
                                              eval_batch_size_prompts=4, model_kwargs={})
    assert abs(sv["mse"] - ours["mse"]) < 1e-4 * max(1, sv["mse"])
    assert abs(sv["explained_variance"] - ours["explained_variance"]) < 1e-5
    assert abs(sv["l0"] - ours["l0"]) < 1e-6
    ce_sae, ce_clean, ce_zero = [], [], []
    for i in range(0, 12, 4):
        r = get_recons_loss(ref_sae, m, ActivationScaler(), toks[i:i + 4], compute_kl=False, compute_ce_loss=True)
        ce_sae.append(r["ce_loss_with_sae"])
        ce_clean.append(r["ce_loss_without_sae"])
        ce_zero.append(r["ce_loss_with_ablation"])
    cs, cc, cz = (float(torch.cat(v).mean()) for v in (ce_sae, ce_clean, ce_zero))
    assert abs(cs - ours["ce_loss_sae"]) < 1e-4 and abs(cc - ours["ce_loss_clean"]) < 1e-4
    assert abs(cz - ours["ce_loss_zero"]) < 1e-4
    assert abs((cz - cs) / (cz - cc) - ours["ce_loss_recovered"]) < 1e-3


def test_hook_that_never_fires_is_refused(tmp_path, tiny_llama):
    if "hook_pos_embed" not in tiny_llama.hook_dict:
        pytest.skip("this bridge has no hook_pos_embed")
    d = make_sae_dir(tmp_path, tiny_llama, "hook_pos_embed")
    with pytest.raises(SAEError, match="never fires"):
        load_sae(SAESpec(path=str(d)), tiny_llama)


def test_training_windows_packed_and_held_out_disjoint(tiny_gpt2):
    from tracekit.sae import _corpus_windows

    bos = tiny_gpt2.tokenizer.bos_token_id
    train = _corpus_windows(tiny_gpt2, "stdlib", 32, 0, 640, "c")
    held = _corpus_windows(tiny_gpt2, "stdlib", 32, 640, 310, "c")
    allw = _corpus_windows(tiny_gpt2, "stdlib", 32, 0, 640 + 310, "c")
    assert all(len(w) == 32 and w[0] == bos for w in train + held)
    assert len(train) == 21 and len(held) == 10  # ceil(640 / 31), ceil(310 / 31)
    assert allw == train + held  # held-out = the windows right after the training ones


@pytest.mark.sae  # reads the cache back with SAELens' ActivationsStore
def test_cached_training_activations_are_the_hooks(tmp_path, perturbed_model):
    """The activations SAELens trains on are exactly the model's at the hook, window by window,
    with their token ids (so SAELens' special-token mask applies), in SAELens' cached format."""
    import datasets
    from sae_lens.training.activations_store import ActivationsStore

    from tracekit.sae import _cache_activations, _corpus_windows, special_token_ids

    model = perturbed_model
    hook = "blocks.1.hook_resid_pre"
    wins = _corpus_windows(model, "stdlib", 16, 0, 200, "c")
    _cache_activations(model, hook, wins, tmp_path / "acts", batch_size=3)
    ds = datasets.load_from_disk(str(tmp_path / "acts"))
    ds.set_format("torch")
    rows = ds[:]
    _, cache = model.run_with_cache(torch.tensor(wins), names_filter=[hook])
    assert rows[hook].shape == (len(wins), 16, model.cfg.d_model)
    assert torch.allclose(rows[hook], cache[hook].float(), atol=1e-5, rtol=0)
    assert rows["token_ids"].tolist() == wins
    # SAELens' store reads them back and drops the special tokens by id, without running the model
    store = ActivationsStore(model=None, dataset=None, cached_activations_path=str(tmp_path / "acts"),  # type: ignore[arg-type]
                             streaming=False, hook_name=hook, hook_head_index=None, context_size=16,
                             d_in=model.cfg.d_model, n_batches_in_buffer=2, total_training_tokens=100,
                             store_batch_size_prompts=2, train_batch_size_tokens=8, prepend_bos=False,
                             normalize_activations="none", device=torch.device("cpu"), dtype="float32",
                             exclude_special_tokens=torch.tensor(special_token_ids(model)))
    got = store.get_filtered_llm_batch()
    flat_tok = torch.tensor(wins[:2]).flatten()
    keep = ~torch.isin(flat_tok, torch.tensor(special_token_ids(model)))
    assert torch.allclose(got, cache[hook][:2].reshape(-1, model.cfg.d_model)[keep].float(), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# SAELens' SAEs without SAELens: tracekit's Dictionary equals SAELens, and the kinds run without it


def _saelens_sae(model, hook, arch, normalize, seed=0, d_sae=40):
    """A random SAELens SAE of ``arch`` (``standard``, ``topk``, ``topk_rescale``, ``jumprelu``,
    ``gated``) with input normalisation ``normalize``; negative JumpReLU thresholds included."""
    from sae_lens import (
        GatedSAE,
        GatedSAEConfig,
        JumpReLUSAE,
        JumpReLUSAEConfig,
        StandardSAE,
        StandardSAEConfig,
        TopKSAE,
        TopKSAEConfig,
    )
    from sae_lens.saes.sae import SAEMetadata

    d_in = int(model.cfg.d_model)
    spec = model_spec_of(model)
    md = SAEMetadata(hook_name=hook, model_name=spec.name, prepend_bos=bool(spec.prepend_bos),
                     tracekit_fingerprint=model_fingerprint(model), tracekit_process_weights=bool(spec.process_weights))
    kw = {"d_in": d_in, "d_sae": d_sae, "normalize_activations": normalize, "metadata": md}
    if arch.startswith("topk"):
        sae = TopKSAE(TopKSAEConfig(k=5, rescale_acts_by_decoder_norm=arch == "topk_rescale", **kw))
    elif arch == "jumprelu":
        sae = JumpReLUSAE(JumpReLUSAEConfig(**kw))
    elif arch == "gated":
        sae = GatedSAE(GatedSAEConfig(**kw))
    else:
        sae = StandardSAE(StandardSAEConfig(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            scale = 1 / d_in ** 0.5 if p.ndim == 2 else 0.2
            p.copy_(scale * torch.randn(p.shape, generator=g) * (1 + torch.rand(p.shape, generator=g)))
    return sae


@pytest.mark.sae  # compares with SAELens itself
@pytest.mark.parametrize("normalize", ["none", "layer_norm", "constant_norm_rescale"])
@pytest.mark.parametrize("arch", ["standard", "topk", "topk_rescale", "jumprelu", "gated"])
def test_loaded_sae_equals_saelens(tmp_path, tiny_model, arch, normalize):
    """The SAE tracekit loads from a SAELens directory (its own Dictionary, no SAELens) encodes and
    reconstructs exactly what SAELens' ``SAE.load_from_disk`` of the same directory does (1e-6 on
    the model's activations); the decomposition's pieces still sum to the activation."""
    from sae_lens import SAE

    from tracekit.dictionaries import Dictionary
    from tracekit.tokens import tokenize

    m = tiny_model
    hook = "blocks.1.hook_resid_mid"
    _saelens_sae(m, hook, arch, normalize).save_model(tmp_path / "s")
    ref = SAE.load_from_disk(str(tmp_path / "s"), device="cpu")
    h = load_sae(SAESpec(path=str(tmp_path / "s")), m)
    assert isinstance(h.sae, Dictionary) and h.d_sae == 40
    x = _cache(m, tokenize(m, [PROMPT, "One two three"]), hook)
    with torch.no_grad():
        want_acts = ref.encode(x)
        want_recon = ref.decode(want_acts)
    t = sae_terms(h, x)
    assert (want_acts != 0).any() and (want_acts == 0).any()  # some features fire, some do not
    assert (t.acts - want_acts).abs().max() < 1e-6
    assert (t.recon - want_recon).abs().max() < 1e-6
    parts = (t.scale * t.acts)[..., None] * t.W_eff
    assert (parts.sum(-2) + t.bias_term + t.error - t.x).abs().max() < 1e-5
    b = tokenize(m, [PROMPT])
    spliced = m.run_with_hooks(b.tokens, fwd_hooks=[(hook, splice_hook(h, use_error=False))])
    with torch.no_grad():
        ref_spliced = m.run_with_hooks(b.tokens, fwd_hooks=[(hook, lambda a, hook: ref.decode(ref.encode(a)))])
    assert (spliced - ref_spliced).abs().max() < 1e-5


@pytest.mark.sae  # compares with SAELens itself
def test_cfg_defaults_match_saelens():
    """:func:`tracekit.sae.spec.saelens_cfg_defaults` reads old (pre-6.0) and new cfg.json files as
    SAELens' ``handle_config_defaulting`` does, for every field tracekit reads."""
    from sae_lens.loading.pretrained_sae_loaders import handle_config_defaulting

    from tracekit.sae.spec import saelens_cfg_defaults

    old = {"d_in": 64, "d_sae": 128, "hook_point": "blocks.1.hook_resid_pre", "hook_point_head_index": None,
           "model_name": "gpt2", "context_size": 128, "dtype": "float32", "device": "cpu"}
    cases = [old, {**old, "sae_lens_version": "3.0.0", "normalize_activations": True},
             {**old, "normalize_activations": None, "prepend_bos": False},
             {**old, "activation_fn": "topk", "activation_fn_kwargs": {"k": 7}},
             {"d_in": 64, "d_sae": 128, "architecture": "topk", "k": 4, "normalize_activations": "layer_norm",
              "apply_b_dec_to_input": False, "dtype": "float32", "device": "cpu",
              "metadata": {"sae_lens_version": "6.54.12", "hook_name": "blocks.2.hook_resid_post",
                           "model_name": "gpt2", "prepend_bos": True}}]
    for cfg in cases:
        ours, theirs = saelens_cfg_defaults(dict(cfg)), handle_config_defaulting(dict(cfg))
        meta_o, meta_t = ours.get("metadata") or {}, theirs.get("metadata") or {}
        for k in ("hook_name", "hook_head_index", "model_name", "prepend_bos", "context_size"):
            assert meta_o.get(k, ours.get(k)) == meta_t.get(k, theirs.get(k)), (cfg, k)
        for k in ("normalize_activations", "apply_b_dec_to_input", "architecture", "k", "d_in", "d_sae"):
            assert ours.get(k) == theirs.get(k), (cfg, k)


@pytest.mark.sae  # compares with SAELens itself
def test_explained_variance_equals_saelens():
    """tracekit's :class:`~tracekit.sae.quality.ExplainedVariance` is SAELens'
    ``ExplainedVarianceCalculator`` (batches of different sizes, a large mean, a perfect fit, none)."""
    from sae_lens.evals import ExplainedVarianceCalculator

    from tracekit.sae.quality import ExplainedVariance

    g = torch.Generator().manual_seed(0)
    ours, theirs = ExplainedVariance(), ExplainedVarianceCalculator()
    assert ours.compute() == theirs.compute() == 0.0
    for n in (5, 17, 1, 40):
        x = 30.0 + torch.randn(n, 24, generator=g)
        xh = x + 0.3 * torch.randn(n, 24, generator=g)
        ours.add_batch(sae_output=xh, hidden_acts=x)
        theirs.add_batch(sae_output=xh, hidden_acts=x)
    assert 0 < ours.compute() < 1 and ours.compute() == theirs.compute()
    same, ref = ExplainedVariance(), ExplainedVarianceCalculator()
    x = torch.ones(4, 3)
    same.add_batch(sae_output=x, hidden_acts=x)
    ref.add_batch(sae_output=x, hidden_acts=x)
    assert same.compute() == ref.compute() == 1.0


def test_explained_variance_by_hand():
    """Explained variance = 1 - E||x - x_hat||^2 / (E||x||^2 - ||E x||^2), worked by hand."""
    from tracekit.sae.quality import ExplainedVariance

    x = torch.tensor([[1.0, 0.0], [3.0, 2.0]])  # mean (2, 1); E||x||^2 = (1 + 13) / 2 = 7; total variance 2
    xh = x + torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # E||x - x_hat||^2 = 0.5
    ev = ExplainedVariance()
    ev.add_batch(sae_output=xh[:1], hidden_acts=x[:1])
    ev.add_batch(sae_output=xh[1:], hidden_acts=x[1:])
    assert abs(ev.compute() - (1 - 0.5 / 2)) < 1e-12


@pytest.fixture
def without_sae_lens(monkeypatch):
    """This process as the TransformerLens 4 environment sees SAELens: not installed, not importable."""
    import sys
    from importlib import metadata

    from tracekit import compat

    real_version, real_requires = metadata.version, metadata.requires

    def version(name):
        if name == "sae-lens":
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    def requires(name):
        if name == "sae-lens":
            raise metadata.PackageNotFoundError(name)
        return real_requires(name)

    monkeypatch.setattr(compat.metadata, "version", version)
    monkeypatch.setattr(compat.metadata, "requires", requires)
    for mod in [m for m in sys.modules if m == "sae_lens" or m.startswith("sae_lens.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "sae_lens", None)  # `import sae_lens` raises ImportError
    compat.sae_lens_status.cache_clear()
    yield
    compat.sae_lens_status.cache_clear()


@pytest.fixture
def topk_ln_dir(tmp_path, tiny_gpt2):
    """A TopK SAE with layer-norm input normalisation, written before SAELens is hidden."""
    return make_sae_dir(tmp_path, tiny_gpt2, "blocks.1.hook_resid_pre", arch="topk", normalize="layer_norm")


def test_sae_kinds_run_without_sae_lens_and_give_the_same_numbers(topk_ln_dir, tiny_gpt2, without_sae_lens):
    """With SAELens absent, a SAELens directory loads, ``sae_features`` and ``sae_eval`` run and give
    the numbers of the same SAE decomposed by hand here (features + error + bias = activation, the
    quality's MSE from the terms); a release is refused naming ``sae.path``."""
    from tracekit import SAEEval, SAEFeatures

    d = topk_ln_dir
    with pytest.raises(ImportError):
        import sae_lens  # noqa: F401
    h = load_sae(SAESpec(path=str(d)), tiny_gpt2)
    f = SAEFeatures.model_validate({"sae": {"path": str(d)}, "prompts": [PROMPT], "target": " Paris",
                                    "foil": " London", "top_k": 3}).run(tiny_gpt2, progress=False)
    dec = feature_decomposition(tiny_gpt2, h, PROMPT, " Paris", " London")
    terms = {str(k): float(v) for k, v in f.tables["terms"].set_index("term")["total"].items()}
    assert abs(terms["features"] - float(dec.total.sum())) < 1e-5
    assert abs(terms["features"] + terms["error"] + terms["bias"] + terms["special_tokens"]
               - terms["activation"]) < 1e-4
    from tracekit.tokens import encode, pad_ids

    wins = [encode(tiny_gpt2, "The quick brown fox jumps over the lazy dog and the cat")]
    e = SAEEval.model_validate({"sae": {"path": str(d)}, "corpus": "stdlib", "max_tokens": 200, "seq_len": 32}
                               ).run(tiny_gpt2, progress=False)
    assert 0 < e.summary()["l0"] <= 6 and e.summary()["n_tokens"] > 0
    q = sae_quality(tiny_gpt2, h, wins)
    t = sae_terms(h, _cache(tiny_gpt2, pad_ids(tiny_gpt2, wins), h.hook)[:, 1:])  # BOS excluded
    assert abs(q.metrics["mse"] - float(t.error.pow(2).sum(-1).mean())) < 1e-4 * max(1.0, q.metrics["mse"])
    with pytest.raises(SAEError, match=r"release.*needs SAELens.*sae\.path"):
        load_sae(SAESpec.model_construct(release="gpt2-small-res-jb", id="blocks.8.hook_resid_pre"), tiny_gpt2)
