"""The checks behind :func:`~manifoldlib.testing.check_optimizer`, one function each.

A check takes the :class:`Setup` (factory, manifold, point shape, seed) and returns a short
description of what it saw, prefixed ``"skip: "`` when it does not apply; it raises
:class:`CheckFailed` naming what went wrong. The contracts are documented with the public API in
:mod:`manifoldlib.testing.conformance`.
"""

from __future__ import annotations

import copy
import io
import itertools
import math
import warnings
from collections.abc import Callable

import geoopt
import torch

from ..manifolds.base import RetractionManifold
from .sampling import random_tangent

__all__ = ["CHECKS", "CheckFailed", "Setup"]

#: ``params -> optimizer``, ``params`` a list of tensors or of parameter-group dicts.
Factory = Callable[[list], torch.optim.Optimizer]


class CheckFailed(Exception):
    """A check's failure; the message names what and by how much."""


def _require(condition: bool, detail: str) -> None:
    if not condition:
        raise CheckFailed(detail)


class Setup:
    """The manifold, the factory and the problems every check builds its runs from."""

    def __init__(self, factory: Factory, manifold: RetractionManifold, shape: tuple[int, ...], seed: int):
        self.factory, self.manifold, self.shape, self.seed = factory, manifold, shape, seed

    def generator(self, offset: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1000 + offset)

    def point(self, offset: int, shape=None, dtype=torch.float64) -> torch.Tensor:
        return self.manifold.random(*(shape or self.shape), generator=self.generator(offset), dtype=dtype)

    def parameters(self, *values: torch.Tensor) -> list[geoopt.ManifoldParameter]:
        return [geoopt.ManifoldParameter(v.clone(), manifold=self.manifold) for v in values]

    def defaults(self) -> dict:
        return self.factory(self.parameters(self.point(0))).defaults

    def run(self, opt, params, targets, steps: int, every: Callable | None = None) -> None:
        """``steps`` optimizer steps on :math:`\\tfrac12\\|p - t\\|^2` for each pair."""
        for step in range(steps):
            for p, t in zip(params, targets):
                p.grad = p.detach() - t
            opt.step()
            if every is not None:
                every(step)


def _tensors_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _same(a, b) -> bool:
    """Structural equality of state dicts: tensors entrywise (NaN equal to NaN), the rest ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_same(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _all_finite(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return not (obj.is_floating_point() or obj.is_complex()) or bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return all(_all_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_all_finite(v) for v in obj)
    return True


def _on_manifold(s: Setup, x: torch.Tensor, what: str) -> None:
    rtol = 1e3 * torch.finfo(x.dtype).eps
    _require(bool(torch.isfinite(x).all()), f"{what} is not finite")
    ok, reason = s.manifold.check_point_on_manifold(x.detach(), explain=True, atol=0.0, rtol=rtol)
    _require(ok, f"{what} is off the manifold (rtol {rtol:.1e}): {reason}")


def _trajectory(s: Setup, starts, targets, steps: int, groups=None) -> list[torch.Tensor]:
    """The points after ``steps`` steps of a fresh optimizer; ``groups`` maps the parameters to
    the factory's argument (default: the plain list)."""
    params = s.parameters(*starts)
    opt = s.factory(params if groups is None else groups(params))
    s.run(opt, params, targets, steps)
    return [p.detach().clone() for p in params]


# -- the checks -----------------------------------------------------------------------------


def _check_on_manifold(s: Setup) -> str:
    for dtype in (torch.float64, torch.float32):
        (p,) = params = s.parameters(s.point(1, dtype=dtype))
        target = 2.0 * torch.randn(s.shape, generator=s.generator(2), dtype=dtype)

        def every_step(k, p=p, dtype=dtype):
            _on_manifold(s, p, f"{dtype} point after step {k + 1}")

        s.run(s.factory(params), params, [target], 100, every=every_step)
    return "100 steps in float64 and float32"


def _check_descent(s: Setup) -> str:
    target = s.point(3)
    v = random_tangent(s.manifold, target, scale=0.3, generator=s.generator(4))
    start = s.manifold.retr(target, v)
    (p,) = params = s.parameters(start)
    points = [start]
    s.run(s.factory(params), params, [target], 60, every=lambda _: points.append(p.detach().clone()))
    path = sum(float((b - a).norm()) for a, b in itertools.pairwise(points))
    _require(path > 0, "60 steps did not move the point")  # else half of a path of 0 asks for nothing
    before, after = float((start - target).norm()), float((points[-1] - target).norm())
    # half the distance, or, where 60 steps of this lr cannot go that far, half the path walked
    required = 0.5 * min(before, path)
    _require(before - after >= required,
             f"||x - x*|| went from {before:.4g} to {after:.4g} in 60 steps along a path of length {path:.4g} "
             f"(a decrease of at least {required:.4g} expected: half the distance or half the path)")
    return f"||x - x*||: {before:.3g} -> {after:.3g} (path {path:.3g})"


def _normal_part(s: Setup, x: torch.Tensor, scale: float, offset: int = 42) -> torch.Tensor | None:
    """A vector normal to the tangent space at ``x`` (``r - proju(x, r)``) of norm ``scale``, which
    the Riemannian gradient ignores; ``None`` where there is none (Euclidean space) or where
    ``egrad2rgrad`` does not ignore it (a metric other than the embedded one)."""
    r = torch.randn(x.shape, generator=s.generator(offset), dtype=x.dtype)
    n = r - s.manifold.proju(x, r)
    if float(n.norm()) <= 1e-8 * float(r.norm()):
        return None
    n = n * (scale / n.norm())
    if float(s.manifold.egrad2rgrad(x, n).norm()) > 1e-12 * scale:
        return None
    return n


