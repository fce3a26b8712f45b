r"""Sphere retractions: one planar rotation, many angle functions.

Every member rotates :math:`x` in :math:`\operatorname{span}(x, v)` by :math:`\theta(\beta)`,
:math:`\beta = \|v\|/r`: :math:`R_x(v) = \cos\theta\,x + (\sin\theta/\beta)\,v`. A subclass of
:class:`AngleRetraction` defines only :meth:`~AngleRetraction.angle`; the built-ins also override
:meth:`~AngleRetraction.coefficients` with closed forms in :math:`\sigma = \beta^2`.

============  ===========================  =====  ========================
name          :math:`\theta(\beta)`        order  paper name
============  ===========================  =====  ========================
exp           :math:`\beta`                2      GeoNorm
gnomonic      :math:`\arctan\beta`         2      Proj-SpheretNorm (p = 1)
cayley        :math:`2\arctan(\beta/2)`    2      Cay-SpheretNorm (p = 2)
p             :math:`p\arctan(\beta/p)`    2      p-SpheretNorm
============  ===========================  =====  ========================

Whose map runs. A class's map is the ``retract`` it runs. :meth:`AngleRetraction.retract` is
the angle form :math:`\cos\theta\,x + k\,v` of the class's ``coefficients``, and two consumers
compute that form without calling ``retract``: :class:`~manifoldlib.nn.SphereResidual`'s fast
path, and :meth:`AngleRetraction.retract_long_step`, which :meth:`~manifoldlib.Sphere.retr` takes
for steps whose :math:`\beta^2` overflows. A class that overrides ``retract`` (an
:class:`AngleRetraction` subclass, or a subclass of a built-in) defines another map there, so
each consumer first asks ``_retract_is_angle_form``: whether the ``retract`` the instance
calls is :meth:`AngleRetraction.retract`, reached directly or through pure forwards. A pure
forward is a function whose code is exactly ``return super().retract(x, v, radius)`` (or
``radius=radius``), with its own parameter names, a docstring allowed, the built-in ``super``,
resolving to a ``retract`` that is recognized in turn (``_pass_through_class``, checked on the
compiled code, not by sampling). No declaration lets a ``retract`` of its own claim agreement with
the angle form: nothing would check the claim. An instance with ``retract`` or one of the angle
methods set on itself is not the angle form either (the row kernels compute the class's math). A
class that supplies the long-step form of its own ``retract`` overrides
:meth:`~AngleRetraction.retract_long_step` in the class that defines that ``retract`` (or below
it): ``_long_step_mismatch`` says when the inherited one would compute another map. The inherited
one rotates by the ``angle`` in effect, so it is the long step of the angle form exactly when the
``coefficients`` that ``retract`` runs are that angle's: the generic ones, or both written together
in one class or on one instance. An ``angle`` set on an instance counts: setting it brings the
generic ``coefficients`` onto the instance (``AngleRetraction.__setattr__``, the instance-level
twin of ``__init_subclass__``), so ``retract`` and the long step both rotate by it.
"""

from __future__ import annotations

import builtins
import inspect
import math
import types
import weakref

import torch

from ..functional.sphere import (
    cayley_coefficients,
    exponential_coefficients,
    gnomonic_coefficients,
    p_coefficients,
    rotate,
    sphere_normalized_sq_step,
    sphere_project_tangent,
    sphere_step_length,
)
from .._numbers import is_real
from .base import Retraction, register_retraction

__all__ = [
    "AngleRetraction",
    "CayleyRetraction",
    "ExponentialRetraction",
    "GnomonicRetraction",
    "PRetraction",
]


def _gnomonic_vjp(cos_theta: torch.Tensor, grad_cos: torch.Tensor, grad_k: torch.Tensor) -> torch.Tensor:
    # cos θ = k = (1 + σ)^(-1/2): both derivatives are -cos³θ / 2
    return -0.5 * cos_theta * cos_theta * cos_theta * (grad_cos + grad_k)


