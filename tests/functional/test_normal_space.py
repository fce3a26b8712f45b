"""The normal-space formulas kept once in manifoldlib.functional, against direct constructions (float64)."""

from __future__ import annotations

import geoopt
import pytest
import torch

from manifoldlib.functional import (
    dgram_normal_multiplier,
    dgram_project_tangent,
    diagonal_part,
    normal_metric,
    normal_multiplier,
    oblique_constraint_deviation,
    oblique_exp,
    oblique_normalize,
    oblique_project_tangent,
    off_diagonal,
    stiefel_project_tangent,
)
from manifoldlib.manifolds import DGram, MatrixConstraintManifold, Oblique, Stiefel
from manifoldlib.optim import DualOptions
from manifoldlib.retractions import ObliqueNormalizeRetraction

F64 = torch.float64
EPS = torch.finfo(F64).eps


def _oblique_point(m, n, seed):
    z = torch.randn(m, n, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return z / z.norm(dim=0)


def test_masks_split_a_matrix():
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(0), dtype=F64)
    torch.testing.assert_close(diagonal_part(a) + off_diagonal(a), a, atol=0, rtol=0)
    assert torch.equal(diagonal_part(a), torch.diag(torch.diagonal(a)))


def test_normal_metric_is_the_mean_of_squared_norms():
    d2 = torch.tensor([1.0, 4.0, 9.0], dtype=F64)
    expected = torch.tensor([[1.0, 2.5, 5.0], [2.5, 4.0, 6.5], [5.0, 6.5, 9.0]], dtype=F64)
    torch.testing.assert_close(normal_metric(d2), expected, atol=0, rtol=0)


@pytest.mark.parametrize("mask", [diagonal_part, off_diagonal], ids=["diag", "off"])
def test_normal_multiplier_is_the_least_squares_normal_component(mask):
    # W S is the orthogonal projection of Z onto {W S : S = mask(S) symmetric}: Z - W S is
    # orthogonal to every normal direction W E, E = mask(E) symmetric
    gen = torch.Generator().manual_seed(1)
    q = torch.linalg.qr(torch.randn(9, 4, generator=gen, dtype=F64)).Q
    w = q * torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=F64)  # orthogonal columns (DGram-like)
    if mask is diagonal_part:
        w = _oblique_point(9, 4, seed=2)  # the diagonal constraint needs no orthogonal columns
    z = torch.randn(9, 4, generator=gen, dtype=F64)
    s = normal_multiplier(w, z, mask)
    torch.testing.assert_close(s, s.mT, atol=0, rtol=0)
    torch.testing.assert_close(mask(s), s, atol=0, rtol=0)
    rest = z - w @ s
    for i in range(4):
        for j in range(4):
            e = torch.zeros(4, 4, dtype=F64)
            e[i, j] = e[j, i] = 1.0
            if torch.equal(mask(e), e):
                assert abs(float((rest * (w @ e)).sum())) <= 1e-12


def test_oblique_kernels():
    gen = torch.Generator().manual_seed(3)
    w = _oblique_point(7, 3, seed=4)
    v = oblique_project_tangent(w, torch.randn(7, 3, generator=gen, dtype=F64))
    assert float((w * v).sum(0).abs().max()) <= 1e-14
    for y in (oblique_normalize(w, v), oblique_exp(w, v)):
        assert float(oblique_constraint_deviation(y).abs().max()) <= 1e-14
    # the exponential map moves each column by the angle ||v_j|| on its great circle
    angles = torch.arccos((w * oblique_exp(w, 0.3 * v / v.norm(dim=0))).sum(0).clamp(-1, 1))
    torch.testing.assert_close(angles, torch.full((3,), 0.3, dtype=F64), atol=1e-12, rtol=0)


def test_matrix_manifolds_share_one_base_and_the_oblique_retraction_is_registered():
    assert all(isinstance(m, MatrixConstraintManifold) for m in (Stiefel(), DGram(), Oblique()))
    assert isinstance(Oblique().retraction, ObliqueNormalizeRetraction)
    assert ObliqueNormalizeRetraction.order == 2


def test_dual_options_validate_once_and_are_plain_data():
    options = DualOptions.coerce({"tol": 1e-4, "update": "bb"})
    assert options.as_dict()["tol"] == 1e-4 and DualOptions.coerce(options.as_dict()) == options
    assert DualOptions.coerce(None) == DualOptions()
    with pytest.raises(ValueError, match="dual max_iter must be None or an int >= 0, got 1.5"):
        DualOptions(max_iter=1.5)
    with pytest.raises(TypeError, match="dual options must be None, a dict or a DualOptions, got list"):
        DualOptions.coerce([1])


