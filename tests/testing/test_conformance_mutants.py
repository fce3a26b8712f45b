"""Mutation tests of the conformance suite: a correct Riemannian SGD passes it, and each realistic
defect planted in it (one per flaw) fails it with a message that names the defect. Each flaw
here passed an earlier version of the suite; ``test_conformance_checks.py`` has the flaws the
suite caught from the start."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from manifoldlib import Euclidean, Oblique, Sphere, Stiefel
from manifoldlib.optim.options import flipped
from manifoldlib.testing import OPTIMIZER_CHECKS, check_optimizer


def _check_lr(lr):
    lr = float(lr) if isinstance(lr, torch.Tensor) and lr.dim() == 0 else lr  # a scheduler's tensor lr
    if not (isinstance(lr, float) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")


class MutantSGD(torch.optim.Optimizer):
    """Riemannian SGD with momentum on ``p.manifold``, per-group ``lr``, ``momentum``,
    ``weight_decay`` and ``nesterov``, stepping bfloat16 and float16 parameters in float32 and storing them back in
    their dtype (projected first: a rounded point is not on the manifold to float32's tolerance).
    A parameter with a non-finite gradient is skipped the way Manifold Muon skips it
    (value and momentum kept, ``state["skipped_steps"]`` counts it, and the diagnostic
    ``state["grad_norm"]`` reads NaN for the step not measured). A matrix is stepped in its tall
    orientation, its momentum kept in the stored one, and a group's ``layout`` (``"out_in"`` or
    ``"in_out"``) says which orientation a square one is, as Manifold Muon does. ``flaw`` plants one
    defect."""

    def __init__(self, params, lr=0.1, momentum=0.5, weight_decay=0.0, nesterov=False, flaw=None):
        self.flaw = flaw
        _check_lr(lr)
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "nesterov": nesterov, "layout": "out_in"})

    def add_param_group(self, group):
        _check_lr(group.get("lr", self.defaults["lr"]))
        super().add_param_group(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None and self.flaw == "closure_without_grad":  # under the step's no_grad
            loss = closure()
        elif closure is not None and self.flaw != "ignores_closure":
            with torch.enable_grad():
                loss = closure()
        if self.flaw == "never_moves":  # reads its gradients from somewhere they never are
            return loss
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, p.grad)
                elif self.flaw == "none_grad_as_zero":  # a frozen parameter's momentum keeps moving it
                    self._update(p, group, torch.zeros_like(p))
            stacked = [p for p in group["params"] if p.shape == group["params"][0].shape]
            if self.flaw == "nan_in_a_stack_of_three" and len(stacked) >= 3:  # a batched solve's defect
                stacked[2].fill_(math.nan)
        return loss

    def _update(self, p, group, grad):
        flaw, m, state = self.flaw, p.manifold, self.state[p]
        skipped = state.setdefault("skipped_steps", torch.zeros((), dtype=torch.long))
        if not bool(torch.isfinite(grad).all()) or (flaw == "sticky_skip" and state.get("found_inf")):
            skipped.add_(1)
            state["grad_norm"] = torch.tensor(math.nan, dtype=torch.float64)
            state["found_inf"] = True  # read only by the "sticky_skip" flaw, which never resets it
            return
        # a matrix is stepped in its tall orientation (its transpose where it is wide, or square and
        # stored (in, out)), as Manifold Muon does; a sphere's points are vectors
        layout = "out_in" if flaw == "ignores_layout" else group["layout"]
        flip = p.dim() >= 2 and m.name != "sphere" and flipped(p.shape, layout)
        orient = (lambda t: t.mT) if flip else (lambda t: t)
        low = p.dtype in (torch.bfloat16, torch.float16)  # a rounded point: projected in float32
        x = m.projx(orient(p.detach()).float()) if low else orient(p.detach())
        grad = orient(grad).to(x.dtype)
        state["grad_norm"] = grad.norm().to(torch.float64)
        rgrad = m.egrad2rgrad(x, grad)
        if flaw == "euclidean_norm_step":  # a normalised step, by the Euclidean gradient's norm
            rgrad = rgrad / grad.norm().clamp_min(torch.finfo(grad.dtype).tiny)
        elif flaw in ("euclidean_second_moment", "euclidean_second_moment_from_step_2"):
            # Adam's second moment of the Euclidean gradient (the second flaw: of the Riemannian one on
            # the first step, so that step is right, and of the Euclidean one after)
            state["steps"] = state.get("steps", 0) + 1
            seen = rgrad if flaw.endswith("from_step_2") and state["steps"] == 1 else grad
            moment = state.get("exp_avg_sq", torch.zeros_like(grad)).to(x.dtype) * 0.999 + 0.001 * seen.square()
            state["exp_avg_sq"] = moment
            rgrad = rgrad / ((moment / (1 - 0.999 ** state["steps"])).sqrt() + 1e-8)
        buf = state.get("momentum_buffer")  # kept in the stored orientation
        if buf is not None:  # the flaw reads a wide matrix's buffer back by reshape, not transpose
            buf = buf.reshape(x.shape) if flaw == "momentum_read_by_reshape" else orient(buf)
        if flaw == "lr_twice":  # lr inside the momentum (Caffe's convention) and again in the step
            rgrad = group["lr"] * rgrad
        momentum = (self.param_groups[0] if flaw == "first_group_momentum" else group)["momentum"]
        if flaw == "momentum_of_euclidean_gradient":  # Euclidean gradients, projected only when used
            raw = grad.clone() if buf is None else momentum * buf.to(x.dtype) + grad
            state["momentum_buffer"] = orient(raw)
            buf = m.proju(x, raw)
        else:
            buf = rgrad.clone() if buf is None else m.proju(x, momentum * buf.to(x.dtype) + rgrad)
            state["momentum_buffer"] = orient(buf)
        nesterov = (self.param_groups[0] if flaw == "first_group_nesterov" else group)["nesterov"]
        if nesterov:  # look ahead along the momentum, as torch's SGD(nesterov=True)
            buf = m.proju(x, rgrad + momentum * buf)
        lr = group["lr"]
        if flaw == "nan_once_a_tensor_lr_changes" and isinstance(lr, torch.Tensor):  # NaN from a stale copy
            lr = lr * (math.nan if float(lr) != state.setdefault("first_lr", float(lr)) else 1.0)
        new = m.retr(x, (lr if flaw == "ascent" else -lr) * buf)
        if flaw == "writes_nan_for_a_tensor_lr" and isinstance(lr, torch.Tensor):
            new = new * math.nan
        decay = (self.param_groups[0] if flaw == "first_group_weight_decay" else group)["weight_decay"]
        if decay and m.name == "euclidean":  # no scale freedom elsewhere
            new = new * (1 - group["lr"] * decay)
        new = new.reshape(p.shape) if flaw == "writes_back_by_reshape" else orient(new)
        if flaw == "replaces_storage":
            p.data = new.to(p.dtype)
        elif flaw == "non_contiguous":
            p.data = new.to(p.dtype).mT.contiguous().mT if p.dim() == 2 else new.to(p.dtype)
        elif flaw == "changes_dtype" and p.dtype != torch.float64:
            p.data = new.to(torch.float64)
        elif flaw == "upcasts_low_precision" and p.dtype != x.dtype:
            p.data = new
        elif flaw == "loses_low_precision_update":  # aliases p only where x.dtype is p's dtype
            p.to(x.dtype).copy_(new)
        else:
            p.copy_(new)


MANIFOLDS = {"sphere": Sphere(2.5, retraction="exp"), "stiefel": Stiefel(), "euclidean": Euclidean(ndim=2)}
#: Also Oblique, whose square points constrain columns, not rows (a layout ignored shows there).
ALL_MANIFOLDS = {**MANIFOLDS, "oblique": Oblique()}


def _report(flaw, manifold="stiefel", checks=None, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_optimizer(lambda params: MutantSGD(params, flaw=flaw, **options), ALL_MANIFOLDS[manifold],
                               **({} if checks is None else {"checks": checks}))


@pytest.mark.parametrize("manifold", sorted(MANIFOLDS))
def test_the_correct_optimizer_passes_every_check(manifold):
    report = _report(None, manifold)
    assert report.ok, str(report)


def _failure(report, check):
    failed = {r.name: r.detail for r in report.failures()}
    assert check in failed, str(report)
    return failed[check]


def test_a_nan_diagnostic_for_a_skipped_step_is_not_a_failure():
    """A state entry that is not a buffer (a diagnostic scalar) may read NaN for the step it did not
    measure, as Manifold Muon's residuals do; the suite used to fail that."""
    report = _report(None, checks=("non_finite_gradient",))
    assert report.ok, str(report)
    assert "counted in state['skipped_steps']" in report.results[0].detail