def _cayley_vjp(k: torch.Tensor, grad_cos: torch.Tensor, grad_k: torch.Tensor) -> torch.Tensor:
    # k = 1/(1 + σ/4), cos θ = 2k - 1: k' = -k²/4, cos θ' = -k²/2
    return -0.25 * k * k * (2.0 * grad_cos + grad_k)


class AngleRetraction(Retraction):
    r"""Base class of sphere retractions that rotate by an angle :math:`\theta(\beta)`.

    Subclasses define :meth:`angle`, an odd function with :math:`\theta'(0) = 1` (then the
    retraction is second order whenever :math:`\theta''(0) = 0`, which oddness gives). Points are
    ``(..., d)`` with the sphere over the last dimension.

    The math is one chain, :meth:`angle` → :meth:`coefficients` → :meth:`coefficients_vjp`. A
    subclass that redefines a link gets the generic form of every later link it does not
    redefine itself, so a closed form inherited from a built-in (gnomonic, Cayley, the
    p-family, the exponential map) never stands in for a different angle.
    """

    manifold = "sphere"
    order = 2

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "angle" in own and "coefficients" not in own:
            cls.coefficients = AngleRetraction.coefficients
        if ("angle" in own or "coefficients" in own) and "coefficients_vjp" not in own:
            cls.coefficients_vjp = AngleRetraction.coefficients_vjp

    def __setattr__(self, name: str, value) -> None:
        """The rule of ``__init_subclass__`` for a link set on an instance: an ``angle`` set without
        ``coefficients`` brings the generic :meth:`coefficients` (and :meth:`coefficients_vjp`)
        onto the instance, a ``coefficients`` without ``coefficients_vjp`` the generic
        :meth:`coefficients_vjp`. Without it ``retract`` ran the class's closed form and ignored
        the instance's angle (``GnomonicRetraction()`` given ``angle = lambda b: b`` stayed the
        gnomonic map, an angle 0.036 short of the exponential map's at :math:`\\beta = 0.5`, with
        no error)."""
        super().__setattr__(name, value)
        if name not in ("angle", "coefficients"):
            return
        own = self.__dict__
        generic = [] if name == "coefficients" or "coefficients" in own else ["coefficients"]
        for link in generic + ([] if "coefficients_vjp" in own else ["coefficients_vjp"]):
            object.__setattr__(self, link, types.MethodType(AngleRetraction.__dict__[link], self))

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        """Rotation angle for the normalized step ``beta = ||v|| / r`` (elementwise, ``beta >= 0``)."""
        raise NotImplementedError(f"{type(self).__name__} must define angle(beta)")

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(cos θ, k = sin θ / β)`` from :math:`\sigma = \beta^2`, shape ``(..., 1)`` each.

        The generic form evaluates :meth:`angle` at :math:`\beta = \sqrt\sigma`, with the
        double-where pattern below :math:`\sigma < \epsilon` (where ``k = 1`` and
        :math:`\cos\theta = 1 - \sigma/2` are exact to rounding for any admissible angle).
        """
        small = sigma < float(torch.finfo(sigma.dtype).eps)
        safe = torch.where(small, torch.ones_like(sigma), sigma)
        beta = safe.sqrt()
        theta = self.angle(beta)
        cos_theta = torch.where(small, 1.0 - 0.5 * sigma, torch.cos(theta))
        k = torch.where(small, torch.ones_like(sigma), torch.sin(theta) / beta)
        return cos_theta, k

    def coefficients_vjp(
        self,
        sigma: torch.Tensor,
        cos_theta: torch.Tensor,
        k: torch.Tensor,
        grad_cos: torch.Tensor,
        grad_k: torch.Tensor,
    ) -> torch.Tensor:
        r"""Vector-Jacobian product of :meth:`coefficients`:
        :math:`g_\sigma = \cos\theta'(\sigma)\,g_c + k'(\sigma)\,g_k`, shape ``(..., 1)``.

        ``cos_theta`` and ``k`` are :meth:`coefficients` at ``sigma`` (closed forms reuse them).
        The generic form differentiates :meth:`coefficients` with autograd on the small
        ``(..., 1)`` tensor; members with closed-form derivatives override it. The analytic
        backward of :class:`~manifoldlib.nn.SphereResidual` calls it.
        """
        with torch.enable_grad():
            s = sigma.detach().requires_grad_(True)
            c2, k2 = self.coefficients(s)
            grads = torch.autograd.grad((c2, k2), s, (grad_cos, grad_k), allow_unused=True)
        return torch.zeros_like(sigma) if grads[0] is None else grads[0]

    def retract(self, x: torch.Tensor, v: torch.Tensor, radius: float | torch.Tensor | None = None) -> torch.Tensor:
        r"""Rotate ``x`` towards ``v``: :math:`R_x(v) = R_x(P_x v)`.

        The normal component of ``v`` is removed first, so a vector that is not tangent — a
        momentum buffer seeded with a raw gradient — still gives a point on the sphere, rotated
        by its tangent part alone. (geoopt's sphere does otherwise: its ``retr`` is
        ``projx(x + v)``, where a normal part rescales the step, and its ``expmap`` leaves the
        sphere for one.)

        Args:
            x: ``(..., d)`` points on the sphere of radius ``radius``.
            v: ``(..., d)`` vectors at ``x``.
            radius: sphere radius; ``None`` reads it from ``||x||``.

        Returns:
            ``(..., d)`` points in the promoted dtype of ``x`` and ``v`` (``x``'s when they
            agree). float16 and bfloat16 inputs are rotated in float32: :math:`\|v\|^2` overflows float16 from :math:`\|v\| \approx 256`, which
            would turn the point into NaN (or zero). Past :math:`\beta` or :math:`\|v\|` of
            about :math:`1.8\cdot 10^{19}` (float32) or :math:`1.3\cdot 10^{154}` (float64),
            :math:`\sigma = \|v\|^2/r^2` or its numerator overflows here too (on a sphere of
            radius :math:`r > 1` already from :math:`\beta \approx 1.8\cdot 10^{19}/r`);
            :meth:`retract_long_step` is the form for such steps (no check is made here:
            :meth:`~manifoldlib.Sphere.retr` checks and switches; for a class that overrides
            ``retract`` only where :meth:`retract_long_step` is overridden with it).
        """
        out = torch.promote_types(x.dtype, v.dtype)
        work = torch.promote_types(out, torch.float32)
        xw, vw = x.to(work), v.to(work)
        radius_sq = (xw * xw).sum(-1, keepdim=True) if radius is None else radius * radius
        vw = sphere_project_tangent(xw, vw, radius_sq)  # (..., d)
        cos_theta, k = self.coefficients(sphere_normalized_sq_step(vw, radius_sq))
        return rotate(xw, vw, cos_theta, k).to(out)

    def retract_long_step(self, x: torch.Tensor, v: torch.Tensor, radius: float | torch.Tensor | None = None) -> torch.Tensor:
        r""":meth:`retract` computed from :meth:`angle` itself, for steps whose :math:`\beta^2` overflows.

        :math:`R_x(v) = \cos\theta\,x + \sin\theta\,r\,\hat v` with :math:`\beta` and
        :math:`\hat v = P_xv/\|P_xv\|` from :func:`~manifoldlib.functional.sphere_step_length`
        (nothing squared). A saturating angle (gnomonic :math:`\pi/2`, Cayley :math:`\pi`, the
        p-family :math:`p\pi/2`) gives its limit point; the exponential map rotates by the
        computed :math:`\beta` itself, exact for the input perturbed by rounding — past
        :math:`\beta \approx 2\pi/\varepsilon` the position along the great circle is
        therefore not determined by the input, though the point is on it. Rows whose angle
        is not finite (the exponential map when :math:`\beta` overflows) come back non-finite.
        Where :math:`\theta = \beta` to rounding (:math:`\beta^2 < \epsilon`) the second term is
        formed as :math:`P_xv` itself, so the Jacobian at :math:`v = 0` is :math:`P_x`, as the
        retraction's is; gradients are finite for every finite angle.

        This is the long-step form of the angle form only. A class that overrides :meth:`retract`
        with a map of its own (one that is not a pure ``super()`` forward; module docstring, *Whose
        map runs*) and takes long steps overrides this method too, in the same class or below:
        :meth:`~manifoldlib.Sphere.retr` calls it only for a class whose ``retract`` is the angle
        form or whose ``retract_long_step`` is defined at or below its ``retract``, and otherwise
        raises ``ValueError`` for a long step that its ``retract`` cannot take (a ``retract`` that
        returns points of the sphere for such steps itself is used as it is).

        Same arguments and result as :meth:`retract`.
        """
        out = torch.promote_types(x.dtype, v.dtype)
        work = torch.promote_types(out, torch.float32)
        xw, vw = x.to(work), v.to(work)
        r = xw.norm(dim=-1, keepdim=True) if radius is None else radius
        unit = xw / r  # (..., d)
        m = vw.abs().amax(-1, keepdim=True)  # (..., 1): v / m cannot overflow what follows
        m = torch.where(m > 0, m, torch.ones_like(m))
        vs = vw / m
        vs = vs - (unit * vs).sum(-1, keepdim=True) * unit  # P_x(v) / m, (..., d)
        length, direction = sphere_step_length(vs, 1.0)  # ||P_x v|| / m, (..., 1); (..., d)
        # m / r, not a radius r / m: that quotient's square underflows in the backward of the
        # division (0 * inf, a NaN gradient for every step past 1/sqrt of the smallest number)
        beta = (m / r) * length  # (..., 1)
        theta = self.angle(beta)
        # where theta = beta to rounding, sin(theta) r v_hat is P_x v = m vs: that form there, whose
        # Jacobian at v = 0 is P_x (v_hat is 0 at v = 0, and so was the Jacobian of the other)
        short = beta * beta < torch.finfo(beta.dtype).eps
        along = torch.where(short, m * vs, (torch.sin(theta) * r) * direction)  # (..., d)
        return (torch.cos(theta) * xw + along).to(out)


@register_retraction("sphere", "exp")
class ExponentialRetraction(AngleRetraction):
    r"""Exponential map (GeoNorm): :math:`\theta = \beta`. Can wrap around the sphere."""

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        return beta

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return exponential_coefficients(sigma)


@register_retraction("sphere", "gnomonic", aliases=("projection",))
class GnomonicRetraction(AngleRetraction):
    r"""Gnomonic = metric projection (Proj-SpheretNorm, p = 1): :math:`(x + v)/\sqrt{1+\sigma}`."""

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        return torch.atan(beta)

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gnomonic_coefficients(sigma)

    def coefficients_vjp(self, sigma, cos_theta, k, grad_cos, grad_k):
        return _gnomonic_vjp(cos_theta, grad_cos, grad_k)


@register_retraction("sphere", "cayley", aliases=("stereographic",))
class CayleyRetraction(AngleRetraction):
    r"""Cayley = stereographic (Cay-SpheretNorm, p = 2): :math:`((1-\sigma/4)x + v)/(1+\sigma/4)`."""

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        return 2.0 * torch.atan(0.5 * beta)

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cayley_coefficients(sigma)

    def coefficients_vjp(self, sigma, cos_theta, k, grad_cos, grad_k):
        return _cayley_vjp(k, grad_cos, grad_k)


@register_retraction("sphere", "p")
class PRetraction(AngleRetraction):
    r"""p-family (p-SpheretNorm): :math:`\theta = p\arctan(\beta/p)`, :math:`p \in (0, \infty]`.

    ``p = 1`` is gnomonic, ``p = 2`` Cayley, ``p = inf`` the exponential map, ``p -> 0``
    the identity. For finite ``p`` the angle saturates below :math:`p\pi/2`.
    """

    def __init__(self, p: float = 1.0):
        if not is_real(p):  # float() would take True as 1 and parse '2'
            raise ValueError(f"p must be a number in (0, inf], got {p!r}")
        value = float(p)
        if math.isnan(value) or value <= 0:
            raise ValueError(f"p must be in (0, inf], got {p!r}")
        self.p = value

    def options(self) -> dict:
        return {"p": self.p}

    def angle(self, beta: torch.Tensor) -> torch.Tensor:
        if math.isinf(self.p):
            return beta
        return self.p * torch.atan(beta / self.p)

    def coefficients(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # p = 1 and p = 2 are the gnomonic and Cayley members: their branch-free closed forms
        if self.p == 1.0:
            return gnomonic_coefficients(sigma)
        if self.p == 2.0:
            return cayley_coefficients(sigma)
        return p_coefficients(sigma, self.p)

    def coefficients_vjp(self, sigma, cos_theta, k, grad_cos, grad_k):
        if self.p == 1.0:
            return _gnomonic_vjp(cos_theta, grad_cos, grad_k)
        if self.p == 2.0:
            return _cayley_vjp(k, grad_cos, grad_k)
        return super().coefficients_vjp(sigma, cos_theta, k, grad_cos, grad_k)


# ---- whose map runs (module docstring) --------------------------------------------------------

#: The methods that define an angle retraction's per-row math (what the row kernels replace).
_ANGLE_MATH = ("angle", "coefficients", "coefficients_vjp")
#: The instance attributes that would replace a class's map: set on an instance, not the angle form.
_MAP_ATTRIBUTES = ("retract", *_ANGLE_MATH)
#: :meth:`AngleRetraction.retract` as defined: the angle form.
_ANGLE_FORM_RETRACT = AngleRetraction.__dict__["retract"]
#: Pass-through overrides recognized so far: function -> :func:`_pass_through_class`'s answer
#: (weak keys: a notebook's redefined class goes away).
_PASS_THROUGH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PassThrough:
    """The two pure forwards, compiled by this interpreter: the templates of
    :func:`_pass_through_class` (bytecode names parameters by position, not by name)."""

    def positional(self, x, v, radius=None):
        return super().retract(x, v, radius)

    def keyword(self, x, v, radius=None):
        return super().retract(x, v, radius=radius)


#: The code flags that say what kind of function it is (not where it was defined: a class in a
#: function, or which ``from __future__`` imports its module has).
_KIND_FLAGS = (inspect.CO_OPTIMIZED | inspect.CO_NEWLOCALS | inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
               | inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
               | inspect.CO_ITERABLE_COROUTINE)


def _constants(code, doc) -> tuple:
    """A code object's constants less ``None`` and its docstring (where a docstring is kept)."""
    return tuple(k for k in code.co_consts if k is not None and not (isinstance(k, str) and k == doc))


