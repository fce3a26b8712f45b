"""Retraction classes and the registry that selects them by ``(manifold, name)``.

Registered names — sphere: ``exp``, ``gnomonic`` (alias ``projection``), ``cayley`` (alias
``stereographic``), ``p``; stiefel: ``polar``, ``qr``, ``cayley``, ``exp``; dgram: ``alternating``,
``colnorm-polar``; oblique: ``normalize``; euclidean: ``add``.
"""

from .base import (
    MANIFOLD_NAMES,
    Retraction,
    available_retractions,
    get_retraction,
    register_retraction,
    resolve_retraction,
)
from .dgram import DGramAlternatingRetraction, DGramColnormPolarRetraction
from .euclidean import AddRetraction
from .oblique import ObliqueNormalizeRetraction
from .sphere import (
    AngleRetraction,
    CayleyRetraction,
    ExponentialRetraction,
    GnomonicRetraction,
    PRetraction,
)
from .stiefel import (
    StiefelCayleyRetraction,
    StiefelExpRetraction,
    StiefelPolarRetraction,
    StiefelQRRetraction,
)

__all__ = [
    "MANIFOLD_NAMES",
    "AddRetraction",
    "AngleRetraction",
    "CayleyRetraction",
    "DGramAlternatingRetraction",
    "DGramColnormPolarRetraction",
    "ExponentialRetraction",
    "GnomonicRetraction",
    "ObliqueNormalizeRetraction",
    "PRetraction",
    "Retraction",
    "StiefelCayleyRetraction",
    "StiefelExpRetraction",
    "StiefelPolarRetraction",
    "StiefelQRRetraction",
    "available_retractions",
    "get_retraction",
    "register_retraction",
    "resolve_retraction",
]
