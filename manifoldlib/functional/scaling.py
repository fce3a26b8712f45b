r"""Exact rescaling by powers of two, for scale-invariant maps at the edges of the float range.

:math:`\operatorname{msign}(sX) = \operatorname{msign}(X)` and :math:`sX/\|sX\| = X/\|X\|` for
:math:`s > 0`, but the Gram matrices and Frobenius norms that compute them square the scale of
:math:`X`: float32 entries above about :math:`10^{19}` overflow them to inf, entries below about
:math:`10^{-19}` underflow them to 0. :func:`into_safe_range` multiplies each matrix whose largest
entry lies outside :math:`[2^{-32}, 2^{32}]` (:data:`SAFE_EXPONENT`) by the power of two that
brings that entry into :math:`[1/2, 1)`. A power of two changes only the exponent, so the scaling
is exact and every result computed from the scaled matrix is, bit for bit, the scaled result
wherever nothing over- or underflowed; matrices inside the range are returned as they are.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SAFE_EXPONENT", "into_safe_range", "out_of_range_scale"]

#: Matrices whose largest entry lies outside ``[2^-SAFE_EXPONENT, 2^SAFE_EXPONENT]`` are rescaled.
SAFE_EXPONENT = 32


def _power_of_two(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2^exponent`` in ``dtype``, built from its bits: exact for normal exponents, where
    ``torch.pow`` need not be (a 16-bit power of two is the float32 one, rounded exactly)."""
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32).to(dtype)


def _power_of_two_scale(top: torch.Tensor) -> torch.Tensor:
    r""":math:`2^{-e}` with :math:`\text{top} \cdot 2^{-e} \in [0.5, 1)` (``frexp``), ``top``'s shape and dtype.

    Multiplying by it is exact. ``1`` where ``top`` is zero or not finite; the exponent is clamped
    so that the scale itself stays finite (a subnormal ``top`` is brought up to the normal range,
    not to ``inf``).
    """
    exponent = torch.frexp(top)[1]
    max_exponent = int(math.log2(torch.finfo(top.dtype).max)) + 1  # 128 for float32, 1024 for float64
    exponent = exponent.clamp_min(2 - max_exponent)
    return torch.ldexp(torch.ones_like(top), -exponent)


def out_of_range_scale(x: torch.Tensor, limit: int) -> torch.Tensor:
    r"""``(..., 1, 1)`` per matrix of ``x`` ``(..., m, n)``: the power of two :math:`u = 2^{-e}` that
    brings its largest entry into :math:`[1/2, 1)` where that entry lies outside
    :math:`[2^{-\text{limit}-1}, 2^{\text{limit}})` (its ``frexp`` exponent outside
    :math:`[-\text{limit}, \text{limit}]`), else 1 (also for a zero or non-finite matrix), in
    ``x``'s dtype; no host synchronization.

    For a map with :math:`f(sX) = sf(X)` (:math:`s > 0`), :math:`f(X) = f(uX)/u`, computed from a
    matrix whose Gram products neither over- nor underflow; exact wherever nothing does (a power
    of two changes exponents only), and bit for bit :math:`f(X)` for matrices in range.
    """
    exponent = _rescaling_exponent(x, limit)
    max_exponent = int(math.log2(torch.finfo(x.dtype).max)) + 1  # the scale itself stays finite
    return torch.ldexp(torch.ones_like(exponent, dtype=x.dtype), -exponent.clamp_min(2 - max_exponent))


def _rescaling_exponent(x: torch.Tensor, limit: int, up: bool = True) -> torch.Tensor:
    """``(..., 1, 1)`` the ``frexp`` exponent of each matrix's largest entry where it lies outside
    ``[-limit, limit]`` (below only with ``up``), else 0 (also for a zero or non-finite matrix)."""
    x = x.detach()  # the largest |entry| from two reductions, without forming |x| (NaN propagates)
    top = torch.maximum(x.amax(dim=(-2, -1), keepdim=True), -x.amin(dim=(-2, -1), keepdim=True))  # (..., 1, 1)
    exponent = torch.frexp(top)[1]  # top = mantissa * 2^exponent, mantissa in [0.5, 1)
    outside = (exponent > limit) | ((exponent < -limit) & (top > 0) & up)
    return torch.where(outside & torch.isfinite(top), exponent, 0)


def into_safe_range(x: torch.Tensor, *, up: bool = True) -> torch.Tensor:
    """``x`` with each matrix whose largest entry is outside the safe range scaled by the power of
    two that brings that entry into ``[0.5, 1)``.

    Args:
        x: ``(..., m, n)`` floating point; zero matrices and non-finite entries are left alone.
            bfloat16 has float32's exponent range and is scaled alike; float16 (largest finite
            65504) never lies outside the range.
        up: also scale small matrices up; ``False`` only scales large ones down (a fixed-count
            Newton–Schulz, like :class:`torch.optim.Muon`'s, keeps its ``eps`` floor for tiny
            inputs).

    Returns:
        A tensor of ``x``'s shape and dtype, equal to ``x`` bit for bit where every matrix is in
        range. No host synchronization (the scale is chosen per matrix on the device).

    Raises:
        ValueError: ``x`` is not a floating-point tensor.
    """
    if not x.dtype.is_floating_point:
        raise ValueError(f"into_safe_range takes floating-point matrices, got {x.dtype}")
    if not x.numel():
        return x
    exponent = _rescaling_exponent(x, SAFE_EXPONENT, up)
    half = torch.div(exponent, 2, rounding_mode="floor")  # two factors: 2^exponent may not be normal
    return x * _power_of_two(-half, x.dtype) * _power_of_two(half - exponent, x.dtype)
