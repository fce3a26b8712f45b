r"""ScaleNorm (Nguyen & Salazar, 2019): project onto a sphere whose radius is one learnable scalar."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["ScaleNorm"]

#: The floor of a float16 input's RMS :math:`\|x\|/\sqrt d`: float32's :math:`\sqrt{\epsilon}`
#: (:math:`3.45\cdot10^{-4}`), the one ``torch.nn.functional.rms_norm`` has for float16 (computed in
#: float32 with float32's epsilon on the mean square).
_FLOAT16_RMS_FLOOR = math.sqrt(torch.finfo(torch.float32).eps)


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
            :math:`x` (the map is :math:`g x/\varepsilon` below the floor). For float16 inputs
            the floor is :math:`\max(\varepsilon, \sqrt{d\,\epsilon_{32}})`, :math:`\epsilon_{32}`
            float32's machine epsilon: :math:`g/\varepsilon` (:math:`2.8\cdot10^{7}` at
            :math:`d = 768`, :math:`\varepsilon = 10^{-6}`) is beyond float16's range (65504),
            where a zero row's gradient was inf; with that floor it is
            :math:`(g/\sqrt d)/\sqrt{\epsilon_{32}} = 2896` at :math:`g = \sqrt d`, what
            ``torch.nn.functional.rms_norm`` gives float16 (it computes in float32 with float32's
            epsilon on the mean square). Only float16 rows of RMS entry below
            :math:`\sqrt{\epsilon_{32}} = 3.45\cdot10^{-4}` change (they are scaled by
            :math:`g` over the floor, not put on the sphere); the other dtypes have room for
            :math:`g/\varepsilon` and keep :math:`\varepsilon`.

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
        floor = self.eps
        if x.dtype == torch.float16:  # the gradient g / floor of a zero row must fit float16
            floor = max(floor, math.sqrt(self.dim) * _FLOAT16_RMS_FLOOR)
        norm = torch.linalg.vector_norm(xw, dim=-1, keepdim=True).clamp_min(floor)  # (..., 1)
        norm = torch.where(torch.isinf(norm), torch.nan, norm)  # an overflowing row: NaN, not 0
        return (xw * (self.scale.to(work) / norm)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