def test_a_skip_that_never_ends_fails_non_finite_gradient():
    """One non-finite gradient, and the parameter is skipped for good (a flag never reset)."""
    detail = _failure(_report("sticky_skip", checks=("non_finite_gradient",)), "non_finite_gradient")
    assert "2 steps with finite gradients after a nan gradient did not move parameter 1" in detail


@pytest.mark.parametrize("flaw, manifold, message", [
    ("replaces_storage", "stiefel", "torch.float64: the step replaced the parameter's storage"),
    ("non_contiguous", "stiefel", "torch.float64: the step changed the parameter's strides from (3, 1) to (1, 5)"),
    ("changes_dtype", "euclidean", "torch.float32: the step changed the parameter's dtype to torch.float64"),
    ("upcasts_low_precision", "sphere", "torch.bfloat16: the step changed the parameter's dtype to torch.float32"),
    ("loses_low_precision_update", "stiefel", "torch.bfloat16: 3 steps did not bring the parameter closer"),
])
def test_a_step_that_is_not_in_place_fails_in_place(flaw, manifold, message):
    """``p.data = new`` (another storage: views, tied weights and captured graphs keep the old
    one), a transposed layout, another dtype, a low-precision weight stored upcast, or one updated
    through a float32 copy that is then dropped."""
    report = _report(flaw, manifold)
    assert message in _failure(report, "in_place")


