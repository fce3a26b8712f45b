r"""An unclipped gradient that would overflow Adam's second moment: stop, do not freeze.

Adam and AdamW keep :math:`v \leftarrow \beta_2 v + (1-\beta_2)\,g^2` per entry in the
parameter's dtype. Under a sustained gradient :math:`v` tends to :math:`g^2`, so a *finite* entry
:math:`|g| > \sqrt{\text{max}}` (about :math:`1.8\times 10^{19}` in float32 and bfloat16, 256 in
float16) makes :math:`v` ``inf`` within about :math:`1/(1-\beta_2)` steps, and past
:math:`\sqrt{\text{max}/(1-\beta_2)}` at once. The update :math:`\hat m / (\sqrt{\hat v} + \epsilon)`
is then 0, and :math:`\beta_2 \cdot \infty` keeps it 0 at every later step: the entry stops
learning, silently, for the rest of the run. With clipping on (``grad_clip > 0``) the clipped
gradient is small and this cannot happen; without it, :func:`check_second_moments` finds an entry
past :math:`\sqrt{\text{max}}` before the step and the trainer stops the run as diverged, naming
the parameter, with every finished checkpoint kept. (The limit is the conservative one: a single
such step may not overflow yet, but a gradient of that size is a run far past divergence.)

Only the groups of Adam-family optimizers (groups with ``"betas"``) are checked: Manifold Muon
normalizes its update and takes such gradients. The check costs one comparison of the global
norm, which bounds every entry, and a pass over the gradients only when that norm is past the
smallest limit. Under FSDP2 a gradient's largest entry is taken over every rank's shard, so
all ranks stop together.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SecondMomentOverflow", "check_second_moments", "square_limit"]


def square_limit(dtype: torch.dtype) -> float:
    r"""The largest :math:`|g|` whose square ``dtype`` holds, :math:`\sqrt{\text{finfo.max}}`."""
    return math.sqrt(torch.finfo(dtype).max)


class SecondMomentOverflow(ArithmeticError):
    """A gradient entry whose square overflows an Adam second moment (the message names it);
    raised before the step, with the step's ``loss`` and ``grad_norm``."""

    def __init__(self, message: str, loss: float, grad_norm: float):
        super().__init__(message)
        self.loss, self.grad_norm = loss, grad_norm


def check_second_moments(optimizer: torch.optim.Optimizer, grad_norm: float, loss: float) -> None:
    """Raise :class:`SecondMomentOverflow` when a gradient of an Adam-family group has an entry
    past :func:`square_limit` of its parameter's dtype.

    Args:
        optimizer: the optimizer about to step (a plain one or ``build_optimizer``'s combined one,
            whose groups carry ``"param_names"``).
        grad_norm: the global norm of the gradients (an upper bound of every entry).
        loss: the step's loss, carried by the exception.
    """
    groups = [g for g in optimizer.param_groups if "betas" in g]
    params = [p for g in groups for p in g["params"] if p.grad is not None]
    if not params or not grad_norm > min(square_limit(p.dtype) for p in params):
        return
    for group in groups:
        names = group.get("param_names") or [None] * len(group["params"])
        for name, p in zip(names, group["params"]):
            if p.grad is None:
                continue
            top = p.grad.detach().abs().amax()
            if hasattr(top, "full_tensor"):  # an FSDP2 shard's largest entry: the largest of all
                top = top.full_tensor()  # ranks' (a collective; every rank is in this loop)
            top = float(top)
            limit = square_limit(p.dtype)
            if top > limit:
                label = f"parameter {name!r}" if name is not None else f"a parameter of shape {tuple(p.shape)}"
                raise SecondMomentOverflow(
                    f"{label} has a gradient entry of {top:.3g} (global norm {grad_norm:.3g}) with "
                    f"grad_clip 0: its square overflows AdamW's {str(p.dtype).removeprefix('torch.')} "
                    f"second moment (past {limit:.3g}) and the entry would stop learning (set "
                    f"--grad_clip)", loss, grad_norm)
