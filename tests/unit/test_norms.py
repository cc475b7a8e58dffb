"""tracekit.model.norms: a norm's affine form is measured by calling it, for every convention families use
(LayerNorm with/without bias, RMSNorm, Gemma's and Nemotron's ``1 + w``), and the run's scale is
recovered from the module's own input and output."""

from __future__ import annotations

import pytest
import torch

from tracekit.model.norms import measure_norm, run_sigma

D = 10


class OnePlusRMS(torch.nn.Module):
    """Gemma's RMSNorm: the stored weight w is applied as (1 + w)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(D) * 0.3)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class OnePlusLN(torch.nn.LayerNorm):
    """Nemotron's LayerNorm1P: (1 + w), with a bias."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, 1 + self.weight, self.bias, self.eps)


def _perturbed(mod):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return mod


@pytest.mark.parametrize("kind", ["ln", "ln_nobias", "rms", "one_plus_rms", "one_plus_ln", "odd_width"])
def test_measured_affine_form_reproduces_the_module(kind):
    d = D + 1 if kind == "odd_width" else D
    mod = {"ln": lambda: torch.nn.LayerNorm(d), "ln_nobias": lambda: torch.nn.LayerNorm(d, bias=False),
           "rms": lambda: torch.nn.RMSNorm(d, eps=1e-6), "one_plus_rms": OnePlusRMS,
           "one_plus_ln": lambda: OnePlusLN(d), "odd_width": lambda: torch.nn.LayerNorm(d)}[kind]()
    mod = _perturbed(mod)
    n = measure_norm(mod, d)
    assert n.exact, n.max_error
    assert n.centred == (kind in ("ln", "ln_nobias", "one_plus_ln", "odd_width"))
    # the affine form with the measured weight/bias equals the module on random inputs
    x = torch.randn(5, d) * 4 + 1
    eps = getattr(mod, "eps", 1e-5) or 1e-6
    c = n.centre(x)
    want = mod(x)
    got = n.weight * c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps) + n.bias
    assert (got - want).abs().max() < 1e-5
    if kind.startswith("one_plus"):  # the weight read is 1 + w, not w (the Nemotron bug)
        assert (n.weight - (1 + mod.weight.detach())).abs().max() < 1e-5


def test_run_sigma_is_the_forward_scale():
    mod = _perturbed(torch.nn.LayerNorm(D))
    n = measure_norm(mod, D)
    x = torch.randn(7, D) * 3
    xc = x - x.mean(-1, keepdim=True)
    sigma = torch.sqrt(xc.pow(2).mean(-1) + mod.eps)
    assert (run_sigma(n, x, mod(x)) - sigma).abs().max() < 1e-5


def test_adjoint_moves_a_direction_through_the_norm():
    mod = _perturbed(torch.nn.LayerNorm(D))
    n = measure_norm(mod, D)
    x, u = torch.randn(D), torch.randn(D)
    # (w * centre(x)) . u == x . centre(w * u)
    assert abs(float((n.weight * n.centre(x)) @ u) - float(x @ n.adjoint(u))) < 1e-5


def test_a_norm_that_is_not_elementwise_affine_is_reported():
    class GroupNorm2(torch.nn.Module):  # normalises two halves separately: not one affine form
        def forward(self, x):
            a, b = x.chunk(2, -1)
            f = torch.nn.functional.layer_norm
            return torch.cat([f(a, a.shape[-1:]), f(b, b.shape[-1:]) * 2], -1)

    assert not measure_norm(GroupNorm2(), D).exact
