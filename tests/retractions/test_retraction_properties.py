"""Invariants every registered retraction must satisfy, parametrized over the registry.

A new ``register_retraction`` call is covered automatically: the cases come from
:func:`manifoldlib.testing.registered_manifolds`, which reads the registry.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifoldlib import get_manifold
from manifoldlib.functional.msign import POLAR_METHODS
from manifoldlib.testing import (
    assert_retraction,
    random_point,
    random_tangent,
    registered_manifolds,
    remainder_norms,
    retraction_order,
)
from manifoldlib.testing import strategies as mst
from manifoldlib.testing.sampling import default_shape

CASES = registered_manifolds()
IDS = [case_id for case_id, _ in CASES]
MANIFOLDS = [m for _, m in CASES]
FIRST_ORDER = {"stiefel-qr", "stiefel-cayley", "dgram-colnorm-polar"}

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps


def _sample(manifold, seed, dtype=torch.float64, scale=1.0, batch=3):
    g = torch.Generator().manual_seed(seed)
    x = random_point(manifold, default_shape(manifold, batch), generator=g, dtype=dtype)
    return x, random_tangent(manifold, x, scale=scale, generator=g)


def test_registry_cases_cover_every_family():
    families = {case_id.split("-")[0] for case_id in IDS}
    assert families == {"sphere", "stiefel", "dgram", "oblique", "euclidean"}
    assert FIRST_ORDER <= set(IDS)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(data=st.data())
def test_result_on_manifold_float64(manifold, data):
    x, v = data.draw(mst.point_and_tangent(manifold, scale=(0.0, 1.0)))
    y = manifold.retr(x, v)
    assert y.shape == x.shape and y.dtype == torch.float64
    ok, reason = manifold.check_point_on_manifold(y, explain=True, atol=0.0, rtol=1e-12)
    assert ok, reason


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(data=st.data())
def test_raw_result_on_manifold_float64(manifold, data):
    """What ``retract`` itself returns, before Sphere.retr rescales it (the sphere residual layers
    use it as it is): assert_retraction judges this at rtol 1e-12."""
    x, v = data.draw(mst.point_and_tangent(manifold, scale=(0.0, 1.0)))
    retraction = manifold.retraction
    if manifold.name == "sphere":  # as Sphere.retr calls it, and as the layers do
        ys = [retraction.retract(x, v, radius=manifold.radius), retraction.retract(x, v, radius=None)]
    else:
        ys = [retraction.retract(x, v)]
    for y in ys:
        ok, reason = manifold.check_point_on_manifold(y, explain=True, atol=0.0, rtol=1e-12)
        assert ok, reason


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_a_vector_with_a_normal_part_still_lands_on_the_manifold(manifold, dtype, rtol):
    """geoopt's momentum starts from the raw gradient: the first retraction sees a non-tangent
    vector (the exponential maps of the sphere and Stiefel used to leave the manifold)."""
    x, v = _sample(manifold, 11, dtype=dtype)
    g = v + 0.7 * x  # normal to the sphere, Stiefel and Oblique (on DGram x is a tangent scaling)
    y = manifold.retr(x, g)
    ok, reason = manifold.check_point_on_manifold(y, explain=True, atol=0.0, rtol=rtol)
    assert ok, reason


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(data=st.data())
def test_result_on_manifold_float32(manifold, data):
    x, v = data.draw(mst.point_and_tangent(manifold, dtype=torch.float32, scale=(0.0, 1.0)))
    y = manifold.retr(x, v)
    assert y.dtype == torch.float32
    # 64 eps: a few dozen rounding errors of O(m n) float32 products
    ok, reason = manifold.check_point_on_manifold(y, explain=True, atol=0.0, rtol=64 * EPS32)
    assert ok, reason


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@given(x=st.data())
def test_zero_step_is_identity(manifold, x):
    point = x.draw(mst.points(manifold))
    y = manifold.retr(point, torch.zeros_like(point))
    err = torch.linalg.vector_norm(y - point)
    assert err <= _zero_step_tolerance(manifold, point) * torch.linalg.vector_norm(point)


def _zero_step_tolerance(manifold, x):
    """Relative bound on ||R_x(0) - x||: 10 eps for closed forms; a backward-stable SVD or QR of an
    n-column matrix with condition number kappa (DGram: ratio of squared column norms, since
    the alternating step factors Y diag(c)) is exact to O(n kappa eps)."""
    if manifold.ndim < 2:
        return 10 * EPS64
    d2 = (x * x).sum(-2)  # (..., n) squared column norms
    kappa = float((d2.amax(-1) / d2.amin(-1)).max()) ** (1.0 if manifold.name == "dgram" else 0.0)
    return 10 * EPS64 * x.shape[-1] * kappa


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_jacobian_at_zero_is_identity_on_tangent_space(manifold, seed):
    x, u = _sample(manifold, seed)
    _, ju = torch.autograd.functional.jvp(lambda v: manifold.retr(x, v), torch.zeros_like(x), u)
    assert torch.linalg.vector_norm(ju - u) <= 1e-10 * torch.linalg.vector_norm(u)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_measured_order_equals_claim(manifold, seed):
    measured = assert_retraction(manifold, generator=torch.Generator().manual_seed(seed))
    expected = manifold.retraction.order
    if math.isinf(measured):
        assert expected == 2
    else:
        assert abs(measured - expected) < 0.1


@pytest.mark.parametrize(
    "manifold", [m for i, m in CASES if i in FIRST_ORDER], ids=[i for i in IDS if i in FIRST_ORDER]
)
def test_first_order_controls_have_ratio_four(manifold):
    # docs/theory/retractions.rst, Measuring the order: e(t)/e(t/2) ≈ 4 for a first-order
    # retraction, for t in [1e-4, 1e-1]
    x, v = _sample(manifold, 5)
    v = v * (torch.linalg.vector_norm(x) / torch.linalg.vector_norm(v))
    ts = [1e-2, 5e-3, 2e-3, 1e-3]
    e = remainder_norms(manifold, x, v, ts)
    e_half = remainder_norms(manifold, x, v, [t / 2 for t in ts])
    for a, b in zip(e, e_half):
        assert 3.8 < a / b < 4.2
    assert manifold.retraction.order == 1


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_finite_gradients_at_zero_step(manifold):
    x, w = _sample(manifold, 3)
    x = x.clone().requires_grad_(True)
    v = torch.zeros_like(x, requires_grad=True)
    y = manifold.retr(x, v)
    (y * w).sum().backward()
    assert torch.isfinite(v.grad).all() and torch.isfinite(x.grad).all()
    # <grad_v, u> = <w, DR(0) u> = <w, u> for tangent u, i.e. P_x(grad_v) = P_x(w)
    xd = x.detach()
    err = torch.linalg.vector_norm(manifold.proju(xd, v.grad) - manifold.proju(xd, w))
    assert err <= 1e-10 * torch.linalg.vector_norm(w)


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_finite_gradients_float32_at_zero_step(manifold):
    x, _ = _sample(manifold, 4, dtype=torch.float32)
    v = torch.zeros_like(x, requires_grad=True)
    manifold.retr(x, v).square().sum().backward()
    assert v.grad.dtype == torch.float32 and torch.isfinite(v.grad).all()


def _unit_columns_with_repeated_singular_values(m: int, seed: int) -> torch.Tensor:
    """``(m, 4)`` with unit columns and singular values ``sqrt(1 ± 0.5)``, each twice."""
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(m, 4, generator=g, dtype=torch.float64))[0]
    block = torch.tensor([[1.0, 0.5], [0.0, 0.75**0.5]], dtype=torch.float64)  # unit columns, cosine 0.5
    return q @ torch.block_diag(block, block)


@pytest.mark.parametrize("method", POLAR_METHODS)
@pytest.mark.parametrize(("family", "name"), [("stiefel", "polar"), ("dgram", "alternating"),
                                              ("dgram", "colnorm-polar")])
def test_every_named_polar_method_differentiates_at_repeated_singular_values(family, name, method):
    # a zero step makes every singular value of the polar factor's argument 1 (DGram colnorm-polar:
    # Y D_Y^{-1} = Q): method="svd" named explicitly gave NaN gradients there (autograd through
    # torch.linalg.svd divides by sigma_i^2 - sigma_j^2), "newton-schulz" the derivative of the
    # zero iterations it ran (Jacobian off by up to 2.2), and "svd" / "gram-eigh" were off by 0.08
    # to 0.6 where the argument has singular values sqrt(0.5), sqrt(0.5), sqrt(1.5), sqrt(1.5).
    # Checked against finite differences at u = 0, at a generic u, and at that repeated u
    manifold = get_manifold(family, retraction=name, method=method)
    g = torch.Generator().manual_seed(11)
    x = torch.linalg.qr(torch.randn(7, 4, generator=g, dtype=torch.float64))[0]
    if family == "dgram":
        x = x * torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    steps = {
        "zero": torch.zeros_like(x),
        "generic": manifold.proju(x, 0.3 * torch.randn(7, 4, generator=g, dtype=torch.float64)),
        # Y = Y D_Y^{-1}: unit columns
        "repeated": _unit_columns_with_repeated_singular_values(7, 12) - x,
    }
    for where, u in steps.items():
        u = u.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda t: manifold.retr(x, t), (u,), eps=1e-6, atol=1e-8,
                                        rtol=1e-6), where


@pytest.mark.parametrize(("family", "name"), [("stiefel", "polar"), ("dgram", "colnorm-polar")])
def test_svd_polar_gradient_float32_at_zero_step_matches_float64(family, name):
    manifold = get_manifold(family, retraction=name, method="svd")
    x, w = _sample(manifold, 5)
    grads = []
    for dtype in (torch.float64, torch.float32):
        v = torch.zeros_like(x, dtype=dtype, requires_grad=True)
        (manifold.retr(x.to(dtype), v) * w.to(dtype)).sum().backward()
        grads.append(v.grad.double())
    assert torch.isfinite(grads[1]).all()
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) <= 20 * EPS32


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_smoke(manifold, dtype):
    x, v = _sample(manifold, 6, scale=0.3)
    xh, vh = x.to(dtype), v.to(dtype)
    y = manifold.retr(xh, vh)
    assert y.dtype == dtype and y.shape == x.shape and torch.isfinite(y).all()
    # rounding of the half inputs alone moves the result by O(eps(dtype)); the float64 reference
    # starts from the rounded point put back on the manifold (a sphere refuses a point whose
    # norm is off by bfloat16's rounding at float64's tolerance)
    x64 = manifold.projx(xh.double())
    reference = manifold.retr(x64, manifold.proju(x64, vh.double()))
    rel = torch.linalg.vector_norm(y.double() - reference) / torch.linalg.vector_norm(reference)
    assert rel <= 8 * torch.finfo(dtype).eps


@pytest.mark.parametrize("manifold", MANIFOLDS, ids=IDS)
def test_batched_equals_one_by_one(manifold):
    x, v = _sample(manifold, 7)
    y = manifold.retr(x, v)
    for i in range(x.shape[0]):
        yi = manifold.retr(x[i], v[i])
        assert torch.allclose(yi, y[i], rtol=0, atol=1e-13 * float(torch.linalg.vector_norm(x[i])))


def test_order_tolerates_float32_inputs_by_measuring_in_float64():
    # retraction_order casts x and v to its dtype: a float32 point measured in float64 shows order 2
    sphere = dict(CASES)["sphere-cayley"]
    x, v = _sample(sphere, 8, dtype=torch.float32)
    x = sphere.projx(x.double())
    assert abs(retraction_order(sphere, x, v) - 2.0) < 0.05


@pytest.mark.parametrize("shape,expected", [((6, 6), 2), ((10, 10), 2), ((8, 4), 1), ((7, 6), 1)])
def test_stiefel_cayley_order_depends_on_the_shape(shape, expected):
    from manifoldlib import Stiefel
    from manifoldlib.testing import retraction_order

    manifold = Stiefel(retraction="cayley")
    gen = torch.Generator().manual_seed(1)
    x = manifold.random(*shape, generator=gen, dtype=torch.float64)
    assert manifold.retraction.order_at(shape) == expected
    assert abs(retraction_order(manifold, x, generator=gen) - expected) < 0.1
    measured = assert_retraction(manifold, x=x, generator=gen)  # checks against order_at
    assert abs(measured - expected) < 0.1


def _polar_in_40_digits(y: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor of a tall float64 ``(m, n)`` matrix, :math:`Y(Y^\top Y)^{-1/2}`
    in 40-digit arithmetic (the float64 SVD itself loses the small columns of a graded matrix)."""
    mpmath = pytest.importorskip("mpmath")

    with mpmath.workdps(40):
        a = mpmath.matrix(y.tolist())
        lam, vec = mpmath.eigsy(a.T * a)
        rsqrt = vec * mpmath.diag([1 / mpmath.sqrt(lam[i]) for i in range(y.shape[1])]) * vec.T
        return torch.tensor((a * rsqrt).tolist(), dtype=torch.float64)


