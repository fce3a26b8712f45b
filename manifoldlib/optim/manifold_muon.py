r"""The optimizer :class:`ManifoldMuon`, on the template of :class:`torch.optim.Muon`.

``__init__`` takes Muon's options plus ``manifold``, ``retraction`` (and its options) and one
plain-data structure of dual-solver options (:class:`~manifoldlib.optim.dual_options.DualOptions`),
validated once; ``step()`` gathers each group and calls the functional core
:func:`~manifoldlib.optim.muon_step.manifold_muon`, the only implementation of the step (its
module docstring has the algorithm).

Distributed training (DDP): after DDP's gradient all-reduce every rank holds the same gradients.
``distributed="replicated"`` (default) lets every rank solve every matrix; ``"sharded"`` solves
each matrix on one owner rank (:func:`~manifoldlib.distributed.assign_owners`) and shares the new
matrices with one ``all_gather`` per dtype (:func:`~manifoldlib.distributed.sharded_apply`). The
momentum buffers stay replicated; the warm-start state of a matrix (``"dual_correction"``,
``"dual_iterations"``, ``"dual_residual"``) lives only on its owner until
:meth:`ManifoldMuon.consolidate_state_dict` shares it for a checkpoint. Both modes give every
rank the parameters of a single process running the same steps, bit for bit.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from ..distributed import STRATEGIES, assign_owners, get_rank_world
from .concurrent_solves import resolve_workers
from .dual_options import DualOptions, reject_replaced_kwargs
from .execution import ExecutionPolicy
from .layouts import tall
from .matmul_precision import ieee_float32_matmul
from .muon_groups import (
    DEFAULT_RETRACTIONS,  # noqa: F401  (re-exported: its public home before the split)
    MUON_MANIFOLDS,  # noqa: F401
    check_decay,
    check_finite_gradients,
    group_dual,
    group_manifold,
    validate_group_options,
    validate_group_params,
)
from .muon_step import ADJUST_LR_FNS, manifold_muon
from .owner_state import restore_dual_corrections, share_owner_state

__all__ = [
    "ADJUST_LR_FNS",
    "DISTRIBUTED_MODES",
    "DualOptions",
    "ManifoldMuon",
    "manifold_muon",
]

# Defaults follow torch.optim.Muon (Keller Jordan's constants).
EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5
DEFAULT_LR = 1e-3
DEFAULT_WEIGHT_DECAY = 0.1
DEFAULT_MOMENTUM = 0.95

#: ``distributed`` modes: every rank solves every matrix, or each matrix on its owner rank.
DISTRIBUTED_MODES = ("replicated", "sharded")
#: Per-matrix state that only the owner keeps in sharded mode.
OWNER_STATE_KEYS = ("dual_correction", "dual_iterations", "dual_residual")


class ManifoldMuon(Optimizer):
    r"""Muon on Stiefel, DGram, Oblique or Euclidean space, per parameter group.

    Args:
        params: parameters or parameter groups (2-D matrices only).
        lr: learning rate :math:`\eta` (default ``1e-3``, as torch.optim.Muon).
        weight_decay: decoupled weight decay :math:`\lambda` (default ``0.1``; skipped on Stiefel and Oblique).
        momentum: momentum factor :math:`\mu \in [0, 1)` (default ``0.95``).
        nesterov: Nesterov momentum (default ``True``).
        ns_coefficients: Newton–Schulz ``(a, b, c)`` (default Muon's quintic).
        eps: added to the Newton–Schulz normalizing norm (default ``1e-7``).
        ns_steps: Newton–Schulz steps (default 5).
        adjust_lr_fn: ``None``, ``"original"``, ``"match_rms_adamw"`` or ``"spectral"`` (see the
            module docstring; ``None`` is ``"original"`` on Euclidean groups, ``"spectral"`` else).
        manifold: ``"euclidean"`` (default), ``"stiefel"``, ``"dgram"`` or ``"oblique"``.
        retraction: a registered retraction name of that manifold; ``None`` picks
            :data:`~manifoldlib.optim.muon_groups.DEFAULT_RETRACTIONS` (Stiefel: polar; DGram: alternating; both take their polar
            factor from the ``n × n`` Gram matrix — products only for a small step, else its
            eigendecomposition, which checks its own error and falls back to a float64 SVD;
            Oblique: column normalization).
        retraction_options: plain-data options of the retraction (e.g. ``{"method": "svd"}``).
        layout: how the matrices are stored, ``"out_in"`` (default: ``torch.nn.Linear``'s
            ``(out, in)``) or ``"in_out"`` (Hugging Face ``Conv1D``): the constraint and the
            shape adjustment apply to the map's matrix (:mod:`~manifoldlib.optim.layouts`; it
            matters for square DGram and Oblique matrices and for ``adjust_lr_fn``).
        dual: the dual-solver options, one plain-data structure
            (:class:`~manifoldlib.optim.dual_options.DualOptions` or a dict of its fields:
            ``msign_method``, ``tol``, ``max_iter``, ``warm_start``, ``smoothing``, ``update``,
            ``spectral``), validated here; a group may give its own ``"dual"`` dict (merged over
            these). ``None``: the defaults (the group's own Newton–Schulz in the dual, ``tol=1e-3``,
            ``max_iter=30``, warm starts, ``smoothing="auto"``, ``update="auto"``, ``spectral="auto"``).
            The former keywords ``msign_method``, ``dual_tol``, ``dual_max_iter``, ``warm_start``,
            ``dual_smoothing``, ``dual_update`` and ``dual_spectral`` raise ``TypeError`` naming
            the field that replaced them.
        ns_dtype: the dtype of the Euclidean groups' Newton–Schulz: ``"auto"`` (default:
            bfloat16 where bfloat16 products are native, float32 elsewhere:
            :func:`~manifoldlib.optim.execution.native_bfloat16`), ``"bfloat16"``
            (always, as :class:`torch.optim.Muon`: with it the Euclidean steps equal
            ``torch.optim.Muon``'s to 1e-6 on any device), or ``"float32"``. On a CPU without
            AVX512-BF16 or AMX bfloat16 products are emulated, 40–80 times slower than float32
            at 768 columns. Stiefel and DGram solves do not use it (they run in the parameter's
            dtype, float32 for 16-bit parameters).
        project_init: project every parameter onto its group's manifold now (default ``True``),
            and the parameters of every group added later with :meth:`add_param_group`.
        distributed: ``"replicated"`` (default; every rank solves every matrix, nothing to set
            up beyond DDP) or ``"sharded"`` (each matrix solved by one owner rank, the results
            shared with one ``all_gather`` per dtype every step; call
            :meth:`consolidate_state_dict` on every rank before rank 0 saves
            :meth:`state_dict`). Outside a distributed job both are the single-process step.
        process_group: the group to shard over (``None``: the default group).
        shard_strategy: owner assignment of :func:`~manifoldlib.distributed.assign_owners`,
            ``"size"`` (default, balances the solve cost) or ``"round-robin"``.
        workers: how many Stiefel/DGram matrices to solve at once on CPU threads
            (:mod:`~manifoldlib.optim.concurrent_solves`): ``"auto"`` (default: as many as
            ``torch.get_num_threads()`` when there are that many, they are not small (about
            128 wide and up) and their estimated costs split evenly, else one at a time), or an
            int ``>= 1`` (1: one at a time, the calling thread's settings). With ``k > 1`` each runs with
            ``torch.get_num_threads() // k`` intra-op threads, so its result is that of a
            one-at-a-time step at that thread count; Euclidean groups and non-CPU matrices
            always run one at a time in the calling thread (``benchmarks/bench_concurrent_solves.py``).
        batch: solve each group's same-shape Stiefel/DGram/Oblique matrices as one batched dual
            (:mod:`~manifoldlib.optim.batched_step`): ``"auto"`` (default: on the products path,
            the CUDA default, and not on the eigh path), ``True`` (needs ``dual={"spectral":
            "products"}`` or a CUDA device) or ``False``. The results equal the per-matrix solves'
            to rounding.

    Group options are plain data (names, numbers, dicts), so ``state_dict()`` round-trips through
    ``torch.load(weights_only=True)``. Wide matrices are handled in their tall orientation: a
    ``(256, 1024)`` ``nn.Linear`` weight on Stiefel has orthonormal *rows*.

    Parameters must be whole tensors: DTensor (FSDP2, tensor parallel) and FSDP1-flattened
    parameters raise :class:`~manifoldlib.distributed.UnsupportedParameterError` here, since a
    manifold step on a shard would be silently wrong. ``distributed``, ``process_group``,
    ``shard_strategy``, ``workers``, ``batch`` and ``project_init`` are attributes of the optimizer, not
    group options.

    Example:
        >>> opt = ManifoldMuon([{"params": [w], "manifold": "stiefel"}], lr=0.02,
        ...                    dual={"tol": 1e-4})  # doctest: +SKIP
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = DEFAULT_LR,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        momentum: float = DEFAULT_MOMENTUM,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        manifold: str = "euclidean",
        retraction: str | None = None,
        retraction_options: dict | None = None,
        layout: str = "out_in",
        dual: DualOptions | dict | None = None,
        ns_dtype: str = "auto",
        project_init: bool = True,
        distributed: str = "replicated",
        process_group=None,
        shard_strategy: str = "size",
        workers: int | str = "auto",
        batch: bool | str = "auto",
        **replaced: Any,
    ) -> None:
        reject_replaced_kwargs(replaced, "ManifoldMuon")
        if replaced:
            raise TypeError(f"ManifoldMuon got unexpected keyword argument(s) {sorted(replaced)}")
        resolve_workers(workers, [])  # raises on a bad value
        ExecutionPolicy.resolve("cpu", spectral="products", batch=batch)  # raises on a bad value
        if distributed not in DISTRIBUTED_MODES:
            raise ValueError(
                f"distributed must be one of {', '.join(DISTRIBUTED_MODES)}, got {distributed!r}"
            )
        if shard_strategy not in STRATEGIES:
            raise ValueError(
                f"shard_strategy must be one of {', '.join(STRATEGIES)}, got {shard_strategy!r}"
            )
        self.distributed = distributed
        self.process_group = process_group
        self.shard_strategy = shard_strategy
        self.workers = workers
        self.batch = batch
        self._owner_cache: tuple[tuple[int, ...], int, dict[int, int]] | None = None
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "manifold": manifold,
            "retraction": retraction,
            "retraction_options": {} if retraction_options is None else retraction_options,
            "layout": layout,
            "dual": DualOptions.coerce(dual).as_dict(),
            "ns_dtype": ns_dtype,
        }
        validate_group_options(defaults)
        self.project_init = False  # the constructor's groups are projected together, below
        super().__init__(params, defaults)  # validates each group (add_param_group)
        self.project_init = bool(project_init)
        if project_init:
            self.project_parameters()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, validated as the constructor's are (the constructor calls this).

        The group's own ``"dual"`` fields are merged over the defaults; its options, retraction and
        parameters (2-D, real, whole tensors) are checked, and when the optimizer was built with
        ``project_init=True`` its parameters are projected onto its manifold.

        Raises:
            ValueError: naming the bad option or parameter; the group is then not added.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            own = group["dual"]
            if isinstance(own, dict) and own is not self.defaults["dual"]:  # its own fields, over the defaults
                group["dual"] = {**self.defaults["dual"], **own}
            validate_group_options(group)
            group_manifold(group)  # fails early on bad retraction options
            check_decay(group)
            validate_group_params(group)
            if self.project_init:
                self._project_group(group)
        except Exception:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def project_parameters(self) -> None:
        """Move every parameter onto its group's manifold (no-op on Euclidean groups).

        Raises:
            ValueError: naming the parameter, for an all-zero matrix (a zero-initialized layer:
                every Stiefel point is equally near, and DGram has none) and for a DGram matrix
                without full column rank.
        """
        for group in self.param_groups:
            self._project_group(group)

    @torch.no_grad()
    def _project_group(self, group: MutableMapping) -> None:
        """:meth:`project_parameters` for one group."""
        manifold = group_manifold(group)
        if not manifold.flat:
            names = group.get("param_names") or [None] * len(group["params"])
            for index, (p, name) in enumerate(zip(group["params"], names)):
                label = repr(name) if name is not None else f"#{index} of its group"
                if not bool(p.detach().ne(0).any()):
                    raise ValueError(
                        f"parameter {label} of shape {tuple(p.shape)} is all zeros and cannot be "
                        f"projected onto {group['manifold']}: initialize it with nonzero values (e.g. "
                        f"torch.nn.init.orthogonal_) or assign it to 'euclidean' / AdamW"
                    )
                w = tall(p, group.get("layout", "out_in"))
                work = w.to(torch.float64) if w.dtype in (torch.float16, torch.bfloat16) else w
                try:
                    with ieee_float32_matmul():
                        w.copy_(manifold.projx(work))
                except ValueError as err:
                    raise ValueError(f"parameter {label} of shape {tuple(p.shape)}: {err}") from err

    def _init_group(
        self,
        group: MutableMapping,
        params_with_grad: list[Tensor],
        grads: list[Tensor],
        momentum_bufs: list[Tensor],
        states: list[dict],
    ) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("ManifoldMuon does not support sparse gradients")
            params_with_grad.append(p)
            grads.append(p.grad)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            momentum_bufs.append(state["momentum_buffer"])
            states.append(state)

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def owners(self) -> dict[int, int]:
        """``id(param) -> owner rank`` in sharded mode, over every parameter of every group.

        Computed from the shapes alone (the same on every rank) and cached, so each matrix
        keeps its owner, and its owner-only warm-start state, from step to step.
        """
        params = self._all_params()
        key = tuple(id(p) for p in params)
        _, world_size = get_rank_world(self.process_group)
        if self._owner_cache is None or self._owner_cache[:2] != (key, world_size):
            ranks = assign_owners([tuple(p.shape) for p in params], world_size, self.shard_strategy)
            self._owner_cache = (key, world_size, dict(zip(key, ranks)))
        return self._owner_cache[2]

    def _resolved_workers(self, items: list[tuple[Any, Tensor]]) -> int:
        """Solves to run at once this step (:func:`~manifoldlib.optim.concurrent_solves.resolve_workers`).

        Decided from every Stiefel/DGram matrix of the step, not only this rank's, so all ranks
        (and a single process) solve each matrix with the same intra-op thread count. CPU only:
        with a matrix on another device every solve runs in the calling thread.
        """
        solved = [p for manifold, p in items if not manifold.flat]
        if any(p.device.type != "cpu" for p in solved):
            return 1
        return resolve_workers(self.workers, [tuple(p.shape) for p in solved])

    def _sharded(self) -> bool:
        return self.distributed == "sharded" and get_rank_world(self.process_group)[1] > 1

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the loss (optional).

        Gathers each group (:meth:`_init_group`), checks every gradient before any buffer moves,
        resolves each group's :class:`~manifoldlib.optim.execution.ExecutionPolicy` once (the
        solve concurrency from every constrained matrix of the step), and calls
        :func:`~manifoldlib.optim.muon_step.manifold_muon` per group. In sharded mode
        this is a collective: every rank of the group must call it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        gathered = []
        for group in self.param_groups:
            params, grads, bufs, states = [], [], [], []
            self._init_group(group, params, grads, bufs, states)
            if params:
                check_finite_gradients(group, params, grads)  # before any buffer moves
                check_decay(group)
                gathered.append((group, params, grads, bufs, states))
        workers = self._resolved_workers([(group_manifold(g), p) for g, ps, _, _, _ in gathered for p in ps])
        owners = self.owners() if self._sharded() else None
        for group, params, grads, bufs, states in gathered:
            dual = group_dual(group)
            execution = ExecutionPolicy.resolve(
                params[0].device, ns_dtype=group.get("ns_dtype", "auto"), spectral=dual.spectral, workers=workers,
                batch=False if group_manifold(group).flat else self.batch,
            )
            manifold_muon(
                params,
                grads,
                bufs,
                states,
                lr=group["lr"], weight_decay=group["weight_decay"],
                momentum=group["momentum"], nesterov=group["nesterov"],
                ns_coefficients=tuple(group["ns_coefficients"]),
                ns_steps=group["ns_steps"], eps=group["eps"],
                adjust_lr_fn=group["adjust_lr_fn"],
                manifold=group_manifold(group),
                dual=dual,
                fuse_retraction=group["retraction"] is None and not group.get("retraction_options"),
                execution=execution,
                layout=group.get("layout", "out_in"),  # absent from groups saved before it existed
                owners=None if owners is None else [owners[id(p)] for p in params],
                process_group=self.process_group,
            )
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`torch.optim.Optimizer.load_state_dict`, keeping each ``"dual_correction"`` in its
        saved dtype (:func:`~manifoldlib.optim.owner_state.restore_dual_corrections`)."""
        super().load_state_dict(state_dict)
        restore_dual_corrections(self, state_dict)

    @torch.no_grad()
    def consolidate_state_dict(self) -> None:
        """Give every rank the owner-only state of every matrix (sharded mode; a collective).

        Every rank of the group must call it, then any rank (usually rank 0) may call
        :meth:`state_dict` and get the complete state, as one process would. A no-op in
        replicated mode and outside a distributed job. Non-owners keep the copies they
        receive; only the owner's copy is updated by later steps, and a later
        :meth:`load_state_dict` on every rank restores every matrix's state everywhere.
        """
        if self._sharded():
            share_owner_state(self)