#: Steps ``normal_gradient`` compares: a state (momentum, second moments, a warm start) built
#: from the first gradient acts from the second step on, one built from two from the third.
NORMAL_GRADIENT_STEPS = 3


def _check_normal_gradient(s: Setup) -> str:
    start, target = s.point(40), s.point(41)
    if _normal_part(s, start, 1.0) is None:
        return "skip: no gradient component that the Riemannian gradient ignores (no normal space)"
    runs = []
    for normal in (False, True):
        (p,) = params = s.parameters(start)
        opt = s.factory(params)
        points = [start]
        for step in range(NORMAL_GRADIENT_STEPS):
            g = p.detach() - target
            n = _normal_part(s, p.detach(), float(g.norm()), 42 + step) if normal else None
            p.grad = g if n is None else g + n
            opt.step()
            points.append(p.detach().clone())
        runs.append(points)
    path, changes = 0.0, []
    for step, (a, b) in enumerate(zip(runs[0][1:], runs[1][1:]), 1):
        path += float((a - runs[0][step - 1]).norm())
        _require(path > 0, "the first step did not move the point")
        change = float((b - a).norm()) / path
        changes.append(f"{change:.1e}")
        _require(change <= 1e-6, f"adding to every gradient a component normal to the manifold (norm ||g||, "
                                 f"ignored by the Riemannian gradient) moved the point after step {step} by "
                                 f"{change:.3e} of the path walked (1e-6 allowed): "
                                 + ("the step uses the Euclidean gradient, not only its Riemannian part"
                                    if step == 1 else "the optimizer's state (a momentum, a second moment, a "
                                    "warm start) keeps the Euclidean gradient, which acts from this step on"))
    return (f"a normal component of norm ||g|| at every step moved the point by {', '.join(changes)} of the path "
            f"after steps 1 to {NORMAL_GRADIENT_STEPS}")


def _check_resume(s: Setup) -> str:
    start, target = s.point(5), s.point(6)
    whole = _trajectory(s, [start], [target], 10)[0]
    params = s.parameters(start)
    opt = s.factory(params)
    s.run(opt, params, [target], 5)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    try:
        saved = torch.load(buffer, weights_only=True)
    except Exception as err:  # noqa: BLE001 - an option that is not plain data, whatever the error
        raise CheckFailed(f"state_dict() does not load with torch.load(weights_only=True): {err}") from None
    fresh = s.parameters(s.point(7))  # other values: the load must overwrite them
    opt = s.factory(fresh)
    with torch.no_grad():
        for p, value in zip(fresh, saved["params"]):
            p.copy_(value)
    opt.load_state_dict(saved["optimizer"])
    s.run(opt, fresh, [target], 5)
    diff = float((fresh[0].detach() - whole).abs().max())
    _require(diff == 0.0, f"the resumed run differs from the uninterrupted one by {diff:.3e} (max abs)")
    return "bit-identical after 5 + 5 steps"


def _second_shape(s: Setup) -> tuple[int, ...]:
    """A point shape other than ``shape`` (separate groups stay separate for batched optimizers);
    for 0-dim points (Euclidean ``ndim=0``, a scalar parameter) a batch of two."""
    if not s.shape:
        return (2,)
    return s.shape[:-1] + (s.shape[-1] + 2,) if s.manifold.name in ("sphere", "euclidean") else \
        s.shape[:-2] + (s.shape[-2] + 1, max(1, s.shape[-1] - 1))


#: What a check that varies or scales ``lr`` reports without a positive number to start from.
_NO_DEFAULT_LR = "skip: the optimizer has no positive float default 'lr'"


