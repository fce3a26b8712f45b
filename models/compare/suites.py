"""The comparison suites (:data:`SUITES`): the shared base configurations, each suite's arms,
baseline and sweep, and :func:`narrow_suite` (``--arms``, ``--sweep``, ``--tune_seeds``,
``--tuning_seeds``)."""

from __future__ import annotations

import dataclasses

from ..config import ConfigError
from ..train import _import

__all__ = [
    "FULL_BASE",
    "MANIFOLD_POLICIES",
    "QUICK_BASE",
    "REFERENCE_POLICIES",
    "RETRACTION_ALPHA_INIT",
    "SUITES",
    "TUNING_SEEDS",
    "Suite",
    "check_requirements",
    "narrow_suite",
]


#: Shared settings of every full suite: byte-level stdlib, a small 4-layer model.
FULL_BASE = {"corpus": "stdlib", "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 64,
             "batch_size": 16, "steps": 300, "warmup_steps": 20, "lr": 3e-3, "adamw_lr": 3e-3,
             "eval_interval": 25, "eval_batches": 4, "log_interval": 25, "sample_tokens": 0,
             "checkpoint": False, "progress": False, "threads": 1}
#: ``--quick``: the synthetic corpus and a tiny model, a few seconds per run.
QUICK_BASE = {"corpus": "synthetic:60000", "block_size": 32, "n_layer": 2, "n_head": 2,
              "n_embd": 32, "batch_size": 8, "steps": 30, "warmup_steps": 5, "lr": 1e-2,
              "adamw_lr": 1e-2, "eval_interval": 10, "eval_batches": 2, "log_interval": 10,
              "sample_tokens": 0, "checkpoint": False, "progress": False, "threads": 1}


@dataclasses.dataclass(frozen=True)
class Suite:
    """One comparison: arms (name, config overrides), the baseline arm, what it needs.

    Attributes:
        name: suite name (``--suite``).
        arms: ``[(arm name, overrides of the base config)]`` in report order.
        baseline: arm whose mean final validation loss is the target.
        requires: ``[(module, attribute)]`` that must exist before anything runs.
        full: base overrides of the full suite (on top of :data:`FULL_BASE`).
        quick: base overrides of ``--quick`` (on top of :data:`QUICK_BASE`).
        seeds: default seeds of the full suite (``--quick`` uses the first one).
        sweep: ``(config key, values)`` swept per arm on the tuning seeds; each
            arm's remaining seeds run at its best value (lowest mean final validation loss over
            the tuning seeds; a value with a diverged run ranks after every value without one,
            fewer diverged runs first),
            so arms are compared each at its own tuned setting. ``()``: no sweep.
        quick_sweep: the values of the sweep under ``--quick`` (tuned on its one seed).
        tune_seeds: without ``tuning_seeds``: how many of the first seeds the sweep runs on.
            One seed is cheap but can pick a value for an outlier seed; all of them (the whole
            grid) selects on the seeds it reports, a small winner's-curse bias towards the
            best-looking value.
        tuning_seeds: held-out tuning: the sweep runs on these seeds (none of ``seeds``), and
            every arm then runs at its best value on ``seeds``, which alone are reported; the
            reports name both sets. ``()``: the sweep runs on the first ``tune_seeds`` seeds.
        quick_tuning_seeds: the held-out tuning seeds under ``--quick``; ``None``: the first of
            ``tuning_seeds``. Seeds given by name (:func:`narrow_suite`) set both, so that an
            explicit ``--tuning_seeds`` is run as given under ``--quick`` too.
    """

    name: str
    arms: tuple[tuple[str, dict], ...]
    baseline: str
    requires: tuple[tuple[str, str], ...] = ()
    full: dict = dataclasses.field(default_factory=dict)
    quick: dict = dataclasses.field(default_factory=dict)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    sweep: tuple = ()
    quick_sweep: tuple = ()
    tune_seeds: int = 1
    tuning_seeds: tuple[int, ...] = ()
    quick_tuning_seeds: tuple[int, ...] | None = None


#: The tuning seeds of the swept suites: disjoint from every reported seed (0-9).
TUNING_SEEDS = (100, 101, 102)


def _spheret_arms() -> tuple[tuple[str, dict], ...]:
    arms: list[tuple[str, dict]] = [
        (name, {"connection": name}) for name in ("pre-ln", "post-ln", "peri-ln", "pre-dyt", "keel",
                                                  "geonorm")]
    arms += [(f"spheret-p{p:g}", {"connection": "spheret", "retraction": "p", "p": p})
             for p in (1.0, 2.0)]
    arms += [("spheret-p1-literal", {"connection": "spheret", "retraction": "p", "p": 1.0,
                                     "sphere_step": "literal", "alpha_init": 1.0})]
    return tuple(arms)


