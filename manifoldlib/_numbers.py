"""What the library accepts as a number in its options (one definition for every validator).

A *real* is a Python or NumPy real number — ``float``, ``int``, ``np.float32`` — but not a
``bool`` (``True`` would pass as 1) and not a string; NaN and inf are reals (range checks decide
about them). An *integer* is a Python or NumPy integer, again not a ``bool``.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["is_integer", "is_real", "require_positive"]


def is_real(value) -> bool:
    """Whether ``value`` is a real number (Python or NumPy; bools excluded, NaN and inf included)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value) -> bool:
    """Whether ``value`` is an integer (Python or NumPy; bools excluded)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_positive(name: str, value) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a real, finite and ``> 0``."""
    if not (is_real(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