def _positive_number(value) -> bool:
    """A default ``lr`` the checks can vary: an int or float (not a bool, not a tensor) above 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _other_value(value):
    """Another valid-looking value of a numeric option: 0.5 for 0 (``momentum=0``,
    ``weight_decay=0``), one more for another int (a count), half of another float (a factor in
    (0, 1) stays in (0, 1), a positive value positive)."""
    if value == 0:
        return 0.5
    return value + 1 if isinstance(value, int) else value / 2


def _varied_options(defaults: dict) -> list[tuple[str, str, object, object]]:
    """``(label, key, value, default)`` for each option other than ``lr`` given another value: a
    number, one entry of a tuple or list of numbers (``betas[1]``), or a boolean flipped
    (``nesterov``, ``amsgrad``)."""
    varied = []
    for key, value in defaults.items():
        if key == "lr":
            continue
        if isinstance(value, bool):
            varied.append((key, key, not value, value))
        elif _is_number(value):
            varied.append((key, key, _other_value(value), value))
        elif isinstance(value, (tuple, list)) and value and all(_is_number(v) for v in value):
            for i, v in enumerate(value):
                entries = list(value)
                entries[i] = _other_value(v)
                varied.append((f"{key}[{i}]", key, type(value)(entries), value))
    return varied


def _check_param_groups(s: Setup) -> str:
    defaults = s.defaults()
    lr = defaults.get("lr")
    if not _positive_number(lr):
        return _NO_DEFAULT_LR
    shape2 = _second_shape(s)
    starts, targets = [s.point(8), s.point(9, shape2)], [s.point(10), s.point(11, shape2)]
    both = _trajectory(s, starts, targets, 5, groups=lambda ps: [{"params": [ps[0]]}, {"params": [ps[1]], "lr": lr / 2}])
    first = _trajectory(s, starts[:1], targets[:1], 5)[0]
    second = _trajectory(s, starts[1:], targets[1:], 5, groups=lambda ps: [{"params": ps, "lr": lr / 2}])[0]
    default_lr = _trajectory(s, starts[1:], targets[1:], 5)[0]
    _require(torch.equal(both[0], first), "the first group's parameter differs from its run alone")
    _require(torch.equal(both[1], second), "the second group's parameter differs from its run alone with lr/2")
    _require(not torch.equal(second, default_lr), "the group's lr = lr/2 did not change the result")
    return f"groups with lr {lr:g} and {lr / 2:g}; " + _other_group_options(s, defaults, starts, targets)


def _other_group_options(s: Setup, defaults: dict, starts, targets) -> str:
    """Each numeric or boolean option but ``lr`` in turn given another value in the second group:
    3 steps of each parameter equal, bit for bit, its run alone with its group's options (an
    option without effect in this run passes trivially; one the optimizer refuses is left out)."""
    first = _trajectory(s, starts[:1], targets[:1], 3)[0]
    default = _trajectory(s, starts[1:], targets[1:], 3)[0]
    effect, none, refused = [], [], []
    for label, key, value, old in _varied_options(defaults):
        shown = f"{label}={_entry(label, value)!r}"
        try:
            alone = _trajectory(s, starts[1:], targets[1:], 3, groups=lambda ps, k=key, v=value: [{"params": ps, k: v}])[0]
        except (ValueError, TypeError):
            refused.append(shown)
            continue
        both = _trajectory(s, starts, targets, 3, groups=lambda ps, k=key, v=value: [{"params": [ps[0]]},
                                                                                      {"params": [ps[1]], k: v}])
        _require(_tensors_same(both[0], first), f"the first group's parameter differs from its run alone when the "
                                                f"second group has {shown}")
        if not _tensors_same(both[1], alone):
            ignored = _tensors_same(both[1], default)
            raise CheckFailed(f"the second group's parameter with {shown} differs from its run alone with {shown}"
                              + (f": it follows the first group's {label}={_entry(label, old)!r} (the group's "
                                 f"{label} is ignored)" if ignored else ""))
        (effect if not _tensors_same(alone, default) else none).append(shown)
    parts = [f"per group: {', '.join(effect)}" if effect else "no other option changed the result"]
    if none:
        parts.append(f"without effect here: {', '.join(none)}")
    if refused:
        parts.append(f"refused: {', '.join(refused)}")
    return "; ".join(parts)


def _entry(label: str, value):
    """The varied entry of ``value`` (``value[i]`` for a label ``key[i]``)."""
    return value[int(label[label.index("[") + 1:-1])] if label.endswith("]") else value


def _check_lr_scaling(s: Setup) -> str:
    lr = s.defaults().get("lr")
    if not _positive_number(lr):
        return _NO_DEFAULT_LR
    start, target = s.point(33), s.point(34)
    lrs = (lr / 8, lr / 16)  # small enough that a step is linear in lr to a few per cent
    moved = [float((_trajectory(s, [start], [target], 3, groups=lambda ps, a=a: [{"params": ps, "lr": a}])[0]
                    - start).norm()) for a in lrs]
    _require(moved[1] > 0, f"3 steps at lr={lrs[1]:g} did not move the point")
    ratio = moved[0] / moved[1]
    _require(1.7 <= ratio <= 2.3, f"halving lr ({lrs[0]:g} -> {lrs[1]:g}) divided the distance 3 steps move by "
                                  f"{ratio:.3g}, not 2 (a step is linear in lr; {ratio:.3g} is lr**"
                                  f"{math.log2(ratio):.2g})")
    return f"halving lr ({lrs[0]:g} -> {lrs[1]:g}) divided the distance moved by {ratio:.3g}"


def _maximize_run(s: Setup, start, target, maximize: bool, sign: float) -> torch.Tensor:
    """3 steps of a fresh optimizer in a group with ``maximize``, the gradients ``sign (x - t)``."""
    (p,) = params = s.parameters(start)
    opt = s.factory([{"params": params, "maximize": maximize}])
    for _ in range(3):
        p.grad = sign * (p.detach() - target)
        opt.step()
    return p.detach().clone()


def _check_maximize(s: Setup) -> str:
    if not isinstance(s.defaults().get("maximize"), bool):
        return "skip: the optimizer has no boolean 'maximize' option"
    start, target = s.point(52), s.point(53)
    try:
        s.factory([{"params": s.parameters(start), "maximize": True}])
    except (ValueError, TypeError) as err:
        return f"skip: a group with maximize=True is refused ({type(err).__name__}: {err})"
    # maximizing -1/2 ||x - t||^2 (gradient t - x) is minimizing 1/2 ||x - t||^2 (gradient x - t)
    ascent = _maximize_run(s, start, target, True, -1.0)
    descent = _maximize_run(s, start, target, False, 1.0)
    if not _tensors_same(ascent, descent):
        ignored = _tensors_same(ascent, _maximize_run(s, start, target, False, -1.0))
        before = float((start - target).norm())
        raise CheckFailed("maximize=True on the gradients of -f differs from minimizing f "
                          f"(||x - t||: {before:.4g} -> {float((ascent - target).norm()):.4g} against "
                          f"{float((descent - target).norm()):.4g}; max abs difference "
                          f"{float((ascent - descent).abs().max()):.3e})"
                          + (": the group's maximize is ignored (the step descends on -f)" if ignored else ""))
    return "maximize=True on the gradients of -f equals minimizing f, bit for bit (3 steps)"


def _lr_run(s: Setup, start, target, lr, halve: Callable[[dict], None], params=None) -> torch.Tensor:
    """3 steps at the group ``lr``, ``halve(group)``, 3 more steps: the final point (of
    ``params``, default: fresh parameters at ``start``)."""
    (p,) = params = params or s.parameters(start)
    opt = s.factory([{"params": params, "lr": lr}])
    s.run(opt, params, [target], 3)
    halve(opt.param_groups[0])
    s.run(opt, params, [target], 3)
    return p.detach().clone()


def _check_tensor_lr(s: Setup) -> str:
    lr = s.defaults().get("lr")
    if not _positive_number(lr):
        return _NO_DEFAULT_LR
    start, target = s.point(54), s.point(55)
    params = s.parameters(start)
    try:
        # torch's LR schedulers change a tensor lr in place (fill_), so a plan or a copy made
        # from its value at the first step would miss the change
        given = _lr_run(s, start, target, torch.tensor(float(lr), dtype=torch.float64),
                        lambda group: group["lr"].fill_(lr / 2), params)
    except (ValueError, TypeError) as err:  # a refusal leaves the parameter as it was
        _require(torch.equal(params[0].detach(), start), f"with a tensor lr, a step raised {type(err).__name__} "
                                                         f"after the parameter had moved: {err}")
        return f"skip: a tensor lr is refused ({type(err).__name__}: {err})"
    reference = _lr_run(s, start, target, float(lr), lambda group: group.__setitem__("lr", lr / 2))
    kept = _lr_run(s, start, target, float(lr), lambda group: None)
    _require(not _tensors_same(reference, kept), "the group's lr set to lr/2 after 3 steps did not change the "
                                                 "next 3 (the step kept lr's first value)")
    path = float((reference - start).norm())
    diff = float((given - reference).norm()) / max(path, torch.finfo(torch.float64).tiny)
    if not diff <= 1e-12:  # NaN too
        stale = float((given - kept).norm()) / max(path, torch.finfo(torch.float64).tiny) <= 1e-12
        raise CheckFailed(f"a float64 tensor lr halved in place after 3 steps (as torch's LR schedulers do) ends "
                          f"{diff:.3e} of the path away from a float lr halved after 3 steps"
                          + (": the in-place change was not seen (the step kept lr's first value)" if stale else ""))
    return f"a tensor lr halved in place after 3 steps follows the float lr to {diff:.1e} of the path"


def _check_global_rng(s: Setup) -> str:
    start, target = s.point(56), s.point(57)
    before = torch.get_rng_state()
    first = _trajectory(s, [start], [target], 3)[0]
    drawn = not torch.equal(before, torch.get_rng_state())
    second = _trajectory(s, [start], [target], 3)[0]
    _require(not drawn, "building the optimizer or its 3 steps drew from torch's global random generator: "
                        "a training run's data order, dropout and initialization then depend on the optimizer "
                        "(use a torch.Generator of the optimizer's own)")
    _require(_tensors_same(first, second), "two fresh runs of 3 steps from the same point end "
                                           f"{float((first - second).abs().max()):.3e} apart (max abs)")
    return "torch's global random generator untouched; two fresh runs bit-identical"


def _gradient_kept(s: Setup, start, target, shown: str, group: dict | None) -> None:
    """3 steps, each given a fresh ``p.grad``: the optimizer leaves that tensor and its values."""
    (p,) = params = s.parameters(start)
    opt = s.factory(params if group is None else [{"params": params, **group}])
    for step in range(3):
        given = p.detach() - target
        p.grad = given.clone()
        grad = p.grad
        opt.step()
        _require(p.grad is grad, f"with {shown}, step {step + 1} replaced p.grad by another tensor")
        _require(_tensors_same(p.grad, given),
                 f"with {shown}, step {step + 1} changed p.grad in place (max abs change "
                 f"{float((p.grad - given).abs().max()):.3e}): a gradient read after the step (a logged norm, "
                 f"a second optimizer of a shared parameter, gradient accumulation) is no longer the gradient")


def _check_gradient_untouched(s: Setup) -> str:
    start, target = s.point(58), s.point(59)
    _gradient_kept(s, start, target, "the defaults", None)
    kept, not_run = ["the defaults"], []
    for label, key, value, _ in _varied_options(s.defaults()):
        shown = f"{label}={_entry(label, value)!r}"
        try:
            _gradient_kept(s, start, target, shown, {key: value})
        except CheckFailed:
            raise
        except Exception as err:  # noqa: BLE001 - a value this run cannot take (torch's capturable off CUDA)
            not_run.append(f"{shown} ({type(err).__name__})")
            continue
        kept.append(shown)
    return f"p.grad left as given over 3 steps with {', '.join(kept)}" + (
        f"; not run: {', '.join(not_run)}" if not_run else "")


def _check_add_param_group(s: Setup) -> str:
    shape2 = _second_shape(s)
    starts, targets = [s.point(12), s.point(13, shape2)], [s.point(14), s.point(15, shape2)]
    first, second = s.parameters(*starts)
    opt = s.factory([first])
    s.run(opt, [first], targets[:1], 3)
    opt.add_param_group({"params": [second]})
    s.run(opt, [first, second], targets, 3)
    _require(torch.equal(first.detach(), _trajectory(s, starts[:1], targets[:1], 6)[0]),
             "the first parameter was disturbed by the added group")
    _require(torch.equal(second.detach(), _trajectory(s, starts[1:], targets[1:], 3)[0]),
             "the added parameter differs from its own fresh run")
    return "added after 3 steps"


def _to_rounding(a, b) -> bool:
    """:func:`_same`, but a floating tensor may differ from its counterpart by rounding:
    ``64 eps`` of its dtype relative to that tensor's norm (a re-projection onto the manifold,
    as geoopt's ``stabilize`` does to every parameter every few steps, moves a point by ulps)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point() \
            and a.dtype == b.dtype and a.shape == b.shape and _all_finite(a) and _all_finite(b):
        return float((a - b).double().norm()) <= 64 * torch.finfo(a.dtype).eps * float(b.double().norm())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_to_rounding(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_to_rounding(x, y) for x, y in zip(a, b))
    return _same(a, b)


