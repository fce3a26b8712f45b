"""Cross-checks against independent implementations: geoopt, scipy.linalg, dense formulas."""

from __future__ import annotations

import geoopt
import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib import DGram, Sphere, Stiefel
from manifoldlib.functional import (
    dgram_alternating,
    dgram_colnorm_polar,
    dgram_metric_projection,
    dgram_project_tangent,
    msign,
    stiefel_cayley,
    stiefel_exp,
    stiefel_polar,
    stiefel_project_tangent,
    stiefel_qr,
)
from manifoldlib.testing import random_point, random_tangent
from manifoldlib.testing import strategies as mst

EPS = torch.finfo(torch.float64).eps


def _rel(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _np_batched(fn, *tensors):
    """Apply a numpy function to each matrix of a batch."""
    lead = tensors[0].shape[:-2]
    flats = [t.reshape(-1, *t.shape[-2:]).numpy() for t in tensors]
    out = np.stack([fn(*mats) for mats in zip(*flats)])
    return torch.from_numpy(out).reshape(*lead, *out.shape[-2:])


# ------------------------------------------------------------------------------ sphere
@pytest.mark.parametrize("radius", [1.0, 3.0])
@given(data=st.data())
def test_sphere_expmap_matches_geoopt(radius, data):
    s = Sphere(radius)
    x, v = data.draw(mst.point_and_tangent(s, scale=(1e-3, 3.0)))
    # geoopt's Sphere has radius 1: Exp^r_x(v) = r·Exp^1_{x/r}(v/r)
    ref = radius * geoopt.Sphere().expmap(x / radius, v / radius)
    assert _rel(s.expmap(x, v), ref) <= 8 * EPS
    assert _rel(s.with_retraction("exp").retr(x, v), ref) <= 8 * EPS


def test_sphere_gnomonic_matches_geoopt_retr():
    s = Sphere(1.0, retraction="gnomonic")
    g = torch.Generator().manual_seed(0)
    x = random_point(s, (8, 6), generator=g)
    v = random_tangent(s, x, scale=0.7, generator=g)
    assert _rel(s.retr(x, v), geoopt.Sphere().retr(x, v)) <= 4 * EPS


# ----------------------------------------------------------------------------- stiefel
def _stiefel_case(seed, shape=(3, 6, 3), scale=0.8):
    st_ = Stiefel()
    g = torch.Generator().manual_seed(seed)
    x = random_point(st_, shape, generator=g)
    return x, random_tangent(st_, x, scale=scale, generator=g)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(2, 6, 3), (4, 4), (2, 7, 1)], ids=str)
def test_stiefel_exp_matches_geoopt_exact(seed, shape):
    x, v = _stiefel_case(seed, shape)
    ref = geoopt.EuclideanStiefelExact().expmap(x, v)
    assert _rel(stiefel_exp(x, v), ref) <= 1e-13
    assert _rel(Stiefel(retraction="exp").retr(x, v), ref) <= 1e-13
    assert _rel(Stiefel().expmap(x, v), ref) <= 1e-13


@pytest.mark.parametrize("seed", range(3))
def test_stiefel_exp_matches_scipy_expm(seed):
    x, v = _stiefel_case(seed)

    def eas(xm, vm):
        n = xm.shape[1]
        a, s = xm.T @ vm, vm.T @ vm
        block = np.block([[a, -s], [np.eye(n), a]])
        return np.hstack([xm, vm]) @ scipy.linalg.expm(block)[:, :n] @ scipy.linalg.expm(-a)

    assert _rel(stiefel_exp(x, v), _np_batched(eas, x, v)) <= 1e-13


