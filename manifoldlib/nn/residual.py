r"""SphereResidual: a residual connection that stays on the hidden-state sphere.

.. math::
    h_l = R_{h_{l-1}}\big(\alpha_l\,\lambda_l\,P_{h_{l-1}}(F_l(h_{l-1}))\big)

:math:`R` is any registered sphere retraction (gnomonic = Proj-SpheretNorm, Cayley =
Cay-SpheretNorm, the p-family, the exponential map = GeoNorm, or a user's own
:class:`~manifoldlib.retractions.AngleRetraction`), :math:`P_h` the tangent projection,
:math:`\alpha_l` a learnable scalar and :math:`\lambda_l` a fixed depth damping.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..retractions.base import Retraction, resolve_retraction
from ._fused import sphere_residual, sphere_residual_reference

__all__ = ["DAMPINGS", "SphereResidual", "damping_factor"]

#: Depth-damping schedules :math:`\lambda_l` by name.
DAMPINGS = ("sqrt", "linear", "none")


def damping_factor(damping: str, layer: int) -> float:
    r"""The damping :math:`\lambda_l` of layer ``layer`` (1-based).

    ``"sqrt"``: :math:`1/\sqrt l` (the SpheretNorm default), ``"linear"``: :math:`1/l`,
    ``"none"``: 1.
    """
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 1:
        raise ValueError(f"layer must be an integer >= 1 (1-based depth), got {layer!r}")
    if damping == "sqrt":
        return 1.0 / math.sqrt(layer)
    if damping == "linear":
        return 1.0 / layer
    if damping == "none":
        return 1.0
    raise ValueError(f"unknown damping {damping!r}; valid dampings: {', '.join(DAMPINGS)}")


class SphereResidual(nn.Module):
    r"""Residual update on the sphere: :math:`h \mapsto R_h(\alpha\lambda\,P_h(f))`.

    The radius is **read from** :math:`\|h\|` row by row, so the layer works on whatever sphere
    the network put its hidden states on (in :class:`models.GPT`, the one set by the
    :class:`~manifoldlib.nn.ScaleNorm` after the embedding) and keeps it: every retraction of
    the family preserves the norm exactly in exact arithmetic.

    :math:`\alpha` is one learnable **scalar per layer**, as in the SpheretNorm paper: it scales
    the step length only, so the update stays a rotation in :math:`\operatorname{span}(h, F)` and
    the direction is the sub-layer's own :math:`P_h F`. A per-channel :math:`\alpha` would
    re-weight coordinates *before* the tangent projection (changing the direction, which the
    sub-layer's output projection can already do) and would put ``d`` more parameters in front
    of every optimizer policy.

    Args:
        dim: feature size :math:`d`.
        layer: 1-based depth :math:`l` of this update, used by the damping.
        retraction: sphere retraction name or instance (``"p"``, ``"gnomonic"``, ``"cayley"``,
            ``"exp"``, a user's registered name...).
        p: the ``p`` of the p-family, used only when ``retraction == "p"``; ``p = inf`` is the
            exponential map.
        damping: ``"sqrt"`` (:math:`1/\sqrt l`), ``"linear"`` (:math:`1/l`) or ``"none"``.
        alpha_init: initial :math:`\alpha`.
        fused: use the analytic-backward function (``True``) or the plain-autograd reference
            (``False``; e.g. to let ``torch.compile`` fuse it). On contiguous float32/float64
            CPU tensors (bf16 runs in float32) the fused path does its full-tensor passes in
            small C++ kernels, compiled on first use into torch's extension cache
            (``TORCH_EXTENSIONS_DIR``); ``MANIFOLDLIB_CPU_KERNELS=0`` switches them off, and
            if they cannot be built it warns once and uses ATen, as on every other device.

    Shapes: ``h`` and ``f`` are ``(..., d)``; the output is ``(..., d)`` in ``h``'s dtype.
    """

    def __init__(
        self,
        dim: int,
        layer: int = 1,
        retraction: str | Retraction = "p",
        p: float = 1.0,
        damping: str = "sqrt",
        alpha_init: float = 1.0,
        fused: bool = True,
    ):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
        self.damping = damping
        self.layer = layer
        self.damping_factor = damping_factor(damping, layer)  # validates layer and damping
        if not (isinstance(alpha_init, (int, float)) and math.isfinite(alpha_init)):
            raise ValueError(f"alpha_init must be a finite number, got {alpha_init!r}")
        options = {"p": p} if retraction == "p" else {}
        self.retraction = resolve_retraction("sphere", retraction, **options)
        self.dim = dim
        self.fused = bool(fused)
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))

    def step_size(self) -> torch.Tensor:
        r""":math:`\alpha_l \lambda_l`, a 0-dim tensor."""
        return self.alpha * self.damping_factor

    def forward(self, h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.dim:
            raise ValueError(f"SphereResidual expects h of shape (..., {self.dim}), got {tuple(h.shape)}")
        f = f.to(h.dtype)  # under autocast the sub-layer may return bf16; the stream keeps h's dtype
        scale = self.step_size().to(h.dtype)
        if self.fused:
            return sphere_residual(h, f, scale, self.retraction)
        return sphere_residual_reference(h, f, scale, self.retraction)

    def extra_repr(self) -> str:
        return (f"{self.dim}, layer={self.layer}, retraction={self.retraction!r}, "
                f"damping={self.damping!r}, fused={self.fused}")