@pytest.mark.parametrize("exponent", [20, 25, -20, -22, -25, -30], ids=str)
def test_float32_normal_multiplier_and_oblique_projection_at_any_column_scale(exponent):
    # d_i^2 + d_j^2 overflowed (columns of norm 1e20: NaN) or fell into the subnormals (1e-20:
    # 1.6e-6, 1e-22: 5e-3 off tangent relative; 1e-25: NaN) in float32
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(30, 6, generator=gen, dtype=F64) * 10.0**exponent).float()
    z = (torch.randn(30, 6, generator=gen, dtype=F64) * 10.0**exponent).float()
    ref = z.double() - w.double() @ normal_multiplier(w.double(), z.double(), diagonal_part)  # float64 oracle
    for out in (oblique_project_tangent(w, z), z - w @ normal_multiplier(w, z, diagonal_part)):
        assert bool(torch.isfinite(out).all())
        column_error = (out.double() - ref).norm(dim=-2) / ref.norm(dim=-2)
        assert float(column_error.max()) <= 1e-6, column_error.tolist()
        cosines = (w.double() * out.double()).sum(-2) / (w.double().norm(dim=-2) * out.double().norm(dim=-2))
        assert float(cosines.abs().max()) <= 1e-6


def test_oblique_projection_keeps_each_column_whatever_the_spread_of_column_norms():
    # one scale per column: norms from 1e-30 to 1e30 in one float32 matrix (a per-matrix scale
    # would leave the small columns' ||w_j||^2 at zero)
    gen = torch.Generator().manual_seed(12)
    d = torch.logspace(-30, 30, 6, dtype=F64)
    w = (torch.randn(30, 6, generator=gen, dtype=F64) * d).float()
    z = (torch.randn(30, 6, generator=gen, dtype=F64) * d).float()
    ref = oblique_project_tangent(w.double(), z.double())
    out = oblique_project_tangent(w, z)
    column_error = (out.double() - ref).norm(dim=-2) / ref.norm(dim=-2)
    assert float(column_error.max()) <= 1e-6, column_error.tolist()


