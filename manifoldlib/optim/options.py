r"""The options of Manifold Muon, validated once: group options, :class:`DualOptions`, :class:`Distribution`.

A parameter group holds plain data only (names, numbers, dicts), so ``state_dict()`` round-trips
through ``torch.load(weights_only=True)``. :func:`validate_group` checks a group once, when it is
added, and stores its numbers as Python floats; each step reads the validated values.

* :class:`DualOptions`: every knob of the per-step dual solve (one frozen structure; a group
  stores it as a dict, :meth:`DualOptions.as_dict`).
* :class:`Distribution`: how the steps of a data-parallel job are shared (an optimizer
  attribute, not a group option).
* :func:`adjusted_lr`: Muon's shape adjustment of the learning rate.
* The storage ``layout`` of a matrix (:data:`LAYOUTS`, :func:`tall`, :func:`weight_layout`), below.

**Storage layouts.** How a matrix parameter is stored, and the orientation Manifold Muon constrains it in.

A manifold of :mod:`manifoldlib.manifolds` constrains the linear map's own matrix
:math:`W \in \mathbb{R}^{\text{out} \times \text{in}}` (:math:`y = W x`) in its tall orientation:
a tall Stiefel point has orthonormal columns, :math:`W^\top W = I`; a wide one orthonormal rows.
``torch.nn.Linear`` stores exactly :math:`W` (layout ``"out_in"``); Hugging Face's ``Conv1D``
(GPT-2) stores :math:`W^\top` and computes :math:`x W^\top` (layout ``"in_out"``).

For a rectangular matrix the layout makes no difference (the tall orientation of :math:`W` and of
:math:`W^\top` is the same matrix), nor for square Stiefel (:math:`W^\top W = I \iff W W^\top = I`).
For a *square* DGram or Oblique matrix it does: :math:`\operatorname{Off}(W^\top W) = 0` makes the
map's input directions orthogonal, :math:`\operatorname{Off}(W W^\top) = 0` its output rows. A
group's ``layout`` option tells :class:`~manifoldlib.optim.ManifoldMuon` which one it holds, so a
GPT-2 ``Conv1D`` and the equivalent ``nn.Linear`` get the same constraint on the same map (and the
same ``adjust_lr_fn`` shape factor, which reads :math:`W`'s rows and columns).
:func:`~manifoldlib.optim.build_optimizer` sets it from each parameter's module
(:func:`weight_layout`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import geoopt
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .._numbers import is_integer, is_real
from ..distributed import STRATEGIES, reject_unsupported_parameter
from ..manifolds import get_manifold
from ..retractions.base import _ON_REGISTER
from ..charts.blocks import SplitBlocks, output_dim
from .execution import NS_DTYPES, SPECTRAL_PATHS

__all__ = [
    "ADJUST_LR_FNS",
    "AUTO_SMOOTHING",
    "DISTRIBUTION_MODES",
    "DUAL_MSIGN_METHODS",
    "DUAL_UPDATES",
    "LAYOUTS",
    "PRODUCTS_ITERATIONS",
    "SMOOTH_BELOW_ASPECT",
    "Distribution",
    "DualOptions",
    "MuonOptions",
    "adjusted_lr",
    "check_layout",
    "flipped",
    "map_shape",
    "resolve_smoothing",
    "tall",
    "validate_group",
    "validate_group_params",
    "weight_layout",
]

#: Storage layouts of a matrix parameter: the map's ``(out, in)`` (``torch.nn.Linear``, the
#: default) or its transpose ``(in, out)`` (Hugging Face ``Conv1D``).
LAYOUTS = ("out_in", "in_out")


def check_layout(layout) -> str:
    """``layout``, or ``ValueError`` naming it and the accepted values."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)} (torch.nn.Linear's (out, in) or a "
                         f"Hugging Face Conv1D's (in, out)), got {layout!r}")
    return layout


