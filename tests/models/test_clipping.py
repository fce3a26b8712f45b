"""Gradient-norm clipping (models.clipping): torch's result on ordinary gradients, a finite
norm and a correct clip where float32's sum of squares overflows, non-finite entries kept."""

from __future__ import annotations

import math

import pytest
import torch

from models.clipping import clip_grad_norm, global_norm


def _params(*grads: torch.Tensor) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def _flat(params) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in params])


@pytest.mark.parametrize("max_norm", [0.5, 1e3, math.inf])
def test_ordinary_gradients_are_clipped_exactly_as_torch_does(max_norm):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(17, 9, generator=gen), torch.randn(5, generator=gen) * 3]
    ours, theirs = _params(*grads), _params(*grads)
    norm = clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert norm == float(expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


def test_a_finite_gradient_whose_float32_norm_overflows_is_measured_and_clipped():
    # entries ~1e19-1e20: every square overflows float32, the gradient itself is finite
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(64, 32, generator=gen) * 1e19, torch.randn(7, generator=gen) * 1e20,
             torch.zeros(3)]
    params = _params(*grads)
    assert not math.isfinite(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
    exact = float(_flat(params).norm())
    direction = _flat(params) / exact
    norm = clip_grad_norm(params, 1.0)
    assert norm == pytest.approx(exact, rel=1e-6)
    assert float(_flat(params).norm()) == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(_flat(params), direction, rtol=1e-5, atol=1e-12)


def test_the_overflow_free_norm_agrees_with_float64_and_is_zero_for_zero_gradients():
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(10, 4, generator=gen) * 3e37, torch.randn(2, generator=gen) * 1e-30]
    exact = float(torch.cat([g.double().flatten() for g in grads]).norm())
    assert float(global_norm(grads)) == pytest.approx(exact, rel=1e-6)
    assert float(global_norm([torch.zeros(4), torch.zeros(2, 2)])) == 0.0
    assert global_norm([torch.ones(2, dtype=torch.float64)]).dtype == torch.float64


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_entry_gives_a_non_finite_norm_and_scales_nothing(bad):
    g = torch.ones(4, 4)
    g[1, 2] = bad
    params = _params(g, torch.full((3,), 1e20))
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, 1.0)
    assert not math.isfinite(norm)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)


def test_no_gradient_is_a_zero_norm():
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(3))], 1.0) == 0.0