def _check_none_gradient(s: Setup) -> str:
    params = s.parameters(s.point(35), s.point(36), s.point(37))
    targets = [s.point(38), s.point(39)]
    opt = s.factory(params)
    s.run(opt, params[:2], targets, 2)  # the third never has a gradient
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy(opt.state_dict()["state"])
    params[1].grad = None  # frozen after 2 steps (requires_grad_(False), or unused this step)
    s.run(opt, params[:1], targets[:1], 3)
    state = opt.state_dict()["state"]
    for k, what in ((1, "a parameter whose grad became None after 2 steps"),
                    (2, "a parameter whose grad was always None")):
        moved = float((params[k].detach() - before[k]).norm())
        _require(_to_rounding(params[k].detach(), before[k]),
                 f"3 steps moved {what} by {moved:.3e} (a parameter without a gradient is skipped)")
        kept, now = state_before.get(k) or {}, state.get(k) or {}
        _require(_to_rounding(now, kept), f"3 steps changed the state of {what} (keys {sorted(kept)} -> "
                                          f"{sorted(now)}; a parameter without a gradient is skipped)")
    _require(not torch.equal(params[0].detach(), before[0]), "the parameter with a gradient did not move")
    return "3 steps: the parameters whose grad is None kept their values and state"


def _check_closure(s: Setup) -> str:
    start, target = s.point(43), s.point(44)
    (p,) = params = s.parameters(start)
    opt = s.factory(params)
    calls, losses = [], []

    def closure():
        calls.append(torch.is_grad_enabled())
        with torch.enable_grad():
            p.grad = None
            loss = 0.5 * (p - target).square().sum()
            loss.backward()
        losses.append(loss)
        return loss

    for step in range(2):
        called = len(calls)
        returned = opt.step(closure)
        _require(len(calls) > called, f"step {step + 1}: step(closure) did not call the closure")
        _require(all(calls[called:]), f"step {step + 1}: step(closure) called the closure with gradients disabled "
                                      f"(its backward() fails under torch.no_grad(); call it under "
                                      f"torch.enable_grad())")
        _require(returned is not None, f"step {step + 1}: step(closure) returned None, not the closure's loss")
        _require(any(returned is loss or (not isinstance(returned, torch.Tensor) and returned == float(loss))
                     for loss in losses[called:]),
                 f"step {step + 1}: step(closure) returned {returned!r}, not the loss the closure returned")
    _require(not torch.equal(p.detach(), start), "2 steps with a closure did not move the parameter")
    return f"called {len(calls)} times in 2 steps, under grad mode; returned its loss"


