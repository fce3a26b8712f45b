"""The run directory of ``python -m models.train``: what a run checks before it starts, and
the files it writes — ``config.json``, ``corpus.json``, ``metrics.jsonl`` (and an optional
TensorBoard log), ``summary.json``; checkpoints go through :mod:`models.storage`.

Resume rules: the saved configuration may change only in
:data:`~models.config.RESUMABLE_FIELDS`; the corpus must have the fingerprint it had, and a
BPE tokenizer the ``tokenizer.json`` it had; the checkpoint must be behind the step asked for.
The storage guarantees (atomic writes, sealed checkpoints read with ``weights_only``, the
previous checkpoint as a fallback, metrics repair) are :mod:`models.storage`'s, whose names are
importable from here too.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
import warnings
from pathlib import Path

from manifoldlib.distributed import all_gather_objects

from .config import (
    LEGACY_LR_SCHEDULE_VERSION,
    LEGACY_MUON_NS_DTYPE,
    RESUMABLE_FIELDS,
    ConfigError,
    TrainConfig,
)
from .data import (
    Corpus,
    check_given_tokenizer,
    check_size,
    load_corpus,
    resolve_tokenizer,
    unigram_entropy,
)
from .sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from .storage import (  # noqa: F401 - the storage names are importable from here too
    CHECKPOINT,
    DAMAGED_CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    REQUIRED_KEYS,
    RUN_FILES,
    SHARDS,
    CheckpointError,
    RunDirLock,
    RunError,
    atomic_write,
    check_run_dir,
    clear_stale_run,
    describe_os_error,
    has_checkpoint,
    load_checkpoint,
    read_metrics,
    remove_stale_temporaries,
    rewrite_metrics,
    rng_state,
    save_checkpoint,
    set_rng_state,
    state_checksum,
    write_json,
)

__all__ = ["MetricsLog", "check_corpus", "check_resumable", "check_same_corpus",
           "finished_summary", "load_optimizer_state", "prepare_run",
           "read_saved_config", "resumed_rows", "with_legacy_defaults"]


def with_legacy_defaults(saved: dict) -> dict:
    """A saved configuration with the values that runs made before a field existed used
    (``muon_ns_dtype``: bfloat16; ``periln_embed_norm``: off; ``muon_weight_decay``: 0;
    ``tokenizer``: byte, the default before ``auto``; ``lr_schedule_version``: 1, the cosine
    whose last update stays above ``min_lr_ratio``), so that resuming such a run repeats its
    computation."""
    return {"muon_ns_dtype": LEGACY_MUON_NS_DTYPE, "periln_embed_norm": False,
            "muon_weight_decay": 0.0, "tokenizer": "byte",
            "lr_schedule_version": LEGACY_LR_SCHEDULE_VERSION, **saved}


def read_saved_config(out: str | Path) -> dict:
    """The flat configuration in ``out/config.json`` (the base of a ``--resume``); the one saved
    in the checkpoint when ``config.json`` is missing (it is written again when the run resumes).

    Raises:
        RunError: the file is not a JSON object of valid configuration values (an unknown key,
            a value of the wrong type or out of range), naming the file and the value; or it is
            missing and there is no usable checkpoint.
    """
    saved = Path(out) / "config.json"
    if not saved.exists():
        return with_legacy_defaults(load_checkpoint(out, move_damaged=False)[0]["config"])
    try:
        base = with_legacy_defaults(json.loads(saved.read_text()))
        if not isinstance(base, dict):
            raise ValueError("not a JSON object")  # noqa: TRY004 - caught below: damaged
        TrainConfig.from_dict(base)
    except (ValueError, UnicodeDecodeError, TypeError) as exc:
        raise RunError(f"cannot resume: {saved} is not a valid configuration ({exc}); "
                       f"it is rewritten from the checkpoint if you delete it") from None
    return base


def check_resumable(saved: TrainConfig, new: TrainConfig) -> None:
    """Refuse a change of any field outside :data:`RESUMABLE_FIELDS`."""
    old_values, new_values = saved.to_dict(), new.to_dict()
    changed = [f"{k} ({old_values[k]!r} -> {new_values[k]!r})" for k in old_values
               if k not in RESUMABLE_FIELDS and old_values[k] != new_values[k]]
    if changed:
        raise RunError("cannot resume with a different configuration: " + ", ".join(changed)
                       + f"; only {', '.join(sorted(RESUMABLE_FIELDS))} may change")


def _resumed_changes(saved: TrainConfig, new: TrainConfig, saved_world: int | None = None,
                     world_size: int = 1) -> str | None:
    """The line a resume prints when it changes resumable fields (``stop_at`` aside, which
    every resume clears), or ``None``. With ``dropout > 0`` a change of ``grad_accum_steps`` or
    of the number of processes draws other dropout masks from then on (each micro-batch or rank
    share runs its own forward), so the run no longer follows the uninterrupted one; the line
    says so."""
    old_values, new_values = saved.to_dict(), new.to_dict()
    changed = [f"{k} {old_values[k]!r} -> {new_values[k]!r}" for k in sorted(RESUMABLE_FIELDS)
               if k != "stop_at" and old_values[k] != new_values[k]]
    if saved_world is not None and saved_world != world_size:
        changed.append(f"processes {saved_world} -> {world_size}")
    if not changed:
        return None
    line = "resuming with changed settings: " + ", ".join(changed)
    split = saved.grad_accum_steps != new.grad_accum_steps or (
        saved_world is not None and saved_world != world_size)
    if split and new.dropout > 0:
        line += (f" (with dropout {new.dropout} the batch's forwards are split otherwise, so the "
                 f"dropout masks from here on differ from an uninterrupted run's)")
    return line


def _check_world_size(cfg: TrainConfig, world_size: int) -> None:
    parts = world_size * cfg.grad_accum_steps
    if cfg.batch_size % parts:
        times = f" times grad_accum_steps {cfg.grad_accum_steps}" if cfg.grad_accum_steps > 1 \
            else ""
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by the {world_size} "
                          f"processes of this job{times}; the global batch is split evenly "
                          f"across micro-steps and ranks, so choose a multiple of {parts}")


def _check_steps_reach(out: Path, step: int, own_steps: int, steps: int) -> None:
    """Refuse ``steps`` below the checkpoint's ``step``, or equal to it when the run (configured
    for ``own_steps``) has not finished: there is nothing to train, and "finished" would be false
    (a run that finished at ``step == own_steps == steps`` is left alone, nothing to do)."""
    if step < steps or step == steps == own_steps:
        return
    where = f"its checkpoint is at step {step}" + (", past it" if step > steps else "")
    if step >= own_steps:
        state = f"the run finished there (its steps={own_steps})"
        advice = f"omit --steps (nothing to do) or pass --steps above {step} to extend it"
    else:
        state = f"the run is configured for steps={own_steps} and never got there"
        advice = (f"omit --steps (or pass --steps {own_steps}) to finish it, or --steps above "
                  f"{step} to end it elsewhere")
    raise RunError(f"cannot resume {out} with steps={steps}: {where}, and {state}; {advice}")


def _open_checkpoint(out: Path, cfg: TrainConfig, is_main: bool, echo: bool,
                     world_size: int = 1) -> tuple[dict, TrainConfig]:
    """The checkpoint, and ``cfg`` with tokenizer ``auto`` as the checkpoint saved it."""
    ckpt, note = load_checkpoint(out, move_damaged=is_main)
    if note is not None and echo and is_main:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    try:
        saved_cfg = TrainConfig.from_dict(with_legacy_defaults(ckpt["config"]))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the configuration saved in {out}'s checkpoint is not "
                              f"valid: {exc}") from None
    if cfg.tokenizer == "auto":  # the run's own, as saved (a run saved as byte on BPE shards too)
        cfg = cfg.replace(tokenizer=saved_cfg.tokenizer)
    check_resumable(saved_cfg, cfg)
    _check_steps_reach(out, ckpt["step"], saved_cfg.steps, cfg.steps)
    if ckpt["step"] < cfg.steps and cfg.last_step <= ckpt["step"]:
        raise RunError(f"cannot resume {out} to step {cfg.last_step}: its checkpoint "
                       f"is already at step {ckpt['step']}")
    changes = _resumed_changes(saved_cfg, cfg, ckpt.get("world_size"), world_size)
    if changes is not None and echo and is_main and ckpt["step"] < cfg.steps:
        print(changes, flush=True)
    return ckpt, cfg


def _check_own_run_files(out: Path) -> None:
    """Refuse to clear a directory of run files (:func:`~models.storage.check_run_dir`) unless
    its ``config.json`` is a configuration, as every run writes first: files of a user's own
    with the same names are never deleted."""
    if not any(p.name in RUN_FILES for p in out.iterdir()):
        return  # only the temporary files of a kill mid-write
    saved = out / "config.json"
    try:
        TrainConfig.from_dict(with_legacy_defaults(json.loads(saved.read_text())))
    except (OSError, ValueError, TypeError):
        raise RunError(f"run directory {out} is not empty and holds no run of this program "
                       f"({saved} is missing or not a configuration); choose another --out"
                       ) from None


def check_corpus(ckpt: dict | None, corpus: Corpus, cfg: TrainConfig,
                 out: Path | None = None) -> None:
    """Refuse to resume on a corpus whose fingerprint changed (the data order would differ), whose
    BPE token ids did, or whose BPE ``tokenizer.json`` did (its SHA-256, recorded in the checkpoint); a checkpoint
    written before the ids or the tokenizer were recorded is not checked for them."""
    if ckpt is not None and ckpt["corpus_fingerprint"] != corpus.fingerprint:
        raise RunError(f"cannot resume: corpus {cfg.corpus!r} changed since the run "
                       f"started (fingerprint {corpus.fingerprint[:12]} != "
                       f"{ckpt['corpus_fingerprint'][:12]}), so the data order would differ")
    saved = None if ckpt is None else ckpt.get("tokens_fingerprint")
    if saved is not None and saved != corpus.tokens_fingerprint:
        now = (corpus.tokens_fingerprint or "none")[:12]
        raise RunError(f"cannot resume: the token ids of corpus {cfg.corpus!r} changed since the "
                       f"run started (token fingerprint {now} != {saved[:12]}): the run's "
                       f"tokenizer.json was changed, or the tokenizers package encodes "
                       f"differently; restore them, or start a fresh run")
    if ckpt is not None:
        _check_tokenizer(ckpt.get("tokenizer_sha256"), corpus.tokenizer, out)


def _check_tokenizer(saved: str | None, tokenizer, out: Path | None = None) -> None:
    """Refuse a BPE tokenizer whose ``tokenizer.json`` is not the file the run started with.

    Token ids are checked (the shards' by their fingerprint, a text corpus's by
    :attr:`~models.data.Corpus.tokens_fingerprint`), the tokenizer's text is not: a
    ``tokenizer.json`` edited beside unchanged shards (its decoder, a vocabulary entry) would
    resume the run and silently decode its samples, and encode its prompt, otherwise. The
    checkpoint records the SHA-256 of the file (``saved``,
    :attr:`~models.tokenizer.BPETokenizer.sha256`). A resume still reads the shards' own file (a
    text corpus's run, its own ``tokenizer.json``) and refuses one with another digest rather
    than switch to the run's copy: the shards no longer match their tokenizer, which every other
    run on them reads, and the user must hear it. The error names the file and both digests;
    where the run directory ``out`` keeps a copy of a shard folder's file, also the top-level
    JSON sections in which they differ and, when the copy is the file the run started with,
    that copying it back restores the run.

    Raises:
        RunError: one line, as above.
    """
    if saved is None or saved == tokenizer.sha256:
        return
    path, copy = tokenizer.path, None if out is None else Path(out) / "tokenizer.json"
    detail, advice = "", "restore that file"
    if copy is not None and path is not None and copy != Path(path) and copy.is_file():
        differs = _json_sections_differ(Path(path), copy)
        detail = f"; sections that differ from the run's copy {copy}: " + (
            ", ".join(map(repr, differs)) if differs else "none, its bytes do")
        if hashlib.sha256(copy.read_bytes()).hexdigest() == saved:
            advice = f"copy {copy} (the file the run started with) back to {path}"
    raise RunError(f"cannot resume: the tokenizer file {path} changed since the run started "
                   f"(SHA-256 {(tokenizer.sha256 or 'none')[:12]} != {saved[:12]}, which the "
                   f"checkpoint records{detail}): the run's token ids were made with the one "
                   f"it started with, so its samples would decode otherwise; {advice}, or start "
                   f"a fresh run")


def _json_sections_differ(a: Path, b: Path) -> list[str]:
    """The top-level keys whose values differ between two JSON objects (``[]`` when either is
    not one)."""
    try:
        first, second = (json.loads(p.read_text(encoding="utf-8")) for p in (a, b))
    except (OSError, ValueError):
        return []
    if not isinstance(first, dict) or not isinstance(second, dict):
        return []
    return sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))


def prepare_run(cfg: TrainConfig, out: Path, resume: bool, world_size: int, *,
                is_main: bool, echo: bool
                ) -> tuple[TrainConfig, dict | None, Corpus | None, bool]:
    """Every check before training, with no writes: ``(config, checkpoint, corpus, stale)``.

    ``config`` is ``cfg`` as the run saves it: tokenizer ``auto`` is the corpus's own for a
    fresh run (:func:`~models.data.resolve_tokenizer`: ``bpe`` on BPE shards), the saved one
    for a resumed run. ``checkpoint`` is ``None`` for a fresh run; ``corpus`` is ``None`` when
    the run finished at ``steps`` (nothing to do; a checkpoint past ``steps`` is refused);
    ``stale`` says the directory holds a run that stopped before its first checkpoint
    (:func:`~models.storage.check_run_dir`).

    Raises:
        ConfigError, CorpusError, RunError: the run cannot start (a fresh run's named tokenizer
            that is not the one its ``bin:`` shards were made with among the reasons,
            :func:`~models.data.check_given_tokenizer`).
    """
    _check_world_size(cfg, world_size)
    stale = check_run_dir(out, resume)
    if stale:
        _check_own_run_files(out)
    ckpt = None
    if resume:
        ckpt, cfg = _open_checkpoint(out, cfg, is_main, echo, world_size)
    else:
        check_given_tokenizer(cfg.corpus, cfg.tokenizer, "the configuration's",
                              advice="set tokenizer='auto' for theirs")
        cfg = resolve_tokenizer(cfg)
    if ckpt is not None and ckpt["step"] >= cfg.steps:
        return cfg, ckpt, None, stale
    corpus = load_corpus(cfg.corpus, val_fraction=cfg.val_fraction, tokenizer=cfg.tokenizer,
                         bpe_vocab_size=cfg.bpe_vocab_size, vocab_size=cfg.vocab_size or None,
                         shard_dtype=None if cfg.shard_dtype == "meta" else cfg.shard_dtype,
                         tokenizer_path=out / "tokenizer.json"  # bin: reads the shards' own
                         if resume and cfg.tokenizer == "bpe" else None)
    check_size(corpus, cfg.batch_size, cfg.block_size)
    check_corpus(ckpt, corpus, cfg, out)
    return cfg, ckpt, corpus, stale


def check_same_corpus(corpus: Corpus, cfg: TrainConfig) -> None:
    """Refuse a job whose ranks loaded different corpora (a collective: every rank calls it)."""
    fingerprints = all_gather_objects(corpus.fingerprint)
    if len(set(fingerprints)) != 1:
        raise RunError(f"the ranks loaded different corpora (fingerprints "
                       f"{[f[:12] for f in fingerprints]}); every rank must see the same "
                       f"{cfg.corpus!r}")


def finished_summary(out: Path, step: int, steps: int, echo: bool) -> dict:
    """What resuming a run already at ``steps`` returns: its ``summary.json``, unchanged
    (empty when there is none).

    Raises:
        RunError: ``summary.json`` is not a JSON object (naming the file and what is wrong).
    """
    if echo:
        print(f"run in {out} already finished at step {step} (steps={steps}); nothing to do",
              flush=True)
    summary = out / "summary.json"
    if not summary.exists():
        return {}
    try:
        saved = json.loads(summary.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")  # noqa: TRY004 - caught below: damaged
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunError(f"{summary} is damaged ({exc}); the run already finished at step "
                       f"{step}, its checkpoint is intact") from None
    return saved


#: The files a run's end writes (:func:`models.train._finish`), of the run as it ended there.
END_FILES = ("summary.json", "loss.png", "sample.txt")


def write_run_files(out: Path, cfg: TrainConfig, corpus: Corpus, resume: bool) -> None:
    """``config.json``, ``corpus.json`` and, for a fresh BPE run, ``tokenizer.json`` (the one
    trained on the text, or a copy of the BPE shards' own).

    A resumed run's :data:`END_FILES` are removed: they describe the run where the invocation
    before ended (``summary.json`` ``finished`` at its old ``steps`` with that step's loss, the
    plot of its curve, the sample of its weights) and, beside a ``config.json`` of the new
    ``steps``, would read as this run's end until this invocation writes its own, or for good
    where it is interrupted (:mod:`models.compare` reuses a run directory whose config matches
    and whose summary says finished).
    """
    if resume:
        for name in END_FILES:
            (out / name).unlink(missing_ok=True)
    write_json(out / "config.json", cfg.to_dict(), allow_nan=True)
    write_json(out / "corpus.json", corpus.describe())
    if cfg.tokenizer == "bpe" and not resume:
        corpus.tokenizer.save(out / "tokenizer.json")


class MetricsLog:
    """``metrics.jsonl`` (one JSON object per row, appended and flushed) and, with
    ``log="tensorboard"``, the same numbers as TensorBoard scalars in ``out/tensorboard``.

    A resumed run's TensorBoard writer purges the events of the steps after its checkpoint
    (``purge_step``), as ``metrics.jsonl`` drops their rows: a run killed after it logged them
    produces them again, and TensorBoard would otherwise show both.

    Args:
        out: the run directory.
        rows: the rows already there (kept, and extended by :meth:`append`).
        write: whether this process writes (rank 0).
        log: ``none`` or ``tensorboard`` (skipped with a warning if it is not installed).
        resumed_at: the step of the checkpoint a resumed run starts from (``None``: fresh).
    """

    def __init__(self, out: Path, rows: list[dict], write: bool, log: str = "none",
                 resumed_at: int | None = None) -> None:
        self.path, self.rows, self.tensorboard = out / "metrics.jsonl", rows, None
        self.file = open(self.path, "a") if write else None  # noqa: SIM115 - until close()
        if write and log == "tensorboard":
            self.tensorboard = _tensorboard_writer(
                out / "tensorboard", None if resumed_at is None else resumed_at + 1)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(row, allow_nan=False) + "\n")
            self.file.flush()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        if self.tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) \
                        and not isinstance(value, bool):
                    self.tensorboard.add_scalar(key, value, row["step"])

    def close(self) -> None:
        """Close the file (and the TensorBoard log).

        Raises:
            OSError: naming ``metrics.jsonl`` when the rows still buffered cannot be written
                (after a failed :meth:`append` on a full disk the buffer still holds its row, and
                closing tries again: the error the trainer reports must still name the file).
        """
        try:
            if self.file is not None:
                file, self.file = self.file, None
                file.close()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        finally:
            if self.tensorboard is not None:
                self.tensorboard.close()
                self.tensorboard = None


def _tensorboard_writer(path: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn("log='tensorboard' needs the tensorboard package (pip install "
                      "tensorboard); training without it, metrics.jsonl has every number",
                      RuntimeWarning, stacklevel=3)
        return None
    return SummaryWriter(log_dir=str(path), purge_step=purge_step)


def load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, checked: every saved per-parameter state must arrive.

    An optimizer that silently drops state (as an early ``CombinedOptimizer`` did) would make a
    resumed run differ from an uninterrupted one; that is refused instead.
    """
    optimizer.load_state_dict(state)
    if len(optimizer.state_dict()["state"]) != len(state["state"]):
        raise RunError("the optimizer lost its per-parameter state while loading the "
                       "checkpoint; cannot resume exactly")


def restore_state(ckpt: dict, model, optimizer, sampler, precision, rank: int,
                  world_size: int, seed: int, out: str | Path = "the run directory") -> None:
    """Load a checkpoint's model, optimizer, sampler, loss scale and RNG state.

    Every rank takes its own saved RNG stream when the world size is the one the checkpoint
    was written with; otherwise rank 0's, with fresh streams for the other ranks. A sharded
    checkpoint (an FSDP run's) is read into this job's shards by every rank
    (:func:`~models.sharded_checkpoint.load_sharded_checkpoint`), whatever number of processes
    wrote it.

    Raises:
        CheckpointError: a part that does not fit (a sealed checkpoint of another version of
            the program, or an edited one), naming the part, ``out`` and the mismatch.
    """
    from .job import set_rank_rng

    per_rank = ckpt.get("rng_per_rank")
    same_world = per_rank is not None and len(per_rank) == world_size
    if SHARDS in ckpt:  # an FSDP run's: every rank reads its shards (a collective)
        _restore_part("model and optimizer", out,
                      lambda s: load_sharded_checkpoint(Path(out), s, model, optimizer), ckpt)
    else:
        _restore_part("model", out, model.load_state_dict, ckpt["model"])
        _restore_part("optimizer", out, lambda s: load_optimizer_state(optimizer, s),
                      ckpt["optimizer"])
    _restore_part("sampler", out, sampler.load_state_dict, ckpt["sampler"])
    _restore_part("scaler", out, precision.load_state_dict, ckpt.get("scaler", {}))
    _restore_part("rng", out, set_rng_state, per_rank[rank] if same_world else ckpt["rng"])
    if not same_world and world_size > 1:
        set_rank_rng(seed, rank)


def _restore_part(part: str, out: str | Path, load, state) -> None:
    """``load(state)``; what a state that does not fit raises is one :class:`CheckpointError`."""
    try:
        load(state)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        detail = " ".join(str(exc).split())[:500] or type(exc).__name__
        raise CheckpointError(f"cannot resume: the {part} state in {out}'s checkpoint does not "
                              f"fit this program ({detail}); it was written by another version "
                              f"or edited") from None


def resumed_rows(out: Path, step: int) -> list[dict]:
    """The rows of ``out/metrics.jsonl`` up to ``step`` (later ones will be produced again)."""
    return [r for r in read_metrics(out / "metrics.jsonl") if r["step"] <= step]


def summary_of(run, ckpt: dict | None, wall: float, seconds: float) -> dict:
    """The content of ``summary.json`` for ``run`` (a :class:`models.train.Run`).

    ``val_loss`` / ``val_ppl`` are the last evaluation's, and null for a run that diverged
    (whether its training or its validation loss went non-finite): no loss of such a run is its
    final one. ``last_finite_val_loss`` / ``last_finite_val_step`` give its last finite
    evaluation for any run (null before one). ``lr_peak_fraction`` is the largest learning-rate
    multiplier of the schedule, below 1 where the warm-up outlasts the run;
    ``warmup_outlasts_run`` is true where ``warmup_steps >= steps`` (at equality the rate peaks
    at the last step and the schedule never acts, at a fraction of 1); ``sel_anneal_fraction``
    how far through SEL's scale annealing the last update is (below 1 where it outlasts the run,
    null where nothing anneals); ``warnings`` holds what the trainer warned about the
    configuration at the start (those lines).
    """
    from .build import lr_peak_fraction, schedule_warnings, sel_anneal_fraction, warmup_outlasts_run
    from .evaluation import perplexity

    cfg, job = run.cfg, run.job
    last_train = next((r["train_loss"] for r in reversed(run.log.rows)
                       if r.get("train_loss") is not None), None)
    last_eval = next((r for r in reversed(run.log.rows) if r.get("val_loss") is not None), {})
    val = run.last_val if run.last_val is not None and math.isfinite(run.last_val) \
        and run.diverged is None else None
    ppl = perplexity(val) if val is not None else None
    return {
        "val_loss": val, "val_ppl": ppl if ppl is not None and math.isfinite(ppl) else None,
        "last_finite_val_loss": last_eval.get("val_loss"),
        "last_finite_val_step": last_eval.get("step"),
        "lr_peak_fraction": lr_peak_fraction(cfg),
        "warmup_outlasts_run": warmup_outlasts_run(cfg) is not None,
        "sel_anneal_fraction": sel_anneal_fraction(cfg), "warnings": schedule_warnings(cfg),
        "steps": run.step, "tokens": run.tokens, "world_size": job.world_size,
        "wall_time_s": wall, "train_loss": last_train,
        "corpus_fingerprint": run.corpus.fingerprint, "corpus": cfg.corpus,
        "unigram_entropy": unigram_entropy(run.corpus.train, run.corpus.vocab_size),
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "finished": run.diverged is None and run.step >= cfg.steps,
        "diverged": run.diverged is not None, "device": str(job.device), "dtype": cfg.dtype,
        "compile": cfg.compile, "fsdp": cfg.fsdp, "grad_accum_steps": cfg.grad_accum_steps,
        "batch_size_per_rank": cfg.batch_size // job.world_size,
        "tokens_per_s": (run.tokens - (ckpt["tokens"] if ckpt else 0)) / max(seconds, 1e-9)}


def save_run_checkpoint(run) -> None:
    """Write ``checkpoint.pt`` of ``run`` (a :class:`models.train.Run`) at ``run.step``.

    Collectives first, on every rank (owner-only optimizer state is consolidated, every rank's
    RNG state gathered); then rank 0 writes model, optimizer, sampler, loss scale, RNG states,
    step, tokens, configuration and corpus fingerprint, sealed (:func:`save_checkpoint`). Under
    FSDP every rank writes its shards of the model and optimizer beside it
    (:func:`~models.sharded_checkpoint.save_sharded_checkpoint`).
    """
    if not run.cfg.checkpoint:
        return
    if run.cfg.fsdp:
        state = _checkpoint_state(run, all_gather_objects(rng_state(run.job.device)))
        save_sharded_checkpoint(run.out, state, run.model, run.optimizer, run.saved_step,
                                run.job.is_main)
        run.saved_step = max(run.saved_step, run.step)
        return
    consolidate = getattr(run.optimizer, "consolidate_state_dict", None)
    if consolidate is not None:
        consolidate()
    rngs = all_gather_objects(rng_state(run.job.device))
    if not run.job.is_main:
        return
    state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             **_checkpoint_state(run, rngs)}
    save_checkpoint(run.out / CHECKPOINT, state, run.saved_step)
    run.saved_step = max(run.saved_step, run.step)


