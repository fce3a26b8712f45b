"""The :class:`Retraction` base class and the registry that makes retractions selectable by name.

A retraction :math:`R_x(v)` maps a tangent vector at :math:`x` to a point of the manifold with
:math:`R_x(0) = x` and :math:`\\mathrm{D}R_x(0) = \\mathrm{id}`. It is second order when the curve
:math:`t \\mapsto R_x(tv)` has zero tangential acceleration at 0. Each class states the order it
*claims* in :attr:`Retraction.order`; :mod:`manifoldlib.testing` measures it.

Registry keys are ``(manifold, name)``: ``register_retraction("sphere", "my-p3")`` decorates a
class (a name already taken needs ``override=True``); ``get_retraction("sphere", "my-p3",
**options)`` builds an instance; unknown names raise a ``ValueError`` that lists the valid ones.
"""

from __future__ import annotations

import abc
import inspect
from typing import Callable, TypeVar

import torch

__all__ = [
    "MANIFOLD_NAMES",
    "Retraction",
    "available_retractions",
    "get_retraction",
    "register_retraction",
    "resolve_retraction",
]

#: Manifold registries that exist; a retraction registers under one of these.
MANIFOLD_NAMES = ("sphere", "stiefel", "dgram", "oblique", "euclidean")

_REGISTRY: dict[str, dict[str, type["Retraction"]]] = {name: {} for name in MANIFOLD_NAMES}
_ALIASES: dict[str, dict[str, str]] = {name: {} for name in MANIFOLD_NAMES}

R = TypeVar("R", bound=type["Retraction"])

#: Called with no arguments after every registration. A cache of objects built from a registry
#: name (ManifoldMuon's group manifolds, :mod:`manifoldlib.optim.options`) registers its
#: ``cache_clear`` here: after ``override=True`` the name means another class, and a cached
#: manifold would go on running the replaced one.
_ON_REGISTER: list[Callable[[], None]] = []


class Retraction(abc.ABC):
    """A retraction of one manifold family.

    Subclasses set the class attributes :attr:`name`, :attr:`manifold` (the registry it belongs
    to) and :attr:`order` (1 or 2, the order it claims), and implement :meth:`retract`.
    Constructor keyword options (e.g. ``p`` of :class:`~manifoldlib.retractions.PRetraction`)
    must be plain data and are reported by :meth:`options`, so a retraction can be rebuilt from
    ``(manifold, name, options)``.
    """

    name: str = ""
    manifold: str = ""
    order: int = 1
    #: Whether the formula assumes ``x`` on the manifold, as a map that is not a projection of
    #: ``x + v`` does (Stiefel's ``exp`` and ``cayley``): ``retr`` of the manifold then refuses an
    #: ``x`` off it (a value check) instead of returning a point off the manifold or one of another
    #: start. A projection (``polar``, ``qr``, ``normalize``, DGram's) maps any ``x + v``.
    needs_point: bool = False

    @abc.abstractmethod
    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Map the tangent vector ``v`` at ``x`` to the manifold. Shapes follow the manifold."""

    def __call__(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.retract(x, v)

    def options(self) -> dict:
        """Constructor options as plain data (empty for option-free retractions)."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.options() == other.options()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.options().items()))))


def _check_manifold_name(manifold: str) -> None:
    if manifold not in _REGISTRY:
        raise ValueError(
            f"unknown manifold {manifold!r} for a retraction; valid manifolds: {', '.join(MANIFOLD_NAMES)}"
        )


