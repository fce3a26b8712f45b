r"""Stiefel kernels, :math:`\mathrm{St}(m, n) = \{X \in \mathbb{R}^{m\times n}: X^\top X = I\}`, Euclidean metric.

Tangent space :math:`\{V: X^\top V + V^\top X = 0\}`, projection
:math:`P_X(Z) = Z - X\,\operatorname{sym}(X^\top Z)`. Retractions (:doc:`/theory/stiefel`):

- polar: :math:`\operatorname{msign}(X + V) = (X+V)(I + V^\top V)^{-1/2}`, second order;
- QR: :math:`\operatorname{qf}(X+V)` with columns multiplied by :math:`\operatorname{sign}(\operatorname{diag} R)`,
  first order (without the sign fix it is discontinuous and not a retraction);
- Cayley (low-rank form, :math:`O(mn^2)`), first order under the Euclidean metric;
- exponential (Edelman–Arias–Smith), exact geodesic.
"""

from __future__ import annotations

import math

import torch

from .msign import _orthonormal_polar
from .newton_schulz import newton_schulz

__all__ = [
    "sym",
    "stiefel_project_tangent",
    "stiefel_polar",
    "stiefel_qr",
    "stiefel_cayley",
    "stiefel_exp",
    "STIEFEL_EXP_MAX_STEP",
]


def _check_tall_pair(x: torch.Tensor, v: torch.Tensor, what: str) -> None:
    """``x`` must be ``(..., m, n)`` with ``m >= n`` and ``v`` of the same matrix shape."""
    if x.dim() < 2 or x.size(-2) < x.size(-1):
        raise ValueError(f"{what} needs points (..., m, n) with m >= n, got shape {tuple(x.shape)}")
    if v.shape[-2:] != x.shape[-2:]:
        raise ValueError(
            f"{what} needs v with the matrix shape {tuple(x.shape[-2:])} of x, got shape {tuple(v.shape)}"
        )


def _linalg_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


_EXPM_THETA = 0.25  # scale until ||A||_1 <= 1/4, where the degree-12 Taylor sum is exact
_EXPM_DEGREE = 12  # truncation (1/4)^13 / 13! ~ 2.4e-18, below float64 rounding


def _matrix_exp(a: torch.Tensor) -> torch.Tensor:
    r"""Matrix exponential by scaling and squaring of a Taylor polynomial, ``(..., k, k)``.

    ``torch.linalg.matrix_exp`` (through torch 2.14 at least) has a wrong coefficient in its
    degree-8 branch, which it selects for a *single* matrix of small norm: errors far above
    rounding in float64 and float32 (pytorch/pytorch#196592; the tests compare this version with
    ``scipy.linalg.expm``). Stiefel points from :func:`stiefel_exp` would leave the manifold by
    that much. This version uses only matrix
    products: :math:`e^A = (T_{12}(A/2^s))^{2^s}` with :math:`\|A/2^s\|_1 \le 1/4`.
    """
    norm = float(a.detach().abs().sum(-2).amax()) if a.numel() else 0.0  # max 1-norm in the batch
    if not math.isfinite(norm):
        return torch.linalg.matrix_exp(a)
    squarings = max(0, math.ceil(math.log2(norm / _EXPM_THETA))) if norm > _EXPM_THETA else 0
    x = a / (2.0**squarings)
    eye = torch.eye(a.size(-1), dtype=a.dtype, device=a.device).expand_as(a)
    result = eye
    for k in range(_EXPM_DEGREE, 0, -1):  # Horner: I + x (I + x/2 (I + x/3 (...)))
        result = eye + (x @ result) / k
    for _ in range(squarings):
        result = result @ result
    return result


def sym(a: torch.Tensor) -> torch.Tensor:
    r""":math:`(A + A^\top)/2` over the last two dimensions."""
    return 0.5 * (a + a.mT)


