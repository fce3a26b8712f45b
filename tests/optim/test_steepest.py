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
from manifoldlib.optim.dual import DualProblem, Spectral
from manifoldlib.optim.execution import Execution
from manifoldlib.optim.steepest import matrix_manifold
from manifoldlib.testing import hard_instance, nearly_normal_instance, nuclear_dual_optimum


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


_OPTIMA: dict = {}


def scipy_optimum(w: torch.Tensor, g: torch.Tensor, *, zero_diagonal: bool = False, diagonal: bool = False) -> float:
    """:func:`~manifoldlib.testing.nuclear_dual_optimum`, once per instance: the tests parametrized
    over solver options (spectral path, msign) share it, and it is most of their time."""
    key = (tuple(w.shape), w.double().numpy().tobytes(), g.double().numpy().tobytes(), zero_diagonal, diagonal)
    if key not in _OPTIMA:
        _OPTIMA[key] = nuclear_dual_optimum(w, g, zero_diagonal=zero_diagonal, diagonal=diagonal)
    return _OPTIMA[key]


def _dual_optimum(w: np.ndarray, g: np.ndarray, zero_diag: bool) -> float:
    """min over symmetric S (zero diagonal if asked) of the nuclear norm of G + W S (scipy L-BFGS)."""
    return scipy_optimum(torch.from_numpy(w), torch.from_numpy(g), zero_diagonal=zero_diag)


CASES = [
    ("stiefel", 12, 4),
    ("stiefel", 16, 7),
    ("stiefel", 6, 6),
    ("dgram", 12, 4),
    ("dgram", 16, 6),
]


@pytest.mark.parametrize("manifold,m,n", CASES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spectral", ["eigh", "products"])
def test_reaches_the_independent_optimum(manifold, m, n, seed, spectral):
    w, g = _instance(m, n, manifold, seed)
    a, info = steepest_direction(w, g, manifold, tol=1e-8, max_iter=2000, spectral=spectral, return_info=True)
    optimum = _dual_optimum(w.numpy(), g.numpy(), zero_diag=manifold == "dgram")
    value = float((g * a).sum())
    assert abs(value - optimum) <= 1e-3 * optimum
    assert float(torch.linalg.matrix_norm(a, ord=2)) <= 1 + 1e-4
    assert float(tangent_residual(w, a, manifold)) <= 1e-3
    assert info.converged


@pytest.mark.parametrize("manifold,m,n", CASES)
@pytest.mark.parametrize("spectral", ["eigh", "products"])
def test_weak_duality_certificate(manifold, m, n, spectral):
    # For the returned multiplier, ||G + 2 W Lambda||_* bounds the optimum from above and
    # <G, A_f> of a strictly feasible A_f (A projected on the tangent space, rescaled to spectral
    # norm <= 1) from below: the gap certifies optimality.
    from manifoldlib.functional import dgram_project_tangent, stiefel_project_tangent

    w, g = _instance(m, n, manifold, seed=5)
    a, info = steepest_direction(w, g, manifold, tol=1e-9, max_iter=3000, spectral=spectral, return_info=True)
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


def test_patience_stops_a_stalled_solve_and_keeps_the_best_iterate():
    # square DGram: the dual optimum is rank deficient, the residual stalls well above 1e-8
    w, g = _instance(8, 8, "dgram", seed=1)
    _, full = steepest_direction(w, g, "dgram", tol=1e-8, max_iter=60, patience=None, smoothing=None,
                                 return_info=True)
    _, short = steepest_direction(w, g, "dgram", tol=1e-8, max_iter=60, patience=3, smoothing=None,
                                  return_info=True)
    assert full.iterations == 60 and not full.converged
    assert short.iterations < 60
    assert short.residual == min(short.history)
    assert full.residual == min(full.history)


def test_a_stalled_exact_iteration_hands_over_to_the_smoothed_dual_at_the_default_patience():
    # tall low rank: the exact map's plain iteration climbs to a residual near 1 and stays there
    # (where it wanders depends on rounding: 57 plain iterations on one thread, 87 on two); without
    # patience it wanders on until the budget or its own stall, with the default (6) it hands over
    # after a few and ends at the same certified answer
    w, g = hard_instance("stiefel", 512, 128, 8, 0.1, seed=0, dtype=torch.float32)
    a_slow, slow = steepest_direction(w, g, "stiefel", patience=None, return_info=True)
    a, info = steepest_direction(w, g, "stiefel", return_info=True)
    assert slow.stages == info.stages == ("bb", "smoothed")
    assert len(info.history) <= 12 and len(slow.history) >= 3 * len(info.history), (slow.history, info.history)
    assert 2 * info.iterations < slow.iterations
    assert info.converged and info.gap <= 1e-3 and info.residual <= 1e-4
    w64, g64 = w.double(), g.double() / g.double().norm()
    upper = float(torch.linalg.matrix_norm(g64 + 2.0 * w64 @ info.multiplier.double(), "nuc"))  # weak duality
    value = float((g64 * a.double()).sum())
    assert value >= (1 - 1e-3) * upper and float(torch.linalg.matrix_norm(a.double(), ord=2)) <= 1 + 1e-5
    assert abs(value - float((g64 * a_slow.double()).sum())) <= 1e-5 * upper


def test_zero_gradient_gives_zero_direction():
    w, _ = _instance(8, 3, "stiefel", seed=0)
    a = steepest_direction(w, torch.zeros_like(w), "stiefel")
    assert torch.equal(a, torch.zeros_like(w))
    assert torch.isfinite(a).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"manifold": "sphere"}, "unknown manifold 'sphere'"),
        ({"tol": 0.0}, "tol must be a finite number > 0, got 0.0"),
        ({"max_iter": -1}, "max_iter must be None or an int >= 0, got -1"),
        ({"msign_method": "qr"}, "msign_method must be one of ns, jordan5, polar-express, newton-schulz, svd, got 'qr'"),
        ({"msign_method": "ns"}, "msign_method='ns' is the optimizer's group Newton-Schulz"),
        ({"multiplier": torch.zeros(2, 2, dtype=torch.float64)}, r"multiplier must have shape \(3, 3\), got \(2, 2\)"),
        ({"correction": torch.zeros(4, 4, dtype=torch.float64)}, r"correction must have shape \(3, 3\), got \(4, 4\)"),
        ({"multiplier": torch.zeros(3, 3, dtype=torch.float64), "correction": torch.zeros(3, 3, dtype=torch.float64)},
         "at most one of multiplier and correction"),
        ({"patience": 0}, "patience must be None or an int >= 1, got 0"),
        ({"gap_tol": 0.0}, "gap_tol must be None or a finite number > 0, got 0.0"),
        ({"sync_free": 1}, "sync_free must be None, True or False, got 1"),
    ],
)
def test_bad_input(kwargs, match):
    w, g = _instance(8, 3, "stiefel", seed=0)
    with pytest.raises(ValueError, match=match):
        steepest_direction(w, g, **kwargs)


