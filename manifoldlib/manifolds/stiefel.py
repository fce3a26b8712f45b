r"""The Stiefel manifold :math:`\mathrm{St}(m, n) = \{X: X^\top X = I_n\}`, :math:`m \ge n`, Euclidean metric."""

from __future__ import annotations

from typing import Union

import torch

from ..functional.stiefel import stiefel_exp, stiefel_project_tangent, stiefel_qr
from ..retractions.base import Retraction
from .base import RetractionManifold, _random_normal, _size_tuple, check_tensor

__all__ = ["Stiefel", "check_tall_matrix"]


def check_tall_matrix(shape, name: str, manifold: str):
    """Shared shape check of the matrix manifolds: ``(..., m, n)`` with ``m >= n >= 1``."""
    if len(shape) < 2:
        return False, f"'{name}' on {manifold} needs a matrix (..., m, n) with m >= n, got shape {tuple(shape)}"
    m, n = shape[-2], shape[-1]
    if n < 1 or m < n:
        return False, (
            f"'{name}' on {manifold} needs (..., m, n) with m >= n >= 1, got m={m}, n={n}"
            " (store a wide matrix transposed)"
        )
    return True, None


class Stiefel(RetractionManifold):
    r"""Stiefel manifold, points ``(..., m, n)`` with :math:`X^\top X = I`.

    Tangent space :math:`\{V: X^\top V + V^\top X = 0\}`, projection
    :math:`P_X(Z) = Z - X\operatorname{sym}(X^\top Z)`. Retractions: ``polar`` (default, second
    order), ``qr`` and ``cayley`` (first order), ``exp`` (the geodesic).
    """

    name = "stiefel"
    ndim = 2
    default_retraction = "polar"

    def __init__(self, retraction: Union[str, Retraction, None] = None, **retraction_options):
        super().__init__(retraction, **retraction_options)

    def _check_shape(self, shape, name):
        return check_tall_matrix(shape, name, "Stiefel")

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        eye = torch.eye(x.size(-1), dtype=x.dtype, device=x.device)
        err = (x.mT @ x - eye).abs().amax()
        ok = bool(err <= atol + rtol)
        return ok, None if ok else f"max |X^T X - I| = {err.item():.3e} exceeds atol={atol}, rtol={rtol}"

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        s = x.mT @ u
        err = (s + s.mT).abs().amax()
        ok = bool(err <= atol + rtol * u.abs().amax())
        return ok, None if ok else f"max |X^T U + U^T X| = {err.item():.3e} exceeds atol={atol}, rtol={rtol}"

    def inner(self, x, u, v=None, *, keepdim=False):
        v = u if v is None else v
        return (u * v).sum(dim=(-2, -1), keepdim=keepdim)

    def projx(self, x):
        r"""Nearest Stiefel point: :math:`UV^\top` from the thin SVD :math:`X = U\Sigma V^\top`.

        For full column rank this is the polar factor :math:`\operatorname{msign}(X)`. For a
        rank-deficient ``X`` the nearest point is not unique and :math:`\operatorname{msign}`
        (which maps zero singular values to 0) is *not* on the manifold; :math:`UV^\top` still
        is — the SVD's orthonormal completion of the range fills the missing directions.
        Computed in float64 and returned in ``x``'s dtype.
        """
        self._validate(x, "x")
        check_tensor(x, "x", "stiefel.projx", finite=True)
        # float64 SVD (a projection is rare: an initialization, a repair); cast back at the end
        u, _, vh = torch.linalg.svd(x.to(torch.float64), full_matrices=False)  # (..., m, n), (..., n, n)
        return (u @ vh).to(x.dtype)

    def proju(self, x, u):
        self._validate_pair(x, u)
        return stiefel_project_tangent(x, u)

    def expmap(self, x, u):
        self._validate_pair(x, u)
        return stiefel_exp(x, u)

    def random(self, *size, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
        """Haar-distributed points (sign-fixed QR of a Gaussian matrix): ``random(m, n)``."""
        shape = _size_tuple(size)
        self._validate(torch.empty(shape, device="meta"), "size")
        z, dtype = _random_normal(shape, generator, dtype, device)
        return stiefel_qr(torch.zeros_like(z), z).to(dtype)