@pytest.mark.parametrize("seed", range(3))
def test_stiefel_exp_is_a_geodesic(seed):
    # Exp_x(2v) = Exp_{Exp_x(v)}(transported v); checked through the one-parameter group property
    # Exp_x((s+t)v) = Exp_{Exp_x(sv)}(c'(s)·t), with the velocity c'(s) by central differences
    x, v = _stiefel_case(seed, scale=0.5)
    mid = stiefel_exp(x, v)
    h = 1e-5
    vel = (stiefel_exp(x, (1 + h) * v) - stiefel_exp(x, (1 - h) * v)) / (2 * h)
    assert _rel(stiefel_exp(mid, vel), stiefel_exp(x, 2 * v)) <= 1e-8  # O(h²) difference quotient


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("method", ["auto", "svd", "newton", "newton-schulz"])
def test_stiefel_polar_matches_scipy_polar_and_closed_form(seed, method):
    x, v = _stiefel_case(seed)
    y = stiefel_polar(x, v, method)
    ref = _np_batched(lambda a: scipy.linalg.polar(a)[0], x + v)
    assert _rel(y, ref) <= 1e-13
    # (X+V)(I + V^T V)^{-1/2} for tangent V (docs/theory/stiefel.rst, section Retractions)
    closed = _np_batched(
        lambda a, b: a @ scipy.linalg.inv(scipy.linalg.sqrtm(np.eye(b.shape[1]) + b.T @ b)).real,
        x + v,
        v,
    )
    assert _rel(y, closed) <= 1e-13
    assert _rel(Stiefel().projx(x + v), ref) <= 1e-13


