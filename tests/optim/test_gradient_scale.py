"""The constrained steepest direction does not depend on the scale of the gradient.

``G`` is normalized by its Frobenius norm before the dual solve. Computed naively in float32 that
norm overflows for entries above about 1e18 (the direction came out zero: no step, reported as a
converged solve) and underflows for entries below about 1e-20 (a tiny, non-tangent direction).
Scaling by a power of two is exact, so a gradient times ``2^k`` must give the very same step.
"""

from __future__ import annotations

import pytest
import torch

from manifoldlib.optim import ManifoldMuon, steepest_direction

SCALES = [2.0**70, 2.0**-80]  # entries ~1e21 (the squares overflow) and ~1e-24 (they underflow)


def _matrices(shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("spectral", ["eigh", "products"])
def test_a_step_is_the_same_for_a_gradient_scaled_by_a_power_of_two(manifold, scale, spectral):
    w0, g = _matrices((48, 12))
    steps, mates = [], []
    for factor in (1.0, scale):
        w = torch.nn.Parameter(w0.clone())
        other = torch.nn.Parameter(torch.randn(48, 12, generator=torch.Generator().manual_seed(5)))
        # a bank of two matrices: the scaled gradient shares its solve with an unscaled one
        opt = ManifoldMuon([w, other], manifold=manifold, lr=0.1, weight_decay=0.0, dual={"spectral": spectral})
        start, other_start = w.detach().clone(), other.detach().clone()
        w.grad, other.grad = g * factor, g.flip(0)
        opt.step()
        steps.append(w.detach() - start)
        mates.append(other.detach() - other_start)
        assert int(opt.state[w]["dual_iterations"]) > 0  # a real solve, not the zero-gradient shortcut
        assert int(opt.state[w]["skipped_steps"]) == 0
    assert float(torch.linalg.matrix_norm(steps[0], ord=2)) > 0.05
    assert torch.equal(steps[1], steps[0])
    assert torch.equal(mates[1], mates[0])  # and its bank-mate's step does not see the scale


@pytest.mark.parametrize("scale", SCALES)
def test_steepest_direction_is_scale_invariant_in_float32(scale):
    w, g = _matrices((32, 8), seed=1)
    w = torch.linalg.qr(w).Q
    reference = steepest_direction(w, g, "stiefel", msign_method="jordan5")
    scaled = steepest_direction(w, g * scale, "stiefel", msign_method="jordan5")
    torch.testing.assert_close(scaled, reference, rtol=0, atol=1e-6)


def test_euclidean_direction_of_a_huge_gradient_is_finite():
    _, g = _matrices((32, 8), seed=2)
    reference = steepest_direction(None, g, "euclidean", msign_method="jordan5")
    huge = steepest_direction(None, g * 2.0**70, "euclidean", msign_method="jordan5")
    assert bool(torch.isfinite(huge).all())
    torch.testing.assert_close(huge, reference, rtol=0, atol=1e-5)


def test_a_float32_dgram_matrix_with_large_columns_takes_a_step():
    """Its alternating retraction takes msign of ``Y diag(‖y_j‖)`` (entries ~1e20 here), whose Gram
    matrix overflowed float32: the step raised ``torch._C._LinAlgError``."""
    w0, g = _matrices((16, 8), seed=3)
    w = torch.nn.Parameter(w0 * 2.0**32)
    opt = ManifoldMuon([w], manifold="dgram", lr=0.1, weight_decay=0.0)
    for _ in range(2):
        w.grad = g.clone()
        opt.step()
    gram = w.detach().double().T @ w.detach().double()
    d = gram.diagonal().sqrt()
    off = gram / (d[:, None] * d[None, :]) - torch.eye(8, dtype=torch.float64)
    assert bool(torch.isfinite(w).all())
    assert float(off.abs().max()) < 1e-5


@pytest.mark.parametrize("scale", [2.0**40, 2.0**-40, 2.0**66, 2.0**-80])
@pytest.mark.parametrize("spectral", ["eigh", "products"])
def test_a_dgram_point_scaled_by_a_power_of_two_takes_the_scaled_steps(scale, spectral):
    """DGram has a scale freedom: ``sW`` has the tangent space and steepest direction of ``W``, and
    ``R_{sW}(sV) = s R_W(V)``. A float32 point whose entries lie far from 1 (here 2^±40 and beyond:
    column norms ~1e12 or ~1e-12) used to be skipped every step, counted but never moved, because
    the fourth powers of its column norms over- or underflow the retraction's Gram products."""
    w0, g = _matrices((48, 12), seed=3)
    w0 = w0 * torch.logspace(-1, 1, 12)  # columns graded over two decades
    runs = []
    for factor in (1.0, scale):
        w = torch.nn.Parameter(w0.clone())
        opt = ManifoldMuon([w], manifold="dgram", lr=0.05 * factor, weight_decay=0.0, dual={"spectral": spectral})
        if factor == 1.0:  # the projected point, its largest entry brought into [1/2, 1) exactly
            top = w.detach().abs().amax()
            w.data.mul_(2.0 ** -float(torch.frexp(top)[1]))
            base = w.detach().clone()
        else:
            w.data.copy_(base * factor)  # exact: a power of two
        trace = []
        for k in range(3):
            w.grad = g.roll(k, 0)
            opt.step()
            trace.append((w.detach().clone(), opt.state[w]["dual_correction"].clone()))
        assert int(opt.state[w]["skipped_steps"]) == 0
        runs.append(trace)
    (w1, lam1), (ws, lams) = runs[0][0], runs[1][0]
    assert float(torch.linalg.matrix_norm(w1 - base, ord=2)) > 0.02  # a real step
    assert torch.equal(ws, w1 * scale)  # the first step: bit for bit the scaled one
    assert torch.equal(lams, lam1 / scale)  # its multipliers (the warm start) in the point's units
    for (w1, _), (ws, _) in zip(runs[0][1:], runs[1][1:]):  # later steps, from points not scaled into [1/2, 1)
        torch.testing.assert_close(ws / scale, w1, rtol=1e-5, atol=1e-6)
