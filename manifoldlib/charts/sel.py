r"""SymExpLin (SEL): a curved chart in which additive raw steps become magnitude-relative changes.

Magnitude map and forward rule (:doc:`/theory/sel`):

.. math::
    E(x) = e_w\bigl(e^{\beta m x - n} - e^{-n}\bigr) = a\,\operatorname{expm1}(b x),
    \quad a = e_w e^{-n},\ b = \beta m, \qquad
    w_\text{eff} = \operatorname{sign}(w)\bigl(E(|w|) + l_w w\bigr) + \Delta
                 = \operatorname{sign}(w) E(|w|) + l_w |w| + \Delta.

The linear part of the forward rule is even, so it differs from the odd *congruent* rule
:math:`g(w) = \operatorname{sign}(w) E(|w|) + l_w w` on negative weights.

* ``init="congruent"``: :meth:`SEL.right_inverse` inverts the forward rule itself (positives: the
  root of :math:`E(x) + l_w x = y`; negatives: the root of :math:`E(t) - l_w t = |y|` beyond the
  minimum), so ``forward(right_inverse(W)) == W`` to rounding.
* ``init="mismatched"`` (default, the seed's choice): :meth:`SEL.right_inverse` inverts :math:`g`
  and the forward rule runs as above. Positives are realized exactly; a negative target
  :math:`y` is realized as :math:`y + 2 l_w |w|` (shrunk towards 0), in the linear regime by the
  factor :math:`(ab - l_w)/(ab + l_w)`.

Scales are positive and rank-1 per weight matrix (``out x in``): for each of :math:`e_w, l_w, m`
the chart holds a row vector ``(out, 1)`` and a column vector ``(1, in)`` of log-values,
:math:`s_{ij} = \exp(u_i + v_j)`; the offset is additive, :math:`n_{ij} = p_i + q_j`, so that
:math:`e^{-n}` is again a positive rank-1 factor. That is :math:`4(\text{out} + \text{in})` scale
parameters (:math:`3(\text{out}+\text{in})` with ``linear=False``); for a 1-D tensor each scale is
one scalar. :math:`\beta` is a fixed buffer, :math:`\beta = \kappa/(\sigma_0 m_0)`, so that
:math:`b\sigma_0 = \kappa` at the typical initial magnitude :math:`\sigma_0` — the exponential
regime starts where the weights are (the seed's curvature calibration). By default
(``calibration="weight"``) :math:`\sigma_0` is the RMS of the weight the chart is built on, its
actual initialization scale; ``calibration="width"`` uses the width rule
:math:`\sigma_0 = \text{gain}/\sqrt{\text{fan\_in}}` instead (the two agree for a
:math:`1/\sqrt{\text{fan\_in}}` initialization; a GPT-2 initialization at std 0.02 is 2–5x
smaller at widths 100–600). :math:`a = s_0 / b` keeps the slope :math:`E'(0) = s_0` fixed.

The fan-in is the map's input size, which depends on how the weight is stored: ``weight.shape[1]``
for ``layout="out_in"`` (:class:`torch.nn.Linear`, the default), ``weight.shape[0]`` for
``layout="in_out"`` (a Hugging Face ``Conv1D``, which stores :math:`W^\top`).
:func:`~manifoldlib.charts.apply_chart` passes each module's layout, so a GPT-2 ``Conv1D`` gets its
fan-in without ``fan_in=``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
from torch import nn

from .._numbers import is_real
from .base import Chart
from .inverse import solve_expm1_linear, solve_expm1_minus_linear
from .kernel import SEL_IMPLS, sel_forward_rule

__all__ = ["SEL", "SEL_CALIBRATIONS", "SEL_INITS", "SEL_LAYOUTS"]

#: Valid ``init`` names of :class:`SEL` (which rule :meth:`SEL.right_inverse` inverts).
SEL_INITS = ("mismatched", "congruent")
#: Valid ``calibration`` names of :class:`SEL` (where the typical magnitude :math:`\sigma_0` of
#: the curvature calibration comes from).
SEL_CALIBRATIONS = ("weight", "width")
#: Valid ``layout`` names of :class:`SEL`: how the weight stores its map, ``(out, in)``
#: (:class:`torch.nn.Linear`) or ``(in, out)`` (Hugging Face ``Conv1D``); the names of
#: :data:`manifoldlib.optim.LAYOUTS`.
SEL_LAYOUTS = ("out_in", "in_out")
DEFAULT_SLOPE = 0.75  # E'(0); with l_w = 0.25 the congruent rule has slope 1 at 0
DEFAULT_SCALE_INIT = {"l_w": 0.25, "m": 1.0, "n": 0.0}
_SCALE_KEYS = ("e_w", "l_w", "m", "n")


_HALF = (torch.float16, torch.bfloat16)


def _rule_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the forward rule runs in for raw coordinates of ``dtype``: float16 and bfloat16
    in float32, rounded once (the package's 16-bit rule)."""
    return torch.float32 if dtype in _HALF else dtype