@pytest.mark.parametrize("seed", range(3))
def test_stiefel_qr_matches_scipy_qr_with_sign_fix(seed):
    x, v = _stiefel_case(seed)

    def qf(a):
        q, r = scipy.linalg.qr(a, mode="economic")
        return q * np.sign(np.diag(r))

    assert _rel(stiefel_qr(x, v), _np_batched(qf, x + v)) <= 1e-13
    # R = Q^T (X + V) is upper triangular with a positive diagonal
    r = stiefel_qr(x, v).mT @ (x + v)
    assert torch.allclose(torch.tril(r, -1), torch.zeros_like(r), atol=1e-13)
    assert (torch.diagonal(r, dim1=-2, dim2=-1) > 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_stiefel_cayley_low_rank_equals_dense_form(seed):
    x, v = _stiefel_case(seed)
    m = x.shape[-2]
    eye = torch.eye(m, dtype=x.dtype)
    p = eye - 0.5 * x @ x.mT
    w = p @ v @ x.mT - x @ v.mT @ p  # (m, m), skew
    assert torch.allclose(w, -w.mT, atol=1e-14)
    dense = torch.linalg.solve(eye - 0.5 * w, (eye + 0.5 * w) @ x)
    assert _rel(stiefel_cayley(x, v), dense) <= 1e-13


def test_stiefel_projection_matches_geoopt():
    x, _ = _stiefel_case(4)
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert _rel(stiefel_project_tangent(x, z), geoopt.EuclideanStiefel().proju(x, z)) <= 4 * EPS


# ------------------------------------------------------------------------------- dgram
def _dgram_case(seed, shape=(2, 6, 3), scale=0.5):
    dg = DGram()
    g = torch.Generator().manual_seed(seed)
    w = random_point(dg, shape, generator=g)
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    return dg, w, z, g


def _dense_dgram_projection(w: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Projection onto the null space of the linear constraints w_i^T v_j + v_i^T w_j = 0 (i < j),
    from an explicit constraint matrix: independent of the closed form P_W(Z) = Z - WS."""
    m, n = w.shape
    rows = []
    for i in range(n):
        for j in range(i + 1, n):
            a = np.zeros((m, n))
            a[:, j] += w[:, i]
            a[:, i] += w[:, j]
            rows.append(a.ravel())
    if not rows:
        return z
    a = np.array(rows)
    zf = z.ravel()
    return (zf - a.T @ np.linalg.solve(a @ a.T, a @ zf)).reshape(m, n)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(2, 6, 3), (5, 5), (4, 1)], ids=str)
def test_dgram_projection_matches_dense_null_space_projection(seed, shape):
    dg, w, z, _ = _dgram_case(seed, shape)
    assert _rel(dgram_project_tangent(w, z), _np_batched(_dense_dgram_projection, w, z)) <= 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_dgram_projection_is_orthogonal(seed):
    dg, w, z, g = _dgram_case(seed)
    pz = dg.proju(w, z)
    assert _rel(dg.proju(w, pz), pz) <= 8 * EPS  # idempotent
    assert dg.check_vector_on_tangent(w, pz, atol=0.0, rtol=1e-13)
    u = dg.proju(w, torch.randn(w.shape, generator=g, dtype=torch.float64))
    normal = z - pz
    assert float(dg.inner(w, normal, u).abs().max()) <= 1e-13 * float(z.norm() * u.norm())


@pytest.mark.parametrize("seed", range(3))
def test_dgram_alternating_is_first_metric_projection_step(seed):
    dg, w, z, g = _dgram_case(seed)
    v = dg.proju(w, 0.3 * z)
    ref = dgram_metric_projection(w + v, iterations=1)
    assert _rel(dgram_alternating(w, v, "svd"), ref) <= 1e-14


@pytest.mark.parametrize("seed", range(3))
def test_dgram_metric_projection_is_a_critical_point(seed):
    # the nearest point R of Y satisfies P_R(Y - R) = 0, and it beats the one-step alternating point
    dg, w, z, g = _dgram_case(seed)
    y = w + 0.2 * z
    errs = []
    for iters in (1, 2, 4, 50):
        r = dgram_metric_projection(y, iterations=iters)
        assert dg.check_point_on_manifold(r, atol=0.0, rtol=1e-13)
        errs.append(
            float(torch.linalg.vector_norm(dg.proju(r, y - r)) / torch.linalg.vector_norm(y))
        )
    assert errs[-1] <= 1e-12  # converged to rounding
    assert errs[0] > errs[1] > errs[2] > errs[3]  # linear convergence of alternating minimization
    dist_one = float((y - dgram_metric_projection(y, 1)).norm())
    dist_many = float((y - dgram_metric_projection(y, 100)).norm())
    assert dist_many <= dist_one


@pytest.mark.parametrize("seed", range(3))
def test_dgram_colnorm_polar_keeps_column_norms(seed):
    dg, w, z, _ = _dgram_case(seed)
    v = dg.proju(w, 0.3 * z)
    r = dgram_colnorm_polar(w, v, "svd")
    assert torch.allclose(r.norm(dim=-2), (w + v).norm(dim=-2), rtol=1e-14, atol=0)
    q = r / r.norm(dim=-2, keepdim=True)
    assert _rel(q, msign((w + v) / (w + v).norm(dim=-2, keepdim=True))) <= 1e-14


def test_dgram_retractions_reduce_to_stiefel_polar_on_stiefel_points():
    # on unit columns, with a step keeping them unit-norm to first order, all agree to O(V²)
    x, v = _stiefel_case(6, scale=1e-4)
    for retr in (dgram_alternating, dgram_colnorm_polar):
        assert _rel(retr(x, v, "svd"), stiefel_polar(x, v, "svd")) <= 1e-7


@pytest.mark.parametrize(
    "dtype,theta,tol",
    [(torch.float64, 0.04, 4 * EPS), (torch.float32, 0.5, 4 * torch.finfo(torch.float32).eps)],
)
def test_stiefel_exp_on_the_circle_single_matrix(dtype, theta, tol):
    # St(2, 1) is the unit circle: Exp_x(θ·x⊥) = (cos θ, sin θ). A single small-norm matrix is
    # where torch.linalg.matrix_exp's degree-8 branch errs (pytorch/pytorch#196592).
    x = torch.tensor([[1.0], [0.0]], dtype=dtype)
    v = torch.tensor([[0.0], [theta]], dtype=dtype)
    expected = torch.tensor([[np.cos(theta)], [np.sin(theta)]], dtype=torch.float64)
    assert float((stiefel_exp(x, v).double() - expected).abs().max()) <= tol
    rotation = torch.tensor([[0.0, -theta], [theta, 0.0]], dtype=dtype)  # square St(2, 2)
    y = stiefel_exp(torch.eye(2, dtype=dtype), rotation)
    expected_2 = torch.tensor([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    assert float((y.double() - expected_2).abs().max()) <= tol


@pytest.mark.parametrize("seed", range(3))
def test_stiefel_exp_single_matrix_small_steps_stay_on_manifold(seed):
    st_ = Stiefel()
    g = torch.Generator().manual_seed(seed)
    x = random_point(st_, (4, 2), generator=g)
    for scale in (1e-3, 3e-2, 0.1):
        y = stiefel_exp(x, random_tangent(st_, x, scale=scale, generator=g))
        assert st_.check_point_on_manifold(y, atol=0.0, rtol=1e-14)