def _check_non_finite_gradient(s: Setup) -> str:
    outcomes = []
    for value in (math.nan, math.inf):
        params = s.parameters(s.point(16), s.point(17))
        targets = [s.point(18), s.point(19)]
        opt = s.factory(params)
        s.run(opt, params, targets, 2)
        outcomes.append(f"{value}: {_non_finite_step(s, opt, params, targets, value)}")
        _recovers(s, opt, params, targets, value)
    return "; ".join(outcomes)


def _non_finite_step(s: Setup, opt, params, targets, value: float) -> str:
    """One step with a ``value`` entry in the second parameter's gradient: what the optimizer did
    (raises :class:`CheckFailed` if that is not one of the accepted ways)."""
    good, bad = params
    before = [p.detach().clone() for p in params]
    state_before = copy.deepcopy(opt.state_dict())
    good.grad = good.detach() - targets[0]
    bad.grad = bad.detach() - targets[1]
    bad.grad[(0,) * bad.grad.dim()] = value
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt.step()
        except ValueError:
            _require(all(torch.equal(p.detach(), b) for p, b in zip(params, before)),
                     f"raised ValueError for a {value} gradient after changing a parameter")
            _require(_same(opt.state_dict(), state_before),
                     f"raised ValueError for a {value} gradient after changing the optimizer state")
            return "ValueError, nothing changed"
    state = opt.state_dict()
    _require(_all_finite([p.detach() for p in params]), f"a {value} gradient made a parameter non-finite")
    poisoned = _non_finite_buffers(state, bad.shape)
    _require(not poisoned, f"a {value} gradient made the state's {', '.join(poisoned)} non-finite")
    _require(torch.equal(bad.detach(), before[1]), f"the parameter with a {value} gradient moved")
    after, prior = state["state"].get(1) or {}, state_before["state"].get(1) or {}
    if _counted_skip(prior, after):  # skipped on the device: its buffers kept, the skip counted
        changed = [key for key, v in after.items() if isinstance(v, torch.Tensor) and v.shape == bad.shape
                   and not _same(v, prior.get(key))]
        _require(not changed, f"the {', '.join(changed)} of the parameter with a {value} gradient changed")
        return "skipped, counted in state['skipped_steps']"
    _require(_same(after, prior), f"the state of the parameter with a {value} gradient changed")
    _require(bool(caught), f"a {value} gradient was skipped without a warning")
    return "skipped with a warning"