@functools.cache
def _largest_clamp(dtype: torch.dtype) -> float:
    r"""The largest clamp :math:`M` for a weight stored in ``dtype``: :math:`\log(\text{finfo.max})`
    of ``dtype``, rounded down in the dtype the rule runs in so that :math:`\operatorname{expm1}(M)`
    computed there is at most ``finfo.max`` (a larger one is inf once the weight is rounded to
    ``dtype``). 88.72283172607422 for float32 (its log(max) rounds up to a number whose ``expm1``
    is inf), 709.782712893384 for float64, 11.089865684509277 for float16 and 88.71891784667969
    for bfloat16 (both computed in float32, whose ``expm1`` is finite up to 88.72283, but rounded
    to ``dtype``, whose range ends at 65504 and at 3.3895e38)."""
    top = torch.finfo(dtype).max
    largest = torch.tensor(math.log(top), dtype=_rule_dtype(dtype))
    while float(largest) > math.log(top) or not float(torch.expm1(largest)) <= top:
        largest = torch.nextafter(largest, torch.zeros_like(largest))
    return largest.item()


def _default_max_exponent(dtype: torch.dtype) -> float:
    r"""The default clamp :math:`\tfrac12\log(\text{finfo.max})` for a weight stored in ``dtype``
    (5.54 for float16, 44.36 for float32 and bfloat16, 354.9 for float64)."""
    return 0.5 * math.log(torch.finfo(dtype).max)


def _beyond_clamp(max_exponent, dtype: torch.dtype, then: str = "") -> str:
    """The one-line refusal of a clamp beyond :func:`_largest_clamp` of ``dtype``."""
    return (
        f"max_exponent must be at most log(finfo.max) = {math.log(torch.finfo(dtype).max):.4g} "
        f"for a {dtype} weight ({_largest_clamp(dtype)!r} computed in {_rule_dtype(dtype)}: "
        f"expm1 of a larger b|w| overflows the {dtype} weight to inf), got {max_exponent!r}{then}"
    )


