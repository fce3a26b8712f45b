r"""How a matrix parameter is stored, and the orientation Manifold Muon constrains it in.

A manifold of :mod:`manifoldlib.manifolds` constrains the linear map's own matrix
:math:`W \in \mathbb{R}^{\text{out} \times \text{in}}` (:math:`y = W x`) in its tall orientation:
a tall Stiefel point has orthonormal columns, :math:`W^\top W = I`; a wide one orthonormal rows.
``torch.nn.Linear`` stores exactly :math:`W` (layout ``"out_in"``); Hugging Face's ``Conv1D``
(GPT-2) stores :math:`W^\top` and computes :math:`x W^\top` (layout ``"in_out"``).

For a rectangular matrix the layout makes no difference (the tall orientation of :math:`W` and of
:math:`W^\top` is the same matrix), nor for square Stiefel (:math:`W^\top W = I \iff W W^\top = I`).
For a *square* DGram or Oblique matrix it does: :math:`\operatorname{Off}(W^\top W) = 0` makes the
map's input directions orthogonal, :math:`\operatorname{Off}(W W^\top) = 0` its output rows. A
group's ``layout`` option tells :class:`~manifoldlib.optim.ManifoldMuon` which one it holds, so a
GPT-2 ``Conv1D`` and the equivalent ``nn.Linear`` get the same constraint on the same map (and the
same ``adjust_lr_fn`` shape factor, which reads :math:`W`'s rows and columns).
:func:`~manifoldlib.optim.build_optimizer` sets it from each parameter's module
(:func:`weight_layout`).
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..charts.blocks import SplitBlocks, output_dim

__all__ = ["LAYOUTS", "check_layout", "flipped", "map_shape", "tall", "weight_layout"]

#: Storage layouts of a matrix parameter: the map's ``(out, in)`` (``torch.nn.Linear``, the
#: default) or its transpose ``(in, out)`` (Hugging Face ``Conv1D``).
LAYOUTS = ("out_in", "in_out")


def check_layout(layout) -> str:
    """``layout``, or ``ValueError`` naming it and the accepted values."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} (torch.nn.Linear's (out, in) or a "
                         f"Hugging Face Conv1D's (in, out)), got {layout!r}")
    return layout


def flipped(shape, layout: str = "out_in") -> bool:
    """Whether the stored matrix of ``shape`` is transposed to give the map's tall orientation."""
    rows, cols = shape[-2], shape[-1]
    return rows < cols or (rows == cols and layout == "in_out")


def tall(t: Tensor, layout: str = "out_in") -> Tensor:
    """``t`` as its manifold constrains it: the map's matrix in its tall orientation
    (``(..., m, n)``, ``m >= n``); a view, and :func:`flipped` says whether it is transposed."""
    return t.mT if flipped(t.shape, layout) else t


def map_shape(shape, layout: str = "out_in") -> tuple[int, int]:
    """``(out, in)`` of the map a stored matrix of ``shape`` holds."""
    rows, cols = shape[-2], shape[-1]
    return (cols, rows) if layout == "in_out" else (rows, cols)


def weight_layout(module: nn.Module) -> str:
    """The layout of the matrices ``module`` owns: ``"in_out"`` for a Hugging Face ``Conv1D`` and
    for the blocks :func:`~manifoldlib.charts.split_blocks` cut from one (split along dim 1, the
    output dimension of an ``(in, out)`` weight), ``"out_in"`` for everything else."""
    if output_dim(module) == 1:
        return "in_out"
    if isinstance(module, parametrize.ParametrizationList) and any(
        isinstance(p, SplitBlocks) and p.dim == 1 for p in module
    ):
        return "in_out"
    return "out_in"
