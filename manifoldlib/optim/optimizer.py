r"""The optimizer :class:`ManifoldMuon`, on the template of :class:`torch.optim.Muon`.

``__init__`` takes Muon's nine options plus ``manifold``, ``retraction``, the dual-solver options
(:class:`~manifoldlib.optim.DualOptions`) and the ``distribution`` of a data-parallel job
(:class:`~manifoldlib.optim.Distribution`), validated once. The first ``step()`` resolves every
group (:class:`~manifoldlib.optim.options.MuonOptions`), gathers the matrices of all groups into
banks and keeps them (a step plan); later steps reuse it while the groups, their matrices with a
gradient, their states and every setting but ``lr`` stay the same (a setting edited in place, a
matrix that loses its gradient, a loaded state dict or a parameter of another dtype build a new
one), so a step reads only the gradients, the momentum buffers and ``lr``, and runs the
functional core (:mod:`~manifoldlib.optim.core`).

Distributed training (DDP): after DDP's gradient all-reduce every rank holds the same gradients.
``distribution="replicated"`` (default) lets every rank solve every matrix; ``"sharded"`` solves
each matrix on one owner rank (:func:`~manifoldlib.distributed.assign_owners`, balanced by solve
cost) and shares the new matrices with one ``all_gather`` per dtype. The momentum buffers stay
replicated; the dual's warm-start state of a matrix lives on its owner until
:meth:`ManifoldMuon.consolidate_state_dict` shares it for a checkpoint. Both modes give every rank
the parameters of a single process running the same steps.

FSDP2 (``fully_shard``): parameters that are DTensors placed ``Shard(0)`` on a one-dimensional mesh
are stepped by :func:`~manifoldlib.optim.fsdp.fsdp_step`: each matrix's rows are gathered on one
rank, solved there, and sent back; momentum and warm starts stay on the row shards. ``distribution``
then does not apply to them (every step is a collective over their mesh).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping, MutableMapping
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from ..distributed import assign_owners, get_rank_world, is_row_sharded, sharded_apply
from ..functional.newton_schulz import MUON_COEFFICIENTS
from ..retractions.base import available_retractions
from .core import make_banks, muon_step, step_sizes
from .execution import Execution, ieee_float32_matmul, step_threads
from .fsdp import fsdp_step, project_row_sharded
from .options import (
    Distribution,
    DualOptions,
    MuonOptions,
    check_decay,
    tall,
    validate_group,
    validate_group_params,
)

__all__ = ["MUON_MANIFOLDS", "ManifoldMuon", "check_state_dict", "manifold_muon"]

#: Manifold names a ManifoldMuon group may use.
MUON_MANIFOLDS = ("euclidean", "stiefel", "dgram", "oblique")
#: Group keys of earlier versions, refused with the way to say the same thing now.
REMOVED_GROUP_KEYS = {
    "retraction_options": "retraction={'name': ..., **options}",
    "workers": "removed: same-shape matrices are solved as one batched problem",
    "batch": "removed: every step solves banks of same-shape matrices",
    "project_init": "removed: parameters are always projected when a group is added",
    "distributed": "distribution='sharded' (an optimizer argument)",
    "shard_strategy": "distribution={'strategy': ...}",
    "process_group": "distribution={'process_group': ...}",
}
#: Options of torch's optimizers that change what a step computes and that ManifoldMuon does not
#: have, refused in a group (``False`` is accepted for the flags): kept as extra keys, a group's
#: ``maximize=True`` descended while the user asked to ascend.
FOREIGN_GROUP_KEYS = {
    "maximize": "ManifoldMuon minimizes: negate the loss to maximize it",
    "differentiable": "ManifoldMuon's step is not differentiable (it runs under torch.no_grad)",
    "amsgrad": "an Adam option: build an AdamW group for these parameters (build_optimizer does)",
    "betas": "an Adam option: ManifoldMuon's momentum is 'momentum'",
}
#: Per-matrix state that only the owner keeps in sharded mode (the momentum buffer is every rank's).
OWNER_STATE_KEYS = ("dual_correction", "dual_iterations", "dual_residual", "skipped_steps", "retraction_residual")


class ManifoldMuon(Optimizer):
    r"""Muon on Stiefel, DGram, Oblique or Euclidean space, per parameter group.

    Args:
        params: parameters or parameter groups (2-D floating-point matrices).
        lr: learning rate :math:`\eta` (default ``1e-3``, as torch.optim.Muon).
        weight_decay: decoupled weight decay :math:`\lambda` (default ``0.1``; skipped on Stiefel
            and Oblique, which have no scale freedom).
        momentum: momentum factor :math:`\mu \in [0, 1)` (default ``0.95``).
        nesterov: Nesterov momentum (default ``True``).
        ns_coefficients: Newton–Schulz ``(a, b, c)`` (default Muon's quintic).
        eps: floor of the Newton–Schulz normalization (default ``1e-7``).
        ns_steps: Newton–Schulz steps (default 5).
        adjust_lr_fn: ``None``, ``"original"``, ``"match_rms_adamw"`` or ``"spectral"`` (``None``:
            ``"original"`` on Euclidean groups, as torch; ``"spectral"`` — no shape factor, the
            step has spectral norm :math:`\eta` for every shape — on the others).
        manifold: ``"euclidean"`` (default), ``"stiefel"``, ``"dgram"`` or ``"oblique"``.
        retraction: ``None`` (the manifold's Gram-form default: polar on Stiefel, alternating on
            DGram, normalization on Oblique), a registered retraction name, or a dict
            ``{"name": ..., **options}`` (e.g. ``{"name": "polar", "method": "svd"}``).
        dual: the dual-solver options (:class:`~manifoldlib.optim.DualOptions` or a dict of its
            fields); a group may give its own ``"dual"`` dict (merged over these).
        distribution: ``"replicated"`` (default), ``"sharded"``, or a
            :class:`~manifoldlib.optim.Distribution` / dict (``mode``, ``process_group``,
            ``strategy``). Outside a distributed job both modes are the single-process step.

    Group options are plain data, so ``state_dict()`` round-trips through
    ``torch.load(weights_only=True)``. Besides the arguments above a group may set ``"layout"``
    (``"out_in"``, ``torch.nn.Linear``'s, or ``"in_out"``, a Hugging Face ``Conv1D``'s:
    :mod:`~manifoldlib.optim.options`) and ``"ns_dtype"`` (``"auto"``: bfloat16 where bfloat16
    products are native, float32 elsewhere; ``"bfloat16"``: always, as :class:`torch.optim.Muon`;
    ``"float32"``). Wide matrices are handled in their tall orientation: a ``(256, 1024)`` weight on
    Stiefel has orthonormal *rows*. Every parameter is projected onto its group's manifold when the
    group is added.

    A matrix whose gradient has a NaN or inf keeps its value and momentum that step and
    ``state["skipped_steps"]`` counts it (:func:`~manifoldlib.optim.optimizer_diagnostics`
    reports it); checking on the host would stall a GPU every step. Parameters are whole tensors
    or FSDP2's row shards (``fully_shard``: DTensors placed ``Shard(0)`` on a one-dimensional mesh,
    :mod:`~manifoldlib.optim.fsdp`); other DTensor placements (tensor parallel) and FSDP1-flattened
    parameters raise :class:`~manifoldlib.distributed.UnsupportedParameterError`.

    Example:
        >>> opt = ManifoldMuon([{"params": [w], "manifold": "stiefel"}], lr=0.02,
        ...                    dual={"tol": 1e-4})  # doctest: +SKIP
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        manifold: str = "euclidean",
        retraction: str | dict | None = None,
        dual: DualOptions | dict | None = None,
        distribution: Distribution | str | dict | None = None,
    ) -> None:
        self.distribution = Distribution.coerce(distribution)
        self._owner_cache: tuple | None = None
        self._step_plan: _StepPlan | None = None
        self._executions: dict[tuple, Execution] = {}  # facts of the device: kept from step to step
        defaults = {
            "lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients) if isinstance(ns_coefficients, (tuple, list)) else ns_coefficients,
            "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn, "manifold": manifold,
            "retraction": retraction, "dual": DualOptions.coerce(dual).as_dict(), "layout": "out_in",
            "ns_dtype": "auto",
        }
        validate_group(defaults, MUON_MANIFOLDS, available_retractions)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its own ``"dual"`` fields merged over the defaults, its options and
        parameters checked, its parameters projected onto its manifold.

        Raises:
            ValueError: naming the bad option or parameter; the group is then not added.
        """
        _refuse_misspelt_keys(param_group, self.defaults)
        self._step_plan = None
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            own = group["dual"]
            if isinstance(own, Mapping) and own is not self.defaults["dual"]:
                group["dual"] = {**self.defaults["dual"], **own}
            validate_group(group, MUON_MANIFOLDS, available_retractions)
            options = MuonOptions.from_group(group)  # fails early on bad retraction options
            check_decay(group, options.manifold.decays and not options.manifold.flat)
            validate_group_params(group)
            self._project_group(group, options)
        except Exception:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def project_parameters(self) -> None:
        """Move every parameter onto its group's manifold (what adding a group does).

        Call it after changing the weights outside the optimizer (loading other weights into the
        model, a manual edit): a step assumes its points are on their manifolds. A matrix its
        manifold's dual cannot use (e.g. Stiefel columns far from unit norm) is refused, naming it,
        before anything moves: on every early-stopping step, and on the sync-free path on the first
        step after the optimizer was made, a group added or a state dict loaded (it reads nothing
        back later), and again on the first step after a matrix was changed in place (torch's
        version counter of the tensor: ``model.load_state_dict``, an edit under ``torch.no_grad``; two
        host reads per bank on that step only, which also let a matrix the sync-free retraction
        cannot bring back, e.g. a square DGram matrix far off its manifold, take the manifold's own
        retraction); FSDP2's row-sharded matrices likewise, through their DTensor's version (every
        DTensor operation, which every rank runs). A matrix edited in place through ``.data``
        (``p.data.copy_(...)``; not ``p.data = ...``, whose new storage is seen), or one rank's
        ``to_local()`` rows, is not checked: one far off its manifold fails the retraction's check
        every step and keeps its value (``state["skipped_steps"]`` counts it), one close to it is
        moved onto it by the retraction.

        Raises:
            ValueError: naming a parameter that has no nearest point (all zeros; DGram without
                full column rank).
        """
        for group in self.param_groups:
            self._project_group(group, MuonOptions.from_group(group))

    @torch.no_grad()
    def _project_group(self, group: MutableMapping, options: MuonOptions) -> None:
        """Move the group's parameters onto its manifold (no-op on Euclidean groups and empty matrices)."""
        manifold = options.manifold
        if manifold.flat:
            return
        names = group.get("param_names") or [None] * len(group["params"])
        for index, (p, name) in enumerate(zip(group["params"], names)):
            if p.numel() == 0:
                continue
            label = repr(name) if name is not None else f"#{index} of its group"

            def project(whole: Tensor, label: str = label) -> Tensor:
                if not bool(whole.detach().ne(0).any()):
                    raise ValueError(
                        f"parameter {label} of shape {tuple(whole.shape)} is all zeros and cannot be projected "
                        f"onto {group['manifold']}: initialize it with nonzero values (e.g. "
                        f"torch.nn.init.orthogonal_) or assign it to 'euclidean' / AdamW")
                w = tall(whole, group["layout"])
                work = w.to(torch.float64) if w.dtype in (torch.float16, torch.bfloat16) else w
                try:
                    with ieee_float32_matmul():
                        w.copy_(manifold.projx(work))
                except (ValueError, RuntimeError) as err:  # no nearest point, or none float64 determines
                    raise type(err)(f"parameter {label} of shape {tuple(whole.shape)}: {err}") from err
                return whole

            if is_row_sharded(p):  # every rank projects the gathered matrix and keeps its rows
                project_row_sharded(p, project)
            else:
                project(p)

    def _plan(self) -> _StepPlan:
        """This step's :class:`_StepPlan`: the last one while every group, its matrices with a
        gradient, their states and every setting but ``lr`` are what it was built from (compared by
        value, so a setting edited in place counts), with its step sizes brought up to this step's
        ``lr``; else a new one. Its banks get this step's gradients and momentum buffers."""
        state = self.state
        key = tuple((id(group), tuple((id(p), id(state[p]), p.grad.is_sparse, p.shape, p.dtype, p.device)
                                      for p in group["params"] if p.grad is not None))
                    for group in self.param_groups)
        plan = self._step_plan
        settings = [{k: v for k, v in group.items() if k not in _PER_STEP_KEYS} for group in self.param_groups]
        # equal by value (a tensor-valued setting never is: its comparison would read the device)
        if (plan is None or plan.key != key or any(isinstance(v, Tensor) for group in settings for v in group.values())
                or plan.settings != settings):
            plan = self._step_plan = self._build_plan(key, settings)
        lrs = [float(group["lr"]) for group in self.param_groups]  # a tensor lr is read here, once per step
        if lrs != plan.lrs:
            for group, options, lr, (_, matrices) in zip(self.param_groups, plan.options, lrs, key):
                if matrices:  # before anything moves: a scheduler may raise lr
                    check_decay(group, options.manifold.decays and not options.manifold.flat)
            plan.options = [dataclasses.replace(options, lr=lr) for options, lr in zip(plan.options, lrs)]
            for bank, groups in zip(plan.banks, plan.groups):
                bank.set_step_sizes([step_sizes(plan.options[g], p.shape) for g, p in zip(groups, bank.params)])
            plan.lrs = lrs
        for bank in plan.banks:
            bank.grads = [p.grad for p in bank.params]
            bank.bufs = [s["momentum_buffer"] for s in bank.states]
        return plan

    def _build_plan(self, key: tuple, settings: list[dict]) -> _StepPlan:
        """A new :class:`_StepPlan` (each group resolved once, every parameter checked before
        anything moves; its step sizes are set by :meth:`_plan`)."""
        self._step_plan = None  # a failure below leaves no plan half built
        options, whole, groups, meshes = [], [], [], {}
        for position, group in enumerate(self.param_groups):
            opts = MuonOptions.from_group(group)
            options.append(opts)
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:  # nothing to step
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("ManifoldMuon does not support sparse gradients")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                if is_row_sharded(p):
                    meshes.setdefault(p.device_mesh, []).append((position, p, state))
                else:
                    whole.append((opts, p, p.grad, state["momentum_buffer"], state))
                    groups.append(position)
        owners = None
        if whole and self._sharded():
            by_id = self.owners()
            owners = [by_id[id(item[1])] for item in whole]
        banks = make_banks(whole, self._execution_of)
        shapes = [tuple(item[1].shape) for item in whole] + [tuple(p.shape) for m in meshes.values() for _, p, _ in m]
        device = whole[0][1].device if whole else next(iter(meshes.values()))[0][1].device if meshes else None
        watched = [[p for bank in banks if bank.execution.sync_free and not bank.options.manifold.flat
                    for p in bank.params]]
        watched += [[p for g, p, _ in sharded if not options[g].manifold.flat] for sharded in meshes.values()]
        return _StepPlan(key, copy.deepcopy(settings), [None] * len(options), options, banks,
                         [[groups[i] for i in bank.indices] for bank in banks], owners, list(meshes.values()),
                         Execution.threads(device, shapes) if device is not None else None, watched=watched)

    def _execution_of(self, opts: MuonOptions, device: torch.device, columns: int) -> Execution:
        """The :class:`~manifoldlib.optim.execution.Execution` of a bank (facts of the device: kept
        from step to step)."""
        key = (device, opts.dual.spectral, opts.ns_dtype, opts.dual.sync_free, columns)
        known = self._executions.get(key)
        if known is None:
            known = self._executions[key] = Execution.resolve(device, spectral=opts.dual.spectral,
                                                              ns_dtype=opts.ns_dtype, sync_free=opts.dual.sync_free,
                                                              columns=columns)
        return known

    def __getstate__(self) -> dict[str, Any]:
        """:class:`torch.optim.Optimizer`'s state plus the ``distribution`` (``copy.deepcopy`` and
        ``pickle`` keep it; the caches are rebuilt)."""
        return {**super().__getstate__(), "distribution": self.distribution}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__({"distribution": Distribution(), **state})
        self._owner_cache = None
        self._step_plan = None
        self._executions = {}

    def owners(self) -> dict[int, int]:
        """``id(param) -> owner rank`` in sharded mode over every whole parameter (from the shapes
        alone: the same on every rank, cached so each matrix keeps its owner and its owner-only
        state; FSDP2's row-sharded parameters are owned per step by :mod:`~manifoldlib.optim.fsdp`)."""
        params = [p for group in self.param_groups for p in group["params"] if not is_row_sharded(p)]
        key = tuple(id(p) for p in params)
        _, world = get_rank_world(self.distribution.process_group)
        if self._owner_cache is None or self._owner_cache[:2] != (key, world):
            ranks = assign_owners([tuple(p.shape) for p in params], world, self.distribution.strategy)
            self._owner_cache = (key, world, dict(zip(key, ranks)))
        return self._owner_cache[2]

    def _sharded(self) -> bool:
        return self.distribution.mode == "sharded" and get_rank_world(self.distribution.process_group)[1] > 1

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the loss (optional).

        The matrices of all groups are banked by manifold, shape, dtype and device (kept from step
        to step, see the module docstring) and each bank is solved as one batched problem. In
        sharded mode this is a collective: every rank of the group must call it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._plan()
        first = not plan.checked
        # a matrix changed in place since the last step (a model.load_state_dict, an edit under
        # no_grad) has a new version: its points are checked again (host reads on this step only)
        versions = [[(p._version, p.data_ptr()) for p in watched] for watched in plan.watched]
        edited = [False] * len(versions) if first else [now != then for now, then in zip(versions, plan.versions)]
        with step_threads(plan.threads):
            if plan.banks:
                muon_step(plan.banks, owners=plan.owners, process_group=self.distribution.process_group,
                          check_layout=first, check_points=first or edited[0])
            for sharded, changed in zip(plan.meshes, edited[1:]):
                items = [(plan.options[g], p, p.grad, state["momentum_buffer"], state) for g, p, state in sharded]
                fsdp_step(items, self._execution_of, strategy=self.distribution.strategy,
                          check_points=first or changed)
        plan.checked = True
        plan.versions = [[(p._version, p.data_ptr()) for p in watched] for watched in plan.watched]
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`torch.optim.Optimizer.load_state_dict` after :func:`check_state_dict`, keeping
        each ``"dual_correction"`` in its saved dtype."""
        check_state_dict(self, state_dict)
        self._step_plan = None
        super().load_state_dict(state_dict)
        restore_dual_corrections(self, state_dict)

    @torch.no_grad()
    def consolidate_state_dict(self) -> None:
        """Give every rank the owner-only state of every matrix (sharded mode; a collective).

        Every rank of the group must call it; then any rank may call :meth:`state_dict` and get the
        complete state. A no-op in replicated mode and outside a distributed job.
        """
        if self._sharded():
            _share_owner_state(self)


#: Group entries a step reads afresh every time (the rest decides whether its plan is rebuilt).
_PER_STEP_KEYS = frozenset({"params", "param_names", "lr"})


@dataclasses.dataclass
class _StepPlan:
    """What :meth:`ManifoldMuon.step` is made of, kept from step to step (:meth:`ManifoldMuon._plan`).

    Attributes:
        key: per group, its id and ``(id(param), id(state), sparse)`` of each matrix with a gradient.
        settings: per group, the settings other than ``lr`` the plan was built from (a copy).
        lrs: per group, the ``lr`` the banks' step sizes were computed at (``None``: not yet).
        options: per group, its :class:`~manifoldlib.optim.options.MuonOptions` at that ``lr``.
        banks: the banks of the whole (not row-sharded) matrices (:func:`~manifoldlib.optim.core.make_banks`).
        groups: per bank, each member's group position.
        owners: sharded mode: the owner rank of each whole matrix (by the banks' ``indices``).
        meshes: FSDP2's row-sharded matrices per device mesh, ``(group position, param, state)``.
        threads: intra-op threads of the step (:meth:`~manifoldlib.optim.execution.Execution.threads`).
        checked: the plan's first step ran its one-time checks (host reads, not repeated while the
            plan lasts): every sync-free bank's points are usable by its manifold's dual (a weight
            edited after its group was added is refused, as early-stopping banks refuse it on every
            step), and in sharded mode the ranks agree on the banks' shapes, dtypes and owners.
        watched: the matrices whose points a step does not check: those of the constrained
            sync-free banks, then per device mesh its constrained row-sharded matrices.
        versions: their ``(version, data_ptr)`` after the last step, torch's counter of in-place
            changes of a tensor and its storage (host attributes, no device read): where they
            differ at the next step, a matrix was changed in place in between and the points of
            its banks (or of its mesh) are checked again on that step. A row-sharded matrix is
            watched through its :class:`~torch.distributed.tensor.DTensor`, whose version moves
            with every DTensor operation (``copy_``, ``load_state_dict``, ``set_model_state_dict``),
            which every rank runs, so the ranks agree on whether the mesh's step checks (a
            collective). An in-place edit through ``.data`` (``p.data.copy_``; ``p.data = ...``
            has a new storage), or of one rank's ``to_local()`` rows, changes neither.
    """

    key: tuple
    settings: list[dict]
    lrs: list
    options: list[MuonOptions]
    banks: list
    groups: list[list[int]]
    owners: list[int] | None
    meshes: list[list[tuple[int, Tensor, dict]]]
    threads: int | None
    checked: bool = False
    watched: list[list[Tensor]] = dataclasses.field(default_factory=list)
    versions: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)


def _refuse_misspelt_keys(group: Mapping, defaults: Mapping) -> None:
    """Raise ``TypeError`` for a group key that looks meant for the optimizer but is not one of its
    options: a removed spelling (:data:`REMOVED_GROUP_KEYS`), another torch optimizer's option that
    would change the step (:data:`FOREIGN_GROUP_KEYS`), a dual option outside ``"dual"``, or a
    near miss of an option name. Other extra keys (a scheduler's ``initial_lr``, a user's labels)
    are kept, as torch's optimizers keep them."""
    known = set(defaults) | {"params", "param_names", "kind", "initial_lr"}
    dual_fields = {f.name for f in dataclasses.fields(DualOptions)}
    for key in group:
        if key in known:
            continue
        if key in REMOVED_GROUP_KEYS:
            raise TypeError(f"ManifoldMuon parameter group: {key!r} no longer exists ({REMOVED_GROUP_KEYS[key]})")
        if key in FOREIGN_GROUP_KEYS and group[key] is not False:
            raise TypeError(f"ManifoldMuon parameter group: {key}={group[key]!r} is not an option of "
                            f"ManifoldMuon ({FOREIGN_GROUP_KEYS[key]})")
        if key in dual_fields:
            raise TypeError(f"ManifoldMuon parameter group: {key!r} is a dual option; give it as "
                            f"'dual': {{{key!r}: ...}}")
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        if close:
            raise TypeError(f"ManifoldMuon parameter group: unknown key {key!r}; did you mean {close[0]!r}?")


