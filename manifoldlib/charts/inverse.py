r"""Exact inverses of the SEL magnitude maps by monotone Newton iteration, scale-safe.

Both solvers invert a convex function of a non-negative magnitude :math:`x` built from

.. math::
    E(x) = a\,\operatorname{expm1}(b x), \qquad a \ge 0,\; b > 0,\; c \ge 0.

* :func:`solve_expm1_linear` inverts the *congruent* magnitude map
  :math:`f(x) = E(x) + c x` (increasing, convex, :math:`f(0) = 0`).
* :func:`solve_expm1_minus_linear` inverts the *forward rule on negatives*,
  :math:`h(t) = E(t) - c t`, on the branch beyond its minimum (where it increases).

Newton's method on an increasing convex function started to the right of the root decreases
monotonically onto it and converges quadratically near it, so both solvers need a starting
point that is a provable upper bound. Every coefficient may lie anywhere in the floating range,
so products such as :math:`y/a`, :math:`ab` or :math:`a e^{bx}` can overflow or underflow even
where the root is an ordinary number; hence

* the **starting point** is formed in log space, where nothing overflows
  (:math:`\ell(z) = \log\log1p(e^z)` is evaluated stably for every :math:`z`):

  - congruent: :math:`\log x_0 = \min(\log y - \log c,\ \ell(\log y - \log a) - \log b)`, the
    smaller of :math:`y/c` and :math:`\log1p(y/a)/b`, each an upper bound alone since
    :math:`f(x) \ge c x` and :math:`f(x) \ge E(x)`;
  - negatives: the positive root :math:`t_q` of the quadratic lower bound
    :math:`\tfrac12 ab^2 t^2 + (ab - c)t = y` (from :math:`\operatorname{expm1}(u) \ge u + u^2/2`),
    so :math:`h(t_q) \ge y`, tightened by a few steps of :math:`g(t) = \log1p((y + ct)/a)/b`,
    which maps every point right of the root to a point right of it and has the root as fixed
    point (:math:`t \ge g(t) \iff h(t) \ge y`); :math:`t_q` is close where the exponential is
    nearly quadratic (near a double root), :math:`g` where it is not.

  The start is nudged up by :math:`2^{-26}` relative, more than the rounding of the logarithms,
  so it stays right of the root in floating point too.
* each **Newton step** divides the equation by a power of two :math:`N = 2^k` with :math:`k` the
  binary exponent of the largest of :math:`y`, :math:`ct` and :math:`E(t)` (of :math:`abt` for
  :math:`bt \le 1`, of :math:`a e^{bt}` beyond). Every product is
  formed from the mantissas of ``torch.frexp`` and an integer exponent sum, and the exponential
  term as :math:`E/N = \exp(bt + \log a - k\ln 2) - a/N` (with :math:`\ln 2` split in two parts so
  that :math:`k\ln 2` is exact) where :math:`bt > 1`, else as
  :math:`(abt/N)\,\operatorname{expm1}(bt)/(bt)`; for the negatives there, :math:`h` and
  :math:`th'` are formed as :math:`a(bt)^2\varphi(bt) + (ab - c)t` and
  :math:`abt\operatorname{expm1}(bt) + (ab - c)t`, :math:`\varphi(u) = (\operatorname{expm1}(u) - u)/u^2`,
  which do not cancel near a double root. The step is the relative one,
  :math:`\delta x = x\,(f(x) - y)/(x f'(x))`, whose ratio does not depend on :math:`N`.

All arithmetic runs in float64 (float32 and half-precision inputs are promoted; float64 holds
every product of their values; the coefficients are taken in float64 as given, whatever
``y``'s dtype, and so is a ``y`` given as Python numbers, which has no dtype of its own), and the
root is rounded to ``y``'s dtype at the end; a root that
does not fit that dtype raises a ``ValueError`` naming the coefficients. The degenerate cases
have closed forms that the iteration reaches: ``c = 0`` gives :math:`\log1p(y/a)/b` and
``a = 0`` gives :math:`y/c`. Arguments broadcast against each other; the solvers run under
:func:`torch.no_grad` semantics (no autograd graph).
"""

from __future__ import annotations

import math

import torch

from .._numbers import is_real

__all__ = ["solve_expm1_linear", "solve_expm1_minus_linear"]

