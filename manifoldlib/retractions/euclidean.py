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
        return x + v
