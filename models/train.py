"""Train the reference GPT: ``python -m models.train [--preset NAME] [--config FILE.toml]
[--out DIR] [--steps N] [--corpus SPEC] [--resume] [--key value ...]``.

The loop, top to bottom: check the run directory and load the corpus (:mod:`models.run_dir`),
build model and optimizer (:mod:`models.build`), restore a checkpoint; then every step sets the
learning rate, draws the global batch and runs :func:`train_step` (``grad_accum_steps``
micro-steps under autocast, clipping, the step); logged steps go to ``metrics.jsonl`` with their
throughput (:mod:`models.throughput`), evaluations (:mod:`models.evaluation`) also write a
checkpoint; the end writes ``summary.json``, the plot and a sample. Under ``torchrun`` every rank
draws the same global batch and trains on its share of each micro-batch, so the steps are one
process's up to rounding. SIGTERM or SIGHUP during training stops the loop at the next step
boundary, writes the checkpoint there and exits 143 / 129 (:mod:`models.cli`); a start removes
the temporary files a killed run left in the run directory. Exit statuses: 0 done, 1 a
file-system fault, 2 bad input, 3 diverged, 130 interrupted, 143 / 129 terminated. See
``docs/guides/training.rst``.
"""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":  # a signal while the imports below load: one line, no traceback
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write("interrupted\n"), os._exit(130)))
    for _name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, _name):
            signal.signal(getattr(signal, _name), lambda signum, _: (
                sys.stderr.write(f"terminated by {signal.Signals(signum).name}\n"),
                os._exit(128 + signum)))

import contextlib
import dataclasses
import math
import random
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from manifoldlib.distributed import (
    all_mean,
    batch_shard,
    destroy_process_group,
    from_rank0,
    raise_together,
)

from . import cli, run_dir

# the names marked F401 are imported from here by models.compare, the tests and users' scripts
from .build import (
    MissingModuleError,  # noqa: F401
    _import,  # noqa: F401
    build_model,
    build_train_optimizer,
    lr_scale,
    resolve_device,
    schedule_warnings,
)
from .cli import _ArgumentError, _Parser  # noqa: F401
from .clipping import clip_grad_norm
from .config import RESUMABLE_FIELDS, ConfigError, TrainConfig  # noqa: F401
from .data import BatchSampler, Corpus, CorpusError
from .evaluation import diagnostics, evaluate, generate_sample, perplexity
from .fsdp import (
    average_replicated_grads,
    forget_sharding_caches,
    gradient_sync,
    shard_model,
    whole_parameters,
)
from .job import Job, set_rank_rng, start_job
from .moment_overflow import SecondMomentOverflow, check_second_moments
from .precision import MIN_LOSS_SCALE, Precision
from .progress import Progress
from .run_dir import (
    MetricsLog,
    RunError,
    load_optimizer_state,  # noqa: F401
    read_metrics,  # noqa: F401
    save_checkpoint,  # noqa: F401
)
from .sharded_checkpoint import remove_stale_shard_folders
from .throughput import Throughput, device_time, flops_per_token, peak_flops

__all__ = ["Run", "main", "run_training", "train_step"]

#: The names of the files a run writes into its directory (whose temporary files are ours).
_RUN_DIR_NAMES = run_dir.RUN_FILES | {run_dir.CHECKPOINT}


@dataclasses.dataclass
class Run:
    """Everything the loop works on, passed explicitly (no closures)."""

    cfg: TrainConfig
    out: Path
    job: Job
    corpus: Corpus
    model: torch.nn.Module          # the unwrapped model: checkpoints, diagnostics, samples
    trained: torch.nn.Module        # what the steps call: compiled and/or DDP-wrapped (under
    # fsdp the sharded model itself, compiled or not)
    evaluator: torch.nn.Module      # what evaluations call: compiled or the model
    optimizer: torch.optim.Optimizer
    multipliers: list               # one lr multiplier per param group, beside base_lrs
    base_lrs: list
    sampler: BatchSampler
    precision: Precision
    log: MetricsLog
    progress: Progress
    meter: Throughput
    step: int = 0
    tokens: int = 0
    saved_step: int = -1
    wall_before: float = 0.0
    t_start: float = dataclasses.field(default_factory=time.perf_counter)
    last_val: float | None = None
    diverged: str | None = None
    rates: dict = dataclasses.field(default_factory=dict)


