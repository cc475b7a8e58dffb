"""Dictionary maths checked by hand (numpy), on every activation and SAELens input option; no sae_lens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracekit.core.errors import SAEError
from tracekit.dictionaries import Dictionary, weights_sha256


def _random(d: Dictionary, seed: int = 0) -> Dictionary:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.5)
        if d.threshold is not None:
            d.threshold.copy_(torch.rand(d.d_sae, generator=g, dtype=torch.float64).to(d.threshold.dtype) * 0.6 - 0.1)
    return d


def _np(d: Dictionary, name: str) -> np.ndarray:
    return getattr(d, name).detach().double().numpy()


def _x(shape, seed=1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _relu(a):
    return np.maximum(a, 0)


@pytest.mark.parametrize("activation,nonneg", [("relu", True), ("jumprelu", True), ("jumprelu", False),
                                                ("topk", True), ("topk", False), ("abstopk", True), ("gated", True)])
def test_encode_decode_by_hand(activation, nonneg):
    k = 4 if "topk" in activation else None
    d = _random(Dictionary(8, 30, activation=activation, k=k, apply_b_dec_to_input=True, nonneg=nonneg,
                           dtype=torch.float64))
    if activation == "jumprelu" and not nonneg:
        assert d.threshold is not None
        with torch.no_grad():
            d.threshold.uniform_(-1.0, 0.3, generator=torch.Generator().manual_seed(9))
    x = _x((2, 3, 8))
    xn = x.numpy()
    sae_in = xn - _np(d, "b_dec")
    W, b = _np(d, "W_enc"), _np(d, "b_enc")
    pre = sae_in @ W + b
    if activation == "relu":
        acts = _relu(pre)
    elif activation == "jumprelu":
        acts = (_relu(pre) if nonneg else pre) * (pre > _np(d, "threshold"))
    elif activation in ("topk", "abstopk"):
        key = np.abs(pre) if activation == "abstopk" else pre
        idx = np.argsort(-key, axis=-1)[..., :k]
        mask = np.zeros_like(pre)
        np.put_along_axis(mask, idx, 1.0, axis=-1)
        kept = pre * mask
        acts = _relu(kept) if (activation == "topk" and nonneg) else kept
    else:
        gate = (sae_in @ W + _np(d, "b_gate")) > 0
        acts = gate * _relu(sae_in @ (W * np.exp(_np(d, "r_mag"))) + _np(d, "b_mag"))
    got = d.encode(x).detach().numpy()
    assert (acts != 0).any() and (acts == 0).any()
    np.testing.assert_allclose(got, acts, atol=1e-12, rtol=0)
    recon = acts @ _np(d, "W_dec") + _np(d, "b_dec")
    np.testing.assert_allclose(d.decode(torch.from_numpy(acts)).detach().numpy(), recon, atol=1e-12, rtol=0)
    np.testing.assert_allclose(d(x).detach().numpy(), recon, atol=1e-12, rtol=0)
    if activation == "jumprelu" and not nonneg:
        neg = (pre < 0) & (pre > _np(d, "threshold"))
        assert neg.any() and (got[neg] < 0).all(), "circuit-tracer's JumpReLU keeps negative values above a negative threshold"


def test_topk_rescale_by_decoder_norm_by_hand():
    d = _random(Dictionary(8, 30, activation="topk", k=3, rescale_acts_by_decoder_norm=True, dtype=torch.float64))
    x = _x((5, 8))
    norms = np.linalg.norm(_np(d, "W_dec"), axis=-1)
    pre = (x.numpy() @ _np(d, "W_enc") + _np(d, "b_enc")) * norms
    idx = np.argsort(-pre, axis=-1)[..., :3]
    acts = np.zeros_like(pre)
    np.put_along_axis(acts, idx, np.take_along_axis(_relu(pre), idx, -1), axis=-1)
    np.testing.assert_allclose(d.encode(x).detach().numpy(), acts, atol=1e-12, rtol=0)
    recon = (acts / norms) @ _np(d, "W_dec") + _np(d, "b_dec")
    np.testing.assert_allclose(d(x).detach().numpy(), recon, atol=1e-12, rtol=0)
    np.testing.assert_allclose(d.decode_linear(torch.from_numpy(acts)).detach().numpy(), recon, atol=1e-12, rtol=0)


@pytest.mark.parametrize("norm", ["constant_norm_rescale", "layer_norm"])
def test_runtime_normalisation_by_hand_and_no_state(norm):
    d = _random(Dictionary(8, 30, activation="relu", apply_b_dec_to_input=True, normalize_activations=norm,
                           dtype=torch.float64))
    x = _x((4, 8))
    xn = x.numpy()
    if norm == "constant_norm_rescale":
        c = np.sqrt(8) / np.linalg.norm(xn, axis=-1, keepdims=True)
        xin, undo = xn * c, (lambda o: o / c)
    else:
        mu = xn.mean(-1, keepdims=True)
        std = (xn - mu).std(-1, ddof=1, keepdims=True)
        xin, undo = (xn - mu) / (std + 1e-5), (lambda o: o * std + mu)
    acts = _relu((xin - _np(d, "b_dec")) @ _np(d, "W_enc") + _np(d, "b_enc"))
    recon = undo(acts @ _np(d, "W_dec") + _np(d, "b_dec"))
    np.testing.assert_allclose(d(x).detach().numpy(), recon, atol=1e-10, rtol=0)
    assert d._norm_state is None, "forward keeps no state"
    a = d.encode(x)
    np.testing.assert_allclose(d.decode(a).detach().numpy(), recon, atol=1e-10, rtol=0)
    assert d._norm_state is None, "decode consumes what encode kept (as SAELens)"
    with pytest.raises(SAEError, match="call encode first"):
        d.decode(a)


def test_hook_z_reshape():
    d = _random(Dictionary(12, 20, hook_in="blocks.0.attn.hook_z", reshape_activations="hook_z",
                           apply_b_dec_to_input=True, dtype=torch.float64))
    x = _x((2, 5, 4, 3))
    out = d(x)
    assert out.shape == x.shape
    flat = d(x.reshape(2, 5, 12))
    assert flat.shape == (2, 5, 12), "a flat input stays flat"
    torch.testing.assert_close(out.reshape(2, 5, 12), flat, atol=0, rtol=0)
    a = d.encode(x)
    assert a.shape == (2, 5, 20) and d.decode(a).shape == x.shape
    with pytest.raises(SAEError, match="n_heads"):
        d.encode(_x((2, 5, 5)))


def test_skip_transcoder_by_hand():
    d = _random(Dictionary(8, 30, 6, skip=True, hook_in="blocks.2.ln2.hook_normalized",
                           hook_out="blocks.2.hook_mlp_out", layer=2, dtype=torch.float64))
    assert d.is_transcoder
    x = _x((3, 8))
    acts = _relu(x.numpy() @ _np(d, "W_enc") + _np(d, "b_enc"))
    want = acts @ _np(d, "W_dec") + _np(d, "b_dec") + x.numpy() @ _np(d, "W_skip").T
    np.testing.assert_allclose(d(x).detach().numpy(), want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(d.skip_out(x).detach().numpy(), x.numpy() @ _np(d, "W_skip").T, atol=1e-12)


def test_refusals_and_content_key():
    with pytest.raises(SAEError, match="not one of"):
        Dictionary(4, 8, activation="batchtopk")
    with pytest.raises(SAEError, match="k >= 1"):
        Dictionary(4, 8, activation="abstopk")
    with pytest.raises(SAEError, match="normalize_activations"):
        Dictionary(4, 8, normalize_activations="whiten")
    with pytest.raises(SAEError, match="rescale_acts_by_decoder_norm"):
        Dictionary(4, 8, rescale_acts_by_decoder_norm=True)
    with pytest.raises(SAEError, match="apply_b_dec_to_input"):
        Dictionary(4, 8, 5, apply_b_dec_to_input=True)
    with pytest.raises(SAEError, match="magnitude path"):
        Dictionary(4, 8, activation="gated").activate(torch.zeros(8))
    a, b = _random(Dictionary(4, 8), 0), _random(Dictionary(4, 8), 0)
    assert weights_sha256(a) == weights_sha256(b)
    with torch.no_grad():
        b.b_dec[0] += 1e-6
    assert weights_sha256(a) != weights_sha256(b)