_MAX_ITER = 100
_WORK = torch.float64
#: ln 2 = _LN2_HI + _LN2_LO, the high part with 32 trailing zero bits: n * _LN2_HI is exact
#: for every binary exponent n of float64 (fdlibm's split).
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
#: Relative nudge of the starting point: above the rounding of its logarithms (a few hundred
#: float64 eps), far below the distance Newton closes in one quadratic step.
_NUDGE = 2.0**-26
#: Refinements of the negatives' starting point by the fixed-point map g.
_LOG_REFINEMENTS = 4


def _as_tensors(y, a, b, c) -> tuple[torch.Tensor, ...]:
    if isinstance(y, bool):
        raise ValueError(f"y must be a floating-point tensor or real numbers, got {y!r}")
    # Python numbers (no dtype of their own) are float64 like the coefficients: through torch's
    # default dtype, float32, y = 1e-50 became 0 (and its root 0) and y = 1e300 inf
    y = torch.as_tensor(y, dtype=None if hasattr(y, "dtype") else _WORK)
    if not y.is_floating_point():
        raise ValueError(f"y must be a floating-point tensor, got dtype {y.dtype}")
    # the coefficients go straight to the float64 work dtype: rounded to y's dtype first, one below
    # its range (a = 1e-8 for a float16 y) became 0 and the solvers solved another equation
    # (a Python float straight to float64: through torch's default dtype it would be rounded too)
    a, b, c = (v.to(device=y.device, dtype=_WORK) if isinstance(v, torch.Tensor)
               else torch.as_tensor(v, dtype=_WORK, device=y.device) for v in (a, b, c))
    return torch.broadcast_tensors(y, a, b, c)