def _positive(name: str, value) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` unless it is a finite number > 0 (a
    real or a one-element floating tensor; a bool or a string is not a number)."""
    tensor = isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()
    if not (tensor or is_real(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def _rms(weight: torch.Tensor) -> float:
    r"""The RMS of ``weight``, in float64 on the entries scaled by :math:`2^{-e}` with :math:`2^e`
    just above the largest magnitude: exact (a power of two), and the squares of float64 entries
    beyond :math:`10^{154}` no longer overflow, nor those below :math:`10^{-154}` underflow (a
    nonzero weight read as all-zero, calibrated by the width rule). 0 for an all-zero weight."""
    w = weight.detach().double()
    top = float(w.abs().max())
    if top == 0.0:
        return 0.0
    e = math.frexp(top)[1]  # top = m 2^e, 1/2 <= m < 1
    half = -e // 2  # two factors: 2^-e alone overflows for a subnormal top
    scaled = w * 2.0**half * 2.0 ** (-e - half)  # (...) entries in (-1, 1)
    return math.ldexp(float(scaled.square().mean().sqrt()), e)


def _explicit_clamp(max_exponent, dtype: torch.dtype) -> float:
    """An explicit ``max_exponent`` for a weight stored in ``dtype``, as a float; ``ValueError``
    unless it is a number in ``(0, _largest_clamp(dtype)]``."""
    value = _positive("max_exponent", max_exponent)
    # the weight is rounded to its own dtype (16-bit ones computed in float32): its range, not
    # the rule's, bounds the clamp; and M rounded to the rule's dtype, not M, must fit
    if value > _largest_clamp(dtype):
        raise ValueError(_beyond_clamp(max_exponent, dtype))
    return value


class SEL(Chart):
    r"""SymExpLin chart for one weight tensor (1-D or 2-D ``(out, in)``).

    Args:
        weight: the tensor the chart will carry; sets shape, dtype, device and the default fan-in.
        init: ``"mismatched"`` (default) or ``"congruent"`` — which rule :meth:`right_inverse`
            inverts (see the module docstring).
        linear: keep the linear path :math:`l_w w` (False: ablation without it).
        kappa: curvature at the typical initial magnitude, :math:`b\sigma_0 = \kappa` (> 0).
        calibration: where :math:`\sigma_0` comes from: ``"weight"`` (default; the RMS of
            ``weight`` — an all-zero tensor has no scale of its own and gets the width rule,
            recorded in :attr:`calibration`) or ``"width"``
            (:math:`\text{gain}/\sqrt{\text{fan\_in}}`). :attr:`sigma0` holds the value used.
        gain: initialization gain in :math:`\sigma_0 = \text{gain}/\sqrt{\text{fan\_in}}` (> 0),
            used with ``calibration="width"``.
        rank: rank of the optional LoRA-style residual :math:`\Delta = BA` (``B`` zero-initialized);
            0 disables it. Only for 2-D weights.
        slope: :math:`s_0 = E'(0) = ab` at initialization (> 0); default 0.75. Mutually exclusive
            with ``scale_init["e_w"]``.
        scale_init: initial values of ``"e_w"``, ``"l_w"`` (default 0.25), ``"m"`` (default 1) and
            ``"n"`` (default 0); ``e_w`` is derived from ``slope`` unless given. ``e_w, l_w, m``
            must be > 0, ``n`` finite.
        layout: how a 2-D ``weight`` stores its map: ``"out_in"`` (default;
            :class:`torch.nn.Linear`) or ``"in_out"`` (a Hugging Face ``Conv1D``); sets the
            default fan-in. :func:`~manifoldlib.charts.apply_chart` passes each module's.
        fan_in: overrides the fan-in (default: the map's input size, ``weight.shape[1]`` for
            ``layout="out_in"`` and ``weight.shape[0]`` for ``"in_out"``; ``numel`` for 1-D).
        max_exponent: clamp of :math:`b|w|` inside ``expm1`` against overflow of the value and its
            gradient (default :math:`\tfrac12\log(\text{finfo.max})` of the weight's dtype: 44.4
            in float32 and bfloat16, 5.54 in float16, 354.9 in float64); at most
            :math:`\log(\text{finfo.max})` of the weight's dtype, rounded down in the dtype the
            rule runs in (88.72283 for float32, 709.8 for float64, 11.09 for float16 and 88.719
            for bfloat16, which run in float32 but are rounded to their own range), beyond which
            ``expm1(M)`` overflows the weight to inf. Left to its default, it follows casts
            downwards: after ``module.half()`` a chart built in float64 or float32 clamps
            exactly like one built in float16 (5.54), after ``module.float()`` one built in
            float64 like one built in float32 (44.4); cast to a wider dtype, a chart keeps the
            clamp it has (its weight is unchanged: charted in float32, trained after
            ``module.half()`` and cast back with ``module.float()``, it still clamps at 5.54). Given explicitly, it is the clamp
            in every dtype, and a cast to a dtype it exceeds the limit of is refused
            (``ValueError`` naming that limit; lower :attr:`max_exponent` first). Within these
            bounds the scales can still carry the weight or its gradient past ``finfo.max``:
            per entry, below the clamp, the weight reaches :math:`a\,\operatorname{expm1}(M)`,
            its raw gradient :math:`a b\,e^{M}` and the gradient of :math:`\log m`
            :math:`a M e^{M}` (per unit upstream gradient; float32 at 88 with :math:`a = 4` gave
            an inf weight, with :math:`a = 1.5, b = 2` an inf raw gradient, with the default
            :math:`a = 0.75/b` an inf gradient of :math:`\log m`; float16 at its default 5.54
            with :math:`a > 46`). A clamp that lets one of them overflow at the chart's scales is
            refused at construction, at a cast, when assigned and in :meth:`right_inverse`
            (``ValueError`` naming the quantity and the largest clamp for these scales); near
            the top of the range that leaves explicit clamps a few units below the limit above
            (float32 at :math:`a = 0.375`: 85.26). The forward does not check (that would
            synchronize with the device every step), so scales that training grows past these
            bounds give inf weights or gradients. The attribute :attr:`max_exponent` reads the clamp in effect in
            the chart's current dtype (after ``module.half()``, 5.54 for a default chart built in
            float32), and :attr:`requested_max_exponent` the value given here (None: the
            default).
        impl: how the forward rule runs: ``"fused"`` (default; one autograd function with a
            hand-written backward), ``"compile"`` (:func:`torch.compile`, fastest on CPU after a
            compile of some seconds per weight shape) or ``"autograd"`` (plain ops, reference).

    Raises:
        ValueError: for an unknown ``init`` or ``layout``, non-positive or non-finite scales,
            ``kappa``, ``gain`` or ``slope`` (bools and strings are not numbers), a ``linear``
            that is not a bool, a ``max_exponent`` out of range for the weight's dtype or
            that lets the weight or its gradient overflow at the initial scales (and
            later, casting the chart to a dtype it is out of range for), initial scales whose
            :math:`b` is not a positive finite number in the weight's dtype, a weight that is
            not finite or not 1-/2-D, or a bad ``rank``; and loading a state dict whose scales
            are not finite or whose ``beta`` is not a finite number > 0 (before any is copied).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        init: str = "mismatched",
        linear: bool = True,
        kappa: float = 1.0,
        calibration: str = "weight",
        gain: float = 1.0,
        rank: int = 0,
        slope: float | None = None,
        scale_init: Mapping[str, float] | None = None,
        layout: str = "out_in",
        fan_in: int | None = None,
        max_exponent: float | None = None,
        impl: str = "fused",
    ) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise ValueError(f"weight must be a floating-point tensor, got {type(weight).__name__}")
        if weight.dim() not in (1, 2):
            raise ValueError(f"SEL charts 1-D or 2-D tensors, got shape {tuple(weight.shape)}")
        if weight.numel() == 0:
            raise ValueError(f"SEL needs a non-empty weight, got shape {tuple(weight.shape)}")
        if init not in SEL_INITS:
            raise ValueError(f"init must be one of {SEL_INITS}, got {init!r}")
        if layout not in SEL_LAYOUTS:
            raise ValueError(f"layout must be one of {SEL_LAYOUTS} (torch.nn.Linear's (out, in) "
                             f"or a Hugging Face Conv1D's (in, out)), got {layout!r}")
        if impl not in SEL_IMPLS:
            raise ValueError(f"impl must be one of {SEL_IMPLS}, got {impl!r}")
        if (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0
                or (rank > 0 and weight.dim() != 2)):
            raise ValueError(f"rank must be an int >= 0 (and 0 for 1-D tensors), got {rank!r}")
        if rank > min(weight.shape):
            raise ValueError(f"rank must be <= min(weight.shape) = {min(weight.shape)}, got {rank}")
        if not isinstance(linear, bool):  # bool("False") is True
            raise ValueError(f"linear must be True or False, got {linear!r}")
        kappa = _positive("kappa", kappa)
        gain = _positive("gain", gain)
        if calibration not in SEL_CALIBRATIONS:
            raise ValueError(f"calibration must be one of {SEL_CALIBRATIONS}, got {calibration!r}")
        scale_init = dict(scale_init or {})
        unknown = sorted(set(scale_init) - set(_SCALE_KEYS))
        if unknown:
            raise ValueError(f"scale_init keys must be among {_SCALE_KEYS}, got {unknown}")
        if slope is not None and "e_w" in scale_init:
            raise ValueError("give either slope or scale_init['e_w'], not both")
        values = {**DEFAULT_SCALE_INIT, **scale_init}
        for key in ("e_w", "l_w", "m"):
            if key in values:
                values[key] = _positive(f"scale_init['{key}']", values[key])
        n = values["n"]
        n0 = float(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else math.nan
        if not math.isfinite(n0):
            raise ValueError(f"scale_init['n'] must be a finite number, got {values['n']!r}")
        if fan_in is None:
            if weight.dim() == 1:
                fan_in = weight.numel()
            else:  # the map's input size
                fan_in = weight.shape[1] if layout == "out_in" else weight.shape[0]
        if not isinstance(fan_in, int) or isinstance(fan_in, bool) or fan_in < 1:
            raise ValueError(f"fan_in must be an int >= 1, got {fan_in!r}")
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("weight must be finite, got NaN or inf entries")
        self._default_clamp = max_exponent is None  # after a cast: at most the new dtype's default
        self._max_exponent = (
            _default_max_exponent(weight.dtype)
            if max_exponent is None
            else _explicit_clamp(max_exponent, weight.dtype)
        )

        self._is_vector, self._numel = weight.dim() == 1, weight.numel()
        self.init, self.impl, self.layout = init, impl, layout
        self.linear = bool(linear)
        self.exact_inverse = init == "congruent" or not self.linear  # without l_w both rules agree
        self.kappa, self.gain, self.rank, self.fan_in = kappa, gain, rank, fan_in

        sigma0 = _rms(weight)
        if calibration == "width" or sigma0 == 0.0:  # an all-zero tensor has no scale of its own
            calibration, sigma0 = "width", gain / math.sqrt(fan_in)
        self.calibration, self.sigma0 = calibration, sigma0
        b0 = kappa / sigma0  # b * sigma_0 = kappa
        m0 = values["m"]
        beta = torch.tensor(b0 / m0, dtype=weight.dtype, device=weight.device)
        if not (b0 < math.inf and 0 < float(beta) < math.inf):
            raise ValueError(
                f"the curvature b = kappa / sigma0 = {kappa!r} / {sigma0:.4g} = {b0:.4g} and "
                f"beta = b / scale_init['m'] = {b0 / m0:.4g} must be finite and > 0 in "
                f"{weight.dtype}; choose kappa (or m) nearer the weight's scale"
            )
        if "e_w" in values:
            log_e_w0 = math.log(values["e_w"])
        else:
            s0 = _positive("slope", DEFAULT_SLOPE if slope is None else slope)
            # a = e_w e^{-n} = s0 / b, in logs: exp(n) overflows (n = 1000) or underflows
            log_e_w0 = math.log(s0) - math.log(b0) + n0
        self.register_buffer("beta", beta)

        factory = {"dtype": weight.dtype, "device": weight.device}
        row_shape = (weight.shape[0], 1) if weight.dim() == 2 else (1,)
        col_shape = (1, weight.shape[1]) if weight.dim() == 2 else None
        init_values = {"log_e_w": log_e_w0, "log_m": math.log(m0), "n": n0}
        if self.linear:
            init_values["log_l_w"] = math.log(values["l_w"])
        for pname, value in init_values.items():
            self.register_parameter(
                f"{pname}_row", nn.Parameter(torch.full(row_shape, value, **factory))
            )
            if col_shape is not None:
                self.register_parameter(
                    f"{pname}_col", nn.Parameter(torch.zeros(col_shape, **factory))
                )
        if rank > 0:
            out_features, in_features = weight.shape
            self.delta_a = nn.Parameter(
                torch.randn(rank, in_features, **factory) / math.sqrt(in_features)
            )
            self.delta_b = nn.Parameter(torch.zeros(out_features, rank, **factory))
        self._check_scale(self._clamp(), weight.dtype)

    def _clamp(self, dtype: torch.dtype | None = None) -> float:
        r"""The clamp :math:`M` of :math:`b|w|` the forward rule runs with for raw coordinates (and
        so a weight) of ``dtype`` (default: the chart's own).

        Left to its default, the clamp the chart holds is lowered to the default
        :math:`\tfrac12\log(\text{finfo.max})` of ``dtype`` where that is smaller: a chart built
        in float64 or float32 and cast to float16 (``module.half()``) clamps exactly like one built
        in float16, at 5.54, not at 354.9 or 44.4, whose ``expm1`` overflows the float16 weight
        (65504) from 11.09; cast to a wider dtype it keeps the clamp it has (a cast down lowers
        the clamp the chart holds, none raises it), so the weight it computes is unchanged. Given explicitly, it is the clamp in every dtype, and one beyond the largest clamp of ``dtype`` (:func:`_largest_clamp`) is
        refused: ``ValueError`` rather than an inf weight or a silently lower clamp."""
        dtype = self.beta.dtype if dtype is None else dtype
        if getattr(self, "_default_clamp", False):
            return min(self._max_exponent, _default_max_exponent(dtype))
        if self._max_exponent > _largest_clamp(dtype):
            raise ValueError(_beyond_clamp(self._max_exponent, dtype))
        return self._max_exponent

    @property
    def max_exponent(self) -> float:
        r"""The clamp :math:`M` of :math:`b|w|` in effect: the one the forward rule runs with on
        the chart's own raw coordinates, in the dtype the chart is in now.

        Left to its default, it follows casts downwards (after ``module.half()`` 5.54, whatever
        the chart was built in, and still 5.54 after casting back up); given explicitly, it is
        that value in every dtype.
        :attr:`requested_max_exponent` tells the two apart.

        Assigning sets an explicit clamp, checked like the constructor's ``max_exponent`` against
        the chart's current dtype (``ValueError`` naming the bound); assigning None restores the
        default of the current dtype."""
        return self._clamp()

    @max_exponent.setter
    def max_exponent(self, value: float | None) -> None:
        dtype = self.beta.dtype
        clamp = _default_max_exponent(dtype) if value is None else _explicit_clamp(value, dtype)
        self._check_scale(clamp, dtype)
        self._max_exponent, self._default_clamp = clamp, value is None

    @property
    def requested_max_exponent(self) -> float | None:
        """The clamp given to the constructor or assigned to :attr:`max_exponent`, or None where it
        was left to the default (which follows casts downwards, see :attr:`max_exponent`)."""
        return None if getattr(self, "_default_clamp", False) else self._max_exponent

    def get_extra_state(self) -> dict:
        """The clamp in the state dict (key ``<chart>._extra_state``): ``{"max_exponent": M,
        "default": bool}``, the clamp the chart holds and whether it was left to its default.

        A loaded chart clamps like the saved one: a clamp lowered by a cast (a default chart
        trained after ``module.half()`` holds 5.54) or given explicitly is part of the function
        the weights define, as :attr:`beta` is."""
        return {"max_exponent": self._max_exponent, "default": bool(self._default_clamp)}

    def set_extra_state(self, state) -> None:
        """Take the clamp of :meth:`get_extra_state`, checked against the chart's current dtype
        as an assignment to :attr:`max_exponent` is (a default one lowered to the dtype's default,
        as a cast lowers it); ``ValueError`` naming what is wrong otherwise."""
        keys = {"max_exponent", "default"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"an SEL chart's extra state must be a dict with keys {sorted(keys)} "
                             f"(its clamp), got {state!r}")
        default = state["default"]
        if not isinstance(default, bool):
            raise ValueError(f"the SEL extra state's 'default' must be a bool, got {default!r}")
        dtype = self.beta.dtype
        clamp = _positive("max_exponent", state["max_exponent"])
        clamp = min(clamp, _default_max_exponent(dtype)) if default else _explicit_clamp(clamp, dtype)
        self._check_scale(clamp, dtype, then=" (loading a state dict)")
        self._max_exponent, self._default_clamp = clamp, default

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the scales and beta a state dict brings are checked as the constructor checks them,
        # before any is copied: a NaN or infinite log_l_w loaded silently and gave NaN or inf
        # weights, log_e_w = -inf an exponential part of 0, beta = 0 a ZeroDivisionError
        def given(name):  # a tensor with values to check (a meta tensor has none)
            t = state_dict.get(prefix + name)
            return t if isinstance(t, torch.Tensor) and not t.is_meta else None

        bad = [prefix + name for name, _ in self.named_parameters(recurse=False)
               if given(name) is not None and not bool(torch.isfinite(given(name)).all())]
        if bad:
            raise ValueError(f"{bad} hold NaN or inf entries: an SEL chart's parameters (scales, "
                             f"low-rank residual) must be finite")
        beta = given("beta")
        if beta is not None and not (beta.numel() == 1 and 0 < float(beta) < math.inf):
            raise ValueError(f"{prefix}beta must be a finite number > 0, got {beta!r}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __setstate__(self, state):
        if "max_exponent" in state:  # pickled before max_exponent became a property
            state["_max_exponent"] = state.pop("max_exponent")
        super().__setstate__(state)

    def _apply(self, fn, recurse=True):
        # a cast (module.half(), .to(dtype)) to a dtype whose range cannot hold an explicit clamp,
        # or the clamp times the chart's scale, is refused before anything of the chart is
        # converted (beta, a 0-d buffer, tells the dtype)
        dtype = fn(self.beta).dtype
        if dtype != self.beta.dtype:
            if not self._default_clamp and self._max_exponent > _largest_clamp(dtype):
                raise ValueError(_beyond_clamp(
                    self._max_exponent, dtype,
                    f" (casting a {self.beta.dtype} chart: lower its max_exponent first)",
                ))
            self._check_scale(self._clamp(dtype), dtype, stored=dtype,
                              then=f" (casting a {self.beta.dtype} chart)")
        out = super()._apply(fn, recurse)
        if getattr(self, "_default_clamp", False):  # lowered by a cast down, never raised
            self._max_exponent = min(self._max_exponent, _default_max_exponent(dtype))
        return out

    # -- scales -----------------------------------------------------------------------------------
    def _factor(
        self, *pairs: tuple[float, str], scale: torch.Tensor | None = None,
        work: torch.dtype | None = None, stored: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # exp(sum_k sign_k (u_k,i + v_k,j)) as a row factor (out, 1) and a column factor (1, in);
        # a 1-D tensor is handled as one row, (1, n), with a constant column of ones.
        row = torch.exp(self._signed_sum(pairs, "row", work, stored))
        if scale is not None:
            row = row * (scale if work is None else scale.to(work))
        if self._is_vector:
            return row.view(1, 1), torch.ones(1, self._numel, dtype=row.dtype, device=row.device)
        col = torch.exp(self._signed_sum(pairs, "col", work, stored))
        return row, col

    def _signed_sum(self, pairs: tuple[tuple[float, str], ...], side: str,
                    work: torch.dtype | None = None,
                    stored: torch.dtype | None = None) -> torch.Tensor:
        # sum_k sign_k p_k, one op per extra term (no Python-scalar products: on small vectors the
        # chart's cost is op dispatch, counted per training step for every charted matrix);
        # ``stored``: each parameter rounded to that dtype first, as a cast to it would
        def read(name):
            p = getattr(self, f"{name}_{side}")
            p = p if stored is None else p.detach().to(stored)
            return p if work is None else p.to(work)
        (first_sign, first), *rest = pairs
        total = read(first)
        total = total if first_sign > 0 else -total
        for sign, name in rest:
            term = read(name)
            total = total + term if sign > 0 else total - term
        return total

    @torch.no_grad()
    def _check_scale(self, clamp: float, dtype: torch.dtype, stored: torch.dtype | None = None,
                     then: str = "") -> None:
        r"""``ValueError`` unless the weight and its gradients stay within ``finfo.max`` of
        ``dtype`` at the chart's scales and the clamp :math:`M` = ``clamp``.

        The clamp keeps :math:`\operatorname{expm1}(M)` within ``dtype``'s range, but the scales
        can carry the weight or its derivatives past it to inf. Per entry, for a unit upstream
        gradient and :math:`b|w| < M` (beyond the clamp the gradient is 0), the largest values are

        .. math::
            a\operatorname{expm1}(M)\ \text{(the weight)}, \quad
            a b\,e^{M}\ \text{(the raw gradient)}, \quad
            a M e^{M}\ \text{(the gradient of}\ \log m),

        each at most ``finfo.max`` of ``dtype`` (the weight and these gradients are rounded to
        it), and, in the dtype the rule runs in, the factor gradients before the chain rule to the
        log-parameters: :math:`a M e^{M} / b` (of :math:`b` and its row and column factors) and
        :math:`e^{M} \max(a_r, a_c)` (of :math:`a`'s factors). float32 at :math:`M = 88` with
        :math:`a = 4` gave an inf weight; with :math:`a = 1.5,\ b = 2` a finite weight
        (:math:`2.5\cdot10^{38}`) and an inf raw gradient (:math:`a b e^M = 4.9\cdot10^{38}`). The
        weight is computed as the forward rule computes it: the factors in the rule's dtype
        (``stored``: from the parameters rounded to that dtype, as in a cast), in both orders of
        the products the implementations use; the gradients in float64, with a margin of 8 ulps
        of the rule's dtype for the orders the implementations round them in. Sums over a row or
        a column (the gradients of the rank-1 factors) are not bounded here: like a plain
        weight's gradient, they overflow for large enough upstream gradients. The linear part
        :math:`l_w|w|` adds to the weight beyond the clamp, as in a plain weight."""
        work = _rule_dtype(dtype)
        row, col = self._factor((1.0, "log_e_w"), (-1.0, "n"), work=work, stored=stored)
        beta = self.beta if stored is None else self.beta.to(stored)
        b_row, b_col = self._factor((1.0, "log_m"), scale=beta, work=work, stored=stored)
        a_r, a_c = row.max(), col.max()
        a = float(a_r) * float(a_c)
        ab = float((row * b_row).max()) * float((col * b_col).max())  # largest a b, entrywise
        b_lo = min(1.0, float(b_row.min()), float(b_col.min()),
                   float(b_row.min()) * float(b_col.min()))
        a_hi = max(1.0, float(a_r), float(a_c))

        top = torch.finfo(dtype).max  # exact in the rule's dtype
        margin = 1.0 - 8.0 * torch.finfo(work).eps
        limits = (top * margin, torch.finfo(work).max * margin)

        def exp(m: float) -> float:
            try:
                return math.exp(m)
            except OverflowError:  # past float64's 709.78: no finite gradient
                return math.inf

        def overflow(m: torch.Tensor) -> str | None:  # like _largest_clamp: at most finfo.max
            e = torch.expm1(m)
            if not all(bool(w <= top) for w in ((a_r * a_c) * e, (e * a_r) * a_c)):
                return f"the weight a expm1(M) = {a * math.expm1(float(m)):.4g}"
            x, em = float(m), exp(float(m))
            for value, limit, name in (
                (ab * em, 0, "the raw gradient a b e^M"),
                (a * x * em, 0, "the gradient of log m, a M e^M"),
                (a * x * em / b_lo, 1, "the gradient of b, a M e^M / b"),
                (a_hi * em, 1, "the gradient of a's factors, e^M max(a_r, a_c)"),
            ):
                if not value <= limits[limit]:
                    return f"{name} = {value:.4g}"
            return None

        m = torch.tensor(clamp, dtype=work, device=row.device)
        what = overflow(m)
        if what is None:
            return
        lo, hi = 0.0, clamp  # each quantity grows with M: bisect, then step to the work grid
        for _ in range(200):
            mid = float(m.new_tensor(0.5 * (lo + hi)))
            if mid in (lo, hi):
                break
            lo, hi = (mid, hi) if overflow(m.new_tensor(mid)) is None else (lo, mid)
        bound = m.new_tensor(lo)
        while bound > 0 and overflow(bound) is not None:
            bound = torch.nextafter(bound, torch.zeros_like(bound))
        while bound > 0 and overflow(up := torch.nextafter(bound, m)) is None:
            bound = up
        x = float(clamp)
        a_most = a * min(top / (a * math.expm1(x)), top / (ab * exp(x)), top / (a * x * exp(x)),
                         limits[1] / (a * x * exp(x) / b_lo))
        default = " (the default)" if clamp == _default_max_exponent(dtype) else ""
        accepted = (f"max_exponent at most {bound.item()!r} for these scales" if bound > 0
                    else "no max_exponent > 0 for these scales")
        raise ValueError(
            f"max_exponent = {clamp!r}{default} overflows a {dtype} weight or its gradient at the "
            f"chart's scales (largest a = e_w e^-n = {a:.4g}, largest a b = {ab:.4g}): {what} > "
            f"finfo.max = {top:.4g}; accepted: {accepted} (or a at most {a_most:.4g} for this "
            f"max_exponent){then}"
        )

    def factors(self):
        """Rank-1 factors ``(row (out, 1), column (1, in))`` of :math:`a`, :math:`b`, :math:`l_w`.

        The :math:`l_w` entry is None without the linear path.
        """
        return self._factors()

    def _factors(self, work: torch.dtype | None = None):
        a = self._factor((1.0, "log_e_w"), (-1.0, "n"), work=work)
        b = self._factor((1.0, "log_m"), scale=self.beta, work=work)
        c = self._factor((1.0, "log_l_w"), work=work) if self.linear else None
        return a, b, c

    def coefficients(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        r"""Full :math:`(a, b, l_w)` in the weight's shape (:math:`l_w` None without linear path).

        :math:`a = e_w e^{-n}` and :math:`b = \beta m`, each the exponential of a rank-1 sum.
        """
        return self._coefficients()

    def _coefficients(self, work: torch.dtype | None = None):
        shape = (self._numel,) if self._is_vector else None
        out = []
        for pair in self._factors(work):
            full = None if pair is None else pair[0] * pair[1]
            out.append(full.reshape(shape) if full is not None and shape else full)
        return tuple(out)

    @property
    def _shape(self) -> tuple[int, ...]:
        # the shape of the tensor the chart carries: (out, in), or (n,) for a 1-D one
        if self._is_vector:
            return (self._numel,)
        return (self.log_e_w_row.shape[0], self.log_e_w_col.shape[1])

    def _check_shape(self, tensor: torch.Tensor, what: str) -> None:
        # the scales broadcast: a (1, in) target came back (out, in), every row the same, and a
        # raw (k, out, in) gave k weights, silently
        if tuple(tensor.shape) != self._shape:
            raise ValueError(f"{what} must have the chart's shape {self._shape}, got "
                             f"{tuple(tensor.shape)}")

    def scale_parameters(self) -> dict[str, list[nn.Parameter]]:
        """The chart's own parameters by role: ``e_w``, ``l_w``, ``m``, ``n`` and ``delta``."""
        roles = {"e_w": "log_e_w", "l_w": "log_l_w", "m": "log_m", "n": "n"}
        out = {}
        for role, pname in roles.items():
            params = [getattr(self, f"{pname}_{side}", None) for side in ("row", "col")]
            params = [p for p in params if p is not None]
            if params:
                out[role] = params
        if self.rank > 0:
            out["delta"] = [self.delta_a, self.delta_b]
        return out

    def delta(self) -> torch.Tensor | None:
        """The low-rank residual :math:`\\Delta = BA` ``(out, in)``, or None when ``rank == 0``."""
        return self.delta_b @ self.delta_a if self.rank > 0 else None

    # -- chart ------------------------------------------------------------------------------------
    def forward(self, raw: torch.Tensor) -> torch.Tensor:
        r""":math:`w_\text{eff} = \operatorname{sign}(w) E(|w|) + l_w |w| + \Delta`, like ``raw``.

        ``sign(0)`` is taken as +1 and :math:`|w|` as :math:`w\,\operatorname{sign}(w)` with the
        sign held constant, so the gradient at :math:`w = 0` is the one-sided slope
        :math:`E'(0) + l_w` instead of 0.

        float16 and bfloat16 raw coordinates are evaluated in float32, the scales computed in
        float32 from the chart's parameters, and the weight and every gradient rounded once to
        their dtype (:func:`~manifoldlib.charts.sel_forward_rule`). The clamp is that of
        ``raw``'s dtype, whose range the weight must fit (see ``max_exponent``): 5.54 by default for
        float16, also for a chart built in float32 or float64 and cast with ``module.half()``
        (their 44.4 and 354.9 gave inf weights: :math:`\operatorname{expm1}(b|w|)` exceeds
        float16's 65504 from :math:`b|w| = 11.09`). bfloat16 for its precision: evaluated in
        bfloat16, the scales, :math:`b|w|`, :math:`\operatorname{expm1}` and the products each
        round to 8 bits, and the weight was off by several bfloat16 ulps, most where
        :math:`b|w|` is large (an error in :math:`b|w|` is multiplied by it in
        :math:`e^{b|w|}`).

        Raises:
            ValueError: if ``raw`` does not have the chart's shape (no batch dimensions: the
                scales would broadcast over them).
        """
        self._check_shape(raw, "raw")
        work = _rule_dtype(raw.dtype)
        a, b, c = self._factors(work if work != raw.dtype else None)  # None: the chart's own dtype
        flat = raw.view(1, -1) if self._is_vector else raw
        weight = sel_forward_rule(flat, a, b, c, self._clamp(raw.dtype), self.impl)
        weight = weight.view_as(raw).to(raw.dtype)  # (out, in) or (n,); in raw's dtype already
        if self.rank > 0:
            weight = weight + self.delta()
        return weight

    @torch.no_grad()
    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        """Raw coordinates for an effective weight (shape of ``weight``).

        ``init="congruent"`` inverts the forward rule (``forward(right_inverse(W)) == W``);
        ``init="mismatched"`` inverts the congruent rule :math:`g` (positives exact, negatives
        shrunk). The current residual :math:`\\Delta` is subtracted first.

        The clamp is checked on the raw coordinates as returned, rounded to ``weight``'s dtype:
        in float16 or bfloat16 a root just inside :attr:`max_exponent` can round past it (a
        target is then refused) and one just past it round back inside (accepted: the forward
        sees an unclamped entry, within the rounding of the raw coordinates of the target).

        Raises:
            ValueError: if ``weight`` does not have the chart's shape (the scales would broadcast
                a ``(1, in)`` target to ``(out, in)``), is not finite, or a target is beyond what
                the clamped chart can represent (:math:`b|w| >` ``max_exponent`` for its raw
                coordinate rounded to ``weight``'s dtype).
        """
        self._check_shape(weight, "weight")
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("weight must be finite, got NaN or inf entries")
        target = weight - self.delta() if self.rank > 0 else weight
        # Newton in at least float32: half-precision rounding would stall the iteration.
        work = torch.promote_types(weight.dtype, torch.float32)
        target = target.to(work)
        # the scales as the forward rule computes them (in float32 for a 16-bit chart)
        rule = _rule_dtype(self.beta.dtype)
        scales = self._coefficients(rule if rule != self.beta.dtype else None)
        a, b, c = (None if x is None else x.to(work) for x in scales)
        c0 = torch.zeros_like(a) if c is None else c
        mag = target.abs()
        raw = torch.sign(target) * solve_expm1_linear(mag, a, b, c0)
        if self.init == "congruent" and c is not None:
            neg = solve_expm1_minus_linear(mag, a, b, c0)
            raw = torch.where(target < 0, -neg, raw)
        clamp = self._clamp(weight.dtype)  # the forward's, on raw coordinates of weight's dtype
        self._check_scale(clamp, weight.dtype)  # the scales may have grown since the last check
        # checked on the raw coordinates the forward will see: a root within the clamp can round
        # past it in a 16-bit dtype (and one past it round back within)
        raw = raw.to(weight.dtype)
        if not bool(torch.isfinite(raw).all()) or bool((b * raw.to(work).abs() > clamp).any()):
            raise ValueError(
                f"weight magnitude {mag.max().item():.4g} is beyond what the chart represents "
                f"(b*|w| <= max_exponent = {clamp:.4g} on the raw coordinates rounded to "
                f"{weight.dtype})"
            )
        return raw

    def extra_repr(self) -> str:
        return (
            f"init={self.init!r}, linear={self.linear}, kappa={self.kappa}, gain={self.gain}, "
            f"rank={self.rank}, layout={self.layout!r}, fan_in={self.fan_in}, "
            f"sigma0={self.sigma0:.3g} "
            f"({self.calibration}), impl={self.impl!r}"
        )
