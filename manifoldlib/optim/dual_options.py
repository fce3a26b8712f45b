"""The dual-solver options of a :class:`~manifoldlib.optim.ManifoldMuon` group: one frozen, validated structure.

:class:`DualOptions` collects every knob of the per-step dual solve
(:func:`~manifoldlib.optim.steepest.solve_dual`). It is validated once, at construction; a
parameter group stores it as a plain ``dict`` (:meth:`DualOptions.as_dict`, strings and numbers
only), so ``optimizer.state_dict()`` round-trips through ``torch.load(weights_only=True)``, and
each step rebuilds it with :meth:`DualOptions.coerce`.

The keyword arguments it replaced (``msign_method``, ``dual_tol``, ``dual_max_iter``,
``warm_start``, ``dual_smoothing``, ``dual_update``, ``dual_spectral``) raise a ``TypeError``
naming the field (:data:`REPLACED_KWARGS`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .._numbers import is_integer, is_real
from .execution import SPECTRAL_PATHS
from .steepest import DUAL_UPDATES

__all__ = ["DUAL_MSIGN_METHODS", "REPLACED_KWARGS", "DualOptions", "reject_replaced_kwargs"]

#: Dual-solve msign methods; "ns" is the group's own Newton–Schulz (ns_coefficients, ns_steps).
DUAL_MSIGN_METHODS = ("ns", "jordan5", "polar-express", "newton-schulz", "svd")
#: Former :class:`~manifoldlib.optim.ManifoldMuon` keyword arguments -> their :class:`DualOptions` field.
REPLACED_KWARGS = {
    "msign_method": "msign_method",
    "dual_tol": "tol",
    "dual_max_iter": "max_iter",
    "warm_start": "warm_start",
    "dual_smoothing": "smoothing",
    "dual_update": "update",
    "dual_spectral": "spectral",
}


@dataclass(frozen=True)
class DualOptions:
    """How each step's dual solve runs (see :func:`~manifoldlib.optim.steepest_direction`).

    Attributes:
        msign_method: msign inside the dual: ``"ns"`` (default: the group's Newton–Schulz,
            ``ns_coefficients`` and ``ns_steps``, so the dual sees the msign Muon uses),
            ``"jordan5"``, ``"polar-express"``, ``"newton-schulz"`` or ``"svd"`` (exact, slow).
        tol: relative tangent residual at which the solve stops (default ``1e-3``).
        max_iter: cap on dual iterations per step (default 30).
        warm_start: start from the previous step's correction :math:`\\Lambda - \\Lambda_0` (default ``True``).
        smoothing: ``"auto"`` (default: the smoothed Newton–CG dual where the plain one cannot
            converge — square DGram — or stalls), ``None`` (plain dual everywhere) or a number > 0.
        update: plain-dual steps: ``"auto"`` (``"anderson"`` on the eigh path, ``"bb"`` on the
            SVD or products path), ``"anderson"`` or ``"bb"``.
        spectral: ``"auto"`` (products on CUDA, eigh elsewhere), ``"eigh"`` or ``"products"``.
    """

    msign_method: str = "ns"
    tol: float = 1e-3
    max_iter: int = 30
    warm_start: bool = True
    smoothing: str | float | None = "auto"
    update: str = "auto"
    spectral: str = "auto"

    def __post_init__(self) -> None:
        if self.msign_method not in DUAL_MSIGN_METHODS:
            raise ValueError(f"dual msign_method must be one of {', '.join(DUAL_MSIGN_METHODS)}, got {self.msign_method!r}")
        if not (is_real(self.tol) and math.isfinite(self.tol) and self.tol > 0):
            raise ValueError(f"dual tol must be a finite number > 0, got {self.tol!r}")
        if not (is_integer(self.max_iter) and self.max_iter >= 0):
            raise ValueError(f"dual max_iter must be an int >= 0, got {self.max_iter!r}")
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"dual warm_start must be True or False, got {self.warm_start!r}")
        s = self.smoothing
        if not (s is None or s == "auto" or (is_real(s) and math.isfinite(s) and s > 0)):
            raise ValueError(f"dual smoothing must be 'auto', None or a finite number > 0, got {s!r}")
        # Python numbers (NumPy scalars included): as_dict() must load with weights_only=True
        object.__setattr__(self, "tol", float(self.tol))
        object.__setattr__(self, "max_iter", int(self.max_iter))
        if is_real(s):
            object.__setattr__(self, "smoothing", float(s))
        if self.update not in DUAL_UPDATES:
            raise ValueError(f"dual update must be one of {', '.join(DUAL_UPDATES)}, got {self.update!r}")
        if self.spectral not in SPECTRAL_PATHS:
            raise ValueError(f"dual spectral must be one of {', '.join(SPECTRAL_PATHS)}, got {self.spectral!r}")
        if self.update == "anderson" and self.msign_method == "svd":
            raise ValueError("dual update='anderson' needs a Newton-Schulz msign_method, got msign_method='svd'")
        if self.update == "anderson" and self.spectral == "products":
            raise ValueError(
                "dual update='anderson' needs the eigenbasis of the dual's Gram matrix, got spectral='products' "
                "(no eigendecomposition): use update='auto' or 'bb'"
            )

    @classmethod
    def coerce(cls, value) -> "DualOptions":
        """``value`` as :class:`DualOptions`: ``None`` (defaults), a mapping of fields, or an instance.

        Raises:
            TypeError: an unknown field (the message lists the valid ones) or another type.
            ValueError: a field out of range.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - fields)
            if unknown:
                raise TypeError(f"unknown dual option(s) {unknown}; valid: {', '.join(sorted(fields))}")
            return cls(**value)
        raise TypeError(f"dual must be None, a dict or a DualOptions, got {type(value).__name__}")

    def as_dict(self) -> dict:
        """Plain data (what a parameter group stores)."""
        return dataclasses.asdict(self)


def reject_replaced_kwargs(options: dict, where: str) -> None:
    """Raise ``TypeError`` naming the :class:`DualOptions` field of a replaced keyword in ``options``."""
    old = [k for k in options if k in REPLACED_KWARGS]
    if old:
        hints = ", ".join(f"{k}=... -> dual={{'{REPLACED_KWARGS[k]}': ...}}" for k in old)
        raise TypeError(f"{where}: {', '.join(old)} were replaced by the dual options structure ({hints})")
