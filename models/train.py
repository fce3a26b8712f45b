"""Train the reference GPT: ``python -m models.train [--preset NAME] [--config FILE.toml]
[--out DIR] [--steps N] [--corpus stdlib|file:PATH] [--resume] [--key value ...]``.

A run directory holds

- ``config.json`` — the full :class:`~models.config.TrainConfig`;
- ``metrics.jsonl`` — one JSON object per logged step: ``step``, ``train_loss``, ``lr``,
  ``tokens``, ``grad_norm``, ``tokens_per_s``, and at evaluations ``val_loss``, ``val_ppl`` and
  diagnostics (largest q/k spectral norm, maximum attention logit);
- ``loss.png`` — the curves; ``sample.txt`` — text generated at the end;
- ``checkpoint.pt`` — model, optimizer, RNG states (torch, numpy, python; under torchrun also
  every rank's, ``rng_per_rank``), the data sampler's position and ``world_size``, as tensors
  and plain data sealed with a checksum, written atomically (:mod:`models.run_dir`), with the
  one before it kept as ``checkpoint.prev.pt``; ``--resume`` continues it exactly, so the
  losses equal an uninterrupted run's;
- ``summary.json`` — ``val_loss``, ``val_ppl``, ``steps``, ``tokens``, ``world_size``,
  ``wall_time_s``, ``corpus_fingerprint`` and more.

Problems with the user's input (a bad corpus path, a non-empty run directory, a bad override,
a damaged or foreign checkpoint) print one ``error:`` line and exit with status 2; a file-system
fault (a full disk, an unwritable directory) prints one line naming the path and the cause and
exits with status 1; a non-finite loss or gradient norm stops the run with status 3 and keeps
the last good checkpoint; Ctrl-C exits with status 130. None of them prints a traceback.

Distributed data parallel: ``python -m torch.distributed.run --standalone --nproc_per_node=N -m
models.train ...`` trains one model with :class:`~torch.nn.parallel.DistributedDataParallel`
(gloo on CPU, nccl on CUDA, one device per rank). Every rank draws the same global batch of
``batch_size`` sequences and trains on its slice (:func:`manifoldlib.distributed.batch_shard`), so
the steps are those of a single process up to floating-point rounding; ``batch_size`` must be
divisible by the number of processes. Only rank 0 writes files; ``--resume`` works the same way.
See ``docs/guides/distributed.rst``.
"""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while the imports below load: one line, no traceback
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write("interrupted\n"), os._exit(130)))

import argparse
import contextlib
import json
import math
import random
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from manifoldlib.distributed import (
    batch_shard,
    destroy_process_group,
    get_rank_world,
    init_from_env,
    is_distributed,
)

from .config import (
    LEGACY_MUON_NS_DTYPE,
    ConfigError,
    TrainConfig,
    build_config,
    load_toml,
    parse_overrides,
)
from .data import (
    BatchSampler,
    Corpus,
    CorpusError,
    check_size,
    eval_batches,
    load_corpus,
    unigram_entropy,
)
from .run_dir import (
    CheckpointError,
    RunError,
    atomic_write,
    check_run_dir,
    clear_stale_run,
    describe_os_error,
    load_checkpoint,
    read_metrics,
    rewrite_metrics,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_json,
)

__all__ = ["RESUMABLE_FIELDS", "MissingModuleError", "RunError", "build_model", "build_optimizer",
           "evaluate", "load_optimizer_state", "lr_scale", "main", "resolve_device",
           "run_training", "save_checkpoint"]

EXIT_ENVIRONMENT = 1
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130

#: Fields that may change when a run is resumed; all others must match the saved config.
RESUMABLE_FIELDS = frozenset({
    "steps", "stop_at", "eval_interval", "eval_batches", "log_interval", "checkpoint",
    "device", "threads", "progress", "sample_tokens", "sample_prompt", "temperature", "top_k",
    "muon_distributed"})


class MissingModuleError(RunError):
    """A configuration needs a module of the project that does not exist (yet)."""


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


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


