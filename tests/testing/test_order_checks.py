"""manifoldlib.testing: the order measurement and assert_retraction catch what they promise to."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch

from manifoldlib import DGram, Euclidean, Sphere, Stiefel
from manifoldlib.functional import stiefel_polar, stiefel_qr
from manifoldlib.retractions import AngleRetraction, PRetraction, Retraction, StiefelCayleyRetraction
from manifoldlib.testing import (
    DEFAULT_TS,
    ORDER_TOLERANCE,
    assert_retraction,
    central_difference_error,
    random_point,
    random_tangent,
    retraction_order,
)


class NotOnSphere(AngleRetraction):
    """x + v: R(0) = x and DR(0) = id, but it leaves the sphere."""

    def retract(self, x, v, radius=None):
        return x + v


class Shifted(AngleRetraction):
    def retract(self, x, v, radius=None):
        return PRetraction(1.0).retract(x + 1e-6 * torch.roll(x, 1, -1), v, radius)


class DoubleSpeed(AngleRetraction):
    """θ = 2 arctan β: on the sphere, R(0) = x, but DR(0) = 2·id."""

    def angle(self, beta):
        return 2 * torch.atan(beta)


class TangentialKick(Retraction):
    """Gnomonic retraction of v + (||v||²/r²)·P_x(r e₀): smooth, DR(0) = id, but the quadratic
    term has a tangential part, so only first order."""

    manifold = "sphere"
    order = 1

    def __init__(self, strength=1.0):
        self.strength = strength

    def retract(self, x, v):
        r2 = (x * x).sum(-1, keepdim=True)
        e0 = torch.zeros_like(x)
        e0[..., 0] = 1.0
        kick = e0 * r2.sqrt() - (x * e0).sum(-1, keepdim=True) / r2 * x * r2.sqrt()  # P_x(r e₀)
        w = v + self.strength * (v * v).sum(-1, keepdim=True) / r2 * kick
        return PRetraction(1.0).retract(x, w)


class OffSphere(Retraction):
    """The gnomonic retraction times 1 + delta: second order (the error is radial), but every
    result is off the sphere by delta relative, which Sphere.retr rescales away."""

    manifold = "sphere"
    order = 2

    def __init__(self, delta=1e-6):
        self.delta = delta

    def retract(self, x, v):
        return PRetraction(1.0).retract(x, v) * (1.0 + self.delta)


class CubicNormDrift(Retraction):
    """The gnomonic retraction times 1 + c beta^3: R(0) = x, DR(0) = id, second order
    tangentially, and a norm error c beta^3 that grows with the step."""

    manifold = "sphere"
    order = 2

    def __init__(self, c=1e-6):
        self.c = c

    def retract(self, x, v):
        beta = torch.linalg.vector_norm(v, dim=-1, keepdim=True) / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return PRetraction(1.0).retract(x, v) * (1.0 + self.c * beta**3)


class QRClaimingTwo(Retraction):
    manifold = "stiefel"
    order = 2

    def retract(self, x, v):
        return stiefel_qr(x, v)


@pytest.mark.parametrize(
    "manifold,expected",
    [
        (Sphere(3.0, retraction="gnomonic"), 2.0),
        (Sphere(0.2, retraction="exp"), 2.0),
        (Stiefel(retraction="polar"), 2.0),
        (Stiefel(retraction="qr"), 1.0),
        (Stiefel(retraction="cayley"), 1.0),
        (DGram(retraction="alternating"), 2.0),
        (DGram(retraction="colnorm-polar"), 1.0),
        (Sphere(retraction=TangentialKick()), 1.0),
    ],
    ids=[
        "gnomonic",
        "exp",
        "polar",
        "qr",
        "st-cayley",
        "alternating",
        "colnorm",
        "tangential-kick",
    ],
)
def test_retraction_order_measures_the_exponent(manifold, expected):
    for seed in range(3):
        measured = retraction_order(manifold, generator=torch.Generator().manual_seed(seed))
        assert abs(measured - expected) < 0.05


def test_exact_retraction_measures_infinity():
    assert retraction_order(Euclidean(ndim=1)) == math.inf
    assert assert_retraction(Euclidean(ndim=1)) == math.inf


def test_retraction_order_uses_given_points_and_rescales_direction():
    s = Sphere(2.0, retraction="cayley")
    g = torch.Generator().manual_seed(0)
    x = random_point(s, (4, 6), generator=g)
    v = random_tangent(s, x, generator=g)
    a = retraction_order(s, x, v)
    b = retraction_order(s, x, 1e-3 * v)  # only the direction matters
    assert a == pytest.approx(b, abs=1e-8)
    # a non-tangent v is projected first
    c = retraction_order(s, x, v + 5.0 * x)
    assert c == pytest.approx(a, abs=1e-6)


def test_retraction_order_input_errors():
    s = Sphere()
    with pytest.raises(ValueError, match="ts must be a non-empty sequence of positive finite step sizes"):
        retraction_order(s, ts=())
    for ts in ((0.1, -0.01), (math.inf, 0.01)):  # inf: an error about non-finite values in 'u'
        with pytest.raises(ValueError, match=re.escape(f"positive finite step sizes, got {ts!r}")):
            retraction_order(s, ts=ts)
    x = s.random(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="direction v is zero"):
        retraction_order(s, x, torch.zeros_like(x))
    # in float32 the remainder at t = 1e-2 (~1e-6) is below the rounding floor (~1e-4):
    # that says nothing about the order, so it raises instead of reporting an exact retraction
    with pytest.raises(ValueError, match="rounding floor .* in torch.float32"):
        retraction_order(s, ts=(1e-2,), dtype=torch.float32)


def test_float32_measurement_with_large_steps():
    s = Sphere(retraction="cayley")
    measured = retraction_order(s, ts=(0.2, 0.1, 0.05), dtype=torch.float32)
    assert abs(measured - 2.0) < 0.2


def test_central_difference_error_is_second_order_in_h():
    s = Sphere(1.5, retraction="p", p=0.7)
    g = torch.Generator().manual_seed(2)
    x = random_point(s, (3, 5), generator=g)
    v = random_tangent(s, x, generator=g)
    errs = [central_difference_error(s, x, v, h) for h in (1e-1, 5e-2, 2.5e-2)]
    for a, b in zip(errs, errs[1:]):
        assert 3.8 < a / b < 4.2


def test_assert_retraction_passes_on_builtins_and_returns_measurement():
    assert abs(assert_retraction(Sphere(2.0, retraction="p", p=1.5)) - 2.0) < 0.05
    assert abs(assert_retraction(Stiefel(retraction="qr")) - 1.0) < 0.05
    assert abs(assert_retraction(Sphere(retraction=TangentialKick())) - 1.0) < 0.05


def test_assert_retraction_catches_off_manifold():
    with pytest.raises(AssertionError, match="off the manifold"):
        assert_retraction(Sphere(retraction=NotOnSphere()))


@pytest.mark.parametrize(
    "retraction,error",
    [(OffSphere(1e-6), "1.000e-06"), (OffSphere(1e-9), "1.000e-09"), (CubicNormDrift(1e-6), r"[0-9.]+e-0[67]")],
    ids=["off-by-1e-6", "off-by-1e-9", "cubic-drift"],
)
@pytest.mark.parametrize("radius", [1.0, 2.5])
def test_assert_retraction_reads_the_raw_result_not_the_rescaled_one(retraction, error, radius):
    """Sphere.retr rescales a result within 1e-5 of the radius onto the sphere, and the check
    went through it: a retraction off the sphere by 1e-6 (or with a norm error c beta^3,
    c = 1e-6) passed, while sphere_residual_reference uses retract's result unrescaled."""
    s = Sphere(radius, retraction=retraction)
    g = torch.Generator().manual_seed(0)
    x = s.random(3, 5, generator=g, dtype=torch.float64)
    v = s.proju(x, torch.randn(x.shape, generator=g, dtype=x.dtype))
    assert s.check_point_on_manifold(s.retr(x, v), atol=0.0, rtol=1e-12)  # what hid it
    raw_error = float((torch.linalg.vector_norm(retraction.retract(x, v), dim=-1) / radius - 1).abs().max())
    assert raw_error > 1e-10
    with pytest.raises(
        AssertionError,
        match=r"R_x\(1\.0·v\) as retract returns it is off the manifold \(Sphere\.retr rescales it "
        r"onto the sphere, SphereResidual uses it as it is\) \(rtol=1e-12\): \| \|\|x\|\|/r - 1 \| = " + error,
    ):
        assert_retraction(s)


