"""Sharded per-matrix work: step time of 1 vs 2 gloo processes on CPU, as ratios.

One "step" is ``sharded_apply`` of a Polar Express ``msign`` (8 Newton–Schulz steps) over the
matrices of ``--layers`` transformer layers of width ``--dim``: q, k, v, o of ``dim x dim`` and the
MLP pair ``dim x 4dim``, ``4dim x dim`` (float32). Every process runs one intra-op thread.

Rows (slowest rank per step; median over ``--repeats`` timed steps after one warm-up, then
median over ``--rounds`` interleaved rounds of all rows):

- ``1 process``: the anchor, everything solved locally.
- ``2 processes, replicated``: every rank solves every matrix (what DDP alone gives).
- ``2 processes, sharded``: each matrix solved by its owner (``--strategy``), one all_gather.
- ``2 processes, gather only``: ``sharded_apply`` of a copy: packing + all_gather overhead.

ManifoldMuon rows (``--muon-dim``, default 256; the same layer shapes, attention matrices on
Stiefel and MLP matrices on DGram, as the ``hetero`` policy): the time of ``optimizer.step()``
with fixed gradients (what every rank holds after DDP's all-reduce), anchored on one process:

- ``muon, 1 process (anchor)``;
- ``muon, 2 processes, replicated``: ``ManifoldMuon(distributed="replicated")``;
- ``muon, 2 processes, sharded``: ``ManifoldMuon(distributed="sharded")``.

Usage::

    python benchmarks/bench_distributed.py                 # dim 768, 1 layer, 2 x 3 steps
    python benchmarks/bench_distributed.py --dim 256 --layers 2 --repeats 5

On a shared machine the ratios are only meaningful when nothing else is running; say so when
recording them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from manifoldlib.distributed import (
    assign_owners,
    rank_loads,
    run_workers,
    sharded_apply,
)
from manifoldlib.functional import msign


def layer_shapes(dim: int, layers: int) -> list[tuple[int, int]]:
    """Matrix shapes of ``layers`` GPT blocks: attention q, k, v, o and the MLP pair."""
    return ([(dim, dim)] * 4 + [(dim, 4 * dim), (4 * dim, dim)]) * layers


def _inputs(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=generator) for s in shapes]


def _solve(i: int, x: torch.Tensor) -> torch.Tensor:
    return msign(x, "polar-express")


def _copy(i: int, x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def timing_job(
    rank: int, shapes: list[tuple[int, int]], mode: str, strategy: str, repeats: int
) -> list[float]:
    """Seconds per step on this rank, after one untimed warm-up step."""
    tensors = _inputs(shapes)
    times = []
    for step in range(repeats + 1):
        if dist.get_world_size() > 1:
            dist.barrier()
        start = time.perf_counter()
        if mode == "replicated":
            results = [_solve(i, t) for i, t in enumerate(tensors)]
        elif mode == "sharded":
            results = sharded_apply(tensors, _solve, strategy=strategy)
        else:  # gather only
            results = sharded_apply(tensors, _copy, strategy=strategy)
        elapsed = time.perf_counter() - start
        assert len(results) == len(tensors)
        if step > 0:
            times.append(elapsed)
    return times


def muon_timing_job(
    rank: int, shapes: list[tuple[int, int]], mode: str, strategy: str, repeats: int
) -> list[float]:
    """Seconds per ``ManifoldMuon.step()`` on this rank, after one untimed warm-up step."""
    from manifoldlib.optim import ManifoldMuon

    generator = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    grads = [torch.randn(s, generator=generator) for s in shapes]
    square = [p for p in params if p.size(0) == p.size(1)]  # attention: Stiefel
    other = [p for p in params if p.size(0) != p.size(1)]  # MLP pair: DGram
    groups = [{"params": square, "manifold": "stiefel"}, {"params": other, "manifold": "dgram"}]
    opt = ManifoldMuon(groups, lr=0.02, distributed=mode, shard_strategy=strategy)
    times = []
    for step in range(repeats + 1):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if dist.get_world_size() > 1:
            dist.barrier()
        start = time.perf_counter()
        opt.step()
        elapsed = time.perf_counter() - start
        if step > 0:
            times.append(elapsed)
    return times


def _median_step(world_size: int, shapes, mode: str, strategy: str, repeats: int) -> float:
    job = timing_job
    if mode.startswith("muon-"):
        job, mode = muon_timing_job, mode[len("muon-"):]
    per_rank = run_workers(job, world_size, shapes, mode, strategy, repeats, timeout=3600.0)
    return statistics.median(max(step) for step in zip(*per_rank))  # slowest rank per step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per job")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all rows")
    parser.add_argument("--strategy", default="size", choices=("size", "round-robin"))
    parser.add_argument("--muon-dim", type=int, default=256, help="width of the ManifoldMuon rows")
    parser.add_argument("--what", default="both", choices=("sharded-apply", "muon", "both"))
    args = parser.parse_args()
    if args.what in ("sharded-apply", "both"):
        _sharded_apply_rows(args)
    if args.what in ("muon", "both"):
        _muon_rows(args)


def _table(configs: list[tuple[str, int, str]], shapes, args) -> list[tuple[str, float]]:
    # interleave the configurations over rounds so slow drift in the machine's load hits all
    samples: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for _ in range(args.rounds):
        for name, world_size, mode in configs:
            samples[name].append(
                _median_step(world_size, shapes, mode, args.strategy, args.repeats)
            )
    rows = [(name, statistics.median(samples[name])) for name, _, _ in configs]
    anchor = rows[0][1]
    print(f"{'':32s} {'s/step':>9s} {'time ratio to anchor':>21s}")
    for name, seconds in rows:
        print(f"{name:32s} {seconds:9.4f} {seconds / anchor:21.3f}")
    return rows


def _muon_rows(args) -> None:
    shapes = layer_shapes(args.muon_dim, args.layers)
    loads = rank_loads(shapes, assign_owners(shapes, 2, args.strategy), 2)
    print(
        f"\nManifoldMuon.step(): {len(shapes)} matrices ({args.layers} layer(s) of dim "
        f"{args.muon_dim}; Stiefel attention, DGram MLP), float32, default options; strategy "
        f"{args.strategy}, rank cost shares {[round(x / sum(loads), 3) for x in loads]}"
    )
    rows = _table(
        [
            ("muon, 1 process (anchor)", 1, "muon-replicated"),
            ("muon, 2 processes, replicated", 2, "muon-replicated"),
            ("muon, 2 processes, sharded", 2, "muon-sharded"),
        ],
        shapes,
        args,
    )
    print(
        f"speedup of sharded over 1 process: {rows[0][1] / rows[2][1]:.2f}x; "
        f"over 2-process replicated: {rows[1][1] / rows[2][1]:.2f}x"
    )


def _sharded_apply_rows(args) -> None:
    shapes = layer_shapes(args.dim, args.layers)
    loads = rank_loads(shapes, assign_owners(shapes, 2, args.strategy), 2)
    print(
        f"matrices: {len(shapes)} ({args.layers} layer(s) of dim {args.dim}), float32, "
        f"polar-express msign; strategy {args.strategy}, rank cost shares "
        f"{[round(x / sum(loads), 3) for x in loads]}; median of {args.rounds} rounds x "
        f"{args.repeats} timed steps"
    )
    rows = _table(
        [
            ("1 process (anchor)", 1, "replicated"),
            ("2 processes, replicated", 2, "replicated"),
            ("2 processes, sharded", 2, "sharded"),
            ("2 processes, gather only", 2, "gather"),
        ],
        shapes,
        args,
    )
    anchor = rows[0][1]
    print(
        f"speedup of sharded over 1 process: {anchor / rows[2][1]:.2f}x; "
        f"over 2-process replicated: {rows[1][1] / rows[2][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
