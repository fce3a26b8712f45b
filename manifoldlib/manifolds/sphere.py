r"""The sphere :math:`S^{d-1}_r = \{x \in \mathbb{R}^d: \|x\| = r\}` over the last dimension."""

from __future__ import annotations

import math
from typing import Union

import torch

from .._numbers import is_real
from ..functional.scaling import _power_of_two_scale
from ..functional.sphere import sphere_antipode_direction, sphere_project_tangent, sphere_step_length
from ..retractions.base import Retraction
from ..retractions.sphere import AngleRetraction, ExponentialRetraction, _long_step_mismatch
from .base import (
    RetractionManifold,
    _random_normal,
    _size_tuple,
    check_tensor,
    default_tolerance,
    value_checks_enabled,
)

__all__ = ["RADIUS_RANGE", "Sphere"]

#: Radii a :class:`Sphere` accepts. Inside it :math:`r^2`, :math:`\|x\|^2` and
#: :math:`\sigma r^2` stay far from float32's overflow (3.4e38) and underflow (1.2e-38) for
#: points of up to millions of coordinates; float16 and bfloat16 points are computed in float32.
RADIUS_RANGE = (1e-15, 1e15)

_EXPONENTIAL = ExponentialRetraction()


class Sphere(RetractionManifold):
    r"""Sphere of radius ``radius`` over the last dimension, points ``(..., d)``.

    Tangent projection :math:`P_x(z) = z - (\langle x, z\rangle/r^2)\,x`; the retraction is any
    registered sphere retraction (``"gnomonic"`` by default; ``"exp"``, ``"cayley"``, ``"p"`` with
    ``p=...``, or a user's own :class:`~manifoldlib.retractions.AngleRetraction`). :meth:`retr` and
    :meth:`expmap` take any vector at ``x`` and act with its tangent part :math:`P_x u` (a normal
    part is dropped). geoopt's own sphere does not drop it: its ``retr`` is ``projx(x + u)``, where
    a normal part :math:`a\,x` scales the tangent step by :math:`1/(1 + a)` (and reverses it for
    :math:`a < -1`), and its ``expmap`` :math:`\cos\|u\|\,x + \sin\|u\|\,u/\|u\|` leaves the
    sphere (:math:`\|y\| = 1.34` for :math:`u = 0.5\,t + 0.7\,x` on the unit sphere).

    Every method that takes a point checks that it is one: a real floating-point tensor whose
    rows have norm :math:`r` within the dtype's tolerance
    (:func:`~manifoldlib.manifolds.default_tolerance`), naming the row and its norm otherwise.
    :meth:`retr` and :meth:`expmap` name a non-finite ``x`` or ``u``, and return each point
    rescaled to norm :math:`r` exactly (to rounding), so chained steps do not drift. A step so long
    that :math:`\beta^2 = \|P_xu\|^2/r^2` (or its numerator) overflows, where the retraction's
    ``retract`` returns a row off the sphere, is computed from the angle itself
    (:meth:`~manifoldlib.retractions.AngleRetraction.retract_long_step`) when that is the
    retraction's own map: its ``retract`` is the angle form (inherited, or through pure ``super()``
    forwards), or its class overrides ``retract_long_step`` at or below its ``retract``. A
    ``retract`` of its own without a long-step form of its own raises ``ValueError`` instead (the
    angle form's point would be another map's); one that returns points of the sphere for such
    steps is used as it is. These value checks
    cost a reduction and a host synchronization per call; skip them in a hot loop with
    :func:`~manifoldlib.manifolds.skip_value_checks`.

    Args:
        radius: :math:`r`, a finite number in :data:`RADIUS_RANGE`.
        retraction: registry name or instance.
        **retraction_options: options of a named retraction (e.g. ``p=1.5``).
    """

    name = "sphere"
    ndim = 1
    default_retraction = "gnomonic"

    def __init__(self, radius: float = 1.0, retraction: Union[str, Retraction, None] = None, **retraction_options):
        lo, hi = RADIUS_RANGE
        # is_real: float() would take True as 1 and parse '2'
        if not (is_real(radius) and math.isfinite(radius) and lo <= float(radius) <= hi):
            raise ValueError(f"radius must be a finite number in [{lo:g}, {hi:g}], got {radius!r}")
        super().__init__(retraction, **retraction_options)
        self.radius = float(radius)

    def _init_kwargs(self) -> dict:
        return {"radius": self.radius}

    def _check_shape(self, shape, name):
        if len(shape) < 1 or shape[-1] < 1:
            return False, f"'{name}' on the sphere needs shape (..., d) with d >= 1, got {tuple(shape)}"
        return True, None

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        # judged in units of r (|| x/r || = 1): an absolute atol let any point of a small sphere
        # pass (radius 1e-10: the zero vector, 3x the radius)
        err = (self._row_norms(x) / self.radius - 1.0).abs()
        ok = bool((err <= atol + rtol).all())
        return ok, None if ok else (
            f"| ||x||/r - 1 | = {err.max().item():.3e} exceeds atol={atol}, rtol={rtol} (r={self.radius})"
        )

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        # <x/r, u/r>: the normal component of u in units of r, as the step beta = ||u||/r is (an
        # absolute bound on <x, u> let u = x pass on spheres of radius 1e-4 and below). Both sides
        # are multiplied by the power of two g <= 1 that brings a row's largest |u| to at most 1
        # (exact), in at least float32: ||u|| overflowed first, and u = 1e20 x (float32, all normal)
        # had the bound inf and passed
        work = torch.promote_types(torch.promote_types(x.dtype, u.dtype), torch.float32)
        x, u = x.to(work) / self.radius, u.to(work)
        g = _power_of_two_scale(u.detach().abs().amax(-1, keepdim=True)).clamp_max(1.0)  # (..., 1)
        u = u * g / self.radius  # (..., d), g u / r
        inner = (x * u).sum(-1).abs()
        excess = inner - rtol * u.norm(dim=-1)  # (...,)
        ok = bool((excess <= atol * g.squeeze(-1)).all())  # (NaN fails)
        if ok:
            return True, None
        unscaled = inner.double() / g.squeeze(-1).double()  # <x/r, u/r>
        return False, f"<x/r, u/r> = {unscaled.max().item():.3e} exceeds atol={atol}, rtol={rtol}"

    # -- value checks -------------------------------------------------------------------
    def _row_norms(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., 1)`` row norms, computed in at least float32."""
        return torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))

    def _off_sphere(self, x: torch.Tensor, norms: torch.Tensor | None = None, slack: float = 1.0,
                    tolerance: float | None = None) -> torch.Tensor:
        """``(..., 1)`` mask of the rows whose norm is not :math:`r` within ``slack`` tolerances
        (``x``'s dtype's unless given; NaN rows included)."""
        norms = self._row_norms(x) if norms is None else norms
        tolerance = default_tolerance(x.dtype) if tolerance is None else tolerance
        return ~((norms / self.radius - 1.0).abs() <= slack * tolerance)

    def _require_points(self, where: str, **points: torch.Tensor) -> None:
        """Raise ``ValueError`` naming the first argument of ``points`` with a row off the sphere
        (or a non-finite entry); one host synchronization when all are points."""
        masks = [self._off_sphere(x).flatten() for x in points.values()]
        if not bool(torch.cat(masks).any()):
            return
        for (name, x), mask in zip(points.items(), masks):
            if bool(mask.any()):
                self._explain_off_sphere(where, name, x, mask)

    def _explain_off_sphere(self, where: str, name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
        check_tensor(x, name, where, finite=True)
        flat = int(mask.nonzero()[0])
        row = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape[:-1])) if x.dim() > 1 else ()
        norm = float(self._row_norms(x).flatten()[flat])
        at = f"row {row if len(row) > 1 else row[0]}" if row else "it"
        raise ValueError(
            f"{where}: '{name}' is not a point of the sphere of radius {self.radius:g}: {at} has norm "
            f"{norm:.6g} (relative tolerance {default_tolerance(x.dtype):.3g} for {x.dtype}); "
            f"project it first (Sphere.projx)"
        )

    # -- geometry -----------------------------------------------------------------------
    def projx(self, x):
        r"""Radial projection :math:`r\,x/\|x\|`, for every finite nonzero row.

        :math:`x/\|x\|` is invariant under :math:`x \mapsto sx`, :math:`s > 0`: each row is first
        multiplied by the power of two that brings its largest entry into :math:`[1/2, 1)` (exact),
        so :math:`\|x\|^2` neither overflows nor underflows (float32 rows with entries of
        :math:`10^{20}` had a norm of ``inf`` and came back as zero rows; rows of subnormals one
        of 0 and were refused as zero rows). Computed in at least float32.

        Raises:
            ValueError: ``x`` has a non-finite entry or a zero row (a zero vector has no nearest
                point on the sphere); value checks, see :func:`~manifoldlib.manifolds.skip_value_checks`.
        """
        self._validate(x, "x")
        work = x.to(torch.promote_types(x.dtype, torch.float32))
        work = work * _power_of_two_scale(work.detach().abs().amax(-1, keepdim=True))  # (..., d)
        norms = torch.linalg.vector_norm(work, dim=-1, keepdim=True)  # (..., 1), in [1/2, sqrt(d)] or 0
        if value_checks_enabled():
            check_tensor(x, "x", "sphere.projx", finite=True)
            if not bool((norms > 0).all()):
                zero = (norms.flatten() == 0).nonzero().flatten().tolist()
                raise ValueError(f"sphere.projx: 'x' has zero rows (flat indices {zero[:8]}): a zero "
                                 f"vector has no nearest point on the sphere")
        return (work * (self.radius / norms.clamp_min(torch.finfo(norms.dtype).tiny))).to(x.dtype)

    def proju(self, x, u):
        dtype = self._validate_args("sphere.proju", x=x, u=u)
        if value_checks_enabled():
            self._require_points("sphere.proju", x=x)
        return sphere_project_tangent(x.to(dtype), u.to(dtype), self.radius**2)

    def transp(self, x, y, v):
        """Vector transport by projection onto the tangent space at ``y``."""
        dtype = self._validate_args("sphere.transp", x=x, y=y, v=v)
        if value_checks_enabled():
            self._require_points("sphere.transp", y=y)
        return sphere_project_tangent(y.to(dtype), v.to(dtype), self.radius**2)

    def retr_transp(self, x, u, v):
        dtype = self._validate_args("sphere.retr_transp", x=x, u=u, v=v)
        # u in the common dtype: y has it (x is checked in its own); a point by construction, y is
        # transported without a second check
        y = self.retr(x, u.to(dtype))
        return y, sphere_project_tangent(y, v.to(dtype), self.radius**2)

    def retr(self, x, u):
        r""":math:`R_x(P_x u)` with the chosen retraction, rescaled to norm :math:`r`.

        Raises:
            ValueError: ``x`` not a point of the sphere, a non-finite ``x`` or ``u``, or a step
                whose rotation cannot be computed in the dtype (value checks).
        """
        return self._rotate(x, u, self._retraction, "sphere.retr")

    def expmap(self, x, u):
        r"""Exponential map :math:`\cos\beta\,x + (\sin\beta/\beta)\,P_xu`, :math:`\beta = \|P_xu\|/r`
        (checked and rescaled as :meth:`retr`)."""
        return self._rotate(x, u, _EXPONENTIAL, "sphere.expmap")

    def _rotate(self, x: torch.Tensor, u: torch.Tensor, retraction: Retraction, where: str) -> torch.Tensor:
        dtype = self._validate_args(where, x=x, u=u)
        xw, uw = x.to(dtype), u.to(dtype)  # (the checks of x below judge it in its own dtype)
        if isinstance(retraction, AngleRetraction):
            y = retraction.retract(xw, uw, radius=self.radius)
        else:  # a user's own sphere retraction: give it a tangent vector
            y = retraction.retract(xw, sphere_project_tangent(xw, uw, self.radius**2))
        norms = self._row_norms(y)  # (..., 1)
        if value_checks_enabled():
            # x within the tolerance gives y within it (the rotation keeps ||x||): x's tolerance
            # where it is the looser (a bfloat16 x with a float32 u); twice it is room for
            # rounding, and a long step's zero or NaN row is far outside
            tolerance = max(default_tolerance(x.dtype), default_tolerance(dtype))
            bad_y = self._off_sphere(y, norms, slack=2.0, tolerance=tolerance)
            if bool((self._off_sphere(x) | bad_y).any()):
                self._require_points(where, x=x)
                y = self._repair_long_steps(xw, uw, y, bad_y, retraction, where, tolerance)
                norms = self._row_norms(y)
        return (y * (self.radius / norms.clamp_min(torch.finfo(norms.dtype).tiny))).to(dtype)

    def _repair_long_steps(self, x, u, y, bad_y, retraction, where, tolerance) -> torch.Tensor:
        """After a failed check of :meth:`_rotate` with ``x`` a point: name a bad ``u``, or
        recompute the rows whose :math:`\\beta^2` or :math:`\\|P_xu\\|^2` overflowed from the
        angle, where ``retract_long_step`` is the retraction's own map; anything else is an error.
        ``x`` and ``u`` have one dtype; ``tolerance`` is the check's on the result."""
        check_tensor(u, "u", where, finite=True)
        beta, _ = sphere_step_length(sphere_project_tangent(x, u, self.radius**2), self.radius)
        beta = beta.to(torch.promote_types(x.dtype, torch.float32))
        # the rotation forms sigma = ||P_x u||^2 / r^2: the numerator overflows first when r > 1
        # (float32, r = 1e15: from beta ~ 1.8e4), sigma itself first when r < 1
        length = beta * self.radius  # ||P_x u||, (..., 1)
        long_rows = ~torch.isfinite(beta * beta) | ~torch.isfinite(length * length)
        long_steps = isinstance(retraction, AngleRetraction) and bool((bad_y <= long_rows).all())
        # retract_long_step is the angle form's long step: for a retract of its own, another map
        mismatch = _long_step_mismatch(retraction) if long_steps else None
        no_angle = False
        if long_steps and mismatch is None:
            try:
                long = retraction.retract_long_step(x, u, radius=self.radius)
            except NotImplementedError:  # an AngleRetraction defined by its coefficients only
                no_angle = True
            if not no_angle:
                # y's long rows are NaN or inf, and their backward turns the zero gradient that
                # torch.where gives them into NaN (0 * inf): the other rows again, from a u with
                # the long rows zeroed (the map is row by row: the same values)
                y = retraction.retract(x, torch.where(long_rows, 0.0, u), radius=self.radius)
                y = torch.where(long_rows, long, y)
            if not no_angle and not bool(self._off_sphere(y, slack=2.0, tolerance=tolerance).any()):
                return y
        flat = int(bad_y.flatten().nonzero()[0])
        why = "" if mismatch is None else (
            f"; the long-step fallback is not taken: {mismatch}. Define the map through angle (alone, "
            f"or with the coefficients it gives, in one class or both on the instance) and inherit "
            f"retract, or override retract_long_step with this retract's form for steps whose beta^2 "
            f"overflows"
        )
        if no_angle:
            why = (f"; the long-step fallback needs angle(beta), which {type(retraction).__name__} "
                   f"does not define (its coefficients take sigma = beta^2, which overflows here): "
                   f"define angle, or override retract_long_step")
        raise ValueError(
            f"{where}: the {retraction!r} retraction cannot take this step in {x.dtype}: its "
            f"normalized length ||P_x u|| / r is {float(beta.flatten()[flat]):.6g} (row {flat} of "
            f"the flattened batch) and the result is not a point of the sphere{why}"
        )

    def logmap(self, x, y):
        r"""Inverse of :meth:`expmap`: :math:`r\,\theta\,w/\|w\|`, :math:`w = P_x y`,
        :math:`\theta = \operatorname{atan2}(\|w\|\,\|x\|, \langle x, y\rangle)`.

        At the antipode :math:`y = -x` (up to rounding: :math:`\|w\| \le 4\sqrt d\,\varepsilon\,r`
        with :math:`\langle x, y\rangle < 0`) every direction is a shortest geodesic; the one
        taken is :func:`~manifoldlib.functional.sphere_antipode_direction`, so
        ``logmap(x, -x)`` has norm :math:`\pi r` and does not depend on rounding.

        At :math:`y = x` the map is smooth, :math:`r\,(\|x\|/\langle x, y\rangle)\,w` to first
        order, and its derivative there is the tangent projection :math:`P_x` in ``y`` (and
        :math:`-P_x` in ``x``); :math:`\theta\,w/\|w\|` is :math:`0 \cdot 0` there, whose
        gradient is 0, so those rows take that first-order form (the same value, 0).
        """
        theta, w, w_norm, q, a = self._angle(x, y, "sphere.logmap")
        eps = torch.finfo(w_norm.dtype).eps
        antipodal = (w_norm <= 4.0 * math.sqrt(x.shape[-1]) * eps * self.radius) & (theta > math.pi / 2)
        direction = torch.where(antipodal, sphere_antipode_direction(x), w / w_norm.clamp_min(torch.finfo(w.dtype).tiny))
        log = self.radius * theta * direction  # (..., d)
        # y = x: theta = atan(||w|| ||x|| / <x, y>), so the first-order form carries the derivative
        # that theta * w / ||w|| (0 * 0, gradient 0) loses
        same = (w_norm == 0) & (a > 0)  # (..., 1)
        slope = self.radius * q.sqrt() / torch.where(same, a, torch.ones_like(a))
        return torch.where(same, slope * w, log)  # the same value there, 0

    def dist(self, x, y, *, keepdim=False):
        r"""Geodesic (great-circle) distance :math:`r\,\theta`, :math:`\theta \in [0, \pi]` (:math:`\pi r`
        between antipodes)."""
        theta = self._angle(x, y, "sphere.dist")[0]
        theta = self.radius * theta
        return theta if keepdim else theta.squeeze(-1)

    def _angle(self, x, y, where):
        """``(theta, w, ||w||, ||x||², <x, y>)``: the angle from ``x`` to ``y`` ``(..., 1)``, :math:`w = P_x y`
        and the two inner products the angle is formed from, ``(..., 1)`` each."""
        dtype = self._validate_args(where, x=x, y=y)
        if value_checks_enabled():
            self._require_points(where, x=x, y=y)
        x, y = x.to(dtype), y.to(dtype)
        q = (x * x).sum(-1, keepdim=True)  # ||x||²
        a = (x * y).sum(-1, keepdim=True)  # (..., 1)
        # w = P_x y = P_x(y - s x), s = sign<x, y>: y - s x is small where y is near s x and then
        # exact (Sterbenz), so w keeps its relative accuracy for close points and near the
        # antipode (y - (a/q) x cancels: float32 points 1e-4 apart had a distance off by 4e-5
        # relative); P_x(-x) = 0 exactly
        e = y - torch.where(a < 0, -1.0, 1.0).to(x.dtype) * x  # (..., d); the sign is exact
        w = e - ((x * e).sum(-1, keepdim=True) / q) * x  # (..., d)
        w_norm = torch.linalg.vector_norm(w, dim=-1, keepdim=True)
        return torch.atan2(w_norm * q.sqrt(), a), w, w_norm, q, a

    def random(self, *size, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
        """Uniform points: ``random(8, 64)`` gives 8 points of :math:`S^{63}_r`."""
        shape = _size_tuple(size)
        self._validate(torch.empty(shape, device="meta"), "size")
        z, dtype = _random_normal(shape, generator, dtype, device)
        return self.projx(z).to(dtype)

    def extra_repr(self):
        return f"radius={self.radius}, retraction={self._retraction!r}"
