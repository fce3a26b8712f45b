"""Comparison suites: ``python -m models.compare --suite NAME [--quick] [--out DIR]
[--seeds 0 1 2 3 4] [--jobs N] [--arms ARM ...] [--sweep V ...] [--tuning_seeds S ...] [--tune_seeds N]
[--key value ...]``.

Each suite trains the reference GPT several times — a set of *arms* (configurations) times a
set of seeds — with :func:`models.train.run_training`, one run directory per arm and seed
(``--jobs N`` trains N at a time, one process each), and writes to ``--out``. ``--key value``
overrides the config of every run, arm settings and the swept value included; one that would
make two arms (or two swept values) the same configuration, or that no arm reads
(:func:`models.config.inert_settings`; one that some arms read is kept), is refused before
anything runs, and so is ``--stop_at`` (every run is trained to its ``steps``: a truncated run
would be reported as a finished one; ``--steps N`` gives shorter runs).
Finished runs of the same config already in ``--out`` are reused, whatever code made them: use
a fresh ``--out`` after a change of the code; not a summary of another length beside the config
(a finished run's ``steps`` must be the config's, a diverged run's at most those). A run on data that changed since (its
``corpus.json`` fingerprint is not the corpus's now: a ``file:`` corpus rewritten, shards
prepared again into their folder, ``stdlib`` of another Python) is trained again.

A follow-up of one suite narrows it (:func:`narrow_suite`) instead of defining a new one:
``--arms`` runs only the named arms, ``--sweep`` replaces the values of the suite's swept key,
``--tuning_seeds`` the held-out seeds the sweep runs on, and ``--tune_seeds N`` tunes on the
first ``N`` reported seeds instead (selection on reported seeds: a small winner's-curse bias;
e.g. an arm's lr window on a finer grid and more seeds:
``--arms geonorm-literal --sweep 3e-4 5e-4 1e-3 2e-3 --seeds 0 1 2 3 4 5 6 7 8 9 --tune_seeds 10``).

**Held-out tuning.** A swept suite chooses each arm's value on its tuning seeds (100, 101, 102),
which no report uses, and reports every arm at its chosen value on the reported seeds (0-4):
a difference between arms is then not inflated by having picked each arm's best-looking value
on the very seeds it is judged on. ``results.md`` names both sets.

- ``results.csv`` — one row per run: final validation loss and perplexity, diverged or not,
  learned or not (final validation loss at least :data:`LEARNED_MARGIN` below the corpus's
  unigram entropy: more than the token frequencies were learned), steps to reach the
  target, wall time, tokens/s, the last evaluation's diagnostics (q/k spectral norms, attention
  logit, entropy and max probability, sphere step angles, weight kurtosis and max|w|/std) and
  their extremes over the run (NaN where an evaluation's value, or validation loss for the
  largest rise, was not finite: the extreme of the finite values alone would read as bounded;
  the largest rise of a run that diverged between evaluations is NaN too);
- ``results.md`` — the same aggregated per arm (mean ± std over seeds, the distance to the
  baseline in standard errors, unpaired (Welch) and paired by seed) with the exact command, and
  the sweep table of a swept suite; a suite's own columns average the runs whose value is finite
  and say how many runs that is (``(k/n)``) and how many had a value that is not
  (``m non-finite``, ``non-finite (m/n)`` when none is finite: NaN in ``results.csv``), while
  ``—`` is a value no run has (a diagnostic the model lacks); in the columns of evaluations
  (final and peak values) a run that diverged is set aside (``m diverged``, ``diverged (m/n)``):
  its values are those of an earlier step than the other runs'; under each table, a line naming
  the runs whose warm-up lasted as long as them or longer (``--steps`` at or below
  ``warmup_steps``: the learning rate peaked at the last step, below its configured value where
  the warm-up is longer, and the schedule never acted) per arm, ``k/n`` with their
  ``lr_peak_fraction``, and one naming the runs whose SEL scale annealing outlasted them
  (``--steps`` at or below ``sel_anneal_steps``, which does not follow ``--steps``) with their
  ``sel_anneal_fraction`` (columns of ``results.csv`` too, with ``warmup_outlasts_run``);
- ``sweep.csv`` — a swept suite's tuning runs (its tuning seeds) at every value;
- ``curves.png`` — the validation curves of every reported run.

The *target* of "steps to target" is the mean final validation loss of the suite's baseline
arm (over its runs that did not diverge); the steps are the first evaluation at or below it
(evaluations every ``eval_interval`` steps, so the resolution is ``eval_interval``), averaged over
the runs that reach it, whose count the cell gives. A run that reached the target and diverged
later counts as reaching it, at that first evaluation: the column says when the target was
first reached, the "diverged" column what became of the run.

Suites:

``spheret``
    The hidden-state connections: pre-ln (baseline), peri-ln, pre-dyt (with the DyT paper's LLM
    recipe), keel, geonorm, 1- and 2-SpheretNorm with the normalized step, and 1-SpheretNorm with
    the seed's literal step, each at every AdamW learning rate of a grid on the tuning seeds:
    the seed's protocol (one shared lr) is a column of the sweep table, and each arm is reported
    at its own best, on five other seeds.
``spheret-p``
    Seed 000's p-family, p = 0.5, 1, 1.5, 2, 4 and inf, under the seed's literal step (alpha 1) and
    the library's normalized step (alpha 0.5), each at its own lr; baseline: the seed's own arm
    (p = 1, literal).
``spheret-ablations``
    1-SpheretNorm in both step forms, whole and without the depth damping, with a fixed step
    alpha, and with a fixed radius.
``spheret-stress``
    A high-learning-rate, no-warmup, no-clipping setting for a subset (the seed reports Pre-LN
    and Keel diverging where SpheretNorms converge), evaluated every 5 steps from the initial
    model so that a blow-up the runs recover from shows in ``val_rise_max``. Keel's outcome
    there is set by its highway weight (``keel_alpha``; the report shows
    ``keel_branch_ratio_max``).
``spheret-retractions``
    The seed's literal step for the exponential map (GeoNorm, baseline), Cayley (p = 2) and
    gnomonic (p = 1), started at angles of 0.17-0.64 rad (``alpha_init`` 100), each at its own
    best lr of a grid (1e-4 to 1, wide enough that every arm's best is inside) run on the
    tuning seeds: the test of "finite p beats the exponential map" that the normalized step
    cannot be (there every member is a reparametrization of one per-layer angle).
``manifolds``
    ManifoldMuon assignment policies on seed 002's base, a Pre-LN GPT: unconstrained
    (baseline), all-stiefel, all-dgram, hetero, hetero-inv, and the DGram-attention policies and
    hetero again with the paper's public code (``-reference``: ``muon_recipe="reference"``), at
    a constant learning rate swept per arm on the three tuning seeds (each policy reported at
    its own best, over five other seeds); logs the q/k
    spectral norms, the attention logit, entropy and max probability at every evaluation.
``manifolds-high-lr``
    The same policies at one large constant learning rate (0.1, three seeds): the regime in which
    the seed's mechanism — DGram lets the attention maps' singular values, hence the logits,
    grow until the softmax saturates — can act.
``sel``
    AdamW baseline (also on 150-, 200- and 250-step cosine schedules, which may reach the full
    schedule's final loss sooner) against SEL mismatched, SEL congruent and SEL without the linear path, with
    the curvature calibrated from the weights' own initialization and the seed's scale-lr
    annealing (and mismatched without it), each at its own best ``block_lr`` (the attention and
    MLP matrices' lr; everything else at 3e-3) of a grid run on the tuning seeds; steps to reach
    the baseline's final loss, the training seconds to it (the chart's overhead included) and the
    effective weights' heavy-tail statistics.
``sel-shared-lr``
    The same at the seed's protocol: one lr for every parameter, swept per arm.

A claim's trend with model size: run a suite at several sizes (``--n_embd``, ``--n_layer``,
``--steps`` overrides, one ``--out`` each) and give the folders to ``python -m
models.compare.trend`` (:mod:`models.compare.trend`): each arm's paired gap to the baseline
against size, its slope per doubling, a figure and a table.

Full suites are sized for about 30 minutes each on a 2-core CPU with ``--jobs 2`` (timings in
``docs/results``); ``--quick`` is a tiny version (synthetic corpus, one seed, a few dozen steps)
for tests: one reported seed and the first of the suite's tuning seeds, unless ``--seeds`` or
``--tuning_seeds`` name others, which are then all run.
"""

from .cli import EXIT_USER_ERROR, main
from .reports import write_reports
from .results import LEARNED_MARGIN, learned, val_rise_max
from .runner import run_suite, suite_configs
from .suites import FULL_BASE, MANIFOLD_POLICIES, SUITES, TUNING_SEEDS, Suite, narrow_suite

__all__ = ["EXIT_USER_ERROR", "FULL_BASE", "LEARNED_MARGIN", "MANIFOLD_POLICIES", "SUITES", "TUNING_SEEDS", "Suite",
           "learned", "main", "narrow_suite", "run_suite", "suite_configs", "val_rise_max",
           "write_reports"]