def _pass_through_class(fn) -> tuple[type, bool] | None:
    """``(the class after which fn's super() looks retract up, whether it passes radius by
    keyword)`` if ``fn`` is exactly ``def retract(self, x, v, radius[=...]): ["docstring"] return
    super().retract(x, v, radius)`` (or ``radius=radius``) with any parameter names; ``None`` for
    anything else.

    The comparison is of compiled code: ``fn`` must have the bytecode, names, flags and constants
    (a docstring aside) of one of the :class:`_PassThrough` templates, four positional parameters
    and no other locals, and ``super`` must be the built-in in ``fn``'s globals and builtins.
    """
    try:
        return _PASS_THROUGH[fn]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable, hence not a plain function
        pass
    found = None
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if (
        code is not None
        and code.co_argcount == 4
        and code.co_nlocals == 4
        and not code.co_posonlyargcount
        and not code.co_kwonlyargcount
        and code.co_freevars == ("__class__",)
        and closure is not None
        and fn.__globals__.get("super", getattr(fn, "__builtins__", {}).get("super")) is builtins.super
    ):
        for keyword, template in ((False, _PassThrough.positional), (True, _PassThrough.keyword)):
            t = template.__code__
            if (
                code.co_code == t.co_code
                and code.co_names == t.co_names
                and code.co_flags & _KIND_FLAGS == t.co_flags & _KIND_FLAGS
                and _constants(code, fn.__doc__) == _constants(t, None)
            ):
                owner = closure[0].cell_contents
                found = (owner, keyword) if isinstance(owner, type) else None
                break
    if not torch.compiler.is_compiling():  # a write while dynamo traces would break the graph
        try:
            _PASS_THROUGH[fn] = found
        except TypeError:
            pass
    return found


