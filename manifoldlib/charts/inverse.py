r"""Exact inverses of the SEL magnitude maps by monotone Newton iteration.

Both solvers invert a convex function of a non-negative magnitude :math:`x` built from

.. math::
    E(x) = a\,\operatorname{expm1}(b x), \qquad a \ge 0,\; b > 0,\; c \ge 0.

* :func:`solve_expm1_linear` inverts the *congruent* magnitude map
  :math:`f(x) = E(x) + c x` (increasing, convex, :math:`f(0) = 0`).
* :func:`solve_expm1_minus_linear` inverts the *forward rule on negatives*,
  :math:`h(t) = E(t) - c t`, on the branch beyond its minimum (where it increases).

Newton's method on an increasing convex function started to the right of the root
(:math:`f(x_0) \ge y`) decreases monotonically to the root and converges quadratically near it,
so both solvers only need a starting point that is a provable upper bound:

* congruent: :math:`x_0 = \min(y/c,\ \log1p(y/a)/b)` — each term alone already overshoots, because
  :math:`f(x) \ge c x` and :math:`f(x) \ge E(x)`;
* negatives: the positive root :math:`t_q` of the quadratic lower bound
  :math:`\tfrac12 a b^2 t^2 + (ab - c)t = y` (from :math:`\operatorname{expm1}(u) \ge u + u^2/2`),
  improved in log space by :math:`\log1p((y + c\,t_q)/a)/b`, which is valid whenever it is below
  :math:`t_q`. Both satisfy :math:`h(t_0) \ge y > 0`, hence lie beyond the minimum.

The degenerate cases have closed forms that the starting point already hits exactly:
``c = 0`` gives :math:`\log1p(y/a)/b` and ``a = 0`` gives :math:`y/c`. Arguments broadcast
against each other; the solvers run under :func:`torch.no_grad` semantics (no autograd graph).
"""

from __future__ import annotations

import math

import torch

__all__ = ["solve_expm1_linear", "solve_expm1_minus_linear"]

_MAX_ITER = 100


def _as_tensors(y, a, b, c) -> tuple[torch.Tensor, ...]:
    y = torch.as_tensor(y)
    if not y.is_floating_point():
        raise ValueError(f"y must be a floating-point tensor, got dtype {y.dtype}")
    a, b, c = (torch.as_tensor(v, dtype=y.dtype, device=y.device) for v in (a, b, c))
    return torch.broadcast_tensors(y, a, b, c)


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


def _newton_from_right(x, y, value_and_slope, tol: float) -> torch.Tensor:
    # Monotone Newton: the step is >= 0 in exact arithmetic; clamping it keeps rounding from
    # sending an iterate to the left of the root, where convergence would no longer be monotone.
    for _ in range(_MAX_ITER):
        value, slope = value_and_slope(x)
        step = ((value - y) / slope).clamp(min=0.0)
        step = torch.where(torch.isfinite(step), step, torch.zeros_like(step))
        x = x - step
        if not bool((step > tol * x.abs()).any()):
            break
    return x