def _checkpoint_state(run, rngs: list[dict]) -> dict:
    """What a checkpoint holds besides the model and the optimizer (``rngs``: every rank's
    RNG state)."""
    state = {"sampler": run.sampler.state_dict(), "rng": rngs[0], "step": run.step,
             "tokens": run.tokens, "config": run.cfg.to_dict(),
             "world_size": run.job.world_size, "scaler": run.precision.state_dict(),
             "wall_time_s": run.wall_before + time.perf_counter() - run.t_start,
             "corpus_fingerprint": run.corpus.fingerprint, "finished": run.step >= run.cfg.steps}
    if run.corpus.tokens_fingerprint is not None:
        state["tokens_fingerprint"] = run.corpus.tokens_fingerprint
    if run.corpus.tokenizer.sha256 is not None:
        state["tokenizer_sha256"] = run.corpus.tokenizer.sha256
    if run.job.world_size > 1:
        state["rng_per_rank"] = rngs
    return state


def describe_start(run) -> str:
    """The first line a run prints: corpus, model, method, where and how it trains."""
    cfg, job, corpus = run.cfg, run.job, run.corpus
    where = f"{job.world_size} processes ({job.device.type})" if job.world_size > 1 \
        else str(job.device)
    how = f"{cfg.dtype}{', FSDP' if cfg.fsdp else ''}{', compiled' if cfg.compile else ''}" + \
        (f", {cfg.grad_accum_steps} micro-steps" if cfg.grad_accum_steps > 1 else "")
    if run.step:
        return f"resuming {run.out} at step {run.step} on {where} ({how})"
    n_params = sum(p.numel() for p in run.model.parameters())
    policy = "/" + cfg.policy if cfg.optimizer == "manifold-muon" else ""
    return (f"corpus {cfg.corpus}: {corpus.train.numel():,} train / {corpus.val.numel():,} "
            f"val tokens, fingerprint {corpus.fingerprint[:12]}; model {n_params:,} parameters "
            f"({cfg.connection}, {cfg.optimizer}{policy}, sel={cfg.sel}) on {where} ({how})")
