r"""Deterministic sampling of points and tangent vectors from a torch generator.

The hypothesis strategies (:mod:`manifoldlib.testing.strategies`) and the retraction checks
(:mod:`manifoldlib.testing.order`) both build their tensors here: hypothesis draws only a seed and
the shape, torch builds the tensor (fast, and reproducible from the seed alone).

A tangent vector's size is given *relative to its point*: ``scale=0.1`` means
:math:`\|v\| = 0.1\,\|x\|` per point (norms over the manifold's trailing ``ndim`` dimensions), so
a step of the same ``scale`` means the same thing on a sphere of radius 100 and on Stiefel.
"""

from __future__ import annotations

import math

import torch

from ..manifolds.base import RetractionManifold

__all__ = ["default_shape", "point_norm", "random_point", "random_tangent"]


def default_shape(manifold: RetractionManifold, batch: int | None = 2) -> tuple[int, ...]:
    """A small shape that exercises ``manifold`` fully.

    ``(batch, 5)`` on the sphere, ``(batch, 5, 3)`` on Stiefel and DGram (tall,
    ``m > n >= 2``: square Stiefel makes Cayley second order and a single
    column makes every DGram retraction exact), ``(batch, 4)`` for Euclidean.

    Raises:
        ValueError: ``batch`` not ``None`` nor an int ``>= 1`` (``2.7`` was truncated to 2, a bool
            taken as 0 or 1, ``-1`` returned as a size).
    """
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch must be None or an int >= 1, got {batch!r}")
    lead = () if batch is None else (batch,)
    if manifold.name == "sphere":
        return lead + (5,)
    if manifold.name in ("stiefel", "dgram", "oblique"):
        return lead + (5, 3)
    return lead + (4,) + (3,) * max(0, manifold.ndim - 1)


def point_norm(manifold: RetractionManifold, x: torch.Tensor) -> torch.Tensor:
    """Per-point Euclidean norm over the manifold's trailing ``ndim`` dimensions (keepdim)."""
    if manifold.ndim == 0:
        return x.abs()
    dims = tuple(range(-manifold.ndim, 0))
    return torch.linalg.vector_norm(x, dim=dims, keepdim=True)


def random_point(
    manifold: RetractionManifold,
    shape: tuple[int, ...],
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``manifold.random(*shape)`` with an explicit generator and dtype."""
    return manifold.random(*shape, generator=generator, dtype=dtype)


def random_tangent(
    manifold: RetractionManifold,
    x: torch.Tensor,
    *,
    scale: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""A random tangent vector at ``x`` with :math:`\|v\| = \text{scale}\cdot\|x\|` per point.

    Args:
        manifold: the manifold ``x`` lies on.
        x: ``(..., *point_shape)`` points.
        scale: relative size, a finite number ``>= 0``.
        generator: torch generator for the Gaussian draw.

    Returns:
        ``v`` with ``x``'s shape and dtype, ``manifold.proju(x, v) == v``.

    Raises:
        ValueError: ``scale`` not a finite number ``>= 0`` (a bool included), or
            :math:`\text{scale}\cdot\|x\|` past the largest number of ``x``'s dtype (the
            tangent would hold infinities).
    """
    if isinstance(scale, bool) or not (scale >= 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be >= 0 and finite (not a bool), got {scale!r}")
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xw = x.to(work)
    z = torch.randn(x.shape, generator=generator, dtype=work, device=x.device)
    # projecting twice removes the normal residue left by cancellation in the first projection
    v = manifold.proju(xw, manifold.proju(xw, z))
    ref = point_norm(manifold, xw)
    ref = torch.where(ref > 0, ref, torch.ones_like(ref))
    vnorm = point_norm(manifold, v).clamp_min(torch.finfo(work).tiny)
    v = (v * (scale * ref / vnorm)).to(x.dtype)
    if bool(torch.isfinite(x).all()) and not bool(torch.isfinite(v).all()):
        raise ValueError(f"scale={scale!r} times the points' norm (up to {float(ref.max()):.3g}) is past the "
                         f"largest {x.dtype} ({torch.finfo(x.dtype).max:.3g}): the tangent would not be finite")
    return v
