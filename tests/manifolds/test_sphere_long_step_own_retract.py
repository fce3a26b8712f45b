"""Sphere.retr's long-step fallback runs the retraction's own map or none: where beta^2 overflows
and ``retract`` returns a row off the sphere, ``retract_long_step`` (the angle form, from
``angle``) is taken only when ``retract`` is the angle form too or the class writes its own
long-step form; a ``retract`` of its own otherwise raises instead of returning the angle form's
point (module docstring of ``manifoldlib.retractions.sphere``, *Whose map runs*)."""

from __future__ import annotations

import math

import pytest
import torch

from manifoldlib import Sphere
from manifoldlib.functional import cayley_coefficients, sphere_project_tangent
from manifoldlib.retractions import (
    AngleRetraction,
    CayleyRetraction,
    ExponentialRetraction,
    GnomonicRetraction,
    PRetraction,
)

RADIUS = 2.0
# normalized step lengths whose square overflows the dtype (float32 past 1.8e19, float64 past 1.3e154)
LONG = [(torch.float32, 1e20), (torch.float64, 1e160)]
_CAYLEY = CayleyRetraction()
_EXPONENTIAL = ExponentialRetraction()


class _GnomonicExpRetract(GnomonicRetraction):
    """A built-in's subclass whose retract is the exponential map (NaN where beta^2 overflows)."""

    def retract(self, x, v, radius=None):
        return _EXPONENTIAL.retract(x, v, radius)


class _GnomonicCayleyRetract(GnomonicRetraction):
    """The Cayley map written out, ((1 - sigma/4) x + v) / (1 + sigma/4): inf / inf, NaN, for a long step."""

    def retract(self, x, v, radius=None):
        r_sq = (x * x).sum(-1, keepdim=True) if radius is None else radius * radius
        v = sphere_project_tangent(x, v, r_sq)
        quarter = 0.25 * (v * v).sum(-1, keepdim=True) / r_sq
        return ((1.0 - quarter) * x + v) / (1.0 + quarter)


class _CayleyWithLongStep(_GnomonicCayleyRetract):
    """The same map with its own long-step form: Cayley's angle, 2 arctan(beta/2)."""

    def retract_long_step(self, x, v, radius=None):
        return _CAYLEY.retract_long_step(x, v, radius)


class _ExpBelowCayleyLongStep(_CayleyWithLongStep):
    """A retract of its own again (the exponential map) below a class whose long step is Cayley's."""

    def retract(self, x, v, radius=None):
        return _EXPONENTIAL.retract(x, v, radius)


class _ForwardToCayleyWithLongStep(_CayleyWithLongStep):
    def retract(self, x, v, radius=None):
        return super().retract(x, v, radius)


class _ForwardToGnomonic(GnomonicRetraction):
    def retract(self, point, step, radius=None):
        """A pure forward: the angle form, so the angle form's long step."""
        return super().retract(point, step, radius=radius)


class _GnomonicLongCayleyRetract(GnomonicRetraction):
    """A retract of its own that takes long steps itself: the Cayley map from its angle, no squares."""

    def retract(self, x, v, radius=None):
        return _CAYLEY.retract_long_step(x, v, radius)


def _long_step(dtype, beta):
    s = Sphere(RADIUS)
    x = s.random(4, 5, generator=torch.Generator().manual_seed(0), dtype=dtype)
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    u = s.proju(x, z)
    u_hat = u / u.norm(dim=-1, keepdim=True)
    return x, (beta * RADIUS) * u_hat, u_hat


@pytest.mark.parametrize("dtype, beta", LONG)
@pytest.mark.parametrize("retraction", [_GnomonicExpRetract(), _GnomonicCayleyRetract(), _ExpBelowCayleyLongStep()],
                         ids=["gnomonic+exp-retract", "gnomonic+cayley-retract", "exp-retract-below-cayley-long-step"])
