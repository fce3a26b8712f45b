"""Worker functions of the trainer's FSDP2 tests: importable by spawned processes, no test logic.

Each job is called as ``job(rank, *args)`` by :func:`manifoldlib.distributed.run_workers` inside
an initialized gloo process group and returns plain data for the parent to assert on.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

#: The tiny GPT of the clipping job: the default (spheret) connection, so it has 0-d
#: parameters that FSDP2 leaves whole.
CLIP_MODEL = {"vocab_size": 40, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


def train_runs(rank: int, runs: list[tuple[dict, str, bool]]) -> list[dict]:
    """``models.train.run_training`` for each ``(overrides, out, resume)`` of ``runs`` in turn
    (overrides on top of the ``smoke`` preset); a configuration or run error is returned as
    ``{"error": "Kind: message"}``."""
    from models.config import build_config
    from models.storage import RunError
    from models.train import run_training

    summaries = []
    for overrides, out, resume in runs:
        try:
            cfg = build_config("smoke", overrides=overrides)
            summaries.append(run_training(cfg, out, resume=resume, echo=False))
        except (ValueError, RunError) as error:  # ConfigError, CorpusError, RunError
            summaries.append({"error": f"{type(error).__name__}: {error}"})
    return summaries


def _clip_models() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A plain GPT, an FSDP2-sharded copy of it, and a batch ``(4, 9)`` of token ids (the same
    on every rank)."""
    from models.fsdp import shard_model
    from models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    plain = GPT(GPTConfig(**CLIP_MODEL))
    sharded = GPT(GPTConfig(**CLIP_MODEL))
    sharded.load_state_dict(plain.state_dict())
    shard_model(sharded, "cpu", dist.get_world_size())
    idx = torch.randint(CLIP_MODEL["vocab_size"], (4, 9), generator=torch.Generator().manual_seed(1))
    return plain, sharded, idx


def _backward(model: torch.nn.Module, idx: torch.Tensor, scale: float) -> None:
    _, loss = model(idx[:, :-1], idx[:, 1:])
    (loss * scale).backward()


def clip_job(rank: int, max_norm: float, scale: float) -> dict:
    """Clip the gradients of one batch (every rank the whole batch, so FSDP2's average over
    ranks is the single-process gradient) with :func:`models.clipping.clip_grad_norm`, on the
    plain model and on the sharded one; the loss is multiplied by ``scale`` (``1e19``: every
    square overflows float32). Returns both norms, both clipped gradients (the sharded ones
    gathered whole)."""
    from models.clipping import clip_grad_norm
    from models.fsdp import average_replicated_grads

    plain, sharded, idx = _clip_models()
    _backward(plain, idx, scale)
    _backward(sharded, idx, scale)
    average_replicated_grads(sharded)
    report = {"plain_norm": clip_grad_norm(plain.parameters(), max_norm),
              "sharded_norm": clip_grad_norm(sharded.parameters(), max_norm),
              "placements": sorted({str(tuple(getattr(p, "placements", ())))
                                    for p in sharded.parameters()})}
    report["plain_grads"] = {n: p.grad.clone() for n, p in plain.named_parameters()}
    report["sharded_grads"] = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in sharded.named_parameters()}
    report["finite"] = math.isfinite(report["sharded_norm"])
    return report


def overflow_job(rank: int) -> str:
    """:func:`models.moment_overflow.check_second_moments` on sharded gradients where only the
    last rank's rows hold an entry whose square overflows float32: what this rank's check says
    (every rank must stop)."""
    from models.moment_overflow import SecondMomentOverflow, check_second_moments

    _, sharded, idx = _clip_models()
    _backward(sharded, idx, 1.0)
    params = dict(sharded.named_parameters())
    if rank == dist.get_world_size() - 1:
        params["blocks.0.attn.q.weight"].grad.to_local()[0, 0] = 2e19
    optimizer = torch.optim.AdamW([{"params": list(params.values()),
                                    "param_names": list(params)}])
    try:
        check_second_moments(optimizer, grad_norm=3e19, loss=1.0)
    except SecondMomentOverflow as error:
        return str(error)
    return "no overflow"


def trainer_job(rank: int, runs: list[tuple[dict, str, bool]],
                clip_cases: list[tuple[float, float]]) -> dict:
    """:func:`train_runs` of ``runs``, then :func:`clip_job` for each ``(max_norm, scale)`` and
    :func:`overflow_job`, in one process group."""
    return {"summaries": train_runs(rank, runs),
            "clip": [clip_job(rank, max_norm, scale) for max_norm, scale in clip_cases],
            "overflow": overflow_job(rank)}