def _tolerance(tol) -> float:
    r"""``tol`` as a float, by default :math:`4\varepsilon` of float64; ``ValueError`` unless a real
    number, finite and :math:`\ge 0` (a NaN or infinite one stopped Newton after its first step,
    unconverged: no step is larger than it; a bool passed as 0 or 1)."""
    if tol is None:
        return 4.0 * torch.finfo(_WORK).eps
    if not (is_real(tol) and math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol must be a finite number >= 0 (a relative step size), got {tol!r}")
    return float(tol)


def _check(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    if not bool(torch.isfinite(y).all()) or bool((y < 0).any()):
        bad = y[~(torch.isfinite(y) & (y >= 0))].flatten()[0].item()
        raise ValueError(f"y must be finite and >= 0 (a magnitude), got {bad}")
    if bool((a < 0).any()) or not bool(torch.isfinite(a).all()):
        raise ValueError(f"a must be finite and >= 0, got min {a.min().item()}")
    if bool((b <= 0).any()) or not bool(torch.isfinite(b).all()):
        raise ValueError(f"b must be finite and > 0, got min {b.min().item()}")
    if bool((c < 0).any()) or not bool(torch.isfinite(c).all()):
        raise ValueError(f"c must be finite and >= 0, got min {c.min().item()}")


def _ldexp(m: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``m * 2**e`` for a mantissa ``m`` of order 1 and an integer-valued float exponent ``e``. The
    exponent is clamped to ``[-1100, 1000]``: below, the value is 0 (negligible next to the terms
    of order 1 it is added to); above, it never occurs for the scaled terms (all at most of order
    1), and the clamp keeps ``0 * inf`` out."""
    return m * torch.exp2(e.clamp(-1100.0, 1000.0))


def _log_softplus(z: torch.Tensor) -> torch.Tensor:
    r""":math:`\log\log1p(e^z)` for every :math:`z` in :math:`[-\infty, \infty]`: for :math:`z < 0`
    as :math:`z + \log(\log1p(e^z)/e^z)`, which stays finite where :math:`e^z` underflows. Below
    :math:`z = -40` the ratio :math:`1 - e^z/2 + \dots` is 1 in float64 and is taken as 1: there
    :math:`e^z` may be subnormal, where ``torch.log1p`` is inexact (0 at 4.9e-324, 1.2 % low at
    4.9e-322), and a low ratio would put the solvers' start left of the root."""
    ez = torch.exp(z.clamp(min=-40.0, max=0.0))  # (...), in [4e-18, 1]: normal, log1p exact
    ratio = torch.where(z > -40.0, torch.log1p(ez) / ez, 1.0)
    negative = z + torch.log(ratio)
    positive = torch.log(z.clamp(min=0.0) + torch.log1p(torch.exp(-z.abs())))
    return torch.where(z < 0, negative, positive)


def _expm1_excess_ratio(u: torch.Tensor) -> torch.Tensor:
    r""":math:`\varphi(u) = (\operatorname{expm1}(u) - u)/u^2` for :math:`0 \le u \le 1`: its Taylor
    series :math:`\sum_{j \ge 0} u^j/(j + 2)!` up to :math:`u = 1/2` (the difference would lose
    :math:`\log_2(2/u)` bits), the difference beyond."""
    w = u.clamp(max=0.5)
    series = torch.full_like(u, 1.0 / math.factorial(15))
    for j in range(12, -1, -1):  # Horner, terms up to u^13/15!
        series = series * w + 1.0 / math.factorial(j + 2)
    direct = (torch.expm1(u) - u) / torch.where(u > 0.5, u * u, 1.0)
    return torch.where(u > 0.5, direct, series)


class _ScaledTerms:
    r"""The terms of :math:`E(t) \pm ct - y` and of :math:`t\,\tfrac{d}{dt}`, divided by :math:`N = 2^k`.

    ``__call__(t)`` returns ``(Y, L, E, D)`` = :math:`(y, ct, E(t), tE'(t)) / N` with
    :math:`tE'(t) = abt\,e^{bt}`, each at most a small multiple of 1 (module docstring), then
    ``small`` (:math:`bt \le 1`), :math:`abt/N` and :math:`u = bt`.
    """

    def __init__(self, y, a, b, c):
        (self.my, ey), (self.ma, ea) = torch.frexp(y), torch.frexp(a)
        (mb, eb), (self.mc, ec) = torch.frexp(b), torch.frexp(c)
        self.ey, self.ea, self.ec = (e.to(y.dtype) for e in (ey, ea, ec))  # exact integers
        self.b = b
        self.mab, self.eab = self.ma * mb, self.ea + eb.to(y.dtype)  # ab = mab 2^eab
        self.log_ma = torch.log(self.ma)  # -inf where a = 0
        self.has_exp = a > 0
        # Binary exponents of y, c and a b (-inf where that term is 0), for the choice of N.
        self.k_y = torch.where(y > 0, self.ey, -math.inf)
        self.k_c = torch.where(c > 0, self.ec, -math.inf)
        self.k_ab = torch.where(self.has_exp, self.eab, -math.inf)

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mt, et = torch.frexp(t)
        et = et.to(t.dtype)
        u = self.b * t  # the exponent b t, at most a few thousand at every iterate where a > 0
        small = u <= 1.0  # E = (a u) expm1(u)/u, else a e^u - a
        log2_exp = (u.clamp(max=1e5) + self.log_ma) * (1.0 / math.log(2.0)) + self.ea  # log2(a e^u)
        k_exp = torch.where(small, self.k_ab + et, log2_exp.floor())
        k = torch.maximum(torch.maximum(self.k_y, self.k_c + et), k_exp)
        k = torch.where(torch.isinf(k), 0.0, k)  # every term 0 (t = 0 or y = c = a = 0)

        y_n = _ldexp(self.my, self.ey - k)
        lin_n = _ldexp(self.mc * mt, self.ec + et - k)
        abt_n = _ldexp(self.mab * mt, self.eab + et - k)  # a u / N
        n = self.ea - k
        a_eu_n = torch.exp((n * _LN2_HI + u) + (n * _LN2_LO + self.log_ma))  # a e^u / N
        ratio = torch.expm1(u) / torch.where(u > 0, u, 1.0)  # expm1(u)/u where u > 0
        ratio = torch.where(u > 0, ratio, 1.0)
        exp_n = torch.where(small, abt_n * ratio, a_eu_n - _ldexp(self.ma, n))
        slope_n = torch.where(small, abt_n * torch.exp(u), a_eu_n * u)
        exp_n = torch.where(self.has_exp, exp_n, 0.0)
        slope_n = torch.where(self.has_exp, slope_n, 0.0)
        return y_n, lin_n, exp_n, slope_n, small, abt_n, u


def _newton_from_right(t, residual_and_slope, tol: float) -> torch.Tensor:
    # Monotone Newton on the relative step: it is >= 0 in exact arithmetic; clamping it keeps
    # rounding from sending an iterate to the left of the root, where convergence would no longer
    # be monotone. t = 0 (a zero root, or a masked entry) stays put.
    for _ in range(_MAX_ITER):
        residual, slope = residual_and_slope(t)
        step = (t * (residual / slope)).clamp(min=0.0)
        step = torch.where(torch.isfinite(step) & (slope > 0) & (t > 0), step, torch.zeros_like(step))
        t = t - step
        if not bool((step > tol * t).any()):
            break
    return t


def _start(log_t: torch.Tensor) -> torch.Tensor:
    """The nudged starting point from its logarithm, clamped to the largest float64."""
    t = torch.exp(log_t) * (1.0 + _NUDGE)
    return t.clamp(max=torch.finfo(_WORK).max)


def _raise_if(bad: torch.Tensor, what: str, dtype: torch.dtype, y, a, b, c) -> None:
    if bool(bad.any()):
        i = bad.flatten().nonzero()[0, 0]
        y0, a0, b0, c0 = (v.flatten()[i].item() for v in (y, a, b, c))
        raise ValueError(
            f"{what} has no root in {dtype} at y={y0:.6g}, a={a0:.6g}, b={b0:.6g}, c={c0:.6g}: "
            f"the root is beyond the largest {dtype} ({torch.finfo(dtype).max:.4g})"
        )


def _to_dtype(t: torch.Tensor, dtype: torch.dtype, what: str, y, a, b, c) -> torch.Tensor:
    out = t.to(dtype)
    _raise_if(torch.isinf(out), what, dtype, y, a, b, c)
    return out


def solve_expm1_linear(y, a, b, c, *, tol: float | None = None) -> torch.Tensor:
    r"""Solve :math:`a\,\operatorname{expm1}(b x) + c x = y` for :math:`x \ge 0`.

    The left side is increasing and convex in :math:`x \ge 0`, so the root is unique; Newton from
    :math:`x_0 = \min(y/c, \log1p(y/a)/b)` (formed in log space) decreases monotonically onto it,
    for coefficients anywhere in the floating range (module docstring).

    Args:
        y: ``(...)`` target magnitudes, finite and :math:`\ge 0`: a tensor, or Python numbers
            (taken as float64).
        a: exponential scale :math:`a \ge 0`, broadcastable to ``y``.
        b: curvature :math:`b > 0`, broadcastable to ``y``.
        c: linear slope :math:`c \ge 0`, broadcastable to ``y``; ``a`` and ``c`` may not both be 0.
        tol: relative step size at which to stop (default :math:`4\varepsilon` of float64, the
            working precision), a finite number :math:`\ge 0`.

    Returns:
        ``(...)`` the root :math:`x`, in ``y``'s dtype (float64 for Python numbers; broadcast
            shape).

    Raises:
        ValueError: on negative or non-finite inputs or ``tol``, where ``a = c = 0`` (no root), or
            where the root is beyond the largest number of ``y``'s dtype.
    """
    tol = _tolerance(tol)
    with torch.no_grad():
        y, a, b, c = _as_tensors(y, a, b, c)
        _check(y, a, b, c)
        if bool(((a == 0) & (c == 0)).any()):
            raise ValueError("a and c are both 0 somewhere: a*expm1(b*x) + c*x = y has no root")
        dtype = y.dtype
        y64, a64, b64, c64 = (v.to(_WORK) for v in (y, a, b, c))
        log_y = torch.log(torch.where(y64 > 0, y64, 1.0))  # y = 0 is masked to x = 0 below
        log_lin = log_y - torch.log(c64)  # log(y/c), inf where c = 0
        log_exp = _log_softplus(log_y - torch.log(a64)) - torch.log(b64)  # log(log1p(y/a)/b)
        x0 = torch.where(y64 > 0, _start(torch.minimum(log_lin, log_exp)), 0.0)
        terms = _ScaledTerms(y64, a64, b64, c64)

        def residual_and_slope(x):
            y_n, lin_n, exp_n, slope_n = terms(x)[:4]
            return exp_n + lin_n - y_n, slope_n + lin_n

        clamped = x0 == torch.finfo(_WORK).max  # both bounds overflowed: is f(max) >= y?
        if bool(clamped.any()):
            _raise_if(clamped & (residual_and_slope(x0)[0] < 0), "a*expm1(b*x) + c*x = y",
                      _WORK, y, a, b, c)
        x = _newton_from_right(x0, residual_and_slope, tol)
        return _to_dtype(x, dtype, "a*expm1(b*x) + c*x = y", y, a, b, c)


def solve_expm1_minus_linear(y, a, b, c, *, tol: float | None = None) -> torch.Tensor:
    r"""Solve :math:`a\,\operatorname{expm1}(b t) - c t = y` for the root beyond the minimum.

    :math:`h(t) = a\,\operatorname{expm1}(bt) - ct` is convex with :math:`h(0) = 0`; when
    :math:`ab < c` it first dips below 0 (minimum at :math:`t_m = \log(c/(ab))/b`), then grows.
    For :math:`y > 0` the root is unique on :math:`t > t_m`; for :math:`y = 0` the largest root is
    returned (:math:`0` when :math:`ab \ge c`). This inverts SEL's forward rule on negative weights,
    where :math:`|w_\text{eff}| = h(|w|)`. Newton starts from the log-space bound of the module
    docstring, for coefficients anywhere in the floating range.

    Args:
        y: ``(...)`` target magnitudes, finite and :math:`\ge 0`: a tensor, or Python numbers
            (taken as float64).
        a: exponential scale :math:`a \ge 0`, broadcastable to ``y``.
        b: curvature :math:`b > 0`, broadcastable to ``y``.
        c: linear slope :math:`c \ge 0`, broadcastable to ``y``.
        tol: relative step size at which to stop (default :math:`4\varepsilon` of float64, the
            working precision), a finite number :math:`\ge 0`.

    Returns:
        ``(...)`` the root :math:`t`, in ``y``'s dtype (float64 for Python numbers); ``nan``
        where ``a = 0`` and ``y > 0`` (then :math:`h(t) = -ct \le 0` has no root).

    Raises:
        ValueError: on negative or non-finite inputs or ``tol``, or where the root is beyond the
            largest number of ``y``'s dtype.
    """
    tol = _tolerance(tol)
    with torch.no_grad():
        y, a, b, c = _as_tensors(y, a, b, c)
        _check(y, a, b, c)
        dtype = y.dtype
        y64, a64, b64, c64 = (v.to(_WORK) for v in (y, a, b, c))
        ok = a64 > 0
        a64 = torch.where(ok, a64, 1.0)  # a = 0 is masked below
        log_y, log_a, log_b, log_c = (torch.log(v) for v in (y64, a64, b64, c64))
        (ma, ea), (mb, eb), (mc, ec) = torch.frexp(a64), torch.frexp(b64), torch.frexp(c64)
        # t_q: the positive root of q t^2 + d t = y, q = ab^2/2, d = ab - c (h's quadratic lower
        # bound), in log space: log|d| from the mantissas, s = sqrt(d^2 + 4qy) by logaddexp.
        ea, eb, ec = (e.to(_WORK) for e in (ea, eb, ec))
        e_d = torch.maximum(ea + eb, ec)
        d_m = _ldexp(ma * mb, ea + eb - e_d) - _ldexp(mc, ec - e_d)  # d / 2^e_d
        log_abs_d = torch.log(d_m.abs()) + e_d * math.log(2.0)
        log_s = 0.5 * torch.logaddexp(2.0 * log_abs_d, math.log(2.0) + log_a + 2.0 * log_b + log_y)
        log_t = torch.where(
            d_m > 0,
            math.log(2.0) + log_y - torch.logaddexp(log_abs_d, log_s),  # 2y / (d + s)
            torch.logaddexp(log_s, log_abs_d) - log_a - 2.0 * log_b,  # (s + |d|) / (ab^2)
        )
        zero_root = (y64 == 0) & (d_m >= 0)  # ab >= c: h increases from h(0) = 0
        for _ in range(_LOG_REFINEMENTS):  # t <- g(t) = log1p((y + ct)/a)/b, in log space
            log_t = _log_softplus(torch.logaddexp(log_y, log_c + log_t) - log_a) - log_b
        t0 = torch.where(ok & ~zero_root, _start(log_t), 0.0)
        terms = _ScaledTerms(y64, a64, b64, c64)

        def residual_and_slope(t):
            y_n, lin_n, exp_n, slope_n, small, abt_n, u = terms(t)
            # For bt <= 1, h = a u^2 phi(u) + (ab - c) t and t h' = abt expm1(u) + (ab - c) t:
            # E - ct and tE' - ct would cancel to rounding of E where h is of order a u^2.
            drift = abt_n - lin_n  # (ab - c) t / N
            residual = torch.where(small, abt_n * u * _expm1_excess_ratio(u) + drift, exp_n - lin_n)
            slope = torch.where(small, abt_n * torch.expm1(u) + drift, slope_n - lin_n)
            return residual - y_n, slope

        clamped = t0 == torch.finfo(_WORK).max
        if bool(clamped.any()):
            _raise_if(clamped & (residual_and_slope(t0)[0] < 0), "a*expm1(b*t) - c*t = y",
                      _WORK, y, a, b, c)
        t = _newton_from_right(t0, residual_and_slope, tol)
        t = torch.where(ok | (y64 == 0), t, math.nan)
        return _to_dtype(t, dtype, "a*expm1(b*t) - c*t = y", y, a, b, c)
