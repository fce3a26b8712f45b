"""Default-argument steepest directions on hard (tall, low-rank-gradient) instances.

The reference is independent of the library's solvers: scipy L-BFGS on the unreduced dual
(:func:`manifoldlib.testing.nuclear_dual_optimum`) and, as a second upper bound on the optimum,
the nuclear norm of ``G + 2WΛ`` at the returned multiplier, computed by a full SVD (weak
duality: any multiplier bounds the optimum from above).
"""

from __future__ import annotations

import pytest
import torch
from test_steepest import scipy_optimum  # nuclear_dual_optimum, once per instance

from manifoldlib.optim import steepest_direction, tangent_residual
from manifoldlib.testing import HARD_INSTANCES, hard_instance, nearly_normal_instance


def _upper_bound(w, g, info, manifold) -> float:
    """min(scipy optimum, ||G/||G|| + 2 W Lambda||_* by SVD) * ||G||: an upper bound on the optimum."""
    norm = g.norm()
    x = g / norm + 2.0 * w @ info.multiplier
    own = float(torch.linalg.matrix_norm(x, "nuc")) * float(norm)
    reference = scipy_optimum(w, g, zero_diagonal=manifold == "dgram", diagonal=manifold == "oblique")
    return min(own, reference)


def _assert_optimal(w, g, manifold, a, info):
    upper = _upper_bound(w, g, info, manifold)
    value = float((g * a).sum())
    assert value >= (1 - 1e-3) * upper, (value, upper)
    assert float(torch.linalg.matrix_norm(a, ord=2)) <= 1 + 1e-4
    assert float(tangent_residual(w, a, manifold)) <= 1e-3
    assert info.converged


_SMALL = [c for c in HARD_INSTANCES if c[1] <= 64]
_LARGE = [c for c in HARD_INSTANCES if c[1] > 64]


# spectral="auto" takes one of the two paths (the products below 256 columns on the CPU): both are checked
SPECTRAL = ["eigh", "products"]


@pytest.mark.parametrize("case", _SMALL, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spectral", SPECTRAL)
def test_default_arguments_reach_the_optimum(case, seed, spectral):
    manifold, m, n, rank, noise = case
    w, g = hard_instance(manifold, m, n, rank, noise, seed)
    a, info = steepest_direction(w, g, manifold, spectral=spectral, return_info=True)
    _assert_optimal(w, g, manifold, a, info)


@pytest.mark.parametrize("case", _LARGE, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("method", ["svd", "polar-express"])
@pytest.mark.parametrize("spectral", SPECTRAL)
def test_default_arguments_reach_the_optimum_128x32(case, seed, method, spectral):
    manifold, m, n, rank, noise = case
    w, g = hard_instance(manifold, m, n, rank, noise, seed)
    a, info = steepest_direction(w, g, manifold, msign_method=method, spectral=spectral, return_info=True)
    _assert_optimal(w, g, manifold, a, info)


@pytest.mark.parametrize("spectral", SPECTRAL)
def test_square_dgram_is_certified_within_the_gap(spectral):
    w, g = hard_instance("dgram", 24, 24, 3, 0.1, seed=0)
    a, info = steepest_direction(w, g, "dgram", spectral=spectral, return_info=True)
    assert info.gap is not None and info.gap <= 1e-3
    _assert_optimal(w, g, "dgram", a, info)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
def test_never_reported_converged_outside_the_tolerances(manifold):
    w, g = hard_instance(manifold, 64, 16, 2, 0.05, seed=0)
    _, capped = steepest_direction(w, g, manifold, max_iter=2, return_info=True)
    assert not capped.converged and capped.residual > 1e-4
    # a gap tolerance the smoothing floor rarely reaches (on Stiefel and DGram it does not; the
    # diagonal multipliers of Oblique get there): an answer above it is returned, not claimed converged
    _, strict = steepest_direction(w, g, manifold, msign_method="polar-express", gap_tol=1e-14, return_info=True)
    if strict.gap is not None:
        assert strict.converged == (strict.gap <= 1e-14 and strict.residual <= 1e-4)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spectral", SPECTRAL)
def test_float32_hard_instances_raise_no_linalg_error(manifold, seed, spectral):
    # these instances sent the exact-SVD dual to non-finite iterates (torch _LinAlgError) before
    w, g = hard_instance(manifold, 64, 16, 2, 0.05, seed, dtype=torch.float32)
    a, info = steepest_direction(w, g, manifold, spectral=spectral, return_info=True)
    assert bool(torch.isfinite(a).all())
    if info.converged:
        assert float(tangent_residual(w.double(), a.double(), manifold)) <= 1e-3


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_is_a_clear_error(bad):
    w, g = hard_instance("stiefel", 12, 4, 2, 0.1, seed=0)
    g[3, 1] = bad
    with pytest.raises(ValueError, match="non-finite"):
        steepest_direction(w, g, "stiefel")


def test_hard_instance_rejects_bad_arguments():
    with pytest.raises(ValueError, match="manifold"):
        hard_instance("sphere", 8, 4, 2, 0.1, 0)
    with pytest.raises(ValueError, match="tall"):
        hard_instance("stiefel", 4, 8, 2, 0.1, 0)
    with pytest.raises(ValueError, match="rank"):
        hard_instance("stiefel", 8, 4, 5, 0.1, 0)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
@pytest.mark.parametrize("m,n", [(40, 10), (12, 12)])
def test_nearly_normal_instance_has_the_asked_tangent_fraction(manifold, m, n):
    w, g = nearly_normal_instance(manifold, m, n, 1e-3, seed=3)
    assert w.shape == g.shape == (m, n) and w.dtype == g.dtype == torch.float64
    gram = w.mT @ w
    if manifold == "stiefel":
        assert torch.allclose(gram, torch.eye(n, dtype=torch.float64), atol=1e-12)
    elif manifold == "dgram":
        assert float((gram - torch.diag(gram.diagonal())).abs().max()) <= 1e-12
    else:
        assert torch.allclose(gram.diagonal(), torch.ones(n, dtype=torch.float64), atol=1e-12)
    fraction = float(tangent_residual(w, g, manifold))  # the normal part of G, relative
    assert abs((1 - fraction**2) ** 0.5 - 1e-3 / (1 + 1e-6) ** 0.5) <= 1e-11  # tangent = 1e-3 x normal
    again = nearly_normal_instance(manifold, m, n, 1e-3, seed=3, dtype=torch.float32)
    assert again[1].dtype == torch.float32 and torch.equal(again[1], g.float())


def test_nearly_normal_instance_rejects_bad_arguments():
    with pytest.raises(ValueError, match="tangent"):
        nearly_normal_instance("stiefel", 8, 4, 0.0, 0)
    with pytest.raises(ValueError, match="tangent"):
        nearly_normal_instance("stiefel", 8, 4, 1.5, 0)
    with pytest.raises(ValueError, match="manifold"):
        nearly_normal_instance("sphere", 8, 4, 0.1, 0)
    with pytest.raises(ValueError, match="tall"):
        nearly_normal_instance("stiefel", 4, 8, 0.1, 0)