@pytest.mark.parametrize("dtype, spread, tol", [(torch.float32, 1e3, 2e-6), (torch.float32, 1e5, 2e-6),
                                                 (torch.float64, 1e5, 1e-14)])
@pytest.mark.parametrize("shape", [(20, 5), (8, 8)])
def test_dgram_alternating_resolves_every_column_when_column_norms_spread(dtype, spread, tol, shape):
    # the polar factor is taken of Y diag(c), column norms c_j^2: an SVD maps the small ones to 0
    # from a column-norm spread of about 1e3 in float32 (the point's column collapsed to zero,
    # relative column error 1.0, silently) and resolves them only to ~eps c_max^2 / c_j^2 below
    # that (9e-9 in float64 at a spread of 1e5); every column must match the oracle relative to
    # its own norm
    from manifoldlib import DGram

    manifold = DGram()
    g = torch.Generator().manual_seed(5)
    m, n = shape
    q = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))[0]
    d = spread ** torch.linspace(-0.5, 0.5, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
    x = q * d  # (m, n), column norms from spread^-1/2 to spread^1/2
    v = manifold.proju(x, 0.1 * torch.randn(m, n, generator=g, dtype=torch.float64) * d)
    x, v = x.to(dtype), v.to(dtype)
    y = (x + v).double()  # the input as rounded, in float64
    polar = _polar_in_40_digits(y * y.norm(dim=-2, keepdim=True))  # (m, n)
    ref = polar * (polar * y).sum(-2, keepdim=True)  # Q' diag(q_j'^T y_j)
    out = manifold.retr(x, v).double()
    column_error = (out - ref).norm(dim=-2) / ref.norm(dim=-2)  # (n,)
    assert float(column_error.max()) <= tol, column_error.tolist()


@pytest.mark.parametrize("dtype, spread, tol", [(torch.float64, 1e1, 1e-14), (torch.float64, 1e2, 1e-14),
                                                 (torch.float64, 1e3, 1e-14), (torch.float64, 1e5, 1e-14),
                                                 (torch.float32, 1e1, 2e-6), (torch.float32, 1e3, 2e-6)])
@pytest.mark.parametrize("shape", [(20, 5), (8, 8), (2, 12, 6)], ids=str)
def test_dgram_gram_eigh_retraction_resolves_every_column_when_column_norms_spread(dtype, spread, tol, shape):
    # the optimizer's DGram retraction (alternating, method="gram-eigh"): the eigh of the Gram
    # matrix of Y diag(c), graded like the fourth power of the column-norm spread, resolved its
    # small eigenvalues only to eps * largest, and one pass was kept up to kappa^2 eps = 1e-6: at a
    # spread of 1e2 in float64 the columns came back off orthogonality by up to 1e-9 (column
    # error 2e-8); the refinement in column-scaled variables brings both to rounding
    from manifoldlib import DGram

    manifold = DGram(retraction="alternating", method="gram-eigh")
    g = torch.Generator().manual_seed(7)
    *batch, m, n = shape
    q = torch.linalg.qr(torch.randn(*batch, m, n, generator=g, dtype=torch.float64))[0]
    d = spread ** torch.linspace(-0.5, 0.5, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
    x = q * d
    v = manifold.proju(x, 0.3 * torch.randn(*batch, m, n, generator=g, dtype=torch.float64) * d / math.sqrt(m))
    x, v = x.to(dtype), v.to(dtype)
    out = manifold.retr(x, v).double()
    y = (x + v).double().reshape(-1, m, n)
    for k, (yk, ok) in enumerate(zip(y, out.reshape(-1, m, n))):
        polar = _polar_in_40_digits(yk * yk.norm(dim=-2, keepdim=True))
        ref = polar * (polar * yk).sum(-2, keepdim=True)
        column_error = (ok - ref).norm(dim=-2) / ref.norm(dim=-2)
        assert float(column_error.max()) <= tol, (k, column_error.tolist())
        unit = ok / ok.norm(dim=-2, keepdim=True)
        cosines = (unit.mT @ unit - torch.eye(n, dtype=torch.float64)).abs().max()
        assert float(cosines) <= tol / 2, (k, float(cosines))
