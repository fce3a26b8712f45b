r"""Dynamic Tanh (Zhu et al., 2025), a normalization-free stand-in for LayerNorm."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["DyT"]


class DyT(nn.Module):
    r""":math:`\mathrm{DyT}(x) = \gamma \odot \tanh(\alpha x) + \beta`.

    :math:`\alpha` is one learnable scalar (initialized to ``alpha_init``), :math:`\gamma`
    (ones) and :math:`\beta` (zeros) are per-channel, like LayerNorm's affine parameters.

    Args:
        dim: feature size :math:`d`.
        alpha_init: initial :math:`\alpha`, finite.

    Shapes: input ``(..., d)``, output ``(..., d)`` in the input's dtype (as LayerNorm's), computed
    in the promoted dtype of the input and the parameters; an integer, boolean or complex input
    raises ``ValueError``.
    """

    def __init__(self, dim: int, alpha_init: float = 0.5):
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
        if not (isinstance(alpha_init, (int, float)) and not isinstance(alpha_init, bool)
                and math.isfinite(alpha_init)):
            raise ValueError(f"alpha_init must be a finite number, got {alpha_init!r}")
        self.dim = dim
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"DyT expects inputs (..., {self.dim}), got shape {tuple(x.shape)}")
        if not x.is_floating_point():  # the output is returned in the input's dtype: an integer
            # input came back as the formula truncated to integers (0 for |gamma tanh| < 1)
            raise ValueError(f"DyT expects a real floating-point input (float16, bfloat16, float32, "
                             f"float64), got dtype {x.dtype}")
        # computed in the promoted dtype of input and parameters (the 0-dim alpha alone would not
        # promote: tanh ran in bfloat16), returned in the input's, as LayerNorm does: float32
        # parameters would otherwise turn a bfloat16 stream into float32
        work = torch.promote_types(x.dtype, self.weight.dtype)
        y = torch.tanh(self.alpha.to(work) * x.to(work)) * self.weight.to(work) + self.bias.to(work)
        return y.to(x.dtype)  # (..., d)

    def extra_repr(self) -> str:
        return f"{self.dim}"
