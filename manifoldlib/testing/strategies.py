r"""Hypothesis strategies for points and tangent vectors of manifoldlib's manifolds.

Hypothesis draws a seed and a shape; the tensor itself comes from a :class:`torch.Generator`
seeded with it, so drawing is fast and a failing example is reproduced from two integers.

.. code-block:: python

    from hypothesis import given
    from manifoldlib import Stiefel
    from manifoldlib.testing import strategies

    st = Stiefel()

    @given(strategies.point_and_tangent(st, scale=(0.0, 1.0)))
    def test_polar_stays_on_stiefel(xv):
        x, v = xv                      # (b, m, n) float64, v tangent at x
        assert st.check_point_on_manifold(st.retr(x, v))

Shapes: ``batch`` is the size of one leading batch dimension (``None``: no batch dimension);
``dim`` is the point dimension ``d`` on the sphere, the row count ``m`` on Stiefel and DGram
(with ``cols`` giving ``n <= m``), and the size of every point dimension for Euclidean. Each of
them is an ``int`` or an inclusive ``(low, high)`` range.
"""

from __future__ import annotations

import math
from typing import Union

import torch
from hypothesis import strategies as st

from ..manifolds.base import RetractionManifold
from .sampling import random_point, random_tangent

__all__ = ["point_and_tangent", "points", "seeds", "shapes", "tangents"]

IntRange = Union[int, tuple[int, int]]
FloatRange = Union[float, tuple[float, float]]

_SEED_MAX = 2**31 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_range(value: IntRange, name: str, low: int = 1) -> st.SearchStrategy[int]:
    # a bool was a size of 0 or 1, a float a TypeError from unpacking or from hypothesis
    pair = (value, value) if _is_int(value) else tuple(value) if isinstance(value, (tuple, list)) else ()
    lo, hi = pair if len(pair) == 2 and all(_is_int(v) for v in pair) else (None, None)
    if lo is None or lo < low or hi < lo:
        raise ValueError(
            f"{name} must be an int >= {low} or a range (lo, hi) with {low} <= lo <= hi, "
            f"got {value!r}"
        )
    return st.integers(lo, hi)


def _float_range(value: FloatRange, name: str) -> st.SearchStrategy[float]:
    lo, hi = (value, value) if isinstance(value, (int, float)) else value
    if not (0 <= lo <= hi and math.isfinite(hi)):
        raise ValueError(
            f"{name} must be >= 0 and finite, or a range (lo, hi) with 0 <= lo <= hi < inf, got {value!r}"
        )
    if lo == hi:
        return st.just(float(lo))
    return st.floats(float(lo), float(hi), allow_nan=False, allow_infinity=False)


def seeds(stream: int = 0) -> st.SearchStrategy[torch.Generator]:
    """Seeded :class:`torch.Generator` objects (the only randomness hypothesis controls).

    ``stream`` selects a disjoint seed range: points draw from stream 0 and tangents from
    stream 1, so a shrunk example never reuses the point's Gaussian draw as the tangent's
    (which would make the ambient vector parallel to the point).
    """
    return st.integers(0, _SEED_MAX).map(
        lambda s: torch.Generator().manual_seed(s + stream * (_SEED_MAX + 1))
    )