#: The literal step's initial ``alpha_l`` in the retraction suite: at GPT-2's init the sub-layer
#: outputs are small, and ``alpha_l = 100`` starts the angles at 0.17-0.64 rad (the default
#: ``FULL_BASE`` model, layer by layer), where the members' angles
#: :math:`p\arctan(\beta/p)` and :math:`\beta` differ by 1-10 %; at ``alpha_l = 1`` they start at
#: 0.001-0.006 rad, where no retraction can differ from another.
RETRACTION_ALPHA_INIT = 100.0


def _retraction_arms() -> tuple[tuple[str, dict], ...]:
    """The literal step (the angle varies per token, so the retraction's shape can act) for the
    exponential map (GeoNorm, the baseline), Cayley (p = 2) and gnomonic (p = 1)."""
    literal = {"sphere_step": "literal", "alpha_init": RETRACTION_ALPHA_INIT}
    return (("geonorm-literal", {"connection": "geonorm", **literal}),
            ("spheret-p2-literal", {"connection": "spheret", "retraction": "p", "p": 2.0, **literal}),
            ("spheret-p1-literal", {"connection": "spheret", "retraction": "p", "p": 1.0, **literal}))


def _stress_arms() -> tuple[tuple[str, dict], ...]:
    stress = {"lr": 3e-2, "warmup_steps": 0, "grad_clip": 0.0}
    return tuple((f"{name} @stress", {**cfg, **stress}) for name, cfg in _spheret_arms()
                 if name in ("pre-ln", "post-ln", "keel", "geonorm", "spheret-p1", "spheret-p2",
                             "spheret-p1-literal"))


#: The p of the p-family suite: 0.5 below gnomonic, 1 (gnomonic), 1.5, 2 (Cayley), 4, inf (the
#: exponential map).
P_VALUES = (0.5, 1.0, 1.5, 2.0, 4.0, float("inf"))
#: The two step forms and their initial alpha: the seed's literal step at its alpha 1, the
#: library's normalized step at 0.5.
STEP_FORMS = (("literal", 1.0), ("normalized", 0.5))


def _p_arms() -> tuple[tuple[str, dict], ...]:
    """Every p of :data:`P_VALUES` under both step forms (``spheret-p<p>-<form>``)."""
    return tuple((f"spheret-p{p:g}-{form}", {"connection": "spheret", "retraction": "p", "p": p,
                                            "sphere_step": form, "alpha_init": alpha})
                 for form, alpha in STEP_FORMS for p in P_VALUES)


def _ablation_arms() -> tuple[tuple[str, dict], ...]:
    """1-SpheretNorm in both step forms, whole and without each of: the depth damping
    :math:`1/\\sqrt l`, the learnable step :math:`\\alpha_l`, the learnable radius."""
    arms = []
    for form, alpha in STEP_FORMS:
        base = {"connection": "spheret", "retraction": "p", "p": 1.0, "sphere_step": form, "alpha_init": alpha}
        arms += [(f"spheret-p1-{form}", base),
                 (f"spheret-p1-{form} no-damping", {**base, "damping": "none"}),
                 (f"spheret-p1-{form} fixed-alpha", {**base, "learn_alpha": False}),
                 (f"spheret-p1-{form} fixed-radius", {**base, "learn_radius": False})]
    return tuple(arms)


#: ManifoldMuon policies of the manifolds suite, baseline first.
MANIFOLD_POLICIES = ("unconstrained", "all-stiefel", "all-dgram", "hetero", "hetero-inv")
#: Policies also run with the paper's public code (``muon_recipe="reference"``: its inexact
#: 20-step dual and its DGram map), beside the library's exact solve.
REFERENCE_POLICIES = ("all-dgram", "hetero", "hetero-inv")


def _manifolds_suite(name: str, *, lr: float | None = None, **options) -> Suite:
    """The ManifoldMuon policies on a 2-layer Pre-LN GPT at a constant lr (``lr``, or swept)."""
    fixed = {} if lr is None else {"lr": lr}
    return Suite(
        name=name,
        arms=tuple((policy, {"optimizer": "manifold-muon", "policy": policy})
                   for policy in MANIFOLD_POLICIES)
        + tuple((f"{policy}-reference", {"optimizer": "manifold-muon", "policy": policy, "muon_recipe": "reference"})
                for policy in REFERENCE_POLICIES),
        baseline="unconstrained", requires=(("manifoldlib.optim", "build_optimizer"),),
        full={"connection": "pre-ln", "schedule": "constant", "adamw_lr": 3e-3, "n_layer": 2,
              "steps": 200, "warmup_steps": 10, "eval_interval": 20, "log_interval": 20, **fixed},
        quick={"connection": "pre-ln", "schedule": "constant", "adamw_lr": 1e-2, **fixed},
        **options)


