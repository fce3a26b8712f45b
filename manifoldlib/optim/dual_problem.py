r"""The reduced dual of one steepest-direction problem, and the tangent residual it drives to zero.

:class:`_DualProblem` holds the ``n × n`` data of a tall instance (:math:`B = Q^\top G`,
:math:`C = G_\perp^\top G_\perp`, the column norms :math:`D` and the normal-space metric) and
evaluates the dual at a multiplier: the Gram matrix :math:`S = C + M^\top M`, one
eigendecomposition, the spectral factor, the dual gradient :math:`H` and the relative tangent
residual. :class:`_State` keeps what one evaluation computed, so the solvers
(:mod:`manifoldlib.optim.dual_solvers`) and the answer reuse it. The same class holds a stack of
same-shape instances, every quantity with a leading batch dimension, for the batched solve
(:mod:`manifoldlib.optim.batched_dual`); the Barzilai–Borwein step rule and the best-iterate
book-keeping both loops share are here too.

Two ways to the spectral factor of a plain (unsmoothed) evaluation (the execution policy's
``spectral``, :mod:`~manifoldlib.optim.execution`): ``"eigh"``, one
``n × n`` eigendecomposition (cheap on a CPU, and the eigenbasis the Anderson step and the
smoothed Newton solve need), or ``"products"``, the Newton–Schulz preset in Gram form
(:func:`~manifoldlib.optim.spectral_factors.gram_msign_factor`: about twenty ``n × n`` products,
no factorization; on a GPU an eigh of 768² costs as much as eight Muon steps, the products a
ninth of that). A smoothed evaluation always takes the eigh.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from ..functional.msign import msign
from ..functional.normal_space import normal_metric
from ..functional.scaling import into_safe_range
from .dual_manifolds import dual_manifold
from .execution import ExecutionPolicy
from .spectral_factors import _rsqrt_divided_differences, _spectral_gain, gram_msign_factor

__all__ = ["tangent_residual"]

_DIMS = (-2, -1)


def _add_product(base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``base + alpha · left @ right`` as one product: ``addmm`` for one instance, ``baddbmm`` for a stack."""
    if base.dim() == 2:
        return torch.addmm(base, left, right, alpha=alpha)
    return torch.baddbmm(base, left, right, alpha=alpha)