def _non_finite_buffers(state: dict, shape: torch.Size) -> list[str]:
    """``state[i][key]`` of every non-finite state tensor of the parameters' shape (a buffer)."""
    return [f"state[{index}][{key!r}]" for index, entries in state["state"].items() for key, v in entries.items()
            if isinstance(v, torch.Tensor) and v.shape == shape and not _all_finite(v)]


def _recovers(s: Setup, opt, params, targets, value: float) -> None:
    """After the non-finite gradient, 2 steps with finite gradients move both parameters and leave
    every parameter and state entry finite (a diagnostic may read NaN for the skipped step only)."""
    before = [p.detach().clone() for p in params]
    s.run(opt, params, targets, 2)
    state = opt.state_dict()
    _require(_all_finite([p.detach() for p in params]),
             f"2 steps with finite gradients after a {value} gradient made a parameter non-finite")
    stuck = [str(k) for k, (p, b) in enumerate(zip(params, before)) if torch.equal(p.detach(), b)]
    _require(not stuck, f"2 steps with finite gradients after a {value} gradient did not move parameter "
                        f"{', '.join(stuck)}")
    stale = [f"state[{index}][{key!r}]" for index, entries in state["state"].items() for key, v in entries.items()
             if not _all_finite(v)]
    _require(not stale, f"2 steps with finite gradients after a {value} gradient left the state's "
                        f"{', '.join(stale)} non-finite")


def _counted_skip(before: dict, after: dict) -> bool:
    """Whether ``state["skipped_steps"]`` of a parameter grew by one between two state dicts."""
    if "skipped_steps" not in after:
        return False
    return int(after["skipped_steps"]) == int(before.get("skipped_steps", 0)) + 1


def _check_zero_gradient(s: Setup) -> str:
    decay = s.defaults().get("weight_decay", 0)
    if decay:
        return f"skip: weight_decay={decay!r} moves parameters by design"
    moves = []
    for dtype in (torch.float64, torch.float32):  # an epsilon guard may underflow in float32 only
        start = s.point(20, dtype=dtype)
        (p,) = params = s.parameters(start)
        opt = s.factory(params)
        for _ in range(3):
            p.grad = torch.zeros_like(p)
            opt.step()
        moved = float((p.detach() - start).norm())
        _require(_all_finite(opt.state_dict()), f"a {dtype} zero gradient made a state entry non-finite")
        _require(moved <= 64 * torch.finfo(dtype).eps * float(start.norm()),
                 f"3 steps with {dtype} zero gradients moved the point by {moved:.3e}")
        moves.append(f"{moved:.1e}")
    return f"moved {moves[0]} (float64), {moves[1]} (float32)"


def _check_zero_lr(s: Setup) -> str:
    lr = s.defaults().get("lr")
    if not _positive_number(lr):
        return _NO_DEFAULT_LR
    outcomes = []
    for dtype in (torch.float64, torch.float32):
        start, target = s.point(60, dtype=dtype), s.point(61, dtype=dtype)
        (p,) = params = s.parameters(start)
        opt = s.factory(params)
        opt.param_groups[0]["lr"] = 0.0  # a warm-up from zero (LambdaLR, linear warm-up schedules)
        s.run(opt, params, [target], 3)
        moved = float((p.detach() - start).norm())
        _require(_all_finite(opt.state_dict()), f"{dtype}: 3 steps at lr=0 made a state entry non-finite")
        _require(moved <= 64 * torch.finfo(dtype).eps * float(start.norm()),
                 f"{dtype}: 3 steps at lr=0 moved the point by {moved:.3e}")
        opt.param_groups[0]["lr"] = lr
        s.run(opt, params, [target], 3)
        _on_manifold(s, p, f"{dtype}: the point 3 steps after lr went from 0 to {lr:g}")
        _require(_all_finite(opt.state_dict()), f"{dtype}: after lr went from 0 to {lr:g} a state entry is "
                                                f"non-finite (a step or momentum rescaled by the ratio of lrs?)")
        after = float((p.detach() - start).norm())
        _require(after > 0, f"{dtype}: 3 steps after lr went from 0 to {lr:g} did not move the point")
        outcomes.append(f"{dtype}: {moved:.1e} at lr=0, then {after:.3g}")
    return "; ".join(outcomes)


def _admits(s: Setup, shape: tuple[int, ...]) -> bool:
    ok, _ = s.manifold.check_point(torch.empty(shape, device="meta"), explain=True)
    return ok


def _check_degenerate_shapes(s: Setup) -> str:
    one_column = (1,) if s.manifold.name == "sphere" else s.shape[:-1] + (1,)
    zero_size = s.shape[:-2] + (0, s.shape[-1]) if len(s.shape) >= 2 else (0,)
    outcomes = []
    for label, shape in (("one column", one_column), ("zero-size point", zero_size),
                         ("zero-size batch", (0,) + s.shape)):
        if not _admits(s, shape):
            outcomes.append(f"{label} {shape}: not a point shape of {s.manifold.name}")
            continue
        start = s.point(21, shape)
        params = s.parameters(start)
        try:
            opt = s.factory(params)
        except ValueError as err:
            _require(torch.equal(params[0].detach(), start), f"{label} {shape}: refused after changing it")
            outcomes.append(f"{label} {shape}: refused ({err})")
            continue
        s.run(opt, params, [s.point(22, shape)], 3)
        p = params[0].detach()
        _require(p.shape == shape, f"{label} {shape}: the shape became {tuple(p.shape)}")
        _on_manifold(s, p, f"{label} {shape}: the point after 3 steps")
        outcomes.append(f"{label} {shape}: ok")
    return "; ".join(outcomes)


