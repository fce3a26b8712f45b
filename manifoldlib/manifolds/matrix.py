r"""What a matrix constraint gives the steepest-direction dual: :class:`MatrixConstraintManifold`.

Stiefel, DGram and Oblique are :math:`\{W \in \mathbb{R}^{m\times n}: \mathcal{P}(W^\top W) =
\mathcal{P}(I)\}` (DGram: :math:`\operatorname{Off}(W^\top W) = 0`) for a projector
:math:`\mathcal{P}` onto symmetric ``n × n`` matrices (:doc:`/theory/matrix_constraints`).
Everything the dual of :func:`~manifoldlib.optim.steepest_direction` needs of one of them
follows from

* :meth:`~MatrixConstraintManifold.multiplier_mask`: :math:`\mathcal{P}` (identity, ``Off``,
  ``Diag``; :mod:`~manifoldlib.functional.normal_space`), the space of multipliers
  :math:`\Lambda`;
* :meth:`~MatrixConstraintManifold.dual_factor`: a factor :math:`F` with :math:`W = QF`,
  :math:`Q^\top Q = I` — ``None`` for :math:`F = I` (Stiefel), the column norms ``d`` for
  :math:`F = \operatorname{diag}(d)` (DGram), or an upper-triangular ``(n, n)`` matrix (Oblique);
  the reduced dual works with :math:`Q^\top G` and :math:`F`;
* :meth:`~MatrixConstraintManifold.normal_multiplier` and the normal-space metric
  :math:`(d_i^2 + d_j^2)/2` (:func:`~manifoldlib.functional.normal_space.normal_metric`), which
  give the initial multiplier :math:`\Lambda_0 = -\mathcal{P}(W^\top G + G^\top W)/(4\cdot\text{metric})`
  and the tangent residual;
* :meth:`~MatrixConstraintManifold.gram_retraction_factor`: the default Muon retraction as an
  ``n × n`` factor of :math:`Y^\top Y`.

A new matrix manifold of this family is one subclass: the optimizer has no branch on names. It
implements the kernels ``_normal_multiplier`` and ``_constraint_deviation`` (and, where ``WS``
must be formed scale-safe, ``_normal_component``); the public methods of those names check
their arguments and call them.
"""

from __future__ import annotations

import torch

from ..functional.scaling import _power_of_two_scale
from .base import RetractionManifold

__all__ = ["MatrixConstraintManifold"]


