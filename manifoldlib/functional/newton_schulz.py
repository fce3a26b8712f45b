r"""Newton–Schulz iterations toward :math:`\operatorname{msign}`: the one place they are written.

A Newton–Schulz step maps every singular value :math:`y` of a (normalized) matrix by the odd
quintic :math:`y \mapsto y(a + by^2 + cy^4)`. A *preset* is a schedule of :math:`(a, b, c)` triples
(the last one repeats), a fixed step count and the first normalization,
:math:`X/\max(s\|X\|_F, \epsilon)` (the clamp of :class:`torch.optim.Muon`). The table :data:`NEWTON_SCHULZ_PRESETS` is the single source:

* ``"jordan5"``: Muon's quintic :math:`(3.4445, -4.7750, 2.0315)`, five steps (K. Jordan). Fast
  and *not* convergent: singular values end in roughly ``[0.7, 1.2]``; an update direction, not
  a retraction.
* ``"polar-express"``: the Polar Express schedule (Amsel et al., 2025), eight steps, much closer
  to exact for the same kind of cost; the first normalization is by :math:`1.01\|X\|_F`.
* ``"newton-schulz"``: the convergent quintic :math:`(15/8, -10/8, 3/8)`, thirty steps (from a
  Frobenius-normalized start it resolves singular values down to about 1e-2 of the largest).

Three evaluators share the table, each batched over leading dimensions:

* :func:`newton_schulz` — the iteration on the matrix itself, in its wide orientation, operation
  for operation as :class:`torch.optim.Muon` runs it (``addmm``/``baddbmm``);
* :func:`gram_newton_schulz` — the same map from the ``n × n`` Gram matrix :math:`S = X^\top X`
  alone: :math:`R` with :math:`\operatorname{msign}(X) \approx XR`. Every iterate is a polynomial
  in :math:`S`, so with :math:`R_0 = I/\max(s\|X\|_F, \epsilon)` and :math:`T_k = R_kSR_k`,

  .. math:: P_k = aI + bT_k + cT_k^2,\qquad R_{k+1} = R_kP_k,\qquad T_{k+1} = P_kT_kP_k,

  four ``n × n`` products a step (two in the last, one fewer in the first). For a tall
  ``m × n`` matrix this replaces two ``m·n²`` products a step by two ``n³`` ones;
* :func:`newton_schulz_gain` — the scalar map on the eigenvalues :math:`\lambda = \sigma^2` of
  :math:`S`: :math:`\psi(\lambda)` with :math:`XR = XV\operatorname{diag}(\psi)V^\top` the same
  iteration, for solvers that hold an eigendecomposition of :math:`S`.

None of them reads a value back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._numbers import is_integer, is_real, require_positive
from .scaling import into_safe_range

__all__ = [
    "CONVERGENT_QUINTIC",
    "JORDAN5_COEFFICIENTS",
    "MUON_COEFFICIENTS",
    "NEWTON_SCHULZ_PRESETS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "NewtonSchulzPreset",
    "gram_newton_schulz",
    "newton_schulz",
    "newton_schulz_gain",
    "resolve_schedule",
]

#: Muon's quintic :math:`(a, b, c)` (K. Jordan), the default of :class:`torch.optim.Muon`.
MUON_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
#: The same triple under the name of its preset.
JORDAN5_COEFFICIENTS = MUON_COEFFICIENTS
#: The convergent quintic: fixed point 1 with zero first and second derivative.
CONVERGENT_QUINTIC: tuple[float, float, float] = (15.0 / 8.0, -10.0 / 8.0, 3.0 / 8.0)

_PE_SAFETY = 1.01
_PE_RAW: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
)
#: Polar Express per-step coefficients: every triple but the final (1.875, -1.25, 0.375) divided
#: by (1.01, 1.01³, 1.01⁵) for safety against rounding.
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = tuple(
    (a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) for a, b, c in _PE_RAW
) + ((1.875, -1.25, 0.375),)


@dataclass(frozen=True)
class NewtonSchulzPreset:
    """A fixed-count Newton–Schulz map, step by step.

    Attributes:
        schedule: the ``(a, b, c)`` triples of the steps (the last one repeats).
        steps: the preset's step count (used when a caller gives none).
        scale: the first normalization divides by ``scale · ||X||_F + eps``.
    """

    schedule: tuple[tuple[float, float, float], ...]
    steps: int
    scale: float = 1.0


#: The presets: the single table every evaluator reads.
NEWTON_SCHULZ_PRESETS: dict[str, NewtonSchulzPreset] = {
    "jordan5": NewtonSchulzPreset((MUON_COEFFICIENTS,), 5),
    "polar-express": NewtonSchulzPreset(POLAR_EXPRESS_COEFFICIENTS, 8, _PE_SAFETY),
    "newton-schulz": NewtonSchulzPreset((CONVERGENT_QUINTIC,), 30),
}


def resolve_schedule(
    preset: str | None = None,
    steps: int | None = None,
    coefficients: Sequence[float] | Sequence[Sequence[float]] | None = None,
) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """``(per-step triples, first scale)`` of a preset, or of custom ``coefficients``.

    Args:
        preset: a name of :data:`NEWTON_SCHULZ_PRESETS` (``None`` with ``coefficients``).
        steps: the step count (``None``: the preset's).
        coefficients: one ``(a, b, c)`` or a schedule of triples; replaces the preset's schedule
            and its safety scale.

    Raises:
        ValueError: an unknown preset, a malformed schedule (or one of values that are not finite
            numbers) or a step count that is not an int ``>= 0``.
    """
    if coefficients is None:
        if preset not in NEWTON_SCHULZ_PRESETS:
            raise ValueError(f"unknown Newton-Schulz preset {preset!r}; valid: {', '.join(NEWTON_SCHULZ_PRESETS)}")
        chosen = NEWTON_SCHULZ_PRESETS[preset]
        schedule, scale = chosen.schedule, chosen.scale
        steps = chosen.steps if steps is None else steps
    else:
        if len(coefficients) == 0:
            raise ValueError(f"coefficients must be one (a, b, c) triple or a sequence of triples, got {coefficients!r}")
        # one triple unless the entries are sequences themselves (a string is a bad number, not a triple)
        single = not isinstance(coefficients[0], (tuple, list))
        schedule = (tuple(coefficients),) if single else tuple(
            tuple(c) if isinstance(c, (tuple, list)) else (c,) for c in coefficients)
        if any(len(t) != 3 for t in schedule):
            raise ValueError(f"coefficients must be one (a, b, c) triple or a sequence of triples, got {coefficients!r}")
        if not all(is_real(v) and math.isfinite(v) for t in schedule for v in t):
            # float() parsed '3.4445' and took True as 1.0; a NaN or inf gave NaN matrices
            raise ValueError(f"coefficients must be finite numbers, got {coefficients!r}")
        scale = 1.0
        if steps is None:
            steps = NEWTON_SCHULZ_PRESETS[preset].steps if preset in NEWTON_SCHULZ_PRESETS else len(schedule)
    if not (is_integer(steps) and steps >= 0):  # (True ran one step)
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    triples = tuple(tuple(float(v) for v in schedule[min(k, len(schedule) - 1)]) for k in range(int(steps)))
    return triples, scale


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float = 1.0) -> torch.Tensor:
    """``beta * bias + alpha * a @ b``, one fused product for a matrix or a batch of them (any
    number of batch dimensions: ``baddbmm`` takes one, so more are flattened into it)."""
    if a.dim() == 2:
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha)
    if a.dim() == 3:
        return torch.baddbmm(bias, a, b, beta=beta, alpha=alpha)
    batch = torch.broadcast_shapes(bias.shape[:-2], a.shape[:-2], b.shape[:-2])
    rows, cols = a.size(-2), b.size(-1)

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:])

    out = torch.baddbmm(flat(bias.expand(*bias.shape[:-2], rows, cols)), flat(a), flat(b), beta=beta, alpha=alpha)
    return out.view(*batch, rows, cols)


def newton_schulz(
    x: torch.Tensor,
    coefficients: Sequence[float] | Sequence[Sequence[float]],
    steps: int,
    *,
    eps: float = 1e-7,
    normalize_scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""Fixed-count Newton–Schulz on the wide orientation: :math:`X \leftarrow aX + (bXX^\top + c(XX^\top)^2)X`.

    The same operations as :class:`torch.optim.Muon`'s iteration (normalize by
    ``normalize_scale · ||X||_F`` clamped at ``eps``, then per step one product for the Gram
    matrix and two ``addmm``), for a matrix or a batch; with ``dtype=torch.bfloat16``,
    ``MUON_COEFFICIENTS`` and five steps it is Muon's, to rounding. A matrix whose largest entry
    exceeds :math:`2^{32}` is first scaled down by a power of two
    (:func:`~manifoldlib.functional.scaling.into_safe_range`: exact, and the normalization
    removes it), so that its norm does not overflow (a bfloat16 matrix too: its squares
    overflow float32 from a norm of about :math:`1.8\cdot 10^{19}`, and Muon's own step then
    returns a direction of about zero).

    Args:
        x: ``(..., m, n)``, tall or wide.
        coefficients: one ``(a, b, c)`` or a schedule of triples (the last repeats).
        steps: iterations (``>= 0``).
        eps: floor of the normalizing norm.
        normalize_scale: the Frobenius norm is multiplied by this first (Polar Express: 1.01).
        dtype: the dtype to iterate and return in (default: ``x``'s, float32 for 16-bit input).

    Returns:
        ``(..., m, n)`` approximation of :math:`\operatorname{msign}(X)`, in ``dtype``.

    Raises:
        ValueError: a non-matrix input, a step count that is not an int ``>= 0``, a malformed
            schedule, an ``eps`` or ``normalize_scale`` that is not a finite number ``> 0``, or a
            ``dtype`` that is not a real floating-point dtype.
    """
    if x.dim() < 2:
        raise ValueError(f"newton_schulz expects a matrix or a batch of matrices (..., m, n), got shape {tuple(x.shape)}")
    triples, _ = resolve_schedule(None, steps, coefficients)
    require_positive("eps", eps)  # a NaN floor gave NaN matrices, 0 NaN for a zero matrix
    require_positive("normalize_scale", normalize_scale)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a real floating-point dtype, got {dtype!r}")
    work = dtype if dtype is not None else (torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
    x = into_safe_range(x, up=False)  # entries whose squares would overflow: scaled down exactly
    y = x.to(work)
    transposed = y.size(-2) > y.size(-1)
    if transposed:
        y = y.mT
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)  # (..., 1, 1)
    if normalize_scale != 1.0:
        norm = norm * normalize_scale
    y = y / norm.clamp(min=eps)
    for a, b, c in triples:
        gram = y @ y.mT  # (..., k, k), k = min(m, n)
        poly = _addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        y = _addmm(y, poly, y, beta=a)  # a Y + (b G + c G^2) Y
    return y.mT if transposed else y


def gram_newton_schulz(
    s: torch.Tensor,
    preset: str | None = "jordan5",
    steps: int | None = None,
    *,
    coefficients=None,
    eps: float = 1e-7,
) -> torch.Tensor:
    r"""``R`` with :math:`\operatorname{msign}(X) \approx XR`, from :math:`S = X^\top X` alone.

    Runs the preset (or custom ``coefficients``) in Gram form (see the module docstring): equal
    to :func:`newton_schulz` applied to ``X`` in exact arithmetic, at ``O(n³)`` per step.

    Args:
        s: ``(..., n, n)`` symmetric positive semi-definite; each matrix of a batch is normalized
            by its own :math:`\|X\|_F = \operatorname{tr}(S)^{1/2}`. Nothing is checked (no
            host read): a matrix whose trace overflows its dtype gives :math:`R = 0`, one with
            NaN entries NaN; scale such an ``X`` into range by a power of two first and form
            ``S`` from that (:func:`~manifoldlib.functional.scaling.into_safe_range`).
        preset: a name of :data:`NEWTON_SCHULZ_PRESETS`.
        steps: the step count (``None``: the preset's).
        coefficients: custom ``(a, b, c)`` or schedule (replaces the preset's schedule and scale).
        eps: floor of the normalizing norm.

    Returns:
        ``(..., n, n)`` symmetric factor ``R``.

    Raises:
        ValueError: as :func:`resolve_schedule`, or an ``eps`` that is not a finite number ``> 0``.
    """
    triples, scale = resolve_schedule(preset, steps, coefficients)
    require_positive("eps", eps)
    return _gram_newton_schulz(s, triples, scale, eps)


def _gram_newton_schulz(s: torch.Tensor, triples: Sequence[tuple[float, float, float]], scale: float,
                        eps: float) -> torch.Tensor:
    """:func:`gram_newton_schulz` on a schedule :func:`resolve_schedule` gave and a checked ``eps``
    (a caller that evaluates one schedule many times resolves it once)."""
    # ||X||_F = sqrt(tr S), the trace taken at least at the dtype's smallest normal number: the same
    # R wherever the floor eps is above scale sqrt(tiny) (it takes over first), and a finite
    # gradient at S = 0, where the square root's derivative is infinite (times the floor's 0: NaN)
    trace = torch.diagonal(s, dim1=-2, dim2=-1).sum(-1)  # (...,)
    fro = trace.clamp_min(torch.finfo(trace.dtype).tiny).sqrt()  # (...,)
    r0 = (scale * fro).clamp_min(eps).reciprocal()[..., None, None]  # (..., 1, 1)
    eye = torch.eye(s.size(-1), dtype=s.dtype, device=s.device)
    if not triples:
        return eye * r0
    t = s * (r0 * r0)  # T_0 = R_0 S R_0
    r = None
    for k, (a, b, c) in enumerate(triples):
        p = _addmm(t, t, t, beta=b, alpha=c)  # b T + c T^2
        p.diagonal(dim1=-2, dim2=-1).add_(a)  # P = a I + b T + c T^2
        r = p * r0 if r is None else r @ p  # R_{k+1} = R_k P_k
        if k + 1 < len(triples):
            t = p @ t @ p  # T_{k+1} = P T P
    return r


def newton_schulz_gain(
    lam: torch.Tensor,
    preset: str | None = "jordan5",
    steps: int | None = None,
    *,
    coefficients=None,
    eps: float = 1e-7,
) -> torch.Tensor:
    r"""The gain :math:`\psi(\lambda) = \phi(\sigma)/\sigma` of a preset on the eigenvalues :math:`\lambda = \sigma^2` of :math:`S`.

    The preset maps a singular value by :math:`y_0 = \sigma/\max(s\|X\|_F, \epsilon)`,
    :math:`y_{k+1} = y_k(a + by_k^2 + cy_k^4)`; the gain is the product of the step factors times
    the first scaling, so nothing is divided by :math:`\sigma` (finite at :math:`\sigma = 0`).

    Args:
        lam: ``(..., n)`` eigenvalues of :math:`S` (clamped at 0 by the caller); each row of a
            batch is one matrix, normalized by its own :math:`\|X\|_F = (\sum_i\lambda_i)^{1/2}`.

    Returns:
        ``(..., n)`` gains.

    Raises:
        ValueError: as :func:`gram_newton_schulz`.
    """
    triples, scale = resolve_schedule(preset, steps, coefficients)
    require_positive("eps", eps)
    return _newton_schulz_gain(lam, triples, scale, eps)


def _newton_schulz_gain(lam: torch.Tensor, triples: Sequence[tuple[float, float, float]], scale: float,
                        eps: float) -> torch.Tensor:
    """:func:`newton_schulz_gain` on a resolved schedule and a checked ``eps`` (as
    :func:`_gram_newton_schulz`)."""
    total = lam.sum(-1, keepdim=True)  # (..., 1) tr S, floored as in _gram_newton_schulz
    s0 = (scale * total.clamp_min(torch.finfo(total.dtype).tiny).sqrt()).clamp_min(eps).reciprocal()  # (..., 1)
    gain = s0.expand_as(lam).clone()
    t = lam * (s0 * s0)  # y_k^2
    for a, b, c in triples:
        factor = a + t * (b + c * t)
        gain = gain * factor
        t = t * factor * factor
    return gain