def _json_float(x: float | None) -> float | None:
    """JSON has no NaN/inf: non-finite values are written as null."""
    return x if x is not None and math.isfinite(x) else None


def run_training(cfg: TrainConfig, out: str | Path, *, resume: bool = False,
                 echo: bool = True) -> dict:
    """Train (or resume, from ``out/checkpoint.pt``) one run in ``out``; its summary.

    Under ``torchrun`` (or in an initialized process group) every rank calls this; only rank 0
    writes files and, with ``echo``, prints. On resume ``cfg`` may differ from the saved
    configuration only in :data:`~models.config.RESUMABLE_FIELDS`. The summary's ``diverged``
    is True when the loss became non-finite (the last good checkpoint is kept).

    Raises:
        CorpusError, ConfigError, RunError: bad input; nothing was trained (on every rank).
    """
    job, owns_group = start_job(resolve_device(cfg.device), fsdp=cfg.fsdp)
    try:
        return _train(cfg, Path(out), resume, echo, job)
    finally:
        if cfg.fsdp:
            forget_sharding_caches()
        if owns_group:
            destroy_process_group()


def _train(cfg: TrainConfig, out: Path, resume: bool, echo: bool, job: Job) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ckpt, corpus, stale, error = None, None, False, None
    try:  # every rank checks; all fail together
        cfg, ckpt, corpus, stale = run_dir.prepare_run(cfg, out, resume, job.world_size,
                                                       is_main=job.is_main, echo=echo)
    except (ConfigError, CorpusError, RunError) as exc:
        error = exc
    raise_together(error, RunError)  # also the barrier before rank 0 creates the directory
    if corpus is None:  # resuming a finished run
        return run_dir.finished_summary(out, ckpt["step"], cfg.steps, echo and job.is_main)
    run_dir.check_same_corpus(corpus, cfg)
    if job.is_main and not resume:
        out.mkdir(parents=True, exist_ok=True)
    with _writer_lock(out, job) as locked:
        if job.is_main:
            _remove_leftovers(out, locked, echo)
        if job.is_main and stale:  # a run that stopped before its first checkpoint: start it
            run_dir.clear_stale_run(out)  # again cleanly
        try:
            run = _setup(cfg, out, resume, echo, job, corpus, ckpt)
        except Exception as exc:
            _raise_out_of_memory(exc, job, "building the model", kept=ckpt is not None)
            raise
        with cli.TERMINATION.deferred():  # SIGTERM / SIGHUP wait for a step boundary
            try:
                _loop(run)
            except Exception as exc:  # torch.compile is lazy: the first forward builds the
                # kernels (with a C++ compiler on CPU, triton on CUDA), deep inside the loop
                _raise_out_of_memory(exc, job, f"in step {run.step + 1}",
                                     kept=run.saved_step >= 0)
                if not (cfg.compile and isinstance(exc, torch._dynamo.exc.BackendCompilerFailed)):
                    raise
                cause = str(exc).strip().splitlines()[0]
                raise RunError(f"--compile true failed on {job.device.type}: {cause}; run with "
                               f"--compile false") from None
            finally:
                run.progress.close()
                run.log.close()
            return _finish(run, ckpt)


