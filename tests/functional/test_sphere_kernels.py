"""Sphere and DGram kernels of :mod:`manifoldlib.functional` tested directly
(docs/theory/sphere.rst, section Numerics; docs/theory/dgram.rst):
the closed forms agree with the general p-family, every member is a rotation
(:math:`\\cos^2\\theta + k^2\\sigma = 1`), and the projections are orthogonal projections."""

from __future__ import annotations

import math

import pytest
import torch

from manifoldlib.functional import (
    cayley_coefficients,
    dgram_normal_multiplier,
    dgram_project_tangent,
    exponential_coefficients,
    gnomonic_coefficients,
    off_diagonal,
    p_coefficients,
    rotate,
    sphere_normalized_sq_step,
    sphere_project_tangent,
    sphere_step_length,
    sphere_unit_tangent,
)

EPS = {torch.float64: torch.finfo(torch.float64).eps, torch.float32: torch.finfo(torch.float32).eps}
# sigma from 0 (v = 0) through the series switch (1e-4) to steps of 30 radii
SIGMAS = torch.cat([torch.zeros(1), torch.logspace(-12, 3, 61, dtype=torch.float64)]).unsqueeze(-1)
FAMILIES = {
    "gnomonic": gnomonic_coefficients,
    "cayley": cayley_coefficients,
    "exp": exponential_coefficients,
    "p=0.5": lambda s: p_coefficients(s, 0.5),
    "p=3": lambda s: p_coefficients(s, 3.0),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("closed,p", [(gnomonic_coefficients, 1.0), (cayley_coefficients, 2.0),
                                      (exponential_coefficients, math.inf)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_closed_forms_equal_the_p_family(closed, p, dtype):
    sigma = SIGMAS.to(dtype)
    for got, want in zip(closed(sigma), p_coefficients(sigma, p)):
        assert (got - want).abs().max() <= 8 * EPS[dtype]


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_coefficients_are_a_rotation(name, dtype):
    # R_x(v) = cos θ x + k v with k = sin θ / β: cos²θ + k²σ = sin²θ + cos²θ = 1
    sigma = SIGMAS.to(dtype)
    c, k = FAMILIES[name](sigma)
    assert (c * c + k * k * sigma - 1).abs().max() <= 8 * EPS[dtype]
    assert torch.equal(c[0], torch.ones(1, dtype=dtype)) and torch.equal(k[0], torch.ones(1, dtype=dtype))


# third derivative of the angle at 0: p atan(b/p) = b - b^3/(3p^2) + ..., so -2/p^2; exp has 0
THETA3 = {"gnomonic": -2.0, "cayley": -0.5, "exp": 0.0, "p=0.5": -8.0, "p=3": -2.0 / 9.0}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_coefficient_gradients_at_zero_are_the_taylor_slopes(name):
    # cos(theta) = 1 - sigma/2 + O(sigma^2), k = sin(theta)/beta = 1 + (THETA3 - 1) sigma/6 + ...
    sigma = torch.zeros(3, 1, dtype=torch.float64, requires_grad=True)
    c, k = FAMILIES[name](sigma)
    (grad_c,) = torch.autograd.grad(c.sum(), sigma, retain_graph=True)
    (grad_k,) = torch.autograd.grad(k.sum(), sigma)
    assert (grad_c + 0.5).abs().max() <= 4 * EPS[torch.float64]
    assert (grad_k - (THETA3[name] - 1.0) / 6.0).abs().max() <= 4 * EPS[torch.float64]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_tangent_projection_and_rotation_keep_the_sphere(dtype):
    g = torch.Generator().manual_seed(3)
    radius = 2.5
    x = torch.randn(6, 9, generator=g, dtype=dtype)
    x = radius * x / x.norm(dim=-1, keepdim=True)  # (6, 9) on the sphere of radius 2.5
    z = torch.randn(6, 9, generator=g, dtype=dtype)
    radius_sq = (x * x).sum(-1, keepdim=True)
    v = sphere_project_tangent(x, z, radius_sq)
    tol = 16 * EPS[dtype]
    assert (x * v).sum(-1).abs().max() <= tol * radius * z.norm(dim=-1).max()  # tangent
    assert _rel(sphere_project_tangent(x, v, radius * radius), v) <= tol  # idempotent, float radius²
    assert _rel(sphere_project_tangent(x, x, radius_sq) + x, x) <= tol  # normal vectors vanish
    sigma = sphere_normalized_sq_step(v, radius_sq)
    assert _rel(sigma, v.norm(dim=-1, keepdim=True) ** 2 / radius**2) <= tol
    for coefficients in FAMILIES.values():
        y = rotate(x, v, *coefficients(sigma))
        assert _rel(y.norm(dim=-1), x.norm(dim=-1)) <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dgram_normal_multiplier_splits_z_into_tangent_and_normal(dtype):
    g = torch.Generator().manual_seed(4)
    q, _ = torch.linalg.qr(torch.randn(2, 7, 4, generator=g, dtype=torch.float64))
    w = (q * torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)).to(dtype)  # (2, 7, 4), WᵀW diagonal
    z = torch.randn(2, 7, 4, generator=g, dtype=dtype)
    s = dgram_normal_multiplier(w, z)  # (2, 4, 4)
    assert torch.equal(s, s.mT)
    assert torch.equal(torch.diagonal(s, dim1=-2, dim2=-1), torch.zeros(2, 4, dtype=dtype))
    v = dgram_project_tangent(w, z)
    assert _rel(v, z - w @ s) <= 4 * EPS[dtype]
    tol = 64 * EPS[dtype] * float(w.norm() * z.norm())
    assert off_diagonal(w.mT @ v + v.mT @ w).abs().max() <= tol  # V is tangent
    assert (v * (w @ s)).sum((-2, -1)).abs().max() <= tol  # Z - V = WS is orthogonal to it


@pytest.mark.parametrize("dtype, scale", [(torch.float64, 1.0), (torch.float64, 1e300), (torch.float64, 1e-300),
                                          (torch.float32, 1e30), (torch.float32, 1e-30)])
def test_sphere_step_length_never_squares_v(dtype, scale):
    v64 = torch.randn(5, 7, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    v64[2] = 0.0
    beta, direction = sphere_step_length((scale * v64).to(dtype), 2.0)
    norms = v64.norm(dim=-1, keepdim=True)  # the exact answer, formed at scale 1
    expected_beta = scale * norms / 2.0
    eps = torch.finfo(dtype).eps
    assert beta.dtype == dtype and direction.shape == v64.shape
    assert torch.allclose(beta.double(), expected_beta, rtol=8 * eps, atol=0)
    assert torch.allclose(direction.double(), v64 / norms.clamp_min(1e-300), rtol=0, atol=8 * eps)
    assert float(beta[2]) == 0.0 and torch.equal(direction[2], torch.zeros(7, dtype=dtype))


@pytest.mark.parametrize(("dtype", "tiny", "big"), [(torch.float32, -20, 50), (torch.float64, -150, 450)])
def test_the_unit_tangent_of_a_step_far_longer_than_its_point_keeps_every_bit_of_its_factor(dtype, tiny, big):
    # r / sqrt(D) with D = ||P_x z||^2 + eps^2 r^2 (r^2 / D was subnormal: a few bits of the factor
    # left, the step off its length r); the same rows scaled into range are exact by homogeneity
    g = torch.Generator().manual_seed(3)
    x, z = torch.randn(4, 32, generator=g, dtype=torch.float64), torch.randn(4, 32, generator=g, dtype=torch.float64)
    # homogeneous: degree 1 in x, 0 in z, with the floor eps relative to ||z|| / ||x||
    expected = sphere_unit_tangent(x, z, eps=1e-6 * 2.0 ** (tiny - big)) * 2.0**tiny
    got = sphere_unit_tangent((x * 2.0**tiny).to(dtype), (z * 2.0**big).to(dtype))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), expected, rtol=64 * eps, atol=0)
    lengths = got.double().norm(dim=-1) / (x * 2.0**tiny).norm(dim=-1)
    assert float((lengths - 1).abs().max()) <= 64 * eps  # the normalized step has the radius's length