def test_assert_retraction_catches_moved_base_point():
    with pytest.raises(AssertionError, match=r"R_x\(0\) != x"):
        assert_retraction(Sphere(retraction=Shifted()), manifold_rtol=1e-3)


class NaNAtZero(AngleRetraction):
    """The exponential map written as cos(b) x + sin(b) r v / ||v||, b = ||v|| / r, without a
    guard for v = 0: right for every step but the zero one, where it is 0/0."""

    order = 2

    def retract(self, x, v, radius=None):
        r, n = x.norm(dim=-1, keepdim=True), v.norm(dim=-1, keepdim=True)
        return torch.cos(n / r) * x + torch.sin(n / r) * r * v / n


@pytest.mark.parametrize("checked", [True, False], ids=["value-checks", "skip-value-checks"])
def test_assert_retraction_catches_a_nan_at_the_zero_step(checked):
    """R_x(0) was compared as ``dev > allowed``, which a NaN passes: inside skip_value_checks such a
    retraction passed (measured 2.000), outside it Sphere.retr's ValueError escaped instead of an
    AssertionError; the raw retract, which SphereResidual calls on a zero-initialized layer's zero
    step, was not asked at 0 at all."""
    from manifoldlib.manifolds import skip_value_checks

    message = r"R_x\(0\) != x as retract returns it: \|\|R_x\(0\) - x\|\| = nan"
    with pytest.raises(AssertionError, match=message), contextlib.nullcontext() if checked else skip_value_checks():
        assert_retraction(Sphere(2.5, retraction=NaNAtZero()))