def _remove_leftovers(out: Path, locked: bool, echo: bool) -> None:
    """Remove the temporary files a run killed mid-write left in ``out`` (ours, and stale: their
    writer is gone, or we hold the directory's lock), saying which."""
    if not out.is_dir():
        return
    removed = run_dir.remove_stale_temporaries(out, _RUN_DIR_NAMES, locked=locked)
    removed += remove_stale_shard_folders(out, locked=locked)
    if removed and echo:
        print(f"removed {len(removed)} temporary file{'s' * (len(removed) > 1)} that a killed "
              f"run left in {out}: {', '.join(removed)}", flush=True)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation the device could not serve: CUDA's ``OutOfMemoryError``, the CPU
    allocator's ``RuntimeError``, or Python's ``MemoryError``."""
    return isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def _raise_out_of_memory(exc: BaseException, job: Job, where: str, kept: bool) -> None:
    """Turn an out-of-memory error into one :class:`RunError` line saying what to shrink;
    ``kept``: a checkpoint exists (written atomically, so it is whole). Other errors pass."""
    if not is_out_of_memory(exc):
        return
    cause = next((line.strip() for line in str(exc).splitlines() if line.strip()),
                 type(exc).__name__)
    cause = cause[cause.find("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in cause else cause
    raise RunError(f"out of memory on {job.device} {where}: {cause}; lower batch_size (or raise "
                   f"grad_accum_steps: each micro-batch holds batch_size / grad_accum_steps "
                   f"sequences), block_size or the model's size"
                   + ("; the last checkpoint is kept" if kept else "")) from None


@contextlib.contextmanager
def _writer_lock(out: Path, job: Job):
    """Rank 0 holds ``out``'s :class:`~models.storage.RunDirLock` while the run writes; every
    rank fails together (before any write) when another run holds it. Yields whether this
    process holds the lock for real (rank 0 on a file system that locks)."""
    lock, error = None, None
    if job.is_main:
        try:
            lock = run_dir.RunDirLock(out)
        except RunError as exc:
            error = exc
    raise_together(error, RunError)
    with lock if lock is not None else contextlib.nullcontext():
        yield lock is not None and lock.held


def _setup(cfg: TrainConfig, out: Path, resume: bool, echo: bool, job: Job, corpus: Corpus,
           ckpt: dict | None) -> Run:
    """Model, optimizer, sampler and precision, identical on every rank (under fsdp the model
    sharded across them before the optimizer is built); the checkpoint's state restored; the run
    directory's files opened."""
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    model = build_model(cfg, corpus.vocab_size).to(job.device)
    if cfg.fsdp:  # before the optimizer, which must hold the sharded parameters
        shard_model(model, job.device.type, job.world_size)
    optimizer, multipliers = build_train_optimizer(model, cfg, world_size=job.world_size)
    base_lrs = [group["lr"] for group in optimizer.param_groups]  # before a checkpoint's
    # rank 0's sampler on every rank: all ranks draw the same global batch, then take a slice
    sampler = BatchSampler(corpus.train, cfg.batch_size, cfg.block_size, cfg.seed, 0)
    precision = Precision(cfg.dtype, job.device)
    set_rank_rng(cfg.seed, job.rank)
    rows = []
    if ckpt is not None:
        run_dir.restore_state(ckpt, model, optimizer, sampler, precision, job.rank,
                              job.world_size, cfg.seed, out)
        rows = run_dir.resumed_rows(out, ckpt["step"])
    raise_together(None, RunError)  # every rank has read metrics.jsonl before rank 0 rewrites it
    if job.is_main:
        if ckpt is not None:  # rows logged after the checkpoint will be produced again
            run_dir.rewrite_metrics(out / "metrics.jsonl", rows)
        run_dir.write_run_files(out, cfg, corpus, resume)
    evaluator = torch.compile(model) if cfg.compile else model  # under fsdp: after sharding
    trained = evaluator
    if job.world_size > 1 and not cfg.fsdp:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(
            evaluator, device_ids=[job.device.index] if job.device.type == "cuda" else None)
    n_params = model.num_params() if hasattr(model, "num_params") else \
        sum(p.numel() for p in model.parameters())
    meter = Throughput(cfg.batch_size * cfg.block_size,
                       flops_per_token(n_params, cfg.n_layer, cfg.block_size, cfg.n_embd),
                       peak_flops(job.device, cfg.dtype, cfg.peak_flops), job.world_size,
                       job.device)
    start = ckpt["step"] if ckpt is not None else 0
    progress = Progress(echo and job.is_main, cfg.progress, cfg.progress_interval, start,
                        cfg.last_step)
    log = MetricsLog(out, rows, job.is_main, cfg.log, resumed_at=start if ckpt is not None else None)
    run = Run(cfg, out, job, corpus, model, trained, evaluator, optimizer, multipliers,
              base_lrs, sampler, precision, log, progress, meter)
    if ckpt is not None:
        run.step, run.tokens = ckpt["step"], ckpt["tokens"]
        run.wall_before, run.saved_step = ckpt["wall_time_s"], ckpt["step"]
    run.progress.say(run_dir.describe_start(run))
    if job.is_main:  # summary.json records them too
        for note in schedule_warnings(cfg):
            warnings.warn(note, RuntimeWarning, stacklevel=2)
    return run


