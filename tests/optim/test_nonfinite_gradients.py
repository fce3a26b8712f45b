"""A non-finite gradient stops ManifoldMuon.step with a ValueError and changes nothing."""

from __future__ import annotations

import pytest
import torch

from manifoldlib.optim import ManifoldMuon


def _params(manifold):
    gen = torch.Generator().manual_seed(0)
    shapes = [(10, 4), (6, 6)]
    return [torch.nn.Parameter(torch.randn(*s, generator=gen, dtype=torch.float64)) for s in shapes], gen


@pytest.mark.parametrize("manifold", ["euclidean", "stiefel", "dgram"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_raises_and_leaves_parameters_and_momentum(manifold, bad):
    params, gen = _params(manifold)
    opt = ManifoldMuon(params, manifold=manifold, lr=0.02)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    opt.step()  # a good step first: momentum buffers are nonzero
    before = [p.detach().clone() for p in params]
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in params]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    params[1].grad[2, 3] = bad
    with pytest.raises(ValueError, match=r"index 1 in its group, shape \(6, 6\).*non-finite"):
        opt.step()
    for p, b, m in zip(params, before, buffers):
        assert torch.equal(p.detach(), b)
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
    params[1].grad[2, 3] = 0.0
    opt.step()  # the next finite gradient steps as usual
    assert not torch.equal(params[0].detach(), before[0])


def test_the_error_names_a_named_parameter():
    model = torch.nn.Linear(4, 6, bias=False)
    opt = ManifoldMuon(list(model.named_parameters()), manifold="stiefel", lr=0.02)
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    with pytest.raises(ValueError, match="'weight'"):
        opt.step()


@pytest.mark.parametrize("manifold", ["euclidean", "stiefel", "dgram"])
def test_a_finite_float64_gradient_beyond_float32s_range_steps(manifold):
    # entries of ~1e100 are finite in float64 (their float32 sum, or a cast to the Euclidean
    # Newton-Schulz's float32/bfloat16, would be inf): no error, and the step (scale-free in G)
    # is the one the gradient's direction gives (a power-of-two scale: the casts round alike)
    params, gen = _params(manifold)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ManifoldMuon(params, manifold=manifold, lr=0.02)
    twin_opt = ManifoldMuon(twins, manifold=manifold, lr=0.02)
    for p, q in zip(params, twins):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        p.grad, q.grad = 2.0**332 * g, g
    opt.step()
    twin_opt.step()
    for p, q in zip(params, twins):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-9)
