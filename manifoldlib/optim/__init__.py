"""Manifold Muon: steepest descent under the spectral norm on Stiefel, DGram, Oblique or Euclidean space.

Train a model:

- :func:`build_optimizer`: one optimizer for a model, matrices by policy to :class:`ManifoldMuon`,
  the rest to AdamW (:class:`CombinedOptimizer`); :func:`assign_parameters` and
  :func:`describe_assignment` say which matrix went where;
- :class:`ManifoldMuon`: the optimizer, with :class:`DualOptions` (the dual solve) and
  :class:`Distribution` (DDP jobs; FSDP2's ``fully_shard`` parameters are stepped on their
  row shards, :mod:`~manifoldlib.optim.fsdp`); :func:`manifold_muon` its functional core.

Choose manifolds per module: :func:`register_policy`, :func:`get_policy`,
:func:`available_policies`, :class:`RolePolicy`, :func:`default_classifier`,
:func:`is_hidden_matrix`; :func:`weight_layout` reads how a module stores its matrix.

Solve one problem: :func:`steepest_direction` (with :class:`SteepestInfo`), :func:`tangent_residual`.

Log: :func:`optimizer_diagnostics`, :func:`constraint_residual`, :func:`spectral_norm`,
:func:`max_attention_logit`.
"""

from .builder import CombinedOptimizer, assign_parameters, build_optimizer, describe_assignment
from .diagnostics import constraint_residual, max_attention_logit, optimizer_diagnostics, spectral_norm
from .optimizer import MUON_MANIFOLDS, ManifoldMuon, manifold_muon
from .options import LAYOUTS, Distribution, DualOptions, weight_layout
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
    "Distribution",
    "DualOptions",
    "ManifoldMuon",
    "RolePolicy",
    "SteepestInfo",
    "assign_parameters",
    "available_policies",
    "build_optimizer",
    "constraint_residual",
    "default_classifier",
    "describe_assignment",
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