#: Shorter schedules of the SEL suites' extra baseline arms, as fractions of the full schedule's
#: steps (300 in the full suite: 150, 200 and 250 steps).
SEL_SHORT_SCHEDULES = (("1/2", 1 / 2), ("2/3", 2 / 3), ("5/6", 5 / 6))


def _sel_suite(name: str, key: str, **full) -> Suite:
    """SEL's variants against the AdamW baseline, ``key`` (``lr`` or ``block_lr``) swept per arm
    on all five seeds."""
    return Suite(
        name=name,
        arms=(("baseline", {"sel": "none"}),
              # the baseline on shorter cosine schedules: a shorter schedule may reach the full
              # one's final loss (the target) sooner than the full one does
              *((f"baseline {name} schedule", {"sel": "none", "schedule_fraction": f}) for name, f in SEL_SHORT_SCHEDULES),
              ("sel-mismatched", {"sel": "mismatched"}),
              ("sel-congruent", {"sel": "congruent"}), ("sel-no-linear", {"sel": "no-linear"}),
              ("sel-mismatched-no-anneal", {"sel": "mismatched", "sel_anneal_steps": 0})),
        baseline="baseline",
        requires=(("manifoldlib.charts", "SEL"), ("manifoldlib.charts", "apply_chart")),
        full={"connection": "pre-ln", "sel_anneal_steps": 100, **full},
        quick={"connection": "pre-ln", "sel_anneal_steps": 10},
        sweep=(key, (0.0003, 0.001, 0.003, 0.01)), quick_sweep=(key, (0.003, 0.01)),
        tuning_seeds=TUNING_SEEDS)


#: The comparison suites by ``--suite`` name.
SUITES: dict[str, Suite] = {
    # hidden-state connections, 5 seeds each, on the whole AdamW lr grid: the seed's protocol
    # (one shared lr, 3e-3) is the grid's column, and each arm is also reported at its own best
    "spheret": Suite(name="spheret", arms=_spheret_arms(), baseline="pre-ln",
                     sweep=("lr", (0.001, 0.003, 0.01, 0.03)), quick_sweep=("lr", (0.01, 0.03)),
                     tuning_seeds=TUNING_SEEDS),
    # the seed's stability claim: Pre-LN / Keel diverge at a high lr where SpheretNorms converge;
    # evaluated every 5 steps, so that a blow-up within the first few steps (which the final
    # loss hides once the run recovers) shows in val_rise_max
    # seed 000's "p = 1 is the best finite p": the whole p-family under both step forms, each at its
    # own lr tuned on held-out seeds; the paper's own arm (p = 1, literal) is the baseline
    "spheret-p": Suite(name="spheret-p", arms=_p_arms(), baseline="spheret-p1-literal",
                       sweep=("lr", (0.001, 0.003, 0.01, 0.03)), quick_sweep=("lr", (0.01, 0.03)),
                       tuning_seeds=TUNING_SEEDS),
    # seed 000's three design choices, each removed from 1-SpheretNorm in both step forms
    "spheret-ablations": Suite(name="spheret-ablations", arms=_ablation_arms(), baseline="spheret-p1-literal",
                               sweep=("lr", (0.001, 0.003, 0.01, 0.03)), quick_sweep=("lr", (0.01, 0.03)),
                               tuning_seeds=TUNING_SEEDS),
    "spheret-stress": Suite(name="spheret-stress", arms=_stress_arms(), baseline="pre-ln @stress",
                            seeds=(0, 1, 2), full={"eval_interval": 5, "log_interval": 5}),
    # seed 000's "finite p beats the exponential map" where it can show: the literal step, whose
    # angle varies per token, started at angles where the members differ (the normalized step
    # makes them reparametrizations of one per-layer angle)
    "spheret-retractions": Suite(name="spheret-retractions", arms=_retraction_arms(),
                                 baseline="geonorm-literal",
                                 sweep=("lr", (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03,
                                                0.1, 0.3, 1.0)),
                                 quick_sweep=("lr", (0.01, 0.03)), tuning_seeds=TUNING_SEEDS),
    # seed 002 on its own base (a Pre-LN GPT), a constant lr whose budget lets singular values
    # grow far past 1 (sum of lr_t = 200 * lr), and a per-arm lr sweep on three seeds: each
    # policy is reported at its own best lr, so no arm is compared at a step size that suits
    # only another (three seeds: the square DGram solves make the whole grid ~1 h on a CPU)
    "manifolds": _manifolds_suite("manifolds", seeds=(0, 1, 2, 3, 4),
                                  sweep=("lr", (0.001, 0.003, 0.01, 0.03, 0.1)),
                                  quick_sweep=("lr", (0.02, 0.1)), tuning_seeds=TUNING_SEEDS),
    # the same at one large constant lr (sum of lr_t = 20): the regime where the seed's DGram
    # mechanism (singular values -> attention logits -> saturated softmax) can act
    "manifolds-high-lr": _manifolds_suite("manifolds-high-lr", lr=0.1, seeds=(0, 1, 2)),
    # seed 004: SEL on every block linear map, curvature calibrated from the weights' own
    # init scale, the seed's scale-lr annealing on (first third of the run; one arm without it),
    # and the block matrices' lr (``block_lr``: a chart's raw coordinates, the baseline's plain
    # matrices) swept per arm with everything else at 3e-3, the arms' best shared lr: at one
    # shared lr an Adam step of the raw coordinates changes a weight by a factor of about
    # e^(b lr), tied to its init scale (16-52 % per step at 3e-3), which no other parameter
    # shares. Tuned on all five seeds
    "sel": _sel_suite("sel", "block_lr", lr=3e-3),
    # the seed's protocol: one lr for every parameter, swept per arm
    "sel-shared-lr": _sel_suite("sel-shared-lr", "lr"),
}


