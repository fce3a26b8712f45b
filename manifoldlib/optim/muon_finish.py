r"""The end of one matrix's Manifold Muon step: from a solved dual to its state and new value.

Shared by the per-matrix solve (:func:`~manifoldlib.optim.muon_step.manifold_muon`) and the
batched one (:mod:`~manifoldlib.optim.batched_step`), so that both write the same state and take
the same retraction: ``state["dual_correction"]`` :math:`= \Lambda - \Lambda_0` (the next step's
warm start), ``state["dual_iterations"]`` and ``state["dual_residual"]``; then
:math:`W \leftarrow R_{\beta W}(-\eta A)` in the fused Gram form
(:mod:`~manifoldlib.optim.fused_retraction`) where it applies, else with the manifold's
retraction of the formed direction.
"""

from __future__ import annotations

import math

from torch import Tensor

from .dual_options import DualOptions
from .dual_solution import DualSolution
from .fused_retraction import fused_retraction
from .layouts import flipped, map_shape, tall

__all__: list[str] = []


def adjusted_lr(lr: float, adjust_lr_fn: str | None, flat: bool, shape, layout: str = "out_in") -> float:
    """The learning rate after the shape adjustment ``adjust_lr_fn`` (``None``: ``"original"`` on
    Euclidean groups, ``"spectral"``, no adjustment, otherwise), from the map's ``(out, in)``
    (:func:`~manifoldlib.optim.layouts.map_shape` of the stored ``shape``)."""
    rows, cols = map_shape(shape, layout)
    fn = adjust_lr_fn if adjust_lr_fn is not None else ("original" if flat else "spectral")
    if fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def dual_msign(dual: DualOptions, ns_steps: int, ns_coefficients) -> tuple[str, int | None, tuple | None]:
    """``(msign_method, ns_steps, ns_coefficients)`` of the dual solve: ``"ns"`` is the group's own
    Newton–Schulz (Jordan's quintic schedule with the group's coefficients and step count)."""
    own_ns = dual.msign_method == "ns"
    method = "jordan5" if own_ns else dual.msign_method
    steps = ns_steps if dual.msign_method in ("ns", "jordan5") else None
    return method, steps, tuple(ns_coefficients) if own_ns else None


def apply_solution(
    param: Tensor,
    solution: DualSolution,
    state: dict,
    *,
    lr: float,
    weight_decay: float,
    adjusted: float,
    manifold,
    fuse_retraction: bool,
    layout: str = "out_in",
) -> Tensor:
    """Write the solve's state entries and return the new value of ``param`` (its own orientation;
    ``solution`` was solved on :func:`~manifoldlib.optim.layouts.tall` of it in ``layout``).

    ``param`` is read, never written. Call under
    :func:`~manifoldlib.optim.matmul_precision.ieee_float32_matmul`.
    """
    info = solution.info
    state["dual_correction"] = info.correction
    state["dual_iterations"] = int(info.iterations)
    state["dual_residual"] = float(info.residual)
    w = tall(param, layout)
    decay = 1 - lr * weight_decay if (manifold.decays and weight_decay) else 1.0
    new = None
    if fuse_retraction and solution.problem is not None:  # the retraction from n x n pieces (tall matrices)
        new = fused_retraction(solution.problem, solution.state, adjusted, decay)
    if new is None:
        base = w.mul(decay) if decay != 1.0 else w
        new = manifold.retr(base, solution.direction().to(w.dtype).mul(-adjusted))  # tall orientation
    new = new.to(w.dtype)
    return new.mT if flipped(param.shape, layout) else new
