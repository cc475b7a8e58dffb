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
from typing import Any, cast

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from tracekit.core.errors import SAEError
from tracekit.dictionaries import (
    Dictionary,
    DictionarySet,
    load_saelens_dir,
    load_transcoder_set,
    save_saelens_dir,
    save_transcoder_set,
)

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
    ("transcoder", {"apply_b_dec_to_input": False, "d_out": D_OUT, "normalize_activations": "layer_norm"},
     "blocks.1.ln2.hook_normalized"),
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
    sae: Any = cast(Any, cls)(cfg)
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
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_dtype_override_equals_saelens(tmp_path, dtype):
    from sae_lens import SAE

    sae = _saelens_sae("jumprelu", {}, "blocks.0.hook_resid_pre", seed=4)
    sae.save_model(tmp_path / "s")
    ref = SAE.load_from_disk(str(tmp_path / "s"), dtype=dtype)
    d = load_saelens_dir(tmp_path / "s", dtype=dtype)
    assert d.W_enc.dtype == getattr(torch, dtype)
    x = _inputs("jumprelu", {})
    with torch.no_grad():
        torch.testing.assert_close(d.encode(x), ref.encode(x), atol=0, rtol=0)
        torch.testing.assert_close(d(x), ref(x), atol=0, rtol=0)


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
    from safetensors.torch import load_file

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


# -- circuit-tracer's transcoder set (no sae_lens, no circuit_tracer: files built in its layout) ------------

CT_IN, CT_SAE = 6, 16  # circuit-tracer: d_model in and out


def _ct_tensors(seed: int, *, skip: bool = False, jump: bool = False, old_layout: bool = False) -> dict:
    """Tensors as circuit-tracer's files hold them: W_enc [d_sae, d_model], W_dec [d_sae, d_model] (its
    to_safetensors) or [d_model, d_sae] (its first load_relu_transcoder, which transposed both)."""
    g = torch.Generator().manual_seed(seed)
    t = {"W_enc": torch.randn(CT_SAE, CT_IN, generator=g), "W_dec": torch.randn(CT_SAE, CT_IN, generator=g) * 0.3,
         "b_enc": torch.randn(CT_SAE, generator=g) * 0.5, "b_dec": torch.randn(CT_IN, generator=g) * 0.2}
    if old_layout:
        t["W_dec"] = t["W_dec"].T.contiguous()
    if skip:
        t["W_skip"] = torch.randn(CT_IN, CT_IN, generator=g) * 0.1
    if jump:
        t["activation_function.threshold"] = torch.rand(CT_SAE, generator=g) * 1.2 - 0.6  # some negative
    return t


def _ct_by_hand(t: dict, x: np.ndarray, *, old_layout: bool = False) -> np.ndarray:
    W_enc = t["W_enc"].numpy()  # [d_sae, d_in]: pre = x @ W_enc.T + b_enc (F.linear)
    pre = x @ W_enc.T + t["b_enc"].numpy()
    if "activation_function.threshold" in t:
        acts = pre * (pre > t["activation_function.threshold"].numpy())  # circuit-tracer's jumprelu
    else:
        acts = np.maximum(pre, 0)
    W_dec = t["W_dec"].numpy().T if old_layout else t["W_dec"].numpy()
    out = acts @ W_dec + t["b_dec"].numpy()
    if "W_skip" in t:
        out = out + x @ t["W_skip"].numpy().T
    return out


