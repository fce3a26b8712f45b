r"""The sphere residual update as one function, with an analytic backward.

.. math::
    h' = R_h\big(s\, P_h(f)\big) = \cos\theta\, h + k\, s\, u, \qquad
    u = P_h(f) = f - \tfrac{a}{q} h,

with per-row scalars :math:`q = \|h\|^2` (the radius, read from :math:`h`),
:math:`a = \langle h, f\rangle`, :math:`n = \|u\|^2 = \|f\|^2 - a^2/q` and
:math:`\sigma = s^2 n / q`. Since :math:`(\cos\theta, k)` depend on :math:`\sigma` only, the
whole update is :math:`h' = A\,h + B\,f` with :math:`A = \cos\theta - k s a/q`, :math:`B = k s`:
three row reductions and one two-term combination — no :math:`(\ldots, d)` temporary for
:math:`u` is kept for the backward.

Backward, for an upstream gradient :math:`g` (per row, with :math:`\langle h, u\rangle = 0`):

.. math::
    g_\sigma &= \cos\theta'(\sigma)\,\langle g, h\rangle + k'(\sigma)\, s\,\langle g, u\rangle,
    \qquad \mu = 2 g_\sigma s^2 / q, \\
    \nabla_f &= ks\,g + \mu f - \big(\mu a + ks\langle g,h\rangle\big)/q \; h, \\
    \nabla_h &= (\cos\theta - aks/q)\,g - \big(a\mu + ks\langle g,h\rangle\big)/q \; f
               + \big(\mu a^2/q^2 + 2aks\langle g,h\rangle/q^2 - 2 g_\sigma\sigma/q\big)\, h, \\
    \nabla_s &= \textstyle\sum_{\text{rows}} \big(k\langle g,u\rangle + 2 g_\sigma s n/q\big).

The coefficients and :math:`g_\sigma` come from the retraction itself:
:meth:`~manifoldlib.retractions.AngleRetraction.coefficients` and
:meth:`~manifoldlib.retractions.AngleRetraction.coefficients_vjp`. The gnomonic and Cayley
members (also as ``PRetraction(p=1)`` / ``(p=2)``) give closed-form derivatives; every other
:class:`~manifoldlib.retractions.AngleRetraction` — a user's own included — a vector-Jacobian
product through its coefficients on the small ``(..., 1)`` tensor :math:`\sigma`. For the built-in
retractions :math:`\nabla_s` is formed in closed form, from :math:`k + 2\sigma k'(\sigma) =
d(ks)/ds = \cos\theta/(1 + z^2)` and :math:`2\cos\theta'(\sigma) = -k/(1 + z^2)`,
:math:`z^2 = \sigma/p^2` (gnomonic :math:`c^3`, Cayley :math:`ck`, the exponential map :math:`c`):
the sum cancels at a long step (gnomonic: terms of order :math:`1/\beta`, the sum :math:`1/\beta^3`)
and would lose about :math:`\beta` ulps (:func:`_step_gradient`; the C++ row kernels likewise).

On contiguous float32/float64 CPU tensors the full-tensor passes run in the C++ kernels of
:mod:`manifoldlib._cpu_kernels` — forward: one pass for :math:`q, a, \|f\|^2` and one for
:math:`A h + B f` (4 reads, 1 write); backward: one pass for :math:`\langle g,h\rangle,
\langle g,f\rangle` and one writing both gradients (6 reads, 2 writes) — while the per-row
coefficient math above stays here (the literal step; the normalized step of a retraction
other than the built-ins is formed in ATen as :math:`\cos\theta\,h + ks\,u` from
:math:`u = P_h f` itself, projected twice, since its :math:`\rho` up to :math:`1/\varepsilon`
would magnify the cancellation in :math:`A h + B f`). A row nearly parallel to :math:`h`
(:math:`\|f\|^2 - a^2/q < \|f\|^2/8` from the double sums, where :math:`\|f\|^2 - a^2/q` and
:math:`A h + B f` in the input dtype would lose more than 3 bits and take the row off the sphere;
``test_user_retraction_literal_step_for_an_update_nearly_parallel_to_h`` in
``tests/nn/test_sphere_residual.py`` checks such rows stay on it to a few eps) is swept once
more by the first pass while it is in cache, for :math:`\|u\|^2` and :math:`\langle h, u\rangle`
of :math:`u = f - (a/q)h` in double, and the second pass writes it as :math:`\cos\theta\,h + ks\,u`
from :math:`u` itself, projected twice, in double; the other rows pay one comparison and get the
bits they got before. For the built-in retractions —
:class:`~manifoldlib.retractions.GnomonicRetraction`, :class:`~manifoldlib.retractions.CayleyRetraction`,
:class:`~manifoldlib.retractions.PRetraction` (any ``p``) and
:class:`~manifoldlib.retractions.ExponentialRetraction` (``p = inf``), and a user's subclass of
one that overrides none of ``angle``, ``coefficients``, ``coefficients_vjp`` (nor ``retract``, below)
— the whole update
runs row by row in C++ instead, with the closed forms
:math:`\cos\theta'(\sigma) = -k/(2(1 + z^2))` and :math:`k'(\sigma) = (\cos\theta/(1 + z^2) - k)/(2\sigma)`,
:math:`z^2 = \sigma/p^2` (its series :math:`-(1/6 + 1/(3p^2)) + 2(1/120 + 1/(6p^2) + 1/(5p^4))\sigma`
while :math:`\sigma` and :math:`z^2` are below :math:`10^{-5}`) (``sphere_step_forward`` /
``sphere_step_backward``): each row is read once per direction, its reductions, per-row math (in
double) and combination done while it is in cache — 2 reads and 1 write forward, 3 reads and 2
writes backward, against 6 + 1 and 6 + 2 for the separate passes (the update is bound by memory
traffic, so the pass count is its cost); they too form the result as :math:`\cos\theta\,h + ks\,u`
from :math:`u` itself, in double. Everywhere else (CUDA, other layouts, the separate passes under
``torch.compile`` tracing, ``MANIFOLDLIB_CPU_KERNELS=0``, a failed build) the passes are composed of
ATen kernels, and both step forms take :math:`\|u\|^2` and the result from :math:`u = P_h f` itself
(projected twice): :math:`\|f\|^2 - a^2/q` and :math:`A h + B f` cancel when :math:`f` is nearly
parallel to :math:`h`, which would turn rounding into a step and move the result off the sphere.

Under ``torch.compile``. The two row kernels are operators with fake (shape) functions and an
autograd formula (``manifoldlib/_cpu_kernels/sphere_step.py``, registered when the library loads),
and the forward calls them the same way eager or traced: inductor keeps each as one opaque call
in its graph (the step :math:`s` enters as a tensor, so the learnable :math:`\alpha` needs no
graph break), and a compiled update runs the kernels an eager one runs, with their values and
gradients (the step and the sum of the per-row :math:`dL/ds` computed by inductor: float64 within
a few ulps). The separate passes are not traced: ``forward_dots`` returns tensors whose size
depends on the values (the rescaled and nearly parallel rows), so a user's retraction compiles to
the ATen path, which inductor fuses. The decision is guarded like any traced branch: a graph
traced outside :func:`manifoldlib._cpu_kernels.disabled` is traced anew inside it (ATen path).

Whose map runs. The update above is the angle form :math:`\cos\theta\,h + k\,v` of
:meth:`~manifoldlib.retractions.AngleRetraction.retract`, computed from the class's
``coefficients``; it is the class's own map only while that ``retract`` is the one the class runs.
A class that overrides ``retract`` (an :class:`~manifoldlib.retractions.AngleRetraction` subclass,
or a subclass of a built-in) defines its map there, and ``Sphere.retr`` and
:func:`~manifoldlib.testing.assert_retraction` use it; the fast path would silently train with
another map (an arctan angle with a Cayley ``retract``: rows far from ``retract``'s at a
long step; ``tests/nn/test_sphere_residual_own_retract.py`` checks every path against the class's
own ``retract``). So such a class takes :func:`sphere_residual_reference`, which
calls its ``retract`` (plain autograd, on every device), unless that ``retract`` is recognized as
:meth:`AngleRetraction.retract <manifoldlib.retractions.AngleRetraction.retract>` reached directly or
through pure forwards, ``return super().retract(x, v, radius)`` (``_retract_is_angle_form``, checked on
the compiled code, not by sampling; the rule is in the module docstring of
:mod:`manifoldlib.retractions.sphere`, *Whose map runs*, and ``Sphere.retr`` asks the same before its
long-step fallback). No declaration lets a ``retract`` of its own claim agreement with the angle form:
a wrong claim is this bug again. A class that wants the fast path defines its map through ``angle``
(or ``coefficients``) and inherits ``retract``. An instance with ``retract`` or one of the angle
methods set on itself takes the reference path too.

Rows of tiny (or huge) norm. :math:`q = \|h\|^2` underflows for float32 rows of norm below about
:math:`10^{-19}` and float64 rows below :math:`10^{-154}`, and the per-row math meets terms such as
:math:`a^2 \sim \|h\|^4` and :math:`a\langle g,h\rangle \sim \|h\|^3` far earlier; with :math:`q`
floored at the dtype's smallest normal, such rows came back off their sphere without a sign. The
update is homogeneous of degree 1 in :math:`(h, f)` together, its gradients in :math:`h, f` of
degree 0 and in :math:`s` of degree 1. So the C++ kernels compute a row whose :math:`q` (summed in
double) is out of their range (float32: norms outside :math:`2^{\pm 24}`, float64:
:math:`2^{\pm 200}`), or whose :math:`\|f\|` or :math:`\|h\|\,\|f\|` passes :math:`2^K`
(:math:`K` = 48 float32, 400 float64: the separate passes' math in the input dtype forms
:math:`a^2 \sim \|h\|^2\|f\|^2`), on :math:`(h, f)\,2^{-e}` by the rule of
:func:`sphere_residual_reference` below: :math:`2^e` the power of two of its largest :math:`|h_i|`, or
a larger one where :math:`f\,2^{-e}` would pass :math:`2^K`. They do it while the row is in cache,
and scale back; a power of two scales exactly, so such a
row gets the bits of its twin in range (for rows whose largest entry is a normal number and whose
update is in range, *An update out of range* below), and a
row in range pays a few comparisons (``sphere_residual.cpp`` has the details). The ATen path cannot
do that without another pass over every row (the row's largest entry, or scaled copies:
``vector_norm`` does not rescale, :math:`\|h\|` underflows with :math:`q`), so there a row whose
:math:`q` is not above :data:`_ATEN_Q_FLOOR` (float32 :math:`2^{-64}`: norms below
:math:`2^{-32} \approx 2.3\cdot 10^{-10}`; float64 :math:`2^{-600}`: norms below
:math:`2^{-300} \approx 4.9\cdot 10^{-91}`) comes out NaN, its values and gradients, and with them
the gradient in :math:`s` (a sum over rows): loud rather than silently off the sphere, at the cost
of one elementwise op on the :math:`(\ldots, 1)` tensor :math:`q` (it replaces the floor's clamp).
Rows above the floor get the bits they got before. :func:`sphere_residual_reference` rescales as the
kernels do, with the ``(..., 1)`` largest :math:`|h_i|` it reads for the zero rows anyway and three
more elementwise passes (no host read): a row outside :data:`_REFERENCE_RANGE` is computed on
:math:`(h, f)\,2^{-e}` (a larger :math:`e` where :math:`f\,2^{-e}` would pass :math:`2^K`), the
scalings passing the upstream gradient through unscaled and :math:`dL/ds` taking its :math:`2^e` through a
per-row step, so that such a row gets its twin's values, gradients and :math:`dL/ds`, bit for bit
(``test_the_reference_computes_rows_of_tiny_and_huge_norm_as_their_twins_in_range``). Huge rows are
left as they were on the ATen path: there the per-row math overflows to inf or NaN gradients (float32 norms above about
:math:`2^{42}`), which is loud already, while the values stay right until :math:`q` overflows.

An update out of range. A nonzero row whose :math:`n = \|P_h f\|^2` or :math:`\sigma = s^2 n/q`
is beyond the input dtype's largest number (float32: :math:`\|P_h f\|` or the literal step's
:math:`\beta = \sqrt\sigma` past about :math:`1.8\cdot 10^{19}`; float64: past about
:math:`1.3\cdot 10^{154}`; e.g. a diverged sub-layer's output) comes out NaN on every path, its
values and gradients, and with them the gradient in :math:`s`. The ATen path forms :math:`n` and
:math:`\sigma` in the input dtype and cannot rescale them without another pass over every row;
there :math:`\sigma = \infty` gave the gnomonic map :math:`\cos\theta = k = 0`, the row 0, off its
sphere, and other maps NaN values, or values with NaN gradients. The C++ kernels, which form both
in double and could compute most such rows, refuse the same rows (two comparisons per row; a
rescaled row's own :math:`n`, not its scaled copy's), and so does
:func:`sphere_residual_reference` (the angle forms of the retractions meet :math:`\sigma = \infty`
there too): a run gives the same rows NaN on CPU and GPU, kernels on or off.
``test_an_update_whose_squares_overflow_comes_out_nan_on_every_path`` and
``test_a_literal_step_whose_sigma_overflows_comes_out_nan_on_every_path`` check every path. The
ATen path tells such a row by :math:`\sigma = \infty` (:math:`n = \infty` makes it :math:`\infty`,
or NaN through :math:`n/D` below) and makes it NaN: one elementwise op on a :math:`(\ldots, 1)`
tensor. Within a small factor of that bound the paths' roundings (and the ATen path's intermediate
products) decide. The normalized step's :math:`\sigma` is at most :math:`s^2`, so there only
:math:`n` can leave the range (the update itself does not depend on the scale of :math:`f`). A zero
row is not refused: it is kept (below).

A step far longer than its row. The normalized step's :math:`\rho = r/\sqrt D`,
:math:`D = n + \varepsilon^2 q`, is of order :math:`\|h\|/\|P_h f\|`, and :math:`(s\rho)^2` and
:math:`q/D` of order :math:`\|h\|^2/\|P_h f\|^2`: for a row with :math:`\|P_h f\|/\|h\|` past
:math:`2^{63}` (float32) or :math:`2^{511}` (float64), in range otherwise, they are subnormal or 0,
and :math:`\sigma = (s\rho)^2 n/q` formed from them left the row off its sphere (float32, ATen
path) or made the step the identity (float64, every path). So every path forms
:math:`\rho = \sqrt q/\sqrt D` and :math:`\sigma = s^2 (n/D)`, ratios of numbers in range, and the
backward groups its products so that none is smaller than the coefficient it forms (:math:`\mu`
as :math:`(g_\sigma/q)(s\rho)^2` from the left, :math:`(a/q)^2` never formed: it overflows first).
The coefficients themselves are what they are: :math:`\nabla_f`'s coefficient of :math:`f`,
:math:`\mu - w`, is of order :math:`\|g\|\,\|h\|/\|P_h f\|^2` (its product with :math:`f` of
order :math:`\|g\|\,\|h\|/\|P_h f\|`), and where it leaves the dtype's normal range that
gradient loses precision, as a product of subnormal numbers does. The C++ row kernels combine a
rescaled row's :math:`f`-terms at a power of two that keeps them normal, and rescale every row whose
:math:`\|f\|` passes :math:`2^K` (above), where that coefficient leaves the normal range for an
upstream gradient of order 1 (float32 :math:`h` of norm :math:`2^{-20}` with :math:`f` of
:math:`2^{55}`); the other paths, and the row kernels for a far smaller upstream gradient, meet
the limit. ``test_a_step_far_longer_than_its_row_is_exact_on_every_path``
in ``tests/nn/test_sphere_residual_normalized.py`` checks every path.

A zero row of h. Outside the contract (its sphere has radius 0), but defined, the same on every
path: the sphere of radius 0 is the point 0 and its tangent space is :math:`\{0\}`, so
:math:`P_h f = 0`, the step is 0 and the row is kept, :math:`h' = h`, with the gradients of a step 0:
:math:`\nabla_h = g`, :math:`\nabla_f = 0`, nothing added to :math:`\nabla_s`
(:class:`~manifoldlib.nn.SphereResidual` has the math;
``test_a_zero_row_of_h_is_kept_with_the_gradients_of_the_identity_on_every_path`` in
``tests/nn/test_sphere_residual.py`` checks every path). Each path runs the formulas above with :math:`q = 1` (any
:math:`q > 0`: :math:`a = \langle 0, f\rangle = 0`, and :math:`q` multiplies nothing but
:math:`h = 0`), the row's step :math:`s` times 0, and :math:`\|P_h f\|^2 = \langle g, P_h f\rangle = 0`
as :math:`P_0 f = 0` (not :math:`\|f\|^2` and :math:`\langle g, f\rangle`, which overflow for an
:math:`f` of large entries, and a step 0 times :math:`\infty` is NaN; a zero row is kept whatever
:math:`f`'s scale, ``test_a_zero_row_of_h_is_kept_whatever_the_scale_of_f``): :math:`\sigma = 0`,
:math:`\cos\theta = k = 1`, :math:`h' = 1\,h + 0\,u`; in the backward :math:`\mu = t = 0` and
:math:`dL/ds = 0`, so :math:`\nabla_f = 0\,g + 0\,f`, :math:`\nabla_h = 1\,g`. The kernels' dots give
:math:`q = 0` for a zero row only (every other row is in range or rescaled into it); the row kernels
write it as :math:`h` and its gradients as :math:`1\,g` and :math:`0\,g`, and mark it with
:math:`q = 0` in their stats; the ATen path tells it by its largest and smallest entry (two more
reductions over :math:`h`, read-only), since there :math:`q = 0` also for a nonzero row whose squares
underflow, which stays NaN; :func:`sphere_residual_reference` computes the update on a row of ones in
place of a zero row and on :math:`0\cdot f`, and takes :math:`h + 0\cdot R`.

A non-finite entry of :math:`f` in a zero row of :math:`h` gives what a non-finite input gives every
other row: the row NaN, its values and its gradients in :math:`h` and :math:`f`, and with them the
gradient in :math:`s` (as an update out of range does), on every path. The row's
:math:`a = \langle 0, f\rangle = \sum_i 0\cdot f_i` is 0, or NaN exactly where an entry of :math:`f`
is not finite (:math:`0\cdot\infty` is NaN; no square of :math:`f` is formed, so a finite :math:`f`
of any scale still gives 0), and each path carries it into the row: the ATen path takes
:math:`\|P_0 f\|^2 = a` (:math:`\sigma` NaN), the row kernels write :math:`h + a`, the gradients
:math:`(1 + a)\,g` and :math:`a\,g` and :math:`dL/ds = a`, and the reference blends with the factor
:math:`1 + a` in place of 1 (``test_a_zero_row_of_h_with_a_non_finite_f_comes_out_nan_on_every_path``).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .. import _cpu_kernels
from .._numbers import is_real
from ..functional.sphere import (
    sphere_normalized_sq_step,
    sphere_project_tangent,
    sphere_unit_tangent,
)
from ..retractions.base import Retraction
from ..retractions.sphere import (
    _ANGLE_MATH,
    AngleRetraction,
    CayleyRetraction,
    ExponentialRetraction,
    GnomonicRetraction,
    PRetraction,
    _retract_is_angle_form,
)

__all__ = ["sphere_residual", "sphere_residual_reference"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float32, torch.float64)
#: The ATen path's floor on :math:`q = \|h\|^2`: a row below it comes out NaN (module docstring).
#: The per-row math has terms of degree three in the row's scale (:math:`a\langle g,h\rangle`,
#: :math:`\mu a^2`) that leave the normal range first: the floor's norm, :math:`2^{-32}` (float32)
#: and :math:`2^{-300}` (float64), sits about :math:`2^6` and :math:`2^{30}` above the norms where the
#: values or gradients start to lose accuracy (for updates with :math:`\|f\|` down to
#: :math:`10^{-6}\|h\|`).
_ATEN_Q_FLOOR = {torch.float32: 2.0**-64, torch.float64: 2.0**-600}


def _rowsq(x: torch.Tensor) -> torch.Tensor:
    """Row-wise squared norm, ``(..., d) -> (..., 1)``: ``vector_norm`` is a single-pass reduction,
    about 3x faster on CPU than ``vecdot(x, x)`` (which materializes ``x * x``)."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()


