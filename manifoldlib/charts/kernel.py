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

**Precision.** The rule is evaluated in the widest dtype of ``raw`` and the factors, and at least
in float32: float16 and bfloat16 inputs are computed in float32 and rounded once (the package's
16-bit rule, as in :func:`manifoldlib.optim.execution.solve_dtype`). The weight comes back in
``raw``'s dtype where that is 16-bit, and each gradient in its input's dtype, each rounded once
from float32. Evaluated in bfloat16 itself, :math:`\operatorname{expm1}` and the products of the
scales would each round to 8 bits, an error of several bfloat16 ulps where correct rounding gives
half of one.

``impl="fused"`` runs, per device:

- **CPU** (contiguous float64, float32, float16 or bfloat16 raw coordinates, outside
  ``torch.compile`` tracing, the C++ kernels built and not switched off):
  :mod:`manifoldlib._cpu_kernels` — one pass over ``raw`` for :math:`W` and one over ``raw`` and
  :math:`G` for :math:`\partial L/\partial w` together with the six row and column reductions of
  the factor gradients (``sel_chart.cpp``; :math:`e` is recomputed in the backward instead of
  stored). 16-bit entries are converted to float32 one at a time as they are read and rounded as
  they are written: no full-size float32 copy is made;
- **CUDA**: the plain expression through :func:`torch.compile` (inductor fuses each pass, the
  conversions included, into one generated kernel);
- elsewhere, and as the fallback (no compiler, a non-contiguous weight, inside
  :func:`manifoldlib._cpu_kernels.disabled`): the ATen autograd function below, which for 16-bit
  raw coordinates makes full-size float32 copies of ``raw`` and of the upstream gradient and
  saves :math:`e` in float32. All give the same values and gradients up to rounding (tested
  against the plain expression in float64, and in 16 bits against the float64 rule to half an
  ulp). Rounding differs by path: the kernels' polynomial :math:`\operatorname{expm1}` is within
  1.7 ulps in float32 (1 in float64), ``torch.expm1`` within about 0.5, so in float32 the two
  paths' weights can differ by a rounding or two, at the clamp too
  (:math:`a\operatorname{expm1}(M)`). That is the whole difference there: each path masks the
  gradient where :math:`e` reaches its own :math:`\operatorname{expm1}(M)`, and both are
  increasing, so on every path exactly the entries with :math:`bt \ge M` get no gradient through
  :math:`e` (tested on the 64 floats below the clamp).

``impl="autograd"`` and ``impl="compile"`` run the plain expression; for 16-bit ``raw`` the
autograd one upcasts it to a full-size float32 copy (kept for the backward), the compiled one
converts entry by entry inside its generated loops.

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


_HALF = (torch.float16, torch.bfloat16)


