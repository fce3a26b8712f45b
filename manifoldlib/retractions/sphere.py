r"""Sphere retractions: one planar rotation, many angle functions.

Every member rotates :math:`x` in :math:`\operatorname{span}(x, v)` by :math:`\theta(\beta)`,
:math:`\beta = \|v\|/r`: :math:`R_x(v) = \cos\theta\,x + (\sin\theta/\beta)\,v`. A subclass of
:class:`AngleRetraction` defines only :meth:`~AngleRetraction.angle`; the built-ins also override
:meth:`~AngleRetraction.coefficients` with closed forms in :math:`\sigma = \beta^2`.

============  ===========================  =====  ========================
name          :math:`\theta(\beta)`        order  paper name
============  ===========================  =====  ========================
exp           :math:`\beta`                2      GeoNorm
gnomonic      :math:`\arctan\beta`         2      Proj-SpheretNorm (p = 1)
cayley        :math:`2\arctan(\beta/2)`    2      Cay-SpheretNorm (p = 2)
p             :math:`p\arctan(\beta/p)`    2      p-SpheretNorm
============  ===========================  =====  ========================
"""

from __future__ import annotations

import math

import torch

from ..functional.sphere import (
    cayley_coefficients,
    exponential_coefficients,
    gnomonic_coefficients,
    p_coefficients,
    rotate,
    sphere_normalized_sq_step,
    sphere_project_tangent,
    sphere_step_length,
)
from .._numbers import is_real
from .base import Retraction, register_retraction

__all__ = [
    "AngleRetraction",
    "CayleyRetraction",
    "ExponentialRetraction",
    "GnomonicRetraction",
    "PRetraction",
]


def _gnomonic_vjp(cos_theta: torch.Tensor, grad_cos: torch.Tensor, grad_k: torch.Tensor) -> torch.Tensor:
    # cos θ = k = (1 + σ)^(-1/2): both derivatives are -cos³θ / 2
    return -0.5 * cos_theta * cos_theta * cos_theta * (grad_cos + grad_k)


def _cayley_vjp(k: torch.Tensor, grad_cos: torch.Tensor, grad_k: torch.Tensor) -> torch.Tensor:
    # k = 1/(1 + σ/4), cos θ = 2k - 1: k' = -k²/4, cos θ' = -k²/2
    return -0.25 * k * k * (2.0 * grad_cos + grad_k)


