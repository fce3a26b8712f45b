"""Identities of the sphere retraction family θ(β) = p·arctan(β/p) (docs/theory/sphere.rst)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib import Sphere
from manifoldlib.functional import exponential_coefficients, p_coefficients
from manifoldlib.retractions import (
    AngleRetraction,
    CayleyRetraction,
    GnomonicRetraction,
    PRetraction,
    available_retractions,
    get_retraction,
)
from manifoldlib.testing import random_point, random_tangent
from manifoldlib.testing import strategies as mst

EPS = torch.finfo(torch.float64).eps
RADII = [0.3, 1.0, 2.5]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _beta(v: torch.Tensor, r: float) -> torch.Tensor:
    return v.norm(dim=-1) / r


@pytest.mark.parametrize("radius", RADII)
@given(data=st.data())
def test_p1_is_gnomonic_and_p2_is_cayley(radius, data):
    s = Sphere(radius)
    x, v = data.draw(mst.point_and_tangent(s, scale=(0.0, 5.0)))
    p1 = s.with_retraction(PRetraction(1.0)).retr(x, v)
    p2 = s.with_retraction(PRetraction(2.0)).retr(x, v)
    assert _rel(p1, s.with_retraction("gnomonic").retr(x, v)) <= 8 * EPS
    assert _rel(p2, s.with_retraction("cayley").retr(x, v)) <= 8 * EPS
    # closed forms of the table in docs/theory/sphere.rst:
    # (x+v)/sqrt(1+σ) and ((1-σ/4)x + v)/(1+σ/4)
    sigma = (v * v).sum(-1, keepdim=True) / radius**2
    assert _rel(p1, (x + v) / torch.sqrt(1 + sigma)) <= 8 * EPS
    assert _rel(p2, ((1 - sigma / 4) * x + v) / (1 + sigma / 4)) <= 8 * EPS


@given(data=st.data())
def test_exp_retraction_is_expmap_and_p_inf(data):
    s = Sphere(1.7, retraction="exp")
    x, v = data.draw(mst.point_and_tangent(s, scale=(0.0, 4.0)))
    y = s.retr(x, v)
    assert _rel(y, s.expmap(x, v)) <= 8 * EPS
    assert _rel(y, s.with_retraction(PRetraction(math.inf)).retr(x, v)) <= 8 * EPS
    beta = _beta(v, 1.7).unsqueeze(-1)
    u = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    assert _rel(y, torch.cos(beta) * x + torch.sin(beta) * 1.7 * u) <= 8 * EPS


@pytest.mark.parametrize("p", [0.5, 1.0, 1.5, 3.0])
@given(data=st.data())
def test_geodesic_distance_to_exp_is_r_times_angle_gap(p, data):
    r = 1.3
    s = Sphere(r)
    x, v = data.draw(mst.point_and_tangent(s, scale=(0.0, 2.0)))
    y = s.with_retraction(PRetraction(p)).retr(x, v)
    e = s.expmap(x, v)
    beta = _beta(v, r)
    theta = p * torch.atan(beta / p)
    dist = s.dist(y, e)  # both on the great circle through x along v, angles θ and β <= 2 < π
    assert torch.allclose(dist, r * (beta - theta), rtol=0, atol=16 * EPS * r)


# β = 0 or normal β/p: a subnormal carries no relative precision, so no rounding bound holds there
_BETAS = st.one_of(st.just(0.0), st.floats(1e-290, 50.0))


@given(beta=_BETAS, p=st.floats(0.05, 50.0))
def test_angle_gap_bound(beta, p):
    # 0 <= β - p·arctan(β/p) <= β³/(3p²), up to the rounding of the subtraction
    b = torch.tensor(beta, dtype=torch.float64)
    gap = float(b - PRetraction(p).angle(b))
    rounding = 4 * EPS * beta
    assert -rounding <= gap <= beta**3 / (3 * p * p) + rounding


@given(beta=st.one_of(st.just(0.0), st.floats(1e-290, 1e12)), p=st.floats(1e-3, 1e3))
def test_angle_saturates_below_p_pi_over_2(beta, p):
    theta = float(PRetraction(p).angle(torch.tensor(beta, dtype=torch.float64)))
    assert 0.0 <= theta < p * math.pi / 2
    assert theta <= beta * (1 + 2 * EPS)  # p·(β/p) may round one ulp above β


@pytest.mark.parametrize("p", [0.5, 1.0, 2.0])
def test_rotation_never_passes_p_pi_over_2_even_for_huge_steps(p):
    r = 1.5
    s = Sphere(r, retraction=PRetraction(p))
    g = torch.Generator().manual_seed(11)
    x = random_point(s, (64, 5), generator=g)
    for scale in (1.0, 1e3, 1e8):
        v = random_tangent(s, x, scale=scale, generator=g)
        y = s.retr(x, v)
        angle = s.dist(x, y) / r
        assert (
            angle <= p * math.pi / 2 + 1e-7
        ).all()  # acos-free atan2 angle, rounding ~1e-8 near π
    assert (s.retr(x, v) * x).sum(-1).min() > (-r * r if p >= 2 else 0.0)


def test_p_to_infinity_approaches_exp_quadratically():
    r = 2.0
    s = Sphere(r)
    g = torch.Generator().manual_seed(3)
    x = random_point(s, (16, 6), generator=g)
    v = random_tangent(s, x, scale=1.0, generator=g)  # β = 1
    beta = _beta(v, r)
    e = s.expmap(x, v)
    gaps = []
    for p in (4.0, 8.0, 16.0, 32.0, 64.0):
        y = s.with_retraction(PRetraction(p)).retr(x, v)
        gap = (y - e).norm(dim=-1)
        assert (gap <= r * beta**3 / (3 * p * p) + 8 * EPS * r).all()
        gaps.append(float(gap.max()))
    for big, small in zip(gaps, gaps[1:]):
        assert 3.8 < big / small < 4.1  # gap ∝ 1/p² once β ≪ p


def test_p_to_zero_approaches_identity():
    r = 0.7
    s = Sphere(r)
    g = torch.Generator().manual_seed(4)
    x = random_point(s, (16, 6), generator=g)
    for scale in (0.1, 1.0, 1e6):
        v = random_tangent(s, x, scale=scale, generator=g)
        previous = math.inf
        for p in (1e-1, 1e-2, 1e-3, 1e-4):
            moved = float((s.with_retraction(PRetraction(p)).retr(x, v) - x).norm(dim=-1).max())
            assert moved <= r * p * math.pi / 2  # chord <= arc = r·θ < r·pπ/2
            assert moved < previous
            previous = moved


@pytest.mark.parametrize("radius", RADII)
@given(data=st.data())
def test_cayley_closed_form_equals_matrix_cayley_transform(radius, data):
    s = Sphere(radius, retraction="cayley")
    x, v = data.draw(mst.point_and_tangent(s, batch=None, scale=(0.0, 3.0)))
    omega = (torch.outer(v, x) - torch.outer(x, v)) / radius**2  # (d, d), skew, Ω x = v
    eye = torch.eye(x.numel(), dtype=x.dtype)
    expected = torch.linalg.solve(eye - omega / 2, (eye + omega / 2) @ x)
    assert _rel(s.retr(x, v), expected) <= 32 * EPS


class _ArctanThree(AngleRetraction):
    """p = 3 through the generic :meth:`AngleRetraction.coefficients` path (not registered)."""

    def angle(self, beta):
        return 3.0 * torch.atan(beta / 3.0)


@given(data=st.data())
def test_generic_angle_path_matches_closed_form(data):
    s = Sphere(1.1)
    x, v = data.draw(mst.point_and_tangent(s, scale=(0.0, 3.0)))
    generic = s.with_retraction(_ArctanThree()).retr(x, v)
    assert _rel(generic, s.with_retraction(PRetraction(3.0)).retr(x, v)) <= 8 * EPS
    # radius=None reads r from ||x||
    assert _rel(_ArctanThree().retract(x, v), generic) <= 8 * EPS


@pytest.mark.parametrize("scale", [0.0, 1e-12, 1e-9, 1e-7])
def test_generic_angle_path_near_zero(scale):
    s = Sphere(1.1)
    g = torch.Generator().manual_seed(9)
    x = random_point(s, (4, 5), generator=g)
    v = random_tangent(s, x, scale=scale, generator=g)
    generic = s.with_retraction(_ArctanThree()).retr(x, v)
    assert _rel(generic, s.with_retraction(PRetraction(3.0)).retr(x, v)) <= 4 * EPS


def _sphere_retractions():
    names = [n for n in available_retractions("sphere")]
    return [(n, n) for n in names] + [
        ("p=1.5", PRetraction(1.5)),
        ("p=0.3", PRetraction(0.3)),
        ("generic-atan3", _ArctanThree()),
    ]


@pytest.mark.parametrize(
    "retraction", [r for _, r in _sphere_retractions()], ids=[i for i, _ in _sphere_retractions()]
)
@pytest.mark.parametrize("at_zero", [True, False], ids=["v=0", "v random"])
def test_gradcheck(retraction, at_zero):
    s = Sphere(1.3, retraction=retraction)
    g = torch.Generator().manual_seed(21)
    x = random_point(s, (2, 4), generator=g)
    v = torch.zeros_like(x) if at_zero else random_tangent(s, x, scale=0.8, generator=g)
    x.requires_grad_(True)
    v.requires_grad_(True)
    assert torch.autograd.gradcheck(s.retr, (x, v), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("sigma", [1e-10, 1e-6, 0.999e-4, 1.001e-4, 1e-2, 1.0, 30.0])
def test_series_branches_exact_to_rounding(sigma):
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40
    s = torch.tensor([sigma], dtype=torch.float64)
    b = mp.sqrt(mp.mpf(sigma))
    c, k = exponential_coefficients(s)
    assert abs(mp.mpf(c.item()) - mp.cos(b)) <= 2 * EPS
    assert abs(mp.mpf(k.item()) - mp.sin(b) / b) <= 2 * EPS
    for p in (0.1, 1.0, 1.5, 10.0):
        c, k = p_coefficients(s, p)
        theta = p * mp.atan(b / p)
        assert abs(mp.mpf(c.item()) - mp.cos(theta)) <= 4 * EPS
        assert abs(mp.mpf(k.item()) - mp.sin(theta) / b) <= 4 * EPS


class _P3(AngleRetraction):
    def angle(self, beta):
        return 3.0 * torch.atan(beta / 3.0)


@pytest.mark.parametrize(
    "retraction",
    [GnomonicRetraction(), CayleyRetraction(), PRetraction(1.0), PRetraction(2.0), PRetraction(0.5),
     PRetraction(math.inf), get_retraction("sphere", "exp"), _P3()],
    ids=["gnomonic", "cayley", "p=1", "p=2", "p=0.5", "p=inf", "exp", "user-p3"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_coefficients_vjp_is_the_derivative_of_coefficients(retraction, dtype):
    # closed-form overrides (gnomonic, Cayley, p = 1, 2) against autograd through coefficients
    g = torch.Generator().manual_seed(5)
    sigma = torch.cat([torch.zeros(1, dtype=torch.float64),
                       torch.logspace(-10, 2, 25, dtype=torch.float64)]).unsqueeze(-1).to(dtype)
    grad_cos = torch.randn(sigma.shape, generator=g, dtype=torch.float64).to(dtype)
    grad_k = torch.randn(sigma.shape, generator=g, dtype=torch.float64).to(dtype)
    c, k = retraction.coefficients(sigma)
    got = retraction.coefficients_vjp(sigma, c, k, grad_cos, grad_k)
    s = sigma.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(retraction.coefficients(s), s, (grad_cos, grad_k))
    eps = torch.finfo(dtype).eps
    assert got.shape == sigma.shape and float((got - want).abs().max()) <= 16 * eps * float(want.abs().max())


def test_p_family_uses_the_closed_forms_at_p_1_and_2():
    sigma = torch.logspace(-8, 3, 12, dtype=torch.float64).unsqueeze(-1)
    for p, closed in ((1.0, GnomonicRetraction()), (2.0, CayleyRetraction())):
        for got, want in zip(PRetraction(p).coefficients(sigma), closed.coefficients(sigma)):
            assert torch.equal(got, want)


@pytest.mark.parametrize(
    "retraction",
    [GnomonicRetraction(), CayleyRetraction(), PRetraction(0.5), get_retraction("sphere", "exp"), _P3()],
    ids=["gnomonic", "cayley", "p=0.5", "exp", "user-p3"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_steps_past_float16_range_stay_on_the_sphere(retraction, dtype):
    # ||v|| = 300 at radius 8: ||v||^2 = 9e4 overflows float16 (max 65504); rotated in float32 the
    # result is the float32 rotation of the same (rounded) inputs, rounded once, of norm 8
    g = torch.Generator().manual_seed(11)
    x = 8.0 * torch.nn.functional.normalize(torch.randn(4, 64, generator=g), dim=-1)
    v = torch.randn(4, 64, generator=g)
    v = v - (x * v).sum(-1, keepdim=True) / 64.0 * x
    v = 300.0 * torch.nn.functional.normalize(v, dim=-1)
    xh, vh = x.to(dtype), v.to(dtype)
    y = retraction.retract(xh, vh)
    want = retraction.retract(xh.float(), vh.float()).to(dtype)
    assert y.dtype == dtype and torch.equal(y, want)
    norms = torch.linalg.vector_norm(y.float(), dim=-1)
    assert torch.allclose(norms, torch.full_like(norms, 8.0), rtol=8 * torch.finfo(dtype).eps, atol=0)


class _SteeperP(PRetraction):
    """A subclass of a built-in that changes the angle (and inherits its closed forms)."""

    def angle(self, beta):
        return 1.1 * super().angle(beta)


class _StepHalf(GnomonicRetraction):
    """A subclass of a built-in that changes the coefficients only: theta = arctan(beta / 2)."""

    def coefficients(self, sigma):
        c = torch.rsqrt(1.0 + 0.25 * sigma)
        return c, 0.5 * c


def _rotation_angle(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r = x.norm(dim=-1)
    along = (x * y).sum(-1) / r
    return torch.atan2((y - along.unsqueeze(-1) * x / r.unsqueeze(-1)).norm(dim=-1), along)


@pytest.mark.parametrize("p", [1.0, 1.5, math.inf])
def test_a_subclass_that_overrides_the_angle_of_a_built_in_rotates_by_its_own_angle(p):
    """The built-ins' closed-form coefficients stood in for the overridden angle: a subclass of
    PRetraction with angle 1.1 p arctan(beta/p) rotated by p arctan(beta/p), silently."""
    s = Sphere(1.3, retraction=_SteeperP(p))
    g = torch.Generator().manual_seed(3)
    x = random_point(s, (4, 6), generator=g)
    v = random_tangent(s, x, scale=0.8, generator=g)
    beta = _beta(v, 1.3)
    want = _SteeperP(p).angle(beta)
    assert float((_rotation_angle(x, s.retr(x, v)) - want).abs().max()) <= 1e-12
    assert float((_rotation_angle(x, _SteeperP(p).retract(x, v)) - want).abs().max()) <= 1e-12


def test_a_subclass_that_overrides_the_coefficients_of_a_built_in_differentiates_its_own():
    """The inherited closed-form derivative of the gnomonic coefficients stood in for the new ones."""
    retraction = _StepHalf()
    sigma = torch.logspace(-6, 2, 9, dtype=torch.float64).unsqueeze(-1)
    grad_cos, grad_k = torch.ones_like(sigma), torch.full_like(sigma, -0.5)
    c, k = retraction.coefficients(sigma)
    got = retraction.coefficients_vjp(sigma, c, k, grad_cos, grad_k)
    s = sigma.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(retraction.coefficients(s), s, (grad_cos, grad_k))
    assert float((got - want).abs().max()) <= 16 * EPS * float(want.abs().max())


@pytest.mark.parametrize(
    "retraction",
    [GnomonicRetraction(), CayleyRetraction(), PRetraction(3.0), get_retraction("sphere", "exp")],
    ids=["gnomonic", "cayley", "p=3", "exp"],
)
def test_the_long_step_form_has_the_tangent_projection_as_derivative_at_zero(retraction):
    # cos(theta) x + sin(theta) r v/||v|| has a zero Jacobian at v = 0 (v/||v|| is 0 there): the
    # long-step form gave 0 where the retraction's derivative is P_x; and its backward formed
    # (r/m)^2, which underflows past steps of ~1e154: NaN gradients for the rows it is taken for
    g = torch.Generator().manual_seed(5)
    radius = 1.3
    x = random_point(Sphere(radius), (3, 5), generator=g)
    v = random_tangent(Sphere(radius), x, scale=0.7, generator=g)
    v[0] = 0.0
    v[2] *= 1e200  # a step whose beta^2 overflows
    jac = torch.autograd.functional.jacobian(lambda w: retraction.retract_long_step(x, w, radius=radius), v)  # (3, 5, 3, 5)
    projection = torch.eye(5, dtype=torch.float64) - torch.outer(x[0], x[0]) / radius**2
    assert torch.allclose(jac[0, :, 0], projection, rtol=0, atol=4 * EPS)
    assert torch.allclose(jac[1, :, 1], torch.autograd.functional.jacobian(
        lambda w: retraction.retract(x[1], w, radius=radius), v[1]), rtol=0, atol=1e-14)
    assert torch.isfinite(jac).all() and float(jac[2, :, 2].abs().max()) < 2.0
    short = v[:2].clone().requires_grad_(True)  # v = 0 and a random tangent
    assert torch.autograd.gradcheck(lambda w: retraction.retract_long_step(x[:2], w, radius=radius), (short,),
                                    eps=1e-6, atol=1e-8, rtol=1e-6)
