r"""The retraction of a Manifold Muon step, formed from the solved reduced dual (tall matrices).

The plain step forms the direction :math:`A = XR` (:math:`X = G + 2W\Lambda`, two ``m·n²``
products) and hands :math:`Y = \beta W - \eta A` to the Gram-form retraction, which takes the
Gram matrix of :math:`Y` and multiplies :math:`Y` by an ``n × n`` factor :math:`\Phi` (two more).
Every piece of that Gram matrix is already known in ``n × n`` form after the dual solve
(:math:`W = QD`, :math:`K = Q^\top A = MR`, :math:`S = X^\top X = V\operatorname{diag}(\lambda)V^\top`):

.. math::

    Y^\top Y = \beta^2 W^\top W - \beta\eta\,(DK + K^\top D) + \eta^2\,V\operatorname{diag}(\lambda\psi^2)V^\top,

so the new point is :math:`Y\Phi = W(\beta\Phi - 2\eta\Lambda R\Phi) - \eta\,G(R\Phi)`: two
``m·n²`` products instead of four, and no ``m × n`` temporaries. :math:`\Phi` is the retraction's
own factor, from the same products-only kernels (:mod:`~manifoldlib.functional.gram_rsqrt`):

* Stiefel (``polar``): :math:`\Phi = (Y^\top Y)^{-1/2}`;
* DGram (``alternating``): with :math:`c_j = \|y_j\|` and :math:`T = cY^\top Yc`,
  :math:`F = T^{-1/2}`, :math:`d'_j = (FcY^\top Y)_{jj}`, :math:`\Phi = cFd'`;
* Oblique (``normalize``): :math:`\Phi = \operatorname{diag}((Y^\top Y)_{jj}^{-1/2})`;

each from the manifold's
:meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.gram_retraction_factor`.

**The Gram matrix of W.** :math:`W^\top W` is taken as :math:`D^2` (DGram, ``D`` the current column
norms) or :math:`I` (Stiefel), and as :math:`F^\top F` from the QR factor on Oblique (exact, the
columns are not orthogonal): what the point satisfies up to its constraint residual. That
residual is then not corrected by the step, and rounding lets it walk: float32, 512×128 DGram,
fused steps only, :math:`\|\mathrm{Off}(W^\top W)\|_F/\|\mathrm{diag}(W^\top W)\|` grew as
:math:`\sqrt{t}` from 2.3e-7 to 6.5e-6 over 3,000 steps. So every step estimates the residual
with one probe vector :math:`z` (:math:`\pm 1` entries: :math:`\mathbb{E}\|Ez\|^2 = \|E\|_F^2`
for the deviation :math:`E = W^\top W - D^2`; two ``m·n`` matrix-vector products) and, above
:data:`GRAM_DRIFT_EPS` units of the dtype's rounding, reads the exact :math:`W^\top W` (one
``m·n²`` product), with which :math:`W^\top A` and :math:`A^\top A` are rebuilt exactly
(:func:`_exact_pieces`; the reduced dual assumed :math:`W^\top W = D^2`): the step then removes
the drift as the four-product step does, and the residual stays at that level.

The fused form pays five ``n × n`` products (``K``, :math:`V\operatorname{diag}V^\top`,
:math:`R`, :math:`R\Phi`, :math:`\Lambda R\Phi`) to save two ``m·n²`` ones, so it is used only
for ``m >= FUSED_MIN_ASPECT · n`` (tall orientation) and when the kernels resolve :math:`\Phi`
within :data:`~manifoldlib.functional.msign.GRAM_EIGH_ONE_PASS`; anything else (a large step,
the exact SVD path) takes the plain step. Both spectral paths fuse: the eigh path builds
:math:`A^\top A = V\operatorname{diag}(\lambda\psi^2)V^\top` from its eigenbasis, the products
path (the CUDA default) as :math:`RSR` from its Gram-form factor, one ``n × n`` product more. Measured on the
development CPU (one thread, 3072×768, steady state): 120–143 ms against 166–301 ms for forming
the direction and retracting it, new points equal to 4e-7 relative.
"""

from __future__ import annotations

import functools
import math

import torch

from ..functional.gram_rsqrt import products_only_rsqrt
from ..functional.msign import GRAM_EIGH_ONE_PASS
from .dual_problem import _DualProblem, _State

__all__ = ["FUSED_MIN_ASPECT", "GRAM_DRIFT_EPS", "fused_retraction"]

#: Smallest aspect ratio ``m/n`` (tall orientation) that takes the fused retraction: there its
#: two ``m·n²`` products saved outweigh the five ``n × n`` ones it adds (equal at ``m = 2n``,
#: where the ``m × n`` temporaries it avoids tip the balance).
FUSED_MIN_ASPECT = 2.0
#: Estimated constraint residual of the point, in units of the dtype's machine epsilon, above
#: which the fused retraction reads the exact Gram matrix of ``W`` (float32: 7.6e-6).
GRAM_DRIFT_EPS = 64.0


