"""``build_optimizer``: one optimizer object for a whole model, matrices by policy to Manifold Muon.

:class:`CombinedOptimizer` is a :class:`torch.optim.Optimizer` whose ``param_groups`` are the
union of a :class:`~manifoldlib.optim.ManifoldMuon` and a :class:`torch.optim.AdamW` (the same
dict objects, so LR schedulers and manual ``group["lr"]`` edits reach the inner optimizers), each
group tagged with ``"kind"`` (``"muon"`` or ``"adamw"``) and ``"param_names"``. There is one
``state`` and one ``state_dict``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from .._numbers import is_real
from .options import weight_layout
from .optimizer import MUON_MANIFOLDS, ManifoldMuon, check_state_dict, restore_dual_corrections
from .policies import (
    Classifier,
    Policy,
    HEAD_NAMES,
    RolePolicy,
    _belongs_to_chart,
    _foreign_parametrization,
    get_policy,
    is_hidden_matrix,
    warn_stacked,
    warn_unclassified,
)

__all__ = ["CombinedOptimizer", "adamw_param_groups", "assign_parameters", "build_optimizer", "describe_assignment"]

DEFAULT_ADAMW_BETAS = (0.9, 0.95)
#: Group keys :func:`build_optimizer` sets itself; ``manifold_options`` may not replace them.
_BUILDER_KEYS = ("params", "param_names", "manifold", "layout", "kind")
#: ManifoldMuon group options (not constructor arguments) that ``**muon_kw`` may set for every group.
GROUP_OPTIONS = ("ns_dtype",)


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """Parameter id -> (qualified name, owning module), first occurrence (tied weights once)."""
    return {pid: places[0] for pid, places in _places(model).items()}


def _places(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """Parameter id -> every (qualified name, owning module) it appears under, in module order."""
    found: dict[int, list[tuple[str, nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            place = (f"{module_name}.{pname}" if module_name else pname, module)
            seen = found.setdefault(id(param), [])
            if all(name != place[0] for name, _ in seen):
                seen.append(place)
    return found


def _check_shared(policy, resolved, places: dict, params: dict[int, nn.Parameter],
                  assignment: dict[str, str | None]) -> None:
    """Refuse a parameter shared under several names (tied weights) to which the policy gives
    different manifolds: it is stepped once, under its first name, and the other choice would be
    dropped without a word (a weight tied between an attention and an MLP block under ``hetero``)."""
    for pid, seen in places.items():
        if len(seen) < 2 or pid not in params:
            continue
        first = seen[0][0]
        for name, module in seen[1:]:
            try:
                choice = resolved(name, module, params[pid])
            except Exception as exc:  # a user policy's bug: say which parameter it failed on
                raise ValueError(f"policy {policy!r} raised {type(exc).__name__} on parameter {name!r} "
                                 f"(shared with {first!r}): {exc}") from exc
            if choice != assignment[first]:
                raise ValueError(
                    f"policy {policy!r} gives the parameter shared as {first!r} and {name!r} two "
                    f"optimizers: {assignment[first] or 'AdamW'!r} under the first name and "
                    f"{choice or 'AdamW'!r} under the second; a tied weight is stepped once, on one "
                    f"manifold: make the policy give both names the same answer (or untie them)"
                )


def assign_parameters(
    model: nn.Module, policy: str | Policy = "hetero", *, classifier: Classifier | None = None
) -> dict[str, str | None]:
    """Apply a policy: qualified parameter name -> manifold name, or ``None`` for AdamW.

    Raises:
        ValueError: unknown policy, a policy returning an unknown manifold, a non-matrix
            parameter assigned to Manifold Muon, or a parameter shared under several names (a tied
            weight) that the policy sends to different optimizers (the message names the
            parameter and the values).
    """
    resolved = get_policy(policy, classifier=classifier)
    places = _places(model)
    owners = {pid: seen[0] for pid, seen in places.items()}
    assignment: dict[str, str | None] = {}
    for name, param in model.named_parameters():
        qualified, module = owners[id(param)]
        if not param.requires_grad:
            continue
        try:
            choice = resolved(qualified, module, param)
        except Exception as exc:  # a user policy's bug: say which parameter it failed on
            raise ValueError(
                f"policy {policy!r} raised {type(exc).__name__} on parameter {qualified!r} of shape "
                f"{tuple(param.shape)}: {exc}"
            ) from exc
        if choice is not None and choice not in MUON_MANIFOLDS:
            raise ValueError(
                f"policy {policy!r} assigned parameter {qualified!r} to unknown manifold {choice!r}; "
                f"valid: {', '.join(MUON_MANIFOLDS)} or None (AdamW)"
            )
        if choice is not None and param.dim() != 2:
            raise ValueError(
                f"policy {policy!r} assigned parameter {qualified!r} of shape {tuple(param.shape)} to "
                f"{choice!r}; Manifold Muon takes 2-D matrices only (return None for AdamW)"
            )
        assignment[qualified] = choice
    _check_shared(policy, resolved, places, {id(p): p for p in model.parameters() if p.requires_grad}, assignment)
    # one warning naming every hidden matrix the role policy sent to its fallback, one naming the
    # stacked (e.g. expert) matrices of attention/MLP blocks that Manifold Muon cannot take
    named = [(*owners[id(p)], p) for p in model.parameters() if p.requires_grad]
    warn_unclassified(resolved, named)
    warn_stacked(resolved, named)
    _warn_parametrized(policy, resolved, named, assignment)
    return assignment


def _warn_parametrized(policy, resolved: Policy, named, assignment: dict[str, str | None]) -> None:
    """Warn about the raw tensors of a foreign ``torch.nn.utils.parametrize`` parametrization (not a
    chart, not split blocks; :func:`~manifoldlib.optim.policies.is_hidden_matrix`): once naming those
    a policy put on a manifold (the constraint holds for them, not for the weight the model uses),
    once naming those a role policy sent to AdamW where it constrains the plain weight."""
    constrained, to_adamw = [], []
    for name, module, param in named:
        kinds = _foreign_parametrization(module)
        if not kinds or param.dim() != 2:
            continue
        label = f"{name} ({', '.join(kinds)})"
        if assignment.get(name) is not None:
            constrained.append(label)
        elif isinstance(resolved, RolePolicy) and not any(p in HEAD_NAMES for p in name.split(".")[:-1]) \
                and {"attn": resolved.attn, "mlp": resolved.mlp}.get(resolved.classifier(name, module),
                                                                     resolved.other) is not None:
            to_adamw.append(label)
    import warnings

    remove = ("torch.nn.utils.parametrize.remove_parametrizations(module, name, leave_parametrized=True) "
              "before building the optimizer")
    if constrained:
        warnings.warn(
            f"policy {policy!r} put {len(constrained)} raw parametrization tensors on a manifold: "
            f"{', '.join(constrained)}. The model uses the parametrized weight, not these tensors, so the "
            f"constraint does not hold for it; return None (AdamW) for them, or call {remove}",
            UserWarning, stacklevel=3)
    if to_adamw:
        warnings.warn(
            f"{len(to_adamw)} parametrized matrices go to AdamW: {', '.join(to_adamw)}. "
            f"torch.nn.utils.parametrize hands the optimizer these raw tensors, not the weight the model "
            f"uses, so policy {policy!r} cannot constrain those weights; to constrain them call {remove}",
            UserWarning, stacklevel=3)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers behind one :class:`torch.optim.Optimizer` interface.

    Args:
        optimizers: ``{kind: optimizer}``; parameter sets must be disjoint.

    ``step(closure)`` evaluates the closure once, then steps every inner optimizer.
    ``load_state_dict`` re-links the inner optimizers to the loaded groups and state;
    ``add_param_group`` hands a group to the inner optimizer its ``"kind"`` names.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)
        groups = []
        for kind, opt in self.optimizers.items():
            for group in opt.param_groups:
                group["kind"] = kind
                groups.append(group)  # the same dict object: edits reach the inner optimizer
        super().__init__(groups, {})
        self._link()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer its ``"kind"`` names (``"muon"``, ``"adamw"``, ...).

        That optimizer fills in its defaults and validates the group (:class:`ManifoldMuon`
        also projects it); the group is the same dict object in both, as at construction.

        Raises:
            ValueError: for a missing or unknown ``"kind"``, or whatever the inner optimizer
                refuses; the group is then not added anywhere.
        """
        if any(param_group is g for opt in self.optimizers.values() for g in opt.param_groups):
            super().add_param_group(param_group)  # the constructor: a group of an inner optimizer
            return
        kind = param_group.get("kind")
        if kind not in self.optimizers:
            raise ValueError(
                f"a CombinedOptimizer parameter group needs 'kind' set to one of "
                f"{', '.join(self.optimizers)}, got {kind!r}"
            )
        super().add_param_group(param_group)  # params disjoint from every group, names or none
        inner = self.optimizers[kind]
        try:
            inner.add_param_group(param_group)
        except Exception:
            self.param_groups.pop()
            inner.param_groups[:] = [g for g in inner.param_groups if g is not param_group]
            raise
        self._link(self.state)

    def _link(self, shared: defaultdict | None = None) -> None:
        if shared is None:
            shared = defaultdict(dict)
            for opt in self.optimizers.values():
                shared.update(opt.state)
        self.state = shared
        for kind, opt in self.optimizers.items():
            opt.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            opt.state = shared

    @torch.no_grad()
    def step(self, closure=None):
        """Step every inner optimizer (the closure runs once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def consolidate_state_dict(self) -> None:
        """Call ``consolidate_state_dict()`` of every inner optimizer that has one.

        A collective under ``ManifoldMuon(distribution="sharded")``: every rank calls it before
        rank 0 saves :meth:`state_dict`; a no-op otherwise.
        """
        for opt in self.optimizers.values():
            consolidate = getattr(opt, "consolidate_state_dict", None)
            if consolidate is not None:
                consolidate()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load after :func:`~manifoldlib.optim.optimizer.check_state_dict` (the Manifold Muon
        groups must match: manifold, retraction, layout, shapes and dtypes)."""
        check_state_dict(self, state_dict)
        super().load_state_dict(state_dict)
        restore_dual_corrections(self, state_dict)  # in their saved dtype, not the parameters'
        self._link(self.state)  # the loaded state is the shared one

    def __repr__(self) -> str:
        inner = ", ".join(f"{kind}: {type(opt).__name__}" for kind, opt in self.optimizers.items())
        return f"CombinedOptimizer({inner}; {len(self.param_groups)} groups)"