def train_step(trained: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, cfg: TrainConfig, job: Job, precision: Precision
               ) -> tuple[float, float, float]:
    r"""One optimizer step on the global batch ``x, y`` (``(batch_size, T)`` each).

    The batch is cut into :math:`K` = ``grad_accum_steps`` micro-batches, each into
    :math:`W` rank shares; rank :math:`r` backpropagates :math:`\ell_{k,r}/K` for its share
    of every micro-batch :math:`k` (DDP all-reduces, FSDP2 reduce-scatters, only on the last
    one, averaging over ranks; :func:`models.fsdp.gradient_sync`), so the gradient is
    :math:`\frac{1}{KW}\sum_{k,r}\nabla\ell_{k,r}`, the gradient of
    the whole batch's mean loss. Then clipping to ``grad_clip``
    (:func:`models.clipping.clip_grad_norm`: a finite gradient whose float32 norm would
    overflow is measured and clipped, not taken for a non-finite one) and the step.

    Returns:
        ``(loss, grad_norm, optimizer_seconds)``: the batch's mean loss (over ranks), the
        gradient norm before clipping, the optimizer step's time. A non-finite loss, or
        (outside float16, whose scaler skips such steps) a non-finite norm, leaves the
        parameters untouched.

    Raises:
        SecondMomentOverflow: without clipping, a gradient entry of an AdamW group whose square
            overflows its second moment (:mod:`models.moment_overflow`); nothing stepped.
    """
    k_steps, world = cfg.grad_accum_steps, job.world_size
    total = torch.zeros((), dtype=torch.float64, device=job.device)
    for k in range(k_steps):
        rows = batch_shard(cfg.batch_size, k * world + job.rank, k_steps * world)
        last = k == k_steps - 1
        with gradient_sync(trained, last or world == 1):
            with precision.autocast():
                _, loss = trained(x[rows].to(job.device), y[rows].to(job.device))
            total += loss.detach()
            precision.backward(loss / k_steps)
    average_replicated_grads(trained)  # FSDP2's unsharded (0-d) parameters
    loss_value = all_mean(float(total) / k_steps, job.device)
    grad_norm = math.nan
    if math.isfinite(loss_value):
        precision.unscale(optimizer)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(trained.parameters(), max_norm)
        if cfg.grad_clip == 0 and math.isfinite(grad_norm):
            check_second_moments(optimizer, grad_norm, loss_value)  # raises before the step
    seconds = 0.0
    if math.isfinite(loss_value) and (math.isfinite(grad_norm) or precision.scaler is not None):
        start = device_time(job.device)
        precision.step(optimizer)
        seconds = device_time(job.device) - start
    optimizer.zero_grad(set_to_none=True)
    return loss_value, grad_norm, seconds


