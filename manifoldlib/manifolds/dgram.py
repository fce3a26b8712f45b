r"""DGram :math:`= \{W \in \mathbb{R}^{m\times n}: \operatorname{Off}(W^\top W) = 0,\ \operatorname{rank} W = n\}`."""

from __future__ import annotations

import math

from typing import Union

import torch

from ..functional.dgram import (
    _dgram_metric_projection,
    check_full_column_rank,
    dgram_normal_multiplier,
    off_diagonal,
)
from ..functional.gram_rsqrt import alternating_gram_factor
from ..functional.normal_space import _normal_component
from ..functional.stiefel import stiefel_qr
from ..retractions.base import Retraction
from .base import _random_normal, _size_tuple, check_tensor, max_abs
from .matrix import MatrixConstraintManifold
from .stiefel import check_tall_matrix

__all__ = ["DGram", "column_cosines"]


def column_cosines(w: torch.Tensor) -> torch.Tensor:
    r"""The cosines :math:`C = D^{-1}W^\top W D^{-1}`, :math:`D = \operatorname{diag}(\|w_j\|)`, of
    the columns of ``w`` ``(..., m, n)``: ``(..., n, n)``, in at least float32.

    Each column is divided by its largest entry before its norm is taken, so neither the norm
    nor the products over- or underflow for entries anywhere in the dtype's range. A zero column
    has no direction: its row and column of :math:`C` are NaN."""
    work = w.to(torch.promote_types(w.dtype, torch.float32))
    largest = torch.linalg.vector_norm(work, ord=float("inf"), dim=-2, keepdim=True)  # (..., 1, n)
    u = work / largest  # (..., m, n), largest |entry| 1 per column
    u = u / u.norm(dim=-2, keepdim=True)  # unit columns
    return u.mT @ u


