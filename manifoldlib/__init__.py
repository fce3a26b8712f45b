"""manifoldlib: deep learning on manifolds with a geoopt backend.

Sphere, Stiefel, DGram and Oblique manifolds with pluggable retraction families, reused for hidden-state
residual updates (:mod:`manifoldlib.nn`), weight-space Manifold Muon (:mod:`manifoldlib.optim`)
and curved parameter charts (:mod:`manifoldlib.charts`).
"""

from . import functional, retractions
from .manifolds import DGram, Euclidean, Oblique, Sphere, Stiefel, available_manifolds, get_manifold

__version__ = "0.1.0"

__all__ = [
    "DGram",
    "Euclidean",
    "Oblique",
    "Sphere",
    "Stiefel",
    "available_manifolds",
    "functional",
    "get_manifold",
    "retractions",
]
