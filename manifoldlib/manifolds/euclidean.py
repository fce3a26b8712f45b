"""Flat space, for the unconstrained members of a policy (and as a reference in tests)."""

from __future__ import annotations

from typing import Union

import torch

from .._numbers import is_integer
from ..retractions.base import Retraction
from .base import RetractionManifold, _random_normal, _size_tuple

__all__ = ["Euclidean"]


class Euclidean(RetractionManifold):
    """:math:`\\mathbb{R}^{...}` with ``retr(x, v) = x + v``; ``ndim`` trailing dimensions form a point."""

    name = "euclidean"
    default_retraction = "add"
    reversible = True
    #: No constraint: Manifold Muon takes Muon's step (no dual) and applies weight decay.
    flat = True
    decays = True
    muon_retraction = ("add", {})

    def constraint_residual(self, w: torch.Tensor) -> torch.Tensor:
        """Zero: every tensor is a point (checked as the matrix manifolds' dual helpers,
        :meth:`~manifoldlib.manifolds.MatrixConstraintManifold.normal_multiplier`)."""
        self._validate_args(f"{self.name}.constraint_residual", w=w)
        return torch.zeros((), dtype=w.dtype, device=w.device)

    def tangent_residual(self, w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Zero, in the promoted dtype of ``w`` and ``a``: every vector is tangent (checked as
        :meth:`constraint_residual`)."""
        dtype = self._validate_args(f"{self.name}.tangent_residual", w=w, a=a)
        return torch.zeros((), dtype=dtype, device=a.device)

    def __init__(self, ndim: int = 0, retraction: Union[str, Retraction, None] = None, **retraction_options):
        if not (is_integer(ndim) and ndim >= 0):  # (True was taken as 1)
            raise ValueError(f"ndim must be an int >= 0, got {ndim!r}")
        super().__init__(retraction, **retraction_options)
        self.ndim = int(ndim)

    def _init_kwargs(self) -> dict:
        return {"ndim": self.ndim}

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        return True, None

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        return True, None

    def projx(self, x):
        self._validate(x, "x")
        return x

    def proju(self, x, u):
        """``u`` itself, broadcast to the batch of ``x`` (a view, as geoopt's, where ``u`` has the
        promoted dtype of ``x`` and ``u`` already)."""
        dtype = self._validate_args(f"{self.name}.proju", x=x, u=u)
        return u.to(dtype).expand(torch.broadcast_shapes(x.shape, u.shape))

    def component_inner(self, x, u, v=None):
        """The metric entry by entry: ``u * v`` (``u * u`` without ``v``), broadcast to the batch of
        ``x``, in the promoted dtype. Flat space is a product of lines, so geoopt's adaptive
        optimizers keep one second moment per entry: ``RiemannianAdam`` is torch's ``Adam``, as
        with geoopt's ``Euclidean``. (geoopt's default, :meth:`inner` with ``keepdim``, sums over
        the ``ndim`` point dimensions: one second moment per point, another optimizer, no error.)"""
        vectors = {"u": u} if v is None else {"u": u, "v": v}
        dtype = self._validate_args(f"{self.name}.component_inner", x=x, **vectors)
        u = u.to(dtype)
        prod = u * (u if v is None else v.to(dtype))
        return prod.expand(torch.broadcast_shapes(x.shape, prod.shape))

    def expmap(self, x, u):
        """``x + u`` (in the promoted dtype of both, also where one is a 0-dim point)."""
        dtype = self._validate_args(f"{self.name}.expmap", x=x, u=u)
        return x.to(dtype) + u.to(dtype)

    def logmap(self, x, y):
        """``y - x`` (in the promoted dtype of both)."""
        dtype = self._validate_args(f"{self.name}.logmap", x=x, y=y)
        return y.to(dtype) - x.to(dtype)

    def random(self, *size, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
        """Standard normal points of shape ``size``, which has at least :attr:`ndim` dimensions
        (``random()`` is one scalar point for ``ndim=0``)."""
        shape = _size_tuple(size)
        if len(shape) < self.ndim:
            raise ValueError(f"Euclidean(ndim={self.ndim}).random needs a size of at least {self.ndim} "
                             f"dimension(s), the point's; got {shape}")
        z, dtype = _random_normal(shape, generator, dtype, device)
        return z.to(dtype)