def shapes(
    manifold: RetractionManifold,
    *,
    batch: IntRange | None = (1, 3),
    dim: IntRange = (2, 6),
    cols: IntRange | None = None,
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes of point tensors of ``manifold``.

    Args:
        manifold: a manifoldlib manifold.
        batch: size range of one leading batch dimension, or ``None`` for none.
        dim: sphere ``d``; Stiefel/DGram ``m``; Euclidean size of each point dimension.
        cols: Stiefel/DGram/Oblique ``n`` range (clipped to ``<= m``; ``m`` is drawn from the
            part of ``dim`` at or above its low end); default ``(1, m)``; only for those.

    Raises:
        ValueError: a range that is not ints ``>= 1`` with ``lo <= hi`` (``cols`` too), a
            ``cols`` whose low end is above every ``m`` of ``dim``, or a ``cols`` for a manifold
            whose points are not matrices (the sphere, Euclidean space).
    """
    lead = st.just(()) if batch is None else _int_range(batch, "batch").map(lambda b: (b,))
    dims = _int_range(dim, "dim")
    if manifold.name in ("stiefel", "dgram", "oblique"):
        # checked here, not per draw: an n range above some of dim's m failed only the draws of such m
        m_lo, m_hi = (dim, dim) if isinstance(dim, int) else dim
        if cols is not None:
            _int_range(cols, "cols")  # its own value in the message
        n_lo, n_hi = (1, m_hi) if cols is None else (cols, cols) if isinstance(cols, int) else cols
        _int_range((n_lo, n_hi), "cols")
        if n_lo > m_hi:
            raise ValueError(f"cols must allow 1 <= n <= m for some m in dim {dim!r}, got {cols!r}")
        rows = st.integers(max(m_lo, n_lo), m_hi)  # the m that admit an n of cols

        @st.composite
        def matrix(draw):
            m = draw(rows)
            n = draw(st.integers(n_lo, min(n_hi, m)))
            return draw(lead) + (m, n)

        return matrix()
    if cols is not None:  # the points have no columns to draw: cols would pass without effect
        raise ValueError(f"cols applies to the matrix manifolds (stiefel, dgram, oblique), not {manifold.name}, "
                         f"got cols={cols!r}")
    if manifold.name == "sphere":
        return st.tuples(lead, dims).map(lambda t: t[0] + (t[1],))
    return st.tuples(lead, st.lists(dims, min_size=manifold.ndim, max_size=manifold.ndim)).map(
        lambda t: t[0] + tuple(t[1])
    )


def points(
    manifold: RetractionManifold,
    *,
    batch: IntRange | None = (1, 3),
    dim: IntRange = (2, 6),
    cols: IntRange | None = None,
    dtype: torch.dtype = torch.float64,
) -> st.SearchStrategy[torch.Tensor]:
    """Points of ``manifold`` (``manifold.random`` from a drawn seed and shape), in ``dtype``."""

    shape_strategy = shapes(manifold, batch=batch, dim=dim, cols=cols)  # its argument errors raise here

    @st.composite
    def draw_point(draw):
        shape = draw(shape_strategy)
        return random_point(manifold, shape, generator=draw(seeds()), dtype=dtype)

    return draw_point()


def tangents(
    manifold: RetractionManifold, point: torch.Tensor, *, scale: FloatRange = (0.0, 1.0)
) -> st.SearchStrategy[torch.Tensor]:
    r"""Tangent vectors at ``point`` with per-point norm ``scale * ||point||``.

    ``scale`` is a number or a range to draw it from.
    """
    scales = _float_range(scale, "scale")

    @st.composite
    def draw_tangent(draw):
        return random_tangent(manifold, point, scale=draw(scales), generator=draw(seeds(1)))

    return draw_tangent()


def point_and_tangent(
    manifold: RetractionManifold,
    *,
    batch: IntRange | None = (1, 3),
    dim: IntRange = (2, 6),
    cols: IntRange | None = None,
    dtype: torch.dtype = torch.float64,
    scale: FloatRange = (0.0, 1.0),
) -> st.SearchStrategy[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, v)``: a point from :func:`points` and a tangent vector at it from :func:`tangents`."""
    point_strategy = points(manifold, batch=batch, dim=dim, cols=cols, dtype=dtype)
    scales = _float_range(scale, "scale")

    # one composite rather than ``flatmap``: the tangent must be built from the very tensor drawn
    @st.composite
    def draw_pair(draw):
        x = draw(point_strategy)
        return x, random_tangent(manifold, x, scale=draw(scales), generator=draw(seeds(1)))

    return draw_pair()
