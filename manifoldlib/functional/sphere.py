r"""Sphere kernels: tangent projection and the rotation coefficients of the retraction family.

Every sphere retraction here rotates :math:`x` in the plane :math:`\operatorname{span}(x, v)` by an
angle :math:`\theta(\beta)`, :math:`\beta = \|v\|/r`:

.. math::
    R_x(v) = \cos\theta \, x + k \, v, \qquad k = \frac{\sin\theta}{\beta}.

Both :math:`\cos\theta` and :math:`k` are even in :math:`\beta`, so every kernel takes
:math:`\sigma = \beta^2 = \|v\|^2 / r^2` and returns ``(cos_theta, k)``. The closed forms for the
gnomonic and Cayley members are branch-free; the exponential and p-family members switch to a
Taylor series near :math:`\sigma = 0` with the *double-where* pattern (the argument of the unsafe
branch is made safe before the unsafe op), so values and gradients are finite at :math:`v = 0`.
"""

from __future__ import annotations

import math

import torch

from .._numbers import require_positive

__all__ = [
    "sphere_project_tangent",
    "sphere_normalized_sq_step",
    "sphere_unit_tangent",
    "sphere_step_length",
    "sphere_antipode_direction",
    "gnomonic_coefficients",
    "cayley_coefficients",
    "exponential_coefficients",
    "p_coefficients",
    "rotate",
]


def _series_threshold(dtype: torch.dtype) -> float:
    # Below this the Taylor branches are used (1e-4 in float64, eps^(1/2) otherwise; see the
    # theory page docs/theory/sphere.rst, section Numerics). The series carry terms up to s^3
    # (atan(z)/z up to z^8), so the first dropped term is below s^4/40320 ~ 2.5e-21 at
    # s = 1e-4: exact to rounding on both sides of the switch.
    return 1e-4 if dtype == torch.float64 else math.sqrt(float(torch.finfo(dtype).eps))


def _cos_sqrt_series(s: torch.Tensor) -> torch.Tensor:
    # cos(sqrt(s)) = 1 - s/2 + s^2/24 - s^3/720 + O(s^4)
    return 1.0 + s * (-1.0 / 2.0 + s * (1.0 / 24.0 - s / 720.0))


def _sinc_sqrt_series(s: torch.Tensor) -> torch.Tensor:
    # sin(sqrt(s))/sqrt(s) = 1 - s/6 + s^2/120 - s^3/5040 + O(s^4)
    return 1.0 + s * (-1.0 / 6.0 + s * (1.0 / 120.0 - s / 5040.0))


def _atanc_sqrt_series(s: torch.Tensor) -> torch.Tensor:
    # atan(z)/z with s = z^2: 1 - s/3 + s^2/5 - s^3/7 + s^4/9 + O(s^5)
    return 1.0 + s * (-1.0 / 3.0 + s * (1.0 / 5.0 + s * (-1.0 / 7.0 + s / 9.0)))


def sphere_project_tangent(x: torch.Tensor, z: torch.Tensor, radius_sq: torch.Tensor | float) -> torch.Tensor:
    r""":math:`P_x(z) = z - \frac{\langle x, z\rangle}{r^2} x` over the last dimension.

    Args:
        x: ``(..., d)`` points of norm ``r``.
        z: ``(..., d)`` ambient vectors (broadcast against ``x``).
        radius_sq: :math:`r^2`, a float or a tensor broadcastable to ``(..., 1)``.
    """
    return z - ((x * z).sum(-1, keepdim=True) / radius_sq) * x


def sphere_normalized_sq_step(v: torch.Tensor, radius_sq: torch.Tensor | float) -> torch.Tensor:
    r""":math:`\sigma = \|v\|^2 / r^2`, shape ``(..., 1)``."""
    return (v * v).sum(-1, keepdim=True) / radius_sq