def flipped(shape, layout: str = "out_in") -> bool:
    """Whether the stored matrix of ``shape`` is transposed to give the map's tall orientation."""
    rows, cols = shape[-2], shape[-1]
    return rows < cols or (rows == cols and layout == "in_out")


def tall(t: Tensor, layout: str = "out_in") -> Tensor:
    """``t`` as its manifold constrains it: the map's matrix in its tall orientation
    (``(..., m, n)``, ``m >= n``); a view, and :func:`flipped` says whether it is transposed."""
    return t.mT if flipped(t.shape, layout) else t


def map_shape(shape, layout: str = "out_in") -> tuple[int, int]:
    """``(out, in)`` of the map a stored matrix of ``shape`` holds."""
    rows, cols = shape[-2], shape[-1]
    return (cols, rows) if layout == "in_out" else (rows, cols)


def weight_layout(module: nn.Module) -> str:
    """The layout of the matrices ``module`` owns: ``"in_out"`` for a Hugging Face ``Conv1D`` and
    for the blocks :func:`~manifoldlib.charts.split_blocks` cut from one (split along dim 1, the
    output dimension of an ``(in, out)`` weight), ``"out_in"`` for everything else."""
    if output_dim(module) == 1:
        return "in_out"
    if isinstance(module, parametrize.ParametrizationList) and any(
        isinstance(p, SplitBlocks) and p.dim == 1 for p in module
    ):
        return "in_out"
    return "out_in"


#: Learning-rate adjustments (``None`` picks ``"original"`` on Euclidean groups, ``"spectral"`` else).
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral")
#: Dual-solve msign maps; ``"ns"`` is the group's own Newton–Schulz (``ns_coefficients``, ``ns_steps``).
DUAL_MSIGN_METHODS = ("ns", "jordan5", "polar-express", "newton-schulz", "svd")
#: How the plain dual moves: ``"auto"`` (Anderson on the eigh path, Barzilai–Borwein elsewhere, a
#: sync-free Stiefel bank by :func:`~manifoldlib.optim.dual_solvers.stiefel_solve`, its steps
#: written out), ``"anderson"`` or ``"bb"`` (Barzilai–Borwein on the general
#: :class:`~manifoldlib.optim.dual.DualProblem`, for Stiefel too).
DUAL_UPDATES = ("auto", "anderson", "bb")
#: ``max_iter=None`` on a sync-free solve: the dual iterations every step runs.
PRODUCTS_ITERATIONS = 3
#: ``max_iter=None`` on an early-stopping solve: the cap (the loop stops when every matrix has converged).
EARLY_STOP_MAX_ITER = 30
#: ``distribution`` modes: every rank solves every matrix, or each matrix on one owner rank.
DISTRIBUTION_MODES = ("replicated", "sharded")