def test_assert_retraction_catches_wrong_derivative():
    with pytest.raises(AssertionError, match="derivative at 0 is not the identity"):
        assert_retraction(Sphere(retraction=DoubleSpeed()))


def test_assert_retraction_catches_overclaimed_order():
    with pytest.raises(
        AssertionError, match=r"claims order 2 but the measured order is (0\.9|1\.0)"
    ):
        assert_retraction(Stiefel(retraction=QRClaimingTwo()))
    with pytest.raises(AssertionError, match="claims order 2"):
        assert_retraction(Sphere(retraction=TangentialKick()), order=2)


def test_assert_retraction_catches_a_small_first_order_term_under_an_order_2_claim():
    # e(t) = 3e-4 c t^2 + d t^3: the cubic term dominates at the larger steps, the median over
    # all steps measures 1.9; the smallest steps show the first-order term (1.1). With the
    # smallest step 1e-3 (before DEFAULT_TS reached 1e-4) this passed, as every strength below
    # 1e-3 did
    weak = Sphere(retraction=TangentialKick(3e-4))
    assert retraction_order(weak) > 2.0 - ORDER_TOLERANCE
    with pytest.raises(AssertionError, match=r"claims order 2 but at the smallest steps \(t = 0.0001, 0.0002, 0.0005\)"):
        assert_retraction(weak, order=2)