class _Dist:
    """This process's place in the job: rank, world size, device, and the few collectives used.

    Outside ``torchrun`` (and without an initialized process group) it is rank 0 of 1 and every
    collective is the identity.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0

    def mean(self, value: float, device: torch.device) -> float:
        """The mean of ``value`` over ranks (``sum / W``; gloo has no ``AVG``)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t) / self.world_size

    def from_main(self, value: float, device: torch.device) -> float:
        """Rank 0's ``value`` on every rank, so decisions (stop, diverge) are taken together."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.broadcast(t, src=0)
        return float(t)

    def gather(self, obj):
        """``[obj_rank0, obj_rank1, ...]`` on every rank (picklable objects)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def raise_together(self, error: Exception | None) -> None:
        """Raise on *every* rank if any rank failed its checks, instead of leaving the others
        waiting in a collective until the timeout. Also a barrier."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        reports = self.gather(None if error is None else (type(error).__name__, str(error)))
        if error is not None:
            raise error
        failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
        if failed:
            r, (kind, message) = failed[0]
            raise RunError(f"rank {r} failed ({kind}): {message}")


def _start_distributed(device: torch.device) -> tuple[_Dist, int, bool]:
    """Join the torchrun job (if any): ``(dist info, local rank, whether we own the group)``.

    An already initialized default group (e.g. a test harness) is used as it is.
    """
    if is_distributed():
        rank, world_size = get_rank_world()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return _Dist(rank, world_size), local_rank, False
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 \
            and device.type not in ("cpu", "cuda"):
        raise RunError(f"distributed training runs on cpu (gloo) or cuda (nccl), not on "
                       f"{device.type}; pass --device cpu or --device cuda")
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        rank, world_size, local_rank = init_from_env(backend)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    return _Dist(rank, world_size), local_rank, is_distributed()


def perplexity(loss: float) -> float:
    """``exp(loss)``, ``inf`` on overflow."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _json_float(x: float | None) -> float | None:
    """JSON has no NaN/inf: non-finite values are written as null."""
    return x if x is not None and math.isfinite(x) else None