@pytest.mark.parametrize("manifold", sorted(MANIFOLDS))
def test_a_learning_rate_applied_twice_fails_lr_scaling(manifold):
    """The step is lr**2 times the direction: every other check passes (the halved lr of a
    parameter group still changes the result, and 60 steps at lr**2 still descend)."""
    report = _report("lr_twice", manifold)
    assert [r.name for r in report.failures()] == ["lr_scaling"], str(report)
    assert "divided the distance 3 steps move by 4, not 2" in report.failures()[0].detail


MOMENTUM_IGNORED = ("with momentum=0.25 differs from its run alone with momentum=0.25: it follows the first "
                    "group's momentum=0.5 (the group's momentum is ignored)")
DECAY_IGNORED = ("with weight_decay=0.5 differs from its run alone with weight_decay=0.5: it follows the first "
                 "group's weight_decay=0.0")
NESTEROV_IGNORED = ("with nesterov=True differs from its run alone with nesterov=True: it follows the first "
                    "group's nesterov=False (the group's nesterov is ignored)")


@pytest.mark.parametrize("flaw, manifold, message", [
    *[("first_group_momentum", m, MOMENTUM_IGNORED) for m in sorted(MANIFOLDS)],
    ("first_group_weight_decay", "euclidean", DECAY_IGNORED),
    *[("first_group_nesterov", m, NESTEROV_IGNORED) for m in sorted(MANIFOLDS)],
])
def test_a_group_option_taken_from_the_first_group_fails_param_groups(flaw, manifold, message):
    """Every group gets group 0's momentum, weight decay or nesterov: only ``lr`` is read per
    group. The check used to vary ``lr`` alone, then each numeric option (nesterov, a boolean,
    still passed); it now gives each numeric option of the defaults another value in the second
    group (0 becomes 0.5: weight decay is 0 by default) and flips each boolean, and asks for the
    run alone with that value, bit for bit."""
    report = _report(flaw, manifold)
    assert [r.name for r in report.failures()] == ["param_groups"], str(report)
    assert message in report.failures()[0].detail