def _retract_definer(kind: type) -> type | None:
    """The class in ``kind``'s MRO whose ``retract`` an instance of ``kind`` runs, recognized
    pass-through overrides (:func:`_pass_through_class`) followed; ``None`` when there is none, or
    when a forward passes ``radius=`` to a ``retract`` that names it otherwise (a TypeError there)."""
    mro = kind.__mro__
    start, keyword = 0, False
    while True:
        owner = next((k for k in mro[start:] if "retract" in k.__dict__), None)
        if owner is None:
            return None
        fn = owner.__dict__["retract"]
        if keyword and getattr(getattr(fn, "__code__", None), "co_varnames", ())[3:4] != ("radius",):
            return None
        if fn is _ANGLE_FORM_RETRACT:
            return owner
        found = _pass_through_class(fn)
        if found is None or found[0] not in mro or mro.index(found[0]) < mro.index(owner):
            return owner  # a retract of its own (a super() bound to a class not at or after the owner too)
        start, keyword = mro.index(found[0]) + 1, found[1]


def _class_retract_is_angle_form(kind: type) -> bool:
    """Whether instances of ``kind`` run :meth:`AngleRetraction.retract` (directly or through
    recognized pass-through overrides), whatever is set on an instance."""
    definer = _retract_definer(kind)
    return definer is not None and definer.__dict__["retract"] is _ANGLE_FORM_RETRACT


