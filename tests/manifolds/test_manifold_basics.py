"""One parametrized suite of geometric invariants for every manifold (geoopt's test model)."""

from __future__ import annotations

import geoopt
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib import DGram, Euclidean, Oblique, Sphere, Stiefel, get_manifold
from manifoldlib.manifolds import RetractionManifold, available_manifolds, default_tolerance
from manifoldlib.testing import random_point, random_tangent
from manifoldlib.testing import strategies as mst

EPS = torch.finfo(torch.float64).eps
MANIFOLDS = [Sphere(0.5), Sphere(3.0), Stiefel(), DGram(), Euclidean(ndim=1), Euclidean(ndim=2)]
IDS = ["sphere-r0.5", "sphere-r3", "stiefel", "dgram", "euclidean-1", "euclidean-2"]
CURVED = MANIFOLDS[:4]
CURVED_IDS = IDS[:4]


def _norm(t):
    return float(torch.linalg.vector_norm(t))


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(data=st.data())
def test_random_points_are_on_manifold_and_projx_fixes_them(manifold, data):
    x = data.draw(mst.points(manifold))
    ok, reason = manifold.check_point_on_manifold(x, explain=True, atol=0.0, rtol=1e-13)
    assert ok, reason
    assert _norm(manifold.projx(x) - x) <= 1e-13 * _norm(x)


@pytest.mark.parametrize("manifold", CURVED, ids=CURVED_IDS)
@given(data=st.data())
def test_projx_lands_on_manifold_and_is_idempotent(manifold, data):
    x = data.draw(mst.points(manifold))
    g = data.draw(mst.seeds())
    y = manifold.projx(
        x + 0.3 * torch.randn(x.shape, generator=g, dtype=x.dtype) * _norm(x) / x.numel() ** 0.5
    )
    ok, reason = manifold.check_point_on_manifold(y, explain=True, atol=0.0, rtol=1e-12)
    assert ok, reason
    assert _norm(manifold.projx(y) - y) <= 1e-12 * _norm(y)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(data=st.data())
def test_proju_is_an_orthogonal_projection(manifold, data):
    x = data.draw(mst.points(manifold))
    g = data.draw(mst.seeds())
    z = torch.randn(x.shape, generator=g, dtype=x.dtype)
    w = torch.randn(x.shape, generator=g, dtype=x.dtype)
    pz = manifold.proju(x, z)
    # the constraint residual of P z is cancellation-limited: O(eps ||x|| ||z||), not O(eps ||P z||)
    atol = 16 * EPS * max(1.0, _norm(x)) * _norm(z)
    ok, reason = manifold.check_vector_on_tangent(x, pz, explain=True, atol=atol, rtol=0.0)
    assert ok, reason
    assert _norm(manifold.proju(x, pz) - pz) <= 1e-13 * _norm(z)  # idempotent
    # self-adjoint: <P z, w> = <z, P w>
    lhs, rhs = manifold.inner(x, pz, w), manifold.inner(x, z, manifold.proju(x, w))
    assert torch.allclose(lhs, rhs, rtol=0, atol=1e-13 * _norm(z) * _norm(w))
    assert torch.equal(manifold.egrad2rgrad(x, z), pz)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_inner_is_symmetric_and_keepdim(manifold):
    g = torch.Generator().manual_seed(0)
    x = random_point(manifold, (3,) + ((5,) if manifold.ndim <= 1 else (5, 3)), generator=g)
    u, v = random_tangent(manifold, x, generator=g), random_tangent(manifold, x, generator=g)
    assert torch.equal(manifold.inner(x, u, v), manifold.inner(x, v, u))
    assert manifold.inner(x, u).shape == (3,)
    assert manifold.inner(x, u, keepdim=True).shape == (3,) + (1,) * manifold.ndim
    assert torch.allclose(manifold.inner(x, u), (u * u).flatten(1).sum(-1), rtol=1e-15, atol=0)


