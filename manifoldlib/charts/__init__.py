"""Curved parameter charts installed with ``torch.nn.utils.parametrize``: SymExpLin (SEL).

``apply_chart(model, SEL, include=...)`` converts (pretrained) weights into chart coordinates,
``merge_charts(model)`` stores the effective weights back into plain modules.
``split_blocks(model)`` / ``merge_blocks(model)`` turn a fused q/k/v projection into separate
blocks (exact, linear) and back.
"""

from .base import Chart, apply_chart, assert_chart_compatible, chart_parameter_names, merge_charts
from .blocks import FUSED_NAMES, PER_HEAD_NAMES, SplitBlocks, merge_blocks, split_blocks
from .inverse import solve_expm1_linear, solve_expm1_minus_linear
from .kernel import SEL_IMPLS, sel_forward_rule
from .schedule import SEL_ROLES, SELLRMultiplier, sel_lr_lambdas, sel_lr_scheduler, sel_param_groups
from .sel import SEL, SEL_CALIBRATIONS, SEL_INITS, SEL_LAYOUTS

__all__ = [
    "FUSED_NAMES",
    "PER_HEAD_NAMES",
    "SEL",
    "SEL_IMPLS",
    "SEL_CALIBRATIONS",
    "SEL_INITS",
    "SEL_LAYOUTS",
    "SEL_ROLES",
    "Chart",
    "SELLRMultiplier",
    "SplitBlocks",
    "apply_chart",
    "assert_chart_compatible",
    "chart_parameter_names",
    "merge_blocks",
    "merge_charts",
    "sel_forward_rule",
    "sel_lr_lambdas",
    "sel_lr_scheduler",
    "sel_param_groups",
    "solve_expm1_linear",
    "solve_expm1_minus_linear",
    "split_blocks",
]