@dataclass(frozen=True)
class DualOptions:
    r"""How a steepest-direction dual is solved (:func:`~manifoldlib.optim.steepest_direction`,
    each :class:`~manifoldlib.optim.ManifoldMuon` step).

    Attributes:
        msign_method: the spectral map inside the dual: ``"ns"`` (the optimizer's default: the
            group's Newton–Schulz, so the dual sees the map Muon uses), ``"jordan5"``,
            ``"polar-express"``, ``"newton-schulz"`` or ``"svd"`` (exact;
            :func:`~manifoldlib.optim.steepest_direction`'s default).
        ns_steps: Newton–Schulz steps of the map (``None``: the preset's, or the group's for ``"ns"``).
        tol: relative tangent residual :math:`\|A - P_WA\|_F/\|A\|_F` at which a matrix has converged.
        max_iter: dual iterations. ``None``: :data:`PRODUCTS_ITERATIONS` on a sync-free solve (a
            fixed count), :data:`EARLY_STOP_MAX_ITER` as the cap of an early-stopping one.
        patience: a matrix's plain dual stops after this many iterations without a 10% cut of its
            best residual (``None``: never); where smoothing is ``"auto"`` it then continues on the
            smoothed dual, whose Newton steps run to ``tol`` or the iteration budget.
        warm_start: start from the previous step's correction :math:`\Lambda - \Lambda_0`.
        smoothing: ``"auto"`` (the smoothed dual where the plain one cannot converge — square
            DGram — or crawls), ``None`` (never) or a relative smoothing :math:`\kappa > 0`.
        update: plain-dual steps, one of :data:`DUAL_UPDATES`.
        spectral: ``"auto"``, ``"eigh"`` or ``"products"`` (:mod:`~manifoldlib.optim.execution`).
        gap_tol: with ``smoothing="auto"``, the largest certified relative duality gap of a
            smoothed answer (the smoothing shrinks until it is met); ``None``: keep the first
            smoothing that meets ``tol`` (a training step needs no certificate).
        sync_free: run a fixed number of iterations and read nothing back to the host (``True``),
            or stop as soon as every matrix has converged (``False``); ``None``: sync-free on the
            products path (:mod:`~manifoldlib.optim.execution`). On the eigh path each
            eigendecomposition synchronizes a CUDA device with the host itself (torch's
            ``linalg.eigh``), so only the products path is free of host synchronization.
    """

    msign_method: str = "ns"
    ns_steps: int | None = None
    tol: float = 1e-3
    max_iter: int | None = None
    patience: int | None = 6
    warm_start: bool = True
    smoothing: str | float | None = "auto"
    update: str = "auto"
    spectral: str = "auto"
    gap_tol: float | None = None
    sync_free: bool | None = None

    def __post_init__(self) -> None:
        def bad(field: str, accepted: str) -> ValueError:
            return ValueError(f"dual {field} must be {accepted}, got {getattr(self, field)!r}")

        if self.msign_method not in DUAL_MSIGN_METHODS:
            raise bad("msign_method", f"one of {', '.join(DUAL_MSIGN_METHODS)}")
        if self.ns_steps is not None and not (is_integer(self.ns_steps) and 0 <= self.ns_steps < 100):
            raise bad("ns_steps", "None or an int in [0, 100)")
        if not (is_real(self.tol) and math.isfinite(self.tol) and self.tol > 0):
            raise bad("tol", "a finite number > 0")
        if self.max_iter is not None and not (is_integer(self.max_iter) and self.max_iter >= 0):
            raise bad("max_iter", "None or an int >= 0")
        if self.patience is not None and not (is_integer(self.patience) and self.patience >= 1):
            raise bad("patience", "None or an int >= 1")
        if not isinstance(self.warm_start, bool):
            raise bad("warm_start", "True or False")
        s = self.smoothing
        if not (s is None or s == "auto" or (is_real(s) and math.isfinite(s) and s > 0)):
            raise bad("smoothing", "'auto', None or a finite number > 0")
        if self.sync_free is not None and not isinstance(self.sync_free, bool):
            raise bad("sync_free", "None, True or False")
        if self.update not in DUAL_UPDATES:
            raise bad("update", f"one of {', '.join(DUAL_UPDATES)}")
        if self.spectral not in SPECTRAL_PATHS:
            raise bad("spectral", f"one of {', '.join(SPECTRAL_PATHS)}")
        g = self.gap_tol
        if g is not None and not (is_real(g) and math.isfinite(g) and g > 0):
            raise bad("gap_tol", "None or a finite number > 0")
        if self.update == "anderson" and self.msign_method == "svd":
            raise ValueError("dual update='anderson' needs a Newton-Schulz msign_method (its steps use the "
                             "eigenbasis of the n x n Gram matrix), got msign_method='svd': use 'bb' or 'auto'")
        if self.update == "anderson" and self.spectral == "products":
            raise ValueError("dual update='anderson' needs the eigenbasis of the dual's Gram matrix, got "
                             "spectral='products' (no eigendecomposition): use update='auto' or 'bb'")
        # Python numbers (NumPy scalars included): as_dict() must load with weights_only=True
        for name, cast in (("tol", float), ("max_iter", int), ("patience", int), ("ns_steps", int),
                           ("gap_tol", float)):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, cast(value))
        if is_real(s):
            object.__setattr__(self, "smoothing", float(s))

    @classmethod
    def coerce(cls, value: DualOptions | Mapping | None, **defaults: Any) -> DualOptions:
        """``value`` as :class:`DualOptions`: ``None``, a mapping of fields (over ``defaults``) or an instance.

        Raises:
            TypeError: an unknown field (the message lists the valid ones) or another type.
            ValueError: a field out of range.
        """
        if isinstance(value, cls):
            return value
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise TypeError(f"dual options must be None, a dict or a DualOptions, got {type(value).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise TypeError(f"unknown dual option(s) {unknown}; valid: {', '.join(sorted(fields))}")
        return cls(**{**defaults, **value})

    def as_dict(self) -> dict:
        """Plain data (what a parameter group stores)."""
        return dataclasses.asdict(self)

    def iterations(self, sync_free: bool) -> int:
        """The iteration count (sync-free) or cap (early stopping) that ``max_iter`` resolves to."""
        if self.max_iter is not None:
            return self.max_iter
        return PRODUCTS_ITERATIONS if sync_free else EARLY_STOP_MAX_ITER


#: Relative smoothing :math:`\kappa` of ``smoothing="auto"``.
AUTO_SMOOTHING = 2e-2
#: ``smoothing="auto"`` smooths from the start below this aspect ratio ``m/n`` (tall orientation;
#: square Stiefel excepted): there :math:`G_\perp^\top G_\perp` has rank ``m - n`` or sits at the
#: Marchenko–Pastur edge, the optimum is close to rank deficient and the plain dual crawls.
SMOOTH_BELOW_ASPECT = 2.5


def resolve_smoothing(smoothing, manifold, shape, exact: bool = False) -> tuple[float | None, float | None]:
    r"""``(kappa, fallback)``: the relative smoothing to solve with from the start (``None``: the
    plain dual) and the one a stalled plain solve continues with (``None``: keep its best iterate).
    ``shape``: the tall ``(m, n)``; ``exact``: the exact-SVD plain dual was asked for, which smooths
    from the start only where it cannot converge (square DGram)."""
    if smoothing == "auto":
        rows, cols = shape[-2], shape[-1]
        square = rows == cols
        if square and manifold.square_dual == "rank-deficient":
            return AUTO_SMOOTHING, None
        closed_form = square and manifold.square_dual == "closed-form"
        if not exact and rows < SMOOTH_BELOW_ASPECT * cols and not closed_form:
            return AUTO_SMOOTHING, None
        return None, AUTO_SMOOTHING
    if smoothing is None:
        return None, None
    return float(smoothing), None


@dataclass(frozen=True)
class Distribution:
    """How a data-parallel job shares the steps (after DDP's gradient all-reduce every rank holds
    the same gradients).

    Attributes:
        mode: ``"replicated"`` (every rank solves every matrix) or ``"sharded"`` (each matrix on
            one owner rank, the new matrices shared with one ``all_gather`` per dtype).
        process_group: the group to shard over (``None``: the default group).
        strategy: owner assignment (:func:`~manifoldlib.distributed.assign_owners`): ``"size"``
            (balances the solve cost) or ``"round-robin"``.
    """

    mode: str = "replicated"
    process_group: Any = None
    strategy: str = "size"

    def __post_init__(self) -> None:
        if self.mode not in DISTRIBUTION_MODES:
            raise ValueError(f"distribution mode must be one of {', '.join(DISTRIBUTION_MODES)}, got {self.mode!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"distribution strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")

    def __deepcopy__(self, memo: dict) -> Distribution:
        """Itself: it is frozen, and its process group is a handle to share, not to copy."""
        return self

    @classmethod
    def coerce(cls, value: Distribution | str | Mapping | None) -> Distribution:
        """``value`` as :class:`Distribution`: ``None``, a mode name, a mapping of fields or an instance."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(mode=value)
        if isinstance(value, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - fields)
            if unknown:
                raise TypeError(f"unknown distribution option(s) {unknown}; valid: {', '.join(sorted(fields))}")
            return cls(**value)
        raise TypeError(f"distribution must be None, a mode name, a dict or a Distribution, got {type(value).__name__}")


@dataclass(frozen=True)
class MuonOptions:
    """A group's options as one step reads them (built once per group and step from its plain data).

    Attributes:
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: as
            :class:`torch.optim.Muon`'s.
        manifold: the manifold object, carrying its retraction.
        fused: the retraction is the manifold's default Muon retraction (its Gram form applies).
        layout: ``"out_in"`` or ``"in_out"`` (:mod:`~manifoldlib.optim.options`).
        ns_dtype: ``"auto"``, ``"bfloat16"`` or ``"float32"`` (Euclidean groups).
        dual: the dual-solver options.
    """

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    ns_steps: int
    eps: float
    adjust_lr_fn: str | None
    manifold: Any
    fused: bool = True
    layout: str = "out_in"
    ns_dtype: str = "auto"
    dual: DualOptions = field(default_factory=DualOptions)

    @classmethod
    def from_group(cls, group: Mapping) -> MuonOptions:
        """The options of a validated group (:func:`validate_group`), its manifold object built
        once per distinct (manifold, retraction) and cached."""
        name, options = retraction_spec(group)
        return cls(
            lr=float(group["lr"]), weight_decay=group["weight_decay"], momentum=group["momentum"],
            nesterov=group["nesterov"], ns_coefficients=tuple(group["ns_coefficients"]), ns_steps=group["ns_steps"],
            eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"], manifold=group_manifold(group["manifold"], name, options),
            fused=name is None, layout=group.get("layout", "out_in"), ns_dtype=group.get("ns_dtype", "auto"),
            dual=DualOptions.coerce(group["dual"]),
        )

    def bank_key(self) -> tuple:
        """What must agree for two matrices to share a bank (their shape, dtype and device aside)."""
        return (id(self.manifold), self.fused, self.momentum, self.nesterov, self.ns_coefficients, self.ns_steps,
                self.eps, self.ns_dtype, self.dual)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, flat: bool, shape, layout: str = "out_in") -> float:
    """The learning rate after the shape adjustment ``adjust_lr_fn`` (``None``: ``"original"`` on
    Euclidean groups, ``"spectral"`` — no adjustment — otherwise), from the map's ``(out, in)``
    (:func:`~manifoldlib.optim.options.map_shape` of the stored ``shape``)."""
    rows, cols = map_shape(shape, layout)
    fn = adjust_lr_fn if adjust_lr_fn is not None else ("original" if flat else "spectral")
    if fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _finite(name: str, value: Any) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` for a non-number, a bool or inf."""
    tensor = isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point()
    if not (tensor or is_real(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    number = float(value)
    if math.isinf(number):
        raise ValueError(f"{name} must be a finite number, got {number}")
    return number


def _retraction(value: Any) -> tuple[str | None, dict]:
    """A group's ``retraction`` as ``(name or None, options)``: a name, ``None``, or a dict with
    ``"name"`` and the retraction's plain-data options."""
    if value is None or isinstance(value, str):
        return value, {}
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        options = {k: v for k, v in value.items() if k != "name"}
        return value["name"], options
    raise ValueError(f"retraction must be None, a registered name or a dict {{'name': ..., **options}}, "
                     f"got {value!r}")


def validate_group(group: MutableMapping, manifolds: tuple[str, ...], available_retractions) -> None:
    """Raise ``ValueError`` naming the option and the accepted values; store the numbers as Python
    floats and ``group["dual"]`` as a validated dict.

    ``lr`` (a number or a 1-element tensor), ``momentum``, ``weight_decay`` and ``eps`` must be
    finite numbers in their ranges, ``ns_coefficients`` three finite numbers, ``ns_steps`` an int
    and ``nesterov`` a bool (bools are not numbers here). ``manifold`` one of ``manifolds``,
    ``retraction`` one of ``available_retractions(manifold)``.
    """
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
    if not (is_integer(steps) and 0 <= steps < 100):
        raise ValueError(f"ns_steps must be an int in [0, 100), got {steps!r}")
    coeffs = group["ns_coefficients"]
    if not (isinstance(coeffs, (tuple, list)) and len(coeffs) == 3
            and all(is_real(c) and math.isfinite(c) for c in coeffs)):
        raise ValueError(f"ns_coefficients must be three finite numbers (a, b, c), got {coeffs!r}")
    if not isinstance(lr, Tensor):
        group["lr"] = float(lr)
    for key in ("momentum", "weight_decay", "eps"):
        group[key] = float(group[key])
    group["ns_steps"] = int(steps)
    group["ns_coefficients"] = tuple(float(c) for c in coeffs)
    fn = group["adjust_lr_fn"]
    if fn is not None and fn not in ADJUST_LR_FNS:
        raise ValueError(f"adjust_lr_fn must be None or one of {', '.join(ADJUST_LR_FNS)}, got {fn!r}")
    manifold = group["manifold"]
    if manifold not in manifolds:
        raise ValueError(f"unknown manifold {manifold!r}; valid: {', '.join(manifolds)}")
    name, options = _retraction(group["retraction"])
    if name is not None and name not in available_retractions(manifold):
        raise ValueError(f"unknown {manifold} retraction {name!r}; valid: {', '.join(available_retractions(manifold))}")
    if isinstance(group["retraction"], Mapping):
        group["retraction"] = {"name": name, **options}  # the group's own copy, not the caller's dict
    check_layout(group.setdefault("layout", "out_in"))
    ns_dtype = group.setdefault("ns_dtype", "auto")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
    group["dual"] = DualOptions.coerce(group.get("dual")).as_dict()


def retraction_spec(group: Mapping) -> tuple[str | None, tuple]:
    """``(name or None, sorted options)`` of a validated group's retraction (hashable)."""
    name, options = _retraction(group["retraction"])
    return name, tuple(sorted(options.items()))


def validate_group_params(group: MutableMapping) -> None:
    """Raise ``ValueError`` naming the first parameter of ``group`` that ManifoldMuon cannot take:
    neither a whole tensor nor FSDP2's row shards (a tensor-parallel DTensor, FSDP1-flattened), not 2-D, not a real floating-point dtype, on
    the meta device, or a ``geoopt.ManifoldParameter`` whose manifold the group's steps would leave
    (a Stiefel parameter in a Euclidean group: the group's manifold is what ManifoldMuon reads)."""
    names = group.get("param_names") or [None] * len(group["params"])
    for index, (p, name) in enumerate(zip(group["params"], names)):
        label = repr(name) if name is not None else f"#{index} of its group"
        reject_unsupported_parameter(p, name, allow_row_shards=True)
        if p.ndim != 2:
            raise ValueError(f"ManifoldMuon only takes 2-D matrices; parameter {label} of shape "
                             f"{tuple(p.shape)} is in a group with manifold {group['manifold']!r}")
        if not p.is_floating_point():
            raise ValueError(f"ManifoldMuon takes floating-point matrices (float16, bfloat16, float32, "
                             f"float64); parameter {label} has dtype {p.dtype}")
        if p.device.type == "meta":
            raise ValueError(f"parameter {label} of shape {tuple(p.shape)} is on the meta device; "
                             f"materialize it (e.g. module.to_empty(device=...) and initialize it) before "
                             f"building the optimizer")
        carried = getattr(p, "manifold", None)  # a geoopt.ManifoldParameter's
        if carried is not None and not _carries_no_other_manifold(carried, group["manifold"]):
            what = getattr(carried, "name", None) or type(carried).__name__
            raise ValueError(
                f"parameter {label} of shape {tuple(p.shape)} carries the manifold {what!r} (a "
                f"geoopt.ManifoldParameter), but its group steps it on {group['manifold']!r}: ManifoldMuon reads "
                f"the group's manifold option, not the parameter's, and would move it off {what!r} without a "
                f"word; put it in a group with that manifold (manifold='stiefel', 'dgram' or 'oblique'), give it "
                f"to an optimizer that reads the parameter's manifold (geoopt's), or pass a plain tensor")


#: The manifolds a group's points stay on, by the group's manifold: a Stiefel point has unit,
#: mutually orthogonal columns, so it lies on DGram and on Oblique too.
_STAYS_ON = {"euclidean": (), "stiefel": ("stiefel", "dgram", "oblique"), "dgram": ("dgram",), "oblique": ("oblique",)}


def _carries_no_other_manifold(carried: Any, name: str) -> bool:
    """Whether a parameter that carries the manifold ``carried`` (geoopt's convention) stays on it
    when stepped on the group's manifold ``name``: a Euclidean one constrains nothing;
    manifoldlib's Stiefel, DGram and Oblique (their retraction is the group's business) and
    geoopt's Stiefel must contain the group's manifold (a Stiefel group keeps a DGram or Oblique
    parameter on its manifold); any other manifold (a sphere, a product) is not one ManifoldMuon
    keeps."""
    if isinstance(carried, geoopt.Euclidean) or getattr(carried, "name", None) == "euclidean":
        return True
    if isinstance(carried, geoopt.Stiefel):
        return name == "stiefel"
    ours = type(carried).__module__.startswith("manifoldlib.")
    return ours and getattr(carried, "name", None) in _STAYS_ON.get(name, ())


def check_decay(group: Mapping, decays: bool) -> None:
    """Raise ``ValueError`` when decoupled decay would multiply ``W`` by ``1 - lr * weight_decay <= 0``
    on a manifold with a scale freedom (``decays``: DGram), which flips or zeroes it. Checked every
    step before anything moves (a scheduler may raise ``lr``); Euclidean groups take Muon's decay."""
    lr, weight_decay = float(group["lr"]), group["weight_decay"]
    if decays and lr * weight_decay >= 1:
        raise ValueError(
            f"ManifoldMuon: lr * weight_decay must be < 1 on {group['manifold']!r} (the decoupled weight "
            f"decay multiplies W by 1 - lr * weight_decay), got lr={lr!r}, weight_decay={weight_decay!r}; "
            f"no parameter or momentum buffer was changed this step"
        )


#: Default Muon retraction per manifold name, ``(name, options)`` (each manifold class names its own).
def default_retraction(manifold: str) -> tuple[str, dict]:
    """The manifold's ``muon_retraction`` (its Gram-form default; Euclidean: ``("add", {})``)."""
    return getattr(get_manifold(manifold), "muon_retraction", ("add", {}))


@functools.lru_cache(maxsize=64)
def _manifold_for(name: str, retraction: str, options: tuple):
    return get_manifold(name, retraction=retraction, **dict(options))


_ON_REGISTER.append(_manifold_for.cache_clear)  # a name re-registered with override=True


def group_manifold(manifold: str, retraction: str | None, options: tuple = ()):
    """The manifold object of a group: ``retraction`` ``None`` takes the manifold's Muon default."""
    if retraction is None:
        retraction, defaults = default_retraction(manifold)
        options = tuple(sorted({**defaults, **dict(options)}.items()))
    try:
        return _manifold_for(manifold, retraction, options)
    except TypeError:  # an unhashable option value: build it afresh
        return get_manifold(manifold, retraction=retraction, **dict(options))