def _loop(run: Run) -> None:
    cfg = run.cfg
    if run.step == 0 and not _evaluate_initial(run):
        return
    for step in range(run.step + 1, cfg.last_step + 1):
        _stop_if_terminated(run)
        scale = lr_scale(step - 1, cfg)
        for group, base, mult in zip(run.optimizer.param_groups, run.base_lrs, run.multipliers):
            group["lr"] = base * scale * mult(step - 1)
        x, y = run.sampler.next_batch()  # (B, T) each: the global batch
        overflow = None
        try:
            loss, grad_norm, opt_s = train_step(run.trained, run.optimizer, x, y, cfg, run.job,
                                                run.precision)
        except SecondMomentOverflow as err:
            overflow, loss, grad_norm, opt_s = err, err.loss, err.grad_norm, 0.0
            run.optimizer.zero_grad(set_to_none=True)
        row = {"step": step, "train_loss": _json_float(loss), "lr": cfg.lr * scale,
               "tokens": run.tokens}
        if overflow is not None:
            run.diverged = f"{overflow} at step {step}"
            row["grad_norm"] = _json_float(grad_norm)
        elif not math.isfinite(loss):
            run.diverged = f"non-finite training loss ({loss}) at step {step}"
        elif not math.isfinite(grad_norm) and run.precision.scaler is None:
            run.diverged = f"non-finite gradient norm ({grad_norm}) at step {step}"
            row["grad_norm"] = None
        elif not math.isfinite(grad_norm) and run.precision.scale_collapsed():
            run.diverged = (f"non-finite gradients at every loss scale (the float16 loss scale "
                            f"fell below {MIN_LOSS_SCALE:g}) at step {step}")
            row["grad_norm"] = None
        if run.diverged is not None:
            run.log.append({**row, "diverged": True})
            return
        run.tokens += cfg.batch_size * cfg.block_size
        run.step = step
        run.meter.add_step(opt_s)
        run.progress.update(step, loss, run.rates)
        is_eval = step % cfg.eval_interval == 0 or step == cfg.last_step
        if not (is_eval or step % cfg.log_interval == 0):
            continue
        row.update(tokens=run.tokens, grad_norm=_json_float(grad_norm), **run.meter.report())
        run.rates = row
        if is_eval and not _evaluate_into(run, row):
            return
        run.log.append(row)
        if is_eval:
            run.progress.say(f"step {step}/{cfg.steps}: train {loss:.4f}, val "
                             f"{run.last_val:.4f} (ppl {perplexity(run.last_val):.2f}), "
                             f"{row['tokens_per_s']:.0f} tok/s")
            run_dir.save_run_checkpoint(run)
            run.meter.skip()


def _stop_if_terminated(run: Run) -> None:
    """At a step boundary: when a terminating signal has arrived (on any rank), write the
    checkpoint of this step (the run directory's usual one; nothing before the first step) and
    end the run with :class:`~models.cli.Terminated`."""
    signum = cli.TERMINATION.signum
    if run.job.world_size > 1:  # every rank stops at the same boundary, or none does
        arrived = all_mean(float(signum is not None), run.job.device) > 0
        signum = (signum or signal.SIGTERM) if arrived else None
    if signum is None:
        return
    if run.step > 0:
        run_dir.save_run_checkpoint(run)
    raise cli.Terminated(signum, run.step, saved=run.saved_step == run.step)


def _evaluate_initial(run: Run) -> bool:
    """Evaluate the model before its first step (a fresh run's row at step 0, as nanoGPT's
    loop does): the reference a spike in the first ``eval_interval`` steps is measured against
    (``models.compare.val_rise_max``). Touches no random state; False when the loss is not
    finite."""
    row = {"step": 0, "tokens": 0}
    if not _evaluate_into(run, row):
        return False
    run.log.append(row)
    run.progress.say(f"step 0/{run.cfg.steps}: val {run.last_val:.4f} "
                     f"(ppl {perplexity(run.last_val):.2f})")
    run.meter.skip()
    return True


