r"""DGram kernels: :math:`\{W \in \mathbb{R}^{m\times n}: \operatorname{Off}(W^\top W) = 0,\ \operatorname{rank} W = n\}`.

Write :math:`W = QD`, :math:`Q` Stiefel, :math:`D = \operatorname{diag}(d)`, :math:`d_j = \|w_j\| > 0`.
Tangent space :math:`\{V: w_i^\top v_j + v_i^\top w_j = 0,\ i \ne j\}`; normal space
:math:`\{WS: S \text{ symmetric, zero diagonal}\}`. See :doc:`/theory/dgram`.
"""

from __future__ import annotations

import torch

from .msign import msign
from .normal_space import normal_multiplier, off_diagonal
from .stiefel import _check_tall_pair

__all__ = [
    "off_diagonal",
    "dgram_normal_multiplier",
    "dgram_project_tangent",
    "dgram_alternating",
    "dgram_colnorm_polar",
    "dgram_metric_projection",
]


def dgram_normal_multiplier(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    r""":math:`S_{ij} = (w_i^\top z_j + z_i^\top w_j)/(d_i^2 + d_j^2)` for :math:`i \ne j`, :math:`S_{ii} = 0`.

    ``WS`` is the normal component of ``Z`` at ``W``: ``(..., n, n)``.
    """
    return normal_multiplier(w, z, off_diagonal)


def dgram_project_tangent(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    r"""Orthogonal projection :math:`P_W(Z) = Z - WS` (assumes :math:`W^\top W` diagonal)."""
    return z - w @ dgram_normal_multiplier(w, z)


def _polar(y: torch.Tensor, method: str) -> torch.Tensor:
    if method == "auto":
        method = "newton" if (torch.is_grad_enabled() and y.requires_grad) else "svd"
    return msign(y, method)


def dgram_alternating(w: torch.Tensor, v: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Alternating retraction (second order): one step of alternating metric projection.

    With :math:`Y = W + V`, :math:`c_j = \|y_j\|`: :math:`Q' = \operatorname{msign}(Y\operatorname{diag}(c))`,
    :math:`d'_j = q_j'^\top y_j` (clamped positive), :math:`R = Q'\operatorname{diag}(d')`.
    """
    _check_tall_pair(w, v, "dgram_alternating")
    y = w + v
    c = y.norm(dim=-2, keepdim=True)  # (..., 1, n)
    q = _polar(y * c, method)
    d = (q * y).sum(-2, keepdim=True)  # (..., 1, n)
    tiny = torch.finfo(d.dtype).tiny
    return q * d.clamp_min(tiny)


def dgram_colnorm_polar(w: torch.Tensor, v: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Column-normalized polar retraction (first order): :math:`\operatorname{msign}(Y D_Y^{-1}) D_Y`."""
    _check_tall_pair(w, v, "dgram_colnorm_polar")
    y = w + v
    c = y.norm(dim=-2, keepdim=True)  # (..., 1, n)
    return _polar(y / c, method) * c


def dgram_metric_projection(y: torch.Tensor, iterations: int = 10, method: str = "svd") -> torch.Tensor:
    r"""Nearest DGram point to ``y`` by alternating minimization of :math:`\|Y - QD\|_F`.

    Starts from :math:`d_j = \|y_j\|` (the first step *is* the alternating retraction of
    :math:`Y`); each step sets :math:`Q = \operatorname{msign}(Y\operatorname{diag}(d))` and then
    :math:`d_j = q_j^\top y_j`. Every iterate lies exactly on DGram; the iteration converges to
    the metric projection. ``y``: ``(..., m, n)`` with :math:`m \ge n`, full column rank.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    # Y diag(d) is graded like the squared spread of the column norms; a float32 SVD resolves its
    # singular values only down to ~1e-7 of the largest and would zero the smaller columns, so the
    # iteration runs in float64 (the projection is not on a hot path)
    out_dtype = y.dtype
    y = y.to(torch.float64) if y.dtype in (torch.float16, torch.bfloat16, torch.float32) else y
    d = y.norm(dim=-2, keepdim=True)  # (..., 1, n)
    tiny = torch.finfo(y.dtype).tiny
    for _ in range(iterations):
        q = msign(y * d, method)
        d = (q * y).sum(-2, keepdim=True).clamp_min(tiny)
    return (q * d).to(out_dtype)
