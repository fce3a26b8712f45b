r"""Parameter groups and learning-rate annealing for SEL scale parameters.

The seed's schedule: the outer scale :math:`e_w` starts with a *high* learning rate (signs and
magnitudes settle fast) that anneals down to the scale rate, while the inner multiplier :math:`m`
starts *low* (curvature is refined only once the scales are stable) and rises to it. With
:math:`p = \min(t/T, 1)` and the cosine ramp :math:`r(p) = \tfrac12(1 + \cos\pi p)` (1 → 0):

.. math::
    \lambda_{e_w}(t) = 1 + (\text{e\_w\_boost} - 1)\,r(p), \qquad
    \lambda_m(t) = \text{m\_start} + (1 - \text{m\_start})(1 - r(p)),

and 1 for every other group; each multiplier is further multiplied by an optional ``base(t)``
(e.g. warmup–cosine). :class:`SELLRMultiplier` objects are what
:class:`torch.optim.lr_scheduler.LambdaLR` expects (one per group, picklable, state-dict friendly).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .._numbers import is_real
from .sel import SEL

__all__ = ["SEL_ROLES", "SELLRMultiplier", "sel_lr_lambdas", "sel_lr_scheduler", "sel_param_groups"]

#: Roles of an :class:`~manifoldlib.charts.SEL` chart's parameters (the ``"sel_role"`` tag of
#: the groups made by :func:`sel_param_groups`).
SEL_ROLES = ("e_w", "l_w", "m", "n", "delta")
#: Every ``"sel_role"`` :func:`sel_param_groups` tags a group with (what
#: :class:`SELLRMultiplier` accepts as ``role``).
_GROUP_ROLES = ("weight", "other", *SEL_ROLES)


def sel_param_groups(
    model: nn.Module,
    lr: float,
    scale_lr: float | None = None,
    weight_decay: float = 0.0,
) -> list[dict]:
    """Split a model's parameters into groups for a torch optimizer, tagged with ``"sel_role"``.

    Groups (empty ones are dropped): ``"weight"`` (tensors with ``dim >= 2``, SEL raw coordinates
    included, with ``weight_decay``), ``"other"`` (``dim < 2``, no decay), then one group per SEL
    role in :data:`SEL_ROLES` at ``scale_lr`` without decay (``delta`` at ``lr``).

    Args:
        model: a model, possibly with SEL charts (:func:`~manifoldlib.charts.apply_chart`).
        lr: learning rate for weights (and the low-rank residual).
        scale_lr: learning rate for the SEL scales (default ``lr``).
        weight_decay: decoupled weight decay for the ``"weight"`` group.

    Returns:
        A list of param-group dicts; every trainable parameter appears exactly once.

    Raises:
        ValueError: for a negative or non-finite ``lr``, ``scale_lr`` or ``weight_decay``.
    """
    for key, value in (("lr", lr), ("scale_lr", scale_lr), ("weight_decay", weight_decay)):
        if value is not None and not (is_real(value) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
    scale_lr = lr if scale_lr is None else scale_lr
    roles: dict[int, str] = {}
    for module in model.modules():
        if isinstance(module, SEL):
            for role, params in module.scale_parameters().items():
                roles.update((id(p), role) for p in params)
    buckets: dict[str, list[nn.Parameter]] = {r: [] for r in ("weight", "other", *SEL_ROLES)}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        role = roles.get(id(p), "weight" if p.dim() >= 2 else "other")
        buckets[role].append(p)
    settings = {"weight": (lr, weight_decay), "other": (lr, 0.0), "delta": (lr, 0.0)}
    groups = []
    for role, params in buckets.items():
        if params:
            group_lr, wd = settings.get(role, (scale_lr, 0.0))
            groups.append({"params": params, "lr": group_lr, "weight_decay": wd, "sel_role": role})
    return groups


class SELLRMultiplier:
    """LR multiplier for one param group: ``multiplier(step) -> float`` (see the module formulas).

    Args:
        role: the group's ``"sel_role"``: ``"e_w"`` and ``"m"`` are annealed; ``"weight"``,
            ``"other"`` and the other roles of :data:`SEL_ROLES` are constant. Any other value is
            refused (a misspelt ``"e-w"`` would otherwise get no annealing, silently).
        anneal_steps: :math:`T`, steps over which the ramp runs (>= 1).
        e_w_boost: initial multiplier of the ``e_w`` group (>= 1).
        m_start: initial multiplier of the ``m`` group (in (0, 1]).
        base: optional schedule ``base(step) -> float`` multiplied into every group.

    Raises:
        ValueError: for an unknown ``role``, a bad ``anneal_steps``, ``e_w_boost`` or
            ``m_start``, or a ``base`` that is not callable.
    """

    def __init__(
        self,
        role: str,
        anneal_steps: int,
        e_w_boost: float = 10.0,
        m_start: float = 0.1,
        base: Callable[[int], float] | None = None,
    ) -> None:
        if not (isinstance(role, str) and role in _GROUP_ROLES):
            raise ValueError(f"role must be one of {_GROUP_ROLES} (the 'sel_role' tags of "
                             f"sel_param_groups), got {role!r}")
        if base is not None and not callable(base):
            raise ValueError(f"base must be None or a callable base(step) -> float, got {base!r}")
        if not isinstance(anneal_steps, int) or isinstance(anneal_steps, bool) or anneal_steps < 1:
            raise ValueError(f"anneal_steps must be an int >= 1, got {anneal_steps!r}")
        if not (is_real(e_w_boost) and math.isfinite(e_w_boost) and e_w_boost >= 1):
            raise ValueError(f"e_w_boost must be a finite number >= 1, got {e_w_boost!r}")
        if not (is_real(m_start) and math.isfinite(m_start) and 0 < m_start <= 1):
            raise ValueError(f"m_start must be in (0, 1], got {m_start!r}")
        self.role, self.anneal_steps = role, anneal_steps
        self.e_w_boost, self.m_start, self.base = e_w_boost, m_start, base

    def __call__(self, step: int) -> float:
        ramp = 0.5 * (1.0 + math.cos(math.pi * min(step / self.anneal_steps, 1.0)))  # 1 -> 0
        if self.role == "e_w":
            mult = 1.0 + (self.e_w_boost - 1.0) * ramp
        elif self.role == "m":
            mult = self.m_start + (1.0 - self.m_start) * (1.0 - ramp)
        else:
            mult = 1.0
        return mult * (1.0 if self.base is None else float(self.base(step)))


def sel_lr_lambdas(
    optimizer: torch.optim.Optimizer, anneal_steps: int, **kwargs
) -> list[SELLRMultiplier]:
    """One :class:`SELLRMultiplier` per param group, read from each group's ``"sel_role"``.

    Groups without a role (built by hand) get the constant multiplier (times ``base``); a group
    whose ``"sel_role"`` is not one :func:`sel_param_groups` makes is refused (``ValueError``).
    ``kwargs`` go to :class:`SELLRMultiplier`.
    """
    out = []
    for i, group in enumerate(optimizer.param_groups):
        role = group.get("sel_role", "weight")
        if not (isinstance(role, str) and role in _GROUP_ROLES):
            raise ValueError(f"param group {i} has sel_role {role!r}; expected one of "
                             f"{_GROUP_ROLES} (the tags of sel_param_groups)")
        out.append(SELLRMultiplier(role, anneal_steps, **kwargs))
    return out


def sel_lr_scheduler(
    optimizer: torch.optim.Optimizer, anneal_steps: int, **kwargs
) -> torch.optim.lr_scheduler.LambdaLR:
    """:class:`~torch.optim.lr_scheduler.LambdaLR` built from :func:`sel_lr_lambdas`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, sel_lr_lambdas(optimizer, anneal_steps, **kwargs)
    )
