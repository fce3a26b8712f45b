r"""The oblique manifold :math:`\mathrm{OB}(m, n) = \{W \in \mathbb{R}^{m\times n}: \operatorname{Diag}(W^\top W) = I\}`."""

from __future__ import annotations

import math
from typing import Union

import torch

from ..functional.gram_rsqrt import normalize_gram_factor
from ..functional.normal_space import diagonal_part, normal_multiplier
from ..functional.oblique import (
    _normalize_columns,
    _oblique_normal_coefficients,
    oblique_constraint_deviation,
    oblique_exp,
    oblique_project_tangent,
)
from ..functional.scaling import _power_of_two_scale
from ..retractions.base import Retraction
from .base import _random_normal, _size_tuple, check_finite_result, check_tensor, max_abs
from .matrix import MatrixConstraintManifold
from .stiefel import check_tall_matrix

__all__ = ["Oblique"]


class Oblique(MatrixConstraintManifold):
    r"""Matrices with unit-norm columns, points ``(..., m, n)``, ``m >= n`` (store a wide one transposed).

    A product of ``n`` unit spheres. Tangent space :math:`\{V: w_j^\top v_j = 0\}`, projection
    :math:`P_W(Z) = Z - W\operatorname{diag}(w_j^\top z_j)`. Retraction ``normalize`` (column
    normalization, second order); :meth:`expmap` rotates each column on its great circle.

    Dual geometry (:class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold`): diagonal
    multipliers (:doc:`/theory/matrix_constraints`: ``Diag`` in place of ``Off``), :math:`F` the
    triangular factor of :math:`W = QF` (the columns need not be orthogonal).
    """

    name = "oblique"
    default_retraction = "normalize"
    projection_retractions = ("normalize",)
    muon_retraction = ("normalize", {})

    def __init__(self, retraction: Union[str, Retraction, None] = None, **retraction_options):
        super().__init__(retraction, **retraction_options)

    def _check_shape(self, shape, name):
        return check_tall_matrix(shape, name, "Oblique")

    @staticmethod
    def multiplier_mask(a):
        return diagonal_part(a)

    def _normal_multiplier(self, w, z):
        return normal_multiplier(w, z, diagonal_part)

    def _normal_component(self, w, z):
        """:math:`W\\operatorname{diag}(w_j^\\top z_j/\\|w_j\\|^2)`, column-scaled (finite wherever it is representable)."""
        ws, s = _oblique_normal_coefficients(w, z)
        return ws * s

    def proju(self, x, u):
        r""":math:`u - x\operatorname{diag}(x_j^\top u_j/\|x_j\|^2)`, column by column (``O(mn)``, no
        ``n x n`` product; scale-safe, :func:`~manifoldlib.functional.oblique_project_tangent`)."""
        dtype = self._validate_args(f"{self.name}.proju", x=x, u=u)
        return oblique_project_tangent(x.to(dtype), u.to(dtype))

    def _constraint_deviation(self, w):
        r""":math:`\|w_j\|^2 - 1`, ``(..., n)``."""
        return oblique_constraint_deviation(w)

    def dual_factor(self, w, check=True):
        q, r = torch.linalg.qr(w)  # W = QR, R upper triangular (..., n, n)
        sign = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(r.dtype)
        r = sign.unsqueeze(-1) * r  # positive diagonal: W = (Q diag(sign)) (diag(sign) R)
        if check and not bool((torch.diagonal(r, dim1=-2, dim2=-1) > 0).all()):
            raise ValueError(
                "W is not usable by the Oblique dual: its columns are linearly dependent (tall "
                "orientation); the reduced dual needs full column rank"
            )
        return r

    def gram_retraction_factor(self, gram, rsqrt):
        return normalize_gram_factor(gram)

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        err = max_abs(self._constraint_deviation(x))
        ok = bool(err <= atol + rtol)
        return ok, None if ok else f"max | ||w_j||^2 - 1 | = {err.item():.3e} exceeds atol={atol}, rtol={rtol}"

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        # column by column, against the column's own norm (one bound for the whole matrix let a
        # fully normal column of norm 1e-2 pass next to columns of norm 1e4); both sides times the
        # power of two g <= 1 that brings a column's largest |u| to at most 1 (exact), in at least
        # float32: ||u_j|| overflowed first (float32 u = 1e20 x, all normal, passed)
        work = torch.promote_types(torch.promote_types(x.dtype, u.dtype), torch.float32)
        x, u = x.to(work), u.to(work)
        g = _power_of_two_scale(u.detach().abs().amax(-2, keepdim=True)).clamp_max(1.0)  # (..., 1, n)
        u = u * g
        g = g.squeeze(-2)  # (..., n)
        excess = (x * u).sum(-2).abs() - rtol * u.norm(dim=-2)  # (..., n), times g
        if bool((excess <= atol * g).all()):  # (NaN fails)
            return True, None
        flat = torch.nan_to_num(excess.double() / g.double(), nan=float("inf")).flatten()
        j = int(flat.argmax()) % x.size(-1)
        return False, (f"|w_j^T u_j| - rtol ||u_j|| = {float(flat.max()):.3e} (column {j}) exceeds "
                       f"atol={atol}, rtol={rtol}")

    def projx(self, x):
        r"""Nearest Oblique point: every column normalized, :math:`w_j/\|w_j\|`
        (scale-safe for every finite nonzero column, as
        :func:`~manifoldlib.functional.oblique_normalize`). A zero column has no nearest point:
        ``ValueError``."""
        self._validate(x, "x")
        check_tensor(x, "x", "oblique.projx", finite=True)
        zero = (x == 0).all(dim=-2)  # (..., n)
        if bool(zero.any()):
            cols = zero.nonzero()[:, -1].unique().tolist()
            raise ValueError(f"oblique needs nonzero columns, got zero columns {cols}: no nearest point exists")
        return _normalize_columns(x)

    def _step_refusal(self, x, u):
        return self._zero_columns_refusal(x, u, "a zero column has no direction to normalize")

    def expmap(self, x, u):
        r"""The geodesic of every column along the tangent part :math:`P_W u` (a normal part of
        ``u`` is dropped, as :meth:`~manifoldlib.manifolds.Stiefel.expmap` and
        :meth:`~manifoldlib.manifolds.Sphere.expmap` drop it).

        :math:`\cos\|v_j\|\,w_j + \operatorname{sinc}\|v_j\|\,v_j` stays on the unit sphere only
        for :math:`w_j^\top v_j = 0`: for a vector with a normal part (a momentum buffer seeded
        with a raw gradient) it would leave the manifold.

        Every step whose angles :math:`\theta_j = \|P_W u_j\|` are finite in the working dtype
        (float32 for 16-bit inputs) is taken, however long: past the overflow of
        :math:`\theta_j^2` the column is rotated from its angle
        (:func:`~manifoldlib.functional.oblique_exp`), as :meth:`Sphere.expmap
        <manifoldlib.Sphere.expmap>` rotates a row. Past :math:`\theta_j \approx 2\pi/\epsilon`
        the point is on the column's great circle but its position there is not determined by
        the input (the float angle is exact only to :math:`\epsilon\,\theta_j`); use :meth:`retr`
        for a step that long.

        ``x`` must be a point of the manifold within the dtype's default tolerances: the formula
        keeps a column's norm, so from a column of norm 3 it returned one of norm 3, with no
        error. The kernel now normalizes the columns of ``x`` first, which repairs rounding
        (chained float32 steps stay at one step's rounding, where they used to drift past this
        check), but from a matrix farther off it steps from another point (``expmap(3x, 0)``
        is ``x``). :meth:`retr` (column normalization) maps any ``x``.

        Raises:
            ValueError: ``x`` off the manifold, a non-finite ``x`` or ``u``, or a column whose angle :math:`\|P_W u_j\|`
                overflows the working dtype, naming the column, the angle and the largest one
                accepted (value checks, see :func:`~manifoldlib.manifolds.skip_value_checks`).
        """
        dtype = self._validate_args(f"{self.name}.expmap", x=x, u=u)
        self._require_point(x, f"{self.name}.expmap", "the exponential map (the geodesic from x)")
        y = oblique_exp(x.to(dtype), self.proju(x, u))
        try:
            return check_finite_result(y, f"{self.name}.expmap", x=x, u=u)
        except ValueError:
            if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(u).all())):
                raise  # check_finite_result named the non-finite input
        raise ValueError(self._angle_overflow(x, u, y.dtype)) from None

    @staticmethod
    def _angle_overflow(x: torch.Tensor, u: torch.Tensor, dtype: torch.dtype) -> str:
        """The message for a finite step whose angle overflows: the first such column, its angle
        (in float64, where a float32 or 16-bit step's angle is finite) and the largest accepted."""
        work = torch.promote_types(dtype, torch.float32)
        v = oblique_project_tangent(x.detach().to(torch.float64), u.detach().to(torch.float64))
        largest = v.abs().amax(dim=-2, keepdim=True)  # (..., 1, n)
        theta = (v / largest.clamp_min(torch.finfo(torch.float64).tiny)).norm(dim=-2) * largest.squeeze(-2)  # (..., n)
        limit = float(torch.finfo(work).max)
        flat = int(torch.nan_to_num(theta, nan=math.inf).flatten().argmax())
        j = flat % x.size(-1)
        return (f"oblique.expmap: column {j}'s step has the angle ||P_W u_j|| = "
                f"{float(theta.flatten()[flat]):.4g}, which overflows {work} (angles up to {limit:.4g} "
                f"are taken; past about 2 pi / eps = {2 * math.pi / torch.finfo(work).eps:.2g} the "
                f"point's position on the column's great circle is not determined by the step anyway): "
                f"shorten the step, or use retr (the 'normalize' retraction takes any finite step)")

    def random(self, *size, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
        """Uniform points (normalized Gaussian columns): ``random(m, n)``."""
        shape = _size_tuple(size)
        self._validate(torch.empty(shape, device="meta"), "size")
        z, dtype = _random_normal(shape, generator, dtype, device)
        return (z / z.norm(dim=-2, keepdim=True)).to(dtype)