#: The ``layout`` of a map stored transposed, ``(in, out)`` as a ``Conv1D`` stores it
#: (:data:`manifoldlib.optim.LAYOUTS`; the default ``"out_in"`` is ``torch.nn.Linear``'s).
_TRANSPOSED_LAYOUT = "in_out"


def _tall_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with more rows than columns: itself, its transpose, or two more rows if square."""
    m, n = shape[-2], shape[-1]
    return shape if m > n else shape[:-2] + ((n, m) if m < n else (m + 2, n))


def _stored_transposed(s: Setup, point: torch.Tensor) -> geoopt.ManifoldParameter:
    """A parameter carrying the manifold whose stored value is ``point``'s transpose (contiguous).
    ``geoopt.ManifoldParameter`` refuses a value its manifold does not admit (a wide matrix on
    Stiefel), so it is built from the point and then given the transposed value."""
    (p,) = s.parameters(point)
    p.data = point.mT.clone(memory_format=torch.contiguous_format)  # .contiguous() may alias a QR's point
    return p


def _run_transposed(s: Setup, start, target, groups, label: str) -> torch.Tensor | str:
    """3 steps on ``start`` stored transposed: the final value transposed back, or the refusal
    (``ValueError``/``TypeError`` from the factory or a step, the parameter unchanged) in words."""
    p = _stored_transposed(s, start)
    stored = p.detach().clone()
    try:
        opt = s.factory(groups([p]))
        s.run(opt, [p], [target.mT.contiguous()], 3)
    except (ValueError, TypeError) as err:
        _require(torch.equal(p.detach(), stored), f"{label}: refused ({type(err).__name__}) after changing the "
                                                  f"parameter")
        return f"{label}: refused ({type(err).__name__}: {err})"
    _require(p.shape == stored.shape and p.stride() == stored.stride(),
             f"{label}: the step changed the parameter's shape/strides from {tuple(stored.shape)}/{stored.stride()} "
             f"to {tuple(p.shape)}/{p.stride()}")
    return p.detach().mT


def _follows(s: Setup, label: str, stored: torch.Tensor, reference: torch.Tensor, reference_label: str) -> str:
    """A run stored transposed (``stored``, transposed back) ends on the manifold where the
    ``reference`` run ends, to rounding (``1e-12`` relative)."""
    _on_manifold(s, stored, f"{label}: after 3 steps, its transpose (the tall orientation)")
    diff = float((stored - reference).norm()) / float(reference.norm())
    _require(diff <= 1e-12, f"{label}: 3 steps differ from those of {reference_label}, transposed, by {diff:.3e} "
                            f"(relative; 1e-12 allowed): rows and columns are not treated as in the tall run")
    return f"{label}: follows {reference_label} ({diff:.1e})"


def _check_wide(s: Setup) -> str:
    if len(s.shape) < 2:
        return "skip: the points are not matrices"
    tall = _tall_shape(s.shape)
    wide, square = tall[:-2] + (tall[-1], tall[-2]), tall[:-2] + (tall[-1], tall[-1])
    if not _admits(s, tall):
        return f"skip: {tall} is not a point shape of {s.manifold.name}"
    layouts = "layout" in s.defaults()
    if _admits(s, wide) and not layouts:
        return (f"skip: a wide {wide} matrix is itself a point of {s.manifold.name}, and the optimizer has no "
                f"'layout' option to store a map transposed")
    as_stored, transposed = (lambda ps: ps), (lambda ps: [{"params": ps, "layout": _TRANSPOSED_LAYOUT}])
    # (label, shape, seed offset, how the transposed copy is stored, the reference run, its label)
    runs = [(f"the wide {wide} parameter", tall, 45, as_stored, transposed if layouts else None,
             f"its tall {tall} point" + (f" with layout={_TRANSPOSED_LAYOUT!r}" if layouts else ""))]
    if layouts and _admits(s, square):
        runs.append((f"the square {square} matrix stored transposed with layout={_TRANSPOSED_LAYOUT!r}", square, 47,
                     transposed, None, "it stored as it is"))
    outcomes, refused = [], 0
    for label, shape, offset, stored_as, reference_as, reference_label in runs:
        start, target = s.point(offset, shape), s.point(offset + 1, shape)
        stored = _run_transposed(s, start, target, stored_as, label)
        if isinstance(stored, str):
            outcomes.append(stored)
            refused += 1
            continue
        reference = _trajectory(s, [start], [target], 3, groups=reference_as)[0]
        outcomes.append(_follows(s, label, stored, reference, reference_label))
    return ("skip: " if refused == len(runs) else "") + "; ".join(outcomes)


def _check_batched(s: Setup) -> str:
    starts = [s.point(23 + k) for k in range(3)]
    targets = [s.point(26 + k) for k in range(3)]
    together = _trajectory(s, starts, targets, 5)
    diffs = []
    for x, t, joint in zip(starts, targets, together):
        alone = _trajectory(s, [x], [t], 5)[0]
        diffs.append(float((joint - alone).norm()) / float(alone.norm()))
    worst = max(diffs, key=lambda d: (math.isnan(d), d))  # max() alone passes over a NaN
    _require(worst <= 1e-12, f"three same-shape parameters in one group differ from each alone by "
                             f"{worst:.3e} (relative; 1e-12 allowed)")
    return f"relative difference {worst:.1e}"


def _check_mixed_dtypes(s: Setup) -> str:
    shape2 = _second_shape(s)
    layout = [(None, torch.float64), (None, torch.float32), (shape2, torch.float64), (shape2, torch.float32),
              (None, torch.float64)]
    starts = [s.point(62 + k, shape, dtype) for k, (shape, dtype) in enumerate(layout)]
    targets = [s.point(67 + k, shape, dtype) for k, (shape, dtype) in enumerate(layout)]
    together = _trajectory(s, starts, targets, 3)
    worst = []
    for (shape, dtype), x, t, joint in zip(layout, starts, targets, together):
        _require(joint.dtype == dtype, f"a {dtype} parameter in a group with others came back {joint.dtype}")
        alone = _trajectory(s, [x], [t], 3)[0]
        worst.append(float((joint - alone).norm()) / max(float(alone.norm()), torch.finfo(dtype).tiny))
        _require(worst[-1] <= 1e-12, f"in one group of float64 and float32 parameters of two shapes, the {dtype} "
                                     f"parameter of shape {tuple(x.shape)} differs from its run alone by "
                                     f"{worst[-1]:.3e} (relative; 1e-12 allowed: a float32 parameter solved "
                                     f"with float64 ones, or the reverse, differs by its rounding)")
    return f"float64 and float32 parameters of two shapes in one group: each as alone to {max(worst):.1e}"


def _check_in_place(s: Setup) -> str:
    outcomes, reach = [], math.inf
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        start, target = s.point(31, dtype=dtype).contiguous(), s.point(32, dtype=dtype)
        (p,) = params = s.parameters(start)
        layout = (p.dtype, tuple(p.shape), p.stride(), p.data_ptr())
        try:
            opt = s.factory(params)
            s.run(opt, params, [target], 3)
        except (ValueError, TypeError) as err:
            _require(torch.equal(p.detach(), start) and p.dtype == dtype,
                     f"{dtype}: refused ({type(err).__name__}) after changing the parameter")
            outcomes.append(f"{dtype}: refused")
            continue
        held = [q for group in opt.param_groups for q in group["params"]]
        _require(any(q is p for q in held), f"{dtype}: the parameter groups no longer hold the parameter "
                                            f"object (the step replaced it)")
        _require(p.dtype == dtype, f"{dtype}: the step changed the parameter's dtype to {p.dtype}")
        _require(tuple(p.shape) == layout[1], f"{dtype}: the step changed the parameter's shape to "
                                              f"{tuple(p.shape)}")
        _require(p.stride() == layout[2], f"{dtype}: the step changed the parameter's strides from {layout[2]} "
                                          f"to {p.stride()} (contiguous: {p.is_contiguous()})")
        _require(p.data_ptr() == layout[3], f"{dtype}: the step replaced the parameter's storage "
                                            f"(p.data = ... rather than an in-place update)")
        _require(_all_finite(p.detach()), f"{dtype}: the parameter is not finite after 3 steps")
        before, after = (float((x.double() - target.double()).norm()) for x in (start, p.detach()))
        name = str(dtype).removeprefix("torch.")
        if dtype == torch.float32:
            reach = float((p.detach() - start).abs().max())  # how far the float32 run moved an entry
        elif dtype in (torch.bfloat16, torch.float16) and reach <= 2 * torch.finfo(dtype).eps * float(start.abs().max()):
            outcomes.append(f"{name}: the float32 run moves less than its resolution")
            continue
        _require(after < before, f"{dtype}: 3 steps did not bring the parameter closer to its target "
                                 f"(||x - t||: {before:.4g} -> {after:.4g})")
        outcomes.append(f"{name}: {before:.3g} -> {after:.3g}")
    return "in place; ||x - t|| " + ", ".join(outcomes)


def _check_bad_lr(s: Setup) -> str:
    for value in (math.nan, math.inf, -1.0):
        params = s.parameters(s.point(29))
        try:
            s.factory([{"params": params, "lr": value}])
        except ValueError as err:
            _require("lr" in str(err), f"lr={value}: the ValueError does not name lr: {err}")
        else:
            raise CheckFailed(f"a parameter group with lr={value} was accepted")
        opt = s.factory(s.parameters(s.point(30)))
        groups = len(opt.param_groups)
        try:
            opt.add_param_group({"params": params, "lr": value})
        except ValueError as err:
            _require("lr" in str(err), f"add_param_group lr={value}: the ValueError does not name lr: {err}")
            _require(len(opt.param_groups) == groups, f"add_param_group lr={value}: raised but kept the group")
        else:
            raise CheckFailed(f"add_param_group accepted a group with lr={value}")
    return "nan, inf and -1 refused"


#: The checks by name, in the order :func:`~manifoldlib.testing.check_optimizer` runs them.
CHECKS: dict[str, Callable[[Setup], str]] = {
    "on_manifold": _check_on_manifold,
    "descent": _check_descent,
    "normal_gradient": _check_normal_gradient,
    "resume": _check_resume,
    "param_groups": _check_param_groups,
    "lr_scaling": _check_lr_scaling,
    "maximize": _check_maximize,
    "tensor_lr": _check_tensor_lr,
    "global_rng": _check_global_rng,
    "gradient_untouched": _check_gradient_untouched,
    "add_param_group": _check_add_param_group,
    "none_gradient": _check_none_gradient,
    "closure": _check_closure,
    "non_finite_gradient": _check_non_finite_gradient,
    "zero_gradient": _check_zero_gradient,
    "zero_lr": _check_zero_lr,
    "degenerate_shapes": _check_degenerate_shapes,
    "wide": _check_wide,
    "batched": _check_batched,
    "mixed_dtypes": _check_mixed_dtypes,
    "in_place": _check_in_place,
    "bad_lr": _check_bad_lr,
}