def test_param_groups_varies_every_numeric_and_boolean_option():
    """Adam's betas entry by entry, eps, weight_decay and amsgrad; SGD's nesterov; Muon's momentum,
    nesterov, Newton-Schulz coefficients and steps; a correct optimizer follows each (weight decay
    has no effect on Stiefel, nor amsgrad in 3 steps: reported, not a failure). Strings and dicts
    (Muon's manifold, dual) are left."""
    import geoopt

    from manifoldlib.optim import ManifoldMuon

    adam = check_optimizer(lambda ps: geoopt.optim.RiemannianAdam(ps, lr=1e-2), MANIFOLDS["stiefel"],
                           checks=("param_groups",))
    assert adam.ok, str(adam)
    assert "per group: betas[0]=0.45, betas[1]=0.4995, eps=5e-09; without effect here: weight_decay=0.5, " \
           "amsgrad=True" in adam.results[0].detail
    sgd = check_optimizer(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.1, momentum=0.9), MANIFOLDS["stiefel"],
                          checks=("param_groups",))
    assert sgd.ok, str(sgd)
    assert "weight_decay=0.5, nesterov=True" in sgd.results[0].detail
    muon = check_optimizer(lambda ps: ManifoldMuon(ps, lr=0.05, momentum=0.95, manifold="euclidean"),
                           MANIFOLDS["euclidean"], checks=("param_groups",))
    assert muon.ok, str(muon)
    for shown in ("weight_decay=0.05", "momentum=0.475", "nesterov=False", "ns_coefficients[1]=-2.3875", "ns_steps=6"):
        assert shown in muon.results[0].detail


WIDE_OFF = "the wide (3, 5) parameter: after 3 steps, its transpose (the tall orientation) is off the manifold"
WIDE_DIFFERS = "parameter: 3 steps differ from those of its tall ({}) point with layout='in_out', transposed, by"
SQUARE_OFF = ("the square (3, 3) matrix stored transposed with layout='in_out': after 3 steps, its transpose (the "
              "tall orientation) is off the manifold")


@pytest.mark.parametrize("flaw, manifold, message", [
    ("writes_back_by_reshape", "stiefel", WIDE_OFF),
    ("writes_back_by_reshape", "euclidean", "the wide (3, 4) " + WIDE_DIFFERS.format("4, 3")),
    ("momentum_read_by_reshape", "stiefel", "the wide (3, 5) " + WIDE_DIFFERS.format("5, 3")),
    ("ignores_layout", "oblique", SQUARE_OFF),
])
def test_a_wide_matrix_handled_on_the_wrong_side_fails_wide(flaw, manifold, message):
    """A wide weight is stepped in its tall orientation (its transpose): a result written back by
    reshape rather than transpose, or a momentum buffer kept in the stored orientation but read
    back by reshape (from step 2 on), or a square matrix whose ``layout="in_out"`` is ignored (its
    rows constrained instead of its columns, on Oblique) passed the suite, which only ever
    stepped tall matrices stored as they are."""
    report = _report(flaw, manifold)
    assert [r.name for r in report.failures()] == ["wide"], str(report)
    assert message in report.failures()[0].detail


def test_an_optimizer_that_refuses_a_wide_matrix_skips_wide():
    """geoopt's optimizers call the manifold on the stored matrix, which refuses a wide one
    before anything changes: not a failure, and the reason is reported."""
    import geoopt

    report = check_optimizer(lambda ps: geoopt.optim.RiemannianAdam(ps, lr=1e-2), MANIFOLDS["stiefel"],
                             checks=("wide",))
    (result,) = report.results
    assert result.status == "skip", str(report)
    assert "the wide (3, 5) parameter: refused (ValueError: " in result.detail
    assert "store a wide matrix transposed" in result.detail