def check_state_dict(optimizer: Optimizer, state_dict: Mapping) -> None:
    """Refuse a state dict that does not belong to ``optimizer``'s Manifold Muon groups.

    Checked per group (groups with a ``"manifold"`` are Manifold Muon's): the saved group must be
    one too, with the same manifold, retraction and layout; each saved momentum buffer must have
    its parameter's shape and dtype, each dual correction its ``(n, n)`` shape.

    Raises:
        ValueError: naming the group, the parameter and what differs.
    """
    saved_groups = state_dict.get("param_groups", [])
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise ValueError(f"the state dict has {len(saved_groups)} parameter groups, the optimizer {len(groups)}")
    state = state_dict.get("state", {})
    for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
        if "manifold" not in group:
            continue
        if "manifold" not in saved:
            raise ValueError(f"group {gi}: the saved group has no 'manifold': a state dict of another optimizer "
                             f"(keys {sorted(k for k in saved if k != 'params')})")
        for key in ("manifold", "retraction", "layout"):
            mine, theirs = group.get(key), saved.get(key, "out_in" if key == "layout" else None)
            if mine != theirs:
                raise ValueError(f"group {gi}: the state dict was saved with {key}={theirs!r}, this optimizer has "
                                 f"{key}={mine!r}; load it into an optimizer built with the same {key}")
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"group {gi}: the state dict has {len(saved['params'])} parameters, the group "
                             f"{len(group['params'])}")
        names = group.get("param_names") or [None] * len(group["params"])
        for j, (p, saved_id, name) in enumerate(zip(group["params"], saved["params"], names)):
            entry = state.get(saved_id, {})
            label = f"group {gi}, parameter {name!r}" if name is not None else f"group {gi}, parameter {j}"
            buf = entry.get("momentum_buffer")
            if isinstance(buf, Tensor):
                if tuple(buf.shape) != tuple(p.shape):
                    raise ValueError(f"{label}: the saved momentum buffer has shape {tuple(buf.shape)}, the parameter "
                                     f"{tuple(p.shape)}: a state dict of another model")
                if buf.dtype != p.dtype:
                    raise ValueError(f"{label}: the saved momentum buffer is {buf.dtype}, the parameter {p.dtype}: "
                                     f"cast the model to the dtype it was saved in before loading")
            corr = entry.get("dual_correction")
            if isinstance(corr, Tensor) and p.dim() == 2 and tuple(corr.shape) != (min(p.shape),) * 2:
                raise ValueError(f"{label}: the saved dual correction has shape {tuple(corr.shape)}, expected "
                                 f"{(min(p.shape),) * 2}")