def solve_expm1_linear(y, a, b, c, *, tol: float | None = None) -> torch.Tensor:
    r"""Solve :math:`a\,\operatorname{expm1}(b x) + c x = y` for :math:`x \ge 0`.

    The left side is increasing and convex in :math:`x \ge 0`, so the root is unique; Newton from
    :math:`x_0 = \min(y/c, \log1p(y/a)/b)` decreases monotonically onto it.

    Args:
        y: ``(...)`` target magnitudes, finite and :math:`\ge 0`.
        a: exponential scale :math:`a \ge 0`, broadcastable to ``y``.
        b: curvature :math:`b > 0`, broadcastable to ``y``.
        c: linear slope :math:`c \ge 0`, broadcastable to ``y``; ``a`` and ``c`` may not both be 0.
        tol: relative step size at which to stop (default :math:`4\varepsilon` of the dtype).

    Returns:
        ``(...)`` the root :math:`x`, in ``y``'s dtype (broadcast shape).

    Raises:
        ValueError: on negative or non-finite inputs, or where ``a = c = 0`` (no root).
    """
    with torch.no_grad():
        y, a, b, c = _as_tensors(y, a, b, c)
        _check(y, a, b, c)
        if bool(((a == 0) & (c == 0)).any()):
            raise ValueError("a and c are both 0 somewhere: a*expm1(b*x) + c*x = y has no root")
        tol = 4.0 * torch.finfo(y.dtype).eps if tol is None else tol
        inf = torch.full_like(y, math.inf)
        x_lin = torch.where(c > 0, y / torch.where(c > 0, c, torch.ones_like(c)), inf)
        x_exp = torch.where(
            a > 0, torch.log1p(y / torch.where(a > 0, a, torch.ones_like(a))) / b, inf
        )
        x0 = torch.minimum(x_lin, x_exp)

        def value_and_slope(x):
            ebx = torch.exp(b * x)
            return a * torch.expm1(b * x) + c * x, a * b * ebx + c

        return _newton_from_right(x0, y, value_and_slope, tol)


def solve_expm1_minus_linear(y, a, b, c, *, tol: float | None = None) -> torch.Tensor:
    r"""Solve :math:`a\,\operatorname{expm1}(b t) - c t = y` for the root beyond the minimum.

    :math:`h(t) = a\,\operatorname{expm1}(bt) - ct` is convex with :math:`h(0) = 0`; when
    :math:`ab < c` it first dips below 0 (minimum at :math:`t_m = \log(c/(ab))/b`), then grows.
    For :math:`y > 0` the root is unique on :math:`t > t_m`; for :math:`y = 0` the largest root is
    returned (:math:`0` when :math:`ab \ge c`). This inverts SEL's forward rule on negative weights,
    where :math:`|w_\text{eff}| = h(|w|)`.

    Args:
        y: ``(...)`` target magnitudes, finite and :math:`\ge 0`.
        a: exponential scale :math:`a \ge 0`, broadcastable to ``y``.
        b: curvature :math:`b > 0`, broadcastable to ``y``.
        c: linear slope :math:`c \ge 0`, broadcastable to ``y``.
        tol: relative step size at which to stop (default :math:`4\varepsilon` of the dtype).

    Returns:
        ``(...)`` the root :math:`t`; ``nan`` where ``a = 0`` and ``y > 0`` (then
        :math:`h(t) = -ct \le 0` has no root).

    Raises:
        ValueError: on negative or non-finite inputs.
    """
    with torch.no_grad():
        y, a, b, c = _as_tensors(y, a, b, c)
        _check(y, a, b, c)
        tol = 4.0 * torch.finfo(y.dtype).eps if tol is None else tol
        ok = a > 0
        a_safe = torch.where(ok, a, torch.ones_like(a))
        d = a_safe * b - c  # h'(0)
        two_q = a_safe * b * b  # h(t) >= q t^2 + d t with q = a b^2 / 2
        root = torch.sqrt(d * d + 2.0 * two_q * y)
        # The two algebraically equal forms of the positive root; pick the one without cancellation.
        t_q = torch.where(
            d > 0,
            2.0 * y / torch.where(d + root > 0, d + root, torch.ones_like(root)),
            (root - d) / two_q,
        )
        t_log = torch.log1p((y + c * t_q) / a_safe) / b
        t0 = torch.minimum(t_q, t_log)

        def value_and_slope(t):
            bt = b * t
            return a_safe * torch.expm1(bt) - c * t, a_safe * b * torch.exp(bt) - c

        t = _newton_from_right(t0, y, value_and_slope, tol)
        return torch.where(
            ok | (y == 0), torch.where(ok, t, torch.zeros_like(t)), torch.full_like(t, math.nan)
        )
