"""Manifold Muon: steepest descent under the spectral norm on Stiefel / DGram, and policies."""

from .steepest import SteepestInfo, steepest_direction, tangent_residual

__all__ = ["SteepestInfo", "steepest_direction", "tangent_residual"]
