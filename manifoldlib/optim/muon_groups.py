"""The parameter groups of :class:`~manifoldlib.optim.ManifoldMuon`: their options, validated once, and their manifolds.

Group options are plain data (names, numbers, dicts), so ``state_dict()`` round-trips through
``torch.load(weights_only=True)``; :func:`group_manifold` builds (and caches) the manifold object
a group's options name, and :func:`group_dual` its :class:`~manifoldlib.optim.dual_options.DualOptions`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor

from .._numbers import is_real
from ..distributed import reject_unsupported_parameter
from ..manifolds import get_manifold
from ..retractions.base import available_retractions
from .dual_manifolds import STEEPEST_MANIFOLDS, dual_manifold
from .dual_options import REPLACED_KWARGS, DualOptions, reject_replaced_kwargs
from .execution import NS_DTYPES
from .layouts import check_layout
from .muon_step import ADJUST_LR_FNS

__all__ = [
    "DEFAULT_RETRACTIONS",
    "MUON_MANIFOLDS",
    "check_decay",
    "check_finite_gradients",
    "group_dual",
    "group_manifold",
    "validate_group_options",
    "validate_group_params",
]

#: Manifold names a ManifoldMuon group may use.
MUON_MANIFOLDS = ("euclidean",) + tuple(name for name in STEEPEST_MANIFOLDS if name != "euclidean")
#: Default retraction and its options per manifold (each manifold class names its own,
#: ``muon_retraction``): Stiefel and DGram take their polar factor from the n x n Gram matrix T
#: (two m·n² products against about ten for convergent Newton–Schulz). For a small step T is
#: diagonal up to O(η²) and T^{-1/2} costs one to four n x n products (functional.gram_rsqrt);
#: otherwise one eigh, whose eigenvalues give κ²ε and trigger a refining pass (> 1e-6) or a
#: float64 SVD (> 1e-4). Oblique normalizes the columns.
DEFAULT_RETRACTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    name: dual_manifold(name).muon_retraction for name in MUON_MANIFOLDS
}


def _finite(name: str, value: Any) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` for a non-number, a bool, NaN or inf.

    NaN falls through to the range checks (``lr must be >= 0, got nan``); inf would turn a Euclidean
    or DGram parameter non-finite at the first step, and a string or bool is not a number.
    """
    tensor = isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point()
    if not (tensor or is_real(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    number = float(value)
    if math.isinf(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    return number


def validate_group_options(group: MutableMapping) -> None:
    """Raise ``ValueError`` naming the option and the accepted values; store ``group["dual"]`` as a
    validated plain dict.

    ``lr`` (a number or a 1-element tensor), ``momentum``, ``weight_decay`` and ``eps`` must be
    finite numbers in their ranges, ``ns_coefficients`` three finite numbers, ``ns_steps`` an int
    and ``nesterov`` a bool (bools are not numbers here). The numbers are stored back as Python
    floats (``ns_coefficients`` as a tuple of them), NumPy scalars included.
    """
    reject_replaced_kwargs(group, "ManifoldMuon parameter group")
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element, got {lr.numel()} elements")
    if not 0.0 <= _finite("lr", lr):
        raise ValueError(f"lr must be >= 0, got {float(lr)}")
    if not 0.0 <= _finite("momentum", group["momentum"]) < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
    if not 0.0 <= _finite("weight_decay", group["weight_decay"]):
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    if not _finite("eps", group["eps"]) > 0.0:
        raise ValueError(f"eps must be > 0, got {group['eps']}")
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov must be True or False, got {group['nesterov']!r}")
    steps = group["ns_steps"]
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps < 100):
        raise ValueError(f"ns_steps must be an int in [0, 100), got {steps!r}")
    coeffs = group["ns_coefficients"]
    if not (isinstance(coeffs, (tuple, list)) and len(coeffs) == 3
            and all(is_real(c) and math.isfinite(c) for c in coeffs)):
        raise ValueError(f"ns_coefficients must be three finite numbers (a, b, c), got {coeffs!r}")
    # plain Python floats: a NumPy scalar in a group would make state_dict() unloadable with
    # torch.load(weights_only=True)
    if not isinstance(lr, Tensor):
        group["lr"] = float(lr)
    for key in ("momentum", "weight_decay", "eps"):
        group[key] = float(group[key])
    group["ns_coefficients"] = tuple(float(c) for c in coeffs)
    fn = group["adjust_lr_fn"]
    if fn is not None and fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be None or one of {', '.join(ADJUST_LR_FNS)}, got {fn!r}")
    manifold = group["manifold"]
    if manifold not in MUON_MANIFOLDS:
        raise ValueError(f"unknown manifold {manifold!r}; valid: {', '.join(MUON_MANIFOLDS)}")
    retraction = group["retraction"]
    if retraction is not None and retraction not in available_retractions(manifold):
        raise ValueError(
            f"unknown {manifold} retraction {retraction!r}; valid: {', '.join(available_retractions(manifold))}"
        )
    options = group.get("retraction_options")
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"retraction_options must be a dict of plain-data options, got {options!r}")
    if options is not None:
        group["retraction_options"] = dict(options)  # the group's own: not the caller's dict
    check_layout(group.get("layout", "out_in"))
    ns_dtype = group.get("ns_dtype", "auto")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
    group["dual"] = DualOptions.coerce(group.get("dual")).as_dict()


def validate_group_params(group: MutableMapping) -> None:
    """Raise ``ValueError`` naming the first parameter of ``group`` that ManifoldMuon cannot take:
    not a whole tensor (DTensor, FSDP-flattened), not 2-D, complex, or on the meta device."""
    names = group.get("param_names") or [None] * len(group["params"])
    for index, (p, name) in enumerate(zip(group["params"], names)):
        reject_unsupported_parameter(p, name)
        if p.ndim != 2:
            raise ValueError(
                f"ManifoldMuon only takes 2-D matrices; a parameter of shape {tuple(p.shape)} "
                f"is in a group with manifold {group['manifold']!r}"
            )
        if torch.is_complex(p):
            raise ValueError("ManifoldMuon does not support complex parameters")
        if p.device.type == "meta":
            label = repr(name) if name is not None else f"#{index} of its group"
            raise ValueError(
                f"parameter {label} of shape {tuple(p.shape)} is on the meta device; "
                f"materialize it (e.g. module.to_empty(device=...) and initialize it) before "
                f"building the optimizer"
            )


def check_decay(group: MutableMapping) -> None:
    """Raise ``ValueError`` when a constrained manifold with a scale freedom (DGram) would be
    decayed by a factor ``1 - lr * weight_decay <= 0``, which flips or zeroes ``W``.

    Checked every step, before any buffer moves: a scheduler may raise ``lr`` after construction.
    (Euclidean groups take ``torch.optim.Muon``'s decay unchanged, whatever its factor.)
    """
    manifold = group_manifold(group)
    lr, weight_decay = float(group["lr"]), group["weight_decay"]
    if manifold.decays and not manifold.flat and lr * weight_decay >= 1:
        raise ValueError(
            f"ManifoldMuon: lr * weight_decay must be < 1 on {group['manifold']!r} (the decoupled "
            f"weight decay multiplies W by 1 - lr * weight_decay), got lr={lr!r}, "
            f"weight_decay={weight_decay!r}; no parameter or momentum buffer was changed this step"
        )


def check_finite_gradients(group: MutableMapping, params: list[Tensor], grads: list[Tensor]) -> None:
    """Raise ``ValueError`` naming the first parameter of ``group`` whose gradient has a NaN or inf.

    One reduction per gradient, stacked, and one host synchronization per group: the sum of a
    tensor is finite exactly when its entries are (short of an overflow of finite sums, which
    would also break the step). The sum is taken in the gradient's dtype, or float32 for
    half-precision ones, so a finite float64 gradient beyond float32's range passes. Called
    before any momentum buffer or parameter changes.
    """
    finite = torch.stack([torch.isfinite(g.sum(dtype=torch.promote_types(g.dtype, torch.float32)))
                          for g in grads])
    if bool(finite.all()):
        return
    bad = int((~finite).nonzero()[0])
    p = params[bad]
    index = next(i for i, q in enumerate(group["params"]) if q is p)
    names = group.get("param_names")
    name = f" {names[index]!r}" if names is not None and index < len(names) else ""
    raise ValueError(
        f"ManifoldMuon: the gradient of parameter{name} (index {index} in its group, shape "
        f"{tuple(p.shape)}, manifold {group['manifold']!r}) has non-finite entries (NaN or inf); "
        f"no parameter or momentum buffer was changed this step"
    )


def group_dual(group: MutableMapping) -> DualOptions:
    """The group's :class:`DualOptions`; a group saved before they existed (separate keys) reads those."""
    if "dual" in group:
        return DualOptions.coerce(group["dual"])
    return DualOptions(**{field: group[old] for old, field in REPLACED_KWARGS.items() if old in group})


def group_manifold(group: MutableMapping):
    """The manifold object of a group, built from its plain-data options (once per distinct options)."""
    name = group["manifold"]
    default_name, default_opts = DEFAULT_RETRACTIONS[name]
    retraction = group["retraction"] or default_name
    options = dict(group.get("retraction_options") or {})
    if group["retraction"] is None:
        options = {**default_opts, **options}
    try:
        return _manifold_for(name, retraction, tuple(sorted(options.items())))
    except TypeError:  # an unhashable option value: build it afresh
        return get_manifold(name, retraction=retraction, **options)


@functools.lru_cache(maxsize=64)
def _manifold_for(name: str, retraction: str, options: tuple):
    return get_manifold(name, retraction=retraction, **dict(options))