def lr_scale(step: int, cfg: TrainConfig) -> float:
    """Learning-rate multiplier for the update that produces step ``step + 1``.

    Linear warm-up over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio``.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------------------
# Model and optimizer
# --------------------------------------------------------------------------------------------


def _import(module: str, what: str, why: str):
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingModuleError(f"{why} needs {module}.{what}, which is not available yet "
                                 f"({exc})") from None
    if not hasattr(mod, what):
        raise MissingModuleError(f"{why} needs {module}.{what}, which is not available yet")
    return getattr(mod, what)


def build_model(cfg: TrainConfig, vocab_size: int) -> torch.nn.Module:
    """The reference GPT for ``cfg`` (fields shared with ``GPTConfig`` are passed through)."""
    import dataclasses

    gpt_cls = _import("models.gpt", "GPT", "training")
    gpt_config_cls = _import("models.gpt", "GPTConfig", "training")
    names = {f.name for f in dataclasses.fields(gpt_config_cls)}
    kwargs = {k: v for k, v in cfg.to_dict().items() if k in names}
    kwargs["vocab_size"] = vocab_size
    try:
        gpt_config = gpt_config_cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model = gpt_cls(gpt_config)
    if cfg.sel != "none":
        apply_sel(model, cfg.sel)
    return model


#: SEL variants of ``TrainConfig.sel`` -> keyword options of ``manifoldlib.charts.SEL``.
SEL_OPTIONS = {
    "mismatched": {"init": "mismatched"},
    "congruent": {"init": "congruent"},
    "no-linear": {"linear": False},
}


def _is_block_linear(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and (".attn." in f".{name}." or
                                                   ".mlp." in f".{name}.")


def apply_sel(model: torch.nn.Module, variant: str) -> None:
    """Put a SEL chart on every attention and MLP linear map of ``model``."""
    import functools

    sel = _import("manifoldlib.charts", "SEL", f"sel={variant!r}")
    apply_chart = _import("manifoldlib.charts", "apply_chart", f"sel={variant!r}")
    apply_chart(model, functools.partial(sel, **SEL_OPTIONS[variant]), include=_is_block_linear)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, *, world_size: int = 1
                    ) -> tuple[torch.optim.Optimizer, list]:
    """The optimizer and one learning-rate multiplier ``mult(step) -> float`` per param group.

    ``adamw``: AdamW with weight decay on matrices only; with SEL charts the groups come from
    ``manifoldlib.charts.sel_param_groups`` (scales at ``sel_scale_lr``) and, when
    ``sel_anneal_steps > 0``, the seed's scale annealing multipliers. ``manifold-muon``:
    ``manifoldlib.optim.build_optimizer(model, policy=...)``, its Euclidean Newton–Schulz in
    ``cfg.muon_ns_dtype`` (``auto``: bfloat16 only where it is native). The warm-up / decay
    schedule of :func:`lr_scale` multiplies all of them.

    With ``world_size > 1`` ManifoldMuon runs in ``cfg.muon_distributed`` mode (``sharded``:
    each matrix's dual solve and retraction on one rank, results shared by ``all_gather``;
    ``replicated``: every rank solves every matrix). Build it on the unwrapped model, before
    the DDP wrap, so the parameter names carry no ``module.`` prefix.
    """
    if cfg.optimizer == "manifold-muon":
        if cfg.sel != "none":
            raise ConfigError(f"sel={cfg.sel!r} with optimizer='manifold-muon' is not supported: "
                              f"the policy would constrain SEL's raw coordinates; use adamw")
        builder = _import("manifoldlib.optim", "build_optimizer", "optimizer='manifold-muon'")
        extra = {"distributed": cfg.muon_distributed} if world_size > 1 else {}
        try:
            opt = builder(model, policy=cfg.policy, lr=cfg.lr, adamw_lr=cfg.adamw_lr,
                          adamw_betas=(cfg.beta1, cfg.beta2),
                          adamw_weight_decay=cfg.weight_decay, ns_dtype=cfg.muon_ns_dtype, **extra)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return opt, [_constant] * len(opt.param_groups)
    if cfg.sel != "none":
        sel_param_groups = _import("manifoldlib.charts", "sel_param_groups", f"sel={cfg.sel!r}")
        groups = sel_param_groups(model, lr=cfg.lr, scale_lr=cfg.sel_scale_lr or cfg.lr,
                                  weight_decay=cfg.weight_decay)
    else:
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)
    if cfg.sel != "none" and cfg.sel_anneal_steps > 0:
        sel_lr_lambdas = _import("manifoldlib.charts", "sel_lr_lambdas", f"sel={cfg.sel!r}")
        return opt, sel_lr_lambdas(opt, cfg.sel_anneal_steps)
    return opt, [_constant] * len(opt.param_groups)


def _constant(step: int) -> float:
    return 1.0


# --------------------------------------------------------------------------------------------
# Evaluation and diagnostics
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig, device: torch.device
             ) -> float:
    """Mean validation loss over ``eval_batches`` fixed batches (no random state is touched)."""
    was_training = model.training
    model.eval()
    losses = []
    for x, y in eval_batches(corpus.val, cfg.batch_size, cfg.block_size, cfg.eval_batches):
        _, loss = model(x.to(device), y.to(device))
        losses.append(float(loss))
    model.train(was_training)
    return sum(losses) / len(losses)


@torch.no_grad()
def diagnostics(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig, device: torch.device
                ) -> dict:
    """Largest spectral norm of the attention ``q`` / ``k`` maps; over the layers, the largest
    attention logit, the smallest mean attention entropy and the largest mean max-probability;
    the mean and largest rotation angle of the sphere residuals (radians); the heavy-tail
    statistics of the (effective) block weights: mean kurtosis (3 for a Gaussian) and the largest
    max|w|/std."""
    out: dict[str, float] = {}
    qk = {"q": [], "k": []}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in qk and ".attn" in f".{name}" and isinstance(module, torch.nn.Linear):
            qk[last].append(float(torch.linalg.matrix_norm(module.weight.float(), ord=2)))
    for key, values in qk.items():
        if values:
            out[f"{key}_spectral_norm_max"] = max(values)
    x = None
    if hasattr(model, "attention_statistics") or hasattr(model, "step_angles"):
        x, _ = next(eval_batches(corpus.val, min(cfg.batch_size, 4), cfg.block_size, 1))
        x = x.to(device)
    if hasattr(model, "attention_statistics"):
        layers = model.attention_statistics(x)
        out["max_attention_logit"] = max(layer["max_logit"] for layer in layers)
        out["attention_entropy_min"] = min(layer["entropy"] for layer in layers)
        out["attention_max_prob"] = max(layer["max_prob"] for layer in layers)
    kurtosis, ratios = [], []
    for name, module in model.named_modules():
        if name.startswith("blocks.") and isinstance(module, torch.nn.Linear):
            w = module.weight.detach().double().flatten()  # the effective weight under a chart
            centered = w - w.mean()
            var = float(centered.square().mean())
            if var > 0:
                kurtosis.append(float(centered.pow(4).mean()) / var**2)
                ratios.append(float(w.abs().max()) / math.sqrt(var))
    if kurtosis:
        out["weight_kurtosis_mean"] = sum(kurtosis) / len(kurtosis)
        out["weight_max_over_std"] = max(ratios)
    if hasattr(model, "step_angles"):
        angles = model.step_angles(x)
        if angles:
            out["step_angle_mean"] = sum(angles) / len(angles)
            out["step_angle_max"] = max(angles)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def generate_sample(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig,
                    device: torch.device) -> str:
    """``sample_tokens`` tokens after ``sample_prompt``, decoded (reproducible: own generator)."""
    prompt = corpus.tokenizer.encode(cfg.sample_prompt.encode()) or [int(corpus.train[0])]
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    was_training = model.training
    model.eval()
    out = model.generate(idx, cfg.sample_tokens, temperature=cfg.temperature,
                         top_k=cfg.top_k or None, generator=gen)  # (1, T0 + n)
    model.train(was_training)
    return corpus.tokenizer.decode(out[0].tolist())


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, checked: every saved per-parameter state must arrive.

    An optimizer that silently drops state (as an early ``CombinedOptimizer`` did) would make a
    resumed run differ from an uninterrupted one; that is refused instead.
    """
    optimizer.load_state_dict(state)
    if len(optimizer.state_dict()["state"]) != len(state["state"]):
        raise RunError("the optimizer lost its per-parameter state while loading the "
                       "checkpoint; cannot resume exactly")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class _Echo:
    """Prints progress lines; through tqdm when a bar is active."""

    def __init__(self, enabled: bool, bar) -> None:
        self.enabled, self.bar = enabled, bar

    def __call__(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(text)
        else:
            print(text, flush=True)


def _make_bar(cfg: TrainConfig, start: int, enabled: bool):
    if not (enabled and cfg.progress and sys.stderr.isatty()):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a nicety: train without it
        return None
    return tqdm(total=cfg.last_step, initial=start, unit="step", dynamic_ncols=True,
                file=sys.stderr)


def _with_legacy_defaults(saved: dict) -> dict:
    """A saved configuration with the values that runs made before a field existed used
    (``muon_ns_dtype``: bfloat16), so that resuming such a run repeats its computation."""
    return {"muon_ns_dtype": LEGACY_MUON_NS_DTYPE, **saved}


def _check_resumable(saved: TrainConfig, new: TrainConfig) -> None:
    changed = [f"{k} ({getattr(saved, k)!r} -> {getattr(new, k)!r})"
               for k in saved.to_dict() if k not in RESUMABLE_FIELDS
               and getattr(saved, k) != getattr(new, k)]
    if changed:
        raise RunError("cannot resume with a different configuration: " + ", ".join(changed)
                       + f"; only {', '.join(sorted(RESUMABLE_FIELDS))} may change")


def _check_world_size(cfg: TrainConfig, world_size: int) -> None:
    if cfg.batch_size % world_size:
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by the {world_size} "
                          f"processes of this job; the global batch is split evenly across "
                          f"ranks, so choose a multiple of {world_size}")