def sphere_unit_tangent(x: torch.Tensor, z: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    r"""The *normalized* tangent update: :math:`P_x z` rescaled to the radius,

    .. math::
        \hat z = \frac{r\,P_x z}{\sqrt{\|P_x z\|^2 + \varepsilon^2 r^2}}, \qquad
        P_x z = z - \frac{\langle x, z\rangle}{r^2} x, \quad r = \|x\|,

    so that a retraction of :math:`s\hat z` has the normalized step :math:`\beta = s` (up to the
    relative floor :math:`\varepsilon`) whatever the scale of :math:`z`: the direction of
    :math:`P_x z` is kept, its length is the radius. :math:`P_x z` is formed explicitly before
    its norm is taken (not as :math:`\|z\|^2 - \langle x,z\rangle^2/r^2`, which cancels when
    :math:`z` is nearly parallel to :math:`x` and would turn rounding into a full step), and the
    floor keeps the value and every derivative finite where :math:`P_x z = 0` (there
    :math:`\hat z = 0`, so the retraction is the identity). The factor is formed as
    :math:`r/\sqrt{D}`, :math:`D = \|P_x z\|^2 + \varepsilon^2 r^2`, not :math:`\sqrt{r^2/D}`, whose
    quotient is subnormal (a few bits) where :math:`\|P_x z\|/r` is past the square root of the
    dtype's largest number.

    Args:
        x: ``(..., d)`` nonzero points.
        z: ``(..., d)`` updates.
        eps: relative floor :math:`\varepsilon > 0` on :math:`\|P_x z\| / r`.

    Returns:
        ``(..., d)`` tangent vectors at ``x`` of norm :math:`\le r`.

    Raises:
        ValueError: ``eps`` is not a finite number ``> 0`` (0 gave NaN rows where
            :math:`P_x z = 0`, NaN every row NaN).
    """
    require_positive("eps", eps)
    q = (x * x).sum(-1, keepdim=True)  # r², (..., 1)
    u = z - ((x * z).sum(-1, keepdim=True) / q) * x  # P_x z, (..., d)
    n = (u * u).sum(-1, keepdim=True)  # ||P_x z||², (..., 1)
    # r / sqrt(D), not sqrt(r² / D): for ||P_x z|| far above r the quotient r²/D is subnormal
    return u * (q.sqrt() / (n + (eps * eps) * q).sqrt())


def sphere_step_length(v: torch.Tensor, radius: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Overflow-safe :math:`\beta = \|v\|/r` and unit direction :math:`\hat v = v/\|v\|`.

    ``v`` is divided by its largest entry :math:`m` before its norm is taken, so
    :math:`\|v\|^2` is never formed: :math:`\beta = (m/r)\,\|v/m\|` is finite for every finite
    ``v`` whose :math:`\beta` fits the dtype (past it, ``inf``, still a valid argument of a
    saturating angle such as :math:`\arctan`). A zero row has :math:`\beta = 0` and
    :math:`\hat v = 0`. The long-step form of a rotation,
    :math:`\cos\theta(\beta)\,x + \sin\theta(\beta)\,r\hat v`, needs nothing else.

    Args:
        v: ``(..., d)`` vectors.
        radius: :math:`r > 0`, a float or a tensor broadcastable to ``(..., 1)``.

    Returns:
        ``(beta, direction)``: ``(..., 1)`` and ``(..., d)``.
    """
    m = v.abs().amax(-1, keepdim=True)  # (..., 1)
    m = torch.where(m > 0, m, torch.ones_like(m))
    scaled = v / m  # (..., d), entries in [-1, 1]
    length = torch.linalg.vector_norm(scaled, dim=-1, keepdim=True)  # (..., 1), in [1, sqrt(d)] or 0
    direction = scaled / torch.where(length > 0, length, torch.ones_like(length))
    return (m / radius) * length, direction


def sphere_antipode_direction(x: torch.Tensor) -> torch.Tensor:
    r"""The fixed unit tangent direction at :math:`x` towards its antipode :math:`-x`.

    Every great circle through :math:`x` reaches :math:`-x`, so the logarithm there needs a
    choice; this one is deterministic: the tangent projection of the coordinate axis
    :math:`e_j`, :math:`j` the first index of the smallest :math:`|x_j|`, normalized. Since
    :math:`x_j^2 \le \|x\|^2/d`, the projection has norm at least :math:`\sqrt{1 - 1/d}`
    (for ``d = 1`` the tangent space is :math:`\{0\}` and the direction is 0).

    Args:
        x: ``(..., d)`` nonzero points.

    Returns:
        ``(..., d)`` unit tangent vectors at ``x`` (zero when ``d = 1``).
    """
    j = x.abs().argmin(dim=-1, keepdim=True)  # (..., 1), first minimum
    axis = torch.zeros_like(x).scatter_(-1, j, 1.0)  # (..., d), e_j
    u = sphere_project_tangent(x, axis, (x * x).sum(-1, keepdim=True))  # (..., d)
    norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    return u / torch.where(norm > 0.5, norm, torch.ones_like(norm))  # d = 1: u is ~0, keep it


def gnomonic_coefficients(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Gnomonic (metric projection), :math:`\theta = \arctan\beta`:
    :math:`\cos\theta = k = (1+\sigma)^{-1/2}`, so :math:`R_x(v) = (x+v)/\sqrt{1+\sigma}`."""
    c = torch.rsqrt(1.0 + sigma)
    return c, c


def cayley_coefficients(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Cayley (stereographic), :math:`\theta = 2\arctan(\beta/2)`:
    :math:`\cos\theta = (1-\sigma/4)/(1+\sigma/4)`, :math:`k = 1/(1+\sigma/4)`."""
    k = 1.0 / (1.0 + 0.25 * sigma)
    return (1.0 - 0.25 * sigma) * k, k


def exponential_coefficients(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Exponential map, :math:`\theta = \beta`: :math:`\cos\sqrt\sigma`, :math:`\sin\sqrt\sigma/\sqrt\sigma`.

    Below the series threshold: :math:`1 - \sigma/2 + \sigma^2/24 - \sigma^3/720` and
    :math:`1 - \sigma/6 + \sigma^2/120 - \sigma^3/5040` (exact to rounding there).
    """
    small = sigma < _series_threshold(sigma.dtype)
    safe = torch.where(small, torch.ones_like(sigma), sigma)  # double-where: no sqrt(0) in autograd
    beta = safe.sqrt()
    cos_big, k_big = torch.cos(beta), torch.sin(beta) / beta
    series = torch.where(small, sigma, torch.zeros_like(sigma))  # and no sigma^3 = inf in it either
    cos_small = _cos_sqrt_series(series)
    k_small = _sinc_sqrt_series(series)
    return torch.where(small, cos_small, cos_big), torch.where(small, k_small, k_big)


def p_coefficients(sigma: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The p-family, :math:`\theta = p\arctan(\beta/p)`, :math:`p \in (0, \infty]`.

    With :math:`z^2 = \sigma/p^2` and :math:`g = \arctan(z)/z` (series
    :math:`1 - z^2/3 + z^4/5 - z^6/7 + z^8/9` for small :math:`z`):
    :math:`\theta = \sqrt\sigma\, g` and :math:`k = (\sin\theta/\theta)\, g`.
    ``p = inf`` is the exponential map.
    """
    if not p > 0:  # also rejects NaN
        raise ValueError(f"p must be in (0, inf], got {p!r}")
    if math.isinf(p):
        return exponential_coefficients(sigma)
    threshold = _series_threshold(sigma.dtype)
    z2 = sigma / (p * p)
    small_z = z2 < threshold
    z2_safe = torch.where(small_z, torch.ones_like(z2), z2)
    z_safe = z2_safe.sqrt()
    # the series at a safe argument too: at a large z^2 its powers overflow, and the backward of
    # the branch torch.where does not take turned 0 * inf into NaN gradients
    z2_series = torch.where(small_z, z2, torch.zeros_like(z2))
    g = torch.where(small_z, _atanc_sqrt_series(z2_series), torch.atan(z_safe) / z_safe)
    theta_sq = sigma * g * g
    small_t = theta_sq < threshold
    t2_safe = torch.where(small_t, torch.ones_like(theta_sq), theta_sq)
    theta_safe = t2_safe.sqrt()
    t2_series = torch.where(small_t, theta_sq, torch.zeros_like(theta_sq))
    cos_theta = torch.where(small_t, _cos_sqrt_series(t2_series), torch.cos(theta_safe))
    sinc = torch.where(small_t, _sinc_sqrt_series(t2_series), torch.sin(theta_safe) / theta_safe)
    return cos_theta, sinc * g


def rotate(x: torch.Tensor, v: torch.Tensor, cos_theta: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    r""":math:`\cos\theta\, x + k\, v` (the shared planar rotation), shapes ``(..., d)``."""
    return cos_theta * x + k * v