class SphereUnitKick(Retraction):
    """The gnomonic retraction of v + c (||v||/r)^2 r u, u a fixed unit tangent direction: a
    tangential defect c t^2 under a second-order retraction (stays on the sphere)."""

    manifold = "sphere"
    order = 2

    def __init__(self, c):
        self.c = c

    def retract(self, x, v):
        r2 = (x * x).sum(-1, keepdim=True)
        e0 = torch.zeros_like(x)
        e0[..., 0] = 1.0
        u = e0 - (x * e0).sum(-1, keepdim=True) / r2 * x
        u = u / torch.linalg.vector_norm(u, dim=-1, keepdim=True) * r2.sqrt()
        return PRetraction(1.0).retract(x, v + self.c * (v * v).sum(-1, keepdim=True) / r2 * u)


class StiefelUnitKick(Retraction):
    """The polar retraction of V + c ||V||^2 U, U a fixed unit tangent direction: a tangential
    defect c t^2 under a second-order retraction."""

    manifold = "stiefel"
    order = 2

    def __init__(self, c):
        self.c = c

    def retract(self, x, v):
        e = torch.zeros_like(x)
        e[..., 0, 1], e[..., 2, 0] = 1.0, -0.5
        xte = x.transpose(-1, -2) @ e
        u = e - x @ (0.5 * (xte + xte.transpose(-1, -2)))  # P_X(E)
        u = u / torch.linalg.matrix_norm(u, keepdim=True)
        return stiefel_polar(x, v + self.c * (v * v).sum((-2, -1), keepdim=True) * u)


@pytest.mark.parametrize(
    "manifold",
    [Sphere(retraction=SphereUnitKick(2e-4)), Stiefel(retraction=StiefelUnitKick(2e-4))],
    ids=["sphere", "stiefel"],
)
def test_the_smallest_steps_reach_1e_4_and_catch_a_tangential_defect_of_2e_4(manifold):
    """With the smallest step 1e-3 a defect c t^2 under an order-2 claim passed up to
    c = 3e-4 (sphere) and 5.6e-4 (Stiefel); with 1e-4 everything from c = 1e-4 fails."""
    with pytest.raises(AssertionError, match=r"claims order 2 but at the smallest steps \(t = 0.0001, 0.0002, 0.0005\)"):
        assert_retraction(manifold)
    for seed in range(3):
        with pytest.raises(AssertionError, match="claims order 2"):
            assert_retraction(manifold, generator=torch.Generator().manual_seed(seed))


def test_assert_retraction_catches_underclaimed_order():
    with pytest.raises(AssertionError, match="claims order 1 .* raise its order to 2"):
        assert_retraction(Sphere(retraction="cayley"), order=1)


def test_assert_retraction_argument_errors():
    with pytest.raises(ValueError, match="order must be 1 or 2, got 3"):
        assert_retraction(Sphere(), order=3)
    bad = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="base point x is not on sphere"):
        assert_retraction(Sphere(), x=bad)


@pytest.mark.parametrize("option, value, needle", [
    ("manifold_rtol", math.inf, "manifold_rtol must be a finite number >= 0, got inf"),  # skipped the check
    ("zero_rtol", math.nan, "zero_rtol must be a finite number >= 0, got nan"),  # 'R_x(0) != x'
    ("order_tolerance", 1.0, r"order_tolerance must be a number in \[0, 0.5\), got 1.0"),
])
def test_assert_retraction_refuses_tolerances_that_would_decide_the_result(option, value, needle):
    """A first-order QR retraction claiming order 2 passed with order_tolerance=1.0 (and with
    manifold_rtol=inf a retraction off the manifold); a NaN tolerance failed a correct retraction
    with a reason that blamed it."""
    with pytest.raises(ValueError, match=needle):
        assert_retraction(Stiefel(retraction="qr"), order=2, **{option: value})


