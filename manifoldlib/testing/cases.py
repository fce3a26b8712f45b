"""Every registered ``(manifold, retraction)`` pair as a ready manifold object.

Meant for parametrized tests.

``registered_manifolds()`` reads the registry when called, so a retraction registered by a user
(or a later version of the library) is covered by a parametrized suite without editing it.
"""

from __future__ import annotations

from ..manifolds import get_manifold
from ..manifolds.base import RetractionManifold
from ..retractions.base import MANIFOLD_NAMES, available_retractions

__all__ = ["registered_manifolds"]

#: Geometry keyword arguments used for each family (a non-unit radius catches r/r² mix-ups).
_GEOMETRY = {"sphere": {"radius": 2.5}, "stiefel": {}, "dgram": {}, "oblique": {}, "euclidean": {"ndim": 1}}


def registered_manifolds(
    families: tuple[str, ...] = MANIFOLD_NAMES, *, aliases: bool = False
) -> list[tuple[str, RetractionManifold]]:
    """``[(id, manifold), ...]`` with one manifold per registered retraction of ``families``.

    Args:
        families: registry names to include.
        aliases: include alias names (``projection``, ``stereographic``) as separate cases.

    Returns:
        ids like ``"sphere-cayley"`` with the matching manifold object.
    """
    from ..retractions.base import _ALIASES  # registry internals: aliases are skipped by default

    cases = []
    for family in families:
        for name in available_retractions(family):
            if not aliases and name in _ALIASES[family]:
                continue
            cases.append(
                (f"{family}-{name}", get_manifold(family, retraction=name, **_GEOMETRY[family]))
            )
    return cases