class _SELForwardRule(torch.autograd.Function):
    """The forward rule on ATen ops. The factors are in the compute dtype; 16-bit ``raw`` is
    upcast to it (a full-size copy, made again in the backward rather than saved) and the weight
    and the raw gradient rounded once to ``raw``'s dtype."""

    @staticmethod
    def forward(ctx, raw, a_r, a_c, b_r, b_c, c_r, c_c, max_exponent: float):
        w = raw.to(a_r.dtype)  # raw itself unless 16-bit (or narrower than the factors)
        t = w.abs()  # (out, in)
        e = t * b_r
        e.mul_(b_c).clamp_(max=max_exponent).expm1_()  # (out, in)
        weight = e * a_r
        weight.mul_(a_c).copysign_(w)
        if c_r is not None:
            weight.addcmul_(t.mul_(c_r), c_c)
        ctx.max_exponent = max_exponent
        ctx.save_for_backward(raw, e, a_r, a_c, b_r, b_c, c_r, c_c)
        return weight.to(raw.dtype) if raw.dtype in _HALF else weight

    @staticmethod
    @once_differentiable  # second derivatives are not implemented: raise instead of being wrong
    def backward(ctx, grad):
        raw, e, a_r, a_c, b_r, b_c, c_r, c_c = ctx.saved_tensors
        need = ctx.needs_input_grad
        g_raw = g_ar = g_ac = g_br = g_bc = g_cr = g_cc = None
        w, grad = raw.to(e.dtype), grad.to(e.dtype)  # no copies unless 16-bit
        grad_s = (w >= 0).to(w.dtype).mul_(2.0).sub_(1.0).mul_(grad)  # s G, s = +1 at -0.0 too
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
            # dL/db (full) = q a w, a multiplied first: q w alone reaches e^M M / b, inf in float32
            # at M = 88 where a e^M M / b is finite for a < 0.01
            qaw = (a_r * a_c).mul_(q).mul_(w)
            g_br = qaw @ b_c.mT if need[3] else None
            g_bc = b_r.mT @ qaw if need[4] else None
        if c_r is not None and (need[5] or need[6]):
            gt = grad * w.abs()  # dL/dc (full)
            g_cr = gt @ c_c.mT if need[5] else None
            g_cc = c_r.mT @ gt if need[6] else None
        if need[0]:
            g_raw = q.mul_((a_r * b_r) * (a_c * b_c))  # q (ab): no partial product of q and a factor
            if c_r is not None:
                g_raw.addcmul_(grad_s.mul_(c_r), c_c)
            g_raw = g_raw.to(raw.dtype)  # rounded once
        return g_raw, g_ar, g_ac, g_br, g_bc, g_cr, g_cc, None


class _SELKernelRule(torch.autograd.Function):
    """The forward rule on the C++ CPU kernels (``ops``: their ``torch.ops`` namespace). The
    factors are in ``raw``'s compute dtype; the weight and the raw gradient come back in
    ``raw``'s dtype, the factor gradients in the factors'."""

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


#: The dtype the C++ kernels compute in, per dtype of the raw coordinates they take.
_KERNEL_WORK = {
    torch.float64: torch.float64, torch.float32: torch.float32,
    torch.float16: torch.float32, torch.bfloat16: torch.float32,
}


def _work_dtype(raw: torch.Tensor, factors) -> torch.dtype:
    """The dtype the rule is evaluated in: the widest of ``raw``'s and the factors', at least
    float32 (16-bit inputs are computed in float32)."""
    dtype = raw.dtype
    for t in factors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return torch.promote_types(dtype, torch.float32)


def _cpu_kernels_for(raw: torch.Tensor, work: torch.dtype, max_exponent: float):
    """The C++ kernels' namespace when they apply to ``raw``, the compute dtype ``work`` and the
    clamp ``max_exponent``, else ``None`` (cheap checks first, so only a call that could use them
    ever triggers the build)."""
    if (
        raw.device.type != "cpu"
        or _KERNEL_WORK.get(raw.dtype) != work
        or raw.dim() != 2
        or not raw.is_contiguous()
        or torch.compiler.is_compiling()
        or not max_exponent <= _kernel_exponent_limit(work)
    ):
        return None
    return _cpu_kernels.enabled()


def _compiled_rule():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_rule_in_work_dtype, dynamic=True)
    return _compiled


def _plain_rule(raw, a_r, a_c, b_r, b_c, c_r, c_c, max_exponent: float):
    sign = (raw >= 0).to(raw.dtype) * 2 - 1  # +-1, +1 at 0; no gradient
    mag = raw * sign  # |w| with d|w|/dw = sign
    weight = sign * (a_r * a_c) * torch.expm1((b_r * b_c * mag).clamp(max=max_exponent))
    return weight if c_r is None else weight + (c_r * c_c) * mag


def _rule_in_work_dtype(raw, a_r, a_c, b_r, b_c, c_r, c_c, max_exponent: float):
    """The plain expression in the factors' dtype (the compute dtype), the weight rounded once to
    16-bit ``raw``'s dtype. For 16-bit ``raw`` the upcast is a full-size float32 copy under plain
    autograd (also kept for the backward); compiled, inductor converts entry by entry."""
    weight = _plain_rule(raw.to(a_r.dtype), a_r, a_c, b_r, b_c, c_r, c_c, max_exponent)
    return weight.to(raw.dtype) if raw.dtype in _HALF else weight