@functools.lru_cache(maxsize=32)
def _probe(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fixed ``(n,)`` vector of ±1 (the same on every process: replicated steps agree)."""
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(n))
    return (2 * signs - 1).to(dtype=dtype, device=device)


def _point_gram(problem: _DualProblem) -> torch.Tensor | None:
    r"""The exact ``(n, n)`` :math:`W^\top W` when the point's estimated constraint residual is
    above :data:`GRAM_DRIFT_EPS`, else ``None`` (take :math:`D^2`). A triangular factor
    (Oblique: the columns are not orthogonal) gives :math:`F^\top F` itself."""
    if problem.full:
        return problem.f.mT @ problem.f
    w = problem.w
    n = w.size(-1)
    z = _probe(n, w.dtype, w.device)
    d2 = problem.d * problem.d
    deviation = w.mT @ (w @ z) - d2 * z  # (n,) = (W^T W - D^2) z
    scale = d2.norm().clamp_min(torch.finfo(w.dtype).tiny)
    if float(deviation.norm() / scale) <= GRAM_DRIFT_EPS * torch.finfo(w.dtype).eps:
        return None
    gram = w.mT @ w
    return 0.5 * (gram + gram.mT)


def _exact_pieces(problem: _DualProblem, lam: torch.Tensor, r: torch.Tensor, point: torch.Tensor):
    r""":math:`W^\top A` and :math:`A^\top A` for a point whose Gram matrix ``point`` is not
    :math:`D^2` (the reduced dual assumed it): :math:`W^\top X = W^\top G + 2W^\top W\Lambda`,
    :math:`X^\top X = G^\top G + 2(G^\top W\Lambda + \Lambda W^\top G) + 4\Lambda W^\top W\Lambda`."""
    wtx = torch.addmm(problem.wg, point, lam, alpha=2.0)  # (n, n) = W^T X
    cross = problem.wg.mT @ lam  # (n, n) = G^T W Lambda
    gtg = torch.addmm(problem.c, problem.b.mT, problem.b)  # G^T G (tall: C + B^T B)
    xtx = gtg + 2.0 * (cross + cross.mT) + 4.0 * (lam @ point @ lam)
    return wtx @ r, r.mT @ xtx @ r


def _rsqrt(t: torch.Tensor) -> torch.Tensor | None:
    """:math:`T^{-1/2}` by the Gram-form polar factor's kernels; ``None`` where neither applies
    or the result would need a refining pass."""
    found = products_only_rsqrt(0.5 * (t + t.mT))
    return found[0] if found is not None and found[1] <= GRAM_EIGH_ONE_PASS else None


def fused_retraction(problem: _DualProblem, state: _State, eta: float, beta: float = 1.0) -> torch.Tensor | None:
    r"""The retracted point :math:`R_{\beta W}(-\eta A)` of a solved reduced dual, tall ``(m, n)``.

    Args:
        problem: the solved dual (:attr:`~manifoldlib.optim.steepest.DualSolution.problem`) of a
            manifold whose :meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.gram_retraction_factor`
            is its default Muon retraction.
        state: its final evaluation (eigh path: eigenvalues, eigenvectors and gain).
        eta: step length (the adjusted learning rate).
        beta: decoupled weight-decay factor applied to ``W`` first (DGram).

    Returns:
        The new point in the tall orientation and the solve's work dtype, or ``None`` where the
        fused form does not apply (see the module docstring): take the plain step then.
    """
    if not (math.isfinite(eta) and eta >= 0) or not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"fused_retraction needs a finite eta >= 0 and beta > 0, got eta={eta!r}, beta={beta!r}")
    w = problem.w
    rows, cols = w.shape[-2:]
    if not problem.reduced or (state.vec is None and state.factor is None):
        return None
    if rows < FUSED_MIN_ASPECT * cols:
        return None
    r = state.spectral_factor()  # (n, n)
    point = _point_gram(problem)
    if point is None:  # W^T W = D^2: the solve's own pieces
        k = state.k if state.k is not None else state.m @ r  # (n, n) = Q^T A
        wta = problem.factor_transposed_times(k)  # W^T A
        if state.vec is not None:  # eigh path: A^T A = R S R = V diag(lambda psi^2) V^T
            ata = (state.vec * (state.eig * state.gain * state.gain)) @ state.vec.mT
        else:  # products path (R a polynomial in S, symmetric): A^T A = R S R
            ata = r @ problem.gram(state.lam) @ r
    else:
        wta, ata = _exact_pieces(problem, state.lam, r, point)
    gram = torch.add(wta, wta.mT).mul_(-beta * eta).add_(ata, alpha=eta * eta)  # (n, n) = Y^T Y
    if point is None:
        gram.diagonal().add_(problem.d * problem.d, alpha=beta * beta)
    else:
        gram.add_(point, alpha=beta * beta)
    phi = problem.manifold.gram_retraction_factor(gram, _rsqrt)  # the manifold's retraction, Gram form
    if phi is None or not bool(torch.isfinite(phi).all()):
        return None
    r_phi = r @ phi  # (n, n)
    w_factor = torch.addmm(phi, state.lam, r_phi, beta=beta, alpha=-2.0 * eta)  # beta Phi - 2 eta Lambda R Phi
    return torch.addmm(w @ w_factor, problem.g, r_phi, alpha=-eta)  # (m, n)