class AngleRetraction(Retraction):
    r"""Base class of sphere retractions that rotate by an angle :math:`\theta(\beta)`.

    Subclasses define :meth:`angle`, an odd function with :math:`\theta'(0) = 1` (then the
    retraction is second order whenever :math:`\theta''(0) = 0`, which oddness gives). Points are
    ``(..., d)`` with the sphere over the last dimension.

    The math is one chain, :meth:`angle` → :meth:`coefficients` → :meth:`coefficients_vjp`. A
    subclass that redefines a link gets the generic form of every later link it does not
    redefine itself, so a closed form inherited from a built-in (gnomonic, Cayley, the
    p-family, the exponential map) never stands in for a different angle.
    """

    manifold = "sphere"
    order = 2

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "angle" in own and "coefficients" not in own:
            cls.coefficients = AngleRetraction.coefficients
        if ("angle" in own or "coefficients" in own) and "coefficients_vjp" not in own:
            cls.coefficients_vjp = AngleRetraction.coefficients_vjp

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        """Rotation angle for the normalized step ``beta = ||v|| / r`` (elementwise, ``beta >= 0``)."""
        raise NotImplementedError(f"{type(self).__name__} must define angle(beta)")

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(cos θ, k = sin θ / β)`` from :math:`\sigma = \beta^2`, shape ``(..., 1)`` each.

        The generic form evaluates :meth:`angle` at :math:`\beta = \sqrt\sigma`, with the
        double-where pattern below :math:`\sigma < \epsilon` (where ``k = 1`` and
        :math:`\cos\theta = 1 - \sigma/2` are exact to rounding for any admissible angle).
        """
        small = sigma < float(torch.finfo(sigma.dtype).eps)
        safe = torch.where(small, torch.ones_like(sigma), sigma)
        beta = safe.sqrt()
        theta = self.angle(beta)
        cos_theta = torch.where(small, 1.0 - 0.5 * sigma, torch.cos(theta))
        k = torch.where(small, torch.ones_like(sigma), torch.sin(theta) / beta)
        return cos_theta, k

    def coefficients_vjp(
        self,
        sigma: torch.Tensor,
        cos_theta: torch.Tensor,
        k: torch.Tensor,
        grad_cos: torch.Tensor,
        grad_k: torch.Tensor,
    ) -> torch.Tensor:
        r"""Vector-Jacobian product of :meth:`coefficients`:
        :math:`g_\sigma = \cos\theta'(\sigma)\,g_c + k'(\sigma)\,g_k`, shape ``(..., 1)``.

        ``cos_theta`` and ``k`` are :meth:`coefficients` at ``sigma`` (closed forms reuse them).
        The generic form differentiates :meth:`coefficients` with autograd on the small
        ``(..., 1)`` tensor; members with closed-form derivatives override it. The analytic
        backward of :class:`~manifoldlib.nn.SphereResidual` calls it.
        """
        with torch.enable_grad():
            s = sigma.detach().requires_grad_(True)
            c2, k2 = self.coefficients(s)
            grads = torch.autograd.grad((c2, k2), s, (grad_cos, grad_k), allow_unused=True)
        return torch.zeros_like(sigma) if grads[0] is None else grads[0]

    def retract(self, x: torch.Tensor, v: torch.Tensor, radius: float | torch.Tensor | None = None) -> torch.Tensor:
        r"""Rotate ``x`` towards ``v``: :math:`R_x(v) = R_x(P_x v)`.

        The normal component of ``v`` is removed first (as geoopt's own sphere retractions do),
        so a vector that is not tangent — a momentum buffer seeded with a raw gradient — still
        gives a point on the sphere.

        Args:
            x: ``(..., d)`` points on the sphere of radius ``radius``.
            v: ``(..., d)`` vectors at ``x``.
            radius: sphere radius; ``None`` reads it from ``||x||``.

        Returns:
            ``(..., d)`` points of ``x``'s dtype. float16 and bfloat16 inputs are rotated in
            float32: :math:`\|v\|^2` overflows float16 from :math:`\|v\| \approx 256`, which
            would turn the point into NaN (or zero). Past :math:`\beta` or :math:`\|v\|` of
            about :math:`1.8\cdot 10^{19}` (float32) or :math:`1.3\cdot 10^{154}` (float64),
            :math:`\sigma = \|v\|^2/r^2` or its numerator overflows here too (on a sphere of
            radius :math:`r > 1` already from :math:`\beta \approx 1.8\cdot 10^{19}/r`);
            :meth:`retract_long_step` is the form for such steps (no check is made here:
            :meth:`~manifoldlib.Sphere.retr` checks and switches).
        """
        work = torch.promote_types(x.dtype, torch.float32)
        xw, vw = x.to(work), v.to(work)
        radius_sq = (xw * xw).sum(-1, keepdim=True) if radius is None else radius * radius
        vw = sphere_project_tangent(xw, vw, radius_sq)  # (..., d)
        cos_theta, k = self.coefficients(sphere_normalized_sq_step(vw, radius_sq))
        return rotate(xw, vw, cos_theta, k).to(x.dtype)

    def retract_long_step(self, x: torch.Tensor, v: torch.Tensor, radius: float | torch.Tensor | None = None) -> torch.Tensor:
        r""":meth:`retract` computed from :meth:`angle` itself, for steps whose :math:`\beta^2` overflows.

        :math:`R_x(v) = \cos\theta\,x + \sin\theta\,r\,\hat v` with :math:`\beta` and
        :math:`\hat v = P_xv/\|P_xv\|` from :func:`~manifoldlib.functional.sphere_step_length`
        (nothing squared). A saturating angle (gnomonic :math:`\pi/2`, Cayley :math:`\pi`, the
        p-family :math:`p\pi/2`) gives its limit point; the exponential map rotates by the
        computed :math:`\beta` itself, exact for the input perturbed by rounding — past
        :math:`\beta \approx 2\pi/\varepsilon` the position along the great circle is
        therefore not determined by the input, though the point is on it. Rows whose angle
        is not finite (the exponential map when :math:`\beta` overflows) come back non-finite.

        Same arguments and result as :meth:`retract`.
        """
        work = torch.promote_types(x.dtype, torch.float32)
        xw, vw = x.to(work), v.to(work)
        r = xw.norm(dim=-1, keepdim=True) if radius is None else radius
        unit = xw / r  # (..., d)
        m = vw.abs().amax(-1, keepdim=True)  # (..., 1): v / m cannot overflow what follows
        m = torch.where(m > 0, m, torch.ones_like(m))
        vs = vw / m
        vs = vs - (unit * vs).sum(-1, keepdim=True) * unit  # P_x(v) / m, (..., d)
        beta, direction = sphere_step_length(vs, r / m)  # (..., 1), (..., d)
        theta = self.angle(beta)
        return (torch.cos(theta) * xw + (torch.sin(theta) * r) * direction).to(x.dtype)


@register_retraction("sphere", "exp")
class ExponentialRetraction(AngleRetraction):
    r"""Exponential map (GeoNorm): :math:`\theta = \beta`. Can wrap around the sphere."""

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        return beta

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return exponential_coefficients(sigma)


@register_retraction("sphere", "gnomonic", aliases=("projection",))
class GnomonicRetraction(AngleRetraction):
    r"""Gnomonic = metric projection (Proj-SpheretNorm, p = 1): :math:`(x + v)/\sqrt{1+\sigma}`."""

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        return torch.atan(beta)

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gnomonic_coefficients(sigma)

    def coefficients_vjp(self, sigma, cos_theta, k, grad_cos, grad_k):
        return _gnomonic_vjp(cos_theta, grad_cos, grad_k)


@register_retraction("sphere", "cayley", aliases=("stereographic",))
class CayleyRetraction(AngleRetraction):
    r"""Cayley = stereographic (Cay-SpheretNorm, p = 2): :math:`((1-\sigma/4)x + v)/(1+\sigma/4)`."""

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.atan(0.5 * beta)

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cayley_coefficients(sigma)

    def coefficients_vjp(self, sigma, cos_theta, k, grad_cos, grad_k):
        return _cayley_vjp(k, grad_cos, grad_k)


@register_retraction("sphere", "p")
class PRetraction(AngleRetraction):
    r"""p-family (p-SpheretNorm): :math:`\theta = p\arctan(\beta/p)`, :math:`p \in (0, \infty]`.

    ``p = 1`` is gnomonic, ``p = 2`` Cayley, ``p = inf`` the exponential map, ``p -> 0``
    the identity. For finite ``p`` the angle saturates below :math:`p\pi/2`.
    """

    def __init__(self, p: float = 1.0):
        if not is_real(p):  # float() would take True as 1 and parse '2'
            raise ValueError(f"p must be a number in (0, inf], got {p!r}")
        value = float(p)
        if math.isnan(value) or value <= 0:
            raise ValueError(f"p must be in (0, inf], got {p!r}")
        self.p = value

    def options(self) -> dict:
        return {"p": self.p}

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        if math.isinf(self.p):
            return beta
        return self.p * torch.atan(beta / self.p)

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # p = 1 and p = 2 are the gnomonic and Cayley members: their branch-free closed forms
        if self.p == 1.0:
            return gnomonic_coefficients(sigma)
        if self.p == 2.0:
            return cayley_coefficients(sigma)
        return p_coefficients(sigma, self.p)

    def coefficients_vjp(self, sigma, cos_theta, k, grad_cos, grad_k):
        if self.p == 1.0:
            return _gnomonic_vjp(cos_theta, grad_cos, grad_k)
        if self.p == 2.0:
            return _cayley_vjp(k, grad_cos, grad_k)
        return super().coefficients_vjp(sigma, cos_theta, k, grad_cos, grad_k)