def narrow_suite(suite: Suite, *, arms: tuple[str, ...] | None = None,
                 sweep: tuple[float, ...] | None = None, tune_seeds: int | None = None,
                 tuning_seeds: tuple[int, ...] | None = None) -> Suite:
    """``suite`` with only ``arms`` (kept in the suite's order), the swept key's values replaced
    by ``sweep`` (under ``--quick`` too), the sweep run on held-out ``tuning_seeds`` (all of
    them, under ``--quick`` too) or else on the first ``tune_seeds`` reported seeds (which drops the suite's held-out tuning seeds);
    ``None`` keeps the suite's. The baseline may be left out: its columns then read "—".

    Raises:
        ConfigError: an arm the suite does not have (the message lists its arms), a repeated
            arm, ``sweep`` for a suite without a sweep, an empty or repeated ``sweep``, a
            ``tune_seeds`` that is not an integer >= 1, both ``tune_seeds`` and
            ``tuning_seeds``, or repeated ``tuning_seeds``.
    """
    names = [name for name, _ in suite.arms]
    if arms is not None:
        unknown = [a for a in arms if a not in names]
        if unknown or not arms or len(set(arms)) != len(arms):
            what = f"unknown {unknown!r}" if unknown else f"{list(arms)!r}"
            raise ConfigError(f"suite {suite.name!r}: --arms {what}; give each of its arms at "
                              f"most once: {', '.join(names)}")
        suite = dataclasses.replace(suite, arms=tuple(a for a in suite.arms if a[0] in arms))
    if sweep is not None:
        if not suite.sweep:
            raise ConfigError(f"suite {suite.name!r} sweeps nothing; --sweep is refused")
        if not sweep or len(set(sweep)) != len(sweep):
            raise ConfigError(f"--sweep needs distinct values of {suite.sweep[0]!r}, got "
                              f"{list(sweep)!r}")
        values = tuple(sweep)
        suite = dataclasses.replace(suite, sweep=(suite.sweep[0], values),
                                    quick_sweep=(suite.sweep[0], values))
    if tune_seeds is not None:
        if isinstance(tune_seeds, bool) or not isinstance(tune_seeds, int) or tune_seeds < 1:
            raise ConfigError(f"--tune_seeds must be an integer >= 1, got {tune_seeds!r}")
        suite = dataclasses.replace(suite, tune_seeds=tune_seeds, tuning_seeds=(),
                                    quick_tuning_seeds=None)
    if tuning_seeds is not None:
        if tune_seeds is not None:
            raise ConfigError("give --tune_seeds (tune on the first reported seeds) or --tuning_seeds (tune on "
                              "held-out seeds), not both")
        if not tuning_seeds or len(set(tuning_seeds)) != len(tuning_seeds):
            raise ConfigError(f"--tuning_seeds needs distinct seeds, got {list(tuning_seeds)!r}")
        # as --sweep: seeds given by name are the ones run, under --quick too
        suite = dataclasses.replace(suite, tuning_seeds=tuple(tuning_seeds),
                                    quick_tuning_seeds=tuple(tuning_seeds))
    return suite


def check_requirements(suite: Suite) -> None:
    """Raise :class:`~models.train.MissingModuleError` naming the first missing module."""
    for module, attr in suite.requires:
        _import(module, attr, f"suite {suite.name!r}")
