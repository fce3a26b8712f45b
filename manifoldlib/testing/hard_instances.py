r"""Fixed-seed hard instances of the steepest-direction dual, shared by tests and benchmarks.

A *hard* instance is a tall point :math:`W` with a low-rank-plus-noise gradient
:math:`G = UV^\top + \nu N` (``U`` ``(m, r)``, ``V`` ``(n, r)``, ``N`` all standard normal): the
dual optimum :math:`\min_\Lambda \|G + 2W\Lambda\|_*` is then close to rank deficient, where a plain
dual ascent stalls and a smoothed dual loses a visible part of the objective unless its smoothing
is driven down. :func:`nuclear_dual_optimum` gives the optimum independently (scipy L-BFGS on the
unreduced dual, SVD of the ``m × n`` matrix every evaluation), to compare
:func:`~manifoldlib.optim.steepest_direction` against.

A *nearly normal* instance (:func:`nearly_normal_instance`) is a gradient almost entirely in the
normal space, :math:`G = WS + \tau\|WS\|_F\,T` with :math:`T` a unit tangent vector: the
tangent part the direction must follow is about a fraction :math:`\tau` of :math:`G`, so a solver that
assumes :math:`W` exactly on its manifold, or reports the residual of a reduced problem rather
than of the returned direction, is off by orders of magnitude (rounding :math:`W` to float32 is
enough).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..manifolds import get_manifold

__all__ = ["HARD_INSTANCES", "hard_instance", "nearly_normal_instance", "nuclear_dual_optimum"]

#: ``(manifold, m, n, rank, noise)`` of the shared hard instances (tall, low-rank gradients).
HARD_INSTANCES = (
    ("stiefel", 128, 32, 4, 0.1),
    ("dgram", 128, 32, 4, 0.1),
    ("stiefel", 64, 16, 2, 0.05),
    ("dgram", 64, 16, 2, 0.05),
    ("oblique", 128, 32, 4, 0.1),
    ("oblique", 64, 16, 2, 0.05),
)


def hard_instance(
    manifold: str, m: int, n: int, rank: int, noise: float, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(W, G)``, both ``(m, n)``: a point and a rank-``rank``-plus-``noise`` gradient.

    ``W`` is the Q factor of a Gaussian matrix (Stiefel), with columns scaled by
    :math:`e^{z_j/2}`, :math:`z_j \sim N(0, 1)`, on DGram, and a Gaussian matrix with normalized
    columns on Oblique; :math:`G = UV^\top + \nu N`. Generated in
    float64 from ``seed`` (reproducible across machines), then cast to ``dtype``.

    Raises:
        ValueError: a manifold other than ``"stiefel"``/``"dgram"``/``"oblique"``, a wide shape,
            a rank outside ``1..n``, sizes or a seed that are not ints, a ``noise`` that is not a
            finite number ``>= 0`` (NaN gave a NaN gradient), or a ``dtype`` that is not floating.
    """
    _check_common(m, n, seed, dtype)
    if isinstance(noise, bool) or not isinstance(noise, numbers.Real) or not 0 <= noise < math.inf:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    gen = torch.Generator().manual_seed(seed)
    w = _point(manifold, m, n, gen)  # checks the manifold and the shape first
    if not _is_int(rank) or not 1 <= rank <= n:
        raise ValueError(f"rank must be an int in 1..{n}, got {rank!r}")
    f64 = torch.float64
    g = torch.randn(m, rank, generator=gen, dtype=f64) @ torch.randn(rank, n, generator=gen, dtype=f64)
    g = g + noise * torch.randn(m, n, generator=gen, dtype=f64)
    return w.to(dtype), g.to(dtype)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_common(m, n, seed, dtype) -> None:
    """The arguments both instance builders share: int sizes and seed, a floating dtype (an int
    dtype truncated the point and the gradient to integers)."""
    for name, value in (("m", m), ("n", n), ("seed", seed)):
        if not _is_int(value):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")