def _check_shapes(raw: torch.Tensor, a, b, c) -> None:
    """``ValueError`` unless ``raw`` is ``(out, in)`` and every pair a row ``(out, 1)`` and a column
    ``(1, in)``. The kernels read the factors by their number of entries and the ATen paths
    broadcast them, so a pair given as vectors ``(out,), (in,)`` or transposed ``(1, out), (in, 1)``
    gave the right weight on one path and, for a square ``raw``, another one on the other (a
    ``(in,)`` ``raw`` was broadcast to ``(out, in)``)."""
    if raw.dim() != 2:
        raise ValueError(f"raw must be an (out, in) matrix, got shape {tuple(raw.shape)}")
    rows, cols = raw.shape
    for name, pair in (("a", a), ("b", b), ("c", c)):
        if pair is None and name == "c":
            continue
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                  for t in (pair if isinstance(pair, (tuple, list)) else [pair])]
        if shapes != [(rows, 1), (1, cols)]:
            raise ValueError(
                f"{name} must be a row factor ({rows}, 1) and a column factor (1, {cols}) for "
                f"raw of shape {(rows, cols)}, got {shapes}"
            )


def sel_forward_rule(
    raw: torch.Tensor,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    c: tuple[torch.Tensor, torch.Tensor] | None,
    max_exponent: float,
    impl: str = "fused",
) -> torch.Tensor:
    r""":math:`s\,a\,\operatorname{expm1}(\min(b|w|, M)) + c|w|` for rank-1 scales.

    Differentiable in ``raw`` and in every factor. Evaluated in the widest dtype of the inputs and
    at least in float32: 16-bit inputs are computed in float32, and the weight and each gradient
    rounded once to their dtype (module docstring).

    Args:
        raw: ``(out, in)`` raw coordinates :math:`w`.
        a: row ``(out, 1)`` and column ``(1, in)`` factors of :math:`a > 0`.
        b: row and column factors of :math:`b > 0`.
        c: row and column factors of :math:`c > 0`, or None (no linear path).
        max_exponent: :math:`M > 0`, the clamp of :math:`b|w|` (its gradient is 0 beyond).
        impl: one of :data:`SEL_IMPLS`; all three give the same values and gradients.

    Returns:
        ``(out, in)`` the effective weight: in ``raw``'s dtype where that is float16 or bfloat16,
        else in the dtype it is evaluated in.

    Raises:
        ValueError: for a ``max_exponent`` that is not a number > 0, an unknown ``impl``, or
            ``raw`` and factors of other shapes (no broadcasting: factors given as vectors or
            transposed gave another weight on the ATen paths than on the kernels).
    """
    clamp = float(max_exponent)
    if not clamp > 0:  # M < 0 flips expm1's sign (a positive raw, a negative weight); NaN: NaNs
        raise ValueError(
            f"max_exponent must be a number > 0 (the clamp of b|w|), got {max_exponent!r}"
        )
    _check_shapes(raw, a, b, c)
    c_r, c_c = (None, None) if c is None else c
    factors = (a[0], a[1], b[0], b[1], c_r, c_c)
    work = _work_dtype(raw, factors)
    # the factors in the compute dtype: vectors, so the copies are small; their gradients are
    # rounded once to each factor's own dtype by the conversion's backward
    factors = tuple(None if t is None else t.to(work) for t in factors)
    args = (raw, *factors, clamp)
    if impl == "fused":
        ops = _cpu_kernels_for(raw, work, args[7])
        if ops is not None:
            return _SELKernelRule.apply(*args, ops)
        if raw.device.type == "cuda" and not torch.compiler.is_compiling():
            return _compiled_rule()(*args)
        return _SELForwardRule.apply(*args)
    if impl == "autograd":
        return _rule_in_work_dtype(*args)
    if impl == "compile":
        return _compiled_rule()(*args)
    raise ValueError(f"impl must be one of {SEL_IMPLS}, got {impl!r}")