def test_a_long_step_of_a_retract_of_its_own_raises_naming_why(retraction, dtype, beta):
    # it used to return the inherited long step's point: the gnomonic limit r u_hat (angle pi/2)
    # for a map that is the exponential map or Cayley's (whose limit is -x)
    x, u, _ = _long_step(dtype, beta)
    s = Sphere(RADIUS, retraction=retraction)
    with pytest.raises(ValueError, match="cannot take this step") as info:
        s.retr(x, u)
    message = str(info.value)
    assert f"{type(retraction).__name__}.retract is a map of its own" in message
    assert "another map's point" in message
    assert "Define the map through angle" in message and "override retract_long_step" in message


@pytest.mark.parametrize("dtype, beta", LONG)
def test_a_retract_set_on_the_instance_raises_too(dtype, beta):
    x, u, _ = _long_step(dtype, beta)
    retraction = GnomonicRetraction()
    retraction.retract = _EXPONENTIAL.retract
    with pytest.raises(ValueError, match="instance has its own retract"):
        Sphere(RADIUS, retraction=retraction).retr(x, u)


@pytest.mark.parametrize("dtype, beta", LONG)
def test_the_fallback_would_be_another_map(dtype, beta):
    # why the fallback is refused: the Cayley-retract class tends to -x along the step, while the
    # long step it inherits gives the gnomonic limit r u_hat, sqrt(2) r away
    x, u, u_hat = _long_step(dtype, beta)
    retraction = _GnomonicCayleyRetract()
    s = Sphere(RADIUS, retraction=retraction)
    below = s.retr(x, u / beta * 1e6)  # beta = 1e6: beta^2 finite in both dtypes
    assert torch.allclose(below, -x, rtol=0, atol=1e-5 * RADIUS)
    inherited = retraction.retract_long_step(x, u, radius=RADIUS)
    assert torch.allclose(inherited, RADIUS * u_hat, rtol=0, atol=1e-5 * RADIUS)
    gap = (inherited - below).norm(dim=-1) / RADIUS
    assert torch.allclose(gap, torch.full_like(gap, math.sqrt(2.0)), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype, beta", LONG)
@pytest.mark.parametrize("kind", [_CayleyWithLongStep, _ForwardToCayleyWithLongStep])
def test_a_class_with_its_own_long_step_uses_it(kind, dtype, beta):
    x, u, _ = _long_step(dtype, beta)
    y = Sphere(RADIUS, retraction=kind()).retr(x, u)
    assert torch.allclose(y, -x, rtol=0, atol=4 * torch.finfo(dtype).eps * RADIUS)  # Cayley's limit
    assert torch.equal(y, Sphere(RADIUS, retraction="cayley").retr(x, u))


@pytest.mark.parametrize("dtype, beta", LONG)
def test_a_pure_forward_keeps_the_angle_forms_long_step(dtype, beta):
    x, u, u_hat = _long_step(dtype, beta)
    y = Sphere(RADIUS, retraction=_ForwardToGnomonic()).retr(x, u)
    assert torch.equal(y, Sphere(RADIUS, retraction="gnomonic").retr(x, u))
    assert torch.allclose(y, RADIUS * u_hat, rtol=0, atol=4 * torch.finfo(dtype).eps * RADIUS)


@pytest.mark.parametrize("dtype, beta", LONG)
def test_a_retract_of_its_own_that_takes_long_steps_is_used_as_it_is(dtype, beta):
    # no row off the sphere, no fallback: the class's map, not the gnomonic limit r u_hat
    x, u, _ = _long_step(dtype, beta)
    y = Sphere(RADIUS, retraction=_GnomonicLongCayleyRetract()).retr(x, u)
    assert torch.equal(y, Sphere(RADIUS, retraction="cayley").retr(x, u))
    assert torch.allclose(y, -x, rtol=0, atol=4 * torch.finfo(dtype).eps * RADIUS)


class _CoefficientsOnly(AngleRetraction):
    """The Cayley map given by its coefficients alone: (inf - inf) / inf = NaN for a long step."""

    def coefficients(self, sigma):
        k = 1.0 / (1.0 + 0.25 * sigma)
        return (1.0 - 0.25 * sigma) * k, k


@pytest.mark.parametrize(("dtype", "beta"), LONG, ids=["float32", "float64"])
def test_a_retraction_of_coefficients_only_is_told_that_long_steps_need_its_angle(dtype, beta):
    # the error said only "the result is not a point of the sphere"; it names what is missing
    manifold = Sphere(RADIUS, retraction=_CoefficientsOnly())
    x = torch.tensor([RADIUS, 0.0, 0.0], dtype=dtype)
    u = torch.tensor([0.0, beta * RADIUS, 0.0], dtype=dtype)
    assert torch.allclose(manifold.retr(x, u * (1.0 / (beta * RADIUS))),
                          Sphere(RADIUS, retraction="cayley").retr(x, u * (1.0 / (beta * RADIUS))))
    with pytest.raises(ValueError, match=r"needs angle\(beta\), which _CoefficientsOnly does not define"):
        manifold.retr(x, u)


# ---- an angle (or coefficients) set on the instance -------------------------------------------


class _AtanByAngle(AngleRetraction):
    """The gnomonic map given by its angle alone: generic coefficients, which read self.angle."""

    def angle(self, beta):
        return torch.atan(beta)


class _ExpWithCayleyLongStep(ExponentialRetraction):
    """The angle form's retract with a long-step form of the class's own (taken at its word)."""

    def retract_long_step(self, x, v, radius=None):
        return _CAYLEY.retract_long_step(x, v, radius)


class _GnomonicCayleyCoefficients(GnomonicRetraction):
    """Cayley's closed-form coefficients under the gnomonic angle it inherits."""

    def coefficients(self, sigma):
        return cayley_coefficients(sigma)


def _exponential_angle(beta):
    return beta


def _with_angle(retraction, angle=_exponential_angle):
    retraction.angle = angle
    return retraction


def _with_vjp_only():
    retraction = ExponentialRetraction()
    retraction.coefficients_vjp = AngleRetraction.coefficients_vjp.__get__(retraction)
    return retraction


# instance overrides whose retract and long step both follow the exponential map's angle
FOLLOWED = {
    "generic-class+angle": lambda: _with_angle(_AtanByAngle()),
    "gnomonic+angle": lambda: _with_angle(GnomonicRetraction()),
    "p3+angle": lambda: _with_angle(PRetraction(3.0)),
    "exp+vjp-only": _with_vjp_only,
}


@pytest.mark.parametrize("dtype, beta", LONG)
@pytest.mark.parametrize("make", list(FOLLOWED.values()), ids=list(FOLLOWED))
def test_an_angle_set_on_the_instance_takes_long_steps_by_that_angle(make, dtype, beta):
    # the long-step fallback was refused for any angle math set on the instance ("this ...
    # instance has its own angle"), although retract_long_step rotates by that same angle
    x, u, _ = _long_step(dtype, beta)
    y = Sphere(RADIUS, retraction=make()).retr(x, u)
    assert torch.equal(y, Sphere(RADIUS, retraction="exp").retr(x, u))
    Sphere(RADIUS).assert_check_point_on_manifold(y)


@pytest.mark.parametrize("make", list(FOLLOWED.values()), ids=list(FOLLOWED))
def test_an_angle_set_on_the_instance_is_the_map_of_short_steps_too(make):
    # GnomonicRetraction() and PRetraction(3) given the exponential angle ran their own closed
    # forms and ignored it: at beta = 0.5 the gnomonic point is 2 (0.5 - atan 0.5) = 0.073 away
    x, u, u_hat = _long_step(torch.float64, 0.5)
    for scale in (1e-9, 1e-3, 0.5, 3.0, 1e6):
        step = u_hat * (scale * RADIUS)
        y = Sphere(RADIUS, retraction=make()).retr(x, step)
        want = Sphere(RADIUS, retraction="exp").retr(x, step)
        assert torch.allclose(y, want, rtol=0, atol=8 * torch.finfo(torch.float64).eps * RADIUS * max(1.0, scale))


def test_setting_an_angle_on_the_instance_brings_the_generic_coefficients():
    retraction = _with_angle(GnomonicRetraction())
    sigma = torch.tensor([[0.0], [1e-20], [0.25], [4.0]], dtype=torch.float64)
    cos_theta, k = retraction.coefficients(sigma)
    beta = sigma.sqrt()
    assert torch.allclose(cos_theta, torch.cos(beta), rtol=0, atol=2e-16)
    assert torch.allclose(k, torch.where(beta > 0, torch.sin(beta) / beta.clamp_min(1e-300), 1.0), rtol=0, atol=2e-16)
    own = AngleRetraction.coefficients.__get__(retraction)
    retraction.coefficients = own  # a coefficients set after the angle is the user's: kept
    assert retraction.coefficients == own


def _refused_instance_coefficients():
    retraction = ExponentialRetraction()
    retraction.coefficients = cayley_coefficients  # retract runs Cayley; the long step would rotate by beta
    return retraction


def _bypassed_angle():
    retraction = GnomonicRetraction()
    vars(retraction)["angle"] = _exponential_angle  # past __setattr__: retract keeps the closed form
    return retraction


# (retraction, what the refusal names): retract and the long step would compute different maps
REFUSED = {
    "instance-coefficients": (_refused_instance_coefficients, "has its own coefficients, which retract runs"),
    "class-coefficients-under-a-foreign-angle": (
        _GnomonicCayleyCoefficients, "are not derived from _GnomonicCayleyCoefficients.angle (defined in GnomonicRetraction)"),
    "instance-angle-over-a-class-long-step": (
        lambda: _with_angle(_ExpWithCayleyLongStep()), "retract_long_step is a long-step form of the class's own"),
    "angle-past-setattr": (_bypassed_angle, "which retract does not read"),
}


@pytest.mark.parametrize("dtype, beta", LONG)
@pytest.mark.parametrize("make, says", list(REFUSED.values()), ids=list(REFUSED))
def test_a_long_step_whose_fallback_would_be_another_map_is_refused(make, says, dtype, beta):
    # class-coefficients-under-a-foreign-angle returned the gnomonic limit r u_hat for a map
    # whose long steps tend to -x (Cayley's), sqrt 2 r away, with no error
    x, u, _ = _long_step(dtype, beta)
    with pytest.raises(ValueError, match="cannot take this step") as info:
        Sphere(RADIUS, retraction=make()).retr(x, u)
    assert says in str(info.value)
    assert "Define the map through angle" in str(info.value)


@pytest.mark.parametrize("dtype, beta", LONG)
def test_the_refused_cases_would_give_another_point(dtype, beta):
    # why the refusals are right: each retract tends to Cayley's -x while the long step it would
    # fall back on is the gnomonic limit r u_hat or the exponential map's point, far from -x
    x, u, _ = _long_step(dtype, beta)
    for make in (_refused_instance_coefficients, _GnomonicCayleyCoefficients):
        retraction = make()
        below = Sphere(RADIUS, retraction=retraction).retr(x, u / beta * 1e6)  # beta = 1e6
        assert torch.allclose(below, -x, rtol=0, atol=1e-5 * RADIUS)
        fallback = retraction.retract_long_step(x, u, radius=RADIUS)
        assert bool(((fallback - below).norm(dim=-1) > 0.1 * RADIUS).all())


@pytest.mark.parametrize("dtype, beta", LONG)
def test_a_class_long_step_of_its_own_stays_taken_without_instance_math(dtype, beta):
    # the other side of instance-angle-over-a-class-long-step: the class alone is taken at its word
    x, u, _ = _long_step(dtype, beta)
    y = Sphere(RADIUS, retraction=_ExpWithCayleyLongStep()).retr(x, u)
    assert torch.equal(y, Sphere(RADIUS, retraction="cayley").retr(x, u))