def restore_dual_corrections(optimizer: Optimizer, state_dict: Mapping) -> None:
    """After ``load_state_dict``: each ``"dual_correction"`` and each integer entry (the counts
    ``"skipped_steps"``, ``"dual_iterations"``) as saved, not cast to the parameter's dtype as torch
    casts every tensor of a floating parameter's state (float32 for a 16-bit matrix's correction; a
    count in bfloat16 is exact only up to 256 and stops counting at 256 or beyond)."""
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for saved_id, p in zip(saved_ids, params):
        if p not in optimizer.state:
            continue
        for key, value in state_dict["state"].get(saved_id, {}).items():
            if isinstance(value, Tensor) and (key == "dual_correction" or not value.is_floating_point()):
                optimizer.state[p][key] = value.to(device=p.device, copy=True)


@torch.no_grad()
def _share_owner_state(optimizer: ManifoldMuon) -> None:
    """Copy every matrix's owner-only state (:data:`OWNER_STATE_KEYS`) to every rank (a collective).

    Each owner packs its entries into one float64 vector per matrix (presence flags, the scalars,
    the correction), :func:`~manifoldlib.distributed.sharded_apply` shares them, and every rank
    unpacks them in the dtypes the step writes (the correction and residuals in the solve's dtype).
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if not is_row_sharded(p)]
    owners = optimizer.owners()
    ranks = [owners[id(p)] for p in params]
    scalars = OWNER_STATE_KEYS[1:]  # after the correction

    def template(p: Tensor) -> Tensor:  # [present per key..., value per scalar..., correction (k*k)]
        k = min(p.shape)
        return torch.zeros(len(OWNER_STATE_KEYS) + len(scalars) + k * k, dtype=torch.float64, device=p.device)

    def owned(i: int, out: Tensor) -> Tensor:
        state = optimizer.state.get(params[i], {})
        out = out.clone()
        for j, key in enumerate(OWNER_STATE_KEYS):
            out[j] = float(state.get(key) is not None)
        for j, key in enumerate(scalars):
            if state.get(key) is not None:
                out[len(OWNER_STATE_KEYS) + j] = float(state[key])
        corr = state.get("dual_correction")
        if corr is not None:
            out[len(OWNER_STATE_KEYS) + len(scalars):] = corr.flatten().to(torch.float64)
        return out

    shared = sharded_apply([template(p) for p in params], owned, process_group=optimizer.distribution.process_group,
                           owners=ranks)
    for p, values in zip(params, shared):
        present = [bool(v) for v in values[:len(OWNER_STATE_KEYS)].tolist()]
        if not any(present):
            continue
        state = optimizer.state[p]
        work = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        dtypes = {"dual_iterations": torch.long, "skipped_steps": torch.long}
        for j, key in enumerate(scalars):
            if present[j + 1]:
                state[key] = values[len(OWNER_STATE_KEYS) + j].to(dtypes.get(key, work)).clone()
        if present[0]:
            k = min(p.shape)
            state["dual_correction"] = values[len(OWNER_STATE_KEYS) + len(scalars):].view(k, k).to(work).clone()


def manifold_muon(params: list[Tensor], grads: list[Tensor], momentum_bufs: list[Tensor], states: list[dict],
                  options: Mapping | MuonOptions) -> None:
    r"""One Manifold Muon step of some matrices of one group, in place: what :meth:`ManifoldMuon.step` runs.

    Args:
        params, grads, momentum_bufs, states: per matrix, the parameter, its gradient, its momentum
            buffer (updated in place) and its optimizer state (the dual's warm start and what the
            solve did are written there).
        options: the group's options: a :class:`~manifoldlib.optim.options.MuonOptions` or a dict
            of group options (the keys of :class:`ManifoldMuon`'s arguments; missing ones take its
            defaults).

    The points must be on their manifolds (``ManifoldMuon.project_parameters`` moves them there).
    An early-stopping step refuses one its manifold's dual cannot use, naming it; a sync-free step
    checks nothing, so that it compiles as one graph (:class:`ManifoldMuon` checks its points on
    the first step of each plan and on the first after a matrix changed in place).
    """
    for state, buf in zip(states, momentum_bufs):
        state["momentum_buffer"] = buf
    if not isinstance(options, MuonOptions):
        group = {**ManifoldMuon([torch.empty(1, 1)]).defaults, **dict(options), "params": []}
        validate_group(group, MUON_MANIFOLDS, available_retractions)
        options = MuonOptions.from_group(group)
    items = [(options, p, g, b, s) for p, g, b, s in zip(params, grads, momentum_bufs, states) if p.numel()]
    if not items:
        return
    device = items[0][1].device

    def execution_of(opts: MuonOptions, device: torch.device, columns: int) -> Execution:
        return Execution.resolve(device, spectral=opts.dual.spectral, ns_dtype=opts.ns_dtype,
                                 sync_free=opts.dual.sync_free, columns=columns)

    with step_threads(Execution.threads(device, [tuple(p.shape) for p in params])):
        muon_step(make_banks(items, execution_of))
    # a step keeps a bank's buffers as views of one tensor in the states: the caller's buffers
    # get the new values too
    moved = [(b, s["momentum_buffer"]) for b, s in zip(momentum_bufs, states) if s.get("momentum_buffer") is not b]
    if moved:
        torch._foreach_copy_([b for b, _ in moved], [v for _, v in moved])