def register_retraction(
    manifold: str, name: str, *, aliases: tuple[str, ...] = (), override: bool = False
) -> Callable[[R], R]:
    """Class decorator registering a :class:`Retraction` subclass as ``(manifold, name)``.

    Sets the class's ``name`` and ``manifold`` attributes; ``aliases`` (a tuple of non-empty
    strings) resolve to ``name``. The registry is process-wide, so a name or alias that is taken
    already (a built-in such as ``"gnomonic"``, or an earlier registration) is refused with a
    ``ValueError`` unless ``override=True``: replacing it changes what that name means for every
    later ``Sphere(retraction=...)``, ``SphereResidual`` and ``GPTConfig`` in the process.
    Re-running a notebook cell that registers a class therefore needs ``override=True``. A class
    that does not define ``retract``, whose ``order`` is not 1 or 2, or that belongs to another
    manifold already (its ``manifold`` is set, by itself, a base class such as
    :class:`~manifoldlib.retractions.AngleRetraction`, or an earlier registration) is refused
    before anything changes: an angle retraction normalizes the last dimension, so registered
    for ``"oblique"`` or ``"stiefel"`` it would return points off that manifold without an error.

    Raises:
        ValueError: unknown manifold, empty name or alias, a taken name without ``override``, a
            class of another manifold.
        TypeError: the decorated object is not a complete :class:`Retraction` subclass.
    """
    _check_manifold_name(manifold)
    if not name or not isinstance(name, str):
        raise ValueError(f"a retraction name must be a non-empty string, got {name!r}")
    if isinstance(aliases, str) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(f"aliases must be a tuple of non-empty strings, got {aliases!r}")
    if not isinstance(override, bool):
        raise ValueError(f"override must be True or False, got {override!r}")

    def decorator(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, Retraction)):
            raise TypeError(f"register_retraction decorates Retraction subclasses, got {cls!r}")
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise TypeError(f"{cls.__name__} does not define {missing}; a retraction implements "
                            f"retract(x, v)")
        if isinstance(cls.order, bool) or cls.order not in (1, 2):
            raise ValueError(f"{cls.__name__}.order must be 1 or 2, got {cls.order!r}")
        if cls.manifold and cls.manifold != manifold:
            owner = next(k for k in cls.__mro__ if "manifold" in k.__dict__).__name__
            raise ValueError(
                f"{cls.__name__} is a {cls.manifold} retraction (manifold={cls.manifold!r}, set by "
                f"{owner}); it cannot be registered for {manifold!r}: register it under "
                f"{cls.manifold!r}, or derive a retraction for {manifold!r} from Retraction"
            )
        if not override:
            _refuse_taken_names(manifold, (name, *aliases))
        cls.name = name
        cls.manifold = manifold
        _REGISTRY[manifold][name] = cls
        _ALIASES[manifold].pop(name, None)  # an alias of the same name would hide the new class
        for alias in aliases:
            _ALIASES[manifold][alias] = name
        for hook in _ON_REGISTER:
            hook()
        return cls

    return decorator


def _refuse_taken_names(manifold: str, names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` for the first of ``names`` that is registered (as a name or alias)."""
    for taken in names:
        canonical = _ALIASES[manifold].get(taken, taken)
        cls = _REGISTRY[manifold].get(canonical)
        if cls is not None:
            what = "" if canonical == taken else f" (an alias of {canonical!r})"
            raise ValueError(
                f"{manifold} retraction {taken!r}{what} is already registered as "
                f"{cls.__qualname__}; registering it again would replace it for the whole "
                f"process: pass override=True to replace it on purpose, or choose another name"
            )


def available_retractions(manifold: str) -> list[str]:
    """Registered retraction names (aliases included) of one manifold family, sorted."""
    _check_manifold_name(manifold)
    return sorted(set(_REGISTRY[manifold]) | set(_ALIASES[manifold]))


def get_retraction(manifold: str, name: str, **options) -> Retraction:
    """Build the retraction registered as ``(manifold, name)`` with constructor ``options``."""
    _check_manifold_name(manifold)
    canonical = _ALIASES[manifold].get(name, name)
    cls = _REGISTRY[manifold].get(canonical)
    if cls is None:
        raise ValueError(
            f"unknown {manifold} retraction {name!r}; valid names: "
            f"{', '.join(available_retractions(manifold))}"
        )
    try:
        inspect.signature(cls).bind(**options)
    except TypeError:
        accepted = [
            p.name
            for p in inspect.signature(cls).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        raise ValueError(
            f"{manifold} retraction {name!r} got unexpected options {sorted(options)}; "
            f"accepted options: {', '.join(accepted) if accepted else 'none'}"
        ) from None
    return cls(**options)


def resolve_retraction(manifold: str, retraction: "str | Retraction", **options) -> Retraction:
    """Accept a registered name or a :class:`Retraction` instance of the right manifold."""
    if isinstance(retraction, Retraction):
        if options:
            raise ValueError(
                f"options {sorted(options)} can only be given with a retraction name, "
                f"not with the instance {retraction!r}"
            )
        if retraction.manifold and retraction.manifold != manifold:
            raise ValueError(
                f"retraction {retraction!r} belongs to the {retraction.manifold!r} manifold, "
                f"expected one for {manifold!r}"
            )
        return retraction
    if isinstance(retraction, str):
        return get_retraction(manifold, retraction, **options)
    raise ValueError(
        f"retraction must be a registered name or a Retraction instance, got {retraction!r}"
    )
