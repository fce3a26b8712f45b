"""Oblique (unit-norm columns) through the public API: one manifold class, no optimizer changes.

The references are independent of the library's dual: the closed form of a single column (the
sphere: :math:`A = P_T G/\\|P_T G\\|`) and scipy L-BFGS on the unreduced dual over diagonal
multipliers (:func:`manifoldlib.testing.nuclear_dual_optimum`).
"""

from __future__ import annotations

import pytest
import torch
from test_steepest import scipy_optimum  # nuclear_dual_optimum, once per instance
from torch import nn

from manifoldlib.manifolds import Oblique
from manifoldlib.optim import (
    ManifoldMuon,
    constraint_residual,
    steepest_direction,
    tangent_residual,
)

F64 = torch.float64


def _instance(m, n, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    w = Oblique().random(m, n, generator=gen, dtype=F64)
    g = torch.randn(m, n, generator=gen, dtype=F64)
    return w.to(dtype), g.to(dtype)


@pytest.mark.parametrize("method", ["svd", "polar-express"])
def test_single_column_is_the_normalized_projected_gradient(method):
    w, g = _instance(9, 1, seed=0)
    a, info = steepest_direction(w, g, "oblique", msign_method=method, tol=1e-10, return_info=True)
    projected = g - w * (w * g).sum()
    torch.testing.assert_close(a, projected / projected.norm(), atol=1e-9, rtol=0)
    assert info.converged


@pytest.mark.parametrize("shape", [(24, 6), (40, 30), (16, 16)])
@pytest.mark.parametrize("method", ["svd", "polar-express"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spectral", ["eigh", "products"])  # "auto" takes one of them
def test_default_solve_is_optimal_against_scipy(shape, method, seed, spectral):
    w, g = _instance(*shape, seed)
    a, info = steepest_direction(w, g, "oblique", msign_method=method, spectral=spectral, return_info=True)
    optimum = scipy_optimum(w, g, diagonal=True)
    value = float((g * a).sum())
    assert info.converged
    assert value >= (1 - 1e-3) * optimum, (value, optimum)
    assert value <= optimum * (1 + 1e-6) + 1e-4 * float(g.norm())  # weak duality, up to the residual
    assert float(torch.linalg.matrix_norm(a, ord=2)) <= 1 + 1e-4
    assert float(tangent_residual(w, a, "oblique")) <= 1e-4
    lam = info.multiplier
    assert torch.equal(lam, torch.diag_embed(torch.diagonal(lam)))  # the multipliers are diagonal


def test_manifold_instance_equals_its_name():
    w, g = _instance(20, 5, seed=3)
    by_name = steepest_direction(w, g, "oblique", msign_method="polar-express")
    by_object = steepest_direction(w, g, Oblique(), msign_method="polar-express")
    torch.testing.assert_close(by_name, by_object, atol=0, rtol=0)


def test_wide_input_is_solved_transposed():
    w, g = _instance(18, 6, seed=4)
    a = steepest_direction(w, g, "oblique", tol=1e-8)
    a_wide = steepest_direction(w.mT, g.mT, "oblique", tol=1e-8)
    torch.testing.assert_close(a_wide, a.mT, atol=1e-10, rtol=0)


def _target_problem(m, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    target = Oblique().random(m, n, generator=gen, dtype=F64).to(dtype)
    param = nn.Parameter(torch.randn(m, n, generator=gen, dtype=F64).to(dtype))
    return param, target


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_manifold_muon_keeps_unit_columns_and_descends(dtype, tol):
    param, target = _target_problem(48, 12, dtype)
    opt = ManifoldMuon([param], lr=0.05, manifold="oblique")
    assert constraint_residual(param.detach(), "oblique") <= tol  # projected at construction
    losses = []
    for _ in range(25):
        opt.zero_grad()
        loss = ((param - target) ** 2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        assert constraint_residual(param.detach(), "oblique") <= tol
        assert opt.state[param]["dual_residual"] <= 1e-3
    assert losses[-1] < 0.2 * losses[0]


def test_fused_step_equals_the_explicit_retraction():
    # the default retraction is fused from the dual's n x n pieces; naming it runs the plain step
    p1, target = _target_problem(60, 10, torch.float64, seed=1)
    p2 = nn.Parameter(p1.detach().clone())
    fused = ManifoldMuon([p1], lr=0.1, manifold="oblique")
    plain = ManifoldMuon([p2], lr=0.1, manifold="oblique", retraction="normalize")
    for _ in range(5):
        for p, opt in ((p1, fused), (p2, plain)):
            opt.zero_grad()
            ((p - target) ** 2).sum().backward()
            opt.step()
    torch.testing.assert_close(p1, p2, atol=1e-10, rtol=0)


def test_wide_parameter_has_unit_rows():
    param, target = _target_problem(40, 10, torch.float64, seed=2)
    param, target = nn.Parameter(param.detach().mT.contiguous()), target.mT
    opt = ManifoldMuon([param], lr=0.05, manifold="oblique")
    for _ in range(3):
        opt.zero_grad()
        ((param - target) ** 2).sum().backward()
        opt.step()
    torch.testing.assert_close(param.detach().norm(dim=1), torch.ones(10, dtype=F64), atol=1e-12, rtol=0)


def test_oblique_has_no_weight_decay():
    # unit columns leave no scale freedom: a decay of W before the step would only change the
    # step's direction after normalization, so it is skipped (as on Stiefel)
    p1, target = _target_problem(30, 6, torch.float64, seed=5)
    p2 = nn.Parameter(p1.detach().clone())
    for p, decay in ((p1, 0.5), (p2, 0.0)):
        opt = ManifoldMuon([p], lr=0.3, weight_decay=decay, manifold="oblique", retraction="normalize")
        ((p - target) ** 2).sum().backward()
        opt.step()
    torch.testing.assert_close(p1, p2, atol=0, rtol=0)
