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

Usage::

    python benchmarks/bench_distributed.py                 # dim 768, 1 layer, 2 x 3 steps
    python benchmarks/bench_distributed.py --dim 256 --layers 2 --repeats 5

On a shared machine the ratios are only meaningful when nothing else is running; say so when
recording them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from manifoldlib.distributed import assign_owners, rank_loads, run_workers, sharded_apply
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


def _median_step(world_size: int, shapes, mode: str, strategy: str, repeats: int) -> float:
    per_rank = run_workers(timing_job, world_size, shapes, mode, strategy, repeats, timeout=3600.0)
    return statistics.median(max(step) for step in zip(*per_rank))  # slowest rank per step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per job")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all rows")
    parser.add_argument("--strategy", default="size", choices=("size", "round-robin"))
    args = parser.parse_args()
    shapes = layer_shapes(args.dim, args.layers)
    loads = rank_loads(shapes, assign_owners(shapes, 2, args.strategy), 2)
    print(
        f"matrices: {len(shapes)} ({args.layers} layer(s) of dim {args.dim}), float32, "
        f"polar-express msign; strategy {args.strategy}, rank cost shares "
        f"{[round(x / sum(loads), 3) for x in loads]}; median of {args.rounds} rounds x "
        f"{args.repeats} timed steps"
    )
    configs = [
        ("1 process (anchor)", 1, "replicated"),
        ("2 processes, replicated", 2, "replicated"),
        ("2 processes, sharded", 2, "sharded"),
        ("2 processes, gather only", 2, "gather"),
    ]
    # interleave the configurations over rounds so slow drift in the machine's load hits all
    samples: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for _ in range(args.rounds):
        for name, world_size, mode in configs:
            samples[name].append(
                _median_step(world_size, shapes, mode, args.strategy, args.repeats)
            )
    rows = [(name, statistics.median(samples[name])) for name, _, _ in configs]
    anchor = rows[0][1]
    print(f"{'':28s} {'s/step':>9s} {'time ratio to anchor':>21s}")
    for name, seconds in rows:
        print(f"{name:28s} {seconds:9.4f} {seconds / anchor:21.3f}")
    print(
        f"speedup of sharded over 1 process: {anchor / rows[2][1]:.2f}x; "
        f"over 2-process replicated: {rows[1][1] / rows[2][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
