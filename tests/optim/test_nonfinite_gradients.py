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
