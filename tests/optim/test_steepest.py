"""The dual solvers reach the optimum of max <G, A> s.t. ||A||_2 <= 1, A tangent.

The optimal value is computed independently: the Lagrangian dual min_S ||G + W S||_* over
symmetric S (zero diagonal for DGram), minimized with scipy's L-BFGS on the upper triangle,
using numpy's SVD (no manifoldlib code).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.optimize
import torch

from manifoldlib.functional import msign
from manifoldlib.functional.msign import NEWTON_SCHULZ_PRESETS
from manifoldlib.optim import steepest_direction, tangent_residual
from manifoldlib.optim.steepest import gram_msign_factor
from manifoldlib.testing import nuclear_dual_optimum


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
    """min over symmetric S (zero diagonal if asked) of the nuclear norm of G + W S (scipy L-BFGS)."""
    return nuclear_dual_optimum(torch.from_numpy(w), torch.from_numpy(g), zero_diagonal=zero_diag)


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
    _, full = steepest_direction(w, g, "dgram", tol=1e-8, max_iter=60, smoothing=None, return_info=True)
    _, short = steepest_direction(w, g, "dgram", tol=1e-8, max_iter=60, patience=3, smoothing=None,
                                  return_info=True)
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


def test_a_point_that_is_not_on_stiefel_is_refused():
    # columns scaled like a DGram point: the dual would run its cap and return garbage silently
    w, g = _instance(8, 3, "dgram", seed=0)
    with pytest.raises(ValueError, match=r"not a Stiefel point: column \d \(tall orientation\) has norm"):
        steepest_direction(w, g, "stiefel")
    with pytest.raises(ValueError, match="not a Stiefel point"):
        steepest_direction(w.mT, g.mT, "stiefel")  # wide: checked in the tall orientation
    nan = w.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not a Stiefel point"):
        steepest_direction(nan, g, "stiefel")
    near = torch.linalg.qr(w)[0] * 1.05  # within the sanity tolerance: accepted
    assert torch.isfinite(steepest_direction(near, g, "stiefel")).all()


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "euclidean"])
@pytest.mark.parametrize("which", ["W", "G"])
def test_integer_or_complex_inputs_are_refused_by_name(manifold, which):
    """They failed with torch's RuntimeError from linalg.vector_norm."""
    w, g = _instance(8, 3, "stiefel", seed=0)
    if manifold == "euclidean" and which == "W":
        w = w.to(torch.int64)  # ignored on Euclidean: nothing to refuse
        assert steepest_direction(w, g, manifold).dtype == g.dtype
        return
    for dtype in (torch.int64, torch.complex128):
        args = {"W": w, "G": g}
        args[which] = args[which].to(dtype)
        with pytest.raises(ValueError, match=rf"{which} must be a real floating-point tensor .*got dtype "
                                             rf"{dtype}"):
            steepest_direction(args["W"], args["G"], manifold)


def test_shape_mismatch():
    w, g = _instance(8, 3, "stiefel", seed=0)
    with pytest.raises(ValueError, match="same shape"):
        steepest_direction(w, g[:, :2], "stiefel")


def _smoothed_dual_upper_bound(w: np.ndarray, g: np.ndarray) -> float:
    """An upper bound on the optimum (weak duality): ||G + W S||_* at an S found by L-BFGS on the
    smoothed nuclear norm sum sqrt(sigma^2 + eps^2), eps -> 0 (numpy and scipy only)."""
    n = w.shape[1]
    iu = np.triu_indices(n, k=1)

    def unpack(z):
        s = np.zeros((n, n))
        s[iu] = z
        return s + s.T

    def fun(z, eps):
        u, sig, vt = np.linalg.svd(g + w @ unpack(z), full_matrices=False)
        root = np.sqrt(sig**2 + eps**2)
        grad_full = w.T @ ((u * (sig / root)) @ vt)
        return root.sum(), (grad_full + grad_full.T)[iu]

    wg = w.T @ g
    d2 = (w * w).sum(0)
    z = (-(wg + wg.T) / (d2[:, None] + d2[None, :]))[iu]
    for eps in (1e-2, 1e-3, 1e-4):
        z = scipy.optimize.minimize(fun, z, args=(eps,), jac=True, method="L-BFGS-B",
                                    options={"maxiter": 3000, "gtol": 1e-10, "ftol": 1e-13}).x
    return float(np.linalg.svd(g + w @ unpack(z), compute_uv=False).sum())