@pytest.mark.parametrize("manifold", sorted(MANIFOLDS))
def test_a_none_gradient_taken_as_zero_fails_none_gradient(manifold):
    """torch.optim skips a parameter whose grad is None (a frozen layer, a branch unused this
    step): not moved, state untouched. Taken as a zero gradient, its momentum keeps moving it
    (and a parameter that never had a gradient gets a state)."""
    report = _report("none_grad_as_zero", manifold)
    assert [r.name for r in report.failures()] == ["none_gradient"], str(report)
    assert "3 steps moved a parameter whose grad became None after 2 steps by" in report.failures()[0].detail


def test_a_reprojection_of_a_parameter_without_gradient_is_not_a_failure():
    """geoopt's stabilize projects every parameter of a group onto the manifold every few steps,
    those without a gradient too: a few ulps, allowed (the check asks for the value and state to
    rounding)."""
    import geoopt

    report = check_optimizer(lambda ps: geoopt.optim.RiemannianSGD(ps, lr=0.1, momentum=0.9, stabilize=5),
                             MANIFOLDS["stiefel"], checks=("none_gradient",))
    assert report.ok, str(report)


@pytest.mark.parametrize("flaw, message", [
    ("ignores_closure", "step 1: step(closure) did not call the closure"),
    ("closure_without_grad", "step 1: step(closure) called the closure with gradients disabled"),
])
def test_a_step_that_does_not_run_its_closure_properly_fails_closure(flaw, message):
    """torch.optim's step(closure) calls the closure under grad mode and returns its loss; one that
    ignores it (and returns None), or calls it inside its own torch.no_grad(), passed."""
    report = _report(flaw)
    assert [r.name for r in report.failures()] == ["closure"], str(report)
    assert message in report.failures()[0].detail


@pytest.mark.parametrize("flaw", ["euclidean_norm_step", "euclidean_second_moment"])
@pytest.mark.parametrize("manifold", ["sphere", "stiefel"])
def test_a_euclidean_gradient_in_a_riemannian_step_fails_normal_gradient(flaw, manifold):
    """A step normalised by the Euclidean gradient's norm, or Adam's second moment of the
    Euclidean gradient: the first step changes by 0.40 to 0.65 of its length when a normal
    component of norm ||g|| is added to the gradient (correct optimizers: at most 1.3e-13)."""
    report = _report(flaw, manifold)
    assert [r.name for r in report.failures()] == ["normal_gradient"], str(report)
    assert "after step 1" in report.failures()[0].detail
    assert "the step uses the Euclidean gradient, not only its Riemannian part" in report.failures()[0].detail


@pytest.mark.parametrize("flaw", ["momentum_of_euclidean_gradient", "euclidean_second_moment_from_step_2"])
@pytest.mark.parametrize("manifold", ["sphere", "stiefel"])
def test_a_state_that_keeps_the_euclidean_gradient_fails_normal_gradient(flaw, manifold):
    """A momentum of Euclidean gradients projected only when used, or Adam's second moment seeded
    with the Riemannian gradient and then updated with the Euclidean one: the first step is right,
    so the check, which compared the first step only, passed both. Over 3 steps with a normal
    component at every step the point moves by 1.8e-2 to 1.3e-1 of the path after step 2."""
    report = _report(flaw, manifold)
    assert [r.name for r in report.failures()] == ["normal_gradient"], str(report)
    detail = report.failures()[0].detail
    assert "moved the point after step 2 by" in detail
    assert "the optimizer's state (a momentum, a second moment, a warm start) keeps the Euclidean gradient" in detail