def _ldexp_wide(t: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``t * 2**e`` (``e`` an integer tensor broadcasting against ``t``) in float64, in steps of at
    most 2^1000, so that a result in float64's range is reached even where ``2**e`` is not in it."""
    out = t.to(torch.float64)
    e = e.to(torch.int64)
    while True:
        step = e.clamp(-1000, 1000)
        if not bool((step != 0).any()):
            return out
        out = torch.ldexp(out, step)
        e = e - step


def _ldexp_float(x: float, e: int) -> float:
    """``x * 2**e`` as a Python float, ``inf`` where it overflows."""
    try:
        return math.ldexp(x, e)
    except OverflowError:
        return math.copysign(math.inf, x)


def _columns(mask: torch.Tensor) -> list[int]:
    """The column indices where ``mask`` ``(..., n)`` is set, in any matrix of a batch."""
    return sorted(set(mask.nonzero()[:, -1].tolist()))


def _unusable_columns(w: torch.Tensor, d: torch.Tensor) -> str:
    """Why ``w``'s column norms ``d`` are not all finite and > 0: its non-finite columns, its
    zero columns, or the columns whose norm under- or overflows ``w``'s dtype."""
    finite = torch.isfinite(w).all(dim=-2)  # (..., n)
    if not bool(finite.all()):
        return (f"W is not a DGram point: columns {_columns(~finite)} (tall orientation) hold "
                f"non-finite entries (nan or inf); a DGram point is finite")
    zero = (w == 0).all(dim=-2)
    if bool(zero.any()):
        return (f"W is not a DGram point: columns {_columns(zero)} (tall orientation) are zero; "
                f"DGram points have nonzero orthogonal columns (project W first)")
    under, over = _columns(d == 0), _columns(d == math.inf)
    parts = ([f"columns {under} have norms that underflow to 0"] if under else []) + (
        [f"columns {over} have norms that overflow to inf"] if over else [])
    return (f"W is not usable by the DGram dual in {w.dtype}: {' and '.join(parts)} (tall "
            f"orientation; every entry is finite and each column nonzero); rescale W or use a "
            f"wider dtype")


class DGram(MatrixConstraintManifold):
    r"""Matrices with orthogonal, non-zero columns: :math:`W = QD`, :math:`Q` Stiefel, :math:`D > 0` diagonal.

    Dimension :math:`mn - n(n-1)/2`. Tangent projection :math:`P_W(Z) = Z - WS` with
    :math:`S_{ij} = (w_i^\top z_j + z_i^\top w_j)/(d_i^2 + d_j^2)`, :math:`S_{ii} = 0`.
    Singular values equal the column norms and may grow: the scale freedom studied for
    Manifold Muon. Retractions: ``alternating`` (default, second order), ``colnorm-polar``
    (first order). There is no closed-form geodesic: :meth:`expmap` raises.

    Dual geometry (:class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold`): symmetric
    multipliers with zero diagonal, :math:`F = \operatorname{diag}(d)`; weight decay applies
    (the column norms are free); on square matrices the dual optimum is rank deficient.
    """

    name = "dgram"
    default_retraction = "alternating"
    decays = True
    square_dual = "rank-deficient"
    muon_retraction = ("alternating", {"method": "gram-eigh"})

    def __init__(self, retraction: Union[str, Retraction, None] = None, **retraction_options):
        super().__init__(retraction, **retraction_options)

    def _check_shape(self, shape, name):
        return check_tall_matrix(shape, name, "DGram")

    @staticmethod
    def multiplier_mask(a):
        return off_diagonal(a)

    def _normal_multiplier(self, w, z):
        return dgram_normal_multiplier(w, z)

    def _normal_component(self, w, z):
        """:math:`WS` formed column-scaled (:func:`~manifoldlib.functional.dgram.dgram_project_tangent`):
        finite wherever :math:`WS` is, however much larger than ``w`` ``z`` is."""
        return _normal_component(w, z, off_diagonal)

    def _constraint_deviation(self, w):
        r""":math:`\operatorname{Off}(C)/\|C\|_F` for the column cosines
        :math:`C = D^{-1}W^\top W D^{-1}`, :math:`D = \operatorname{diag}(\|w_j\|)`
        (:func:`column_cosines`), ``(..., n, n)``.

        Invariant under :math:`W \mapsto WD'` for every positive diagonal :math:`D'`, DGram's own
        symmetry: entry :math:`(i, j)` is :math:`\cos\angle(w_i, w_j)/\|C\|_F` whatever the
        two norms, so a small column far from orthogonal to a large one counts in full (in
        :math:`\operatorname{Off}(W^\top W)/\|W^\top W\|_F` it is weighted by
        :math:`\|w_i\|\|w_j\|/\|W^\top W\|_F` and vanishes). Where the columns have equal
        norms the two agree. A zero column has no angle: the deviation is NaN (DGram needs
        nonzero columns). :meth:`constraint_residual` is its Frobenius norm."""
        cos = column_cosines(w)  # (..., n, n)
        return (off_diagonal(cos) / cos.norm(dim=(-2, -1), keepdim=True)).to(w.dtype)

    def dual_factor(self, w, check=True):
        """The column norms ``(..., n)``. With ``check``, ``ValueError`` naming the columns
        (tall orientation) that hold a NaN or inf, that are zero, or whose norm is 0 or inf in
        ``w``'s dtype though every entry is finite (one host read; a failing check costs more)."""
        d = (w * w).sum(dim=-2).sqrt()  # (..., n) column norms (one pass; torch's norm over dim -2 takes several)
        if check and not bool(((d > 0) & (d < math.inf)).all()):  # NaN fails too
            raise ValueError(_unusable_columns(w, d))
        return d

    def gram_retraction_factor(self, gram, rsqrt):
        return alternating_gram_factor(gram, rsqrt)

    def _check_point_on_manifold(self, x, *, atol=1e-5, rtol=1e-5):
        r"""Nonzero columns, and every cosine :math:`|w_i^\top w_j| / (\|w_i\|\|w_j\|)`,
        :math:`i \ne j`, at most ``atol + rtol``.

        The cosines form the off-diagonal of a matrix whose diagonal is 1, so ``rtol`` is
        relative to that unit scale and ``atol`` adds to it, as in Stiefel's check of
        :math:`X^\top X - I`. Each pair of columns is judged at its own scale: the rounding of a
        computed :math:`w_i^\top w_j` is of order :math:`m\,\epsilon\,\|w_i\|\|w_j\|`, so a
        cosine's is of order :math:`m\,\epsilon` whatever the norms."""
        finite = torch.isfinite(x).all(dim=-2)  # (..., n)
        if not bool(finite.all()):
            cols = sorted(set((~finite).nonzero()[:, -1].tolist()))
            return False, (f"columns {cols} of W hold non-finite entries (nan or inf): a DGram "
                           f"point is finite")
        zero = (x == 0).all(dim=-2)  # (..., n)
        if bool(zero.any()):
            cols = sorted(set(zero.nonzero()[:, -1].tolist()))
            return False, f"columns {cols} of W are zero: DGram needs nonzero orthogonal columns"
        cos = off_diagonal(column_cosines(x)).abs()  # (..., n, n)
        err = max_abs(cos)
        if bool(err <= atol + rtol):
            return True, None
        flat = int(torch.nan_to_num(cos, nan=float("inf")).flatten().argmax())
        n = x.size(-1)
        i, j = (flat // n) % n, flat % n
        return False, (
            f"max |w_i^T w_j| / (||w_i|| ||w_j||) = {err.item():.3e} (columns {i}, {j}) "
            f"exceeds atol={atol}, rtol={rtol}"
        )

    def _check_vector_on_tangent(self, x, u, *, atol=1e-5, rtol=1e-5):
        r"""Every :math:`i \ne j`: :math:`|w_i^\top u_j + u_i^\top w_j| \le \|w_i\|\|w_j\|\,(\mathrm{atol}
        + \mathrm{rtol}\,(\|u_i\|/\|w_i\| + \|u_j\|/\|w_j\|))`.

        DGram's symmetry :math:`W \mapsto WD'` (positive diagonal :math:`D'`) carries tangent
        vectors :math:`U \mapsto UD'` and multiplies entry :math:`(i, j)` of
        :math:`\operatorname{Off}(W^\top U + U^\top W)` by :math:`d'_id'_j`; so is every term of the
        bound, so the check is invariant under it: dividing by :math:`\|w_i\|\|w_j\|`, the entry is
        :math:`\operatorname{Off}(D^{-1}(W^\top U + U^\top W)D^{-1})` at :math:`W = QD`, judged against
        ``atol`` and ``rtol`` times the columns' relative sizes :math:`\|u_j\|/\|w_j\|`. The
        rounding of a computed :math:`w_i^\top u_j` is of order
        :math:`m\,\epsilon\,\|w_i\|\|u_j\|`, a term of the bound. (One scale for the whole
        matrix let a small column's clearly normal component pass where a large column
        dominated the norms.) Both are multiplied column by column by the power of two that brings
        ``w``'s largest entry into :math:`[0.5, 1)` (the check's own symmetry, exact), and ``u``
        as a whole by the power of two :math:`g \le 1` that brings its largest scaled entry to at
        most 1 (``atol`` multiplied by :math:`g` with it), so neither the ratios
        :math:`\|u_j\|/\|w_j\|` nor the products and norms over- or underflow (float32 ``W`` ~ 1e-20
        with ``U`` ~ 1 gave :math:`\|u_j\|/\|w_j\| = \infty` and passed a fully normal ``U``);
        products in at least float32."""
        work = torch.promote_types(torch.promote_types(x.dtype, u.dtype), torch.float32)
        w = x.to(work)
        largest = torch.linalg.vector_norm(w, ord=float("inf"), dim=-2, keepdim=True)  # (..., 1, n)
        largest = torch.where(largest > 0, largest, torch.ones_like(largest))
        e_w = torch.frexp(largest)[1]  # (..., 1, n): 2^(e_w - 1) <= largest < 2^e_w
        w = torch.ldexp(w, -e_w)  # W D'^{-1}, D' = diag(2^e_w): largest entry per column in [0.5, 1)
        top_u = torch.linalg.vector_norm(u.to(work), ord=float("inf"), dim=-2, keepdim=True)  # (..., 1, n)
        e_u = torch.frexp(top_u)[1]
        ratio = torch.where(top_u > 0, e_u - e_w, torch.zeros_like(e_u))  # |u_j| / 2^e_w <= 2^ratio
        e_g = ratio.amax(dim=-1, keepdim=True).clamp_min(0)  # (..., 1, 1): g = 2^-e_g
        v = _ldexp_wide(u, -(e_w + e_g)).to(work)  # U D'^{-1} g, |entries| <= 1
        g = torch.ldexp(torch.ones_like(e_g, dtype=torch.float64), -e_g).to(work)  # (..., 1, 1), may be 0
        wn, un = w.norm(dim=-2), v.norm(dim=-2)  # (..., n)
        s = w.mT @ v  # (..., n, n): g w_i^T u_j / (d'_i d'_j)
        err = off_diagonal(s + s.mT).abs()
        scale = wn.unsqueeze(-1) * wn.unsqueeze(-2)  # ||w_i|| ||w_j||
        bound = (atol * g) * scale + rtol * (wn.unsqueeze(-1) * un.unsqueeze(-2) + un.unsqueeze(-1) * wn.unsqueeze(-2))
        ok = bool((err <= bound).all())
        if ok:
            return True, None
        excess = torch.nan_to_num((err - bound) / torch.where(scale > 0, scale, 1.0), nan=float("inf"))
        flat = int(excess.flatten().argmax())
        n = x.size(-1)
        i, j = (flat // n) % n, flat % n
        sc = float(scale.reshape(-1)[flat]) or 1.0
        e = int(e_g.reshape(-1)[flat // (n * n)])  # undo g in the message
        rel, bd = (_ldexp_float(float(t.reshape(-1)[flat]) / sc, e) for t in (err, bound))
        return False, (
            f"|w_i^T u_j + u_i^T w_j| / (||w_i|| ||w_j||) = {rel:.3e} (columns {i}, {j}) exceeds "
            f"atol + rtol (||u_i||/||w_i|| + ||u_j||/||w_j||) = {bd:.3e} (atol={atol}, rtol={rtol})"
        )

    def projx(self, x):
        """Nearest DGram point, searched to stationarity
        (:func:`~manifoldlib.functional.dgram.dgram_metric_projection`).

        ``x`` must have full column rank: DGram points have nonzero, mutually orthogonal
        columns, and for a rank-deficient ``x`` (a zero column, two parallel ones) no nearest
        point exists — ever smaller columns come ever closer; full column rank is enough for one
        to exist (:doc:`/theory/dgram`). A rank-deficient ``x``, and one whose nearest point has a
        column norm float64 does not determine (column norms spread over many orders), raise
        ``ValueError``. DGram is a cone (:math:`\\operatorname{projx}(sX) = s\\operatorname{projx}(X)`):
        the rank check and the search run on ``x`` scaled by a power of two (exact) that keeps
        the squares of its entries inside float64, so entries anywhere in the dtype's range
        are projected.
        """
        self._validate(x, "x")
        check_tensor(x, "x", "dgram.projx", finite=True)
        check_full_column_rank(x, self.name)
        return _dgram_metric_projection(x)

    def _step_refusal(self, x, u):
        return self._zero_columns_refusal(x, u, f"the {self._retraction.name!r} retraction has no "
                                                f"DGram point for them (DGram's columns are nonzero)")

    def expmap(self, x, u):
        raise NotImplementedError(
            "DGram has no closed-form exponential map; use retr (retraction "
            f"{self._retraction.name!r}) or a geoopt optimizer, which only needs retr"
        )

    def random(self, *size, generator: torch.Generator | None = None, dtype=None, device=None) -> torch.Tensor:
        """Haar-random orthonormal columns scaled by column norms drawn log-uniform in [1/2, 2]."""
        shape = _size_tuple(size)
        self._validate(torch.empty(shape, device="meta"), "size")
        z, dtype = _random_normal(shape, generator, dtype, device)
        q = stiefel_qr(torch.zeros_like(z), z)
        u = torch.rand(shape[:-2] + (1, shape[-1]), generator=generator, dtype=z.dtype, device=z.device)
        d = torch.exp((2.0 * u - 1.0) * torch.log(torch.tensor(2.0, dtype=z.dtype)))
        return (q * d).to(dtype)
