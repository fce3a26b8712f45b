"""The manifold object of a steepest-direction problem, from a name or an instance.

The dual solve asks the manifold for its constraint's geometry
(:class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold`); Euclidean space (``flat``) has
no dual. Names resolve once to a shared default instance.
"""

from __future__ import annotations

import functools

from ..manifolds import Euclidean, MatrixConstraintManifold, get_manifold

__all__ = ["STEEPEST_MANIFOLDS", "dual_manifold"]

#: Manifold names :func:`~manifoldlib.optim.steepest_direction` and :class:`~manifoldlib.optim.ManifoldMuon` know.
STEEPEST_MANIFOLDS = ("stiefel", "dgram", "oblique", "euclidean")


@functools.lru_cache(maxsize=None)
def _named(name: str):
    return get_manifold(name)


def dual_manifold(manifold):
    """The manifold object for ``manifold`` (a name of :data:`STEEPEST_MANIFOLDS`, or an instance of
    :class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold` or
    :class:`~manifoldlib.manifolds.Euclidean`).

    Raises:
        ValueError: an unknown name or a manifold without a matrix constraint (e.g. a sphere).
    """
    if isinstance(manifold, (MatrixConstraintManifold, Euclidean)):
        return manifold
    if isinstance(manifold, str) and manifold in STEEPEST_MANIFOLDS:
        return _named(manifold)
    raise ValueError(
        f"unknown manifold {manifold!r}; valid: {', '.join(STEEPEST_MANIFOLDS)} or a "
        f"MatrixConstraintManifold instance"
    )