def _point(manifold: str, m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """A float64 tall point of ``manifold`` (see :func:`hard_instance`), drawn from ``gen``."""
    if manifold not in ("stiefel", "dgram", "oblique"):
        raise ValueError(f"manifold must be 'stiefel', 'dgram' or 'oblique', got {manifold!r}")
    if not m >= n >= 1:
        raise ValueError(f"need a tall shape m >= n >= 1, got ({m}, {n})")
    w = torch.randn(m, n, generator=gen, dtype=torch.float64)
    w = w / w.norm(dim=0) if manifold == "oblique" else torch.linalg.qr(w)[0]
    if manifold == "dgram":
        w = w * torch.exp(0.5 * torch.randn(n, generator=gen, dtype=torch.float64))
    return w


def nearly_normal_instance(
    manifold: str, m: int, n: int, tangent: float, seed: int, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(W, G)``, both ``(m, n)``: a point and a gradient whose tangent part is ``tangent``
    times its normal part (in Frobenius norm).

    ``W`` as in :func:`hard_instance`; :math:`G = WS + \tau\|WS\|_F\,T/\|T\|_F` with :math:`S` a
    Gaussian multiplier of the manifold (symmetric on Stiefel, zero diagonal on DGram, diagonal on
    Oblique: :math:`WS` is normal) and :math:`T` the tangent projection of a Gaussian matrix.
    Generated in float64 from ``seed``, then cast to ``dtype``.

    Raises:
        ValueError: as :func:`hard_instance`, or ``tangent`` not a number in ``(0, 1]``.
    """
    _check_common(m, n, seed, dtype)
    if isinstance(tangent, bool) or not isinstance(tangent, numbers.Real) or not 0.0 < tangent <= 1.0:
        raise ValueError(f"tangent must be a number in (0, 1], got {tangent!r}")
    gen = torch.Generator().manual_seed(seed)
    w = _point(manifold, m, n, gen)
    space = get_manifold(manifold)  # the manifold's own normal and tangent spaces
    s = torch.randn(n, n, generator=gen, dtype=torch.float64)
    normal = w @ space.multiplier_mask(s + s.mT)
    t = space.proju(w, torch.randn(m, n, generator=gen, dtype=torch.float64))
    g = normal + tangent * normal.norm() * t / t.norm()
    return w.to(dtype), g.to(dtype)


def nuclear_dual_optimum(w: torch.Tensor, g: torch.Tensor, zero_diagonal: bool, *, diagonal: bool = False) -> float:
    r""":math:`\min_S \|G + WS\|_*` over symmetric ``S`` (zero diagonal if asked; ``diagonal``:
    diagonal ``S`` only), by scipy L-BFGS.

    Equals :math:`\max\langle G, A\rangle` over :math:`\|A\|_2 \le 1`, :math:`A \in T_W` (Stiefel:
    symmetric ``S``; DGram: zero diagonal; Oblique: diagonal) by strong duality. Independent of the library's
    solvers: the SVD of the full ``m × n`` matrix each evaluation, started at the projected
    gradient. Needs ``scipy`` (a test dependency). The value is an upper bound on the optimum
    (any ``S`` gives one); on an *exactly* low-rank gradient L-BFGS can stop well above it.
    """
    import numpy as np
    import scipy.optimize

    wn, gn = w.double().cpu().numpy(), g.double().cpu().numpy()
    n = wn.shape[1]
    if diagonal and zero_diagonal:
        raise ValueError("diagonal and zero_diagonal exclude each other (S would be 0)")
    iu = np.diag_indices(n) if diagonal else np.triu_indices(n, k=1 if zero_diagonal else 0)

    def unpack(z):
        s = np.zeros((n, n))
        s[iu] = z
        return s + np.triu(s, 1).T  # (diagonal S: the strict upper triangle is empty)

    def fun(z):
        u, sig, vt = np.linalg.svd(gn + wn @ unpack(z), full_matrices=False)
        sym = wn.T @ (u @ vt)
        sym = sym + sym.T
        if not zero_diagonal:
            sym[np.diag_indices(n)] /= 2.0
        return sig.sum(), sym[iu]

    wg = wn.T @ gn
    d2 = (wn * wn).sum(0)
    s0 = -(wg + wg.T) / (d2[:, None] + d2[None, :])
    options = {"maxiter": 5000, "gtol": 1e-12, "ftol": 1e-15}
    return float(scipy.optimize.minimize(fun, s0[iu], jac=True, method="L-BFGS-B", options=options).fun)
