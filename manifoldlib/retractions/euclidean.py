"""The Euclidean "retraction" ``x + v`` (exact, the exponential map of flat space)."""

from __future__ import annotations

import torch

from .base import Retraction, register_retraction

__all__ = ["AddRetraction"]


@register_retraction("euclidean", "add")
class AddRetraction(Retraction):
    """:math:`R_x(v) = x + v`."""

    order = 2

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``x + v``; ``v`` must have ``x``'s shape (a broadcast would change the point's shape,
        or silently apply one step to many points)."""
        if v.shape != x.shape:
            raise ValueError(f"euclidean retraction: 'v' must have the shape {tuple(x.shape)} of "
                             f"x, got shape {tuple(v.shape)}")
        return x + v