def _zero_rows(x: torch.Tensor) -> torch.Tensor:
    """``(..., d) -> (..., 1)``: whether the row is zero, from its largest and smallest entry (two
    single-pass reductions: ``vector_norm(x, inf)`` runs about 40x slower than ``amax`` on CPU, and
    ``x == 0`` would materialize a ``(..., d)`` mask). A NaN row is not zero."""
    return (x.amax(-1, keepdim=True) == 0) & (x.amin(-1, keepdim=True) == 0)


#: The range of a row's largest :math:`|h_i|` that :func:`sphere_residual_reference` computes as it
#: is (float32: norms of about :math:`2^{\pm 24}`, float64 :math:`2^{\pm 200}`, as the C++ kernels), the
#: power of two :math:`2^K` that a rescaled row's largest :math:`|f_i|` may reach, and the bound on
#: :math:`|e|` that keeps :math:`2^{\pm e}` normal numbers. A row outside the range is computed on
#: :math:`(h, f)\,2^{-e}`: plain autograd meets :math:`q` and terms of higher degree in the row's
#: scale, which leave the range (inf gradients in :math:`h`, values off the sphere) long before the
#: row's entries do.
_REFERENCE_RANGE = {torch.float32: (2.0**-24, 2.0**24, 48, 126), torch.float64: (2.0**-200, 2.0**200, 400, 1022)}