def _retract_is_angle_form(retraction: AngleRetraction) -> bool:
    """Whether ``retraction.retract`` is the angle form (module docstring, *Whose map runs*):
    :meth:`AngleRetraction.retract` itself, reached through a chain of recognized pass-through
    overrides (:func:`_pass_through_class`), and nothing of :data:`_MAP_ATTRIBUTES` set on the
    instance. The built-ins answer at the first step."""
    instance = getattr(retraction, "__dict__", None)
    if instance and any(name in instance for name in _MAP_ATTRIBUTES):
        return False
    return _class_retract_is_angle_form(type(retraction))


def _generic(retraction: AngleRetraction, name: str) -> bool:
    """Whether ``retraction``'s ``name`` (``"coefficients"`` or ``"coefficients_vjp"``) is
    :class:`AngleRetraction`'s generic one, derived from :meth:`~AngleRetraction.angle`: the class's
    (set by ``__init_subclass__`` for a class that defines ``angle`` alone) or the one
    :meth:`AngleRetraction.__setattr__` puts on an instance given an ``angle`` of its own."""
    generic = AngleRetraction.__dict__[name]
    own = getattr(retraction, "__dict__", {}).get(name)
    if own is None:
        return getattr(type(retraction), name) is generic
    return getattr(own, "__func__", None) is generic and getattr(own, "__self__", None) is retraction