def test_float64_oblique_projection_matches_the_multiplier_form():
    gen = torch.Generator().manual_seed(13)
    w = torch.randn(3, 11, 5, generator=gen, dtype=F64) * torch.logspace(-200, 200, 5, dtype=F64)
    z = torch.randn(3, 11, 5, generator=gen, dtype=F64)
    out = oblique_project_tangent(w, z)
    w1 = w / w.abs().amax(dim=-2, keepdim=True)
    w1 = w1 / w1.norm(dim=-2, keepdim=True)  # the same projection at unit columns
    ref = z - w1 * (w1 * z).sum(-2, keepdim=True)
    torch.testing.assert_close(out, ref, atol=1e-15, rtol=1e-13)
    torch.testing.assert_close(Oblique().proju(w1, z), ref, atol=1e-15, rtol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_oblique_tangent_check_judges_each_column_by_its_own_norm(dtype):
    # one bound rtol max|u| for the whole matrix let a fully normal column of norm 1e-2 pass next
    # to columns of norm 1e4
    x = _oblique_point(50, 4, seed=5)
    u = oblique_project_tangent(x, torch.randn(50, 4, generator=torch.Generator().manual_seed(6), dtype=F64))
    u = u / u.norm(dim=0) * torch.tensor([1e4, 1e4, 1e4, 1e-2], dtype=F64)
    assert Oblique().check_vector_on_tangent(x.to(dtype), u.to(dtype))
    bad = u.clone()
    bad[:, 3] = 1e-2 * x[:, 3]
    ok, reason = Oblique().check_vector_on_tangent(x.to(dtype), bad.to(dtype), explain=True)
    assert not ok and "column 3" in reason


@pytest.mark.parametrize("manifold", [Oblique(), DGram(), Stiefel()], ids=["oblique", "dgram", "stiefel"])
@pytest.mark.parametrize("dtype, exponent", [(torch.float32, 20), (torch.float64, 160)], ids=str)
def test_tangent_residual_of_a_huge_vector_is_its_relative_normal_part(manifold, dtype, exponent):
    # ||A||^2 overflowed (float32 entries 1e20, float64 1e160): inf / inf = NaN
    x = _oblique_point(30, 5, seed=7) if isinstance(manifold, Oblique) else Stiefel().random(
        30, 5, generator=torch.Generator().manual_seed(7), dtype=F64)
    z = torch.randn(30, 5, generator=torch.Generator().manual_seed(8), dtype=F64)
    ref = float((z - manifold.proju(x, z)).norm() / z.norm())  # float64 oracle at unit scale
    out = float(manifold.tangent_residual(x.to(dtype), (z * 10.0**exponent).to(dtype)))
    assert abs(out - ref) <= 1e-5 * ref if dtype == torch.float32 else abs(out - ref) <= 1e-13 * ref


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("largest", [1.0, 10.0, 100.0])
def test_oblique_exp_keeps_unit_columns_at_every_angle(dtype, largest):
    # cos and sin/theta of one theta, in at least float32: the column norm is 1 to the rounding of
    # the dtype at every angle (torch.sinc of the rounded theta/pi, in the input's dtype, put the
    # sine at another angle than the cosine: norms off by ~0.1 eps * theta, 9 to 11 eps for
    # angles up to 100 in every dtype)
    gen = torch.Generator().manual_seed(5)
    w = _oblique_point(64, 64, seed=6)
    v = oblique_project_tangent(w, torch.randn(64, 64, generator=gen, dtype=F64))
    v = torch.linspace(largest / 64, largest, 64, dtype=F64) * v / v.norm(dim=0)  # angles up to largest
    wd, vd = w.to(dtype), v.to(dtype)
    y = oblique_exp(wd, vd)
    assert y.dtype == dtype
    # ||y_j|| = 1 up to the rounding of the result and of the input columns' own norms
    eps = torch.finfo(dtype).eps
    w_deviation = float((wd.to(F64).norm(dim=0) - 1).abs().max())
    assert float((y.to(F64).norm(dim=0) - 1).abs().max()) <= 2 * eps + w_deviation


def test_oblique_exp_matches_the_sphere_exponential_map_column_by_column():
    gen = torch.Generator().manual_seed(7)
    w = _oblique_point(6, 3, seed=8)
    v = oblique_project_tangent(w, 2.0 * torch.randn(6, 3, generator=gen, dtype=F64))
    y = oblique_exp(w, v)
    sphere = geoopt.Sphere()
    for j in range(3):
        torch.testing.assert_close(y[:, j], sphere.expmap(w[:, j], v[:, j]), atol=4 * EPS, rtol=0)


def test_oblique_exp_has_a_finite_gradient_at_a_zero_step():
    w = _oblique_point(5, 2, seed=9)
    v = torch.zeros(5, 2, dtype=F64, requires_grad=True)
    (g,) = torch.autograd.grad((oblique_exp(w, v) * torch.arange(10.0, dtype=F64).reshape(5, 2)).sum(), v)
    assert bool(torch.isfinite(g).all())
    torch.testing.assert_close(g, torch.arange(10.0, dtype=F64).reshape(5, 2), atol=1e-15, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_oblique_expmap_of_long_low_precision_steps_stays_on_the_manifold(dtype):
    # computed in the input dtype, an angle ||v_j|| ~ 85 carried an absolute error of eps * 85
    # (0.7 rad in bfloat16) between cos and sinc: ||y_j||^2 - 1 reached 0.30 in bfloat16 (its
    # check allows 0.25) and 0.043 in float16 (0.031), and check_point_on_manifold failed
    gen = torch.Generator().manual_seed(11)
    manifold = Oblique()
    worst = 0.0
    for _ in range(20):
        w = manifold.random(8, 4, generator=gen, dtype=F64)
        v = manifold.proju(w, 30.0 * torch.randn(8, 4, generator=gen, dtype=F64))
        y = manifold.expmap(w.to(dtype), v.to(dtype))
        ok, reason = manifold.check_point_on_manifold(y, explain=True)
        assert ok, reason
        worst = max(worst, float((y.to(F64).norm(dim=0) - 1).abs().max()))
    assert worst <= 2 * torch.finfo(dtype).eps


def test_projection_kernels_compute_mixed_dtypes_in_the_promoted_one():
    """A float32 point with a float64 vector: stiefel_project_tangent, dgram_project_tangent and
    dgram_normal_multiplier raised torch's 'expected m1 and m2 to have the same dtype' from their
    products, and oblique_project_tangent, elementwise, formed the squared column norms of the
    point in float32. Each is now the float64 result of the point cast to float64, bit for bit."""
    g = torch.Generator().manual_seed(4)
    x = Stiefel().random(6, 3, generator=g, dtype=torch.float32)
    z = torch.randn(6, 3, generator=g, dtype=torch.float64)
    for kernel in (stiefel_project_tangent, dgram_project_tangent, dgram_normal_multiplier, oblique_project_tangent):
        out = kernel(x, z)
        assert out.dtype == torch.float64, kernel.__name__
        torch.testing.assert_close(out, kernel(x.double(), z), rtol=0, atol=0)