def test_assert_retraction_accepts_float32_points():
    s = Stiefel(retraction="polar")
    x = s.random(2, 5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    # cast to float64 and re-checked there: a float32 point is on Stiefel only to ~1e-7
    with pytest.raises(ValueError, match="not on stiefel"):
        assert_retraction(s, x=x.double() + 1e-3)
    assert abs(assert_retraction(s, x=s.projx(x.double())) - 2.0) < 0.05


def test_order_depends_on_shape_where_theory_says_so():
    # On square Stiefel (the orthogonal group) the Euclidean and canonical metrics agree up to a
    # factor, so Cayley is second order there; with one column DGram is R^m minus 0 and both
    # DGram retractions return W + V exactly. The default shapes (m > n >= 2) avoid both.
    g = torch.Generator().manual_seed(0)
    square = Stiefel().random(2, 4, 4, generator=g, dtype=torch.float64)
    assert abs(retraction_order(Stiefel(retraction="cayley"), square) - 2.0) < 0.05
    column = DGram().random(2, 5, 1, generator=g, dtype=torch.float64)
    assert retraction_order(DGram(retraction="colnorm-polar"), column) == math.inf


class CayleyClaimingTwo(StiefelCayleyRetraction):
    """A user's Cayley that claims order 2 (it is, for the canonical metric): first order on tall
    points for the Euclidean metric the check measures."""

    order = 2


class CayleyBecomesPolar(StiefelCayleyRetraction):
    order = 2

    def retract(self, x, v):
        return stiefel_polar(x, v)


def test_an_order_set_in_a_subclass_is_the_claim_at_every_shape():
    # the inherited order_at read 1 on tall points: the order-2 claim of CayleyClaimingTwo passed
    # there unchecked, and the second-order CayleyBecomesPolar was told to raise its order to 2
    with pytest.raises(AssertionError, match=r"claims order 2 but the measured order is (0\.9|1\.0)"):
        assert_retraction(Stiefel(retraction=CayleyClaimingTwo()))
    assert abs(assert_retraction(Stiefel(retraction=CayleyBecomesPolar())) - 2.0) < 0.05
    assert abs(assert_retraction(Stiefel(retraction="cayley")) - 1.0) < 0.05  # the built-in's order_at
    square = Stiefel().random(2, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert abs(assert_retraction(Stiefel(retraction="cayley"), x=square) - 2.0) < 0.05


def test_a_given_point_drawn_with_seed_0_gets_a_generic_tangent():
    """With a point and no generator the tangent came from seed 0 too: for a point drawn with
    manual_seed(0) that is the point's own Gaussian, and on Stiefel P_X(XR) = X skew(R) is a
    vertical direction, along which Cayley is second order. The built-in Cayley measured 2.000 on
    5x3 points ('raise its order to 2'), and a Cayley claiming 2 passed."""
    st = Stiefel()
    x = st.random(2, 5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert abs(retraction_order(Stiefel(retraction="cayley"), x) - 1.0) < 0.05
    assert abs(assert_retraction(Stiefel(retraction="cayley"), x=x) - 1.0) < 0.05
    with pytest.raises(AssertionError, match=r"claims order 2 but the measured order is (0\.9|1\.0)"):
        assert_retraction(Stiefel(retraction="cayley"), order=2, x=x)


def test_default_step_sizes_and_tolerance():
    # docs/theory/retractions.rst, Measuring the order: ratio e(t)/e(t/2) for t in [1e-4, 1e-1]
    assert min(DEFAULT_TS) == 1e-4 and max(DEFAULT_TS) == 1e-1 and len(set(DEFAULT_TS)) == len(DEFAULT_TS)
    s = Sphere(retraction="cayley")
    assert retraction_order(s) == retraction_order(s, ts=DEFAULT_TS)  # the default
    # the tolerance separates the two claims: a first-order measurement (about 1) is not
    # within it of 2, and a second-order one (about 2) is not within it of 1
    assert 0 < ORDER_TOLERANCE < 0.5
    with pytest.raises(AssertionError, match="claims order 1"):
        assert_retraction(s, order=1, order_tolerance=ORDER_TOLERANCE)
