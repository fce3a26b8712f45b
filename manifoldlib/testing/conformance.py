r"""A conformance suite for optimizers on manifolds, for your own optimizer's tests.

Give it a *factory* — ``params -> torch.optim.Optimizer``, where ``params`` is what torch
optimizers take: a list of tensors or a list of parameter-group dicts — and a manifold;
:func:`check_optimizer` runs the checks of :data:`OPTIMIZER_CHECKS` on small problems and returns
an :class:`OptimizerReport`; :func:`assert_optimizer` raises ``AssertionError`` listing what
failed.

.. code-block:: python

    import geoopt
    from manifoldlib import Stiefel
    from manifoldlib.testing import assert_optimizer

    assert_optimizer(lambda params: geoopt.optim.RiemannianAdam(params, lr=1e-2), Stiefel())

Parameters are :class:`geoopt.ManifoldParameter` objects carrying the manifold (geoopt's
optimizers read it from there; others see a plain ``nn.Parameter``), of the point shape
``shape`` (default: :func:`~manifoldlib.testing.default_shape` without its batch). Gradients
are those of the quadratic :math:`\tfrac12\|x - t\|^2` for a target :math:`t`, set
directly on ``.grad``. The checks:

``on_manifold``
    100 steps towards a random target, in float64 and float32: every point is finite and on
    the manifold to :math:`10^3\varepsilon` (relative, the dtype's :math:`\varepsilon`), not
    only some (an optimizer that projects back every few steps drifts off in between).
``descent``
    from :math:`x_0 = R_{x^*}(0.3\,\|x^*\|\,\hat v)` towards a target :math:`x^*` on the
    manifold (a minimizer of the quadratic; geodesically convex near it): 60 steps decrease the
    distance :math:`\|x - x^*\|` by at least half the initial distance or half the length of
    the path walked, whichever is less (a small ``lr`` cannot go far in 60 steps, but what it
    walks must mostly be progress); a point that does not move fails.
``normal_gradient``
    3 steps from a fresh state, in float64, with the gradients :math:`g_k` and with
    :math:`g_k + n_k`, each :math:`n_k` normal to the tangent space at the current point
    (``r - proju(x, r)``, of norm :math:`\|g_k\|`; the Riemannian gradient ignores it): after each
    step the two points differ by at most :math:`10^{-6}` of the path walked. A step that reads
    the Euclidean gradient (normalised by its norm, Adam's second moment of it, a momentum seeded
    with it) changes the first step by 0.1 to 0.7; a state that keeps it (a momentum of Euclidean
    gradients projected only when used, as Manifold Muon's, a second moment updated with it after
    a Riemannian first step, a warm start that depends on it) moves the point from the second step
    on, by :math:`10^{-4}` to 0.2 of the path; optimizers whose state holds only Riemannian gradients by
    at most :math:`5 \cdot 10^{-14}` (Manifold Muon without momentum, its dual warm-started,
    :math:`3 \cdot 10^{-12}`: its dual is iterative). Skipped where there is no normal space
    (Euclidean space) or ``egrad2rgrad`` does not ignore the normal part.
``resume``
    5 steps, ``state_dict()`` through ``torch.save`` / ``torch.load(weights_only=True)``, a
    fresh optimizer from the factory on parameters given the saved values (the usual
    checkpoint order: build, then load), 5 more steps: bit-identical to 10 uninterrupted steps.
``param_groups``
    two groups, the second with half the default ``lr``: each parameter follows, bit for bit,
    its own run alone with its group's options, and the halved ``lr`` changes the result. Then
    each other numeric or boolean option of the defaults (``momentum``, ``weight_decay``, each
    entry of ``betas``, ``nesterov``, ``amsgrad``, ...; strings and dicts are left) in turn gets
    another value in the second group (0 becomes 0.5, another int one more, another float half, a
    boolean its negation): 3 steps of each parameter equal, bit for bit, its run alone with its
    group's options, so an optimizer that gives every group the first group's ``momentum`` or
    ``nesterov`` fails. An option without effect in this run (weight decay on a manifold without
    scale freedom, ``nesterov`` without momentum) passes; a value the optimizer refuses with
    ``ValueError`` or ``TypeError`` is left out. The detail lists both.
``lr_scaling``
    3 steps from a fresh state at ``lr / 8`` and at ``lr / 16`` (the default ``lr``): halving
    ``lr`` halves the distance moved (a ratio in ``[1.7, 2.3]``; a step is linear in ``lr`` when
    it is small), so an ``lr`` applied twice (a ratio of 4) or ignored (1) fails.
``maximize``
    where the defaults have a boolean ``maximize`` (torch's SGD and Adam, and what inherits their
    defaults): 3 steps in a group with ``maximize=True`` on the gradients of :math:`-f` end, bit
    for bit, where 3 steps with ``maximize=False`` on those of :math:`f` end (negating a gradient
    is exact and rounding is symmetric in sign, so any implementation of "minimize :math:`-f`"
    agrees). An optimizer that inherits the option and never reads it fails, and the detail says
    so. Skipped without the option, or where a group with ``maximize=True`` is refused with
    ``ValueError`` or ``TypeError``.
``tensor_lr``
    ``lr`` given as a 0-dim float64 tensor and halved in place after 3 steps (``fill_``, what
    torch's LR schedulers do to a tensor ``lr``), then 3 more steps: the point is where a float
    ``lr`` set to ``lr / 2`` after 3 steps takes it (to :math:`10^{-12}` of the path), and that
    change of ``lr`` moved the last 3 steps. An optimizer that caches the step size from the first
    step, renewing it only when the group holds another ``lr`` object (a tensor changed in place
    is the same object), fails. Skipped where a tensor ``lr`` is refused with ``ValueError`` or
    ``TypeError`` before the parameter changed (an error after it moved is a failure).
``global_rng``
    building the optimizer and 3 steps leave torch's global random generator as they found it (an
    optimizer that draws from it — a random probe, sketch or restart — shifts the data order,
    dropout and initialization of the training run around it), and two fresh runs from the same
    point end bit for bit alike.
``gradient_untouched``
    3 steps, each given a fresh ``p.grad``, with the defaults and then with each numeric or
    boolean option varied as ``param_groups`` varies it (``weight_decay``, ``nesterov``,
    ``maximize``, ...): after each step ``p.grad`` is the same tensor with the same values.
    torch's optimizers decay and negate a copy; one that adds the weight decay to ``p.grad`` in
    place hands whatever reads the gradient after the step (a logged norm, a second optimizer of
    a shared parameter) something else. A varied value that cannot run here (torch's
    ``capturable`` off CUDA) is listed as not run.
``add_param_group``
    a parameter added after 3 steps follows its own fresh run bit for bit, and the first one is
    undisturbed.
``none_gradient``
    torch.optim skips a parameter whose ``grad`` is ``None``. Three parameters, two with
    gradients for 2 steps; then the second's ``grad`` is set to ``None`` and 3 steps give the
    first alone a gradient: the second and the third (never a gradient) keep their values and
    state to rounding (``64 eps`` relative: geoopt's ``stabilize`` re-projects every parameter),
    and the first moves. A ``None`` gradient taken as zero (momentum keeps moving a frozen layer;
    a state appears for a parameter never trained) fails.
``closure``
    2 steps ``opt.step(closure)`` on a parameter whose ``grad`` is ``None``, the closure setting
    it with ``backward()``: each step calls the closure, with gradients enabled (a step under
    ``@torch.no_grad()`` calls it inside ``torch.enable_grad()``), and returns the loss the
    closure returned (that object, or its value as a number); the parameter moves.
``non_finite_gradient``
    after 2 steps one of two parameters gets a NaN (then an inf) gradient entry. The optimizer
    either raises ``ValueError`` and changes no parameter and no state, or leaves that
    parameter and its state unchanged and warns (``warnings.warn``), or — skipping on the device,
    without a host read to warn from — leaves that parameter and its buffers (state tensors of
    its shape) unchanged and counts the skip in ``state["skipped_steps"]`` (one more than
    before). No parameter and no buffer (state tensor of a parameter's shape) becomes
    non-finite; another state entry may (a diagnostic reading NaN for the step it did not
    measure, as Manifold Muon's residuals do). Then 2 steps with finite gradients move both
    parameters again and leave every parameter and state entry finite.
``zero_gradient``
    3 steps with zero gradients from a fresh state, in float64 and float32, move nothing beyond
    rounding (``64 eps`` relative, the dtype's) and leave everything finite (an epsilon guard
    such as ``g / (||g|| + 1e-50)`` underflows to ``0 / 0`` in float32 only) (skipped when the defaults have a nonzero
    ``weight_decay``, which moves parameters by design).
``zero_lr``
    a group whose ``lr`` is set to 0 after construction (a warm-up from zero, as ``LambdaLR`` and
    linear warm-up schedules start), in float64 and float32: 3 steps move the point by rounding
    at most (``64 eps`` relative) and leave every state entry finite; with ``lr`` back at its
    default, 3 more steps move it, on the manifold, with a finite state. A step or momentum
    rescaled by the ratio of the new ``lr`` to the last (a momentum correction) divides by zero
    there and fails.
``degenerate_shapes``
    a one-column point (``(m, 1)``, or ``(1,)`` on the sphere), a zero-size point (``(0, n)``,
    ``(0,)``) and a zero-size batch of points ``(0, *shape)``, each where the manifold admits it:
    3 steps give finite points of the same shape on the manifold, or the optimizer refuses the
    parameter with ``ValueError`` before changing it.
``wide``
    a weight stored wide (more columns than rows: ``nn.Linear(3072, 768)`` stores a
    ``(768, 3072)`` matrix). Where the manifold's points are tall (Stiefel, DGram, Oblique) its
    transpose is the point: 3 steps on :math:`X^\top`, :math:`X` a tall point of ``shape`` (two
    more rows if square), with the target and gradients transposed, end where 3 steps on
    :math:`X` end, transposed (to ``1e-12`` relative), and on the manifold in that orientation.
    An optimizer with a ``layout`` option (manifoldlib's convention,
    :data:`manifoldlib.optim.LAYOUTS`: ``"out_in"`` by default, ``"in_out"`` for a map stored
    transposed, as Hugging Face's ``Conv1D`` stores it) is compared with :math:`X` in a group with
    ``layout="in_out"``, the same map (same constraint, same shape factor of ``lr``), on Euclidean
    space too; and a square :math:`S^\top` in a group with ``layout="in_out"`` must follow
    :math:`S` stored as it is (DGram and Oblique constrain the columns of :math:`S`, not its
    rows). A momentum or a write-back that reshapes where it should transpose fails. The wide
    parameter is a ``geoopt.ManifoldParameter`` carrying the manifold; an optimizer may refuse it
    with ``ValueError`` or ``TypeError`` before changing it (geoopt's optimizers call the
    manifold on the stored matrix, which refuses a wide one): skipped, with the reason. Skipped
    too where the points are not matrices, or a wide matrix is itself a point (Euclidean space)
    and the optimizer has no ``layout``.
``batched``
    three same-shape parameters in one group end where each ends alone, to rounding
    (``1e-12`` relative: a batched solve may sum in another order).
``mixed_dtypes``
    one group of float64 and float32 parameters of two shapes: each ends 3 steps where it ends
    alone (``1e-12`` relative), in its own dtype. A batched step that solves a group in one dtype
    (the first parameter's, or float64 throughout) differs by the rounding of the other.
``in_place``
    3 steps on a contiguous parameter in each of float64, float32, bfloat16 and float16 update
    it in place: the parameter groups still hold the same object, of the same dtype, shape and
    strides, on the same storage (``p.data = ...`` fails: views, tied weights and captured
    graphs keep the old one; so does a low-precision weight stored upcast), finite and closer
    to its target (a bfloat16 weight updated through a float32 copy that is dropped fails;
    not asked in bfloat16 or float16 when the float32 run moves no entry by more than 2 eps of
    that dtype relative to the largest entry: such steps may round away). An
    optimizer may refuse a dtype with ``ValueError`` or ``TypeError`` before changing the
    parameter.
``bad_lr``
    a parameter group with ``lr`` NaN, inf or -1, given to the factory or to
    ``add_param_group``, raises ``ValueError`` naming ``lr`` (and is not added).

Everything runs on the CPU with a fixed seed; a check's failure names the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..manifolds.base import RetractionManifold
from .optimizer_checks import CHECKS, CheckFailed, Factory, Setup
from .sampling import default_shape

__all__ = [
    "OPTIMIZER_CHECKS",
    "CheckResult",
    "OptimizerReport",
    "assert_optimizer",
    "check_optimizer",
]

#: The checks :func:`check_optimizer` runs, in order (module docstring).
OPTIMIZER_CHECKS = tuple(CHECKS)


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: ``status`` is ``"pass"``, ``"fail"`` or ``"skip"`` (not applicable)."""

    name: str
    status: str
    detail: str = ""


