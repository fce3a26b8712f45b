"""What a training run is made of: the device, the model (with its SEL charts), the optimizer
and the learning-rate schedule of a :class:`~models.config.TrainConfig`."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import torch
from torch.nn.utils import parametrize

from manifoldlib.optim.builder import adamw_param_groups

from .config import ConfigError, TrainConfig
from .storage import RunError

__all__ = ["SEL_OPTIONS", "MissingModuleError", "apply_sel", "build_model",
           "build_train_optimizer", "lr_peak_fraction", "lr_scale", "resolve_device",
           "schedule_warnings", "sel_anneal_fraction", "sel_anneal_outlasts_run",
           "warmup_outlasts_run"]

#: SEL variants of ``TrainConfig.sel`` -> keyword options of ``manifoldlib.charts.SEL``.
SEL_OPTIONS = {
    "mismatched": {"init": "mismatched"},
    "congruent": {"init": "congruent"},
    "no-linear": {"linear": False},
}


class MissingModuleError(RunError):
    """A configuration needs a module of the project that does not exist (yet)."""


def _import(module: str, what: str, why: str):
    """``module.what``, or :class:`MissingModuleError` saying that ``why`` needs it."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingModuleError(f"{why} needs {module}.{what}, which is not available yet "
                                 f"({exc})") from None
    if not hasattr(mod, what):
        raise MissingModuleError(f"{why} needs {module}.{what}, which is not available yet")
    return getattr(mod, what)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available, else mps, else cpu; anything else is a torch device."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda[:N]' or 'mps', got {name!r}") \
            from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    return device


def build_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """The reference GPT of ``cfg.model`` with the corpus's ``vocab_size`` (and SEL charts)."""
    gpt_cls = _import("models.gpt", "GPT", "training")
    try:
        gpt_config = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model = gpt_cls(gpt_config)
    if cfg.sel != "none":
        apply_sel(model, cfg.sel, kappa=cfg.sel_kappa)
    return model