def _owner(kind: type, name: str) -> type:
    """The class in ``kind``'s MRO that defines ``name``."""
    return next(k for k in kind.__mro__ if name in k.__dict__)


def _angle_mismatch(retraction: AngleRetraction) -> str | None:
    """``None`` when the ``coefficients`` that the angle form's ``retract`` runs are those of the
    ``angle`` that :meth:`AngleRetraction.retract_long_step` runs, else why not (a clause).

    They are when the coefficients are the generic ones (derived from whatever ``angle`` is in
    effect), or when both were written together: both set on the instance, or both defined in the
    same class (a class that writes both is taken at its word, as the built-ins are). A class
    without an ``angle`` gets ``None`` here: its long step raises ``NotImplementedError``, which
    :meth:`~manifoldlib.Sphere.retr` explains.
    """
    if _generic(retraction, "coefficients"):
        return None
    kind, instance = type(retraction), getattr(retraction, "__dict__", {})
    name = kind.__name__
    if "coefficients" in instance:
        if "angle" in instance:
            return None
        return (f"this {name} instance has its own coefficients, which retract runs, and not its own "
                f"angle: retract_long_step would rotate by {_owner(kind, 'angle').__name__}.angle, "
                f"another map")
    coefficients_owner = _owner(kind, "coefficients")
    if "angle" in instance:  # only where AngleRetraction.__setattr__ was bypassed
        return (f"this {name} instance has its own angle, which retract does not read (it runs "
                f"{coefficients_owner.__name__}.coefficients), but retract_long_step would")
    angle_owner = _owner(kind, "angle")
    if angle_owner is AngleRetraction or angle_owner is coefficients_owner:
        return None
    return (f"{name}.coefficients (defined in {coefficients_owner.__name__}) are not derived from "
            f"{name}.angle (defined in {angle_owner.__name__}): retract runs the coefficients, "
            f"retract_long_step would rotate by the angle, another map")