def _largest(x: torch.Tensor) -> torch.Tensor:
    """``(..., d) -> (..., 1)``: the largest ``|x_i|`` of each row (NaN for a row with a NaN), detached."""
    return torch.maximum(x.amax(-1, keepdim=True), -x.amin(-1, keepdim=True)).detach()


def _reference_factors(largest_h: torch.Tensor, largest_f: torch.Tensor) -> torch.Tensor:
    """The factor :math:`2^{-e}` of each row for :func:`sphere_residual_reference`, ``(..., 1)``, from its
    largest ``|h_i|`` and ``|f_i|``: 1 for a row in :data:`_REFERENCE_RANGE`, a zero row and a
    non-finite one; for the others :math:`2^e` the power of two of the largest :math:`|h_i|`, as the
    C++ kernels take it, or a larger one where :math:`f 2^{-e}` would pass :math:`2^K` (its squares
    would overflow where the row's own do not). Powers of two: a rescaled row's values are its twin's
    times :math:`2^{-e}`, bit for bit."""
    low, high, reach, bound = _REFERENCE_RANGE[largest_h.dtype]
    exponent = torch.frexp(largest_h).exponent  # (..., 1) int32, 0 for 0, inf and NaN
    of_f = torch.frexp(largest_f).exponent - reach  # (..., 1)
    # a zero f (frexp's exponent 0) or a non-finite one sets no bound, as in the C++ kernels
    exponent = torch.maximum(exponent, torch.where(largest_f.isfinite() & (largest_f > 0), of_f, exponent))
    exponent = exponent.clamp(-bound, bound).to(largest_h.dtype)  # 2^±e normal numbers
    keep = ~((largest_h < low) | (largest_h > high)) | (largest_h == 0) | ~largest_h.isfinite()
    return torch.where(keep, 1.0, torch.exp2(-exponent))


