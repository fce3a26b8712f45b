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

**Solvers** of this problem are in :mod:`~manifoldlib.optim.dual_solvers`.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, fields, replace

import torch

from .._numbers import require_positive
from ..functional.msign import msign
from ..functional.newton_schulz import (
    _gram_newton_schulz,
    _newton_schulz_gain,
    gram_newton_schulz,
    resolve_schedule,
)
from ..functional.normal_space import normal_metric
from .execution import Execution

__all__ = ["NORMAL_GRADIENT_ULPS", "DualProblem", "Evaluation", "Spectral", "with_smoothing"]

_DIMS = (-2, -1)
#: The Newton–Schulz preset of a smoothed evaluation on the products path: :math:`S + \mu^2I` has a
#: condition number of at most about :math:`1/\kappa^2`, which Polar Express resolves in its steps.
SMOOTHED_PRESET = "polar-express"
#: A unit gradient whose part outside the span of :math:`W` has :math:`\|G_\perp\|_F^2` below this
#: gets :math:`G_\perp` formed explicitly (``explicit=None``).
NEARLY_NORMAL = 0.1
#: A gradient whose tangent part is at most ``NORMAL_GRADIENT_ULPS`` times its rounding, relative to
#: its norm :math:`2\epsilon_{\text{in}} + \sqrt n\,\epsilon_{\text{work}}` (the machine epsilons,
#: ``torch.finfo(dtype).eps``, of the inputs and of the solve: rounding a normal ``G`` leaves a
#: tangent part of about :math:`0.15\epsilon`, projecting one about :math:`\sqrt n\,\epsilon/2`), is
#: normal: every tangent direction has inner product 0 with it, a solve would return a unit
#: direction made of rounding, and the steepest direction is ``A = 0``.
NORMAL_GRADIENT_ULPS = 8.0
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
        schedule: the Newton–Schulz ``(triples, scale)`` of :func:`~manifoldlib.functional.newton_schulz.resolve_schedule`,
            resolved (and ``steps``, ``coefficients`` and ``eps`` checked) once, here, not at every
            evaluation (``None`` for ``"svd"``).

    Raises:
        ValueError: as :func:`~manifoldlib.functional.newton_schulz.gram_newton_schulz`, naming the value.
    """

    method: str = "jordan5"
    steps: int | None = None
    coefficients: tuple | None = None
    eps: float = 1e-7
    path: str = "eigh"
    schedule: tuple | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        require_positive("eps", self.eps)
        if self.method != "svd":
            object.__setattr__(self, "schedule", resolve_schedule(self.method, self.steps, self.coefficients))

    @classmethod
    def of_group(cls, options, path: str) -> Spectral:
        """The map of a group's :class:`~manifoldlib.optim.options.MuonOptions` on ``path``:
        ``msign_method="ns"`` is the group's own Newton–Schulz."""
        dual = options.dual
        if dual.msign_method == "ns":
            return cls("jordan5", options.ns_steps if dual.ns_steps is None else dual.ns_steps,
                       options.ns_coefficients, options.eps, path)
        return cls(dual.msign_method, dual.ns_steps, None, options.eps, path)


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
        wtw = w.mT @ w if exact_gram else None  # (B, n, n) = W^T W, exact: one m n^2 product
        self.p = 0.5 * (wtw + wtw.mT) if exact_gram else None
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
            c = torch.baddbmm(self.gtg, self.b.mT, self.b, alpha=-1.0)
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

    def x_norm(self, lam: torch.Tensor, raw: bool = False) -> torch.Tensor:
        r"""``(B,)`` :math:`\|X\|_F = \operatorname{tr}(S)^{1/2}` at ``lam`` (the unit of the dual's steps;
        1 where it is zero or not finite, a zero or diverged matrix; ``raw``: as computed). At
        :math:`\Lambda_0` it is :math:`\|P_W G\|_F`, the tangent part of the (unit) gradient."""
        if self.reduced:
            m = self._m(lam)
            sq = (m * m).sum(_DIMS) + torch.diagonal(self.c, dim1=-2, dim2=-1).sum(-1)
        else:
            sq = torch.baddbmm(self.g, self.w, lam, alpha=2.0).square().sum(_DIMS)
        norm = sq.clamp_min(0).sqrt()
        if raw:
            return norm
        return torch.where(torch.isfinite(norm) & (norm > 0), norm, torch.ones_like(norm))

    def gram(self, lam: torch.Tensor) -> torch.Tensor:
        r"""``(B, n, n)`` :math:`S = C + M^\top M` and :math:`M`."""
        m = self._m(lam)
        return (m.mT @ m if self.square else torch.baddbmm(self.c, m.mT, m)), m

    def _m(self, lam: torch.Tensor) -> torch.Tensor:
        if self.full:
            return torch.baddbmm(self.b, self.f, lam, alpha=2.0)
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
                gain = _newton_schulz_gain(eig, *sp.schedule, sp.eps)
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
                r = _gram_newton_schulz(s, *sp.schedule, sp.eps)
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
        x = torch.baddbmm(self.g, self.w, lam, alpha=2.0)  # (B, m, n) = G + 2 W Lambda
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
            return torch.baddbmm(self.times_q(k), self.gperp, ev.factor())
        # G_perp R + Q K = G R + Q (K - B R)
        return torch.baddbmm(self.times_q(k - self.b @ ev.factor()), self.g, ev.factor())

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
        """:meth:`relative_gaps` of a one-matrix problem, as a float (a host read)."""
        return float(self.relative_gaps(ev).reshape(-1)[0])

    def relative_gaps(self, ev: Evaluation) -> torch.Tensor:
        r"""``(B,)`` certified relative duality gap :math:`(\|X\|_* - \langle P_WG, A\rangle)/\|X\|_*` of
        an eigh evaluation of the reduced problem.

        Any multiplier bounds the optimum by :math:`\|X(\Lambda)\|_* = \sum_i\sqrt{\lambda_i}`. The
        answer's value is that of its tangent part, :math:`\langle P_WG, A\rangle = \langle X(\Lambda_0), A\rangle
        = \langle C, R\rangle + \langle M_0, K\rangle` (:math:`X(\Lambda_0) = G_\perp + QM_0`,
        :math:`A = G_\perp R + QK`): every term is of the size of the gradient's tangent part. The
        equal :math:`\langle G, A\rangle = \sum_i\lambda_i\psi_i - 2\langle\Lambda, F^\top K\rangle` is a
        difference of terms of the size of :math:`G`, which for a gradient nearly normal to the
        tangent space leaves rounding (and the answer's own tangent residual times the normal part)
        divided by a small :math:`\|X\|_*`: gaps of :math:`\pm 10^{2}` and beyond.
        """
        nuclear = ev.eig.sqrt().sum(-1)
        value = (self._m(self.initial_multiplier()) * ev.product()).sum(_DIMS)  # <M_0, K>
        if not self.square:  # <C, R> = sum_i psi_i (V^T C V)_ii
            value = value + (((self.c @ ev.vec) * ev.vec).sum(-2) * ev.gain).sum(-1)
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


def with_smoothing(problem: DualProblem, smoothing) -> DualProblem:
    """A copy of ``problem`` (the setup shared) with another smoothing, on the reduced eigh path
    (the smoothed Newton steps need the eigenbasis)."""
    part = copy.copy(problem)
    part.smoothing = smoothing
    part.spectral = replace(problem.spectral, path="eigh")
    if not part.reduced:
        part._reduce()
    return part
