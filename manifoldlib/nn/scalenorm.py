r"""ScaleNorm (Nguyen & Salazar, 2019): project onto a sphere whose radius is one learnable scalar."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["ScaleNorm"]


class ScaleNorm(nn.Module):
    r""":math:`\mathrm{ScaleNorm}(x) = g\,x / \max(\|x\|, \varepsilon)` over the last dimension.

    One scalar :math:`g`, initialized to :math:`\sqrt{d}`, so the output lies on the sphere of
    radius :math:`\sqrt d` (RMS 1 per coordinate) at initialization. Used on the embedding of a
    sphere network it *sets* the radius of the hidden-state sphere; every
    :class:`~manifoldlib.nn.SphereResidual` after it reads the radius back from :math:`\|h\|`.

    Args:
        dim: feature size :math:`d` (the last dimension of the input).
        eps: floor :math:`\varepsilon > 0` of the norm; a zero input maps to zero instead of
            NaN, with gradient 0 in :math:`g` and the formula's :math:`g/\varepsilon` in
            :math:`x` (the map is :math:`g x/\varepsilon` below the floor; at :math:`d = 768`,
            :math:`\varepsilon = 10^{-6}` that is :math:`2.8\cdot10^{7}`, beyond float16's
            range: a float16 zero row gets an inf gradient, a bfloat16 one a finite one).

    Shapes: input ``(..., d)``, output ``(..., d)`` in the input's dtype (float16 and bfloat16
    inputs are normalized in float32); an integer or complex input raises ``ValueError``. A row
    whose :math:`\|x\|` overflows the working dtype (float32: entries of about
    :math:`10^{19}/\sqrt d`, float64: :math:`10^{154}/\sqrt d`) comes out NaN, not the zero row
    that :math:`x\,g/\infty` would give: loud, for one op on the ``(..., 1)`` norms (rescaling
    every row to avoid the overflow would cost passes over ``x`` for every input).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool)
                and math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
        self.dim = dim
        self.eps = float(eps)
        self.scale = nn.Parameter(torch.tensor(math.sqrt(dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"ScaleNorm expects inputs (..., {self.dim}), got shape {tuple(x.shape)}")
        if not x.is_floating_point():  # an integer input would come back rounded to integers
            raise ValueError(f"ScaleNorm expects a real floating-point input (float16, bfloat16, float32, "
                             f"float64), got dtype {x.dtype}")
        # float16/bfloat16 inputs are normalized in float32: in float16 the norm of a large
        # input overflows (to a zero output) and g / eps of a zero one does (0 * inf = NaN)
        work = torch.promote_types(x.dtype, torch.float32)
        xw = x.to(work)
        norm = torch.linalg.vector_norm(xw, dim=-1, keepdim=True).clamp_min(self.eps)  # (..., 1)
        norm = torch.where(torch.isinf(norm), torch.nan, norm)  # an overflowing row: NaN, not 0
        return (xw * (self.scale.to(work) / norm)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
