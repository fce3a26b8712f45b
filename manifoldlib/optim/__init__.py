"""Manifold Muon: steepest descent under the spectral norm on Stiefel / DGram, with policies.

- :func:`steepest_direction`: the dual solvers (:mod:`.steepest`);
- :class:`ManifoldMuon`: the optimizer and its functional core (:mod:`.manifold_muon`);
- :func:`register_policy`, :func:`get_policy`, :func:`available_policies`: which matrix goes
  to which manifold (:mod:`.policies`);
- :func:`build_optimizer`: one combined optimizer for a model (:mod:`.builder`);
- diagnostics for logging (:mod:`.diagnostics`).
"""

from .builder import CombinedOptimizer, assign_parameters, build_optimizer
from .diagnostics import (
    constraint_residual,
    max_attention_logit,
    optimizer_diagnostics,
    spectral_norm,
)
from .manifold_muon import MUON_MANIFOLDS, ManifoldMuon, manifold_muon
from .policies import (
    RolePolicy,
    available_policies,
    default_classifier,
    get_policy,
    is_hidden_matrix,
    register_policy,
)
from .steepest import SteepestInfo, steepest_direction, tangent_residual

__all__ = [
    "MUON_MANIFOLDS",
    "CombinedOptimizer",
    "ManifoldMuon",
    "RolePolicy",
    "SteepestInfo",
    "assign_parameters",
    "available_policies",
    "build_optimizer",
    "constraint_residual",
    "default_classifier",
    "get_policy",
    "is_hidden_matrix",
    "manifold_muon",
    "max_attention_logit",
    "optimizer_diagnostics",
    "register_policy",
    "spectral_norm",
    "steepest_direction",
    "tangent_residual",
]
