"""Public tools for verifying retractions and optimizers: hypothesis strategies, exp-free order
checks, the optimizer conformance suite (:func:`check_optimizer`, :func:`assert_optimizer`), and
:func:`count_ops` (the ATen operators, host synchronizations and FLOPs of a call).

.. code-block:: python

    from manifoldlib import Sphere
    from manifoldlib.testing import assert_optimizer, assert_retraction, retraction_order

    retraction_order(Sphere(retraction="cayley"))   # ≈ 2.0
    assert_retraction(Sphere(retraction="my-p3"))   # raises AssertionError if a check fails
    assert_optimizer(lambda params: MyOptimizer(params, lr=0.1), Sphere())   # likewise

:mod:`~manifoldlib.testing.strategies` needs ``hypothesis`` (a test dependency); it is imported
on first use so the order checks work without it.
"""

from __future__ import annotations

from .cases import registered_manifolds
from .counting import SYNC_OPS, OpCounts, count_ops
from .conformance import OPTIMIZER_CHECKS, CheckResult, OptimizerReport, assert_optimizer, check_optimizer
from .hard_instances import HARD_INSTANCES, hard_instance, nearly_normal_instance, nuclear_dual_optimum
from .order import (
    DEFAULT_TS,
    ORDER_TOLERANCE,
    assert_retraction,
    central_difference_error,
    remainder_norms,
    retraction_order,
)
from .sampling import default_shape, point_norm, random_point, random_tangent

__all__ = [
    "SYNC_OPS",
    "OpCounts",
    "count_ops",
    "DEFAULT_TS",
    "HARD_INSTANCES",
    "OPTIMIZER_CHECKS",
    "ORDER_TOLERANCE",
    "CheckResult",
    "OptimizerReport",
    "assert_optimizer",
    "assert_retraction",
    "check_optimizer",
    "central_difference_error",
    "default_shape",
    "hard_instance",
    "nearly_normal_instance",
    "nuclear_dual_optimum",
    "point_norm",
    "random_point",
    "random_tangent",
    "registered_manifolds",
    "remainder_norms",
    "retraction_order",
    "strategies",
]


def __getattr__(name: str):
    if name == "strategies":
        import importlib

        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
