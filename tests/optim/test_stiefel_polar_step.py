"""The fused square-Stiefel polar step equals msign(W - eta A) without an eigh of the retraction."""

from __future__ import annotations

import sys

import pytest
import torch

from manifoldlib.functional import msign
from manifoldlib.optim import ManifoldMuon, constraint_residual
from manifoldlib.optim.steepest import solve_dual
from manifoldlib.optim.stiefel_polar_step import FIRST_ORDER_LIMIT, fusable, stiefel_polar_step


def _point(n: int, seed: int, dtype=torch.float64, drift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    if drift:  # a point off the manifold by about `drift` (rounding drift, exaggerated)
        q = q @ (torch.eye(n, dtype=torch.float64) + drift * torch.randn(n, n, generator=g, dtype=torch.float64))
    return q.to(dtype)


def _gradient(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, n, generator=g, dtype=torch.float64).to(dtype)


def _solve(w, g, method="jordan5"):
    return solve_dual(w, g, "stiefel", msign_method=method, tol=1e-6, max_iter=50)


@pytest.mark.parametrize("eta", [0.01, 0.2, 1.0])
@pytest.mark.parametrize("method", ["jordan5", "newton-schulz"])
def test_matches_the_polar_retraction_of_the_direction_float64(eta, method):
    w, g = _point(24, 0), _gradient(24, 1)
    solution = _solve(w, g, method)
    assert fusable(solution)
    reference = msign(w - eta * solution.direction(), "svd")
    fused = stiefel_polar_step(solution, eta)
    assert float((fused - reference).norm() / reference.norm()) <= 1e-12
    assert constraint_residual(fused, "stiefel") <= 1e-12


def test_a_drifted_point_comes_back_orthonormal_through_the_exact_eigh_branch(monkeypatch):
    module = sys.modules["manifoldlib.optim.stiefel_polar_step"]
    eighs = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(module.torch.linalg, "eigh", lambda t: eighs.append(1) or eigh(t))
    w = _point(24, 2, drift=1e-2)  # ||W^T W - I|| ~ 0.1: far past the first-order limit
    assert constraint_residual(w, "stiefel") > 10 * FIRST_ORDER_LIMIT
    solution = _solve(w, _gradient(24, 3))
    eighs.clear()
    out = stiefel_polar_step(solution, 0.1)
    assert eighs == [1]
    assert constraint_residual(out, "stiefel") <= 1e-12
    # the step is the polar factor of W P (P = I - eta M R): the retraction of W's own drifted frame
    reference = msign(w - 0.1 * solution.direction(), "svd")
    # they differ only through the drift (the fused step drops G's O(drift) part outside span(W))
    assert float((out - reference).norm() / reference.norm()) <= constraint_residual(w, "stiefel")


def test_float32_small_drift_stays_first_order_and_orthonormal(monkeypatch):
    module = sys.modules["manifoldlib.optim.stiefel_polar_step"]
    eighs = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(module.torch.linalg, "eigh", lambda t: eighs.append(1) or eigh(t))
    w, g = _point(96, 4, torch.float32), _gradient(96, 5, torch.float32)
    solution = solve_dual(w, g, "stiefel", msign_method="jordan5", tol=1e-3, max_iter=30)
    eighs.clear()  # the patch counts every eigh; only the step's matter
    out = stiefel_polar_step(solution, 0.04)
    assert eighs == []
    reference = msign(w.double() - 0.04 * solution.direction().double(), "svd")
    assert float((out.double() - reference).norm() / reference.norm()) <= 1e-6
    # as orthonormal as the general path in float32 (form A, then the Gram-form polar)
    general = msign(w - 0.04 * solution.direction(), "gram-eigh")
    assert constraint_residual(out, "stiefel") <= 2 * constraint_residual(general, "stiefel")


def test_refuses_what_it_cannot_fuse():
    tall = torch.linalg.qr(torch.randn(12, 5, dtype=torch.float64))[0]
    for solution in (
        solve_dual(tall, torch.randn(12, 5, dtype=torch.float64), "stiefel", msign_method="jordan5"),
        solve_dual(_point(6, 0), _gradient(6, 1), "stiefel", msign_method="svd"),
        solve_dual(_point(6, 0), _gradient(6, 1), "dgram", msign_method="jordan5"),
        solve_dual(_point(6, 0), torch.zeros(6, 6, dtype=torch.float64), "stiefel", msign_method="jordan5"),
    ):
        assert not fusable(solution)
        with pytest.raises(ValueError, match="needs a reduced dual solution of a square Stiefel matrix"):
            stiefel_polar_step(solution, 0.1)


@pytest.mark.parametrize("options,fused", [(None, True), ({"method": "svd"}, False)])
def test_manifold_muon_fuses_only_the_default_gram_form_polar(monkeypatch, options, fused):
    module = sys.modules["manifoldlib.optim.manifold_muon"]
    calls = []
    step = module.stiefel_polar_step
    monkeypatch.setattr(module, "stiefel_polar_step", lambda *a: calls.append(1) or step(*a))
    params = [torch.nn.Parameter(_point(16, 6, torch.float32)), torch.nn.Parameter(torch.randn(24, 8))]
    kw = {} if options is None else {"retraction_options": options}
    opt = ManifoldMuon(params, lr=0.05, manifold="stiefel", **kw)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    assert len(calls) == (1 if fused else 0)  # the square matrix only; the tall one never
    for p in params:
        assert constraint_residual(p.detach(), "stiefel") <= 1e-5
