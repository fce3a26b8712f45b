r"""Measure and assert the properties of a retraction, without the exponential map.

A retraction :math:`R` at :math:`x` satisfies :math:`R_x(0) = x` and
:math:`\mathrm{D}R_x(0) = \mathrm{id}` on the tangent space. It is *second order* when
:math:`c(t) = R_x(tv)` has zero tangential acceleration at 0 (:math:`c''(0)` is normal). Both
statements become measurable through the tangential part of the Taylor remainder

.. math::
    e(t) = \big\|P_x\big(R_x(tv) - x - tv\big)\big\|,

which is :math:`O(t^2)` for a first-order retraction and :math:`O(t^3)` for a second-order one,
so :math:`e(t)/e(t/2) \approx 4` or :math:`\approx 8`.

**Convention of** :func:`retraction_order`: it returns :math:`\log_2(e(t)/e(t/2)) - 1` (median over
``ts``), i.e. the exponent :math:`q` of :math:`e(t) = O(t^{q+1})`: ``≈ 2.0`` for a second-order
retraction, ``≈ 1.0`` for a first-order one, ``math.inf`` when :math:`e` is at rounding level for
every ``t`` (e.g. :math:`x + v` on Euclidean space: the remainder vanishes identically). Unlike a
log-log slope fit against the exponential map (Manopt, pymanopt), it works on DGram, which has no
closed-form geodesic.

:func:`assert_retraction` turns the checks into assertions, for any registered retraction
including a user's own; all checks run in float64.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..manifolds.base import RetractionManifold
from ..manifolds.sphere import Sphere
from ..retractions.sphere import AngleRetraction
from .sampling import default_shape, random_point, random_tangent

__all__ = [
    "DEFAULT_TS",
    "ORDER_TOLERANCE",
    "assert_retraction",
    "central_difference_error",
    "remainder_norms",
    "retraction_order",
]

#: Step sizes of the ratio test, geometric in ``[1e-4, 1e-1]``; each is compared with its half.
#: The smallest steps set the sensitivity to a small first-order term :math:`c t^2` under a
#: second-order claim (a tangential :math:`c\|v\|^2` added to a second-order retraction's step):
#: the error is :math:`e(t) \approx ct^2 + dt^3`, and the :math:`t^2` term shows only at steps
#: :math:`t < c/d`, so the smallest step bounds the smallest :math:`c` caught
#: (``test_the_smallest_steps_reach_1e_4_and_catch_a_tangential_defect_of_2e_4``). Smaller steps
#: gain nothing in float64: a pair whose error is below the rounding floor
#: :math:`10^3\epsilon\|x\|` is skipped, and a second-order remainder :math:`dt^3` of a
#: unit-size problem reaches that floor (about :math:`2\cdot10^{-13}`) from :math:`t \approx 10^{-4}`;
#: without the floor the exponent fitted from pairs below it measures rounding, not the retraction.
DEFAULT_TS: tuple[float, ...] = (1e-1, 5e-2, 2e-2, 1e-2, 5e-3, 2e-3, 1e-3, 5e-4, 2e-4, 1e-4)

#: Accepted distance between the measured and the claimed order in :func:`assert_retraction`.
ORDER_TOLERANCE = 0.3

# e(t) below 1e3 * eps * ||x|| is rounding, not signal (the theory page
# docs/theory/retractions.rst, section Measuring the order)
_ROUNDING_FACTOR = 1e3

# the pairs of smallest t (above the rounding floor) that measure a second-order claim's limit
_SMALL_PAIRS = 3


# Seed of the tangent draw at a given point when no generator is given: not 0, since a point drawn
# with manual_seed(0) would give the tangent that point's own Gaussian (on Stiefel P_X(XR) = X skew(R):
# a vertical direction, along which Cayley is second order and measured 2.0 on tall points).
_TANGENT_SEED = 2**31


def _sample(
    manifold: RetractionManifold,
    x: torch.Tensor | None,
    v: torch.Tensor | None,
    generator: torch.Generator | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    if x is None:
        generator = torch.Generator().manual_seed(0) if generator is None else generator
        x = random_point(manifold, default_shape(manifold), generator=generator, dtype=dtype)
    else:
        generator = torch.Generator().manual_seed(_TANGENT_SEED) if generator is None else generator
        x = x.to(dtype)
        ok, reason = manifold.check_point_on_manifold(x, explain=True)
        if not ok:
            raise ValueError(f"the base point x is not on {manifold.name}: {reason}")
    if v is None:
        v = random_tangent(manifold, x, scale=1.0, generator=generator)
    else:
        v = manifold.proju(x, v.to(dtype))
    return x, v


def _unit_direction(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # a direction with ||v|| = ||x||, so that t is a relative step size
    vnorm = float(torch.linalg.vector_norm(v))
    if vnorm == 0.0:
        raise ValueError("the tangent direction v is zero: the order is undefined")
    return v * (float(torch.linalg.vector_norm(x)) / vnorm)


def remainder_norms(
    manifold: RetractionManifold, x: torch.Tensor, v: torch.Tensor, ts: Sequence[float]
) -> list[float]:
    r""":math:`e(t) = \|P_x(R_x(tv) - x - tv)\|` for each ``t`` (norm over the whole tensor)."""
    out = []
    with torch.no_grad():
        for t in ts:
            y = manifold.retr(x, t * v)
            out.append(float(torch.linalg.vector_norm(manifold.proju(x, y - x - t * v))))
    return out


def retraction_order(
    manifold: RetractionManifold,
    x: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    ts: Sequence[float] = DEFAULT_TS,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> float:
    r"""Measured order of ``manifold.retr``: median over ``ts`` of :math:`\log_2(e(t)/e(t/2)) - 1`.

    Args:
        manifold: a manifold carrying the retraction to measure.
        x: ``(..., *point_shape)`` base points; drawn with ``manifold.random`` when ``None``.
        v: tangent directions at ``x`` (projected onto the tangent space and rescaled to
            :math:`\|v\| = \|x\|`, so ``ts`` are relative step sizes); random when ``None``.
        ts: step sizes; each is compared with its half.
        generator: torch generator for the random ``x`` and ``v`` (``None``: seed 0 for ``x``
            and the ``v`` after it; a ``v`` at a given ``x`` from a seed of its own). A generator
            in the state that drew a given ``x`` draws ``v`` from ``x``'s own Gaussian, a special
            direction (vertical on Stiefel): give the point and the tangent different seeds.
        dtype: computation dtype (float64 recommended: in float32 most of the default ``ts``
            are below the rounding floor and skipped).

    Returns:
        ≈ 2.0 for a second-order retraction, ≈ 1.0 for a first-order one, ``math.inf`` if the
        remainder is at rounding level for every ``t`` (float64 only: in a lower precision that
        says nothing and raises).

    Raises:
        ValueError: empty, non-positive or infinite ``ts``, a zero direction, or no usable pair of steps
            (in float64: the remainder rises above the rounding floor only at some steps of each
            pair; below float64: no pair above it).
    """
    if len(ts) == 0 or any(not 0 < t < math.inf for t in ts):
        raise ValueError(
            f"ts must be a non-empty sequence of positive finite step sizes, got {tuple(ts)!r}"
        )
    x, v = _sample(manifold, x, v, generator, dtype)
    return _measure(manifold, x, v, ts)[0]


def _measure(
    manifold: RetractionManifold, x: torch.Tensor, v: torch.Tensor, ts: Sequence[float]
) -> tuple[float, list[tuple[float, float]]]:
    """:func:`retraction_order` at a sampled ``x``, ``v``, and the pairs it took the median of:
    ``[(t, log2(e(t)/e(t/2)) - 1)]`` where both remainders are above the rounding floor."""
    v = _unit_direction(x, v)
    floor = _ROUNDING_FACTOR * float(torch.finfo(x.dtype).eps) * float(torch.linalg.vector_norm(x))
    big = remainder_norms(manifold, x, v, ts)
    half = remainder_norms(manifold, x, v, [t / 2 for t in ts])
    pairs = [(t, math.log2(a / b) - 1.0) for t, a, b in zip(ts, big, half) if a >= floor and b >= floor]
    if pairs:
        return _median([q for _, q in pairs]), pairs
    if max(big + half) < floor and x.dtype == torch.float64:
        return math.inf, pairs
    raise ValueError(
        f"no step pair in ts={tuple(ts)} has both remainders above the rounding floor {floor:.3e} "
        f"in {x.dtype}; use float64 or larger steps"
    )


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def central_difference_error(
    manifold: RetractionManifold, x: torch.Tensor, v: torch.Tensor, h: float
) -> float:
    r"""Relative first-order error :math:`\|(R_x(hv) - R_x(-hv))/(2h) - v\| / \|v\|`.

    It is :math:`O(h^2)` exactly when :math:`\mathrm{D}R_x(0)v = v` (plus rounding
    :math:`\approx \epsilon\|x\|/(h\|v\|)`).
    """
    with torch.no_grad():
        diff = (manifold.retr(x, h * v) - manifold.retr(x, -h * v)) / (2.0 * h)
    return float(torch.linalg.vector_norm(diff - v) / torch.linalg.vector_norm(v))


def _raw_retracts(manifold: RetractionManifold, x: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """The retraction's own ``retract`` at a tangent ``v``, without what ``manifold.retr`` does to
    the result: :meth:`~manifoldlib.Sphere.retr` rescales a point within twice its tolerance (2e-5
    relative in float64) to the radius, the sphere residual layers
    (:func:`~manifoldlib.nn.sphere_residual_reference`) use the result as it is. An angle
    retraction is called both ways it is called: with the sphere's radius (``Sphere.retr``) and
    with ``radius=None`` (the layers: the radius read from ``||x||``)."""
    retraction = manifold.retraction
    with torch.no_grad():
        if isinstance(manifold, Sphere) and isinstance(retraction, AngleRetraction):
            return [retraction.retract(x, v, radius=manifold.radius), retraction.retract(x, v, radius=None)]
        return [retraction.retract(x, v)]


def _fail(manifold: RetractionManifold, what: str) -> None:
    raise AssertionError(f"retraction {manifold.retraction!r} on {manifold.name}: {what}")


def _claimed_order(manifold: RetractionManifold, x: torch.Tensor) -> int:
    """The order the retraction claims at points of ``x``'s shape: its ``order_at`` where it has
    one, unless ``order`` is set below the class that defines ``order_at`` (on the instance, or in
    a subclass): a subclass of Stiefel Cayley that says ``order = 2`` claims 2 at every shape, and
    reading the inherited ``order_at`` instead would check its tall points against 1."""
    retraction = manifold.retraction
    order_at = getattr(retraction, "order_at", None)
    if not callable(order_at) or "order" in vars(retraction):
        return retraction.order
    mro = type(retraction).__mro__
    depth = {attr: next((i for i, k in enumerate(mro) if attr in vars(k)), len(mro)) for attr in ("order", "order_at")}
    return int(order_at(tuple(x.shape))) if depth["order_at"] <= depth["order"] else retraction.order


def assert_retraction(
    manifold: RetractionManifold,
    order: int | None = None,
    *,
    x: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    manifold_rtol: float = 1e-12,
    zero_rtol: float = 1e-13,
    derivative_rtol: float = 1e-6,
    order_tolerance: float = ORDER_TOLERANCE,
) -> float:
    r"""Assert that ``manifold.retr`` is a retraction of the order it claims.

    Returns the measured order.

    Checks, all in float64:

    1. :math:`R_x(v)` lies on the manifold (``check_point_on_manifold`` with ``atol=0``,
       ``rtol=manifold_rtol``) for a unit-size and a small step, both as the retraction's own
       ``retract`` returns it and through ``manifold.retr``, which must not refuse it. The raw
       result counts: a :class:`~manifoldlib.Sphere` rescales a result within twice its tolerance
       (:math:`2\cdot10^{-5}` relative in float64) to the radius, but the sphere residual layers use
       ``retract``'s result as it is, so a retraction off the sphere by :math:`10^{-6}` would
       pass through ``retr`` and drift in a network. The message names the error (on the sphere
       :math:`|\|y\|/r - 1|`); the built-ins are within :math:`O(\epsilon)` on the sphere and
       :math:`O(n\epsilon)` elsewhere (sums of ``n`` products per entry), far inside the tolerances;
    2. :math:`R_x(0) = x` to ``zero_rtol`` relative (SVD-based retractions are exact only to
       :math:`O(n\,\kappa\,\epsilon)`), as ``retract`` returns it and through ``manifold.retr``:
       a formula that divides by :math:`\|v\|` returns NaN there (a zero-initialized layer's
       step), which fails this check also inside
       :func:`~manifoldlib.manifolds.skip_value_checks`;
    3. :math:`\mathrm{D}R_x(0) = \mathrm{id}` on the tangent space: the central difference at
       :math:`h = 10^{-4}` has relative error ``<= derivative_rtol``;
    4. :func:`retraction_order` matches ``order`` (default ``manifold.retraction.order``):
       within ``order_tolerance`` of 1 for a first-order claim, at least ``2 - order_tolerance``
       for a second-order claim (an exact retraction measures ``inf``), both over all steps
       and over the three smallest steps above the rounding floor (the order is a limit
       :math:`t \to 0`: a small first-order term :math:`c t^2` hides under the cubic one at
       larger steps). A retraction that is better than it claims also fails: its claim should
       be raised.

    Args:
        manifold: the manifold carrying the retraction (``Sphere(retraction="my-p3")``).
        order: claimed order, 1 or 2; ``None`` reads the retraction's ``order_at(x.shape)`` where
            it has one (an order that depends on the shape: Stiefel Cayley), else its ``order``;
            an ``order`` set in a subclass (or on the instance) below the class that defines
            ``order_at`` is the claim at every shape.
        x, v: optional base points and tangent directions (random when ``None``).
        generator: torch generator for the random draws (as in :func:`retraction_order`).

    Raises:
        AssertionError: naming the failed check and the measured numbers.
        ValueError: ``order`` not 1 or 2, a tolerance that is not a finite number ``>= 0``, or an
            ``order_tolerance`` of 0.5 or more (orders 1 and 2 would both pass either claim).
    """
    tolerances = {"manifold_rtol": manifold_rtol, "zero_rtol": zero_rtol, "derivative_rtol": derivative_rtol}
    for name, value in tolerances.items():  # NaN failed every check with a wrong reason, inf skipped it
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if isinstance(order_tolerance, bool) or not isinstance(order_tolerance, (int, float)) \
            or not 0 <= order_tolerance < 0.5:
        # from 0.5 on, a first-order retraction that claims order 2 passes (and one of order 2 claiming 1)
        raise ValueError(f"order_tolerance must be a number in [0, 0.5), got {order_tolerance!r}")
    x, v = _sample(manifold, x, v, generator, torch.float64)
    claim = _claimed_order(manifold, x) if order is None else order
    if isinstance(claim, bool) or claim not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {claim!r}")
    v = _unit_direction(x, v)

    for scale in (1.0, 1e-3):
        # the raw result first: Sphere.retr rescales a result within 2e-5 of the radius, so its
        # output hid a retraction off the sphere by 1e-6 that SphereResidual then used unrescaled
        for raw in _raw_retracts(manifold, x, scale * v):
            if not bool(torch.isfinite(raw).all()):
                _fail(manifold, f"R_x({scale}·v) is not finite")
            ok, reason = manifold.check_point_on_manifold(raw, explain=True, atol=0.0, rtol=manifold_rtol)
            if not ok:
                rescaled = (
                    " (Sphere.retr rescales it onto the sphere, SphereResidual uses it as it is)"
                    if isinstance(manifold, Sphere)
                    else ""
                )
                _fail(
                    manifold,
                    f"R_x({scale}·v) as retract returns it is off the manifold{rescaled} "
                    f"(rtol={manifold_rtol}): {reason}",
                )
        try:
            with torch.no_grad():
                y = manifold.retr(x, scale * v)
        except ValueError as err:  # the manifold's value checks refused the retraction's result
            _fail(manifold, f"R_x({scale}·v) is off the manifold or not finite: {err}")
        if not bool(torch.isfinite(y).all()):
            _fail(manifold, f"R_x({scale}·v) is not finite")
        ok, reason = manifold.check_point_on_manifold(y, explain=True, atol=0.0, rtol=manifold_rtol)
        if not ok:
            _fail(manifold, f"R_x({scale}·v) is off the manifold (rtol={manifold_rtol}): {reason}")

    # the raw result too: a zero step is what a zero-initialized layer gives SphereResidual, which
    # calls retract itself; and NaN-safe (a NaN ||R_x(0) - x|| compares false both ways)
    zero = torch.zeros_like(v)
    allowed = zero_rtol * float(torch.linalg.vector_norm(x))
    for raw in _raw_retracts(manifold, x, zero):
        dev = float(torch.linalg.vector_norm(raw - x))
        if not dev <= allowed:
            _fail(manifold, f"R_x(0) != x as retract returns it: ||R_x(0) - x|| = {dev:.3e} "
                            f"(allowed {zero_rtol} relative)")
    try:
        with torch.no_grad():
            y0 = manifold.retr(x, zero)
    except ValueError as err:  # the manifold's value checks refused the retraction's result
        _fail(manifold, f"R_x(0) is not x: {err}")
    dev = float(torch.linalg.vector_norm(y0 - x))
    if not dev <= allowed:
        _fail(manifold, f"R_x(0) != x: ||R_x(0) - x|| = {dev:.3e} (allowed {zero_rtol} relative)")

    err = central_difference_error(manifold, x, v, 1e-4)
    if not err <= derivative_rtol:
        _fail(
            manifold,
            f"the derivative at 0 is not the identity on the tangent space: "
            f"||(R(hv) - R(-hv))/2h - v|| / ||v|| = {err:.3e} at h=1e-4 "
            f"(allowed {derivative_rtol})",
        )

    measured, pairs = _measure(manifold, x, v, DEFAULT_TS)
    if claim == 2 and not measured >= 2.0 - order_tolerance:
        _fail(
            manifold,
            f"claims order 2 but the measured order is {measured:.3f} "
            f"(e(t)/e(t/2) ≈ {2 ** (measured + 1):.2f}, 8 expected)",
        )
    if claim == 2 and measured != math.inf:
        # The order is a limit t -> 0. A first-order defect c t^2 under a cubic term d t^3 shows
        # only where t < c/d: the median over all ts misses it (c = 3e-4 measures 1.9 there), the
        # smallest steps above the rounding floor do not.
        small = sorted(pairs)[:_SMALL_PAIRS]
        asymptotic = _median([q for _, q in small]) if small else measured
        if not asymptotic >= 2.0 - order_tolerance:
            _fail(
                manifold,
                f"claims order 2 but at the smallest steps (t = {', '.join(f'{t:g}' for t, _ in small)}) "
                f"the measured order is {asymptotic:.3f} (e(t)/e(t/2) ≈ {2 ** (asymptotic + 1):.2f}, "
                f"8 expected; {measured:.3f} over all steps): a small first-order term",
            )
    if claim == 1 and not abs(measured - 1.0) <= order_tolerance:
        hint = (
            " (it is better than claimed: raise its order to 2)"
            if measured >= 2.0 - order_tolerance
            else ""
        )
        _fail(manifold, f"claims order 1 but the measured order is {measured:.3f}{hint}")
    return measured
