"""Pure tensor kernels: no classes, no state. Everything else in manifoldlib builds on these."""

from .dgram import (
    dgram_alternating,
    dgram_colnorm_polar,
    dgram_metric_projection,
    dgram_normal_multiplier,
    dgram_project_tangent,
    off_diagonal,
)
from .msign import MSIGN_METHODS, msign
from .newton_schulz import (
    JORDAN5_COEFFICIENTS,
    MUON_COEFFICIENTS,
    NEWTON_SCHULZ_PRESETS,
    POLAR_EXPRESS_COEFFICIENTS,
    gram_newton_schulz,
    newton_schulz,
    newton_schulz_gain,
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
    "MUON_COEFFICIENTS",
    "NEWTON_SCHULZ_PRESETS",
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
    "gram_newton_schulz",
    "msign",
    "newton_schulz",
    "newton_schulz_gain",
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
