"""Layers for hidden states on manifolds.

- :class:`SphereResidual` — the retraction residual :math:`h \\mapsto R_h(\\alpha\\lambda P_h F)`
  (SpheretNorm, GeoNorm), with an analytic backward.
- :class:`ScaleNorm` — :math:`g\\,x/\\max(\\|x\\|, \\varepsilon)`, puts hidden states on a sphere.
- :class:`DyT` — :math:`\\gamma \\tanh(\\alpha x) + \\beta`.
"""

from ._fused import sphere_residual, sphere_residual_reference
from .dyt import DyT
from .residual import DAMPINGS, STEP_FORMS, SphereResidual, damping_factor
from .scalenorm import ScaleNorm

__all__ = [
    "DAMPINGS",
    "DyT",
    "STEP_FORMS",
    "ScaleNorm",
    "SphereResidual",
    "damping_factor",
    "sphere_residual",
    "sphere_residual_reference",
]