def _scaled(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``x * factor`` (a ``(..., 1)`` power of two per row) with the gradient of ``x`` itself: the
    value of the product, exactly, and a backward that passes the gradient through unscaled."""
    return (x * factor).detach() + (x - x.detach())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(..., d) -> (N, d)`` view of a contiguous tensor, the layout the C++ kernels take."""
    return x.view(-1, x.shape[-1])


def _kernels_take(h: torch.Tensor, f: torch.Tensor) -> bool:
    """Whether the C++ kernels take ``h`` and ``f``: contiguous float32/float64 CPU tensors, when the
    kernels are built and not switched off. The cheap checks come first, so the build is only ever
    triggered by a call that could use it; under ``torch.compile`` the answer is the traced
    graph's, guarded on the inputs' device, dtype and layout and on
    :func:`~manifoldlib._cpu_kernels.disabled`."""
    return (
        h.device.type == "cpu"
        and h.dtype in _KERNEL_DTYPES
        and f.dtype == h.dtype
        and h.numel() > 0
        and h.is_contiguous()
        and f.is_contiguous()
        and _cpu_kernels.in_use()
    )


def _separate_passes_for(h: torch.Tensor, f: torch.Tensor):
    """The C++ kernels' namespace for the separate passes (a retraction's own per-row math between
    them) when they take ``h`` and ``f``, else ``None`` (ATen path). Not under ``torch.compile``
    tracing: ``forward_dots`` returns tensors whose size depends on the values (the rescaled and
    the nearly parallel rows, empty when there are none), which the Python math branches on, and the
    combinations write into their arguments; inductor fuses the ATen path there instead."""
    if torch.compiler.is_compiling() or not _kernels_take(h, f):
        return None
    return _cpu_kernels.enabled()


def _built_in_math(retraction: Retraction) -> type | None:
    """The built-in angle retraction whose math ``retraction`` runs: its own class, or the built-in
    a subclass derives from without overriding any of :data:`_ANGLE_MATH` (a name, options or a
    ``retract`` of its own change nothing the update computes). ``None`` for anything else."""
    kind = type(retraction)
    for base in (GnomonicRetraction, CayleyRetraction, ExponentialRetraction, PRetraction):
        if issubclass(kind, base) and all(getattr(kind, name) is getattr(base, name) for name in _ANGLE_MATH):
            return base
    return None


def _kernel_family(retraction: Retraction) -> tuple[int, float] | None:
    """The C++ row kernels' code ``(family, p)`` of a built-in angle retraction, else None.

    Gnomonic ``(0, 1)``, Cayley ``(1, 2)``, the p-family ``(2, p)`` with the exponential map as
    ``p = inf``; a subclass that keeps its built-in's math counts as that built-in
    (:func:`_built_in_math`). A subclass that overrides the angle or its coefficients takes the
    separate passes with the per-row math of its own coefficients. (Only reached for a class whose
    ``retract`` is the angle form: :func:`_retract_is_angle_form`.)
    """
    kind = _built_in_math(retraction)
    p = float(retraction.p) if kind is PRetraction else None
    if kind is GnomonicRetraction or p == 1.0:
        return 0, 1.0
    if kind is CayleyRetraction or p == 2.0:
        return 1, 2.0
    if kind is ExponentialRetraction:
        return 2, math.inf
    if p is not None:
        return 2, p
    return None


def _step_gradient(retraction, sigma, c, k, g_u, g_h, g_sigma, step_n_q):
    r""":math:`dL/dt` per row for the step :math:`t` (:math:`\sigma = t^2 n/q`), ``(..., 1)``:
    :math:`k\langle g,u\rangle + 2g_\sigma tn/q`. For the built-in retractions in closed form,
    :math:`(c\langle g,u\rangle - k\langle g,h\rangle tn/q)/(1 + z^2)`, :math:`z^2 = \sigma/p^2`
    (:math:`\theta'(\beta) = 1/(1 + z^2)`, so :math:`d(kt)/dt = c/(1 + z^2)` and
    :math:`2\cos\theta'(\sigma) = -k/(1 + z^2)`): the sum holds :math:`k + 2\sigma k'(\sigma)`, whose
    terms cancel to :math:`c/(1 + z^2)` (gnomonic: :math:`k \sim 1/\beta`, the sum
    :math:`c^3 \sim 1/\beta^3`) and lose :math:`\beta` ulps at a long step. A user's retraction keeps
    the sum, from its own ``coefficients_vjp`` (``g_sigma``)."""
    family = _kernel_family(retraction)
    if family is None:
        return k * g_u + 2.0 * g_sigma * step_n_q
    one_z = 1.0 + sigma / (family[1] * family[1])  # p = inf (the exponential map): 1
    return (c * g_u - k * g_h * step_n_q) / one_z


class _SphereResidual(torch.autograd.Function):
    # Autocast is switched off inside: it would run the row products (matmuls) in bf16. The
    # inputs arrive in one floating dtype (float32 or float64) and all arithmetic stays in it.

    @staticmethod
    def forward(ctx, h, f, scale, retraction, eps):
        with torch.autocast(h.device.type, enabled=False):
            return _SphereResidual._forward(ctx, h, f, scale, retraction, eps)

    @staticmethod
    def _forward(ctx, h, f, scale, retraction, eps):
        # Full-tensor passes. C++ kernels (literal step): one pass for ||h||², <h, f>, ||f||², one
        # for A h + B f. ATen: ||h||², ||f||² (single-pass norms), h∘f into the output buffer and
        # its row sum, then A·h + B·f written over that same buffer; the normalized step instead
        # forms P_h f in that buffer (projected twice) and writes c h + ks P_h f over it, in ATen
        # whatever the device. Either way the output is the only (..., d) allocation: on CPU a
        # fresh large tensor costs page faults comparable to a pass. Both paths allocate it
        # before the small (..., 1) tensors (the backward likewise its gradients), so the
        # allocator sees one pattern whichever path runs.
        kernels = _separate_passes_for(h, f) if eps is None else None
        down = None  # (..., 1): the factors 2^-e of rows the kernels rescaled, if any
        parallel = None  # (N, 3) double: [a/q, ν, ||P_h f||²] of nearly parallel rows, if any
        if kernels is None:
            q = _rowsq(h)  # (..., 1)
            # (..., d), scratch for <h, f>, then the result; contiguous whatever h's layout (dynamo
            # refuses a non-contiguous out= below)
            out = torch.mul(h, f, out=torch.empty(h.shape, dtype=h.dtype, device=h.device))
            a = out.sum(-1, keepdim=True)  # (..., 1)
            # a zero row is kept (below); q = 0 does not tell it from a row whose squares underflow
            zero = _zero_rows(h)  # (..., 1)
            # a row of tiny norm: NaN rather than off its sphere (one op, as the clamp it replaces)
            q = torch.nn.functional.threshold(q, _ATEN_Q_FLOOR.get(h.dtype, torch.finfo(h.dtype).tiny), math.nan)
        else:
            out = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # (..., d)
            # (N, 3), accumulated in double; a row whose ||h||² is out of range: the dots of
            # (h, f) 2^-e, and its factor 2^-e in `factors` (empty if no row was rescaled). The
            # coefficients A, B below are ratios of the dots, the same for the scaled row. A
            # nearly parallel row: its a/q, ν and ||P_h f||² from P_h f itself in `parallel`
            # (empty if no row was flagged).
            dots, factors, parallel = kernels.forward_dots(_rows(h), _rows(f))
            q, a, f_sq = dots.view(*h.shape[:-1], 3).split(1, dim=-1)  # (..., 1) each
            zero = q == 0  # only a zero row: the others are in range or rescaled into it
            if factors.numel():
                down = factors.view(*h.shape[:-1], 1)
            if not parallel.numel():
                parallel = None
        # a zero row: the update of a step 0 (module docstring), computed with q = 1 (h = 0, a = 0)
        q = torch.where(zero, 1.0, q)
        s = scale.to(h.dtype) * (~zero).to(h.dtype)  # (..., 1): the step, 0 for a zero row
        if kernels is None:
            # ||P_h f||² from P_h f itself, for both step forms: the difference form
            # ||f||² - <h, f>²/||h||² cancels when f is nearly parallel to h (its rounding,
            # eps ||f||², then stands for the step), and so does A h + B f, whose B f and
            # B (a/q) h agree in their normal part: both lose eps ||f||²/||P_h f||² of the
            # dtype (relative), and the row leaves its sphere by the rounding that exposes
            torch.addcmul(f, h, -a / q, out=out)  # (..., d): u = P_h f, kept for the combination
            normal = (h.unsqueeze(-2) @ out.unsqueeze(-1)).squeeze(-1) / q  # (..., 1): h left in u
            out.addcmul_(h, -normal)  # projected twice: tangent to rounding
            n = _rowsq(out)  # (..., 1)
        else:
            # The dots are summed in double but come back in the input dtype: the difference form
            # loses eps ||f||²/||P_h f||² of that dtype, and A h + B f below cancels in its normal
            # part, when f is nearly parallel to h (both lose eps ||f||²/||P_h f||² of the input
            # dtype, relative). forward_dots flags such rows (cancellation
            # beyond 3 bits) and sweeps them once more while they are in cache: their ||P_h f||²
            # comes from P_h f itself, and forward_combine writes them as c h + ks u in double.
            n = (f_sq - a * a / q).clamp_min(0.0)  # ||P_h f||², (..., 1)
            if parallel is not None:
                par = parallel.view(*h.shape[:-1], 3)
                n = torch.where(par[..., :1].isnan(), n, par[..., 2:].to(h.dtype))
        # a zero row: ||P_0 f||² = 0, not ||f||², which may overflow (and 0 inf is NaN); its a = <0, f>
        # is that 0, or NaN where f has a non-finite entry, which makes the row NaN (module docstring)
        n = torch.where(zero, a, n)
        rho = None
        if eps is None:  # literal
            sigma = s * s * n / q  # (..., 1)
        else:  # normalized: σ = (s rho)² n/q as a ratio (module docstring, *A step far longer than its row*)
            denominator = n + (eps * eps) * q  # D = ||P_h f||² + eps² r², (..., 1)
            rho = q.sqrt() / denominator.sqrt()  # r / sqrt(D)
            sigma = s * s * (n / denominator)  # (..., 1)
            s = s * rho  # the per-row step of the literal form
        # ||P_h f||² or σ past the dtype (n = inf makes σ inf, or NaN through n/D): NaN, the row
        # and its gradients (module docstring, *An update out of range*); one op, NaN stays NaN
        sigma = sigma.nan_to_num(nan=math.nan, posinf=math.nan)
        c, k = retraction.coefficients(sigma)
        ks = k * s
        coef_h = c - ks * a / q  # A, (..., 1)
        if kernels is None:
            out.mul_(ks).addcmul_(h, c)  # (..., d): c h + ks u, on the sphere to rounding
        else:
            coef = [coef_h.contiguous(), ks.expand_as(coef_h).contiguous()]  # A, B: (..., 1)
            if parallel is None:
                kernels.forward_combine(_rows(h), _rows(f), coef, _rows(out))
            else:  # the flagged rows: c h + ks u in double
                coef.append(c.expand_as(coef_h).contiguous())
                kernels.forward_combine(_rows(h), _rows(f), coef, _rows(out), parallel)
        ctx.save_for_backward(h, f, s, q, a, n, sigma, c, k, rho, down, zero)
        ctx.retraction, ctx.eps = retraction, eps
        ctx.kernels = kernels
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        with torch.autocast(g.device.type, enabled=False):
            return _SphereResidual._backward(ctx, g)

    @staticmethod
    def _backward(ctx, g):
        h, f, s, q, a, n, sigma, c, k, rho, down, zero = ctx.saved_tensors
        want_h, want_f, want_s = ctx.needs_input_grad[:3]
        kernels = ctx.kernels
        if not (g.is_contiguous() and g.dtype == h.dtype and g.device == h.device):
            kernels = None  # e.g. an expanded gradient: the ATen passes read it in place
        if kernels is None:
            # The products g∘h and g∘f are formed in the two buffers that then receive the
            # gradients, so the backward allocates only what it returns.
            buf_f = torch.mul(g, h)  # (..., d), scratch for <g, h>, then grad_f
            g_h = buf_f.sum(-1, keepdim=True)  # <g, h>, (..., 1)
            buf_h = torch.mul(g, f)  # (..., d), scratch for <g, f>, then grad_h
            g_f = buf_h.sum(-1, keepdim=True)  # <g, f>, (..., 1)
        else:  # the gradients' buffers first, as in the forward
            grad_f = torch.empty(h.shape, dtype=h.dtype, device=h.device) if want_f else None
            grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if want_h else None
            dots = kernels.backward_dots(_rows(g), _rows(h), _rows(f))  # (N, 2)
            g_h, g_f = dots.view(*h.shape[:-1], 2).split(1, dim=-1)  # (..., 1) each
        if down is not None:  # the per-row math below is that of the rescaled rows (h, f) 2^-e
            g_h, g_f = g_h * down, g_f * down
        # <g, u>, (..., 1); a zero row: <g, P_0 f> = 0, not <g, f>, which may overflow
        g_u = torch.where(zero, 0.0, g_f - a / q * g_h)
        g_sigma = ctx.retraction.coefficients_vjp(sigma, c, k, g_h, s * g_u)
        ks = k * s
        along = a / q  # (..., 1)
        # Products grouped so that none is smaller than the coefficient it forms: s² and a ks are
        # of order ||h||²/||P_h f||² and ||h||² in the normalized step, and (a/q)² of order
        # ||f||²/||h||² (module docstring, *A step far longer than its row*)
        mu = 2.0 * (g_sigma / q) * s * s
        t = mu * along + ks * (g_h / q)  # shared coefficient, (..., 1)
        grad_s = None
        # grad_f = ks g + mu_f f - t h,  grad_h = coef_g g - t f + coef_h h  (row coefficients)
        mu_f = mu
        g_step = _step_gradient(ctx.retraction, sigma, c, k, g_u, g_h, g_sigma, (s / q) * n)  # dL/ds per row
        if want_h:
            coef_g = c - ks * along
            coef_h = (mu * along + 2.0 * ks * (g_h / q)) * along - 2.0 * g_sigma * sigma / q
        if rho is not None:
            # the per-row step s rho depends on h and f: s rho = s r D^(-1/2), D = n + eps² q,
            # n = ||P_h f||² (dn/df = 2u, dn/dh = -2(a/q)u), q = ||h||² (dq/dh = 2h)
            floor_sq = ctx.eps * ctx.eps
            denominator = n + floor_sq * q  # D, (..., 1)
            w = g_step * s / denominator  # (..., 1)
            w_along = w * along
            mu_f = mu - w
            t = t - w_along
            if want_h:
                coef_h = coef_h - w_along * along + g_step * s * (1.0 / q - floor_sq / denominator)
        if down is not None:  # the coefficients of h and f act on (h, f) 2^-e (exact: powers of two)
            t, mu_f = t * down, mu_f * down
            if want_h:
                coef_h = coef_h * down
        if kernels is None:
            grad_h = grad_f = None
            if want_f:
                grad_f = torch.mul(g, ks, out=buf_f)  # (..., d)
                grad_f.addcmul_(f, mu_f).addcmul_(h, -t)
            if want_h:
                grad_h = torch.mul(g, coef_g, out=buf_h)  # (..., d)
                grad_h.addcmul_(f, -t).addcmul_(h, coef_h)
        elif want_f or want_h:
            # One pass reads g, h, f and writes both gradients; coefficients of g, h, f in turn.
            minus_t = -t
            of_f = [ks.expand_as(t), minus_t, mu_f.expand_as(t)] if want_f else []
            of_h = [coef_g, coef_h, minus_t] if want_h else []
            kernels.backward_combine(
                _rows(g), _rows(h), _rows(f),
                [coef.contiguous() for coef in of_f], [coef.contiguous() for coef in of_h],
                None if grad_f is None else _rows(grad_f),
                None if grad_h is None else _rows(grad_h),
            )
        if want_s:
            per_row = g_step if rho is None else g_step * rho  # d(s rho)/ds = rho; 0 for a zero row
            if down is not None:  # a rescaled row's dL/ds is 2^e times the scaled row's
                per_row = per_row / down
            grad_s = per_row.sum().reshape(())
        return grad_h, grad_f, grad_s, None, None


def _check_scale(scale) -> None:
    """A Python step must be a finite number; a tensor's values are not read (no device sync per
    call: :class:`~manifoldlib.nn.SphereResidual` passes a positive tensor by construction)."""
    if isinstance(scale, torch.Tensor):
        return
    if not (is_real(scale) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or a scalar tensor, got {scale!r}")


def _check(
    h: torch.Tensor, f: torch.Tensor, scale: torch.Tensor, retraction: Retraction, normalize_eps: float | None
) -> None:
    finite_positive = is_real(normalize_eps) and 0 < normalize_eps < float("inf")
    if normalize_eps is not None and not finite_positive:
        raise ValueError(f"normalize_eps must be None or a finite number > 0, got {normalize_eps!r}")
    if h.shape != f.shape:
        raise ValueError(f"h and f must have the same shape (..., d), got {tuple(h.shape)} and {tuple(f.shape)}")
    if h.dim() < 1:
        raise ValueError(f"h must have shape (..., d) with at least one dimension, got {tuple(h.shape)}")
    if scale.numel() != 1:
        raise ValueError(f"scale must be a scalar tensor, got shape {tuple(scale.shape)}")
    if not h.is_floating_point():
        raise ValueError(f"h must be a floating-point tensor, got dtype {h.dtype}")
    if normalize_eps is not None:
        # the floor eps² r² of D = ||P_h f||² + eps² r² must be a number of the dtype the rows are
        # computed in: below, a zero update (P_h f = 0, e.g. a zero-initialized sub-layer) has D = 0
        # and comes out NaN, values and gradients, on the ATen path and the reference
        work = torch.float32 if h.dtype in _LOW_PRECISION else h.dtype
        smallest = math.sqrt(torch.finfo(work).tiny)
        if normalize_eps < smallest:
            raise ValueError(f"normalize_eps must be at least {smallest:.3g} for {h.dtype} rows (computed in "
                             f"{work}, where its square must be a normal number), got {normalize_eps!r}")
    if not isinstance(retraction, Retraction):
        raise ValueError(f"retraction must be a sphere Retraction instance (e.g. get_retraction('sphere', "
                         f"'p')), got {retraction!r}")
    if retraction.manifold != "sphere":
        raise ValueError(f"retraction must be a sphere retraction, got {retraction!r} of {retraction.manifold!r}")


def sphere_residual(
    h: torch.Tensor,
    f: torch.Tensor,
    scale: torch.Tensor | float,
    retraction: Retraction,
    normalize_eps: float | None = None,
) -> torch.Tensor:
    r""":math:`R_h(s\,P_h(f))` with the analytic backward (the fast path).

    With ``normalize_eps`` :math:`\varepsilon` the update is the normalized tangent
    :math:`\hat f = rP_hf/\sqrt{\|P_hf\|^2 + \varepsilon^2r^2}`
    (:func:`~manifoldlib.functional.sphere_unit_tangent`), folded into the same passes: it is the
    literal update with the per-row step :math:`s\rho`, :math:`\rho = r/\sqrt{\|P_hf\|^2 +
    \varepsilon^2r^2}`, with :math:`\|P_hf\|^2` read from :math:`P_hf` itself (one more pass; the
    difference form :math:`\|f\|^2 - \langle h,f\rangle^2/r^2` cancels for :math:`f \parallel h`) and
    the backward carrying the derivatives of :math:`\rho` in :math:`h` and :math:`f`.

    Args:
        h: ``(..., d)`` points; the sphere radius of each row is read from :math:`\|h\|`. A zero
            row is kept (module docstring, *A zero row of h*). Nonzero rows of any norm whose
            largest entry is a normal number are exact where the C++ kernels run them; on the
            ATen path (CUDA, kernels off, a user's retraction in the normalized step, ...) a row
            of norm below :math:`2^{-32}` (float32) or :math:`2^{-300}` (float64) comes out NaN
            (see the module docstring).
        f: ``(..., d)`` update (e.g. a sub-layer output), any direction; only :math:`P_h(f)` acts.
            A nonzero row whose :math:`\|P_h f\|^2` or :math:`\sigma` is beyond the dtype's largest
            number comes out NaN on every path (module docstring, *An update out of range*).
        scale: step size :math:`s` (a scalar tensor, may require grad, or a finite number).
        retraction: a sphere :class:`~manifoldlib.retractions.AngleRetraction`; any other sphere
            retraction, and an angle retraction with a ``retract`` of its own (other than a
            plain ``super()`` forward; module docstring, *Whose map runs*), falls back to
            :func:`sphere_residual_reference`, which calls that ``retract``.
        normalize_eps: ``None`` (the literal step :math:`s P_h f`) or the relative floor
            :math:`\varepsilon > 0` of the normalized step, whose square must be a normal number of
            the dtype the rows are computed in (:math:`\varepsilon \ge` about :math:`1.1\cdot 10^{-19}`
            for float32 and half precision, :math:`1.5\cdot 10^{-154}` for float64; ``ValueError``
            otherwise).

    Returns:
        ``(..., d)`` points with the norms of ``h``. Half-precision inputs are computed in
        float32 and returned in their own dtype.
    """
    _check_scale(scale)
    scale = torch.as_tensor(scale, dtype=h.dtype, device=h.device)
    _check(h, f, scale, retraction, normalize_eps)
    if not (isinstance(retraction, AngleRetraction) and _retract_is_angle_form(retraction)):
        # a retract of its own is the class's map: the reference path calls it (module docstring)
        return sphere_residual_reference(h, f, scale, retraction, normalize_eps)
    eps = None if normalize_eps is None else float(normalize_eps)
    if h.dtype in _LOW_PRECISION:
        return _apply(h.float(), f.float(), scale.float().reshape(()), retraction, eps).to(h.dtype)
    return _apply(h, f.to(h.dtype), scale.reshape(()), retraction, eps)


def _apply(h, f, scale, retraction, eps):
    family = _kernel_family(retraction)
    if family is not None and scale.device == h.device and _kernels_take(h, f):
        # the row kernels: an operator with its autograd formula (_cpu_kernels/sphere_step.py), the
        # same call eager and under torch.compile (an opaque node of inductor's graph)
        out, _ = torch.ops.manifoldlib_cpu.sphere_step_forward(
            _rows(h), _rows(f), scale, *family, 0.0 if eps is None else eps
        )  # (N, d), (N, 3) stats for the backward
        return out.view(h.shape)
    return _SphereResidual.apply(h, f, scale, retraction, eps)


def sphere_residual_reference(
    h: torch.Tensor,
    f: torch.Tensor,
    scale: torch.Tensor | float,
    retraction: Retraction,
    normalize_eps: float | None = None,
) -> torch.Tensor:
    r""":math:`R_h(s\,P_h(f))` written with plain autograd: the reference the fast path is tested
    against, and the path for sphere retractions that are not :class:`AngleRetraction`.

    Same arguments and shapes as :func:`sphere_residual` (half-precision inputs likewise computed in
    float32). Rows of tiny or huge norm are computed rescaled by a power of two, as the C++ kernels
    do (module docstring, *Rows of tiny (or huge) norm*): their first derivatives are exact; a
    second derivative of such a row (double backward) is its rescaled twin's, :math:`2^e` times the
    row's own (the second derivatives in :math:`h, f` are of degree :math:`-1`).
    """
    _check_scale(scale)
    scale = torch.as_tensor(scale, dtype=h.dtype, device=h.device)
    _check(h, f, scale, retraction, normalize_eps)
    if h.dtype in _LOW_PRECISION:  # ||h||² and the normalized step's floor overflow/underflow there
        return sphere_residual_reference(h.float(), f.float(), scale.float(), retraction, normalize_eps).to(h.dtype)
    f = f.to(h.dtype)
    # A zero row is kept (module docstring): the update runs on a row of ones in its place and on 0 f
    # (P_0 f = 0: whatever f's scale, no square of it is formed; NaN for a non-finite f, as on the
    # fused path), and the blend below takes 0 times that result plus h.
    largest = _largest(h)  # (..., 1)
    zero = largest == 0  # (..., 1); a NaN row is not zero
    f_zero = 0.0 * f  # (..., d)
    f = torch.where(zero, f_zero, f)  # (..., d)
    # A row whose largest |h_i| is out of range is computed on (h, f) 2^-e, as the C++ kernels do
    # (module docstring, *Rows of tiny (or huge) norm*): exact, with the bits of its twin in range.
    # The scalings carry no gradient factor (the update is of degree 1 in (h, f), its Jacobians in
    # h and f of degree 0), so the twin's backward runs on the upstream gradient itself, not on
    # 2^e times it, which goes subnormal with a tiny row's coefficients; dL/ds, of degree 1, gets
    # its 2^e through a per-row step.
    down = _reference_factors(largest, _largest(f))  # (..., 1): 2^-e, or 1
    up = 1.0 / down  # (..., 1), exact
    point = _scaled(torch.where(zero, 1.0, h), down)  # (..., d)
    f = _scaled(f, down)  # (..., d)
    step = scale.detach() + (scale * up - (scale * up).detach())  # (..., 1): s, dL/ds times 2^e
    radius_sq = (point * point).sum(-1, keepdim=True)  # (..., 1)
    v = sphere_project_tangent(point, f, radius_sq)  # (..., d), P_h f
    tangent_sq = (v * v).sum(-1, keepdim=True)  # ||P_h f||², (..., 1)
    if normalize_eps is not None:  # r P_h f / sqrt(||P_h f||² + eps² r²), norm <= r
        v = sphere_project_tangent(point, sphere_unit_tangent(point, f, normalize_eps), radius_sq)
    v = step * v  # (..., d), tangent at h
    # ||P_h f||² (the row's own: the scaled row's times 2^2e) or σ past the dtype: the row and its
    # gradients NaN, as on the fused path (module docstring, *An update out of range*), through a
    # constant factor NaN (else 1)
    own_sq = tangent_sq.detach() * up * up  # (..., 1)
    out_of_range = own_sq.isinf() | sphere_normalized_sq_step(v, radius_sq).isinf()  # (..., 1)
    if isinstance(retraction, AngleRetraction):
        out = retraction.retract(point, v, radius=None)
    else:
        out = retraction.retract(point, v)
    out = _scaled(out, up) * torch.where(out_of_range, math.nan, 1.0)  # (..., d)
    # 1 for a zero row, 0 for the others; NaN for a zero row whose f has a non-finite entry (its
    # <0, f> NaN), which makes the row NaN, values and gradients, as on the fused path
    keep = torch.where(zero, 1.0 + f_zero.detach().sum(-1, keepdim=True), 0.0)  # (..., 1)
    return torch.addcmul(h * keep, out, 1.0 - keep)  # (..., d): out, or h for a zero row