def _set_rank_rng(cfg: TrainConfig, rank: int) -> None:
    # Rank 0 keeps the single-process stream; the others get their own (dropout masks differ
    # across ranks as they would across the rows of one process's batch).
    if rank > 0:
        torch.manual_seed(cfg.seed * 1_000_003 + rank)


def run_training(cfg: TrainConfig, out: str | Path, *, resume: bool = False,
                 echo: bool = True) -> dict:
    """Train (or resume) one run in the directory ``out`` and return its summary.

    Under ``torchrun`` (or inside an initialized default process group) every rank calls this;
    the model is wrapped in :class:`~torch.nn.parallel.DistributedDataParallel`, each rank
    trains on its slice of the same global batch, and only rank 0 writes files.

    Args:
        cfg: the configuration (on resume it must match the saved one except
            :data:`RESUMABLE_FIELDS`).
        out: run directory (on a filesystem every rank sees).
        resume: continue from ``out/checkpoint.pt``.
        echo: print progress lines and the final sample (rank 0 only).

    Returns:
        The summary dict written to ``summary.json`` (``diverged`` is True when the loss became
        non-finite; the run then stopped early and the last good checkpoint was kept).

    Raises:
        CorpusError, ConfigError, RunError: bad input; nothing was trained (on every rank).
    """
    out = Path(out)
    device = resolve_device(cfg.device)
    ctx, local_rank, owns_group = _start_distributed(device)
    try:
        if ctx.world_size > 1 and device.type == "cuda":
            device = torch.device("cuda", local_rank)
        return _train(cfg, out, resume, echo, ctx, device)
    finally:
        if owns_group:
            destroy_process_group()