def _write_ct(root, layers: dict, *, in_hook="mlp.hook_in", out_hook="hook_mlp_out", entries=None):
    root.mkdir(parents=True, exist_ok=True)
    for name, t in layers.values():
        if name.endswith(".npz"):
            np.savez(root / name, **{k: v.numpy() for k, v in t.items()})
        else:
            save_file(t, str(root / name))
    cfg = {"model_name": "org/tiny-model", "feature_input_hook": in_hook, "feature_output_hook": out_hook,
           "transcoders": entries if entries is not None else
           [{"id": f"tc-{layer}", "layer": layer, "filepath": name} for layer, (name, _) in layers.items()]}
    (root / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    return root / "tiny.yaml"


def test_circuit_tracer_layout_loads_with_its_maths(tmp_path):
    t0 = _ct_tensors(0, skip=True)
    t1 = _ct_tensors(1, jump=True)
    t2 = _ct_tensors(2, old_layout=True)
    gs = _ct_tensors(3, jump=True)
    npz = {"W_enc": gs["W_enc"].T.contiguous(), "W_dec": gs["W_dec"], "b_enc": gs["b_enc"], "b_dec": gs["b_dec"],
           "threshold": gs["activation_function.threshold"].abs()}  # Gemma Scope params.npz: W_enc [d_model, d_sae]
    cfg = _write_ct(tmp_path / "set", {0: ("layer_0.safetensors", t0), 1: ("layer_1.safetensors", t1),
                                       2: ("layer_2.safetensors", t2), 3: ("params_3.npz", npz)})
    dset = load_transcoder_set(cfg)
    assert isinstance(dset, DictionarySet) and dset.layers == [0, 1, 2, 3]
    assert dset[1].hook_in == "blocks.1.mlp.hook_in" and dset[1].hook_out == "blocks.1.hook_mlp_out"
    assert dset.metadata["model_name"] == "org/tiny-model" and len(dset.metadata["sha256"]) == 64
    assert dset[0].W_skip is not None and dset[1].activation == "jumprelu" and dset[2].activation == "relu"
    assert dset[3].activation == "jumprelu" and not dset[1].nonneg
    x = torch.randn(4, 7, CT_IN, generator=torch.Generator().manual_seed(5))
    npz_as_ct = {"W_enc": npz["W_enc"].T, "W_dec": npz["W_dec"], "b_enc": npz["b_enc"], "b_dec": npz["b_dec"],
                 "activation_function.threshold": npz["threshold"]}
    for layer, (t, old) in {0: (t0, False), 1: (t1, False), 2: (t2, True), 3: (npz_as_ct, False)}.items():
        want = _ct_by_hand(t, x.numpy(), old_layout=old)
        got = dset[layer](x).detach().numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    neg = dset[1].encode(x) < 0
    assert neg.any(), "the JumpReLU with negative thresholds keeps negative activations (circuit-tracer's maths)"
    # the same set re-loaded gives the same content key; a changed file changes it
    assert load_transcoder_set(cfg).metadata["sha256"] == dset.metadata["sha256"]
    save_file({**t0, "b_dec": t0["b_dec"] + 1}, str(tmp_path / "set" / "layer_0.safetensors"))
    assert load_transcoder_set(cfg).metadata["sha256"] != dset.metadata["sha256"]


def test_gemma_scope_2_and_topk_files(tmp_path):
    t = _ct_tensors(4)
    g = torch.Generator().manual_seed(8)
    gs2 = {"w_enc": t["W_enc"].T.contiguous(), "w_dec": t["W_dec"], "b_enc": t["b_enc"], "b_dec": t["b_dec"],
           "threshold": torch.rand(CT_SAE, generator=g) * 0.3,
           "affine_skip_connection": torch.randn(CT_IN, CT_IN, generator=g) * 0.1}  # [d_in, d_out]
    topk = {**_ct_tensors(5), "k": torch.tensor(3)}
    cfg = _write_ct(tmp_path / "s", {0: ("a.safetensors", gs2), 1: ("b.safetensors", topk)},
                    in_hook="ln2.hook_normalized")
    dset = load_transcoder_set(tmp_path / "s")  # the folder: its one YAML
    x = torch.randn(5, CT_IN, generator=g)
    pre = x.numpy() @ gs2["w_enc"].numpy() + gs2["b_enc"].numpy()
    acts = pre * (pre > gs2["threshold"].numpy())
    want = acts @ gs2["w_dec"].numpy() + gs2["b_dec"].numpy() + x.numpy() @ gs2["affine_skip_connection"].numpy()
    np.testing.assert_allclose(dset[0](x).detach().numpy(), want, atol=1e-5, rtol=0)
    assert dset[1].activation == "topk" and dset[1].k == 3 and not dset[1].nonneg
    pre1 = x.numpy() @ topk["W_enc"].numpy().T + topk["b_enc"].numpy()
    idx = np.argsort(-pre1, axis=-1)[:, :3]
    a1 = np.zeros_like(pre1)
    np.put_along_axis(a1, idx, np.take_along_axis(pre1, idx, -1), axis=-1)  # circuit-tracer's TopK: no ReLU
    np.testing.assert_allclose(dset[1].encode(x).detach().numpy(), a1, atol=1e-5, rtol=0)
    assert dset[0].hook_in == "blocks.0.ln2.hook_normalized"
    assert cfg.exists()


def test_transcoder_set_round_trip(tmp_path):
    dicts = {}
    g = torch.Generator().manual_seed(11)
    for layer in range(3):
        d = Dictionary(CT_IN, CT_SAE, CT_IN + 2, activation="jumprelu", skip=layer == 1,
                       hook_in=f"blocks.{layer}.mlp.hook_in", hook_out=f"blocks.{layer}.hook_mlp_out", layer=layer)
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            assert d.threshold is not None
            d.threshold.copy_(torch.rand(CT_SAE, generator=g) * 0.4)
        dicts[layer] = d
    dset = DictionarySet(dicts)
    cfg = save_transcoder_set(dset, tmp_path / "out", model_name="org/tiny")
    raw = yaml.safe_load(cfg.read_text())
    assert raw["feature_input_hook"] == "mlp.hook_in" and raw["feature_output_hook"] == "hook_mlp_out"
    assert [e["layer"] for e in raw["transcoders"]] == [0, 1, 2] and raw["model_name"] == "org/tiny"
    from safetensors.torch import load_file

    f1 = load_file(str(tmp_path / "out" / "layer_1.safetensors"))
    assert f1["W_enc"].shape == (CT_SAE, CT_IN) and f1["W_dec"].shape == (CT_SAE, CT_IN + 2)  # circuit-tracer's layout
    assert f1["W_skip"].shape == (CT_IN + 2, CT_IN) and "activation_function.threshold" in f1
    back = load_transcoder_set(tmp_path / "out")
    x = torch.randn(3, CT_IN, generator=g)
    for layer in range(3):
        assert back[layer].config() == dicts[layer].config() | {"transcoder": True}
        torch.testing.assert_close(back[layer](x), dicts[layer](x), atol=0, rtol=0)
    # topk round trip keeps k and the ReLU (recorded in the file header)
    tk = {0: Dictionary(CT_IN, CT_SAE, activation="topk", k=4, hook_in="blocks.0.mlp.hook_in",
                        hook_out="blocks.0.hook_mlp_out", layer=0)}
    with torch.no_grad():
        for p in tk[0].parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    back_tk = load_transcoder_set(save_transcoder_set(DictionarySet(tk), tmp_path / "tk", model_name="m"))
    assert back_tk[0].k == 4 and back_tk[0].nonneg
    torch.testing.assert_close(back_tk[0](x), tk[0](x), atol=0, rtol=0)


def test_transcoder_set_bad_files(tmp_path):
    t = _ct_tensors(0)
    # a gap in the layers
    cfg = _write_ct(tmp_path / "gap", {0: ("l0.safetensors", t), 2: ("l2.safetensors", t)})
    with pytest.raises(SAEError, match=r"layers \[1\] have no transcoder"):
        load_transcoder_set(cfg)
    # a missing tensor
    cfg = _write_ct(tmp_path / "miss", {0: ("l0.safetensors", {k: v for k, v in t.items() if k != "b_enc"})})
    with pytest.raises(SAEError, match=r"l0.safetensors.*missing tensor 'b_enc'"):
        load_transcoder_set(cfg)
    # a shape mismatch
    cfg = _write_ct(tmp_path / "shape", {0: ("l0.safetensors", {**t, "W_dec": torch.zeros(CT_SAE, CT_IN + 1)})})
    with pytest.raises(SAEError, match=r"l0.safetensors.*'W_dec'"):
        load_transcoder_set(cfg)
    # NaN
    bad = t["W_enc"].clone()
    bad[1, 1] = float("nan")
    cfg = _write_ct(tmp_path / "nan", {0: ("l0.safetensors", {**t, "W_enc": bad})})
    with pytest.raises(SAEError, match=r"l0.safetensors.*NaN"):
        load_transcoder_set(cfg)
    # a missing file, an hf:// path, a duplicated layer, an unknown tensor
    cfg = _write_ct(tmp_path / "nofile", {}, entries=[{"id": "a", "layer": 0, "filepath": "gone.safetensors"}])
    with pytest.raises(SAEError, match="gone.safetensors.*not found"):
        load_transcoder_set(cfg)
    cfg = _write_ct(tmp_path / "hf", {}, entries=[{"id": "a", "layer": 0, "filepath": "hf://org/repo/l0.safetensors"}])
    with pytest.raises(SAEError, match="download it"):
        load_transcoder_set(cfg)
    cfg = _write_ct(tmp_path / "dup", {0: ("l0.safetensors", t)},
                    entries=[{"id": "a", "layer": 0, "filepath": "l0.safetensors"},
                             {"id": "b", "layer": 0, "filepath": "l0.safetensors"}])
    with pytest.raises(SAEError, match="more than one"):
        load_transcoder_set(cfg)
    cfg = _write_ct(tmp_path / "unk", {0: ("l0.safetensors", {**t, "mystery": torch.zeros(3)})})
    with pytest.raises(SAEError, match="mystery"):
        load_transcoder_set(cfg)
    # writer refusals: gaps, gated, mixed hooks
    d = Dictionary(4, 8, activation="gated", hook_in="blocks.0.mlp.hook_in", hook_out="blocks.0.hook_mlp_out", layer=0)
    with pytest.raises(SAEError, match="gated"):
        save_transcoder_set(DictionarySet({0: d}), tmp_path / "w1", model_name="m")
    assert not (tmp_path / "w1").exists(), "a refused write leaves nothing behind"
    r = {i: Dictionary(4, 8, hook_in=f"blocks.{i}.mlp.hook_in", hook_out=f"blocks.{i}.hook_mlp_out", layer=i)
         for i in (0, 2)}
    with pytest.raises(SAEError, match="without gaps"):
        save_transcoder_set(DictionarySet(r), tmp_path / "w2", model_name="m")
    r[1] = Dictionary(4, 8, hook_in="blocks.1.ln2.hook_normalized", hook_out="blocks.1.hook_mlp_out", layer=1)
    with pytest.raises(SAEError, match="feature_input_hook"):
        save_transcoder_set(DictionarySet(r), tmp_path / "w3", model_name="m")


def test_cross_format_saelens_to_circuit_tracer(tmp_path):
    """A skip JumpReLU transcoder: SAELens directory -> Dictionary -> circuit-tracer set -> Dictionary, same maths."""
    g = torch.Generator().manual_seed(21)
    d = Dictionary(CT_IN, CT_SAE, CT_IN, activation="jumprelu", skip=True, hook_in="blocks.0.ln2.hook_normalized",
                   hook_out="blocks.0.hook_mlp_out", layer=0)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        assert d.threshold is not None
        d.threshold.copy_(torch.rand(CT_SAE, generator=g) * 0.3)
    via_saelens = load_saelens_dir(save_saelens_dir(d, tmp_path / "sl", model_name="m"))
    cfg = save_transcoder_set(DictionarySet({0: via_saelens}), tmp_path / "ct", model_name="m")
    back = load_transcoder_set(cfg)[0]
    assert back.hook_in == d.hook_in and back.hook_out == d.hook_out and back.activation == "jumprelu"
    x = torch.randn(6, CT_IN, generator=g)
    torch.testing.assert_close(back(x), d(x), atol=0, rtol=0)
    torch.testing.assert_close(back.encode(x), d.encode(x), atol=0, rtol=0)
