"""The retraction formed from the solved reduced dual equals forming the direction and retracting it."""

from __future__ import annotations

import sys

import pytest
import torch
from core_step import core_step  # pytest puts this folder on sys.path

from manifoldlib.functional.dgram import off_diagonal
from manifoldlib.manifolds import get_manifold
from manifoldlib.optim import ManifoldMuon
from manifoldlib.optim.fused_retraction import FUSED_MIN_ASPECT, GRAM_DRIFT_EPS, fused_retraction
from manifoldlib.optim.manifold_muon import DEFAULT_RETRACTIONS
from manifoldlib.optim.muon_groups import group_manifold
from manifoldlib.optim.steepest import solve_dual

fused_module = sys.modules["manifoldlib.optim.fused_retraction"]


def _point(m, n, manifold, dtype, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    if manifold == "dgram":
        q = q * torch.exp(spread * torch.randn(n, generator=g, dtype=torch.float64))
    return q.to(dtype), torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)


def _plain_step(solution, w, manifold, eta, beta):
    name, options = DEFAULT_RETRACTIONS[manifold]
    retraction = get_manifold(manifold, retraction=name, **options)
    return retraction.retr(w * beta, solution.direction().to(w.dtype).mul(-eta))


def _solve(w, g, manifold, spectral="eigh"):
    return solve_dual(w, g, manifold, tol=1e-6, max_iter=60, msign_method="jordan5", patience=None,
                      gap_tol=None, spectral=spectral)  # the optimizer's solve (its work dtype)


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("shape", [(96, 24), (64, 32)])
@pytest.mark.parametrize("spectral", ["eigh", "products"])  # products: what CUDA solves with
def test_fused_equals_direction_then_retraction(manifold, dtype, rtol, shape, spectral):
    w, g = _point(*shape, manifold, dtype)
    solution = _solve(w, g, manifold, spectral)
    if shape == (96, 24):  # the products solve stays on its own path (no smoothed continuation)
        assert (solution.state.vec is None) == (spectral == "products")
    beta = 0.99 if manifold == "dgram" else 1.0  # decoupled weight decay (DGram only)
    fused = fused_retraction(solution.problem, solution.state, 0.02, beta)
    assert fused is not None and fused.dtype == dtype
    plain = _plain_step(solution, w, manifold, 0.02, beta)
    assert float((fused - plain).norm() / plain.norm()) <= rtol


def test_fused_declines_below_its_aspect_and_for_large_steps():
    w, g = _point(48, 32, "stiefel", torch.float64)  # aspect 1.5 < FUSED_MIN_ASPECT
    assert 48 < FUSED_MIN_ASPECT * 32
    solution = _solve(w, g, "stiefel")
    assert fused_retraction(solution.problem, solution.state, 0.05) is None
    w, g = _point(96, 24, "dgram", torch.float64)
    eigh = _solve(w, g, "dgram")
    # a step as long as the point: the Gram matrix of W - eta A is far from diagonal, the products-only
    # kernels give up and the caller takes the plain (eigh / SVD) retraction
    assert fused_retraction(eigh.problem, eigh.state, 5.0) is None


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_a_drifted_point_is_retracted_with_its_exact_gram_matrix(manifold):
    w, g = _point(96, 24, manifold, torch.float64)
    tilt = torch.eye(24, dtype=torch.float64)
    tilt[0, 1] = 1e-6  # W -> W (I + 1e-6 E_01): Off(W^T W) ~ 1e-6, above the float64 threshold
    drifted = w @ tilt
    solution = _solve(drifted, g, manifold)
    exact = {"reads": 0}
    real = fused_module._point_gram

    def counted(problem):
        found = real(problem)
        exact["reads"] += found is not None
        return found

    fused_module._point_gram = counted
    try:
        fused = fused_retraction(solution.problem, solution.state, 0.02)
        clean = _solve(w, g, manifold)
        fused_retraction(clean.problem, clean.state, 0.02)
    finally:
        fused_module._point_gram = real
    assert exact["reads"] == 1  # the drifted point, not the clean one
    plain = _plain_step(solution, drifted, manifold, 0.02, 1.0)
    assert float((fused - plain).norm() / plain.norm()) <= 1e-12
    gram = fused.mT @ fused
    residual = off_diagonal(gram) if manifold == "dgram" else gram - torch.eye(24, dtype=gram.dtype)
    assert float(residual.norm() / gram.diagonal().norm()) < 1e-13  # the drift is gone


def test_probe_threshold_is_in_units_of_the_dtype():
    w, g = _point(96, 24, "dgram", torch.float32)
    solution = _solve(w, g, "dgram")
    assert fused_module._point_gram(solution.problem) is None  # a projected float32 point
    tilt = torch.eye(24)
    tilt[2, 5] = 50 * GRAM_DRIFT_EPS * torch.finfo(torch.float32).eps
    drifted = _solve(w @ tilt, g, "dgram")
    assert fused_module._point_gram(drifted.problem) is not None


@pytest.mark.parametrize("manifold", ["stiefel", "dgram"])
def test_manifold_muon_keeps_tall_points_on_the_manifold_over_many_fused_steps(manifold):
    # the fused step reads W^T W only when the probe sees drift: 300 float32 steps stay at the level
    # the four-product step keeps (Stiefel ||W^T W - I||, DGram ||Off(W^T W)|| / ||diag||)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(128, 32))
    opt = ManifoldMuon([p], lr=0.02, manifold=manifold, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        p.grad = torch.randn(128, 32, generator=g)
        opt.step()
    w = p.detach().double()
    gram = w.mT @ w
    residual = off_diagonal(gram) if manifold == "dgram" else gram - torch.eye(32, dtype=gram.dtype)
    assert float(residual.norm() / gram.diagonal().norm()) <= 2 * GRAM_DRIFT_EPS * torch.finfo(torch.float32).eps


def test_a_group_with_its_own_retraction_is_not_fused():
    # the optimizer's step of each group equals the functional core with fuse_retraction as the
    # group's retraction says: fused for the default one, plain for its own (bit for bit)
    g = torch.Generator().manual_seed(2)
    w0 = [torch.randn(64, 16, generator=g) for _ in range(2)]
    grads = [torch.randn(64, 16, generator=g) for _ in range(2)]
    default, own = (torch.nn.Parameter(w.clone()) for w in w0)
    opt = ManifoldMuon(
        [{"params": [default]}, {"params": [own], "retraction_options": {"method": "svd"}}], lr=0.02, manifold="dgram"
    )
    starts = [p.detach().clone() for p in (default, own)]  # projected onto DGram
    default.grad, own.grad = grads[0].clone(), grads[1].clone()
    opt.step()

    def core(start, grad, group, fuse):
        return core_step(start, grad, group, group_manifold(group), fuse_retraction=fuse)

    first, second = opt.param_groups
    torch.testing.assert_close(default.detach(), core(starts[0], grads[0], first, True), rtol=0, atol=0)
    assert not torch.equal(default.detach(), core(starts[0], grads[0], first, False))  # fusing changed rounding
    torch.testing.assert_close(own.detach(), core(starts[1], grads[1], second, False), rtol=0, atol=0)


@pytest.mark.parametrize(("eta", "beta"), [(-0.1, 1.0), (float("nan"), 1.0), (0.02, 0.0), (0.02, float("inf"))])
def test_bad_step_or_decay_is_refused_by_name(eta, beta):
    w, g = _point(96, 24, "dgram", torch.float64)
    solution = _solve(w, g, "dgram")
    with pytest.raises(ValueError, match="eta=.*beta="):
        fused_retraction(solution.problem, solution.state, eta, beta)