def _train(cfg: TrainConfig, out: Path, resume: bool, echo: bool, ctx: _Dist,
           device: torch.device) -> dict:
    rank, world_size, is_main = ctx.rank, ctx.world_size, ctx.is_main
    if cfg.threads:
        torch.set_num_threads(cfg.threads)

    # ---- checks: every rank runs them, all fail together --------------------------------
    ckpt, corpus, error, stale = None, None, None, False
    tokenizer_path = out / "tokenizer.json"
    try:
        _check_world_size(cfg, world_size)
        stale = check_run_dir(out, resume)
        if resume:
            ckpt, note = load_checkpoint(out, move_damaged=is_main)
            if note is not None and echo and is_main:
                print(f"warning: {note}", file=sys.stderr, flush=True)
            try:
                saved_cfg = TrainConfig(**_with_legacy_defaults(ckpt["config"]))
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"the configuration saved in {out}'s checkpoint is not "
                                      f"valid: {exc}") from None
            _check_resumable(saved_cfg, cfg)
            if ckpt["step"] < cfg.steps and cfg.last_step <= ckpt["step"]:
                raise RunError(f"cannot resume {out} to step {cfg.last_step}: its checkpoint "
                               f"is already at step {ckpt['step']}")
        if ckpt is None or ckpt["step"] < cfg.steps:
            corpus = load_corpus(cfg.corpus, val_fraction=cfg.val_fraction,
                                 tokenizer=cfg.tokenizer, bpe_vocab_size=cfg.bpe_vocab_size,
                                 tokenizer_path=tokenizer_path
                                 if resume and cfg.tokenizer == "bpe" else None)
            check_size(corpus, cfg.batch_size, cfg.block_size)
            if ckpt is not None and ckpt["corpus_fingerprint"] != corpus.fingerprint:
                raise RunError(f"cannot resume: corpus {cfg.corpus!r} changed since the run "
                               f"started (fingerprint {corpus.fingerprint[:12]} != "
                               f"{ckpt['corpus_fingerprint'][:12]}), so the data order would "
                               f"differ")
    except (ConfigError, CorpusError, RunError) as exc:
        error = exc
    ctx.raise_together(error)  # also the barrier before rank 0 creates the directory
    if ckpt is not None and ckpt["step"] >= cfg.steps:
        if echo and is_main:
            print(f"run in {out} already finished at step {ckpt['step']} "
                  f"(steps={cfg.steps}); nothing to do", flush=True)
        summary_path = out / "summary.json"
        return json.loads(summary_path.read_text()) if summary_path.exists() else {}
    fingerprints = ctx.gather(corpus.fingerprint)
    if len(set(fingerprints)) != 1:
        raise RunError(f"the ranks loaded different corpora (fingerprints "
                       f"{[f[:12] for f in fingerprints]}); every rank must see the same "
                       f"{cfg.corpus!r}")
    if is_main and not resume:
        out.mkdir(parents=True, exist_ok=True)
        if stale:  # a run that stopped before its first checkpoint: start it again cleanly
            clear_stale_run(out)

    # ---- model, optimizer, data: identical on every rank ---------------------------------
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    model = build_model(cfg, corpus.vocab_size).to(device)
    optimizer, multipliers = build_optimizer(model, cfg, world_size=world_size)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    # rank 0's sampler on every rank: all ranks draw the same global batch, then take a slice
    sampler = BatchSampler(corpus.train, cfg.batch_size, cfg.block_size, cfg.seed, 0)
    shard = batch_shard(cfg.batch_size, rank, world_size)
    _set_rank_rng(cfg, rank)

    start_step, tokens, wall_before, saved_step = 0, 0, 0.0, -1
    metrics_path = out / "metrics.jsonl"
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        load_optimizer_state(optimizer, ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])
        per_rank = ckpt.get("rng_per_rank")
        same_world = per_rank is not None and len(per_rank) == world_size
        set_rng_state(per_rank[rank] if same_world else ckpt["rng"])
        if not same_world and world_size > 1:
            _set_rank_rng(cfg, rank)
        start_step, tokens = ckpt["step"], ckpt["tokens"]
        wall_before, saved_step = ckpt["wall_time_s"], ckpt["step"]
        rows = [r for r in read_metrics(metrics_path) if r["step"] <= start_step]
    else:
        rows = []
    ctx.raise_together(None)  # every rank has read metrics.jsonl before rank 0 rewrites it
    if is_main and ckpt is not None:  # rows logged after the checkpoint will be produced again
        rewrite_metrics(metrics_path, rows)
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        trained = model
    unigram = unigram_entropy(corpus.train, corpus.vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    if is_main:
        write_json(out / "config.json", cfg.to_dict(), allow_nan=True)
        write_json(out / "corpus.json", corpus.describe())
        if cfg.tokenizer == "bpe" and not resume:
            corpus.tokenizer.save(tokenizer_path)

    bar = _make_bar(cfg, start_step, echo and is_main)
    say = _Echo(echo and is_main, bar)
    where = f"{world_size} processes ({device.type})" if world_size > 1 else str(device)
    if start_step == 0:
        say(f"corpus {cfg.corpus}: {corpus.train.numel():,} train / {corpus.val.numel():,} val "
            f"tokens, fingerprint {corpus.fingerprint[:12]}, unigram entropy {unigram:.3f} nats; "
            f"model {n_params:,} parameters ({cfg.connection}, {cfg.optimizer}"
            f"{'/' + cfg.policy if cfg.optimizer == 'manifold-muon' else ''}, sel={cfg.sel}) "
            f"on {where}")
    else:
        say(f"resuming {out} at step {start_step} on {where}")

    tokens_per_step = cfg.batch_size * cfg.block_size  # the global batch, whatever the world
    t_start = time.perf_counter()
    t_last, tokens_last = t_start, tokens
    last_val: float | None = None
    diverged: str | None = None
    completed = start_step
    metrics_file = open(metrics_path, "a") if is_main else contextlib.nullcontext()
    trained.train()
    with metrics_file as mf:
        def log(row: dict) -> None:
            rows.append(row)
            if is_main:
                try:
                    mf.write(json.dumps(row, allow_nan=False) + "\n")
                    mf.flush()
                except OSError as exc:
                    raise OSError(exc.errno, exc.strerror, str(metrics_path)) from None

        def checkpoint(step: int) -> None:
            nonlocal saved_step
            if not cfg.checkpoint:
                return
            # collectives first, on every rank: owner-only optimizer state, per-rank RNG
            consolidate = getattr(optimizer, "consolidate_state_dict", None)
            if consolidate is not None:
                consolidate()
            rngs = ctx.gather(rng_state(device))
            if not is_main:
                return
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "sampler": sampler.state_dict(), "rng": rngs[0], "step": step,
                     "tokens": tokens, "config": cfg.to_dict(), "world_size": world_size,
                     "wall_time_s": wall_before + time.perf_counter() - t_start,
                     "corpus_fingerprint": corpus.fingerprint, "finished": step >= cfg.steps}
            if world_size > 1:
                state["rng_per_rank"] = rngs
            save_checkpoint(out / "checkpoint.pt", state, saved_step)
            saved_step = max(saved_step, step)

        for step in range(start_step + 1, cfg.last_step + 1):
            scale = lr_scale(step - 1, cfg)
            for group, base, mult in zip(optimizer.param_groups, base_lrs, multipliers):
                group["lr"] = base * scale * mult(step - 1)
            x, y = sampler.next_batch()  # (B, T) each: the global batch
            x, y = x[shard], y[shard]  # (B / W, T): this rank's rows
            _, loss = trained(x.to(device), y.to(device))
            loss_value = ctx.mean(float(loss.detach()), device)  # the global batch's mean loss
            if not math.isfinite(loss_value):
                diverged = f"non-finite training loss ({loss_value}) at step {step}"
                log({"step": step, "train_loss": None, "lr": cfg.lr * scale, "tokens": tokens,
                     "diverged": True})
                break
            loss.backward()  # DDP averages the gradients over ranks
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            if not math.isfinite(grad_norm):  # before the step: parameters never see it
                diverged = f"non-finite gradient norm ({grad_norm}) at step {step}"
                optimizer.zero_grad(set_to_none=True)
                log({"step": step, "train_loss": loss_value, "lr": cfg.lr * scale,
                     "tokens": tokens, "grad_norm": None, "diverged": True})
                break
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tokens += tokens_per_step
            completed = step
            if bar is not None:
                bar.update(1)
            is_eval = step % cfg.eval_interval == 0 or step == cfg.last_step
            if not (is_eval or step % cfg.log_interval == 0):
                continue
            now = time.perf_counter()
            row = {"step": step, "train_loss": loss_value, "lr": cfg.lr * scale,
                   "tokens": tokens, "grad_norm": _json_float(grad_norm),
                   "tokens_per_s": (tokens - tokens_last) / max(now - t_last, 1e-9)}
            t_last, tokens_last = now, tokens
            if is_eval:
                # every rank evaluates the unwrapped model (a DDP forward on rank 0 alone could
                # wait for its peers); rank 0's value decides for all
                last_val = ctx.from_main(evaluate(model, corpus, cfg, device), device)
                if not math.isfinite(last_val):
                    diverged = f"non-finite validation loss ({last_val}) at step {step}"
                    row.update(val_loss=None, diverged=True)
                    log(row)
                    break
                row.update(val_loss=last_val, val_ppl=_json_float(perplexity(last_val)))
                if is_main:
                    row.update(diagnostics(model, corpus, cfg, device))
            log(row)
            if bar is not None:
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            if is_eval:
                say(f"step {step}/{cfg.steps}: train {loss_value:.4f}, val {last_val:.4f} "
                    f"(ppl {perplexity(last_val):.2f}), {row['tokens_per_s']:.0f} tok/s")
                checkpoint(step)
    if bar is not None:
        bar.close()

    wall = wall_before + time.perf_counter() - t_start
    finished = diverged is None and completed >= cfg.steps
    last_train = next((r["train_loss"] for r in reversed(rows)
                       if r.get("train_loss") is not None), None)
    run_tokens = tokens - (ckpt["tokens"] if ckpt else 0)
    summary = {
        "val_loss": _json_float(last_val),
        "val_ppl": _json_float(perplexity(last_val)) if last_val is not None else None,
        "steps": completed, "tokens": tokens, "world_size": world_size, "wall_time_s": wall,
        "corpus_fingerprint": corpus.fingerprint, "train_loss": last_train,
        "unigram_entropy": unigram, "parameters": n_params, "finished": finished,
        "diverged": diverged is not None, "device": str(device), "corpus": cfg.corpus,
        "batch_size_per_rank": cfg.batch_size // world_size,
        "tokens_per_s": run_tokens / max(time.perf_counter() - t_start, 1e-9)}
    if diverged is not None:
        kept = (f"the last good checkpoint (step {saved_step}) is kept in {out}"
                if saved_step >= 0 else "no checkpoint had been written yet")
        summary["error"] = f"{diverged}; {kept}"
        say(f"stopped: {summary['error']}")
    elif finished and cfg.sample_tokens > 0 and is_main:
        sample = generate_sample(model, corpus, cfg, device)
        atomic_write(out / "sample.txt", sample.encode())
        say("--- sample ---\n" + sample + "\n--------------")
    if is_main:
        write_json(out / "summary.json", summary)
        from .plotting import plot_run

        plot_run(rows, out / "loss.png", title=f"{cfg.connection} / {cfg.optimizer} "
                 f"/ sel={cfg.sel} on {cfg.corpus}", reference=unigram)
    if diverged is None and finished:
        say(f"done: val loss {last_val:.4f} (ppl {perplexity(last_val):.2f}, unigram entropy "
            f"{unigram:.3f}), {tokens:,} tokens in {wall:.1f} s; run directory {out}")
    ctx.raise_together(None)  # no rank returns before rank 0 has written the run directory
    return summary


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump, caught in main
        raise _ArgumentError(message)


