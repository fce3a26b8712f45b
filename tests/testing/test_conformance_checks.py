"""The conformance suite itself: a correct toy Riemannian SGD passes every check, and each flaw
planted in it fails the check written for it (a flaw may break later checks as well: a point
off the manifold is refused by the manifold's own checks)."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

from manifoldlib import Euclidean, Sphere, Stiefel
from manifoldlib.testing import (
    OPTIMIZER_CHECKS,
    CheckResult,
    OptimizerReport,
    assert_optimizer,
    check_optimizer,
)

FLAWS = ("euclidean_step", "ascent", "unsaved_state", "ignores_group_lr", "forgets_added_groups",
         "propagates_nan", "skips_nan_silently", "moves_on_zero", "loses_a_dimension", "joint_norm",
         "accepts_bad_lr", "projects_every_tenth_step", "zero_guard_underflows_in_float32", "ignores_maximize",
         "caches_lr_by_object", "keeps_first_lr", "draws_from_global_rng",
         "decays_gradient_in_place", "rescales_momentum_by_lr_ratio", "solves_in_the_first_dtype")


class ToySGD(torch.optim.Optimizer):
    """Riemannian SGD with momentum on ``p.manifold``; ``flaw`` plants one bug."""

    def __init__(self, params, lr=0.1, flaw=None):
        self.flaw = flaw
        self._hidden = {}  # where the "unsaved_state" flaw keeps its buffers
        self._check_lr(lr)
        super().__init__(params, {"lr": lr, "momentum": 0.5, "maximize": False})

    def _check_lr(self, lr):
        lr = float(lr) if isinstance(lr, torch.Tensor) and lr.dim() == 0 else lr  # a scheduler's tensor lr
        if self.flaw != "accepts_bad_lr" and not (isinstance(lr, float) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")

    def add_param_group(self, group):
        self._check_lr(group.get("lr", self.defaults["lr"]))
        if self.flaw == "forgets_added_groups" and hasattr(self, "state") and self.param_groups:
            return
        super().add_param_group(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            if self.flaw == "solves_in_the_first_dtype" and params:  # one dtype for a batched solve
                grads = [g.to(params[0].dtype) for g in grads]
            bad = [i for i, g in enumerate(grads) if not bool(torch.isfinite(g).all())]
            if bad and self.flaw == "skips_nan_silently":
                pass
            elif bad and self.flaw != "propagates_nan":
                raise ValueError(f"gradient {bad[0]} has non-finite entries; nothing was changed")
            total = math.sqrt(sum(float(g.square().sum()) for g in grads)) or 1.0
            for i, p in enumerate(params):
                if i in bad and self.flaw == "skips_nan_silently":
                    continue
                self._update(p, grads[i] / total if self.flaw == "joint_norm" else grads[i], group)
        return loss

    def _update(self, p, grad, group):
        m = p.manifold
        if group["maximize"] and self.flaw != "ignores_maximize":
            grad = -grad
        store = self._hidden.setdefault(p, {}) if self.flaw == "unsaved_state" else self.state[p]
        if self.flaw == "zero_guard_underflows_in_float32":  # 1e-50 is 0 in float32: 0 / 0
            grad = grad * (grad.norm() / (grad.norm() + 1e-50))
        if self.flaw == "decays_gradient_in_place":
            grad = grad.add_(p, alpha=1e-3)
        rgrad = m.egrad2rgrad(p, grad)
        buf = store.get("momentum_buffer")
        buf = rgrad.clone() if buf is None else m.proju(p, group["momentum"] * buf + rgrad)
        store["momentum_buffer"] = buf
        lr = self.defaults["lr"] if self.flaw == "ignores_group_lr" else group["lr"]
        if self.flaw in ("caches_lr_by_object", "keeps_first_lr"):  # a value cached from the first step,
            # renewed (caches_lr_by_object) when the group holds another lr object: a tensor lr that a
            # scheduler changes in place is the same object
            if "lr" not in store or (self.flaw == "caches_lr_by_object" and store["lr_object"] is not lr):
                store["lr"], store["lr_object"] = float(lr), lr
            lr = store["lr"]
        if self.flaw == "rescales_momentum_by_lr_ratio":  # momentum correction: 0/0 after lr = 0
            buf = buf * (lr / store.get("last_lr", lr)) if "last_lr" in store else buf
            store["last_lr"] = lr
        step = (lr if self.flaw == "ascent" else -lr) * buf
        store["steps"] = store.get("steps", 0) + 1
        if self.flaw == "draws_from_global_rng":  # a random restart, never taken here
            torch.rand(())
        if self.flaw == "euclidean_step":
            new = p + step
        elif self.flaw == "projects_every_tenth_step":  # 1e-3 off the manifold between the projections
            new = m.projx(p + step) * (1 + 1e-3 * bool(store["steps"] % 10))
        else:
            new = m.retr(p, step)
        if self.flaw == "moves_on_zero":
            new = new + 1e-6 * p
        if self.flaw == "loses_a_dimension" and p.numel() == 0:
            new = new.reshape(-1)
        p.data = new.to(p.dtype) if self.flaw == "loses_a_dimension" else p.copy_(new)


#: The check each flaw must fail.
CAUGHT_BY = {
    "euclidean_step": "on_manifold",
    "ascent": "descent",
    "unsaved_state": "resume",
    "ignores_group_lr": "param_groups",
    "forgets_added_groups": "add_param_group",
    "propagates_nan": "non_finite_gradient",
    "skips_nan_silently": "non_finite_gradient",
    "moves_on_zero": "zero_gradient",
    "loses_a_dimension": "degenerate_shapes",
    "joint_norm": "batched",
    "accepts_bad_lr": "bad_lr",
    "projects_every_tenth_step": "on_manifold",
    "zero_guard_underflows_in_float32": "zero_gradient",
    "ignores_maximize": "maximize",
    "caches_lr_by_object": "tensor_lr",
    "keeps_first_lr": "tensor_lr",
    "draws_from_global_rng": "global_rng",
    "decays_gradient_in_place": "gradient_untouched",
    "rescales_momentum_by_lr_ratio": "zero_lr",
    "solves_in_the_first_dtype": "mixed_dtypes",
}
MANIFOLDS = {"sphere": Sphere(2.5, retraction="exp"), "stiefel": Stiefel(), "euclidean": Euclidean(ndim=2)}


@pytest.mark.parametrize("manifold", sorted(MANIFOLDS))
def test_a_correct_optimizer_passes_every_check(manifold):
    report = assert_optimizer(lambda params: ToySGD(params), MANIFOLDS[manifold])
    assert isinstance(report, OptimizerReport) and report.ok
    assert [r.name for r in report.results] == list(OPTIMIZER_CHECKS)
    skipped = {r.name for r in report.results if r.status != "pass"}
    # it refuses a wide matrix (the manifold does) and has no layout; Euclidean space has no normal space
    assert skipped == ({"wide", "normal_gradient"} if manifold == "euclidean" else {"wide"})
    assert report.optimizer == "ToySGD"


@pytest.mark.parametrize("flaw", FLAWS)
def test_each_flaw_fails_its_check(flaw):
    manifold = MANIFOLDS["stiefel"] if flaw != "euclidean_step" else MANIFOLDS["sphere"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = check_optimizer(lambda params: ToySGD(params, flaw=flaw), manifold)
    assert CAUGHT_BY[flaw] in [r.name for r in report.failures()], str(report)


def test_assert_optimizer_raises_with_the_report():
    with pytest.raises(AssertionError, match=r"(?s)ToySGD on stiefel.*fail  descent: \|\|x - x\*\|\| went from"):
        assert_optimizer(lambda params: ToySGD(params, flaw="ascent"), Stiefel(), checks=("on_manifold", "descent"))


def test_zero_gradient_is_skipped_with_weight_decay():
    class Decaying(ToySGD):
        def __init__(self, params):
            super().__init__(params)
            self.defaults["weight_decay"] = 0.1

    (result,) = check_optimizer(Decaying, Stiefel(), checks=("zero_gradient",)).results
    assert result == CheckResult("zero_gradient", "skip", "weight_decay=0.1 moves parameters by design")


def test_an_optimizer_that_raises_unexpectedly_fails_with_the_exception():
    def factory(params):
        raise RuntimeError("boom")

    report = check_optimizer(factory, Stiefel(), checks=("descent",))
    assert report.failures() == [CheckResult("descent", "fail", "raised RuntimeError: boom")]
    assert report.optimizer == "factory"


def test_unknown_check_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown checks \['speed'\]; valid checks: on_manifold, descent"):
        check_optimizer(lambda params: ToySGD(params), Stiefel(), checks=("descent", "speed"))


def test_no_check_at_all_is_refused_not_passed():
    # checks=() ran nothing and reported ok, so assert_optimizer passed any optimizer
    with pytest.raises(ValueError, match=r"checks must name at least one check .*got \(\)"):
        assert_optimizer(lambda params: ToySGD(params, flaw="ascent"), Stiefel(), checks=())
    with pytest.raises(ValueError, match=r"checks must name at least one check .*got 'descent'"):
        check_optimizer(lambda params: ToySGD(params), Stiefel(), checks="descent")


@pytest.mark.parametrize("seed", [1.5, 2.0, "0", None, True])
def test_a_seed_that_is_not_an_int_is_refused_not_reported_as_failures(seed):
    # seed=1.5 reached the generators, which refused it in every check: a report of all failures
    with pytest.raises(ValueError, match=re.escape(f"seed must be an int, got {seed!r}")):
        check_optimizer(lambda params: ToySGD(params), Stiefel(), checks=("descent",), seed=seed)


def test_a_0_dim_shape_is_the_shape_checked():
    # shape=() (a scalar parameter on Euclidean space of ndim=0) was taken as "no shape" and
    # checked the default (4,) instead
    shapes = set()

    def factory(params):
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        shapes.update(tuple(p.shape) for group in groups for p in group["params"])
        return ToySGD(params)

    report = check_optimizer(factory, Euclidean(ndim=0), shape=(), checks=("descent", "add_param_group"))
    assert report.ok, str(report)
    assert () in shapes and (4,) not in shapes