@pytest.mark.parametrize("n", [5, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_square_dgram_reaches_the_optimum_with_smoothing(n, seed):
    # The plain dual of square DGram stalls (rank-deficient optimum); the smoothed dual's answer is
    # tangent, inside the unit ball, and its value is certified against an independent upper bound.
    from manifoldlib.functional import dgram_project_tangent

    w, g = _instance(n, n, "dgram", seed)
    gn = g / g.norm()
    a, info = steepest_direction(w, g, "dgram", tol=1e-4, max_iter=200, return_info=True)
    assert info.converged
    assert float(tangent_residual(w, a, "dgram")) <= 1e-3
    assert float(torch.linalg.matrix_norm(a, ord=2)) <= 1 + 1e-4
    upper = _smoothed_dual_upper_bound(w.numpy(), gn.numpy())
    feasible = dgram_project_tangent(w, a)
    feasible = feasible / max(1.0, float(torch.linalg.matrix_norm(feasible, ord=2)))
    lower = float((gn * feasible).sum())  # <G, A_f> of an exactly feasible A_f
    assert lower <= upper + 1e-9
    assert upper - lower <= 1e-3 * upper
    assert abs(float((gn * a).sum()) - lower) <= 1e-3 * upper


def test_square_dgram_plain_dual_stalls_where_the_smoothed_one_converges():
    w, g = _instance(8, 8, "dgram", seed=2)
    _, plain = steepest_direction(w, g, "dgram", tol=1e-3, max_iter=100, smoothing=None, return_info=True)
    _, smooth = steepest_direction(w, g, "dgram", tol=1e-3, max_iter=100, return_info=True)
    assert not plain.converged
    assert smooth.converged and smooth.residual <= 1e-3


@pytest.mark.parametrize("method", ["jordan5", "polar-express", "newton-schulz"])
def test_eigen_gram_factor_equals_the_matrix_form(method):
    # one eigendecomposition applies the preset's scalar polynomial exactly: same R as the
    # Newton-Schulz iteration written on the Gram matrix (float64), and ||XR||_F^2 matches.
    from manifoldlib.optim.steepest import gram_msign_factor_eigh

    g = torch.Generator().manual_seed(12)
    x = torch.randn(40, 10, generator=g, dtype=torch.float64)
    s = x.mT @ x
    r_eig, norm_sq = gram_msign_factor_eigh(s, method)
    r_ns = gram_msign_factor(s, method)
    torch.testing.assert_close(x @ r_eig, x @ r_ns, rtol=0, atol=1e-10)
    torch.testing.assert_close(norm_sq, (x @ r_ns).square().sum(), rtol=1e-10, atol=0)
    # rank deficient (a zero singular value): the gain has no 1/sigma, everything stays finite
    x[:, -1] = x[:, 0]
    r_deg, norm_deg = gram_msign_factor_eigh(x.mT @ x, method)
    assert torch.isfinite(r_deg).all() and torch.isfinite(norm_deg)
    # In the null direction both forms see only rounding (about eps of the normalized X), which
    # the preset's polynomial amplifies by its slope at 0, the product of its steps' a: 1.875^30
    # ~ 1.6e8 for the convergent quintic. The two forms may differ by a few times that.
    preset = NEWTON_SCHULZ_PRESETS[method]
    null_gain = math.prod(preset.schedule[min(k, len(preset.schedule) - 1)][0] for k in range(preset.steps))
    null_atol = max(1e-8, 4 * null_gain * torch.finfo(torch.float64).eps)
    torch.testing.assert_close(
        x @ r_deg, x @ gram_msign_factor(x.mT @ x, method), rtol=0, atol=null_atol
    )


def test_smoothed_factor_is_the_smoothed_nuclear_norm_gradient():
    from manifoldlib.optim.steepest import gram_msign_factor_eigh

    g = torch.Generator().manual_seed(13)
    x = torch.randn(9, 5, generator=g, dtype=torch.float64)
    mu = 0.3
    r, _ = gram_msign_factor_eigh(x.mT @ x, "jordan5", smoothing=mu)
    u, sv, vh = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(x @ r, (u * (sv / (sv**2 + mu**2).sqrt())) @ vh, rtol=0, atol=1e-12)


@pytest.mark.parametrize("manifold,m,n", [("dgram", 7, 7), ("dgram", 11, 5), ("stiefel", 11, 5)])
def test_smoothed_dual_hessian_matches_finite_differences(manifold, m, n):
    from manifoldlib.optim.dual_problem import _DualProblem

    w, g = _instance(m, n, manifold, seed=14)
    g = g / g.norm()
    problem = _DualProblem(w, g, manifold, "jordan5", None, None, 1e-7, smoothing=0.05)
    gen = torch.Generator().manual_seed(15)
    noise = torch.randn(n, n, generator=gen, dtype=torch.float64)
    lam = problem.initial_multiplier() + problem.mask(0.01 * (noise + noise.mT))
    delta = torch.randn(n, n, generator=gen, dtype=torch.float64)
    delta = problem.mask(delta + delta.mT)
    h, _, state = problem.evaluate(lam)
    step = 1e-6
    h_plus, _, s_plus = problem.evaluate(lam + step * delta)
    h_minus, _, s_minus = problem.evaluate(lam - step * delta)
    hv = problem.hessian_vector(state, delta)
    fd = (h_plus - h_minus) / (2 * step)
    assert float((hv - fd).norm()) <= 1e-6 * float(fd.norm())
    # and H is the gradient of the smoothed dual value
    slope = (s_plus.value - s_minus.value) / (2 * step)
    assert abs(slope - float((h * delta).sum())) <= 1e-6 * max(1.0, abs(slope))


def test_square_dgram_float32_converges():
    w, g = _instance(24, 24, "dgram", seed=16, dtype=torch.float32)
    a, info = steepest_direction(w, g, "dgram", tol=1e-3, max_iter=100, msign_method="jordan5", return_info=True)
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
    assert info.converged
    assert float(tangent_residual(w.double(), a.double(), "dgram")) <= 1.5e-3
    assert float(torch.linalg.matrix_norm(a.double(), ord=2)) <= 1 + 1e-4


@pytest.mark.parametrize("bad", [0.0, -1.0, "yes", True])
def test_bad_smoothing(bad):
    w, g = _instance(8, 3, "stiefel", seed=0)
    with pytest.raises(ValueError, match="smoothing must be 'auto', None or a float > 0"):
        steepest_direction(w, g, smoothing=bad)


def test_explicit_smoothing_on_tall_stiefel_is_tangent_and_inside_the_ball():
    w, g = _instance(20, 6, "stiefel", seed=17)
    a, info = steepest_direction(w, g, "stiefel", tol=1e-6, max_iter=100, smoothing=0.05, return_info=True)
    assert info.converged
    assert float(tangent_residual(w, a, "stiefel")) <= 1e-6
    assert float(torch.linalg.matrix_norm(a, ord=2)) < 1.0
