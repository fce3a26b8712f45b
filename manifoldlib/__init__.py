"""manifoldlib: deep learning on manifolds with a geoopt backend.

Sphere, Stiefel and DGram manifolds with pluggable retraction families, reused for hidden-state
residual updates (:mod:`manifoldlib.nn`), weight-space Manifold Muon (:mod:`manifoldlib.optim`)
and curved parameter charts (:mod:`manifoldlib.charts`).
"""

from . import functional, retractions
from .manifolds import DGram, Euclidean, Sphere, Stiefel, available_manifolds, get_manifold

__version__ = "0.1.0"

__all__ = [
    "DGram",
    "Euclidean",
    "Sphere",
    "Stiefel",
    "available_manifolds",
    "functional",
    "get_manifold",
    "retractions",
]
