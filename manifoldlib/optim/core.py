r"""The functional core of Manifold Muon: one step over banks of same-shape matrices.

One step for a matrix :math:`W` with gradient :math:`G` (tall orientation):

.. math::

    B \leftarrow \mu B + (1-\mu) G,\qquad
    U = \begin{cases} (1-\mu) G + \mu B & \text{nesterov} \\ B & \text{otherwise}\end{cases},\qquad
    A = \operatorname*{arg\,max}_{\|A\|_2\le 1,\ A\in T_W} \langle U, A\rangle,\qquad
    W \leftarrow R_{\beta W}(-\eta A),

with :math:`\beta = 1 - \eta_0\lambda` the decoupled weight decay where the manifold has a scale
freedom (DGram, Euclidean) and :math:`\eta` the learning rate after the shape adjustment. On
Euclidean space :math:`A` is Muon's Newton–Schulz direction and the step is
:class:`torch.optim.Muon`'s.

**Banks.** Every matrix of every group whose manifold, retraction, tall shape, dtype, device and
solve options agree joins one bank (a ``(768, 3072)`` and a ``(3072, 768)`` weight share the tall
shape ``(3072, 768)``). A bank is stacked once, solved as one batched problem
(:func:`~manifoldlib.optim.dual_solvers.solve_bank`), retracted as one, and written back with one
``_foreach_copy_``: the number of launches is per bank, not per matrix. Learning rates and decay
factors that differ inside a bank are per-matrix tensors.

**Momentum** is accumulated on the Euclidean gradient, as :class:`torch.optim.Muon` does; the
tangent space enters only through the dual at the current point. Each solve starts from the
closed-form multiplier :math:`\Lambda_0` of the new point plus the correction
:math:`\Lambda - \Lambda_0` the previous step found (``state["dual_correction"]``, in units of the
tangent part of the normalized gradient: :attr:`~manifoldlib.optim.dual_solvers.BankSolution.correction`).

**Non-finite gradients** are found on the device: such a matrix keeps its value and its momentum
buffer that step, and ``state["skipped_steps"]`` counts it (read by
:func:`~manifoldlib.optim.optimizer_diagnostics`); its step records 0 dual iterations and a NaN
dual (and retraction) residual, since no direction was solved; nothing is read back to the host.

**The retraction.** With the manifold's default Muon retraction on a sync-free (products) step,
the new point is :math:`Y\Phi`, :math:`Y = \beta W - \eta A`, with :math:`\Phi` the manifold's
Gram-form factor of :math:`Y^\top Y` (:meth:`~manifoldlib.manifolds.matrix.MatrixConstraintManifold.gram_retraction_factor`)
from fixed chord steps (:func:`~manifoldlib.functional.gram_rsqrt.chord_rsqrt`); a matrix whose
factor does not reach :data:`RETRACTION_TOL` keeps its value and ``state["skipped_steps"]`` counts
it. Everywhere else the manifold's own retraction runs (it checks its own accuracy); a matrix for
which it returns a non-finite value keeps its value, counted the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..distributed import get_rank_world, sharded_apply
from ..functional.gram_rsqrt import chord_rsqrt, products_only_rsqrt
from ..functional.msign import GRAM_EIGH_ONE_PASS
from ..functional.newton_schulz import newton_schulz
from ..functional.scaling import out_of_range_scale
from .dual import NORMAL_GRADIENT_ULPS, Spectral
from .dual_solvers import solve_bank, stiefel_solve
from .execution import Execution, ieee_float32_matmul, run_side_by_side, side_by_side, solve_dtype
from .options import MuonOptions, adjusted_lr, flipped, resolve_smoothing

__all__ = ["RETRACTION_TOL", "Bank", "make_banks", "muon_step", "stiefel_iterations"]

#: Largest residual :math:`\|I - \Phi^\top T\Phi\|_1` of a sync-free retraction factor at which the
#: new point is taken (a larger one means the fixed chord steps diverged: the matrix keeps its
#: value). Below it the point may sit off the manifold by about the residual; the next step's
#: exact :math:`W^\top W` takes that into account.
RETRACTION_TOL = 1e-2
#: A dual solve that ends with a relative tangent residual above this does not pass its
#: correction :math:`\Lambda - \Lambda_0` on to the next step (that one starts from :math:`\Lambda_0`).
WARM_START_RESIDUAL = 0.1
#: Chord steps of the sync-free retraction factor per dtype (each gains about a factor
#: :math:`\rho = \|T/(d_id_j) - I\|_1`, :math:`O(\eta^2)` for a tangent step).
CHORD_STEPS = {torch.float64: 12, torch.float32: 3}
#: A scale-free (DGram) matrix whose largest entry lies outside ``[2^-17, 2^16)`` is solved and
#: retracted at the power-of-two scale that brings it into ``[1/2, 1)``: float32 fourth powers of
#: its column norms then stay in range for column norms spread over about four decades.
SCALE_FREE_EXPONENT = 16
_EPS64 = torch.finfo(torch.float64).eps


@dataclass
class Bank:
    """Same-shape matrices solved together (see the module docstring).

    Attributes:
        options: the options of the first member's group (every member agrees on
            :meth:`MuonOptions.bank_key`).
        params, grads, bufs, states: per member (stored orientation).
        flips: per member, whether its tall orientation is its transpose.
        lrs, decays: per member, the adjusted learning rate :math:`\\eta` and the decay factor :math:`\\beta`.
        indices: per member, its position in the caller's list (for sharded steps).
        updates_given: ``grads`` already are the momentum updates :math:`U` (their momentum was
            accumulated elsewhere, on FSDP2's row shards: :mod:`~manifoldlib.optim.fsdp`); the
            bank has no buffers.
        execution: the device's choices for this bank (:class:`~manifoldlib.optim.execution.Execution`).
        spectral: the dual's spectral map on the execution's path (constrained banks).
        work: the dtype a step computes in (:func:`~manifoldlib.optim.execution.solve_dtype` of the
            members' for a constrained bank, theirs for a Euclidean one).
        eta, beta: ``lrs`` and ``decays`` as the step uses them, set by :meth:`set_step_sizes`: one
            float where the members agree, else a ``(B, 1, 1)`` tensor in ``work``.
        ratios: the members' step sizes relative to the largest, on the device, by
            ``(quantity, indices)`` (shared with the bank's parts, :func:`_subset`): see
            :meth:`set_step_sizes`.
        stiefel_iterations: the iterations of :func:`~manifoldlib.optim.dual_solvers.stiefel_solve`
            where it solves this bank (:func:`stiefel_iterations`), else ``None`` (the general
            :func:`~manifoldlib.optim.dual_solvers.solve_bank`).
    """

    options: MuonOptions
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    bufs: list[Tensor] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    flips: list[bool] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    decays: list[float] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    updates_given: bool = False
    execution: Execution | None = None
    spectral: Spectral | None = None
    work: torch.dtype | None = None
    eta: float | Tensor = 1.0
    beta: float | Tensor = 1.0
    ratios: dict = field(default_factory=dict, repr=False)
    stiefel_iterations: int | None = None

    def stack(self, tensors: Sequence[Tensor], dtype: torch.dtype | None = None) -> Tensor:
        """``(B, m, n)`` the members' tall orientations in ``dtype`` (theirs by default), one copy.

        A bank with transposed members on the CPU is copied member by member into one buffer:
        ``torch.stack`` gathers a transposed operand several times slower than ``copy_``."""
        tall = [t.mT if f else t for t, f in zip(tensors, self.flips)]
        if any(self.flips) and tall[0].device.type == "cpu":
            out = torch.empty((len(tall), *tall[0].shape), dtype=dtype or tall[0].dtype, device=tall[0].device)
            torch._foreach_copy_(list(out.unbind(0)), tall)
            return out
        out = torch.stack(tall)
        return out if dtype is None else out.to(dtype)

    def unstack(self, stacked: Tensor) -> list[Tensor]:
        """Views of ``stacked`` ``(B, m, n)`` in the members' stored orientations."""
        return [t.mT if f else t for t, f in zip(stacked.unbind(0), self.flips)]

    def set_step_sizes(self, sizes: Sequence[tuple[float, float]]) -> None:
        r"""Set the members' ``(eta, beta)`` (:func:`step_sizes`, in member order): the lists
        :attr:`lrs` and :attr:`decays`, and :attr:`eta` and :attr:`beta` as the step uses them
        (once per plan and learning rate, not per step).

        Where the members differ, their values go to the device as ratios :math:`r_j` to the
        largest, :math:`s`, times :math:`s` (:math:`\eta_j = r_js`, :math:`1 - \beta_j = r_js`,
        float64, then ``work``): a schedule that scales every ``lr`` alike changes :math:`s`
        alone, and the ratios uploaded once are reused while they give every value to four units
        of float64 rounding.
        A copy from the host would make a GPU wait for the work queued so far at every step of
        a schedule; where the ratios do change it is asynchronous from pinned memory on CUDA.
        """
        self.lrs, self.decays = [lr for lr, _ in sizes], [decay for _, decay in sizes]
        same = lambda values: all(v == values[0] for v in values)  # noqa: E731
        self.eta = self.lrs[0] if same(self.lrs) else self._per_member("eta", self.lrs, 0.0).to(self.work)
        self.beta = self.decays[0] if same(self.decays) else \
            (1.0 - self._per_member("1 - beta", [1.0 - decay for decay in self.decays], 1.0)).to(self.work)

    def _per_member(self, quantity: str, values: list[float], unit: float) -> Tensor:
        """``(B, 1, 1)`` float64 ``values``, not all equal, on the device (:meth:`set_step_sizes`):
        the ratios known for these members where they give every value to four units of float64
        rounding of ``max(|value|, unit)`` (``unit`` 1 for ``1 - beta``, a difference from 1)."""
        scale = max(values, key=abs)
        ratios = [v / scale for v in values]
        key = (quantity, tuple(self.indices))
        known = self.ratios.get(key)
        if known is None or any(abs(r * scale - v) > 4 * _EPS64 * max(abs(v), unit) for r, v in zip(known[0], values)):
            device = self.params[0].device
            host = torch.tensor(ratios, dtype=torch.float64).view(-1, 1, 1)
            if device.type == "cuda":  # asynchronous from pinned memory: no wait for the queue
                host = host.pin_memory()
            known = self.ratios[key] = (ratios, host.to(device, non_blocking=device.type == "cuda"))
        return known[1] * scale


def make_banks(items: Sequence[tuple[MuonOptions, Tensor, Tensor, Tensor | None, dict]],
               execution_of: Callable[[MuonOptions, torch.device, int], Execution], *,
               updates_given: bool = False) -> list[Bank]:
    """Group ``(options, param, grad, momentum_buffer, state)`` items into banks, in first-seen order;
    ``execution_of(options, device, columns)`` gives each bank its :class:`Execution`
    (``updates_given``: the "grads" are momentum updates and there are no buffers, see :class:`Bank`).

    Raises:
        ValueError: a stored warm start (``state["dual_correction"]``) of the wrong shape, naming
            the matrix (checked here, when a plan is made, before anything moves).
    """
    banks: dict[tuple, Bank] = {}
    sizes: dict[tuple, list[tuple[float, float]]] = {}
    for index, (opts, p, g, buf, state) in enumerate(items):
        flip = flipped(p.shape, opts.layout)
        shape = (p.size(1), p.size(0)) if flip else tuple(p.shape)
        key = (opts.bank_key(), shape, p.dtype, p.device)
        bank = banks.get(key)
        if bank is None:
            execution = execution_of(opts, p.device, min(shape))
            spectral = Spectral.of_group(opts, execution.spectral)
            bank = banks[key] = Bank(opts, updates_given=updates_given, execution=execution, spectral=spectral,
                                     work=p.dtype if opts.manifold.flat else solve_dtype(p.dtype),
                                     stiefel_iterations=stiefel_iterations(opts, execution, spectral, shape))
            sizes[key] = []
        _check_warm_start(opts, p, state)
        sizes[key].append(step_sizes(opts, p.shape))
        bank.params.append(p)
        bank.grads.append(g)
        bank.bufs.append(buf)
        bank.states.append(state)
        bank.flips.append(flip)
        bank.indices.append(index)
    for key, bank in banks.items():
        bank.set_step_sizes(sizes[key])
    return list(banks.values())


def stiefel_iterations(opts: MuonOptions, execution: Execution, spectral: Spectral, shape) -> int | None:
    """The iterations :func:`~manifoldlib.optim.dual_solvers.stiefel_solve` runs on a bank of tall
    ``shape`` ``(m, n)``, or ``None`` where :func:`~manifoldlib.optim.dual_solvers.solve_bank` solves it:
    decided once per plan. It runs where its written-out steps are the general solver's: a sync-free,
    unsmoothed, products-path solve with a Newton–Schulz map on a manifold with ``orthonormal_dual``
    (Stiefel), under ``update="auto"``."""
    manifold, dual = opts.manifold, opts.dual
    if manifold.flat or not (manifold.orthonormal_dual and not manifold.decays and execution.sync_free
                             and spectral.path == "products" and spectral.method != "svd" and dual.update == "auto"):
        return None
    if resolve_smoothing(dual.smoothing, manifold, shape)[0] is not None:  # smoothed from the start
        return None
    return 0 if shape[-2] == shape[-1] else dual.iterations(True)  # square: the closed form


def _check_warm_start(opts: MuonOptions, p: Tensor, state: dict) -> None:
    """Refuse a stored ``dual_correction`` that is not ``(n, n)``, ``n = min(p.shape)``."""
    given = state.get("dual_correction") if opts.dual.warm_start and not opts.manifold.flat else None
    n = min(p.shape)
    if given is not None and tuple(given.shape) != (n, n):
        raise ValueError(f"ManifoldMuon: a {tuple(p.shape)} matrix on {opts.manifold.name} has a stored "
                         f"dual_correction of shape {tuple(given.shape)}, expected {(n, n)} (a state dict of "
                         f"other shapes?); no parameter or momentum buffer was changed")


def step_sizes(opts: MuonOptions, shape) -> tuple[float, float]:
    r"""``(eta, beta)`` of a matrix of the stored ``shape``: the learning rate after the shape
    adjustment and the decoupled decay factor :math:`1 - \eta_0\lambda` (1 where the manifold has
    no scale freedom or :math:`\lambda = 0`)."""
    decays = opts.manifold.decays and opts.weight_decay
    return (adjusted_lr(opts.lr, opts.adjust_lr_fn, opts.manifold.flat, shape, opts.layout),
            1.0 - opts.lr * opts.weight_decay if decays else 1.0)


def _bank_buffer(bank: Bank) -> Tensor:
    """The members' momentum buffers as one ``(B, m, n)`` tensor (tall orientation), kept in the
    optimizer state as views of it (stacked once, the first time the bank meets)."""
    base = bank.bufs[0]._base
    views = bank.unstack(base) if base is not None and base.dim() == 3 and base.size(0) == len(bank.bufs) else None
    if views is not None and all(v.data_ptr() == b.data_ptr() and v.stride() == b.stride()
                                 for v, b in zip(views, bank.bufs)):
        return base
    stacked = bank.stack(bank.bufs)
    for state, view in zip(bank.states, bank.unstack(stacked)):
        state["momentum_buffer"] = view
    bank.bufs = [state["momentum_buffer"] for state in bank.states]
    return stacked


def _check_points(bank: Bank) -> Tensor:
    """Raise ``ValueError`` before any matrix moves where a constrained bank's point is one its
    manifold's dual cannot use (a point never projected, or edited after its group was added),
    naming the matrix: one host read for the bank (two for an early-stopping bank with a scale
    freedom), more only where one fails. Returns the ``(B, m, n)`` points it checked (tall, in the
    bank's work dtype), for the step to reuse."""
    manifold = bank.options.manifold
    stacked = bank.stack([p.detach() for p in bank.params], bank.work)  # (B, m, n)
    # solved at a power-of-two scale where the manifold has a scale freedom (see _constrained)
    scale = out_of_range_scale(stacked, SCALE_FREE_EXPONENT) if manifold.decays else None
    # (an early-stopping bank reads the host anyway: none of its matrices may need the scaling pass)
    in_range = scale is None or (not bank.execution.sync_free and bool((scale == 1).all()))
    points = stacked if in_range else stacked * scale
    try:
        manifold.dual_factor(points, check=True)
        return stacked
    except ValueError:
        pass
    for j, p in enumerate(bank.params):  # name the first matrix that fails
        try:
            manifold.dual_factor(points[j:j + 1], check=True)
        except ValueError as err:
            raise ValueError(f"ManifoldMuon: a {tuple(p.shape)} matrix on {manifold.name}: {err}; no parameter or "
                             f"momentum buffer was changed (ManifoldMuon.project_parameters moves every matrix onto "
                             f"its manifold)") from err
    raise AssertionError("a bank's points failed their check together but passed it one by one")


def _momentum(bank: Bank, work: torch.dtype) -> tuple[Tensor, Tensor]:
    """Update the members' momentum buffers (not where a gradient is non-finite); return the
    ``(B, m, n)`` updates (non-finite where the gradient is) in ``work`` and the ``(B,)`` finite mask."""
    opts = bank.options
    g = bank.stack(bank.grads)
    finite = gradient_finite(g)
    if bank.updates_given:
        return g if g.dtype == work else g.to(work), finite
    buf = _bank_buffer(bank)
    if not opts.manifold.flat and not bank.execution.sync_free and bool(finite.all()):
        buf.lerp_(g, 1 - opts.momentum)  # an early-stopping solve reads the host anyway: in place
    else:
        torch.where(finite.view(-1, 1, 1), buf.lerp(g, 1 - opts.momentum), buf, out=buf)
    update = g.lerp_(buf, opts.momentum) if opts.nesterov else buf
    return update if update.dtype == work else update.to(work), finite


def gradient_finite(g: Tensor) -> Tensor:
    """``(B,)`` whether each of the ``(B, m, n)`` matrices is finite, on the device: its largest
    magnitude is (from its largest and smallest entries, reductions that propagate a NaN; exact, so
    no finite entry overflows them, as a sum could)."""
    return torch.isfinite(torch.maximum(g.amax(dim=(-2, -1)), -g.amin(dim=(-2, -1))))  # maximum keeps a NaN


def _count_skips(bank: Bank, skipped: Tensor) -> None:
    """``state["skipped_steps"]`` ``+=`` the ``(B,)`` mask, on the device."""
    zero = None
    previous = []
    for state in bank.states:
        if "skipped_steps" not in state:
            zero = torch.zeros((), dtype=torch.long, device=skipped.device) if zero is None else zero
        previous.append(state.get("skipped_steps", zero))
    counts = torch.stack(previous) + skipped.long()
    for state, count in zip(bank.states, counts.unbind(0)):
        state["skipped_steps"] = count


def _euclidean(bank: Bank, execution: Execution) -> Tensor:
    """Muon's step on a Euclidean bank: ``(B, m, n)`` new values (tall, the parameters' dtype)."""
    opts = bank.options
    update, finite = _momentum(bank, bank.params[0].dtype)
    direction = newton_schulz(update, opts.ns_coefficients, opts.ns_steps, eps=opts.eps, dtype=execution.ns_dtype)
    w = bank.stack(bank.params)
    decay, lr = bank.beta, bank.eta
    new = w * decay if not (isinstance(decay, float) and decay == 1.0) else w.clone()
    new = new.add_(direction, alpha=-lr) if isinstance(lr, float) else new.sub_(direction * lr)
    _count_skips(bank, ~finite)
    return torch.where(finite.view(-1, 1, 1), new, w)


def _constrained(bank: Bank, execution: Execution, checked: bool = False, w: Tensor | None = None) -> Tensor:
    """A Stiefel / DGram / Oblique bank: ``(B, m, n)`` new values (tall, the parameters' dtype).

    ``w``: the members' points stacked in ``bank.work`` where :func:`_check_points` formed them
    (else they are stacked here).

    ``checked``: this step reads the host for the bank's points anyway (:func:`muon_step`), and
    where the sync-free Gram-form retraction fails for a matrix (its fixed chord steps do not reach
    a point far off the manifold: a square DGram matrix loaded from an unconstrained checkpoint),
    that matrix takes the manifold's own retraction instead of keeping its value; on other steps it
    keeps its value (counted in ``state["skipped_steps"]``)."""
    opts = bank.options
    manifold = opts.manifold
    work = bank.work
    n = min(bank.params[0].shape)
    starts = [s.get("dual_correction") if opts.dual.warm_start else None for s in bank.states]
    update, finite = _momentum(bank, work)
    w = bank.stack(bank.params, work) if w is None else w
    # DGram's scale freedom: uW has the tangent space and steepest direction of W, and its
    # retractions commute with scaling, R_{uW}(uV) = u R_W(V); a matrix whose entries lie far from
    # 1 is solved and retracted as uW, u a power of two (exact), so that its Gram products (fourth
    # powers of the column norms in the alternating factor) stay in range. Multipliers scale as
    # 1/u: the stored correction is in W's units.
    unit = out_of_range_scale(w, SCALE_FREE_EXPONENT) if manifold.decays else None  # (B, 1, 1)
    if unit is not None and not execution.sync_free and bool((unit == 1).all()):
        unit = None  # every matrix in range (read on an early-stopping step): no pass to scale it
    point = w if unit is None else w * unit
    start = None
    if any(s is not None for s in starts):
        zero = torch.zeros(n, n, dtype=work, device=w.device)
        start = torch.stack([zero if s is None else s.to(work) for s in starts])
    with ieee_float32_matmul():
        if bank.stiefel_iterations is not None:
            solution = stiefel_solve(point, update, bank.spectral, start, opts.dual.tol, opts.dual.patience,
                                     bank.stiefel_iterations)
        else:
            solution = solve_bank(point, update, manifold, opts.dual, execution, bank.spectral,
                                  start=start if unit is None or start is None else start / unit,
                                  check_point=False)  # checked before the step where it can be (_check_points)
        eta = bank.eta if unit is None else bank.eta * unit
        beta = bank.beta
        # a gradient with no tangent part above its rounding (e.g. G = WS on Stiefel: a loss of
        # W^T W alone) takes no step rather than a unit step along the rounding noise
        floor = NORMAL_GRADIENT_ULPS * (2 * torch.finfo(bank.params[0].dtype).eps
                                        + n**0.5 * torch.finfo(solution.lam0.dtype).eps)
        moves = solution.tangent > floor  # (B,) ||P_W G|| of the unit gradient; False for a zero G
        eta = eta * moves.view(-1, 1, 1).to(w.dtype)
        ok = finite
        new = None
        if opts.fused and execution.sync_free:  # form Y, its Gram matrix, fixed chord steps
            base = point if isinstance(beta, float) and beta == 1.0 else point * beta
            step = eta * solution.direction().to(w.dtype)
            new, residual = _gram_retraction(manifold, base - step)
            retracted = residual <= RETRACTION_TOL
            if checked and not bool((retracted | ~ok).all()):  # (a host read on a checked step only)
                try:
                    own = manifold.retraction.retract(base, -step)  # (B, m, n)
                except (ValueError, torch.linalg.LinAlgError):  # no point there either: kept, counted
                    own = None
                if own is not None:  # a matrix whose own retraction is not finite keeps its value too
                    redo = ok & ~retracted & torch.isfinite(own).flatten(1).all(1)  # (B,)
                    new = torch.where(redo.view(-1, 1, 1), own, new)
                    residual = torch.where(redo, 0.0, residual)
                    retracted = retracted | redo
            ok = ok & retracted
            residual = torch.where(finite, residual, float("nan"))  # no retraction of a solved direction
            for state, value in zip(bank.states, residual.unbind(0)):
                state["retraction_residual"] = value
        elif opts.fused and solution.best is not None:
            new = _fused_retraction(solution, eta, beta)
        if new is None:  # form the direction and take the manifold's own retraction
            base = point if isinstance(beta, float) and beta == 1.0 else point * beta
            new = manifold.retraction.retract(base, solution.direction().to(w.dtype) * -eta)
            # a retraction with no point there (DGram's for a step that zeroes a column; a user's)
            # may return NaN or inf: that matrix keeps its value, counted (on the device)
            ok = ok & torch.isfinite(new).flatten(1).all(1)
        if unit is not None:
            new = new / unit
    # the next step starts from this correction, unless the solve ended far from tangent (a warm
    # start that led it astray would otherwise be carried on and on)
    kept = ((solution.residual <= WARM_START_RESIDUAL) & moves).view(-1, 1, 1)
    corrections = torch.where(kept, solution.correction, 0.0)
    if unit is not None:
        corrections = corrections * unit.to(corrections.dtype)
    if start is not None:  # a matrix that keeps its value keeps its warm start too
        corrections = torch.where(ok.view(-1, 1, 1), corrections, start.to(corrections.dtype))
    residual = torch.where(moves, solution.residual, 0.0)  # A = 0 is tangent
    # a non-finite gradient gets no direction: no dual iterations, no residual to report (NaN)
    residual = torch.where(finite, residual, float("nan"))
    iterations = torch.where(finite, solution.iterations, 0)
    for state, corr, it, res in zip(bank.states, corrections.unbind(0),
                                    iterations.unbind(0), residual.unbind(0)):
        state["dual_correction"] = corr
        state["dual_iterations"] = it
        state["dual_residual"] = res
    _count_skips(bank, ~ok)
    if not execution.sync_free and bool(ok.all()):  # read on an early-stopping step: nothing to keep
        return new.to(bank.params[0].dtype)
    return torch.where(ok.view(-1, 1, 1), new, w).to(bank.params[0].dtype)


def _gram_retraction(manifold, y: Tensor) -> tuple[Tensor, Tensor | None]:
    r"""``(Y\Phi, residual)``: the manifold's Gram-form retraction of a formed ``y`` ``(B, m, n)``, with
    :math:`\Phi` from fixed chord steps (:func:`~manifoldlib.functional.gram_rsqrt.chord_rsqrt`) and
    nothing read back; ``residual`` ``(B,)`` is their :math:`\|I - \Phi^\top T\Phi\|_1` (0 where the
    factor needs no inverse square root, Oblique's; inf where :math:`\Phi` is not finite, e.g. a
    zero column)."""
    found: list[Tensor] = []

    def rsqrt(t: Tensor) -> Tensor:
        root, residual = chord_rsqrt(t, CHORD_STEPS.get(t.dtype, 3))
        found.append(residual)
        return root

    gram = y.mT @ y
    phi = manifold.gram_retraction_factor(0.5 * (gram + gram.mT), rsqrt)
    residual = found[0] if found else torch.zeros(y.size(0), dtype=y.dtype, device=y.device)
    finite = torch.isfinite(residual) & torch.isfinite(phi.sum(dim=(-2, -1)))  # e.g. a zero column
    return y @ phi, torch.where(finite, residual, torch.full_like(residual, float("inf")))


def _fused_retraction(solution, eta, beta) -> Tensor | None:
    r""":math:`R_{\beta W}(-\eta A)` in the manifold's Gram form from the solved dual's ``n × n`` pieces,
    without forming :math:`A`: two ``m·n²`` products (an early-stopping step; ``None`` where the
    checked product kernels do not resolve the Gram matrix — take the manifold's retraction then).

    :math:`Y^\top Y = \beta^2P - \beta\eta(W^\top A + A^\top W) + \eta^2A^\top A`
    (:meth:`~manifoldlib.optim.dual.DualProblem.pieces`; exact with the point's :math:`P = W^\top W`
    where its constraint residual has drifted), :math:`\Phi` the manifold's factor of it, and
    :math:`Y\Phi = W(\beta\Phi - \eta F^{-1}K'\Phi) - \eta G'(R\Phi)` with :math:`G' = G_\perp`,
    :math:`K' = K` where :math:`G_\perp` was formed, else :math:`G' = G`, :math:`K' = K - BR`.
    """
    problem, ev = solution.problem, solution.best
    wta, ata = solution.pieces if solution.pieces is not None else problem.pieces(ev)
    gram = beta * beta * problem.point_gram() - (beta * eta) * (wta + wta.mT) + (eta * eta) * ata

    def rsqrt(t):
        result = products_only_rsqrt(0.5 * (t + t.mT))
        return result[0] if result is not None and result[1] <= GRAM_EIGH_ONE_PASS else None

    phi = problem.manifold.gram_retraction_factor(0.5 * (gram + gram.mT), rsqrt)
    if phi is None:
        return None
    r = ev.factor()
    k = ev.product() if problem.square or problem.gperp is not None else ev.product() - problem.b @ r
    new = problem.w @ (beta * phi - eta * problem.solve_factor(k @ phi))  # (B, m, n)
    if not problem.square:  # the step's factor -eta R Phi formed n x n, the m n^2 product adds into new
        new = torch.baddbmm(new, problem.gperp if problem.gperp is not None else problem.g, (r @ phi).mul_(-eta))
    # one reduction: a non-finite entry makes the sum non-finite (so would an overflowing sum of
    # finite ones, then the manifold's retraction runs: never a wrong point)
    return new if bool(torch.isfinite(new.sum())) else None


def muon_step(banks: Sequence[Bank], *, owners: Sequence[int] | None = None, process_group=None,
              check_layout: bool = True, check_points: bool = False) -> None:
    """One step of every bank, in place.

    Args:
        banks: from :func:`make_banks`.
        owners: sharded mode: the owner rank of each item (by the banks' ``indices``); a rank solves
            the items it owns and :func:`~manifoldlib.distributed.sharded_apply` shares the new
            values (a collective over ``process_group``). ``None``: every item is solved here.
        check_layout: sharded mode: let :func:`~manifoldlib.distributed.sharded_apply` check that
            every rank passed the same shapes, dtypes and owners (a host read; the optimizer
            checks on the first step of each plan only). The same on every rank.
        check_points: also check the points of sync-free banks (a host read per bank; the
            optimizer checks on the first step of each plan and after a matrix changed in place),
            and let a matrix whose sync-free retraction fails take its manifold's own
            (:func:`_constrained`: a second host read per bank). Early-stopping banks, which read the host anyway, are checked on
            every step.
    """
    points = [_check_points(bank) if not bank.options.manifold.flat and (check_points or not bank.execution.sync_free)
              else None for bank in banks]  # every refusal before anything moves
    if owners is None:
        params = [p for bank in banks for p in bank.params]
        torch._foreach_copy_(params, [v for values in _new_values(banks, check_points, points) for v in values])
        return
    rank = get_rank_world(process_group)[0]
    values: dict[int, Tensor] = {}
    params: dict[int, Tensor] = {}
    parts = []
    for bank in banks:
        mine = [j for j, i in enumerate(bank.indices) if owners[i] == rank]
        for j, i in enumerate(bank.indices):
            params[i] = bank.params[j]
        if not mine:
            _momentum(bank, bank.params[0].dtype)  # every rank keeps every momentum buffer
            continue
        parts.append(_subset(bank, mine))
        if len(mine) < len(bank.params):
            _momentum(_subset(bank, [j for j in range(len(bank.params)) if j not in mine]), bank.params[0].dtype)
    for part, new in zip(parts, _new_values(parts, check_points, [None] * len(parts))):
        values.update(zip(part.indices, new))
    order = sorted(params)
    shared = sharded_apply([params[i] for i in order], lambda k, p: values[order[k]],
                           process_group=process_group, owners=[owners[i] for i in order],
                           check_layout=check_layout)
    torch._foreach_copy_([params[i] for i in order], shared)


def _new_values(banks: Sequence[Bank], checked: bool, points: Sequence[Tensor | None]) -> list[list[Tensor]]:
    """Each bank's members' new values (views, in their stored orientation); ``points``: the banks'
    stacked points where :func:`_check_points` formed them.

    A large constrained bank on the CPU is solved in equal parts side by side
    (:func:`~manifoldlib.optim.execution.side_by_side`); the parts of every bank run in one pool of
    threads, longest first, so that a thread whose part stopped early (fewer dual iterations)
    takes the next part instead of waiting for its neighbour."""
    values: list = [None] * len(banks)
    parts = []  # (cost, bank index, the part's step); a bank's parts in member order
    workers = 1
    for i, (bank, w) in enumerate(zip(banks, points)):
        execution = bank.execution
        if bank.options.manifold.flat:
            values[i] = bank.unstack(_euclidean(bank, execution))
            continue
        count, shape = len(bank.params), bank.params[0].shape
        split = 1 if execution.sync_free else side_by_side(bank.params[0].device, shape, count, path=execution.spectral)
        if split == 1:
            values[i] = bank.unstack(_constrained(bank, execution, checked, w))
            continue
        workers, size = max(workers, split), count // split
        values[i] = []
        for k in range(split):
            sub = _subset(bank, range(k * size, (k + 1) * size))
            part = None if w is None else w[k * size:(k + 1) * size]
            parts.append((size * shape[0] * shape[1] * min(shape), i,
                          lambda sub=sub, part=part: sub.unstack(_constrained(sub, sub.execution, w=part))))
    if parts:
        order = sorted(range(len(parts)), key=lambda j: -parts[j][0])  # longest first
        with ieee_float32_matmul():  # set here: the threads only read the process-wide setting
            done = run_side_by_side([parts[j][2] for j in order], workers)
        new = dict(zip(order, done))
        for j, (_, i, _) in enumerate(parts):  # each bank's parts in member order
            values[i].extend(new[j])
    return values


def _subset(bank: Bank, members: Sequence[int]) -> Bank:
    """The bank of some of ``bank``'s members."""
    pick = lambda values: [values[j] for j in members]  # noqa: E731
    part = Bank(bank.options, pick(bank.params), pick(bank.grads), pick(bank.bufs), pick(bank.states),
                pick(bank.flips), indices=pick(bank.indices), updates_given=bank.updates_given,
                execution=bank.execution, spectral=bank.spectral, work=bank.work, ratios=bank.ratios,
                stiefel_iterations=bank.stiefel_iterations)
    part.set_step_sizes(list(zip(pick(bank.lrs), pick(bank.decays))))
    return part

