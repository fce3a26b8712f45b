"""Every registered ``(manifold, retraction)`` pair as a ready manifold object.

Meant for parametrized tests.

``registered_manifolds()`` reads the registry when called, so a retraction registered by a user
(or a later version of the library) is covered by a parametrized suite without editing it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..manifolds import get_manifold
from ..manifolds.base import RetractionManifold
from ..retractions.base import MANIFOLD_NAMES, available_retractions

__all__ = ["registered_manifolds"]

#: Geometry keyword arguments used for each family (a non-unit radius catches r/r² mix-ups).
_GEOMETRY = {"sphere": {"radius": 2.5}, "stiefel": {}, "dgram": {}, "oblique": {}, "euclidean": {"ndim": 1}}


def registered_manifolds(
    families: str | Sequence[str] = MANIFOLD_NAMES, *, aliases: bool = False
) -> list[tuple[str, RetractionManifold]]:
    """``[(id, manifold), ...]`` with one manifold per registered retraction of ``families``.

    Args:
        families: registry names to include, at least one; a single name (``"sphere"``) is
            that family.
        aliases: include alias names (``projection``, ``stereographic``) as separate cases.

    Returns:
        ids like ``"sphere-cayley"`` with the matching manifold object.

    Raises:
        ValueError: no family at all (a suite parametrized by no case runs nothing and passes),
            or an unknown family name.
    """
    from ..retractions.base import _ALIASES  # registry internals: aliases are skipped by default

    if isinstance(families, str):  # iterated, a name is its letters: "unknown manifold 's'"
        families = (families,)
    if not families:
        raise ValueError(f"families must name at least one manifold family, got {families!r}; "
                         f"valid names: {', '.join(MANIFOLD_NAMES)}")
    cases = []
    for family in families:
        for name in available_retractions(family):
            if not aliases and name in _ALIASES[family]:
                continue
            cases.append(
                (f"{family}-{name}", get_manifold(family, retraction=name, **_GEOMETRY[family]))
            )
    return cases
