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
        """``x + v``, ``x`` and ``v`` broadcast to one batch as every manifold's ``retr`` broadcasts
        them (geoopt's ``x + u``); shapes that do not broadcast are refused, naming both."""
        try:
            torch.broadcast_shapes(x.shape, v.shape)
        except RuntimeError:
            raise ValueError(f"euclidean retraction: x of shape {tuple(x.shape)} and v of shape "
                             f"{tuple(v.shape)} are not one batch (they do not broadcast)") from None
        return x + v
