r"""The steepest-direction dual of a bank of same-shape matrices: the problem and its solvers.

For a gradient :math:`G` at a point :math:`W` of a matrix manifold the *steepest direction* under
the spectral norm is

.. math::

    A^\star = \operatorname*{arg\,max}_{A}\ \langle G, A\rangle
    \quad\text{s.t.}\quad \|A\|_2 \le 1,\ A \in T_W\mathcal{M}.

The normal space is :math:`\{W\Lambda\}` with :math:`\Lambda = \mathcal{P}(\Lambda)` symmetric,
:math:`\mathcal{P}` the manifold's :meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.multiplier_mask`
(identity on Stiefel, ``Off`` on DGram, ``Diag`` on Oblique), and the Lagrangian dual is

.. math::

    \max_A \langle G, A\rangle = \min_{\Lambda} \|G + 2W\Lambda\|_*,
    \qquad A(\Lambda) = \operatorname{msign}(G + 2W\Lambda),

whose gradient is the normal residual :math:`H = \mathcal{P}(W^\top A + A^\top W)`; at the
optimum :math:`A(\Lambda^\star)` is tangent, of spectral norm one, and optimal.

**The reduced problem.** Write :math:`W = QF` (:math:`F = I` on Stiefel, :math:`\operatorname{diag}(d)`
on DGram, triangular on Oblique), :math:`B = Q^\top G` and :math:`G_\perp = G - QB`, formed
explicitly (:math:`C = G_\perp^\top G_\perp` by difference, :math:`G^\top G - B^\top B`, loses
every digit for a gradient nearly normal to the tangent space). With :math:`M = B + 2F\Lambda`,
:math:`X = G + 2W\Lambda = G_\perp + QM` has the Gram matrix :math:`S = C + M^\top M`, and every
spectral map of :math:`X` is :math:`XR` with :math:`R` a function of :math:`S`: for a
Newton–Schulz map :math:`R` comes from :func:`~manifoldlib.functional.newton_schulz.gram_newton_schulz`
(``"products"``) or from :math:`S = V\operatorname{diag}(\lambda)V^\top` and the scalar gain
:math:`\psi(\lambda)` (``"eigh"``). So an iteration is ``n × n`` work only, and
:math:`K = Q^\top A = MR`, :math:`W^\top A = F^\top K`; the ``m``-sized work is the setup and the
answer :math:`A = G_\perp R + QK`.

**Banks.** Every quantity carries a leading batch dimension: ``B`` same-shape matrices are one
problem, one batched product where ``B`` separate solves would run ``B``.

**Solvers.** :func:`bb_solve`: Barzilai–Borwein steps on the metric-preconditioned gradient
(:math:`2/(d_i^2 + d_j^2)`, so DGram columns of different norms converge together), alternating
the long and short rules, with per-matrix step sizes, convergence masks, stall counts and best
iterates, all on the device; it runs a fixed number of iterations (``sync_free``) or stops once
every matrix has converged. :func:`anderson_solve` (eigh path): frozen-gain Newton steps in the
eigenbasis the evaluation computed, with Anderson mixing. :func:`smoothed_solve` (one matrix,
eigh path): Newton–CG on the smoothed dual :math:`\operatorname{tr}(X^\top X + \mu^2 I)^{1/2}`,
whose optimum is tangent with :math:`\|A\|_2 < 1` and loses at most :math:`n\mu` of the
objective — for square DGram, whose plain dual optimum is rank deficient, and for plain solves
that stall.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass, fields, replace

import torch

from ..functional.msign import msign
from ..functional.newton_schulz import gram_newton_schulz, newton_schulz_gain
from ..functional.normal_space import normal_metric
from .execution import Execution

__all__ = ["DualProblem", "Evaluation", "Progress", "Spectral", "anderson_solve", "bb_solve", "smoothed_solve",
           "with_smoothing"]

_DIMS = (-2, -1)
#: Past steps Anderson mixing combines.
ANDERSON_MEMORY = 2
#: Over-relaxation of the frozen-gain Newton step until a matrix's residual first grows.
PRECONDITIONED_RELAXATION = 1.2
#: CG iterations per Newton step of the smoothed dual.
NEWTON_CG_ITER = 40
#: Backtracking steps of the smoothed dual's line search.
LINE_SEARCH_STEPS = 20
#: Rounding noise of the smoothed dual value, in units of ``eps · |value|``: below it the Armijo
#: test cannot see a predicted decrease, and a trial is accepted when it lowers the residual.
VALUE_NOISE_ULPS = 16
#: Continuation start of a cold smoothed solve (relative :math:`\kappa`).
SMOOTHING_START = 1e-1
#: Smallest relative smoothing the gap-driven continuation goes down to.
SMOOTHING_FLOOR = 2e-5
#: The Newton–Schulz preset of a smoothed evaluation on the products path: :math:`S + \mu^2I` has a
#: condition number of at most about :math:`1/\kappa^2`, which Polar Express resolves in its steps.
SMOOTHED_PRESET = "polar-express"
#: A unit gradient whose part outside the span of :math:`W` has :math:`\|G_\perp\|_F^2` below this
#: gets :math:`G_\perp` formed explicitly (``explicit=None``).
NEARLY_NORMAL = 0.1
#: Estimated constraint residual of the point, in units of its dtype's machine epsilon, above which
#: the exact :math:`W^\top W` is computed (``exact_gram=None``): float32 7.6e-6.
GRAM_DRIFT_EPS = 64.0


@functools.lru_cache(maxsize=32)
def _probe(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fixed ``(n,)`` vector of ±1 (the same on every process, so replicated steps agree)."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(n))
    return (2 * signs - 1).to(dtype=dtype, device=device)


@dataclass(frozen=True)
class Spectral:
    """How an evaluation maps the Gram matrix :math:`S` to the factor :math:`R`.

    Attributes:
        method: a Newton–Schulz preset (``"jordan5"``, ``"polar-express"``, ``"newton-schulz"``)
            or ``"svd"`` (exact; unreduced, or the exact gain :math:`\\lambda^{-1/2}` when smoothed).
        steps: Newton–Schulz steps (``None``: the preset's).
        coefficients: a custom ``(a, b, c)`` or schedule (``None``: the preset's).
        eps: floor of the Newton–Schulz normalization.
        path: ``"eigh"`` or ``"products"``.
    """

    method: str = "jordan5"
    steps: int | None = None
    coefficients: tuple | None = None
    eps: float = 1e-7
    path: str = "eigh"


@dataclass
class Evaluation:
    """One evaluation of every matrix of a bank at the multipliers ``lam`` ``(B, n, n)``.

    ``residual`` ``(B,)`` is the reduced problem's relative tangent residual (NaN where the
    evaluation diverged); ``r`` the spectral factor (or ``vec`` and ``gain`` that give it),
    ``k`` :math:`= Q^\\top A` (:meth:`product`), ``m`` :math:`= B + 2F\\Lambda`, ``mv``
    :math:`= MV`; ``a`` the ``m × n`` answer of the unreduced (exact SVD) path; ``value`` the
    smoothed dual's value; ``rotated`` :math:`V^\\top HV` where an evaluation left it instead of
    :math:`H`.
    """

    lam: torch.Tensor
    h: torch.Tensor
    residual: torch.Tensor
    k: torch.Tensor | None = None
    m: torch.Tensor | None = None
    r: torch.Tensor | None = None
    eig: torch.Tensor | None = None
    vec: torch.Tensor | None = None
    gain: torch.Tensor | None = None
    value: torch.Tensor | None = None
    a: torch.Tensor | None = None
    mv: torch.Tensor | None = None
    rotated: torch.Tensor | None = None
    sr: torch.Tensor | None = None

    def product(self) -> torch.Tensor:
        """``(B, n, n)`` :math:`K = MR` (formed on first use where the evaluation skipped it)."""
        if self.k is None:
            self.k = (self.mv * self.gain.unsqueeze(-2)) @ self.vec.mT
        return self.k

    def materialized(self) -> Evaluation:
        """The answer's fields in matrix form (``lam``, ``residual``, ``k``, ``m``, ``r``, ``sr``), so that
        evaluations of either spectral path can be joined (:meth:`cat`)."""
        r, k = self.factor(), self.product()
        sr = self.sr
        if sr is None:
            sr = (self.vec * (self.eig * self.gain).unsqueeze(-2)) @ self.vec.mT  # S R = V diag(lambda psi) V^T
        return Evaluation(self.lam, None, self.residual, k=k, m=self.m, r=r, sr=sr)

    def factor(self) -> torch.Tensor:
        """The ``(B, n, n)`` spectral factor :math:`R`."""
        if self.r is None:
            self.r = (self.vec * self.gain.unsqueeze(-2)) @ self.vec.mT
        return self.r

    def where(self, take: torch.Tensor, other: Evaluation) -> Evaluation:
        """This evaluation where ``take`` ``(B,)`` is true, ``other`` elsewhere (field by field)."""
        out = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is None or theirs is None:
                out[f.name] = None
                continue
            mask = take.view((-1,) + (1,) * (mine.dim() - 1))
            out[f.name] = torch.where(mask, mine, theirs)
        return Evaluation(**out)

    @classmethod
    def cat(cls, evaluations: list[Evaluation]) -> Evaluation:
        """One evaluation of a bank from evaluations of its parts, in order (fields all carry)."""
        out = {}
        for f in fields(cls):
            values = [getattr(e, f.name) for e in evaluations]
            out[f.name] = None if any(v is None for v in values) else torch.cat(values)
        return cls(**out)

    def select(self, index) -> Evaluation:
        """The evaluations of some matrices (an index tensor or a slice) of the bank."""
        return Evaluation(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                             for f in fields(self)})


def _add_product(base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return torch.baddbmm(base, left, right, alpha=alpha)


class DualProblem:
    r"""The reduced dual of a bank: tall points ``w`` and normalized gradients ``g``, ``(B, m, n)``.

    The answer is :math:`A = G_\perp R + QK`; :meth:`pieces` gives its exact :math:`W^\top A` and
    :math:`A^\top A` from ``n × n`` work, using :math:`P = W^\top W` where it was computed
    (``exact_gram``) and :math:`F^\top F` (what the point satisfies up to its constraint
    residual) elsewhere; the retraction and the reported residual read them.

    Args:
        w: points on ``manifold`` (tall orientation, the solve's dtype).
        g: gradients, each of Frobenius norm 1 (or 0: its answer is 0).
        manifold: a :class:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold`.
        spectral: the map from :math:`S` to :math:`R` (:class:`Spectral`).
        execution: the device's choices (search dtype).
        smoothing: ``None`` or the absolute smoothing :math:`\mu` per matrix ``(B,)``.
        reduced: work with the ``n × n`` reduced problem (``None``: unless the exact ``"svd"`` map
            runs unsmoothed, which iterates on the ``m × n`` matrix itself: the reference).
        explicit: form :math:`G_\perp = G - QB` (one ``m·n²`` product) rather than
            :math:`C = G^\top G - B^\top B`, which loses every digit of a gradient nearly normal to
            the tangent space; ``None``: where some :math:`\|G_\perp\|_F^2 <` :data:`NEARLY_NORMAL` (a host read).
        exact_gram: compute :math:`P = W^\top W` (one ``m·n²`` product); ``None``: where a
            random probe finds the point's constraint residual above :data:`GRAM_DRIFT_EPS`
            units of its dtype's rounding (a host read).
        check_point: let the manifold refuse a point the dual cannot use (a host read).
    """

    def __init__(self, w, g, manifold, spectral: Spectral, execution: Execution, *, smoothing=None,
                 reduced: bool | None = None, explicit: bool | None = True, exact_gram: bool | None = False,
                 check_point: bool = True) -> None:
        self.manifold, self.spectral, self.execution = manifold, spectral, execution
        self.w, self.g = w, g
        n = w.size(-1)
        self.square = w.size(-2) == n
        self.f = manifold.dual_factor(w, check=check_point)  # None, (B, n) or (B, n, n)
        self.unit = self.f is None
        self.full = self.f is not None and self.f.dim() == w.dim()
        if self.unit:
            self.d = w.new_ones(w.shape[:-2] + (n,))
        else:
            self.d = self.f.norm(dim=-2) if self.full else self.f  # (B, n) column norms of W
        self.metric = normal_metric(self.d * self.d)  # (B, n, n): (d_i^2 + d_j^2)/2
        self.mask = manifold.multiplier_mask
        self.smoothing = smoothing
        self.counters = {"evaluations": 0, "hessian_products": 0}  # shared by the problem's parts
        self.wg = w.mT @ g  # (B, n, n) = W^T G = F^T B
        if exact_gram is None:
            exact_gram = self._drifted()
        self.p = 0.5 * (w.mT @ w + (w.mT @ w).mT) if exact_gram else None  # (B, n, n) = W^T W, exact
        self.explicit = explicit
        self.b = self.gperp = self.c = self.gtg = None
        self.reduced = False
        if reduced or (reduced is None and (spectral.method != "svd" or smoothing is not None)):
            self._reduce()

    @property
    def evaluations(self) -> int:
        """Dual evaluations of this bank so far (its narrowed and smoothed parts included)."""
        return self.counters["evaluations"]

    @property
    def hessian_products(self) -> int:
        """Hessian-vector products of the smoothed dual so far."""
        return self.counters["hessian_products"]

    def _drifted(self) -> bool:
        r"""Whether :math:`\|(W^\top W - F^\top F)z\|/\|F^\top F\|` exceeds :data:`GRAM_DRIFT_EPS` units of
        rounding for a fixed :math:`\pm 1` probe ``z`` (:math:`\mathbb{E}\|Ez\|^2 = \|E\|_F^2`)."""
        w = self.w
        z = _probe(w.size(-1), w.dtype, w.device)
        deviation = (w.mT @ (w @ z).unsqueeze(-1)).squeeze(-1) - self.assumed_gram() @ z  # (B, n)
        scale = self.assumed_gram().norm(dim=(-2, -1)).clamp_min(torch.finfo(w.dtype).tiny)
        return bool((deviation.norm(dim=-1) / scale > GRAM_DRIFT_EPS * torch.finfo(w.dtype).eps).any())

    def _reduce(self) -> None:
        r""":math:`B = Q^\top G` and :math:`C = G_\perp^\top G_\perp`, :math:`G_\perp = G - QB`."""
        self.reduced = True
        self.b = self.solve_factor_transposed(self.wg)  # (B, n, n) = F^{-T} W^T G
        if self.square:  # G lies in span(Q)
            self.c = torch.zeros_like(self.b)
            return
        if self.explicit is None:  # ||G_perp||^2 = 1 - ||B||^2 for a unit G
            self.explicit = bool((1.0 - (self.b * self.b).sum((-2, -1)) < NEARLY_NORMAL).any())
        if self.explicit:
            self.gperp = self.g - self.times_q(self.b)  # (B, m, n)
            self.c = self.gperp.mT @ self.gperp  # (B, n, n)
        else:
            self.gtg = self.g.mT @ self.g
            c = _add_product(self.gtg, self.b.mT, self.b, alpha=-1.0)
            self.c = 0.5 * (c + c.mT)

    def assumed_gram(self) -> torch.Tensor:
        r""":math:`F^\top F` ``(B, n, n)``: the Gram matrix the point satisfies up to its constraint residual."""
        if self.full:
            return self.f.mT @ self.f
        return torch.diag_embed(self.d * self.d)

    def point_gram(self) -> torch.Tensor:
        r""":math:`P = W^\top W`: exact where computed, else :meth:`assumed_gram`."""
        return self.p if self.p is not None else self.assumed_gram()

    # -- the factor F of W = QF --------------------------------------------------------------
    def solve_factor_transposed(self, x: torch.Tensor) -> torch.Tensor:
        r""":math:`F^{-\top}x`."""
        if self.unit:
            return x
        if self.full:
            return torch.linalg.solve_triangular(self.f.mT, x, upper=False)
        return x / self.d.unsqueeze(-1)

    def solve_factor(self, x: torch.Tensor) -> torch.Tensor:
        r""":math:`F^{-1}x`."""
        if self.unit:
            return x
        if self.full:
            return torch.linalg.solve_triangular(self.f, x, upper=True)
        return x / self.d.unsqueeze(-1)

    def times_factor(self, x: torch.Tensor) -> torch.Tensor:
        r""":math:`Fx`."""
        if self.unit:
            return x
        return self.f @ x if self.full else self.d.unsqueeze(-1) * x

    def factor_transposed_times(self, x: torch.Tensor) -> torch.Tensor:
        r""":math:`F^\top x` (:math:`W^\top A` from :math:`K = Q^\top A`)."""
        if self.unit:
            return x
        return self.f.mT @ x if self.full else self.d.unsqueeze(-1) * x

    def times_q(self, x: torch.Tensor) -> torch.Tensor:
        r"""``(B, m, n)`` :math:`Qx = WF^{-1}x`."""
        return self.w @ self.solve_factor(x)

    # -- evaluations ---------------------------------------------------------------------------
    def initial_multiplier(self) -> torch.Tensor:
        r""":math:`\Lambda_0 = -\mathcal{P}(W^\top G + G^\top W)/(4\cdot\text{metric})`: :math:`G + 2W\Lambda_0 = P_W(G)`."""
        return -self.mask(self.wg + self.wg.mT) / (4.0 * self.metric)

    def x_norm(self, lam: torch.Tensor) -> torch.Tensor:
        r"""``(B,)`` :math:`\|X\|_F = \operatorname{tr}(S)^{1/2}` at ``lam`` (the unit of the dual's steps;
        1 where it is zero or not finite, a zero or diverged matrix)."""
        if self.reduced:
            m = self._m(lam)
            sq = (m * m).sum(_DIMS) + torch.diagonal(self.c, dim1=-2, dim2=-1).sum(-1)
        else:
            sq = _add_product(self.g, self.w, lam, alpha=2.0).square().sum(_DIMS)
        norm = sq.clamp_min(0).sqrt()
        return torch.where(torch.isfinite(norm) & (norm > 0), norm, torch.ones_like(norm))

    def gram(self, lam: torch.Tensor) -> torch.Tensor:
        r"""``(B, n, n)`` :math:`S = C + M^\top M` and :math:`M`."""
        m = self._m(lam)
        return (m.mT @ m if self.square else _add_product(self.c, m.mT, m)), m

    def _m(self, lam: torch.Tensor) -> torch.Tensor:
        if self.full:
            return _add_product(self.b, self.f, lam, alpha=2.0)
        return torch.add(self.b, lam, alpha=2.0) if self.unit else torch.addcmul(self.b, 2.0 * self.d.unsqueeze(-1), lam)

    def evaluate(self, lam: torch.Tensor, rotated: bool = False) -> Evaluation:
        """Every matrix of the bank at the multipliers ``lam``; no host read.

        ``rotated`` (eigh path, Stiefel): leave :math:`V^\\top HV = N\\Psi + \\Psi N^\\top`,
        :math:`N = V^\\top MV`, for the frozen-gain step instead of :math:`H` and :math:`K`: two
        ``n × n`` products fewer.
        """
        self.counters["evaluations"] += 1
        if not self.reduced:
            return self._evaluate_unreduced(lam)
        s, m = self.gram(lam)
        finite = torch.isfinite(s.sum(_DIMS))  # (B,): a diverged step gives NaN below, not an error
        sp = self.spectral
        if sp.path == "eigh" or (self.smoothing is not None and sp.method == "svd"):
            s = torch.where(finite.view(-1, 1, 1), s, torch.zeros_like(s))
            eig, vec = torch.linalg.eigh(s)  # (B, n), (B, n, n); reads the lower triangle
            eig = eig.clamp_min(0)
            if self.smoothing is not None:
                mu2 = self._mu2(eig)
                gain = (eig + mu2).rsqrt()
                value = (eig + mu2).sqrt().sum(-1)
            elif sp.method == "svd":  # the exact polar factor; eigenvalues the Gram matrix cannot resolve map to 0
                floor = eig.amax(-1, keepdim=True) * eig.size(-1) * torch.finfo(eig.dtype).eps
                gain = torch.where(eig > floor, eig.clamp_min(torch.finfo(eig.dtype).tiny).rsqrt(), 0.0)
                value = None
            else:
                gain = newton_schulz_gain(eig, sp.method, sp.steps, coefficients=sp.coefficients, eps=sp.eps)
                value = None
            a_sq = (eig * gain * gain).sum(-1)  # ||A||_F^2
            mv = m @ vec  # (B, n, n) = M V
            ev = Evaluation(lam, None, None, m=m, eig=eig, vec=vec, gain=gain, value=value, mv=mv)
            if rotated and self.unit and self.smoothing is None:
                nt = (vec.mT @ mv) * gain.unsqueeze(-2)  # N Psi
                ev.rotated = nt + nt.mT  # V^T H V (metric 1 on Stiefel)
                residual = 0.5 * ev.rotated.norm(dim=_DIMS) / a_sq.clamp_min(torch.finfo(a_sq.dtype).tiny).sqrt()
                ev.residual = torch.where(finite, residual, torch.full_like(residual, float("nan")))
                return ev
        else:
            if self.smoothing is None:
                r = gram_newton_schulz(s, sp.method, sp.steps, coefficients=sp.coefficients, eps=sp.eps)
            else:  # (S + mu^2 I)^{-1/2}: the smoothed dual's own map, well conditioned (Polar Express)
                t = s + torch.diag_embed(self._mu2(s).expand(s.shape[:-1]))
                r = gram_newton_schulz(t, SMOOTHED_PRESET, eps=sp.eps)
            sr = s @ r
            a_sq = (sr * r).sum(_DIMS)  # ||X R||_F^2 = tr(R S R)
            ev = Evaluation(lam, None, None, k=m @ r, m=m, r=r, sr=sr)
        ev.h, residual = self.normal_residual(self.factor_transposed_times(ev.product()), a_sq)
        ev.residual = torch.where(finite, residual, torch.full_like(residual, float("nan")))
        return ev

    def _mu2(self, like: torch.Tensor) -> torch.Tensor:
        mu = torch.as_tensor(self.smoothing, dtype=like.dtype, device=like.device)
        return (mu * mu).reshape(-1, 1) if mu.dim() else mu * mu

    def _evaluate_unreduced(self, lam: torch.Tensor) -> Evaluation:
        x = _add_product(self.g, self.w, lam, alpha=2.0)  # (B, m, n) = G + 2 W Lambda
        finite = torch.isfinite(x.sum(_DIMS))
        x = torch.where(finite.view(-1, 1, 1), x, torch.zeros_like(x))
        a = msign(x, "svd")
        h, residual = self.normal_residual(self.w.mT @ a, (a * a).sum(_DIMS))
        residual = torch.where(finite, residual, torch.full_like(residual, float("nan")))
        return Evaluation(lam, h, residual, a=a)

    def normal_residual(self, wa: torch.Tensor, a_sq: torch.Tensor):
        r"""``(H, residual)`` from :math:`W^\top A` and :math:`\|A\|_F^2`: the dual gradient
        :math:`H = \mathcal{P}(W^\top A + A^\top W)` and the relative tangent residual
        :math:`\|WS\|_F/\|A\|_F`, :math:`S = H/(d_i^2 + d_j^2)`, :math:`\|WS\|_F = \|FS\|_F`."""
        h = self.mask(wa + wa.mT)
        s = h / (2.0 * self.metric)
        normal = (self.times_factor(s) if not self.unit else s).norm(dim=_DIMS)
        return h, normal / a_sq.clamp_min(torch.finfo(a_sq.dtype).tiny).sqrt()

    def answer(self, ev: Evaluation) -> torch.Tensor:
        r"""``(B, m, n)`` :math:`A = G_\perp R + QK` (the unreduced path's own ``a``)."""
        if ev.a is not None:
            return ev.a
        k = ev.product()
        if self.square:
            return self.times_q(k)
        if self.gperp is not None:
            return _add_product(self.times_q(k), self.gperp, ev.factor())
        # G_perp R + Q K = G R + Q (K - B R)
        return _add_product(self.times_q(k - self.b @ ev.factor()), self.g, ev.factor())

    def pieces(self, ev: Evaluation) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(W^T A, A^T A)`` ``(B, n, n)`` of the answer :math:`A = G_\perp R + QK`, from ``n × n`` work.

        Where :math:`W^\top W = F^\top F` (no :math:`P` computed) these are the reduced problem's
        :math:`F^\top K` and :math:`RSR` (:math:`V\operatorname{diag}(\lambda\psi^2)V^\top` from an
        eigenbasis): one product. With the point's exact :math:`P = W^\top W`,
        :math:`W^\top Q = PF^{-1}`, :math:`Q^\top Q = F^{-\top}PF^{-1}`,
        :math:`W^\top G_\perp = W^\top G - PF^{-1}B`:

        .. math::

            W^\top A = W^\top G_\perp R + PF^{-1}K,\qquad
            A^\top A = RCR + R\,G_\perp^\top Q\,K + K^\top Q^\top G_\perp R + K^\top Q^\top QK,

        with :math:`C = G_\perp^\top G_\perp` (formed, or :math:`G^\top G - 2B^\top B + B^\top Q^\top QB`):
        exact for a point off its manifold, so a retraction built from them removes the drift.
        """
        k = ev.product()
        if self.p is None:
            if ev.vec is not None:
                ata = (ev.vec * (ev.eig * ev.gain * ev.gain).unsqueeze(-2)) @ ev.vec.mT
            else:
                ata = ev.factor().mT @ ev.sr
            return self.factor_transposed_times(k), 0.5 * (ata + ata.mT)
        r = ev.factor()
        p_finv = self.solve_factor_transposed(self.p).mT  # P F^{-1}
        qtq = self.solve_factor_transposed(p_finv)  # F^{-T} P F^{-1}
        wta = p_finv @ k
        ata = k.mT @ (qtq @ k)
        if not self.square:
            wtg_perp = self.wg - p_finv @ self.b  # W^T G_perp
            qtg_perp = self.solve_factor_transposed(wtg_perp)  # Q^T G_perp
            c = self.c if self.gperp is not None else \
                self.gtg - 2.0 * (self.b.mT @ self.b) + self.b.mT @ (qtq @ self.b)
            cross = r.mT @ (qtg_perp.mT @ k)  # R G_perp^T Q K
            ata = ata + r.mT @ (c @ r) + cross + cross.mT
            wta = wta + wtg_perp @ r
        return wta, 0.5 * (ata + ata.mT)

    def answer_residual(self, wta: torch.Tensor, ata: torch.Tensor) -> torch.Tensor:
        r"""``(B,)`` relative tangent residual of the answer from its :meth:`pieces`."""
        return self.normal_residual(wta, torch.diagonal(ata, dim1=-2, dim2=-1).sum(-1))[1]

    def tangent_residual(self, a: torch.Tensor) -> torch.Tensor:
        r"""``(B,)`` relative normal component :math:`\|A - P_WA\|_F/\|A\|_F` of a formed ``a``,
        from the exact :math:`W^\top A`."""
        return self.normal_residual(self.w.mT @ a, (a * a).sum(_DIMS))[1]

    def select(self, index) -> DualProblem:
        """The problem of some matrices of the bank (an index tensor or a slice); the setup is shared."""
        part = copy.copy(self)
        for name in ("w", "g", "f", "d", "metric", "wg", "p", "b", "gperp", "c", "gtg"):
            value = getattr(self, name)
            if value is not None:
                setattr(part, name, value[index])
        if isinstance(self.smoothing, torch.Tensor) and self.smoothing.dim():
            part.smoothing = self.smoothing[index]
        return part

    # -- the smoothed dual (one matrix, eigh) --------------------------------------------------
    def relative_gap(self, ev: Evaluation) -> float:
        r"""Certified relative duality gap :math:`(\|X\|_* - \langle G, A\rangle)/\|X\|_*` of an eigh evaluation.

        Any multiplier bounds the optimum by :math:`\|X(\Lambda)\|_* = \sum_i\sqrt{\lambda_i}`, and
        :math:`\langle G, A\rangle = \sum_i\lambda_i\psi_i - 2\langle\Lambda, F^\top K\rangle` is
        the answer's value (up to its tangent residual).
        """
        nuclear = ev.eig.sqrt().sum()
        value = (ev.eig * ev.gain).sum() - 2.0 * (ev.lam * self.factor_transposed_times(ev.product())).sum()
        return float((nuclear - value) / nuclear.clamp_min(torch.finfo(nuclear.dtype).tiny))

    def relative_gaps(self, ev: Evaluation) -> torch.Tensor:
        """``(B,)`` :meth:`relative_gap` of every matrix of an eigh evaluation."""
        nuclear = ev.eig.sqrt().sum(-1)
        value = (ev.eig * ev.gain).sum(-1) - 2.0 * (ev.lam * self.factor_transposed_times(ev.product())).sum(_DIMS)
        return (nuclear - value) / nuclear.clamp_min(torch.finfo(nuclear.dtype).tiny)

    def hessian_vector(self, ev: Evaluation, delta: torch.Tensor, cache: dict) -> torch.Tensor:
        r"""Second derivative of the smoothed dual along the symmetric ``delta``.

        :math:`E = 2F\Delta`, :math:`dS = E^\top M + M^\top E`, :math:`dR = V[(V^\top dSV)\circ\Phi]V^\top`
        with :math:`\Phi_{ij} = -1/(a_ia_j(a_i + a_j))`, :math:`a = \psi^{-1}` (the divided
        differences of :math:`(\lambda + \mu^2)^{-1/2}`); then :math:`dK = ER + M\,dR` and the
        answer is :math:`\mathcal{P}(F^\top dK + dK^\top F)`. Four ``n × n`` products, in the search
        dtype (they only steer conjugate gradients).
        """
        self.counters["hessian_products"] += 1
        if "vec" not in cache:
            low = self.execution.search_dtype_for(ev.vec)
            root = ev.gain.reciprocal()
            phi = -1.0 / (root.unsqueeze(-1) * root.unsqueeze(-2) * (root.unsqueeze(-1) + root.unsqueeze(-2)))
            cache.update(vec=ev.vec.to(low), mv=ev.mv.to(low), phi=phi)
        vec, mv, phi = cache["vec"], cache["mv"], cache["phi"]
        e_v = (2.0 * self.times_factor(delta)).to(vec.dtype) @ vec  # E V
        t = (e_v.mT @ mv).to(delta.dtype)
        dr = ((t + t.mT) * phi).to(vec.dtype)  # V^T dR V
        dk = ((e_v.to(delta.dtype) * ev.gain.unsqueeze(-2)).to(vec.dtype) + mv @ dr) @ vec.mT  # dK
        ddk = self.factor_transposed_times(dk.to(delta.dtype))
        return self.mask(ddk + ddk.mT)


# -- Barzilai–Borwein on a bank ----------------------------------------------------------------

@dataclass
class Progress:
    """Per-matrix book-keeping of a bank's solve, all on the device.

    Attributes:
        best: the best evaluation of each matrix so far (a NaN one is always replaced).
        iterations: ``(B,)`` dual updates each matrix took.
        active: ``(B,)`` matrices still iterating (above ``tol``, finite, not stalled).
        mark, stall: ``(B,)`` the residual of the last 10% cut and the iterations since.
        history: the ``(B,)`` residuals of every evaluation, in order (device tensors).
    """

    best: Evaluation
    iterations: torch.Tensor
    active: torch.Tensor
    mark: torch.Tensor
    stall: torch.Tensor
    history: list

    sync_free: bool = True

    @classmethod
    def start(cls, ev: Evaluation, tol: float, sync_free: bool = True) -> Progress:
        r = ev.residual
        if not sync_free:  # rows of the best iterate are written in place (record_rows)
            ev = Evaluation(**{f.name: None if getattr(ev, f.name) is None else getattr(ev, f.name).clone()
                               for f in fields(ev)})
        return cls(ev, torch.zeros_like(r, dtype=torch.long), (r > tol) & torch.isfinite(r), r.clone(),
                   torch.zeros_like(r, dtype=torch.long), [r], sync_free)

    def record_rows(self, ev: Evaluation, rows: torch.Tensor, tol: float, patience: int | None) -> None:
        """Take ``ev``, the evaluation of the matrices ``rows`` (an index tensor) that stepped: best
        iterate, stall count, activity. Early-stopping loops only (a host read per call)."""
        r = ev.residual
        self.history.append(r)
        self.iterations[rows] += 1
        best_r = self.best.residual[rows]
        improved = (r < best_r) | torch.isnan(best_r)
        if bool(improved.any()):
            take = rows if bool(improved.all()) else rows[improved]
            sub = ev if bool(improved.all()) else ev.select(improved)
            for f in fields(self.best):
                mine, theirs = getattr(self.best, f.name), getattr(sub, f.name)
                if mine is not None and theirs is not None:
                    mine[take] = theirs
        progress = r < 0.9 * self.mark[rows]
        self.mark[rows] = torch.where(progress, r, self.mark[rows])
        self.stall[rows] = torch.where(progress, 0, self.stall[rows] + 1)
        still = (r > tol) & torch.isfinite(r)
        if patience is not None:
            still = still & (self.stall[rows] < patience)
        self.active[rows] = still

    def record(self, ev: Evaluation, stepped: torch.Tensor, tol: float, patience: int | None) -> None:
        """Take ``ev`` for the matrices that ``stepped``: best iterate, stall count, activity."""
        r = ev.residual
        self.history.append(r)
        self.iterations = self.iterations + stepped.long()
        improved = stepped & ((r < self.best.residual) | torch.isnan(self.best.residual))
        if not self.sync_free and bool(improved.all()):  # a host read where it is free: no masked copies
            self.best = ev
        else:
            self.best = ev.where(improved, self.best)
        progress = r < 0.9 * self.mark
        self.mark = torch.where(stepped & progress, r, self.mark)
        self.stall = torch.where(stepped, torch.where(progress, 0, self.stall + 1), self.stall)
        still = (r > tol) & torch.isfinite(r)
        if patience is not None:
            still = still & (self.stall < patience)
        self.active = stepped & still | (~stepped & self.active)


def _barzilai_borwein(step, s_vec, y_vec, long: bool):
    """Next BB step size per matrix ``(B,)``: long :math:`\\langle s,s\\rangle/\\langle s,y\\rangle` or
    short :math:`\\langle s,y\\rangle/\\langle y,y\\rangle`, kept only where :math:`\\langle s,y\\rangle > 0`."""
    sy = (s_vec * y_vec).sum(_DIMS)
    if long:
        proposed = (s_vec * s_vec).sum(_DIMS) / sy
    else:
        proposed = sy / (y_vec * y_vec).sum(_DIMS).clamp_min(torch.finfo(sy.dtype).tiny)
    return torch.where(sy > 0, proposed, step)


def bb_solve(problem: DualProblem, lam: torch.Tensor, tol: float, iterations: int, patience: int | None,
             sync_free: bool) -> Progress:
    r"""Barzilai–Borwein steps on every matrix of ``problem`` from ``lam`` ``(B, n, n)``.

    The first step is :math:`\|X\|_F/(4\sqrt n)` at the start (about a quarter of a typical
    singular value), then the long and short rules alternate. A matrix stops moving once it
    is inactive (:class:`Progress`). ``sync_free``: exactly ``iterations`` iterations, every matrix
    evaluated each time under device-side masks, and no host read; otherwise the loop reads which
    matrices are still active, works on those alone (:meth:`DualProblem.select`) and stops when
    none is.
    """
    ev = problem.evaluate(lam)
    progress = Progress.start(ev, tol, sync_free)
    # ~ a quarter of a typical singular value of X: the curvature of the nuclear norm is ~ 1/sigma
    # (for a gradient nearly normal to the tangent space X is small, and so is the first step)
    step = 0.25 * problem.x_norm(lam) / math.sqrt(lam.size(-1))
    lam_prev = grad_prev = None
    work, rows = problem, None
    for taken in range(iterations):
        if sync_free:
            active = progress.active
        else:
            keep = progress.active if rows is None else progress.active[rows]
            if not bool(keep.any()):
                break
            if rows is None or not bool(keep.all()):  # narrow the work to the active matrices
                index = keep.nonzero().flatten()
                rows = index if rows is None else rows[index]
                work, ev, lam, step = work.select(index), ev.select(index), lam[index], step[index]
                if lam_prev is not None:
                    lam_prev, grad_prev = lam_prev[index], grad_prev[index]
            active = None
        grad = ev.h / work.metric  # preconditioned dual gradient
        if lam_prev is not None:
            proposed = _barzilai_borwein(step, lam - lam_prev, grad - grad_prev, long=bool(taken % 2))
            step = proposed if active is None else torch.where(active, proposed, step)
        lam_prev, grad_prev = lam, grad
        moved = lam - step.view(-1, 1, 1) * grad
        lam = moved if active is None else torch.where(active.view(-1, 1, 1), moved, lam)
        ev = work.evaluate(lam)
        if active is None:
            progress.record_rows(ev, rows, tol, patience)
        else:
            progress.record(ev, active, tol, patience)
    return progress


# -- Anderson-mixed frozen-gain Newton steps (eigh path) -----------------------------------

def _preconditioned_step(problem: DualProblem, ev: Evaluation, relaxation: torch.Tensor) -> torch.Tensor:
    r"""Approximate Newton step :math:`-\mathcal{H}^{-1}H` from the eigenbasis in hand.

    With the gain frozen, a change :math:`\Delta` of the multiplier changes :math:`H` by
    :math:`\mathcal{P}(2D^2\Delta R + 2R\Delta D^2)`; with :math:`D^2` replaced by the metric
    that operator is diagonal in the basis :math:`V`, with entries :math:`2(\psi_i + \psi_j)`.
    Freezing :math:`R` drops the curvature of the spectral map, so the step is short (on
    Stiefel the preconditioned Jacobian has its spectrum in :math:`(0, 1]`) and is over-relaxed
    by ``relaxation`` ``(B,)``.
    """
    low = ev.vec.to(problem.execution.search_dtype_for(ev.vec))
    rotated = ev.rotated.to(low.dtype) if ev.rotated is not None else \
        low.mT @ (ev.h / problem.metric).to(low.dtype) @ low  # in the eigenbasis of S
    scale = 2.0 * (ev.gain.unsqueeze(-1) + ev.gain.unsqueeze(-2))
    step = (low @ (rotated / scale.clamp_min(torch.finfo(scale.dtype).tiny)).to(low.dtype) @ low.mT).to(ev.vec.dtype)
    step = problem.mask(step + step.mT)  # symmetric part, times two
    return step * (-0.5 * relaxation).view(-1, 1, 1)


def anderson_solve(problem: DualProblem, lam: torch.Tensor, tol: float, iterations: int,
                   patience: int | None, memory: int = ANDERSON_MEMORY) -> Progress:
    r"""Frozen-gain Newton steps (:func:`_preconditioned_step`) with Anderson mixing, per matrix.

    The fixed-point map :math:`\Lambda + \delta(\Lambda)` converges linearly; Anderson mixing of
    the last ``memory`` steps (type II: :math:`\Lambda_{k+1} = \Lambda_k + \delta_k - (\Delta\Lambda
    + \Delta\delta)\gamma`, :math:`\gamma = \arg\min\|\delta_k - \Delta\delta\,\gamma\|`) about halves
    the iterations of Barzilai–Borwein steps. Steps are over-relaxed by
    :data:`PRECONDITIONED_RELAXATION` until a matrix's residual first grows; then its memory
    restarts and its relaxation drops to 1. Eigh path only (the eigenbasis); it reads which
    matrices are still active every iteration, works on those alone and stops when none is.
    """
    ev = problem.evaluate(lam, rotated=True)
    progress = Progress.start(ev, tol, sync_free=False)
    relaxation = torch.full((lam.size(0),), PRECONDITIONED_RELAXATION, dtype=lam.dtype, device=lam.device)
    points: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    valid: list[torch.Tensor] = []  # per history entry, per matrix: not cleared by a restart
    previous = ev.residual
    work, rows = problem, None
    for _ in range(iterations):
        keep = progress.active if rows is None else progress.active[rows]
        if not bool(keep.any()):
            break
        if rows is None or not bool(keep.all()):  # narrow the work to the active matrices
            index = keep.nonzero().flatten()
            rows = index if rows is None else rows[index]
            work, ev, lam = work.select(index), ev.select(index), lam[index]
            relaxation, previous = relaxation[index], previous[index]
            points, steps, valid = [p[index] for p in points], [d[index] for d in steps], [v[index] for v in valid]
        delta = _preconditioned_step(work, ev, relaxation)
        points, steps = (points + [lam])[-(memory + 1):], (steps + [delta])[-(memory + 1):]
        valid = (valid + [torch.ones_like(previous, dtype=torch.bool)])[-(memory + 1):]
        lam = lam + delta
        if len(steps) > 1:
            lam = lam - _anderson_correction(points, steps, valid, delta)
        ev = work.evaluate(lam, rotated=True)
        progress.record_rows(ev, rows, tol, patience)
        grew = ~(ev.residual < previous)
        relaxation = torch.where(grew, torch.ones_like(relaxation), relaxation)
        valid = [v & ~grew for v in valid]  # the mixing overshot: restart from plain steps
        previous = ev.residual
    return progress


def _anderson_correction(points, steps, valid, delta) -> torch.Tensor:
    r"""``(B, n, n)`` :math:`(\Delta\Lambda + \Delta\delta)\gamma` from the consecutive differences of
    the history; pairs that a restart invalidated get :math:`\gamma = 0`."""
    d_steps = [b - a for a, b in itertools.pairwise(steps)]
    d_points = [b - a for a, b in itertools.pairwise(points)]
    ok = [u & v for u, v in itertools.pairwise(valid)]
    k = len(d_steps)
    flat = torch.stack([d.flatten(1) for d in d_steps], dim=1)  # (B, k, n*n)
    keep = torch.stack(ok, dim=1).to(flat.dtype)  # (B, k)
    flat = flat * keep.unsqueeze(-1)
    gram = flat @ flat.mT  # (B, k, k)
    rhs = (flat @ delta.flatten(1).unsqueeze(-1)).squeeze(-1)  # (B, k)
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    ridge = 1e-10 * torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(gram.dtype).tiny)
    gamma, info = torch.linalg.solve_ex(gram + ridge.view(-1, 1, 1) * eye + (1 - keep).unsqueeze(-1) * eye, rhs)
    gamma = torch.where((info == 0).unsqueeze(-1) & torch.isfinite(gamma), gamma * keep, 0.0)  # (B, k)
    out = torch.zeros_like(delta)
    for i in range(k):
        out = out + gamma[:, i].view(-1, 1, 1) * (d_points[i] + d_steps[i])
    return out


# -- the smoothed dual: Newton–CG, one matrix ----------------------------------------------

def _conjugate_gradient(problem: DualProblem, ev: Evaluation, rhs: torch.Tensor, max_iter: int, rtol: float):
    """Preconditioned CG on ``Hess · p = rhs`` (preconditioner: the normal-space metric)."""
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    z = r / problem.metric
    p = z.clone()
    rz = float((r * z).sum())
    stop = rtol * float(rhs.norm())
    cache: dict = {}
    for _ in range(max_iter):
        hp = problem.hessian_vector(ev, p, cache)
        php = float((p * hp).sum())
        if not php > 0:  # flat or numerically indefinite: keep what we have
            break
        alpha = rz / php
        x = x + alpha * p
        r = r - alpha * hp
        if float(r.norm()) <= stop:
            break
        z = r / problem.metric
        rz_new = float((r * z).sum())
        p = z + (rz_new / rz) * p
        rz = rz_new
    return x if bool(x.abs().sum() > 0) else z


def _newton(problem: DualProblem, lam: torch.Tensor, tol: float, max_iter: int, patience: int | None):
    r"""Newton–CG with backtracking on the smoothed dual of one matrix (a bank of one).

    Armijo on the smoothed value where it resolves the predicted decrease; below the value's
    rounding noise (:data:`VALUE_NOISE_ULPS`) a trial is accepted when it lowers the residual.
    Returns ``(best evaluation, iterations)``.
    """
    ev = problem.evaluate(lam)
    best, mark, stall, iterations = ev, float(ev.residual), 0, 0
    residual = float(ev.residual)
    while not residual <= tol and iterations < max_iter:
        if (patience is not None and stall >= patience) or math.isnan(residual):
            break
        h = ev.h
        direction = _conjugate_gradient(problem, ev, -h, NEWTON_CG_ITER, min(0.5, float(h.norm()) ** 0.5))
        slope = float((h * direction).sum())
        if not slope < 0:
            direction, slope = -h / problem.metric, -float((h * h / problem.metric).sum())
        noise = VALUE_NOISE_ULPS * torch.finfo(lam.dtype).eps * abs(float(ev.value))
        t = 1.0
        for _ in range(LINE_SEARCH_STEPS):
            trial = problem.evaluate(lam + t * direction)
            decrease = t * slope
            if -decrease > noise:
                accepted = float(trial.value) <= float(ev.value) + 1e-4 * decrease
            else:
                accepted = float(trial.residual) < residual
            if accepted:
                break
            t *= 0.5
        ev, lam = trial, trial.lam
        residual = float(ev.residual)
        iterations += 1
        if residual < float(best.residual) or math.isnan(float(best.residual)):
            best = ev
        if residual < 0.9 * mark:
            mark, stall = residual, 0
        else:
            stall += 1
    return best, iterations


def smoothed_solve(problem: DualProblem, lam: torch.Tensor, lam0: torch.Tensor, kappa: float, tol: float,
                   max_iter: int, patience: int | None, cold: bool, gap_tol: float | None = None):
    r"""Newton–CG on the smoothed dual of one matrix with :math:`\mu = \kappa\|P_WG\|_F/\sqrt n`.

    A cold start runs a continuation (:data:`SMOOTHING_START` to ``10 tol``, then ``kappa`` to
    ``tol``); a warm start goes straight to ``kappa`` when it beats the closed-form start. With
    ``gap_tol`` the smoothing shrinks tenfold a stage (down to :data:`SMOOTHING_FLOOR`) until the
    certified relative gap is at most ``gap_tol``. The iteration budget is shared.

    Returns:
        ``(best evaluation, iterations, gap, problem)``: ``problem`` the reduced copy that ran
        (its :meth:`~DualProblem.answer` forms the direction).
    """
    n = lam.size(-1)
    problem = with_smoothing(problem, None)
    s0, _ = problem.gram(lam0)
    scale = float(torch.diagonal(s0, dim1=-2, dim2=-1).sum().clamp_min(0).sqrt()) / math.sqrt(n)
    scale = scale if scale > 0 else 1.0 / math.sqrt(n)
    if not cold:
        problem.smoothing = kappa * scale
        cold = not float(problem.evaluate(lam).residual) < float(problem.evaluate(lam0).residual)
        lam = lam0 if cold else lam
    stages = [SMOOTHING_START, kappa] if (cold and kappa < SMOOTHING_START) else [kappa]
    iterations, ev = 0, None
    for i, stage in enumerate(stages):
        problem.smoothing = stage * scale
        stage_tol = tol if i == len(stages) - 1 else 10.0 * tol
        ev, done = _newton(problem, lam, stage_tol, max_iter - iterations, patience)
        lam, iterations = ev.lam, iterations + done
    gap = problem.relative_gap(ev)
    while gap_tol is not None and not gap <= gap_tol and float(ev.residual) <= tol and iterations < max_iter:
        stage = stage / 10.0
        if stage < SMOOTHING_FLOOR:
            break
        before = problem.smoothing
        problem.smoothing = stage * scale
        more, done = _newton(problem, ev.lam, tol, max_iter - iterations, patience)
        iterations += done
        if not float(more.residual) <= tol:
            problem.smoothing = before
            break  # the smaller smoothing did not get to tol: keep the last answer that did
        ev, gap = more, problem.relative_gap(more)
    return ev, iterations, gap, problem


def with_smoothing(problem: DualProblem, smoothing) -> DualProblem:
    """A copy of ``problem`` (the setup shared) with another smoothing, on the reduced eigh path
    (the smoothed Newton steps need the eigenbasis)."""
    part = copy.copy(problem)
    part.smoothing = smoothing
    part.spectral = replace(problem.spectral, path="eigh")
    if not part.reduced:
        part._reduce()
    return part