def _check_arguments(*, lr, adamw_lr, weight_decay, adamw_betas, adamw_weight_decay) -> None:
    """Refuse bad numbers at the door, naming the argument (not torch's inner parameter name)."""
    for name, value in (("lr", lr), ("adamw_lr", adamw_lr)):
        if not is_real(value) or not math.isfinite(value) \
                or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    for name, value in (("weight_decay", weight_decay), ("adamw_weight_decay", adamw_weight_decay)):
        if value is None and name == "adamw_weight_decay":
            continue
        if not is_real(value) or not math.isfinite(value) \
                or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    betas = tuple(adamw_betas) if isinstance(adamw_betas, (tuple, list)) else None
    if betas is None or len(betas) != 2 or not all(
        is_real(b) and 0.0 <= b < 1.0 for b in betas
    ):
        raise ValueError(f"adamw_betas must be two numbers in [0, 1), got {adamw_betas!r}")


def adamw_param_groups(named_params, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: matrices (``dim >= 2``: embeddings, heads, linear maps) decayed by
    ``weight_decay``, everything else (gains, biases, scalar steps) not decayed.

    Args:
        named_params: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``.
        weight_decay: decay of the matrix group.

    Returns:
        Up to two groups ``{"params", "param_names", "weight_decay"}``, decayed first; an empty
        one is left out.
    """
    decay, no_decay = [], []
    for name, param in named_params:
        (decay if param.dim() >= 2 else no_decay).append((name, param))
    return [
        {"params": [p for _, p in items], "param_names": [n for n, _ in items], "weight_decay": wd}
        for items, wd in ((decay, weight_decay), (no_decay, 0.0))
        if items
    ]


def build_optimizer(
    model: nn.Module,
    policy: str | Policy = "hetero",
    lr: float = 0.02,
    adamw_lr: float = 3e-3,
    weight_decay: float = 0.0,
    adamw_betas: tuple[float, float] = DEFAULT_ADAMW_BETAS,
    *,
    adamw_weight_decay: float | None = None,
    classifier: Classifier | None = None,
    manifold_options: dict[str, dict[str, Any]] | None = None,
    verbose: bool = False,
    **muon_kw: Any,
) -> CombinedOptimizer:
    """One optimizer for ``model``: Manifold Muon for the policy's matrices, AdamW for the rest.

    Muon groups: one per manifold and storage layout in use (``"manifold"`` and ``"layout"``
    set; a Hugging Face ``Conv1D`` stores ``(in, out)``, :func:`~manifoldlib.optim.options.weight_layout`,
    so its matrices get the constraint of the equivalent ``nn.Linear``). AdamW groups: matrices
    (embeddings, head) with ``adamw_weight_decay`` and vectors (gains, biases) without decay.

    Args:
        model: the model; tied parameters are counted once, and frozen ones
            (``requires_grad=False``) are left out, as :func:`torch.optim` users expect (unfreeze
            a parameter before building the optimizer, or add it later with
            ``add_param_group``).
        policy: a registered policy name or a callable ``(name, module, param) -> str | None``.
        lr: Manifold Muon learning rate.
        adamw_lr: AdamW learning rate.
        weight_decay: Manifold Muon weight decay (skipped on Stiefel, see ManifoldMuon).
        adamw_betas: AdamW betas.
        adamw_weight_decay: decay of AdamW matrices (default: ``weight_decay``).
        classifier: ``(name, module) -> "attn" | "mlp" | "other" | None`` for a model that does
            not follow the ``attn`` / ``mlp`` naming rule (built-in policies only).
        verbose: print :func:`describe_assignment`'s table (which matrix went where, and why).
        manifold_options: per-manifold ManifoldMuon group options, e.g.
            ``{"dgram": {"retraction": "colnorm-polar"}}``; not ``params``, ``param_names``,
            ``manifold``, ``layout`` or ``kind``, which the policy and the modules decide.
        **muon_kw: further ManifoldMuon arguments for every Muon group (``momentum``, ``ns_steps``,
            ``dual={"tol": ...}``, ``distribution="sharded"``, ...) and the group options
            ``ns_dtype``. Build the optimizer on the unwrapped model, before wrapping it in DDP.

    Returns:
        A :class:`CombinedOptimizer`.
    """
    _check_arguments(lr=lr, adamw_lr=adamw_lr, weight_decay=weight_decay, adamw_betas=adamw_betas,
                     adamw_weight_decay=adamw_weight_decay)
    # plain floats: a NumPy scalar in a group makes state_dict() unloadable with weights_only=True
    lr, adamw_lr, weight_decay = float(lr), float(adamw_lr), float(weight_decay)
    adamw_weight_decay = None if adamw_weight_decay is None else float(adamw_weight_decay)
    adamw_betas = tuple(float(b) for b in adamw_betas)
    manifold_options = dict(manifold_options or {})
    for key, options in manifold_options.items():
        if key not in MUON_MANIFOLDS:
            raise ValueError(f"manifold_options has unknown manifold {key!r}; valid: {', '.join(MUON_MANIFOLDS)}")
        if not isinstance(options, dict):
            raise ValueError(f"manifold_options[{key!r}] must be a dict of ManifoldMuon group options, "
                             f"got {options!r}")
        reserved = sorted(set(options) & set(_BUILDER_KEYS))
        if reserved:
            raise ValueError(
                f"manifold_options[{key!r}] may not set {', '.join(map(repr, reserved))}: the policy "
                f"decides which parameters a group holds and its manifold "
                f"(reserved: {', '.join(_BUILDER_KEYS)})"
            )
    if "manifold" in muon_kw:
        raise ValueError("pass manifolds through the policy, not manifold=...")
    if "layout" in muon_kw:
        raise ValueError("the layout of each matrix is read from its module (weight_layout), not layout=...")
    assignment = assign_parameters(model, policy, classifier=classifier)
    if verbose:
        print(describe_assignment(model, policy, classifier=classifier))
    _warn_charted(model, policy, assignment)
    params = {name: p for name, p in model.named_parameters()}
    owners = _owners(model)
    by_manifold: dict[tuple[str, str], list[str]] = {}  # (manifold, layout) -> names
    for name, choice in assignment.items():
        if choice is not None:
            layout = weight_layout(owners[id(params[name])][1])
            by_manifold.setdefault((choice, layout), []).append(name)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if by_manifold:
        groups = [
            {
                "params": [params[n] for n in names],
                "param_names": list(names),
                "manifold": manifold,
                "layout": layout,
                **manifold_options.get(manifold, {}),
            }
            for (manifold, layout), names in by_manifold.items()
        ]
        group_options = {key: muon_kw.pop(key) for key in GROUP_OPTIONS if key in muon_kw}
        for group in groups:
            group.update({k: v for k, v in group_options.items() if k not in group})
        optimizers["muon"] = ManifoldMuon(groups, lr=lr, weight_decay=weight_decay, **muon_kw)
    adamw_groups = adamw_param_groups(
        [(n, params[n]) for n, choice in assignment.items() if choice is None],
        weight_decay if adamw_weight_decay is None else adamw_weight_decay,
    )
    if adamw_groups:
        optimizers["adamw"] = torch.optim.AdamW(adamw_groups, lr=adamw_lr, betas=tuple(adamw_betas))
    return CombinedOptimizer(optimizers)


def _reason(policy: Policy, name: str, module: nn.Module, param: torch.Tensor) -> str:
    """Why ``policy`` sent a parameter where it did (a role policy's reading of the parameter)."""
    if not isinstance(policy, RolePolicy):
        return f"policy {getattr(policy, '__name__', type(policy).__name__)}"
    if param.dim() != 2:
        return "not a matrix"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    if _belongs_to_chart(module):
        return "chart coordinates (Euclidean)"
    if _foreign_parametrization(module):
        return "parametrization tensor (Euclidean)"
    if not is_hidden_matrix(name, module, param):
        return "output head"
    role = policy.classifier(name, module)
    return {"attn": "attention", "mlp": "MLP", "other": "other hidden matrix"}.get(role, "unrecognized: fallback")


def describe_assignment(model: nn.Module, policy: str | Policy = "hetero", *,
                        classifier: Classifier | None = None) -> str:
    """A table of every trainable parameter: name, shape, storage layout, where it goes (a manifold
    of :class:`ManifoldMuon`, or AdamW) and why — the first thing to check on a new model.

    Returns:
        The table as text (``build_optimizer(..., verbose=True)`` prints it).
    """
    resolved = get_policy(policy, classifier=classifier)
    assignment = assign_parameters(model, policy, classifier=classifier)
    owners = _owners(model)
    rows = [("parameter", "shape", "layout", "optimizer", "why")]
    for name, choice in assignment.items():
        param = dict(model.named_parameters())[name]
        module = owners[id(param)][1]
        layout = weight_layout(module) if param.dim() == 2 else "-"
        rows.append((name, "x".join(map(str, param.shape)) or "scalar", layout, choice or "AdamW",
                     _reason(resolved, name, module, param)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    counts = {}
    for choice in assignment.values():
        counts[choice or "AdamW"] = counts.get(choice or "AdamW", 0) + 1
    summary = ", ".join(f"{k}: {v}" for k, v in counts.items())
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:], f"({summary})"])


def _warn_charted(model: nn.Module, policy, assignment: dict[str, str | None]) -> None:
    """One warning when the policy constrains matrices but charted ones (SEL) go to AdamW."""
    owners = _owners(model)
    params = dict(model.named_parameters())
    charted = [n for n, choice in assignment.items()
               if choice is None and params[n].dim() == 2 and _belongs_to_chart(owners[id(params[n])][1])]
    if charted:
        import warnings

        weights = sorted({name.split(".parametrizations.")[0] for name in charted})  # the charted tensors
        warnings.warn(
            f"{len(weights)} charted matrices (e.g. {weights[0]!r}) go to AdamW: a chart's raw coordinates "
            f"are Euclidean coordinates of a curved map, not points of a matrix manifold, so policy "
            f"{policy!r} cannot constrain them; merge the charts (manifoldlib.charts.merge_charts) before "
            f"building a constrained optimizer, or use AdamW for the charted model", stacklevel=3)
