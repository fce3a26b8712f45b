"""Pure tensor kernels: no classes, no state. Everything else in manifoldlib builds on these."""

from .dgram import (
    dgram_alternating,
    dgram_colnorm_polar,
    dgram_metric_projection,
    dgram_normal_multiplier,
    dgram_project_tangent,
    off_diagonal,
)
from .msign import (
    JORDAN5_COEFFICIENTS,
    MSIGN_METHODS,
    POLAR_EXPRESS_COEFFICIENTS,
    msign,
    newton_schulz,
)
from .normal_space import diagonal_part, normal_metric, normal_multiplier
from .oblique import (
    oblique_constraint_deviation,
    oblique_exp,
    oblique_normalize,
    oblique_project_tangent,
)
from .sphere import (
    cayley_coefficients,
    exponential_coefficients,
    gnomonic_coefficients,
    p_coefficients,
    rotate,
    sphere_antipode_direction,
    sphere_normalized_sq_step,
    sphere_step_length,
    sphere_unit_tangent,
    sphere_project_tangent,
)
from .stiefel import (
    stiefel_cayley,
    stiefel_exp,
    stiefel_polar,
    stiefel_project_tangent,
    stiefel_qr,
    sym,
)

__all__ = [
    "JORDAN5_COEFFICIENTS",
    "MSIGN_METHODS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "cayley_coefficients",
    "dgram_alternating",
    "dgram_colnorm_polar",
    "dgram_metric_projection",
    "dgram_normal_multiplier",
    "dgram_project_tangent",
    "diagonal_part",
    "exponential_coefficients",
    "gnomonic_coefficients",
    "msign",
    "newton_schulz",
    "normal_metric",
    "normal_multiplier",
    "oblique_constraint_deviation",
    "oblique_exp",
    "oblique_normalize",
    "oblique_project_tangent",
    "off_diagonal",
    "p_coefficients",
    "rotate",
    "sphere_antipode_direction",
    "sphere_normalized_sq_step",
    "sphere_step_length",
    "sphere_unit_tangent",
    "sphere_project_tangent",
    "stiefel_cayley",
    "stiefel_exp",
    "stiefel_polar",
    "stiefel_project_tangent",
    "stiefel_qr",
    "sym",
]