def _long_step_mismatch(retraction: AngleRetraction) -> str | None:
    """``None`` when ``retraction.retract_long_step`` is the long-step form of the map
    ``retraction.retract`` computes, else why not (a clause for an error message).

    It is

    * when ``retract_long_step`` is set on the instance (taken at its word);
    * when ``retract`` is the angle form of the class and ``retract_long_step``
      :meth:`AngleRetraction.retract_long_step`, which rotates by the ``angle`` in effect, and the
      coefficients that ``retract`` runs are that angle's (:func:`_angle_mismatch`): an ``angle``
      set on the instance included, for a class of generic coefficients or through
      :meth:`AngleRetraction.__setattr__`;
    * when the class defines ``retract_long_step`` in the class whose ``retract`` runs or in a
      subclass of it (taken at its word), and nothing of the map is set on the instance.

    A ``retract`` set on the instance, or an ``angle`` or ``coefficients`` set on it where the class
    has a long-step form of its own (which need not read them), is refused.
    """
    instance = getattr(retraction, "__dict__", None) or {}
    if "retract_long_step" in instance:
        return None
    kind = type(retraction)
    name = kind.__name__
    if "retract" in instance:
        return (f"this {name} instance has its own retract, so the class's retract_long_step would "
                f"compute another map")
    own_math = [a for a in ("angle", "coefficients") if a in instance]
    angle_form = _class_retract_is_angle_form(kind)
    long_owner = next((k for k in kind.__mro__ if "retract_long_step" in k.__dict__), None)
    if angle_form and long_owner is AngleRetraction:
        return _angle_mismatch(retraction)
    if own_math:
        definer = (_retract_definer(kind) or kind).__name__
        what = (f"{definer}.retract is a map of its own" if not angle_form
                else f"{long_owner.__name__}.retract_long_step is a long-step form of the class's own")
        return (f"this {name} instance has its own {', '.join(own_math)}, and {what}, which need not "
                f"read it")
    if angle_form:
        return None  # a class's own long-step form for the angle form: taken at its word
    mro = kind.__mro__
    definer = _retract_definer(kind)
    if definer is not None and long_owner is not None and mro.index(long_owner) <= mro.index(definer):
        return None
    definer_name = (definer or kind).__name__
    if long_owner is AngleRetraction:
        inherited = "AngleRetraction.retract_long_step, the angle form from angle()"
    else:
        inherited = f"{getattr(long_owner, '__name__', None)}.retract_long_step, from a class above {definer_name}"
    return (f"{name}.retract is a map of its own (defined in {definer_name}, not AngleRetraction's "
            f"angle form), and its long-step form ({inherited}) would return another map's point")
