"""geoopt-backed manifolds with pluggable retractions, and :func:`get_manifold` to build one by name."""

from __future__ import annotations

from typing import Union

from .base import RetractionManifold, default_tolerance, skip_value_checks
from .dgram import DGram
from .euclidean import Euclidean
from .matrix import MatrixConstraintManifold
from .oblique import Oblique
from .sphere import Sphere
from .stiefel import Stiefel

__all__ = [
    "DGram",
    "Euclidean",
    "MatrixConstraintManifold",
    "Oblique",
    "RetractionManifold",
    "Sphere",
    "Stiefel",
    "available_manifolds",
    "default_tolerance",
    "get_manifold",
    "skip_value_checks",
]

_MANIFOLDS = {"sphere": Sphere, "stiefel": Stiefel, "dgram": DGram, "oblique": Oblique, "euclidean": Euclidean}


def available_manifolds() -> list[str]:
    """Names accepted by :func:`get_manifold`."""
    return sorted(_MANIFOLDS)


def get_manifold(name: Union[str, RetractionManifold], **kwargs) -> RetractionManifold:
    """Build a manifold by name (``"sphere"``, ``"stiefel"``, ``"dgram"``, ``"oblique"``, ``"euclidean"``).

    Keyword arguments go to the constructor (``radius``, ``retraction``, retraction options).
    A manifold instance is returned unchanged (then ``kwargs`` must be empty).
    """
    if isinstance(name, RetractionManifold):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} cannot be applied to the instance {name!r}")
        return name
    cls = _MANIFOLDS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown manifold {name!r}; valid names: {', '.join(available_manifolds())}")
    return cls(**kwargs)