class MatrixConstraintManifold(RetractionManifold):
    r"""Base of the tall matrix manifolds :math:`\mathcal{P}(W^\top W) = \mathcal{P}(I)` (points ``(..., m, n)``, ``m >= n``).

    Attributes:
        muon_retraction: ``(name, options)`` of the retraction :class:`~manifoldlib.optim.ManifoldMuon`
            uses by default; :meth:`gram_retraction_factor` is its Gram form.
        decays: decoupled weight decay applies (the manifold has a scale freedom: DGram).
        square_dual: what the plain dual does on square matrices: ``"closed-form"`` (Stiefel:
            :math:`\Lambda_0` is optimal), ``"rank-deficient"`` (DGram: the optimum is rank
            deficient, smooth from the start) or ``None``.
        orthonormal_dual: the dual's factor :math:`F` of :math:`W = QF` is the identity and so are the
            multiplier mask and the normal-space metric (Stiefel): the optimizer's sync-free
            products-path solve takes :func:`~manifoldlib.optim.dual_solvers.stiefel_solve`. A
            subclass that changes :meth:`dual_factor` or :meth:`multiplier_mask` sets it ``False``.
    """

    ndim = 2
    flat = False
    decays = False
    square_dual: str | None = None
    orthonormal_dual = False
    muon_retraction: tuple[str, dict] = ("", {})

    @staticmethod
    def multiplier_mask(a: torch.Tensor) -> torch.Tensor:
        r""":math:`\mathcal{P}(A)`: the projector onto the multipliers, ``(..., n, n)``."""
        raise NotImplementedError

    def normal_multiplier(self, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        r"""``(..., n, n)`` ``S`` with ``WS`` the normal component of ``z`` at ``w``, both ``(..., m, n)``,
        in their promoted dtype (Stiefel :math:`\operatorname{sym}(W^\top Z)`; DGram and Oblique
        :math:`\mathcal{P}(W^\top Z + Z^\top W)` over :math:`d_i^2 + d_j^2`, formed scale-safe).

        The dual helpers (this, :meth:`normal_component`, :meth:`tangent_residual`,
        :meth:`constraint_deviation`, :meth:`constraint_residual`) check their arguments as every
        method of several tensors does (:meth:`_validate_args`): dtypes promote, and a tensor
        that is not real floating point, a ``w`` that is not a tall matrix, a second argument
        of another matrix shape, or batches that do not broadcast raise ``ValueError`` naming
        the method and the argument. A subclass implements the ``_``-prefixed kernels, which take
        checked arguments of one dtype (:meth:`proju` calls them after its own check).
        """
        dtype = self._validate_args(f"{self.name}.normal_multiplier", w=w, z=z)
        return self._normal_multiplier(w.to(dtype), z.to(dtype))

    def _normal_multiplier(self, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """:meth:`normal_multiplier` of checked arguments of one dtype."""
        raise NotImplementedError

    def dual_factor(self, w: torch.Tensor, check: bool = True) -> torch.Tensor | None:
        r""":math:`F` with :math:`W = QF` of a tall ``(..., m, n)`` point (``None``: :math:`F = I`;
        ``(..., n)``: diagonal; ``(..., n, n)``: upper triangular), one per matrix of a leading batch.
        With ``check``, raises ``ValueError`` for a point the dual cannot use (any matrix of a
        batch; a host read); without it nothing is read back (a sync-free optimizer step)."""
        raise NotImplementedError

    def constraint_deviation(self, w: torch.Tensor) -> torch.Tensor:
        r"""The constraint's violation at ``w`` ``(..., m, n)``, zero exactly on the manifold:
        Stiefel :math:`W^\top W - I` ``(..., n, n)``; DGram the off-diagonal of the column cosines
        over their Frobenius norm ``(..., n, n)``, invariant under column scaling, NaN for a zero
        column; Oblique :math:`\|w_j\|^2 - 1` ``(..., n)``. Checked as :meth:`normal_multiplier`."""
        self._validate_args(f"{self.name}.constraint_deviation", w=w)
        return self._constraint_deviation(w)

    def _constraint_deviation(self, w: torch.Tensor) -> torch.Tensor:
        """:meth:`constraint_deviation` of a checked ``w``."""
        raise NotImplementedError

    def constraint_residual(self, w: torch.Tensor) -> torch.Tensor:
        r"""Scalar distance of ``w`` (``(m, n)``, tall) from the manifold: :math:`\|\text{deviation}\|_F`
        (over the whole batch for a batch). Checked as :meth:`normal_multiplier`."""
        self._validate_args(f"{self.name}.constraint_residual", w=w)
        return self._constraint_deviation(w).norm()

    def normal_component(self, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        r"""``(..., m, n)`` :math:`WS`, :math:`S` = :meth:`normal_multiplier`: the normal component
        of ``z`` at ``w``, in their promoted dtype. DGram and Oblique, whose ``S`` can leave the
        dtype's range where :math:`WS` does not (``S`` scales like :math:`|z|/|w|`), form it
        without ``S`` at scale. Checked as :meth:`normal_multiplier`."""
        dtype = self._validate_args(f"{self.name}.normal_component", w=w, z=z)
        return self._normal_component(w.to(dtype), z.to(dtype))

    def _normal_component(self, w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """:meth:`normal_component` of checked arguments of one dtype."""
        return w @ self._normal_multiplier(w, z)

    def tangent_residual(self, w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        r"""Relative normal component :math:`\|A - P_W A\|_F / \|A\|_F` of ``a`` at ``w`` (tall
        ``(m, n)``; over the broadcast batch for batches), in their promoted dtype. Checked as
        :meth:`normal_multiplier`."""
        dtype = self._validate_args(f"{self.name}.tangent_residual", w=w, a=a)
        w, a = w.to(dtype), a.to(dtype)
        normal = self._normal_component(w, a)  # (..., m, n), the broadcast batch
        a = a.expand_as(normal)  # a broadcast a counts once per point it is taken at
        if a.numel():  # both divided by the power of two of max |a|: the squares neither over- nor underflow
            scale = _power_of_two_scale(a.detach().abs().amax())
            normal, a = normal * scale, a * scale
        return normal.norm() / a.norm().clamp_min(torch.finfo(a.dtype).tiny)

    def proju(self, x, u):
        r""":math:`P_X(u) = u - XS`, :math:`XS` the normal component (:meth:`normal_component`), in the
        dtype of ``x`` and ``u`` promoted."""
        dtype = self._validate_args(f"{self.name}.proju", x=x, u=u)
        x, u = x.to(dtype), u.to(dtype)
        return u - self._normal_component(x, u)

    def _zero_columns_refusal(self, x: torch.Tensor, u: torch.Tensor, why: str) -> str | None:
        """For a retraction that projects ``x + u``: the zero columns of ``x + u`` (tall
        orientation, in any matrix of a batch) and ``why`` the projection has no point for them;
        ``None`` without any."""
        y = x + u  # (..., m, n), promoted
        zero = (y == 0).all(dim=-2)  # (..., n)
        if not bool(zero.any()):
            return None
        cols = sorted(set(zero.nonzero()[:, -1].tolist()))
        return (f"columns {cols} of x + u (tall orientation) are zero, a step u_j = -x_j: {why}; "
                f"shorten the step")

    def gram_retraction_factor(self, gram: torch.Tensor, rsqrt) -> torch.Tensor | None:
        r""":math:`\Phi` with :math:`R(Y) = Y\Phi` for the :attr:`muon_retraction`, from :math:`T = Y^\top Y`;
        ``rsqrt`` maps a symmetric ``T`` to :math:`T^{-1/2}` or ``None`` (then ``None``)."""
        return None