@dataclass(frozen=True)
class OptimizerReport:
    """What :func:`check_optimizer` found for one optimizer on one manifold."""

    optimizer: str
    manifold: str
    results: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        """No check failed (skipped ones do not count)."""
        return not self.failures()

    def failures(self) -> list[CheckResult]:
        """The failed checks."""
        return [r for r in self.results if r.status == "fail"]

    def __str__(self) -> str:
        lines = [f"{self.optimizer} on {self.manifold}:"]
        lines += [f"  {r.status:4}  {r.name}" + (f": {r.detail}" if r.detail else "") for r in self.results]
        return "\n".join(lines)


def check_optimizer(
    factory: Factory,
    manifold: RetractionManifold,
    *,
    checks: Sequence[str] = OPTIMIZER_CHECKS,
    shape: tuple[int, ...] | None = None,
    seed: int = 0,
    name: str | None = None,
) -> OptimizerReport:
    """Run the conformance checks of ``factory``'s optimizer on ``manifold``.

    Args:
        factory: ``params -> optimizer``; ``params`` is a list of tensors or of parameter-group
            dicts, as torch optimizers take. Put the options under test in it
            (``lambda params: RiemannianSGD(params, lr=0.1, momentum=0.9)``).
        manifold: a manifoldlib manifold; the parameters carry it (``geoopt.ManifoldParameter``).
        checks: names from :data:`OPTIMIZER_CHECKS`, at least one (default: all, in that order).
        shape: the point shape of the parameters (default: :func:`default_shape` without a batch;
            ``()`` is a 0-dim point, a scalar parameter on Euclidean space of ``ndim=0``).
        seed: seed of every random draw, an int.
        name: the optimizer's name in the report (default: its class name).

    Returns:
        An :class:`OptimizerReport`, one :class:`CheckResult` per check. A check passes, fails
        (the detail names what and by how much; an unexpected exception is a failure too) or is
        skipped (not applicable: the detail says why).

    Raises:
        ValueError: an unknown check name, no check at all, or a seed that is not an int
            (one the generators refuse would fail every check instead).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(  # noqa: TRY004 - the project's convention for bad input
            f"seed must be an int, got {seed!r}")
    if isinstance(checks, str) or not checks:  # a report of nothing run would read as a pass
        raise ValueError(f"checks must name at least one check (a sequence of names), got {checks!r}; "
                         f"valid checks: {', '.join(OPTIMIZER_CHECKS)}")
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; valid checks: {', '.join(OPTIMIZER_CHECKS)}")
    s = Setup(factory, manifold, tuple(default_shape(manifold, batch=None) if shape is None else shape), seed)
    results = []
    for check in checks:
        try:
            detail = CHECKS[check](s)
            status = "skip" if detail.startswith("skip: ") else "pass"
            results.append(CheckResult(check, status, detail.removeprefix("skip: ")))
        except CheckFailed as failure:
            results.append(CheckResult(check, "fail", str(failure)))
        except Exception as err:  # noqa: BLE001 - the optimizer (or manifold) raised where it should not
            results.append(CheckResult(check, "fail", f"raised {type(err).__name__}: {err}"))
    if name is None:
        try:
            name = type(s.factory(s.parameters(s.point(0)))).__name__
        except Exception:  # noqa: BLE001 - a factory that refuses the shape: its failures are reported
            name = getattr(factory, "__name__", "optimizer")
    return OptimizerReport(name, repr(manifold).strip(), tuple(results))


def assert_optimizer(factory: Factory, manifold: RetractionManifold, **options) -> OptimizerReport:
    """:func:`check_optimizer`, raising ``AssertionError`` with the report when a check fails.

    Returns:
        The report (every check passed or was skipped).
    """
    report = check_optimizer(factory, manifold, **options)
    if not report.ok:
        raise AssertionError(str(report))
    return report