def _is_block_linear(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and (".attn." in f".{name}." or
                                                   ".mlp." in f".{name}.")


def apply_sel(model: torch.nn.Module, variant: str, *, kappa: float = 1.0) -> None:
    """Put a SEL chart on every attention and MLP linear map of ``model``, its curvature
    :math:`\\kappa` at each weight's own initial scale."""
    sel = _import("manifoldlib.charts", "SEL", f"sel={variant!r}")
    apply_chart = _import("manifoldlib.charts", "apply_chart", f"sel={variant!r}")
    apply_chart(model, functools.partial(sel, kappa=kappa, **SEL_OPTIONS[variant]),
                include=_is_block_linear)


def build_train_optimizer(model: torch.nn.Module, cfg: TrainConfig, *, world_size: int = 1
                          ) -> tuple[torch.optim.Optimizer, list]:
    """The run's optimizer and one learning-rate multiplier ``mult(step) -> float`` per group.

    ``adamw``: AdamW with weight decay on matrices only (the groups of
    :func:`manifoldlib.optim.builder.adamw_param_groups`); with SEL charts the groups come from
    ``manifoldlib.charts.sel_param_groups`` (scales at ``sel_scale_lr``) and, when
    ``sel_anneal_steps > 0``, the seed's scale annealing multipliers; ``block_lr`` puts the
    attention and MLP matrices (SEL's raw coordinates where charted) in groups of their own at
    that lr, so a chart's coordinates and the plain baseline's matrices can be stepped alike
    apart from the rest. ``manifold-muon``:
    ``manifoldlib.optim.build_optimizer(model, policy=...)``, its Euclidean Newton–Schulz in
    ``cfg.muon_ns_dtype``, its unconstrained matrices decayed by ``cfg.muon_weight_decay`` and
    its constrained ones not (the seed's recipe). The schedule of :func:`lr_scale` multiplies all of them.

    With ``world_size > 1`` ManifoldMuon runs in ``cfg.muon_distributed`` mode (``sharded``:
    each matrix's dual solve and retraction on one rank, results shared by ``all_gather``;
    ``replicated``: every rank solves every matrix). Build it on the unwrapped model, before
    the DDP wrap, so the parameter names carry no ``module.`` prefix.
    """
    if cfg.optimizer == "manifold-muon":
        if cfg.block_lr:
            raise ConfigError(f"block_lr={cfg.block_lr!r} applies to optimizer='adamw'; "
                              f"ManifoldMuon steps the block matrices at lr")
        if cfg.sel != "none":
            raise ConfigError(f"sel={cfg.sel!r} with optimizer='manifold-muon' is not supported: "
                              f"the policy would constrain SEL's raw coordinates; use adamw")
        if cfg.muon_recipe == "reference":
            opt = _reference_optimizer(model, cfg, world_size)
            return opt, [_constant] * len(opt.param_groups)
        builder = _import("manifoldlib.optim", "build_optimizer", "optimizer='manifold-muon'")
        extra = {"distribution": cfg.muon_distributed} if world_size > 1 else {}
        try:
            opt = builder(model, policy=cfg.policy, lr=cfg.lr, adamw_lr=cfg.adamw_lr,
                          adamw_betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.muon_weight_decay,
                          adamw_weight_decay=cfg.weight_decay, ns_dtype=cfg.muon_ns_dtype,
                          manifold_options=_UNDECAYED_MANIFOLDS, **extra)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return opt, [_constant] * len(opt.param_groups)
    if cfg.sel != "none":
        sel_param_groups = _import("manifoldlib.charts", "sel_param_groups", f"sel={cfg.sel!r}")
        groups = sel_param_groups(model, lr=cfg.lr, scale_lr=cfg.sel_scale_lr or cfg.lr,
                                  weight_decay=cfg.weight_decay)
    else:
        groups = adamw_param_groups(
            ((n, p) for n, p in model.named_parameters() if p.requires_grad), cfg.weight_decay)
    if cfg.block_lr:
        groups = _block_matrices_apart(model, groups, cfg.block_lr)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if cfg.sel != "none" and cfg.sel_anneal_steps > 0:
        sel_lr_lambdas = _import("manifoldlib.charts", "sel_lr_lambdas", f"sel={cfg.sel!r}")
        return opt, sel_lr_lambdas(opt, cfg.sel_anneal_steps)
    return opt, [_constant] * len(opt.param_groups)


def _reference_optimizer(model: torch.nn.Module, cfg: TrainConfig, world_size: int) -> torch.optim.Optimizer:
    """``muon_recipe='reference'``: the policy's matrices to
    :class:`~models.reference_muon.ReferenceManifoldMuon` (the paper's code: Euclidean matrices
    decayed by ``muon_weight_decay``, constrained ones not), the rest to AdamW, as one optimizer."""
    from manifoldlib.optim import CombinedOptimizer, assign_parameters

    from .reference_muon import ReferenceManifoldMuon

    if world_size > 1:
        raise ConfigError("muon_recipe='reference' runs in one process (the paper's code solves every matrix on "
                          "every rank); use muon_recipe='library' under torchrun")
    try:
        assignment = assign_parameters(model, cfg.policy)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    named = dict(model.named_parameters())
    groups = []
    for manifold in ("stiefel", "dgram", "oblique", "euclidean"):
        names = [n for n, m in assignment.items() if m == manifold]
        if names:
            decay = cfg.muon_weight_decay if manifold == "euclidean" else 0.0
            groups.append({"params": [named[n] for n in names], "param_names": names, "manifold": manifold,
                           "weight_decay": decay})
    rest = ((n, p) for n, p in model.named_parameters() if p.requires_grad and assignment.get(n) is None)
    optimizers = {"adamw": torch.optim.AdamW(adamw_param_groups(rest, cfg.weight_decay), lr=cfg.adamw_lr,
                                             betas=(cfg.beta1, cfg.beta2))}
    if groups:
        optimizers = {"muon": ReferenceManifoldMuon(groups, lr=cfg.lr), **optimizers}
    return CombinedOptimizer(optimizers)


#: ManifoldMuon groups the trainer never decays: DGram's column norms are the scale freedom the
#: seed leaves uncontrolled (Stiefel and Oblique skip decay by construction).
_UNDECAYED_MANIFOLDS = {"dgram": {"weight_decay": 0.0}}


def _block_matrix(module: torch.nn.Module) -> torch.nn.Parameter:
    """A block linear map's trained matrix: its weight, or a chart's raw coordinates."""
    if parametrize.is_parametrized(module, "weight"):
        return module.parametrizations.weight.original
    return module.weight


def _block_matrices_apart(model: torch.nn.Module, groups: list[dict], block_lr: float
                          ) -> list[dict]:
    """``groups`` with the attention and MLP matrices (:func:`_is_block_linear`; SEL's raw
    coordinates where charted) moved into groups of their own at ``block_lr``, each beside the
    group it came from and with its other settings (decay, ``sel_role``, names)."""
    block = {id(_block_matrix(m)) for name, m in model.named_modules() if _is_block_linear(name, m)}
    out = []
    for group in groups:
        inside = [id(p) in block for p in group["params"]]
        if not any(inside):
            out.append(group)
            continue
        for is_block in (False, True):
            part = {**group, "lr": block_lr} if is_block else {**group}
            for key in ("params", "param_names"):
                if key in group:
                    part[key] = [x for x, b in zip(group[key], inside) if b == is_block]
            if part["params"]:
                out.append(part)
    return out


def _constant(step: int) -> float:
    return 1.0


def lr_scale(step: int, cfg: TrainConfig) -> float:
    r"""Learning-rate multiplier for the update that produces step ``step + 1``.

    With :math:`t` = ``step`` (the run's updates are :math:`t = 0, \dots, S - 1`),
    :math:`S` = ``steps``, :math:`W` = ``warmup_steps`` and :math:`m` = ``min_lr_ratio``:

    - warm-up, :math:`t < W`: :math:`(t + 1) / W`, so that update :math:`W - 1` is the first
      at the peak, 1;
    - after it, ``schedule="constant"``: 1;
    - after it, ``schedule="cosine"``: :math:`m + (1 - m)\,\tfrac12\,(1 + \cos \pi p)` with,
      under ``lr_schedule_version`` 2 and :math:`W' = \max(W, 1)`,

      .. math:: p = \operatorname{clamp}\Big(\frac{t + 1 - W'}{\max(S - W', 1)}, 0, 1\Big)

      The decay takes the :math:`S - W'` updates after the peak, the first of them already
      below it (no two updates at 1 at the seam) and the last, :math:`t = S - 1`, exactly at
      :math:`m` (:math:`p = 1`), non-increasing in between. Without a warm-up (:math:`W = 0`,
      treated as :math:`W = 1`) update 0 is the peak: the run starts at its configured rates.
      Where :math:`S \le W'` the run ends at the peak or before it (:func:`warmup_outlasts_run`
      where :math:`W \ge S`) and nothing decays.

    ``lr_schedule_version`` 1, the formula of runs saved before the field (kept so that they
    resume bit for bit), has :math:`p = \min\big((t - W) / \max(S - W, 1), 1\big)`: update
    :math:`W` repeats the peak, and the last update stays above :math:`m` by
    :math:`(1 - m)\,\tfrac12\,(1 - \cos(\pi / (S - W)))`.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.lr_schedule_version == 1:
        span = max(cfg.steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
    else:
        first = max(cfg.warmup_steps, 1)  # the first update after the peak's (W - 1, or 0)
        progress = min(max(step + 1 - first, 0) / max(cfg.steps - first, 1), 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_peak_fraction(cfg: TrainConfig) -> float:
    """The largest :func:`lr_scale` of the run's ``steps`` updates: 1, or ``steps /
    warmup_steps`` where the warm-up outlasts the run (the last update's)."""
    return min(1.0, cfg.steps / cfg.warmup_steps) if cfg.warmup_steps else 1.0


def warmup_outlasts_run(cfg: TrainConfig) -> str | None:
    """What a warm-up of at least ``steps`` does to the run, or None where it is shorter.

    Such a run warms up for its whole length: every learning rate peaks at the last update at
    ``steps / warmup_steps`` of its value, and ``schedule`` (with ``min_lr_ratio``) never acts.
    It is not refused (a short test run of a long run's configuration is one), but said: the
    trainer warns at the start and ``summary.json`` records the line and the fraction.
    """
    if cfg.warmup_steps < cfg.steps:
        return None
    peak = lr_peak_fraction(cfg)
    unused = f"schedule {cfg.schedule!r}" + (f" and min_lr_ratio {cfg.min_lr_ratio:g} never act"
                                             if cfg.schedule == "cosine" else " never acts")
    return (f"warmup_steps {cfg.warmup_steps} >= steps {cfg.steps}: the learning rate warms up "
            f"for the whole run and peaks at its last step at {cfg.steps}/{cfg.warmup_steps} = "
            f"{peak:.3g} of each configured rate (lr {cfg.lr:g} -> {cfg.lr * peak:.3g}); {unused}; "
            f"give warmup_steps below steps to train at the configured rates")


def sel_anneal_fraction(cfg: TrainConfig) -> float | None:
    """How far through SEL's scale annealing the run's last update is: ``min(1, (steps - 1) /
    sel_anneal_steps)`` (the update that makes step ``t`` reads the ramp at ``t - 1``), 1 where
    the anneal completes, below 1 where ``sel_anneal_steps >= steps``; None where nothing
    anneals (``sel`` none, ``sel_anneal_steps`` 0)."""
    if cfg.sel == "none" or not cfg.sel_anneal_steps:
        return None
    return min(1.0, (cfg.steps - 1) / cfg.sel_anneal_steps)


def sel_anneal_outlasts_run(cfg: TrainConfig) -> str | None:
    """What a SEL scale annealing of at least ``steps`` does to the run, or None where it
    completes (or nothing anneals).

    The ``e_w`` scales' learning rate starts high and the ``m`` multipliers' low, each reaching
    the scale rate at the end of the anneal (:class:`manifoldlib.charts.SELLRMultiplier`); a run
    no longer than the anneal ends with both still on the way, which no loss shows. As for the
    warm-up (:func:`warmup_outlasts_run`), it is not refused but said: the trainer warns at the
    start, ``summary.json`` records the line and :func:`sel_anneal_fraction`.
    """
    done = sel_anneal_fraction(cfg)
    if done is None or cfg.sel_anneal_steps < cfg.steps:
        return None
    multiplier = _import("manifoldlib.charts", "SELLRMultiplier", f"sel={cfg.sel!r}")
    e_w, m = (multiplier(role, cfg.sel_anneal_steps)(cfg.steps - 1) for role in ("e_w", "m"))
    return (f"sel_anneal_steps {cfg.sel_anneal_steps} >= steps {cfg.steps}: SEL's scale annealing "
            f"outlasts the run, whose last update is {cfg.steps - 1}/{cfg.sel_anneal_steps} = "
            f"{done:.3g} of the way through it: the e_w scales' learning rate ends at {e_w:.4g} "
            f"and the m multipliers' at {m:.4g} times the scale rate (1 once annealed); give "
            f"sel_anneal_steps below steps for an annealed run")


def schedule_warnings(cfg: TrainConfig) -> list[str]:
    """The lines the trainer warns at the start and ``summary.json`` records under
    ``warnings``: a warm-up or a SEL anneal that outlasts the run."""
    return [w for w in (warmup_outlasts_run(cfg), sel_anneal_outlasts_run(cfg)) if w is not None]
