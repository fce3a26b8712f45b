"""The dual solvers reach the optimum of max <G, A> s.t. ||A||_2 <= 1, A tangent.

The optimal value is computed independently: the Lagrangian dual min_S ||G + W S||_* over
symmetric S (zero diagonal for DGram), minimized with scipy's L-BFGS on the upper triangle,
using numpy's SVD (no manifoldlib code).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import torch

from manifoldlib.functional import msign
from manifoldlib.optim import steepest_direction, tangent_residual
from manifoldlib.optim.steepest import gram_msign_factor


def _instance(m, n, manifold, seed, dtype=torch.float64, lowrank=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    if manifold == "dgram":
        w = w * torch.exp(0.5 * torch.randn(n, generator=g, dtype=torch.float64))
    if lowrank:
        u = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
        grad = (u * torch.exp(-torch.arange(n, dtype=torch.float64) / (n / 4))) @ v.T
    else:
        grad = torch.randn(m, n, generator=g, dtype=torch.float64)
    return w.to(dtype), grad.to(dtype)


def _dual_optimum(w: np.ndarray, g: np.ndarray, zero_diag: bool) -> float:
    """min over symmetric S (zero diagonal if asked) of the nuclear norm of G + W S."""
    n = w.shape[1]
    iu = np.triu_indices(n, k=1 if zero_diag else 0)

    def unpack(z):
        s = np.zeros((n, n))
        s[iu] = z
        return s + np.triu(s, 1).T

    def fun(z):
        s = unpack(z)
        u, sig, vt = np.linalg.svd(g + w @ s, full_matrices=False)
        grad_full = w.T @ (u @ vt)  # d||X||_* / dS before symmetrization
        sym = grad_full + grad_full.T
        if not zero_diag:
            sym[np.diag_indices(n)] /= 2.0
        return sig.sum(), sym[iu]

    wg = w.T @ g
    d2 = (w * w).sum(0)
    s0 = -(wg + wg.T) / (d2[:, None] + d2[None, :])  # the projected-gradient start
    best = scipy.optimize.minimize(fun, s0[iu], jac=True, method="L-BFGS-B", options={"maxiter": 5000, "gtol": 1e-12, "ftol": 1e-15})
    return float(best.fun)


CASES = [
    ("stiefel", 12, 4),
    ("stiefel", 16, 7),
    ("stiefel", 6, 6),
    ("dgram", 12, 4),
    ("dgram", 16, 6),
]


@pytest.mark.parametrize("manifold,m,n", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_reaches_the_independent_optimum(manifold, m, n, seed):
    w, g = _instance(m, n, manifold, seed)
    a, info = steepest_direction(w, g, manifold, tol=1e-8, max_iter=2000, return_info=True)
    optimum = _dual_optimum(w.numpy(), g.numpy(), zero_diag=manifold == "dgram")
    value = float((g * a).sum())
    assert abs(value - optimum) <= 1e-3 * optimum
    assert float(torch.linalg.matrix_norm(a, ord=2)) <= 1 + 1e-4
    assert float(tangent_residual(w, a, manifold)) <= 1e-3
    assert info.converged


@pytest.mark.parametrize("manifold,m,n", CASES)
def test_weak_duality_certificate(manifold, m, n):
    # For the returned multiplier, ||G + 2 W Lambda||_* bounds the optimum from above and
    # <G, A_f> of a strictly feasible A_f (A projected on the tangent space, rescaled to spectral
    # norm <= 1) from below: the gap certifies optimality.
    from manifoldlib.functional import dgram_project_tangent, stiefel_project_tangent

    w, g = _instance(m, n, manifold, seed=5)
    a, info = steepest_direction(w, g, manifold, tol=1e-9, max_iter=3000, return_info=True)
    gn = g / g.norm()
    project = stiefel_project_tangent if manifold == "stiefel" else dgram_project_tangent
    feasible = project(w, a)
    feasible = feasible / max(1.0, float(torch.linalg.matrix_norm(feasible, ord=2)))
    upper = float(torch.linalg.matrix_norm(gn + 2 * w @ info.multiplier, ord="nuc"))
    lower = float((gn * feasible).sum())
    assert lower <= upper + 1e-12
    assert upper - lower <= 1e-6 * upper


def test_square_stiefel_is_solved_by_the_closed_form_start():
    w, g = _instance(9, 9, "stiefel", seed=3)
    a, info = steepest_direction(w, g, "stiefel", tol=1e-10, return_info=True)
    assert info.iterations == 0
    assert float(tangent_residual(w, a, "stiefel")) <= 1e-12


def test_euclidean_is_msign():
    _, g = _instance(10, 4, "stiefel", seed=2)
    torch.testing.assert_close(steepest_direction(None, g, "euclidean"), msign(g, "svd"), rtol=0, atol=1e-12)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_wide_input_is_solved_transposed(manifold):
    w, g = _instance(14, 5, manifold, seed=4)
    tall = steepest_direction(w, g, manifold, tol=1e-9, max_iter=2000)
    wide = steepest_direction(w.T, g.T, manifold, tol=1e-9, max_iter=2000)
    torch.testing.assert_close(wide, tall.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_scale_invariance(manifold):
    w, g = _instance(12, 4, manifold, seed=6)
    a1 = steepest_direction(w, g, manifold, tol=1e-9, max_iter=2000)
    a2 = steepest_direction(w, 1e3 * g, manifold, tol=1e-9, max_iter=2000)
    torch.testing.assert_close(a1, a2, rtol=0, atol=1e-8)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_warm_start_from_the_solution_needs_no_iterations(manifold):
    w, g = _instance(16, 6, manifold, seed=7, lowrank=True)
    _, cold = steepest_direction(w, g, manifold, tol=1e-6, max_iter=2000, return_info=True)
    assert cold.iterations > 0
    _, warm = steepest_direction(w, g, manifold, tol=1e-6, multiplier=cold.multiplier, return_info=True)
    _, corr = steepest_direction(w, g, manifold, tol=1e-6, correction=cold.correction, return_info=True)
    assert warm.iterations == 0 and corr.iterations == 0


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize("method", ["polar-express", "jordan5"])
def test_newton_schulz_presets_float32(manifold, method):
    # float32 tier: the Gram-form presets drive the tangent residual of their own (inexact)
    # polar factor below the tolerance, and the value is close to the exact optimum.
    w, g = _instance(48, 12, manifold, seed=8)
    exact = steepest_direction(w, g, manifold, tol=1e-8, max_iter=2000)
    a, info = steepest_direction(
        w.float(), g.float(), manifold, tol=1e-3, max_iter=200, msign_method=method, return_info=True
    )
    assert a.dtype == torch.float32
    assert info.converged
    assert float(tangent_residual(w, a.double(), manifold)) <= 1.5e-3
    ratio = float((g * a.double()).sum() / (g * exact).sum())
    bound = 1.25 if method == "jordan5" else 1.02  # jordan5 singular values end in ~[0.7, 1.2]
    assert 0.9 <= ratio <= bound


def test_gram_form_equals_newton_schulz_on_the_matrix():
    from manifoldlib.functional import newton_schulz
    from manifoldlib.functional.msign import JORDAN5_COEFFICIENTS

    g = torch.Generator().manual_seed(9)
    x = torch.randn(30, 8, generator=g, dtype=torch.float64)
    r = gram_msign_factor(x.mT @ x, "jordan5", 5)
    torch.testing.assert_close(x @ r, newton_schulz(x, JORDAN5_COEFFICIENTS, 5), rtol=0, atol=1e-10)


def test_patience_stops_a_stalled_solve_and_keeps_the_best_iterate():
    # square DGram: the dual optimum is rank deficient, the residual stalls well above 1e-8
    w, g = _instance(8, 8, "dgram", seed=1)
    _, full = steepest_direction(w, g, "dgram", tol=1e-8, max_iter=60, return_info=True)
    _, short = steepest_direction(w, g, "dgram", tol=1e-8, max_iter=60, patience=3, return_info=True)
    assert full.iterations == 60 and not full.converged
    assert short.iterations < 60
    assert short.residual == min(short.history)
    assert full.residual == min(full.history)


def test_step_size_warm_start_is_returned_and_accepted():
    w, g = _instance(24, 6, "stiefel", seed=11, lowrank=True)
    _, first = steepest_direction(w, g, "stiefel", tol=1e-6, max_iter=500, return_info=True)
    assert first.step_size is not None and first.step_size > 0
    a, second = steepest_direction(w, g, "stiefel", tol=1e-6, max_iter=500, step_size=first.step_size,
                                   return_info=True)
    assert second.converged
    assert float(tangent_residual(w, a, "stiefel")) <= 1e-6


def test_zero_gradient_gives_zero_direction():
    w, _ = _instance(8, 3, "stiefel", seed=0)
    a = steepest_direction(w, torch.zeros_like(w), "stiefel")
    assert torch.equal(a, torch.zeros_like(w))
    assert torch.isfinite(a).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"manifold": "sphere"}, "unknown manifold 'sphere'"),
        ({"tol": 0.0}, "tol must be > 0"),
        ({"max_iter": -1}, "max_iter must be"),
        ({"msign_method": "qr"}, "unknown msign_method 'qr'"),
        ({"multiplier": torch.zeros(2, 2, dtype=torch.float64)}, r"multiplier must have shape \(3, 3\)"),
        ({"patience": 0}, "patience must be None or an int >= 1, got 0"),
    ],
)
def test_bad_input(kwargs, match):
    w, g = _instance(8, 3, "stiefel", seed=0)
    with pytest.raises(ValueError, match=match):
        steepest_direction(w, g, **kwargs)


def test_shape_mismatch():
    w, g = _instance(8, 3, "stiefel", seed=0)
    with pytest.raises(ValueError, match="same shape"):
        steepest_direction(w, g[:, :2], "stiefel")
