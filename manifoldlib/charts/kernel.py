r"""The SEL forward rule as one autograd function with a hand-written backward.

With rank-1 positive scales :math:`a = a_r a_c^\top`, :math:`b = b_r b_c^\top`,
:math:`c = c_r c_c^\top` (rows ``(out, 1)``, columns ``(1, in)``), :math:`t = |w|`, :math:`s = \pm1`
the sign of :math:`w` (:math:`+1` at 0) and :math:`e = \operatorname{expm1}(\min(bt, M))`:

.. math::
    W = s\,a\,e + c\,t.

For an upstream gradient :math:`G`, with :math:`k = [bt < M]` (the overflow clamp) and
:math:`Q = G\,(e + 1)\,k`:

.. math::
    \frac{\partial L}{\partial w} = Q\,ab + s\,G\,c, \quad
    \frac{\partial L}{\partial a} = s\,G\,e, \quad
    \frac{\partial L}{\partial b} = Q\,a\,w, \quad
    \frac{\partial L}{\partial c} = G\,t,

using :math:`s\,t = w`. The gradient of a rank-1 factor is a matrix–vector product, e.g.
:math:`\partial L/\partial a_r = (sGe)\,a_c^\top`. Autograd of the plain expression needs about
twice the memory passes (every broadcast product and its reduction is a separate kernel); these are
memory-bound elementwise passes, so the pass count is the cost.

``impl="fused"`` runs, per device:

- **CPU** (contiguous float32/float64 raw coordinates, outside ``torch.compile`` tracing, the C++
  kernels built and not switched off): :mod:`manifoldlib._cpu_kernels` — one pass over ``raw``
  for :math:`W` and one over ``raw`` and :math:`G` for :math:`\partial L/\partial w` together with
  the six row and column reductions of the factor gradients (``sel_chart.cpp``; :math:`e` is
  recomputed in the backward instead of stored);
- **CUDA**: the plain expression through :func:`torch.compile` (inductor fuses each pass into one
  generated kernel);
- elsewhere, and as the fallback (no compiler, a non-contiguous or 16-bit weight, inside
  :func:`manifoldlib._cpu_kernels.disabled`): the ATen autograd function below. All give the
  same values and gradients up to rounding (tested against the plain expression in float64).

The sign convention is :math:`s = +1` for :math:`w \ge 0`, ``-0.0`` included.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .. import _cpu_kernels

__all__ = ["SEL_IMPLS", "sel_forward_rule"]

#: ``fused``: the C++ kernels on CPU, the compiled expression on CUDA, the autograd function below
#: elsewhere (module docstring); ``autograd``: the plain expression (reference); ``compile``: the
#: plain expression through :func:`torch.compile` (one fused loop per pass, compiled on first use,
#: dynamic in the shape).
SEL_IMPLS = ("fused", "autograd", "compile")
_compiled = None


class _SELForwardRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw, a_r, a_c, b_r, b_c, c_r, c_c, max_exponent: float):
        t = raw.abs()  # (out, in)
        e = t * b_r
        e.mul_(b_c).clamp_(max=max_exponent).expm1_()  # (out, in)
        weight = e * a_r
        weight.mul_(a_c).copysign_(raw)
        if c_r is not None:
            weight.addcmul_(t.mul_(c_r), c_c)
        ctx.max_exponent = max_exponent
        ctx.save_for_backward(raw, e, a_r, a_c, b_r, b_c, c_r, c_c)
        return weight

    @staticmethod
    @once_differentiable  # second derivatives are not implemented: raise instead of being wrong
    def backward(ctx, grad):
        raw, e, a_r, a_c, b_r, b_c, c_r, c_c = ctx.saved_tensors
        need = ctx.needs_input_grad
        g_raw = g_ar = g_ac = g_br = g_bc = g_cr = g_cc = None
        grad_s = (raw >= 0).to(raw.dtype).mul_(2.0).sub_(1.0).mul_(grad)  # s G, s = +1 at -0.0 too
        if need[1] or need[2]:
            p = grad_s * e  # dL/da (full)
            g_ar = p @ a_c.mT if need[1] else None
            g_ac = a_r.mT @ p if need[2] else None
        q = e + 1.0
        q.mul_(grad)
        limit = torch.expm1(torch.tensor(ctx.max_exponent, dtype=e.dtype))
        if bool(e.max() >= limit):  # rare: only then pay for the mask
            q.masked_fill_(e >= limit, 0.0)
        if need[3] or need[4]:
            qw = q * raw  # dL/db / a (full)
            g_br = (qw @ (a_c * b_c).mT) * a_r if need[3] else None
            g_bc = ((a_r * b_r).mT @ qw) * a_c if need[4] else None
        if c_r is not None and (need[5] or need[6]):
            gt = grad * raw.abs()  # dL/dc (full)
            g_cr = gt @ c_c.mT if need[5] else None
            g_cc = c_r.mT @ gt if need[6] else None
        if need[0]:
            g_raw = q.mul_(a_r * b_r).mul_(a_c * b_c)
            if c_r is not None:
                g_raw.addcmul_(grad_s.mul_(c_r), c_c)
        return g_raw, g_ar, g_ac, g_br, g_bc, g_cr, g_cc, None


class _SELKernelRule(torch.autograd.Function):
    """The forward rule on the C++ CPU kernels (``ops``: their ``torch.ops`` namespace)."""

    @staticmethod
    def forward(ctx, raw, a_r, a_c, b_r, b_c, c_r, c_c, max_exponent: float, ops):
        factors = [t.contiguous() for t in (a_r, a_c, b_r, b_c)]
        linear = [None, None] if c_r is None else [c_r.contiguous(), c_c.contiguous()]
        ctx.max_exponent, ctx.ops, ctx.linear = max_exponent, ops, c_r is not None
        ctx.save_for_backward(raw, *factors, *(t for t in linear if t is not None))
        return ops.sel_forward(raw, *factors, *linear, max_exponent)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        raw, a_r, a_c, b_r, b_c, *linear = ctx.saved_tensors
        c_r, c_c = linear if ctx.linear else (None, None)
        grads = ctx.ops.sel_backward(grad, raw, a_r, a_c, b_r, b_c, c_r, c_c, ctx.max_exponent)
        grads = list(grads) + [None] * (7 - len(grads))  # no linear path: no c gradients
        return (*grads, None, None)


def _kernel_exponent_limit(dtype: torch.dtype) -> float:
    r"""The largest clamp :math:`M` the C++ kernels' ``expm1`` takes in ``dtype``.

    They build :math:`2^n`, :math:`n = \operatorname{round}(x/\ln 2)`, from the exponent bits,
    which must stay below the all-ones (inf/NaN) field: :math:`n \le n_\text{max} - 1` with
    :math:`2^{n_\text{max}} \approx` ``finfo.max``, i.e. :math:`x \le \ln(\text{max}) - \ln 2`.
    Past it the bits wrap into the sign and the result is garbage (``-1`` or NaN instead of the
    large or infinite value the plain expression gives), so a larger ``max_exponent`` runs in ATen.
    """
    return math.log(torch.finfo(dtype).max) - math.log(2.0)


def _cpu_kernels_for(raw: torch.Tensor, max_exponent: float):
    """The C++ kernels' namespace when they apply to ``raw`` and the clamp ``max_exponent``, else
    ``None`` (cheap checks first, so only a call that could use them ever triggers the build)."""
    if (
        raw.device.type != "cpu"
        or raw.dtype not in (torch.float32, torch.float64)
        or raw.dim() != 2
        or not raw.is_contiguous()
        or torch.compiler.is_compiling()
        or not max_exponent <= _kernel_exponent_limit(raw.dtype)
    ):
        return None
    return _cpu_kernels.enabled()


def _compiled_rule():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_plain_rule, dynamic=True)
    return _compiled


def _plain_rule(raw, a_r, a_c, b_r, b_c, c_r, c_c, max_exponent: float):
    sign = (raw >= 0).to(raw.dtype) * 2 - 1  # +-1, +1 at 0; no gradient
    mag = raw * sign  # |w| with d|w|/dw = sign
    weight = sign * (a_r * a_c) * torch.expm1((b_r * b_c * mag).clamp(max=max_exponent))
    return weight if c_r is None else weight + (c_r * c_c) * mag


def sel_forward_rule(
    raw: torch.Tensor,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    c: tuple[torch.Tensor, torch.Tensor] | None,
    max_exponent: float,
    impl: str = "fused",
) -> torch.Tensor:
    r""":math:`s\,a\,\operatorname{expm1}(\min(b|w|, M)) + c|w|` for rank-1 scales.

    Differentiable in ``raw`` and in every factor.

    Args:
        raw: ``(out, in)`` raw coordinates :math:`w`.
        a: row ``(out, 1)`` and column ``(1, in)`` factors of :math:`a > 0`.
        b: row and column factors of :math:`b > 0`.
        c: row and column factors of :math:`c > 0`, or None (no linear path).
        max_exponent: :math:`M`, the clamp of :math:`b|w|` (its gradient is 0 beyond).
        impl: one of :data:`SEL_IMPLS`; all three give the same values and gradients.

    Returns:
        ``(out, in)`` the effective weight.
    """
    c_r, c_c = (None, None) if c is None else c
    args = (raw, a[0], a[1], b[0], b[1], c_r, c_c, float(max_exponent))
    if impl == "fused":
        ops = _cpu_kernels_for(raw, args[7]) if all(t.dtype == raw.dtype for t in args[1:7] if t is not None) else None
        if ops is not None:
            return _SELKernelRule.apply(*args, ops)
        if raw.device.type == "cuda" and not torch.compiler.is_compiling():
            return _compiled_rule()(*args)
        return _SELForwardRule.apply(*args)
    if impl == "autograd":
        return _plain_rule(*args)
    if impl == "compile":
        return _compiled_rule()(*args)
    raise ValueError(f"impl must be one of {SEL_IMPLS}, got {impl!r}")