def _parser() -> argparse.ArgumentParser:
    import dataclasses
    import textwrap

    fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(TrainConfig))
    epilog = "config fields (--key value), defaults before a preset applies:\n" + textwrap.fill(
        fields, width=96, initial_indent="  ", subsequent_indent="  ")
    p = _Parser(
        allow_abbrev=False, prog="python -m models.train", epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train the reference GPT. Any config field can be overridden with "
                    "--key value (e.g. --lr 1e-3 --connection pre-ln).")
    p.add_argument("--preset", help="named preset: smoke, default (default: default)")
    p.add_argument("--config", help="TOML file of config fields (may name a preset)")
    p.add_argument("--out", help="run directory (default: runs/<preset>)")
    p.add_argument("--steps", help="total optimizer steps")
    p.add_argument("--corpus", help="stdlib | file:PATH | synthetic[:NBYTES]")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, dict]:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)
    for key in ("steps", "corpus"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    return args, overrides


def config_from_args(args: argparse.Namespace, overrides: dict, out: Path) -> TrainConfig:
    """The run's configuration.

    A fresh run layers preset (``default`` unless ``--preset`` / a TOML ``preset`` key says
    otherwise), TOML file and overrides. ``--resume`` starts from the saved ``config.json``
    instead (``--preset`` is ignored, ``stop_at`` is cleared) and applies the TOML file and
    overrides on top; :func:`run_training` then refuses changes outside
    :data:`RESUMABLE_FIELDS`.
    """
    saved = out / "config.json"
    if args.resume and saved.is_file():
        try:
            base = _with_legacy_defaults(json.loads(saved.read_text()))
            if not isinstance(base, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise RunError(f"cannot resume: {saved} is not a valid configuration ({exc}); "
                           f"it is rewritten from the checkpoint if you delete it") from None
        base["stop_at"] = 0
        toml = load_toml(args.config) if args.config is not None else {}
        toml.pop("preset", None)
        return build_config(overrides={**toml, **overrides}, base=base)
    preset = args.preset if args.preset is not None or args.config is not None else "default"
    return build_config(preset, args.config, overrides)


def _is_rank_zero() -> bool:
    """Rank 0 of a torchrun job, or a plain process (the only one that prints errors)."""
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 file-system fault, 2 bad input,
    3 diverged, 130 interrupted)."""
    argv = sys.argv[1:] if argv is None else argv
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt from here on
    try:
        args, overrides = parse_args(argv)
        if args.out is not None and not args.out.strip():
            raise ConfigError("--out must name a run directory, got ''")
        out = Path(args.out) if args.out else Path("runs") / (args.preset or "default")
        cfg = config_from_args(args, overrides, out)
        summary = run_training(cfg, out, resume=args.resume)
    except (_ArgumentError, ConfigError, CorpusError, RunError) as exc:
        if _is_rank_zero():  # every rank failed with the same message (see _Dist.raise_together)
            print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:  # the environment: a full disk, a directory we may not write, ...
        if _is_rank_zero():
            print(f"error: {describe_os_error(exc)}; the last checkpoint is kept",
                  file=sys.stderr)
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        print("interrupted; resume with --resume (from the last checkpoint)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary.get("diverged"):
        if _is_rank_zero():
            print(f"error: training diverged: {summary.get('error')}", file=sys.stderr)
        return EXIT_DIVERGED
    return 0


if __name__ == "__main__":
    sys.exit(main())
