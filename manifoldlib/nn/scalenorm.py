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
        eps: floor :math:`\varepsilon > 0` of the norm; a zero input maps to zero with zero
            gradient instead of NaN.

    Shapes: input ``(..., d)``, output ``(..., d)`` in the input's dtype (float16 and bfloat16
    inputs are normalized in float32); an integer or complex input raises ``ValueError``. Rows
    whose largest entry is at least 1 are divided by its power of two first (exact), so the norm
    does not overflow for any finite input.
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
        # ||x||^2 overflows for rows whose entries pass sqrt(finfo.max / d) (float32, and
        # bfloat16 computed in it: ~1e19), and the output would be 0 instead of a point on the
        # sphere. A row whose largest entry is >= 1 is divided by the power of two 2^e of that
        # entry (frexp: exact, so the norm's bits and the output's are those of the unscaled
        # formula wherever it did not overflow); the floor moves with it, eps 2^-e. Rows with
        # entries < 1 are untouched (e clamped at 0), so the floor keeps its meaning there.
        # (two plain reductions are cheaper than one over |x|, which materializes |x|)
        xd = xw.detach()
        top = torch.maximum(xd.amax(dim=-1, keepdim=True), -xd.amin(dim=-1, keepdim=True))  # (..., 1)
        inv = torch.ldexp(torch.ones_like(top), -torch.frexp(top).exponent.clamp_min(0))  # (..., 1)
        norm = torch.linalg.vector_norm(xw * inv, dim=-1, keepdim=True)  # ||x|| 2^-e, (..., 1)
        # g 2^-e / max(||x|| 2^-e, eps 2^-e) = g / max(||x||, eps), exactly (powers of two)
        return (xw * (self.scale.to(work) * inv / torch.maximum(norm, self.eps * inv))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
