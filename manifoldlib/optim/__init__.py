"""Manifold Muon: steepest descent under the spectral norm on Stiefel / DGram / Oblique, with policies.

- :func:`steepest_direction`: the dual solvers (:mod:`.steepest`);
- :class:`ExecutionPolicy`: the device-dependent choices of a step (:mod:`.execution`);
- :class:`ManifoldMuon`: the optimizer (:mod:`.manifold_muon`), its dual-solver options
  :class:`DualOptions` (:mod:`.dual_options`) and its functional core :func:`manifold_muon`
  (:mod:`.muon_step`);
- :func:`register_policy`, :func:`get_policy`, :func:`available_policies`: which matrix goes
  to which manifold (:mod:`.policies`);
- :func:`build_optimizer`: one combined optimizer for a model (:mod:`.builder`), each matrix
  constrained as the map it stores (:func:`weight_layout`, :mod:`.layouts`);
- diagnostics for logging (:mod:`.diagnostics`).
"""

from .builder import CombinedOptimizer, assign_parameters, build_optimizer
from .diagnostics import (
    constraint_residual,
    max_attention_logit,
    optimizer_diagnostics,
    spectral_norm,
)
from .dual_options import DualOptions
from .execution import ExecutionPolicy
from .layouts import LAYOUTS, weight_layout
from .manifold_muon import ManifoldMuon, manifold_muon
from .muon_groups import MUON_MANIFOLDS
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
    "LAYOUTS",
    "MUON_MANIFOLDS",
    "CombinedOptimizer",
    "DualOptions",
    "ExecutionPolicy",
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
    "weight_layout",
]
