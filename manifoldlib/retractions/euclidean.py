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
        self.check_shapes(x, v)
        return x + v

    @staticmethod
    def check_shapes(x: torch.Tensor, v: torch.Tensor) -> None:
        """Raise ``ValueError`` naming both shapes unless ``v`` has the shape of ``x``: this
        retraction's rule, stricter than the manifolds' broadcasting (which
        :meth:`~manifoldlib.Euclidean.retr` therefore checks first)."""
        if v.shape != x.shape:
            raise ValueError(f"euclidean retraction: 'v' must have the shape {tuple(x.shape)} of "
                             f"x, got shape {tuple(v.shape)}")