def _evaluate_into(run: Run, row: dict) -> bool:
    """Add the validation loss (rank 0's, on every rank) and diagnostics to ``row``; False
    (and the row logged) when the loss is not finite."""
    cfg, job = run.cfg, run.job
    # every rank evaluates without DDP (a DDP forward on rank 0 alone could wait for its peers)
    val = from_rank0(evaluate(run.evaluator, run.corpus, cfg, job.device,
                              run.precision.autocast, world_size=job.world_size), job.device)
    run.last_val = val
    if not math.isfinite(val):
        run.diverged = f"non-finite validation loss ({val}) at step {row['step']}"
        run.log.append({**row, "val_loss": None, "diverged": True})
        return False
    row.update(val_loss=val, val_ppl=_json_float(perplexity(val)))
    if job.is_main or cfg.fsdp:  # under fsdp every rank gathers the weights and measures
        with whole_parameters(run.model), run.precision.autocast():
            stats = diagnostics(run.model, run.corpus, cfg, job.device)
        if job.is_main:
            row.update(stats)
    return True


def _finish(run: Run, ckpt: dict | None) -> dict:
    """Write ``summary.json`` and the plot, then the sample (so that an interrupted sample
    loses nothing else); say how the run ended."""
    cfg, out, say = run.cfg, run.out, run.progress.say
    seconds = time.perf_counter() - run.t_start
    summary = run_dir.summary_of(run, ckpt, run.wall_before + seconds, seconds)
    if run.diverged is not None:
        kept = (f"the last good checkpoint (step {run.saved_step}) is kept in {out}"
                if run.saved_step >= 0 else "no checkpoint had been written yet")
        last = summary["last_finite_val_loss"]
        before = (f"; val_loss is null (no final loss), the last finite one {last:.4f} at step "
                  f"{summary['last_finite_val_step']}" if last is not None else "")
        summary["error"] = f"{run.diverged}; {kept}{before}"
        say(f"stopped: {summary['error']}")
    if run.job.is_main:
        run_dir.write_json(out / "summary.json", summary)
        _plot(run, summary)
    if run.diverged is None and summary["finished"] and cfg.sample_tokens > 0 \
            and (run.job.is_main or cfg.fsdp):  # under fsdp every rank samples, on whole weights
        # the run is saved: a signal need not wait for the sample
        with cli.TERMINATION.immediate(), whole_parameters(run.model):
            sample = generate_sample(run.model, run.corpus, cfg, run.job.device)
        if run.job.is_main:
            run_dir.atomic_write(out / "sample.txt", sample.encode())
            say("--- sample ---\n" + sample + "\n--------------")
    if summary["finished"]:
        say(f"done: val loss {run.last_val:.4f} (ppl {perplexity(run.last_val):.2f}, unigram "
            f"entropy {summary['unigram_entropy']:.3f}), {run.tokens:,} tokens in "
            f"{summary['wall_time_s']:.1f} s; run directory {out}")
    elif run.diverged is None:
        say(f"stopped at step {run.step} of {cfg.steps}; continue with: python -m models.train "
            f"--resume --out {out}" if cfg.checkpoint and run.saved_step == run.step else
            f"stopped at step {run.step} of {cfg.steps} without a checkpoint (checkpoint=false)")
    raise_together(None, RunError)  # no rank returns before rank 0 has written the directory
    return summary


def _plot(run: Run, summary: dict) -> None:
    """``loss.png``; skipped with a warning without matplotlib (the ``train`` extra), as the
    bar is without tqdm: ``metrics.jsonl`` has every number."""
    from .plotting import plot_run

    cfg = run.cfg
    try:
        plot_run(run.log.rows, run.out / "loss.png", reference=summary["unigram_entropy"],
                 title=f"{cfg.connection} / {cfg.optimizer} / sel={cfg.sel} on {cfg.corpus}")
    except ImportError:
        warnings.warn("loss.png needs the matplotlib package (pip install matplotlib, or the "
                      "'train' extra); skipped, metrics.jsonl has every number",
                      RuntimeWarning, stacklevel=2)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 file-system fault, 2 bad input,
    3 diverged, 130 interrupted)."""
    return cli.main(argv, run_training)


if __name__ == "__main__":
    sys.exit(main())