def _scaled_with_norm(g: torch.Tensor, flat: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g · 2^k, ‖g · 2^k‖_F)``: ``g`` brought into range by an exact power of two
    (:func:`~manifoldlib.functional.scaling.into_safe_range`), so that the normalized
    ``g / ‖g‖_F`` the dual solves with is bit for bit that of ``g`` wherever no square over- or
    underflowed. Without it a float32 gradient with entries above about 1e18 had an infinite norm
    (a zero direction: no step) and one below about 1e-20 a zero norm (no dual solve). ``flat``:
    large gradients only, so the Euclidean Newton–Schulz keeps its ``eps`` floor for tiny ones
    (as Muon's).
    """
    g = into_safe_range(g, up=not flat)
    return g, g.norm()


def tangent_residual(w: torch.Tensor, a: torch.Tensor, manifold) -> torch.Tensor:
    r"""Relative normal component :math:`\|A - P_W A\|_F / \|A\|_F` of ``a`` at ``w`` (tall, ``(m, n)``).

    ``manifold``: a name or a manifold object; the formula is the manifold's
    (:meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.tangent_residual`: Stiefel
    :math:`\|W\operatorname{sym}(W^\top A)\|_F`, DGram and Oblique :math:`\|WS\|_F` with
    :math:`S = \mathcal{P}(W^\top A + A^\top W)/(d_i^2 + d_j^2)`; Euclidean 0).
    """
    return dual_manifold(manifold).tangent_residual(w, a)


@dataclass
class _State:
    """One evaluation of the dual: the multiplier and what rebuilds ``A`` (and its Hessian)."""

    lam: torch.Tensor
    factor: torch.Tensor | None  # R (n, n) on the reduced path (built on demand), A (m, n) on the SVD path
    m: torch.Tensor | None = None
    eig: torch.Tensor | None = None
    vec: torch.Tensor | None = None
    gain: torch.Tensor | None = None
    value: float | None = None  # smoothed dual objective sum sqrt(lambda + mu^2)
    mv: torch.Tensor | None = None
    rotated: torch.Tensor | None = None  # V^T (H / metric) V, when the evaluation formed it
    hessian: tuple | None = None  # (V, M V, Phi) for Hessian-vector products, built on first use
    k: torch.Tensor | None = None  # K = Q^T A = M R (n, n), when the evaluation formed it

    def spectral_factor(self) -> torch.Tensor:
        r""":math:`R = V\operatorname{diag}(\psi)V^\top` ``(n, n)`` (reduced path), built once."""
        if self.factor is None:
            self.factor = (self.vec * self.gain) @ self.vec.mT
        return self.factor


class _DualProblem:
    r"""The reduced dual of one tall instance ``(m, n)``, or of a stack of same-shape instances
    ``(B, m, n)``: every iteration is ``n × n`` work only.

    Setup: :math:`W^\top G` and :math:`G^\top G` (two ``m·n²`` products); the answer
    :math:`A = (G + 2W\Lambda)R` costs two more. With :math:`W = QF` (the manifold's
    :meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.dual_factor`: :math:`F = I` on
    Stiefel, :math:`D` on DGram, triangular on Oblique) the Gram matrix of
    :math:`X = G + 2W\Lambda` is :math:`S = C + M^\top M` with :math:`M = B + 2F\Lambda`,
    :math:`B = Q^\top G` and :math:`C = G^\top G - B^\top B` (zero for square ``W``); the dual
    gradient is :math:`H = \mathcal{P}(F^\top K + K^\top F)`, :math:`K = Q^\top A`, with the
    manifold's mask :math:`\mathcal{P}`.

    A stack carries its batch dimension through every ``n × n`` quantity. It is evaluated on the
    products path by :meth:`evaluate_products` (the batched solve,
    :mod:`~manifoldlib.optim.batched_dual`), and :meth:`select` narrows it or takes one instance's
    problem, the same setup without repeating it. The other methods take one instance.
    """

    #: Attributes that carry the batch dimension of a stack (``b`` and ``c`` once reduced).
    _STACKED = ("w", "g", "f", "d", "metric", "two_d", "normal_scale", "wg", "b", "c")

    def __init__(self, w, g, manifold, method, steps, coefficients, eps, smoothing=None,
                 policy: ExecutionPolicy | None = None):
        manifold = dual_manifold(manifold)  # a MatrixConstraintManifold (or its name)
        self.manifold = manifold  # the constraint's geometry
        self.method = method
        self.policy = ExecutionPolicy() if policy is None else policy  # dtypes and spectral path
        self.spectral = self.policy.spectral  # plain evaluations; smoothed ones take the eigh
        self.steps, self.coefficients, self.eps = steps, coefficients, eps
        self.smoothing = smoothing  # absolute mu of the smoothed nuclear norm, or None
        n = w.size(-1)
        # W = Q F: None (F = I), (..., n) diagonal or (..., n, n) triangular
        self.f = manifold.dual_factor(w)
        self.unit = self.f is None  # D = I, metric 1, no mask: skip the scalings
        self.full = self.f is not None and self.f.dim() == w.dim()
        if self.unit:
            self.d = w.new_ones(w.shape[:-2] + (n,))
        else:
            self.d = self.f.norm(dim=-2) if self.full else self.f  # (..., n) column norms of W
        self.w, self.g = w, g
        self.square = w.size(-2) == n
        self.metric = normal_metric(self.d * self.d)  # (..., n, n), (d_i^2 + d_j^2)/2
        self.two_d = 2.0 * self.d.unsqueeze(-1)  # (..., n, 1)
        self.normal_scale = self.d.unsqueeze(-1) / (2.0 * self.metric)  # (..., n, n): H -> D S
        self.mask = manifold.multiplier_mask
        self.evaluations = 0  # what the solve cost, read into SteepestInfo
        self.hessian_products = 0
        self.relaxations: list[float] = []  # over-relaxation of each preconditioned step
        self.wg = w.mT @ g  # (..., n, n) = W^T G = F^T B
        self.b = self.c = None
        self.reduced = False
        if method != "svd" or smoothing is not None:
            self.enable_reduced()

    def select(self, index: int | torch.Tensor) -> _DualProblem:
        """The problem of some instances of a stack: an ``int`` gives that instance's own
        (unbatched) problem, a 1-D index tensor a narrower stack. The setup is shared, not
        recomputed; the cost counters start afresh."""
        part = copy.copy(self)
        for name in self._STACKED:
            value = getattr(self, name)
            if value is not None:
                setattr(part, name, value[index])
        part.evaluations = part.hessian_products = 0
        part.relaxations = []
        return part

    def times_factor(self, x: torch.Tensor) -> torch.Tensor:
        """``(n, n)`` :math:`Fx`."""
        if self.unit:
            return x
        return self.f @ x if self.full else self.d.unsqueeze(-1) * x

    def factor_transposed_times(self, x: torch.Tensor) -> torch.Tensor:
        r"""``(n, n)`` :math:`F^\top x` (:math:`W^\top A` from :math:`K = Q^\top A`)."""
        if self.unit:
            return x
        return self.f.mT @ x if self.full else self.d.unsqueeze(-1) * x

    def enable_reduced(self) -> None:
        r"""Switch to the reduced (``n × n``) evaluations: form :math:`B = Q^\top G` and
        :math:`C = G_\perp^\top G_\perp` (one more ``m·n²`` product). An exact-SVD solve that
        stalls continues this way with the smoothed dual."""
        if self.reduced:
            return
        self.reduced = True
        if self.full:  # (..., n, n) = Q^T G = F^{-T} W^T G
            self.b = torch.linalg.solve_triangular(self.f.mT, self.wg, upper=False)
        else:
            self.b = self.wg / self.d.unsqueeze(-1)
        if self.square:
            self.c = torch.zeros_like(self.b)  # square: G lies in span(Q)
        else:
            gram = self.g.mT @ self.g  # (..., n, n)
            self.c = gram - self.b.mT @ self.b  # G_perp^T G_perp
            self.c = 0.5 * (self.c + self.c.mT)

    def initial_multiplier(self) -> torch.Tensor:
        # G + 2 W Lambda_0 = P_T(G): Lambda_0 = -(W^T G + G^T W) / (2 (d_i^2 + d_j^2))
        return -self.mask(self.wg + self.wg.mT) / (4.0 * self.metric)

    def gram(self, lam: torch.Tensor) -> torch.Tensor:
        r"""``(..., n, n)`` Gram matrix :math:`S` of :math:`X = G + 2W\Lambda` (reduced path only)."""
        m = self._m(lam)
        return m.mT @ m if self.square else _add_product(self.c, m.mT, m)

    def _m(self, lam: torch.Tensor) -> torch.Tensor:
        """``(..., n, n)`` :math:`M = B + 2F\\Lambda`."""
        if self.full:
            return _add_product(self.b, self.f, lam, alpha=2.0)
        return torch.add(self.b, lam, alpha=2.0) if self.unit else torch.addcmul(self.b, self.two_d, lam)

    def evaluate(self, lam: torch.Tensor, *, rotated: bool = False):
        r"""``(H, residual, state)`` at the multiplier ``lam`` of one instance; ``state`` rebuilds ``A``.

        ``rotated=True`` (reduced Stiefel path only) skips ``H`` (returned as ``None``) and leaves
        :math:`V^\top H V = N\Psi + \Psi N^\top`, :math:`N = V^\top M V`, in ``state.rotated``:
        what the eigenbasis-preconditioned step needs, two ``n × n`` products cheaper.
        """
        self.evaluations += 1
        if not self.reduced:
            x = self.g + 2.0 * (self.w @ lam)  # (m, n)
            if not bool(torch.isfinite(x.sum())):  # a diverged step: no SVD of non-finite input
                nan = torch.full_like(lam, float("nan"))
                return nan, float("nan"), _State(lam, torch.full_like(x, float("nan")))
            a = msign(x, "svd")
            a_sq = (a * a).sum()
            return self._gradient(None, a_sq, _State(lam, a), wa=self.w.mT @ a)
        nan = torch.full_like(lam, float("nan"))
        if self.smoothing is None and self.spectral == "products":  # one host read: the residual
            h, residual, r, m, k = self._products(lam)
            residual = float(residual)
            if math.isnan(residual):  # a diverged step
                return nan, residual, _State(lam, nan, value=residual)
            return h, residual, _State(lam, r, m, k=k)
        m = self._m(lam)  # (n, n)
        s = m.mT @ m if self.square else _add_product(self.c, m.mT, m)  # (n, n) Gram matrix of X
        if not bool(torch.isfinite(s.sum())):  # a diverged step: no eigh of non-finite input
            return nan, float("nan"), _State(lam, nan, value=float("nan"))
        eig, vec, gain = _spectral_gain(s, self.method, self.steps, self.coefficients, self.eps, self.smoothing)
        a_sq = (eig * gain * gain).sum()  # ||A||_F^2
        value = float((eig + self.smoothing**2).sqrt().sum()) if self.smoothing is not None else None
        state = _State(lam, None, m, eig, vec, gain, value)
        state.mv = m @ vec  # (n, n) = M V
        if rotated and self.unit:
            nt = vec.mT @ state.mv  # (n, n) = V^T M V
            state.rotated = nt * gain + (nt * gain).mT  # V^T H V (metric 1 on Stiefel)
            tiny = torch.finfo(a_sq.dtype).tiny
            residual = float(0.5 * state.rotated.norm() / a_sq.clamp_min(tiny).sqrt())
            return None, residual, state
        k = (state.mv * gain) @ vec.mT  # (n, n) = M R = Q^T A
        return self._gradient(k, a_sq, state)

    def evaluate_products(self, lam: torch.Tensor):
        r"""``(H, residual, R, M, K)`` at the multipliers ``lam`` ``(..., n, n)`` on the products
        path, every instance of a stack at once and without a host synchronization: ``residual``
        ``(...)`` is a tensor, NaN for an instance whose Gram matrix is not finite (a diverged step)."""
        self.evaluations += 1
        return self._products(lam)

    def _products(self, lam: torch.Tensor):
        r""":meth:`evaluate_products` uncounted: the Gram matrix :math:`S` of :math:`X`, the
        Gram-form Newton–Schulz factor :math:`R` (each instance normalized by its own
        :math:`\|X\|_F`), :math:`K = MR` and :math:`\|A\|_F^2 = \operatorname{tr}(R^\top SR)`."""
        m = self._m(lam)
        s = m.mT @ m if self.square else _add_product(self.c, m.mT, m)  # (..., n, n) Gram matrix of X
        r = gram_msign_factor(s, self.method, self.steps, coefficients=self.coefficients, eps=self.eps)
        a_sq = ((s @ r) * r).sum(_DIMS)  # ||X R||_F^2
        k = m @ r  # (..., n, n) = M R = Q^T A
        h, residual = self._dual_gradient(self.factor_transposed_times(k), a_sq)
        finite = torch.isfinite(s.sum(_DIMS))
        return h, torch.where(finite, residual, torch.full_like(residual, float("nan"))), r, m, k

    def _dual_gradient(self, dk: torch.Tensor, a_sq: torch.Tensor):
        r"""``(H, residual)`` from :math:`W^\top A` and :math:`\|A\|_F^2`: the dual gradient
        :math:`H = \mathcal{P}(W^\top A + A^\top W)` and the relative tangent residual (a tensor).

        The normal part of :math:`A` is :math:`WS` with :math:`S = H/(d_i^2 + d_j^2)`, and
        :math:`\|WS\|_F = \|FS\|_F`.
        """
        h = self.mask(dk + dk.mT)
        if self.full:
            normal = (self.f @ (h / (2.0 * self.metric))).norm(dim=_DIMS)
        else:
            normal = 0.5 * h.norm(dim=_DIMS) if self.unit else (h * self.normal_scale).norm(dim=_DIMS)
        return h, normal / a_sq.clamp_min(torch.finfo(a_sq.dtype).tiny).sqrt()

    def _gradient(self, k, a_sq: torch.Tensor, state: _State, wa: torch.Tensor | None = None):
        r"""``(H, residual, state)`` from :math:`K = Q^\top A` (or ``wa`` :math:`= W^\top A`) and :math:`\|A\|_F^2`."""
        state.k = k
        h, residual = self._dual_gradient(self.factor_transposed_times(k) if wa is None else wa, a_sq)
        return h, float(residual), state

    def relative_gap(self, state: _State) -> float:
        r"""Certified relative duality gap :math:`(\|X\|_* - \langle G, A\rangle)/\|X\|_*` of a
        reduced eigen evaluation (``nan`` without its eigenvalues).

        Any multiplier gives the upper bound :math:`\|X(\Lambda)\|_* = \sum_i\sqrt{\lambda_i}` on the
        optimum, and :math:`\langle G, A\rangle = \langle X, A\rangle - 2\langle\Lambda, W^\top A\rangle
        = \sum_i \lambda_i\psi_i - 2\langle\Lambda, DK\rangle` is the value of the answer, so the
        gap bounds how far :math:`\langle G, A\rangle` is below the optimum (up to the tangent
        residual of ``A``). ``n × n`` work only.
        """
        if state.eig is None or state.k is None:
            return float("nan")
        nuclear = state.eig.sqrt().sum()
        dk = self.factor_transposed_times(state.k)  # W^T A
        value = (state.eig * state.gain).sum() - 2.0 * (state.lam * dk).sum()
        return float((nuclear - value) / nuclear.clamp_min(torch.finfo(nuclear.dtype).tiny))

    def direction(self, state: _State) -> torch.Tensor:
        if not self.reduced:
            return state.factor  # the (m, n) direction itself
        x = torch.addmm(self.g, self.w, state.lam, alpha=2.0)  # (m, n) = G + 2 W Lambda
        return x @ state.spectral_factor()  # msign(X) = X R, (m, n)

    def hessian_vector(self, state: _State, delta: torch.Tensor) -> torch.Tensor:
        r"""Second derivative of the smoothed dual along the symmetric ``delta`` (reduced path).

        :math:`E = 2F\Delta`, :math:`dS = E^\top M + M^\top E`,
        :math:`dR = V[(V^\top dS V)\circ\Phi]V^\top` with :math:`\Phi_{ij}` the divided difference of
        :math:`\psi(\lambda) = (\lambda + \mu^2)^{-1/2}`, :math:`-1/(a_i a_j (a_i + a_j))`,
        :math:`a = \psi^{-1}`; then :math:`dK = ER + M\,dR` and the answer is
        :math:`\mathcal{P}(F^\top dK + dK^\top F)`. Four ``n × n`` products, in bfloat16 for a float32
        solve where the policy says so (:mod:`~manifoldlib.optim.execution`: they only steer
        conjugate gradients; the Newton iterates are evaluated in float32).
        """
        self.hessian_products += 1
        if state.hessian is None:
            low = self.policy.search_dtype_for(state.vec)  # bfloat16 where native: a CG search direction
            phi = _rsqrt_divided_differences(state.gain.reciprocal())  # at a_i^2, a_i = sqrt(lambda_i + mu^2)
            state.hessian = (state.vec.to(low), state.mv.to(low), phi)
        vec, mv, phi = state.hessian
        ev = (2.0 * self.times_factor(delta)).to(vec.dtype) @ vec  # (n, n) = E V
        t = (ev.mT @ mv).to(delta.dtype)  # (n, n)
        dr = ((t + t.mT) * phi).to(vec.dtype)  # V^T dR V
        dk = ((ev.to(delta.dtype) * state.gain).to(vec.dtype) + mv @ dr) @ vec.mT  # (n, n) = dK
        ddk = self.factor_transposed_times(dk.to(delta.dtype))
        return self.mask(ddk + ddk.mT)


def _barzilai_borwein(step: torch.Tensor, s_vec: torch.Tensor, y_vec: torch.Tensor, long: bool) -> torch.Tensor:
    r"""The next Barzilai–Borwein step size of each instance, from the multiplier change ``s_vec``
    and the preconditioned-gradient change ``y_vec`` ``(..., n, n)``: the long rule
    :math:`\langle s, s\rangle/\langle s, y\rangle` or the short rule
    :math:`\langle s, y\rangle/\langle y, y\rangle`, kept only where :math:`\langle s, y\rangle > 0`
    (elsewhere the previous ``step``, a tensor of the batch shape ``(...)``)."""
    sy = (s_vec * y_vec).sum(_DIMS)
    if long:
        proposed = (s_vec * s_vec).sum(_DIMS) / sy
    else:
        proposed = sy / (y_vec * y_vec).sum(_DIMS).clamp_min(torch.finfo(sy.dtype).tiny)
    return torch.where(sy > 0, proposed, step)


class _BestIterate:
    """Book-keeping shared by the dual iterations: the best iterate so far (a NaN one is always
    replaced) and the stall count behind ``patience`` (iterations in a row without a 10% cut of
    the best-so-far residual mark)."""

    def __init__(self, residual: float, lam: torch.Tensor, state: _State) -> None:
        self.best = (residual, lam, state)
        self.mark = residual
        self.since_progress = 0

    def record(self, residual: float, lam: torch.Tensor, state: _State) -> None:
        if residual < self.best[0] or self.best[0] != self.best[0]:
            self.best = (residual, lam, state)
        if residual < 0.9 * self.mark:
            self.mark, self.since_progress = residual, 0
        else:
            self.since_progress += 1

    def stalled(self, patience: int | None) -> bool:
        return patience is not None and self.since_progress >= patience
