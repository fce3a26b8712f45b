r"""The sphere :math:`S^{d-1}_r = \{x \in \mathbb{R}^d: \|x\| = r\}` over the last dimension."""

from __future__ import annotations

import math
from typing import Union

import torch

from ..functional.sphere import (
    exponential_coefficients,
    rotate,
    sphere_normalized_sq_step,
    sphere_project_tangent,
)
from ..retractions.base import Retraction
from ..retractions.sphere import AngleRetraction
from .base import RetractionManifold, _random_normal, _size_tuple

__all__ = ["Sphere"]


class Sphere(RetractionManifold):
    r"""Sphere of radius ``radius`` over the last dimension, points ``(..., d)``.

    Tangent projection :math:`P_x(z) = z - (\langle x, z\rangle/r^2)\,x`; the retraction is any
    registered sphere retraction (``"gnomonic"`` by default; ``"exp"``, ``"cayley"``, ``"p"`` with
    ``p=...``, or a user's own :class:`~manifoldlib.retractions.AngleRetraction`).

    Args:
        radius: :math:`r > 0`.
        retraction: registry name or instance.
        **retraction_options: options of a named retraction (e.g. ``p=1.5``).
    """

    name = "sphere"
    ndim = 1
    default_retraction = "gnomonic"

    def __init__(self, radius: float = 1.0, retraction: Union[str, Retraction, None] = None, **retraction_options):
        if isinstance(radius, (bool, str)):  # float() would take True as 1 and parse '2'
            raise ValueError(f"radius must be a finite number > 0, got {radius!r}")
        try:
            r = float(radius)
        except (TypeError, ValueError):
            raise ValueError(f"radius must be a positive number, got {radius!r}") from None
        if not math.isfinite(r) or r <= 0:
            raise ValueError(f"radius must be a finite number > 0, got {radius!r}")
        super().__init__(retraction, **retraction_options)
        self.radius = r

    def _init_kwargs(self) -> dict:
        return {"radius": self.radius}

    def _check_shape(self, shape, name):
        if len(shape) < 1 or shape[-1] < 1:
            return False, f"'{name}' on the sphere needs shape (..., d) with d >= 1, got {tuple(shape)}"
        return True, None

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        norm = x.norm(dim=-1)
        err = (norm - self.radius).abs()
        ok = bool((err <= atol + rtol * self.radius).all())
        return ok, None if ok else f"||x|| - r = {err.max().item():.3e} exceeds atol={atol}, rtol={rtol} (r={self.radius})"

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        inner = (x * u).sum(-1).abs()
        bound = atol + rtol * self.radius * u.norm(dim=-1)
        ok = bool((inner <= bound).all())
        return ok, None if ok else f"<x, u> = {inner.max().item():.3e} exceeds atol={atol}, rtol={rtol}"

    def inner(self, x, u, v=None, *, keepdim=False):
        v = u if v is None else v
        return (u * v).sum(-1, keepdim=keepdim)

    def projx(self, x):
        r"""Radial projection :math:`r\,x/\|x\|` (a zero vector has no projection and stays 0)."""
        self._validate(x, "x")
        return self.radius * x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)

    def proju(self, x, u):
        self._validate_pair(x, u)
        return sphere_project_tangent(x, u, self.radius**2)

    def retr(self, x, u):
        self._validate_pair(x, u)
        if isinstance(self._retraction, AngleRetraction):
            return self._retraction.retract(x, u, radius=self.radius)
        return self._retraction.retract(x, u)

    def expmap(self, x, u):
        r"""Exponential map :math:`\cos\beta\,x + (\sin\beta/\beta)\,u`, :math:`\beta = \|u\|/r`."""
        self._validate_pair(x, u)
        cos_theta, k = exponential_coefficients(sphere_normalized_sq_step(u, self.radius**2))
        return rotate(x, u, cos_theta, k)

    def logmap(self, x, y):
        r"""Inverse of :meth:`expmap` (undefined at the antipode)."""
        r2 = self.radius**2
        w = sphere_project_tangent(x, y, r2)
        w_norm = w.norm(dim=-1, keepdim=True)
        theta = torch.atan2(w_norm * self.radius, (x * y).sum(-1, keepdim=True))
        return self.radius * theta * w / w_norm.clamp_min(torch.finfo(x.dtype).tiny)

    def dist(self, x, y, *, keepdim=False):
        """Geodesic (great-circle) distance."""
        return self.logmap(x, y).norm(dim=-1, keepdim=keepdim)

    def random(self, *size, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
        """Uniform points: ``random(8, 64)`` gives 8 points of :math:`S^{63}_r`."""
        shape = _size_tuple(size)
        self._validate(torch.empty(shape, device="meta"), "size")
        z, dtype = _random_normal(shape, generator, dtype, device)
        return self.projx(z).to(dtype)

    def extra_repr(self):
        return f"radius={self.radius}, retraction={self._retraction!r}"