@pytest.mark.parametrize("manifold", CURVED, ids=CURVED_IDS)
def test_transport_lands_in_target_tangent_space(manifold):
    g = torch.Generator().manual_seed(1)
    x = random_point(manifold, (3,) + ((5,) if manifold.ndim == 1 else (5, 3)), generator=g)
    u, w = (
        random_tangent(manifold, x, scale=0.5, generator=g),
        random_tangent(manifold, x, generator=g),
    )
    y, tw = manifold.retr_transp(x, u, w)
    assert torch.equal(y, manifold.retr(x, u))
    ok, reason = manifold.check_vector_on_tangent(y, tw, explain=True, atol=0.0, rtol=1e-12)
    assert ok, reason
    assert torch.equal(manifold.transp_follow_retr(x, u, w), tw)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_random_respects_generator_dtype_and_shape(manifold, dtype):
    shape = (2, 6) if manifold.ndim <= 1 else (2, 6, 4)
    a = manifold.random(*shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    b = manifold.random(shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    assert a.shape == shape and a.dtype == dtype and torch.equal(a, b)
    assert manifold.check_point_on_manifold(a)  # dtype-aware default tolerance
    c = manifold.random(*shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("manifold", CURVED, ids=CURVED_IDS)
def test_check_point_explains_failures(manifold):
    x = random_point(
        manifold, (5,) if manifold.ndim == 1 else (5, 3), generator=torch.Generator().manual_seed(5)
    )
    bad = x * 1.1 if manifold.ndim == 1 else x + 0.1 * torch.ones_like(x)
    ok, reason = manifold.check_point_on_manifold(bad, explain=True)
    assert not ok and isinstance(reason, str) and "exceeds" in reason
    assert manifold.check_point_on_manifold(x, explain=True) == (True, None)
    with pytest.raises(ValueError, match="exceeds"):
        manifold.assert_check_point_on_manifold(bad)


def test_dgram_rejects_a_zero_column():
    x = DGram().random(5, 3, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    x[:, 1] = 0
    ok, reason = DGram().check_point_on_manifold(x, explain=True)
    assert not ok and "zero" in reason


@given(data=st.data())
def test_sphere_logmap_inverts_expmap_and_dist_is_arc_length(data):
    s = Sphere(1.7)
    x, v = data.draw(mst.point_and_tangent(s, scale=(0.0, 1.5)))  # β < π: no wrap-around
    y = s.expmap(x, v)
    assert _norm(s.logmap(x, y) - v) <= 1e-12 * max(1.0, _norm(v))
    assert torch.allclose(s.dist(x, y), v.norm(dim=-1), rtol=0, atol=1e-13)


def test_get_manifold_builds_every_family():
    assert available_manifolds() == ["dgram", "euclidean", "oblique", "sphere", "stiefel"]
    s = get_manifold("sphere", radius=2.0, retraction="p", p=1.5)
    assert isinstance(s, Sphere) and s.radius == 2.0 and s.retraction.options() == {"p": 1.5}
    assert get_manifold(s) is s
    assert isinstance(get_manifold("stiefel", retraction="qr"), Stiefel)
    assert (
        isinstance(get_manifold("dgram"), DGram)
        and get_manifold("dgram").retraction.name == "alternating"
    )
    assert get_manifold("euclidean", ndim=2).ndim == 2
    assert "retraction=" in repr(s) and "radius=2.0" in repr(s)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_every_manifold_is_a_retraction_manifold_of_geoopt(manifold):
    assert isinstance(manifold, RetractionManifold) and isinstance(manifold, geoopt.manifolds.Manifold)
    assert manifold.retraction.manifold == manifold.name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_default_tolerance_covers_every_float_dtype(dtype):
    # geoopt's tolerance table knows only float32/float64; ours is defined for every dtype
    tol = default_tolerance(dtype)
    assert tol >= 1e-5 and tol >= 16 * torch.finfo(dtype).eps
    assert tol == max(default_tolerance(torch.float64), 16 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("scale", [1.0, 2.5], ids=["on-manifold", "scaled"])
def test_stiefel_projx_has_finite_gradients_where_singular_values_repeat(scale):
    """At a Stiefel point (and any multiple of one) every singular value is the same, where the
    SVD's backward divides by their differences: the gradient of projx was NaN. The polar
    factor is smooth there; its derivative at a Stiefel point is the tangent projection."""
    m = Stiefel()
    g = torch.Generator().manual_seed(7)
    point = m.random(7, 3, generator=g, dtype=torch.float64)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64)
    x = (scale * point).requires_grad_(True)
    y = m.projx(x)
    (y * w).sum().backward()
    assert _norm(y.detach() - point) <= 1e-14
    torch.testing.assert_close(x.grad, m.proju(point, w) / scale, rtol=0, atol=1e-13)


def test_stiefel_projx_gradient_matches_finite_differences():
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    assert torch.autograd.gradcheck(Stiefel().projx, (x.requires_grad_(True),))


@pytest.mark.parametrize("manifold", [Stiefel(), DGram(), Sphere(2.0)], ids=["stiefel", "dgram", "sphere"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_assert_twins_agree_with_the_checks(manifold, dtype):
    """The assert_ twins kept geoopt's fixed 1e-5 tolerances: a bfloat16 Stiefel point passed
    check_point_on_manifold and failed assert_check_point_on_manifold."""
    g = torch.Generator().manual_seed(4)
    x = manifold.random(6, 3, generator=g, dtype=torch.float64)
    u = manifold.proju(x, torch.randn(6, 3, generator=g, dtype=torch.float64))
    w = torch.randn(6, 3, generator=g, dtype=torch.float64).to(dtype)  # neither point nor tangent
    xd, ud = x.to(dtype), u.to(dtype)
    assert manifold.check_point_on_manifold(xd) and manifold.check_vector_on_tangent(xd, ud)
    manifold.assert_check_point_on_manifold(xd)
    manifold.assert_check_vector_on_tangent(xd, ud)
    assert not manifold.check_point_on_manifold(w) and not manifold.check_vector_on_tangent(xd, w)
    with pytest.raises(ValueError, match="not lying on"):
        manifold.assert_check_point_on_manifold(w)
    with pytest.raises(ValueError, match="not lying on"):
        manifold.assert_check_vector_on_tangent(xd, w)
    with pytest.raises(ValueError, match="not lying on"):  # explicit tolerances still apply
        manifold.assert_check_point_on_manifold(xd + 0.05, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("shape", [(6, 3), (40, 10), (3, 12, 5)])
def test_stiefel_projx_is_the_same_point_with_and_without_a_gradient(shape):
    """The differentiable path (Newton's polar iteration) and the SVD path give one projection."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    plain = Stiefel().projx(x)
    traced = Stiefel().projx(x.clone().requires_grad_(True))
    assert traced.requires_grad and not plain.requires_grad
    assert _norm(traced.detach() - plain) <= 1e-13 * _norm(plain)


@pytest.mark.parametrize("manifold", [Oblique(), Stiefel()], ids=["oblique", "stiefel"])
def test_expmap_of_a_vector_with_a_normal_part_stays_on_the_manifold(manifold):
    # geoopt's momentum starts from the raw gradient; the Oblique geodesic formula
    # cos|v_j| w_j + sinc|v_j| v_j leaves the unit sphere unless w_j^T v_j = 0
    g = torch.Generator().manual_seed(3)
    x = manifold.random(3, 7, 4, generator=g, dtype=torch.float64)
    u = torch.randn(x.shape, generator=g, dtype=torch.float64) + 0.7 * x
    y = manifold.expmap(x, u)
    ok, reason = manifold.check_point_on_manifold(y, explain=True, atol=0.0, rtol=1e-13)
    assert ok, reason
    assert _norm(y - manifold.expmap(x, manifold.proju(x, u))) <= 1e-14 * _norm(y)


def _stiefel_spread_tangent(m, n, norms, seed):
    """A Stiefel point ``q`` and, built in float64 (oracle), a tangent vector ``u = Q_perp B + Q A``
    (``A`` skew) whose column norms are ``norms``; the frame ``[q, Q_perp]`` comes with them."""
    g = torch.Generator().manual_seed(seed)
    frame, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    q, perp = frame[:, :n], frame[:, n:]
    b = torch.randn(m - n, n, generator=g, dtype=torch.float64)
    b = b / b.norm(dim=0) * torch.as_tensor(norms, dtype=torch.float64)
    a = 1e-3 * torch.randn(n, n, generator=g, dtype=torch.float64)
    return q, perp @ b + q @ (a - a.mT)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("normal_to", [3, 2], ids=["own-column", "other-column"])
def test_stiefel_tangent_check_judges_each_entry_by_its_columns(dtype, normal_to):
    # one bound rtol max|U| for the whole matrix (0.05 here) let a fully normal column of norm 1e-2
    # pass next to columns of norm 1e4: u_3 = 1e-2 q_3 (|2 q_3^T u_3| = 2e-2) or u_3 = 1e-2 q_2 with
    # u_2 of norm 1e-2 too (|q_2^T u_3 + u_2^T q_3| ~ 1e-2)
    q, u = _stiefel_spread_tangent(30, 4, [1e4, 1e4, 1e-2, 1e-2], seed=0)
    s = q.mT @ u
    assert float((s + s.mT).abs().max()) <= 1e-11  # the oracle: tangent
    assert Stiefel().check_vector_on_tangent(q.to(dtype), u.to(dtype))
    bad = u.clone()
    bad[:, 3] = 1e-2 * q[:, normal_to]
    s = q.mT @ bad
    i, j = sorted((normal_to, 3))
    defect = float((s + s.mT)[i, j].abs())
    assert defect >= 0.5e-2  # the oracle: half the size of column 3, clearly normal
    ok, reason = Stiefel().check_vector_on_tangent(q.to(dtype), bad.to(dtype), explain=True)
    assert not ok
    assert f"columns {i}, {j}" in reason or f"columns {j}, {i}" in reason


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(30, 4), (256, 64), (3, 64, 64)], ids=str)
def test_stiefel_tangent_vectors_with_spread_column_norms_pass(dtype, shape):
    g = torch.Generator().manual_seed(11)
    q = Stiefel().random(*shape, generator=g, dtype=torch.float64)
    d = torch.logspace(-2, 4, shape[-1], dtype=torch.float64)[torch.randperm(shape[-1], generator=g)]
    z = torch.randn(shape, generator=g, dtype=torch.float64) * d
    u = Stiefel().proju(q, z)  # float64 tangent vector, rounded to dtype
    ok, reason = Stiefel().check_vector_on_tangent(q.to(dtype), u.to(dtype), explain=True)
    assert ok, reason
    ok, reason = Stiefel().check_vector_on_tangent(q.to(dtype), Stiefel().proju(q.to(dtype), z.to(dtype)), explain=True)
    assert ok, reason
