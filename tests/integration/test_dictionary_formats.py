"""The SAELens-format reader/writer against SAELens itself (default environment), and the formats on
both TransformerLens stacks.

For every architecture SAELens 6.54 loads from disk (standard, topk (with and without decoder-norm
rescaling), abstopk, jumprelu, gated, transcoder, skip_transcoder, jumprelu_transcoder,
jumprelu_skip_transcoder, plus SAELens' runtime normalisations and hook_z reshaping) a random SAELens
SAE with perturbed biases and thresholds is saved by SAELens and read by ``load_saelens_dir``, and
written by ``save_saelens_dir`` and read by ``sae_lens.SAE.load_from_disk``: encode / decode / forward
equal to 1e-6 (float32).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tracekit.core.errors import SAEError
from tracekit.dictionaries import Dictionary, load_saelens_dir, save_saelens_dir

HAS_SAELENS = importlib.util.find_spec("sae_lens") is not None
needs_saelens = pytest.mark.skipif(not HAS_SAELENS, reason="sae_lens is not installed (the TransformerLens 4 env)")

D_IN, D_SAE, D_OUT = 12, 40, 9
ATOL = 1e-6

# (architecture, config kwargs, hook name)
CASES = [
    ("standard", {}, "blocks.1.hook_resid_pre"),
    ("standard", {"apply_b_dec_to_input": False}, "blocks.1.hook_resid_pre"),
    ("standard", {"normalize_activations": "constant_norm_rescale"}, "blocks.1.hook_resid_pre"),
    ("standard", {"normalize_activations": "layer_norm"}, "blocks.1.hook_resid_pre"),
    ("standard", {"normalize_activations": "expected_average_only_in"}, "blocks.1.hook_resid_pre"),
    ("standard", {"reshape_activations": "hook_z"}, "blocks.0.attn.hook_z"),
    ("topk", {"k": 5}, "blocks.2.hook_resid_post"),
    ("topk", {"k": 5, "rescale_acts_by_decoder_norm": True}, "blocks.2.hook_resid_post"),
    ("topk", {"k": 5, "normalize_activations": "layer_norm"}, "blocks.2.hook_resid_post"),
    ("abstopk", {"k": 4}, "blocks.2.hook_resid_post"),
    ("jumprelu", {}, "blocks.0.hook_mlp_out"),
    ("gated", {}, "blocks.3.hook_resid_mid"),
    ("transcoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}, "blocks.1.ln2.hook_normalized"),
    ("skip_transcoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}, "blocks.1.ln2.hook_normalized"),
    ("jumprelu_transcoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}, "blocks.1.ln2.hook_normalized"),
    ("jumprelu_skip_transcoder", {"apply_b_dec_to_input": False, "d_out": D_OUT}, "blocks.1.ln2.hook_normalized"),
]
IDS = [f"{a}-{'-'.join(f'{k}={v}' for k, v in kw.items() if k != 'd_out')}" for a, kw, _ in CASES]


def _saelens_sae(arch: str, kw: dict, hook: str, seed: int = 0):
    from sae_lens import SAE  # noqa: F401  (registers the architectures)
    from sae_lens.registry import get_sae_class
    from sae_lens.saes.sae import SAEMetadata

    cls, cfg_cls = get_sae_class(arch)
    meta = SAEMetadata(model_name="tiny-test", hook_name=hook)
    if arch.endswith("transcoder"):
        meta.hook_name_out = hook.replace("ln2.hook_normalized", "hook_mlp_out")
    cfg = cfg_cls(d_in=D_IN, d_sae=D_SAE, metadata=meta, **kw)
    sae = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.startswith("W") else 0.3))
        if hasattr(sae, "threshold"):
            sae.threshold.copy_(torch.rand(D_SAE, generator=g) * 0.4)  # positive, perturbed
    sae.eval()
    return sae


def _inputs(arch: str, kw: dict, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kw.get("reshape_activations") == "hook_z" and not arch.endswith("transcoder"):
        return torch.randn(3, 5, 4, D_IN // 4, generator=g) * 2  # [batch, pos, n_heads, d_head]
    return torch.randn(3, 5, D_IN, generator=g) * 2


def _compare(sae, d: Dictionary, x: torch.Tensor) -> None:
    with torch.no_grad():
        a_ref, a = sae.encode(x), d.encode(x)
        assert a.shape == a_ref.shape
        assert (a_ref != 0).any() and (a_ref == 0).any(), "the test SAE is trivially dense or dead"
        torch.testing.assert_close(a, a_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(d.decode(a), sae.decode(a_ref), atol=ATOL, rtol=0)
        torch.testing.assert_close(d(x), sae(x), atol=ATOL, rtol=0)


@needs_saelens
@pytest.mark.parametrize("arch,kw,hook", CASES, ids=IDS)
def test_saelens_saved_loads_equal(tmp_path, arch, kw, hook):
    sae = _saelens_sae(arch, kw, hook)
    sae.save_model(tmp_path / "sae")
    d = load_saelens_dir(tmp_path / "sae")
    assert d.hook_in == hook and d.metadata["model_name"] == "tiny-test"
    assert d.layer == int(hook.split(".")[1])
    assert d.metadata["architecture"] == arch and len(d.metadata["sha256"]) == 64
    if arch.endswith("transcoder"):
        assert d.is_transcoder and d.hook_out.endswith("hook_mlp_out") and d.d_out == D_OUT
    _compare(sae, d, _inputs(arch, kw))


@needs_saelens
@pytest.mark.parametrize("arch,kw,hook", CASES, ids=IDS)
def test_saved_loads_in_saelens_equal(tmp_path, arch, kw, hook):
    from sae_lens import SAE

    sae = _saelens_sae(arch, kw, hook, seed=3)
    sae.save_model(tmp_path / "ref")
    d = load_saelens_dir(tmp_path / "ref")
    out = save_saelens_dir(d, tmp_path / "ours", model_name="tiny-test")
    back = SAE.load_from_disk(str(out))
    assert type(back) is type(sae)
    assert back.cfg.metadata.hook_name == hook and back.cfg.metadata.model_name == "tiny-test"
    for name, p in sae.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], p, atol=0, rtol=0)
    _compare(back, d, _inputs(arch, kw, seed=5))


@needs_saelens
def test_pre6_config_reads_like_saelens(tmp_path):
    """A pre-6.0 cfg.json (hook_point, top-level metadata, activation_fn_kwargs.k) reads as SAELens reads it."""
    from sae_lens import SAE

    sae = _saelens_sae("topk", {"k": 3}, "blocks.0.hook_resid_pre", seed=7)
    sae.save_model(tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "cfg.json").read_text())
    old = {"d_in": cfg["d_in"], "d_sae": cfg["d_sae"], "dtype": "torch.float32", "device": "cpu",
           "hook_point": "blocks.0.hook_resid_pre", "model_name": "tiny-old", "apply_b_dec_to_input": True,
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3}, "normalize_activations": False,
           "context_size": 128}
    (tmp_path / "old" / "cfg.json").write_text(json.dumps(old))
    ref = SAE.load_from_disk(str(tmp_path / "old"))
    d = load_saelens_dir(tmp_path / "old")
    assert d.activation == "topk" and d.k == 3 and d.hook_in == "blocks.0.hook_resid_pre"
    assert d.metadata["model_name"] == "tiny-old" and d.metadata["context_size"] == 128
    _compare(ref, d, _inputs("topk", {}))


def test_saelens_round_trip_without_saelens(tmp_path):
    """save -> load is the identity on weights and maths for every SAELens-expressible dictionary (runs on both stacks)."""
    g = torch.Generator().manual_seed(0)
    specs = [dict(activation="relu", apply_b_dec_to_input=True, hook_in="blocks.0.hook_resid_pre"),
             dict(activation="topk", k=3, rescale_acts_by_decoder_norm=True, hook_in="blocks.1.hook_resid_pre"),
             dict(activation="abstopk", k=3, hook_in="blocks.1.hook_resid_pre"),
             dict(activation="jumprelu", hook_in="blocks.2.hook_resid_pre", normalize_activations="layer_norm"),
             dict(activation="gated", hook_in="blocks.2.hook_resid_pre"),
             dict(activation="relu", skip=True, hook_in="blocks.0.ln2.hook_normalized", d_out=7,
                  hook_out="blocks.0.hook_mlp_out"),
             dict(activation="jumprelu", hook_in="blocks.0.ln2.hook_normalized", d_out=7,
                  hook_out="blocks.0.hook_mlp_out")]
    for i, spec in enumerate(specs):
        spec = dict(spec)
        d_out = spec.pop("d_out", None)
        d = Dictionary(10, 24, d_out, layer=int(spec["hook_in"].split(".")[1]), **spec)
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if d.threshold is not None:
                d.threshold.copy_(torch.rand(24, generator=g) * 0.3)
        out = save_saelens_dir(d, tmp_path / f"d{i}", model_name="m")
        back = load_saelens_dir(out)
        assert back.config() == d.config() | {"transcoder": d.is_transcoder}, spec
        for name, p in d.state_dict().items():
            if d.activation == "gated" and name == "b_enc":
                continue  # SAELens' gated SAE has no b_enc
            torch.testing.assert_close(back.state_dict()[name], p, atol=0, rtol=0)
        x = torch.randn(4, 10, generator=g)
        torch.testing.assert_close(back(x), d(x), atol=0, rtol=0)
        assert back.metadata["model_name"] == "m"


def test_saelens_dir_bad_files(tmp_path):
    d = Dictionary(6, 10, activation="jumprelu", hook_in="blocks.0.hook_resid_pre", layer=0)
    with torch.no_grad():
        d.W_enc.normal_()
    out = save_saelens_dir(d, tmp_path / "ok", model_name="m")
    from safetensors.torch import load_file, save_file

    w = load_file(str(out / "sae_weights.safetensors"))
    # missing tensor
    bad = tmp_path / "missing"
    save_saelens_dir(d, bad, model_name="m")
    save_file({k: v for k, v in w.items() if k != "threshold"}, str(bad / "sae_weights.safetensors"))
    with pytest.raises(SAEError, match="missing.*threshold"):
        load_saelens_dir(bad)
    # shape mismatch
    save_file({**w, "W_enc": torch.zeros(6, 11)}, str(bad / "sae_weights.safetensors"))
    with pytest.raises(SAEError, match="W_enc.*shape"):
        load_saelens_dir(bad)
    # NaN
    nan = w["W_dec"].clone()
    nan[0, 0] = float("nan")
    save_file({**w, "W_dec": nan}, str(bad / "sae_weights.safetensors"))
    with pytest.raises(SAEError, match="NaN"):
        load_saelens_dir(bad)
    # unsupported architecture / option
    cfg = json.loads((out / "cfg.json").read_text())
    (out / "cfg.json").write_text(json.dumps({**cfg, "architecture": "temporal"}))
    with pytest.raises(SAEError, match="temporal"):
        load_saelens_dir(out)
    (out / "cfg.json").write_text(json.dumps({**cfg, "normalize_activations": "whiten_somehow"}))
    with pytest.raises(SAEError, match="whiten_somehow"):
        load_saelens_dir(out)
    with pytest.raises(SAEError, match="cfg.json"):
        load_saelens_dir(tmp_path / "nowhere")
    # what SAELens cannot express
    tc = Dictionary(6, 10, 5, activation="topk", k=2, hook_in="blocks.0.mlp.hook_in", hook_out="blocks.0.hook_mlp_out")
    with pytest.raises(SAEError, match="no topk transcoder"):
        save_saelens_dir(tc, tmp_path / "tc", model_name="m")