@pytest.mark.parametrize("name", ["dual_update", "step_size", "execution"])
def test_unknown_option_names_are_refused_with_the_valid_ones(name):
    # the old keywords (dual_update=, step_size=, execution=) must not be silently ignored
    w, g = _instance(8, 3, "stiefel", seed=0)
    with pytest.raises(TypeError, match=rf"unknown dual option\(s\) \['{name}'\]; valid: gap_tol, max_iter"):
        steepest_direction(w, g, **{name: None})


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
        with pytest.raises(ValueError, match=rf"{which} must be a real floating-point tensor \(float16, "
                                             rf"bfloat16, float32, float64\), got {dtype}"):
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


def _problem(w, g, manifold, smoothing=None, method="jordan5"):
    """The reduced dual of one matrix on the eigh path, a bank of one (``smoothing``: absolute mu)."""
    return DualProblem(w.unsqueeze(0), (g / g.norm()).unsqueeze(0), matrix_manifold(manifold),
                       Spectral(method, path="eigh"), Execution(), smoothing=smoothing, reduced=True)


@pytest.mark.parametrize("manifold,m,n", [("dgram", 7, 7), ("dgram", 11, 5), ("stiefel", 11, 5)])
def test_smoothed_answer_is_the_smoothed_nuclear_norm_gradient(manifold, m, n):
    # A(Lambda) of the smoothed dual is U diag(s / sqrt(s^2 + mu^2)) V^T of X = G + 2 W Lambda
    # (an SVD of the m x n matrix, not the reduced problem's eigh), and its value sum sqrt(s^2 + mu^2)
    w, g = _instance(m, n, manifold, seed=13)
    mu = 0.3
    problem = _problem(w, g, manifold, smoothing=mu)
    noise = torch.randn(n, n, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    lam = problem.initial_multiplier() + problem.mask(0.05 * (noise + noise.mT))
    ev = problem.evaluate(lam)
    x = g / g.norm() + 2.0 * w @ lam[0]
    u, sv, vh = torch.linalg.svd(x, full_matrices=False)
    torch.testing.assert_close(problem.answer(ev)[0], (u * (sv / (sv**2 + mu**2).sqrt())) @ vh, rtol=0, atol=1e-12)
    torch.testing.assert_close(ev.value[0], (sv**2 + mu**2).sqrt().sum(), rtol=1e-13, atol=0)


@pytest.mark.parametrize("manifold,m,n", [("dgram", 7, 7), ("dgram", 11, 5), ("stiefel", 11, 5)])
def test_smoothed_dual_hessian_matches_finite_differences(manifold, m, n):
    w, g = _instance(m, n, manifold, seed=14)
    problem = _problem(w, g, manifold, smoothing=0.05)
    gen = torch.Generator().manual_seed(15)
    noise = torch.randn(n, n, generator=gen, dtype=torch.float64)
    lam = problem.initial_multiplier() + problem.mask(0.01 * (noise + noise.mT))
    delta = torch.randn(n, n, generator=gen, dtype=torch.float64)
    delta = problem.mask(delta + delta.mT).unsqueeze(0)
    ev = problem.evaluate(lam)
    step = 1e-6
    plus, minus = problem.evaluate(lam + step * delta), problem.evaluate(lam - step * delta)
    hv = problem.hessian_vector(ev, delta, {})
    fd = (plus.h - minus.h) / (2 * step)
    assert float((hv - fd).norm()) <= 1e-6 * float(fd.norm())
    # and H is the gradient of the smoothed dual value
    slope = float(plus.value[0] - minus.value[0]) / (2 * step)
    assert abs(slope - float((ev.h * delta).sum())) <= 1e-6 * max(1.0, abs(slope))


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
    with pytest.raises(ValueError, match=r"smoothing must be 'auto', None or a finite number > 0, got "):
        steepest_direction(w, g, smoothing=bad)


def test_explicit_smoothing_on_tall_stiefel_is_tangent_and_inside_the_ball():
    w, g = _instance(20, 6, "stiefel", seed=17)
    a, info = steepest_direction(w, g, "stiefel", tol=1e-6, max_iter=100, smoothing=0.05, return_info=True)
    assert info.converged
    assert float(tangent_residual(w, a, "stiefel")) <= 1e-6
    assert float(torch.linalg.matrix_norm(a, ord=2)) < 1.0


def _normal_fraction(w, a, manifold) -> float:
    """||A - P_W A||_F / ||A||_F in float64 by least squares on the normal space {W S}, S in the
    manifold's multipliers (symmetric; zero diagonal on DGram; diagonal on Oblique)."""
    w, a = w.double(), a.double()
    n = w.size(-1)
    basis = []
    for i in range(n):
        for j in range(i, n):
            if (manifold == "dgram" and i == j) or (manifold == "oblique" and i != j):
                continue
            e = torch.zeros(n, n, dtype=torch.float64)
            e[i, j] = e[j, i] = 1.0
            basis.append((w @ e).flatten())
    normal_space = torch.stack(basis, dim=1)  # (m n, dim)
    coef = torch.linalg.lstsq(normal_space, a.flatten().unsqueeze(1)).solution
    return float((normal_space @ coef).norm() / a.norm())


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("m,n", [(40, 10), (12, 12)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "options",
    [
        {"msign_method": "svd", "smoothing": None, "spectral": "eigh"},  # the unreduced path (or closed form)
        {"msign_method": "svd"},
        {"msign_method": "polar-express", "spectral": "eigh"},
        {"msign_method": "polar-express", "spectral": "products"},
    ],
    ids=["svd-plain", "svd-auto", "pe-eigh", "pe-products"],
)
def test_reported_residual_is_that_of_the_returned_direction(manifold, m, n, dtype, options):
    # G = W S + 1e-4 tangent noise: the tangent part is 1e-4 of G, so any residual taken from
    # W^T G - B^T B or from a reduced problem that assumes W exactly on its manifold would be off
    # by orders of magnitude; the reported residual must be the returned A's own
    w, g = nearly_normal_instance(manifold, m, n, 1e-4, seed=21)
    w, g = w.to(dtype), g.to(dtype)
    a, info = steepest_direction(w, g, manifold, return_info=True, **options)
    assert a.dtype == dtype and bool(torch.isfinite(a).all())
    recomputed = _normal_fraction(w, a, manifold)  # at the point the solve saw (W rounded to dtype)
    floor = 1e-12 if dtype == torch.float64 else 1e-6
    assert abs(info.residual - recomputed) <= 0.05 * recomputed + floor, (info.residual, recomputed)
    assert abs(tangent_residual(w.double(), a.double(), manifold) - recomputed) <= 0.01 * recomputed + floor
    if info.converged:
        assert recomputed <= info.residual * 1.05 + floor and info.residual <= 1e-4
    # exact maps: ||A||_2 <= 1 up to rounding; in float32 the point is off its manifold by ~1e-7,
    # which the 1e-4 tangent fraction amplifies to ~1e-3 in the Gram matrix of G + 2 W Lambda
    slack = 1e-6 if dtype == torch.float64 else 1e-3
    assert float(torch.linalg.matrix_norm(a.double(), ord=2)) <= 1 + slack


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_direction_reports_its_own_rounded_residual(manifold, dtype):
    # the solve runs in float32/float64; the returned A is rounded to G's dtype, which alone puts
    # ~eps_16 of it in the normal space (bfloat16: 5e-4 > tol = 1e-4): the residual and converged
    # must describe that A, not the solve's unrounded one (reported 9e-5, converged, before)
    w, g = hard_instance(manifold, 32, 8, 2, 0.05, seed=1, dtype=dtype)
    a, info = steepest_direction(w, g, manifold, return_info=True)
    assert a.dtype == dtype
    recomputed = _normal_fraction(w.double(), a.double(), manifold)
    assert abs(info.residual - recomputed) <= 0.05 * recomputed, (info.residual, recomputed)
    assert info.converged == (info.residual <= 1e-4)
    if dtype == torch.bfloat16:
        assert not info.converged


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique", "euclidean"])
def test_a_finite_gradient_whose_float32_sum_overflows_is_solved(manifold):
    # entries ~4e37 to 8e37 are finite in float32; their float32 sum is inf, which read as
    # "G has non-finite entries" and refused a finite G. The direction is scale-free in G.
    w, _ = hard_instance("stiefel" if manifold == "euclidean" else manifold, 16, 4, 4, 0.0, seed=2)
    g = torch.rand(16, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 1.0
    a_big = steepest_direction(w.float(), (2.0**125 * g).float(), manifold)
    a = steepest_direction(w.float(), g.float(), manifold)
    torch.testing.assert_close(a_big, a)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("m, n", [(24, 6), (8, 8), (6, 24)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_normal_gradient_gives_the_zero_direction_like_a_zero_one(manifold, m, n, dtype):
    """G = W S (S a multiplier of the manifold: no tangent part) gives A = 0, converged, no gap: every
    tangent A has <G, A> = 0. The solve used to chase the rounding noise: float64 Stiefel 24x6 came back
    converged=False with a relative gap ~1e13 and ||A||_2 = 1.06-1.29 (outside the unit ball)."""
    space = matrix_manifold(manifold)
    tall_w, _ = nearly_normal_instance(manifold, max(m, n), min(m, n), 0.5, seed=4)
    s = torch.randn(min(m, n), min(m, n), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    tall_g = tall_w @ space.multiplier_mask(s + s.mT)
    w, g = (tall_w, tall_g) if m >= n else (tall_w.mT, tall_g.mT)
    a, info = steepest_direction(w.to(dtype), g.to(dtype), manifold, return_info=True)
    assert a.dtype == dtype and torch.equal(a, torch.zeros_like(a))
    assert info.converged and info.gap is None and info.residual == 0.0
    # the multiplier is the closed-form start, the exact one here: a near-normal solve starts from it
    # (its correction is in units of the normalized gradient's tangent part ||P_W G||)
    g_near = g + 1e-6 * g.norm() * torch.randn_like(g)
    _, near = steepest_direction(w, g_near, manifold, return_info=True)
    tall = (lambda t: t) if m >= n else (lambda t: t.mT)
    tangent = space.proju(tall(w), tall(g_near) / g_near.norm()).norm()
    torch.testing.assert_close(info.multiplier.double(), near.multiplier - near.correction * tangent, atol=1e-5, rtol=0)
    assert torch.equal(info.correction, torch.zeros_like(info.correction))


@pytest.mark.parametrize("manifold,m,n", [("dgram", 16, 16), ("oblique", 16, 16), ("dgram", 32, 32), ("oblique", 32, 32)])
@pytest.mark.parametrize("tangent", [1e-6, 1e-2])
def test_the_reported_gap_is_the_answers_gap_for_a_nearly_normal_gradient(manifold, m, n, tangent):
    """``info.gap`` is (||X(Lambda)||_* - <P_W G, A>)/||X(Lambda)||_* of the returned multiplier and
    direction (float64 oracle: an SVD and the manifold's projection). Computed as
    <G, A> = sum(lambda psi) - 2<Lambda, W^T A>, a difference of terms of the size of G, it read
    -0.25 .. -1e8 for a gradient nearly normal to the tangent space (tangent part 1e-5 .. 1e-12 of
    it) while the direction itself was right. (The square problems: the eigh evaluations that
    report a gap.)"""
    w, g = nearly_normal_instance(manifold, m, n, tangent, seed=2)
    a, info = steepest_direction(w, g, manifold, spectral="eigh", return_info=True)
    assert info.gap is not None
    gn = g / g.norm()
    upper = float(torch.linalg.matrix_norm(gn + 2 * w @ info.multiplier, ord="nuc"))
    value = float((matrix_manifold(manifold).proju(w, gn) * a).sum())
    oracle = (upper - value) / upper
    assert abs(info.gap - oracle) <= 1e-6 * max(1.0, 1e-6 / tangent)  # the oracle's own rounding: eps ||G|| / ||P_W G||
    assert -1e-6 <= info.gap <= 1e-2  # a certificate, and a small one: the direction is near the optimum