@pytest.mark.parametrize("manifold", ["stiefel", "dgram", "oblique"])
def test_manifold_muon_ignores_the_normal_part_only_in_its_first_step(manifold):
    """Its first step ignores a normal component of the gradient's norm (to 1.3e-13 of its length,
    its iterative dual included), but its momentum is one of Euclidean gradients (as
    torch.optim.Muon's): from step 2 on the point moves by 1e-4 to 1e-2 of the path (a known
    failure, a strict xfail in test_conformance.py). Without momentum every step ignores it, the
    dual's warm start included (at most 3e-12 of the path): the correction it carries is kept in
    units of the gradient's tangent part, which a normal part does not change (it did before: 3e-3
    of the path after step 2 on Stiefel, 1.6e-4 on DGram, 5.4e-5 on Oblique)."""
    from manifoldlib import DGram, Oblique
    from manifoldlib.optim import ManifoldMuon

    manifold_of = {"stiefel": Stiefel(), "dgram": DGram(), "oblique": Oblique()}[manifold]
    report = check_optimizer(lambda ps: ManifoldMuon(ps, lr=0.05, manifold=manifold), manifold_of,
                             checks=("normal_gradient",))
    assert "moved the point after step 2 by" in report.failures()[0].detail, str(report)
    for dual in ({}, {"warm_start": False}):
        memoryless = check_optimizer(lambda ps: ManifoldMuon(ps, lr=0.05, momentum=0.0, manifold=manifold, dual=dual),
                                     manifold_of, checks=("normal_gradient",))
        assert memoryless.ok, (dual, str(memoryless))


#: Every check but normal_gradient, which Manifold Muon fails from its second step (its momentum is
#: one of Euclidean gradients: test_manifold_muon_ignores_the_normal_part_only_in_its_first_step).
BUT_NORMAL_GRADIENT = tuple(c for c in OPTIMIZER_CHECKS if c != "normal_gradient")


@pytest.mark.parametrize("manifold, checks", [
    ("euclidean", None),
    ("stiefel", ("descent",)),
    pytest.param("stiefel", BUT_NORMAL_GRADIENT, marks=pytest.mark.slow),  # 4 s
])
def test_manifold_muon_with_its_defaults_passes(manifold, checks):
    """lr=1e-3 (torch.optim.Muon's default): 60 steps cannot halve the distance to the target
    (a path of ~0.1 against a distance of ~0.5), which ``descent`` used to fail."""
    from manifoldlib.optim import ManifoldMuon

    report = check_optimizer(lambda params: ManifoldMuon(params, manifold=manifold), MANIFOLDS[manifold],
                             **({} if checks is None else {"checks": checks}))
    assert report.ok, str(report)


def test_a_small_learning_rate_is_not_a_failure():
    """Steps below bfloat16's resolution leave a bfloat16 weight where it is: not a failure."""
    report = check_optimizer(lambda params: MutantSGD(params, lr=1e-4), MANIFOLDS["sphere"])
    assert report.ok, str(report)
    assert "the float32 run moves less than its resolution" in {r.name: r.detail for r in report.results}["in_place"]


def test_a_descent_too_slow_for_its_path_fails_descent():
    """At a small lr, ascent still fails: the decrease asked for is half the path walked."""
    report = _report("ascent", checks=("descent",), lr=1e-3)
    assert "(a decrease of at least" in _failure(report, "descent")


@pytest.mark.parametrize("flaw, check, message", [
    ("never_moves", "descent", "60 steps did not move the point"),
    ("nan_in_a_stack_of_three", "batched", "three same-shape parameters in one group differ from each alone by nan"),
    ("writes_nan_for_a_tensor_lr", "tensor_lr", "halved in place after 3 steps (as torch's LR schedulers do) ends nan"),
    ("nan_once_a_tensor_lr_changes", "tensor_lr", ("with a tensor lr, a step raised ValueError after the parameter "
                                                   "had moved: stiefel.retr: 'u' holds 15 non-finite value(s)")),
])
def test_a_check_does_not_pass_a_point_that_never_moves_or_turns_nan(flaw, check, message):
    """descent asked for a decrease of half the path walked, 0 for a point that never moves; batched
    took the worst difference with max(), which passes over a NaN (max(0.0, nan) is 0.0); tensor_lr
    failed where the difference was > 1e-12, which a NaN is not, and skipped as 'a tensor lr is
    refused' on a ValueError from any step, the fourth too (the manifold refusing the NaN step
    once lr changed): each passed or was skipped."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_optimizer(lambda params: MutantSGD(params, flaw=flaw), ALL_MANIFOLDS["stiefel"],
                                 checks=(check,))
    assert message in _failure(report, check)