def stiefel_project_tangent(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    r""":math:`P_X(Z) = Z - X\operatorname{sym}(X^\top Z)`, shapes ``(..., m, n)``, in the promoted
    dtype of ``x`` and ``z`` (a float32 ``x`` with a float64 ``z`` was torch's matmul error)."""
    dtype = torch.promote_types(x.dtype, z.dtype)
    x, z = x.to(dtype), z.to(dtype)
    return z - x @ sym(x.mT @ z)


def stiefel_polar(x: torch.Tensor, v: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Polar retraction :math:`\operatorname{msign}(X + V)`.

    ``method="auto"`` takes the exact SVD when no gradient is needed and the convergent scaled
    Newton iteration, differentiated through its steps, when one is. Any
    :func:`~manifoldlib.functional.msign` method may be named instead; the polar ones carry the
    polar factor's own derivative, finite at :math:`V = 0` too, where every singular value is 1.

    Where :math:`X + V` is rank deficient (a step that cancels a column, :math:`V = -X`), its polar
    factor is not unique and :func:`~manifoldlib.functional.msign` maps the zero singular values
    to 0, which is no Stiefel point (:math:`V = -X` gave the zero matrix): ``"svd"``,
    ``"gram-eigh"`` and ``"newton-schulz"`` return :math:`UV^\top` of the SVD there, a nearest
    Stiefel point (:meth:`~manifoldlib.Stiefel.projx`'s), and ``"newton"`` (``"auto"`` under
    autograd) raises ``ValueError``.
    """
    _check_tall_pair(x, v, "stiefel_polar")
    y = x + v
    if method == "auto":
        method = "newton" if (torch.is_grad_enabled() and y.requires_grad) else "svd"
    return _orthonormal_polar(y, method)


def stiefel_qr(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""QR retraction: :math:`Q\,\operatorname{diag}(\operatorname{sign}\operatorname{diag} R)` for :math:`X + V = QR`,
    in the promoted dtype of ``x`` and ``v`` (as every retraction kernel here)."""
    _check_tall_pair(x, v, "stiefel_qr")
    y = x + v
    q, r = torch.linalg.qr(y.to(_linalg_dtype(y)))
    d = torch.diagonal(r, dim1=-2, dim2=-1)
    sign = torch.where(d >= 0, torch.ones_like(d), -torch.ones_like(d))
    return (q * sign.unsqueeze(-2)).to(y.dtype)


def stiefel_cayley(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""Cayley retraction in its low-rank form, from ``x`` with its rounding repaired.

    With :math:`P = I - \tfrac12 XX^\top`, :math:`U_1 = [PV, X]`, :math:`U_2 = [X, -PV]`:
    :math:`R = X + U_1 (I - \tfrac12 U_2^\top U_1)^{-1} U_2^\top X`, which equals
    :math:`(I - \tfrac12 W)^{-1}(I + \tfrac12 W)X` for :math:`W = PVX^\top - XV^\top P`.
    Cost :math:`O(mn^2)`: about :math:`10mn^2` multiply-adds in products and a
    :math:`2n \times 2n` solve. Returned in the promoted dtype of ``x`` and ``v``.

    The transform multiplies :math:`X` by an orthogonal matrix, so :math:`R^\top R = X^\top X`:
    a deviation of ``x`` from the manifold is kept, not repaired, and chained steps added up
    their rounding like a random walk (about :math:`\sqrt N` roundings after :math:`N` steps),
    towards the deviation beyond which :meth:`~manifoldlib.Stiefel.retr` refuses ``x``. ``x`` is therefore first
    re-orthonormalized by the cubic Newton–Schulz map :math:`X(3I - X^\top X)/2` of
    :func:`stiefel_exp` (:func:`_reorthonormalize`), which takes a deviation :math:`E` to about
    :math:`\tfrac34E^2`; :func:`_cayley_repair_steps` says how many steps. A step costs
    :math:`2mn^2 + n^3` multiply-adds, a fifth of the transform's products for :math:`m \gg n`.
    A chain is then off by the rounding of one step however long it runs
    (``test_chained_float32_stiefel_cayley_stays_at_rounding``), and the map of an exact point is
    unchanged to rounding. This repairs rounding and small deviations; it is no
    projection of an arbitrary ``x`` (the map of :math:`3X` is the map of :math:`X`), and
    :meth:`~manifoldlib.Stiefel.retr` refuses an ``x`` beyond the dtype's default tolerances.
    """
    _check_tall_pair(x, v, "stiefel_cayley")
    out_dtype = torch.promote_types(x.dtype, v.dtype)
    dtype = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    xx = _reorthonormalize(x.to(dtype), _cayley_repair_steps(out_dtype))  # (m, n): once per point
    # one batch for both (x (m, n) with v (..., m, n) is a step at each point): the blocks below
    # are concatenated, which does not broadcast
    xx, vv = torch.broadcast_tensors(xx, v.to(dtype))
    pv = vv - 0.5 * xx @ (xx.mT @ vv)  # (..., m, n)
    u1 = torch.cat([pv, xx], dim=-1)  # (..., m, 2n)
    u2 = torch.cat([xx, -pv], dim=-1)  # (..., m, 2n)
    n2 = u1.size(-1)
    eye = torch.eye(n2, dtype=dtype, device=x.device)
    inner = eye - 0.5 * (u2.mT @ u1)  # (..., 2n, 2n)
    # (I - W/2)^{-1}(I + W/2) X = X + (I - W/2)^{-1} W X with W = U1 U2^T, and by Woodbury
    # (I - U1 U2^T/2)^{-1} U1 = U1 (I - U2^T U1/2)^{-1}
    out = xx + u1 @ torch.linalg.solve(inner, u2.mT @ xx)
    return out.to(out_dtype)


def _cayley_repair_steps(dtype: torch.dtype) -> int:
    r"""Cubic steps with which :func:`stiefel_cayley` repairs ``x`` for a result in ``dtype``: one
    in float32, two otherwise.

    A step takes a deviation :math:`E` to about :math:`\tfrac34E^2`. The count is set by the
    largest deviation :meth:`~manifoldlib.Stiefel.retr` accepts, :math:`2\cdot10^{-5}` in float32
    and float64: one step leaves about :math:`3\cdot10^{-10}`, below float32's rounding but not
    float64's, which a second step reaches. float16 and bfloat16 points are repaired in float32
    from at most their tolerances (and :math:`\|X^\top X - I\|_\infty \le 1/4`,
    :data:`~manifoldlib.manifolds.stiefel.REPAIR_MAX_DEVIATION`): two steps bring them to about
    their own rounding (``test_stiefel_cayley_repairs_a_point_within_the_tolerance``).
    """
    return 1 if dtype == torch.float32 else 2


#: Longest step :math:`\|P_XV\|_F` :func:`stiefel_exp` takes (:math:`2^{43} \approx 8.8\cdot10^{12}`).
#: Up to it the float64 result is a Stiefel point to rounding and its position errs by about
#: :math:`\epsilon_{64}\|V\|`, the uncertainty of the step's own angle; beyond it the squarings'
#: rounding outgrows the re-orthonormalization, and near :math:`1/\epsilon_{64}` the angle itself
#: is not known to a radian (``tests/manifolds/test_stiefel_exp_long_steps.py``).
STIEFEL_EXP_MAX_STEP = 2.0**43

#: Steps of the cubic Newton–Schulz map :math:`Y \leftarrow Y(3I - Y^\top Y)/2` that re-orthonormalize
#: a point near the manifold: each roughly squares the deviation :math:`\|Y^\top Y - I\|`.
_REORTHONORMALIZE = ((1.5, -0.5, 0.0),)
_REORTHONORMALIZE_STEPS = 3


def _reorthonormalize(y: torch.Tensor, steps: int = _REORTHONORMALIZE_STEPS) -> torch.Tensor:
    r"""The polar factor of a ``y`` ``(..., m, n)`` near the manifold, by ``steps`` (default
    :data:`_REORTHONORMALIZE_STEPS`) steps of the cubic map on the shared
    :func:`~manifoldlib.functional.newton_schulz.newton_schulz` (normalized by
    :math:`\|Y\|_F/\sqrt n`, 1 for a Stiefel point). A polynomial, so its gradient is finite
    everywhere (an SVD's is not at the repeated singular values of a Stiefel point)."""
    return newton_schulz(y, _REORTHONORMALIZE, steps, normalize_scale=y.size(-1) ** -0.5,
                         dtype=y.dtype)


def stiefel_exp(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""Exponential map (Edelman–Arias–Smith) along :math:`P_X V`, Euclidean metric.

    :math:`A = X^\top V`, :math:`S = V^\top V`:
    :math:`[X\ V]\,\exp\!\begin{pmatrix} A & -S \\ I & A\end{pmatrix}\begin{pmatrix}I\\0\end{pmatrix}\exp(-A)`.

    Everything is computed in float64 whatever the input dtype, and the result is cast back to
    the promoted dtype of ``x`` and ``v``:

    1. ``x`` — a Stiefel point up to its dtype's rounding — is re-orthonormalized
       (:func:`_reorthonormalize`). The formula assumes :math:`X^\top X = I` exactly and
       amplifies a deviation with the step (a float16 point's rounding ended past the
       manifold's own check at long steps).
    2. ``v`` is projected onto the tangent space there (a normal part is dropped; the formula
       leaves the manifold for one). Projecting in the input dtype instead left a normal part of
       the input's rounding times the step.
    3. The block exponential is balanced by :math:`\operatorname{diag}(I, cI)`,
       :math:`c = \|V\|_F/\sqrt n` (at least 1), which leaves the result unchanged but keeps the
       block's entries of one size (:math:`S/c` and :math:`cI` instead of :math:`S` and :math:`I`),
       where the squarings lost accuracy like :math:`\epsilon\|V\|^2`.
    4. The result is re-orthonormalized: the rounding of the float64 exponential.

    The result then satisfies :math:`|Y^\top Y - I| \lesssim` the rounding of ``x``'s dtype for
    every step up to :data:`STIEFEL_EXP_MAX_STEP` (an exact Stiefel point rounded to that dtype),
    and is differentiable with finite gradients (matrix products only). A longer step raises
    ``ValueError``: float64 does not determine where so long a geodesic ends. The leading batch dimensions of ``x`` and ``v``
    broadcast. ``x`` must be a Stiefel point up to rounding: the correction of step 1 repairs
    rounding, not a matrix far from the manifold (from one, the geodesic starts elsewhere). This
    kernel does not check; :meth:`~manifoldlib.Stiefel.expmap` and ``retr`` refuse an ``x`` off
    the manifold beyond the dtype's default tolerances.
    """
    _check_tall_pair(x, v, "stiefel_exp")
    # float64 whatever the input: computed in float32, chained steps drift off the manifold
    # (tests/manifolds/test_drift.py)
    dtype = torch.float64
    # one batch for both (x (m, n) with v (..., m, n) is a step at each point): the blocks below
    # are concatenated, which does not broadcast
    xx, vv = torch.broadcast_tensors(x.to(dtype), v.to(dtype))
    xx = _reorthonormalize(xx)
    vv = stiefel_project_tangent(xx, vv)
    step = float(vv.detach().norm(dim=(-2, -1)).amax()) if vv.numel() else 0.0  # a sync, as _matrix_exp's
    if math.isfinite(step) and step > STIEFEL_EXP_MAX_STEP:  # (a non-finite v is the caller's to name)
        raise ValueError(
            f"stiefel_exp: a step of norm ||P_X V||_F = {step:.3g} exceeds STIEFEL_EXP_MAX_STEP = "
            f"{STIEFEL_EXP_MAX_STEP:.3g}: float64 cannot follow a geodesic that long (its angle is known "
            f"only to about {step * torch.finfo(torch.float64).eps:.2g} rad); shorten the step or use a "
            f"projection retraction ('polar', 'qr'), which takes any length"
        )
    n = x.size(-1)
    # the balancing constant: a similarity, so no gradient flows through it
    c = (vv.detach().norm(dim=(-2, -1), keepdim=True) / math.sqrt(n)).clamp_min(1.0)  # (..., 1, 1)
    a = xx.mT @ vv  # (..., n, n)
    s = vv.mT @ vv  # (..., n, n)
    eye = torch.eye(n, dtype=dtype, device=x.device).expand_as(a)
    block = torch.cat([torch.cat([a, -s / c], dim=-1), torch.cat([eye * c, a], dim=-1)], dim=-2)  # (..., 2n, 2n)
    e = _matrix_exp(block)[..., :, :n]  # (..., 2n, n)
    out = torch.cat([xx, vv / c], dim=-1) @ e @ _matrix_exp(-a)  # (..., m, n)
    return _reorthonormalize(out).to(torch.promote_types(x.dtype, v.dtype))
