"""The timing harness shared by the ``bench_*.py`` scripts: round-robin rounds against an anchor.

Every candidate runs once per round, one after the other, for ``repeats`` rounds, so a load spike
on a shared machine hits the anchor and the candidates alike. Scripts import it as a sibling
module (``python benchmarks/bench_x.py`` puts ``benchmarks/`` on ``sys.path``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device | str) -> None:
    """Wait for queued device work, so a timer measures the work and not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def round_robin(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device | str = "cpu",
    warmup: int = 2,
) -> dict[str, list[float]]:
    """Seconds per call of every candidate, one call per round, ``repeats`` rounds.

    ``warmup`` untimed calls of each candidate come first (allocator, kernels, compilation).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def round_robin_ms(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device | str = "cpu",
    warmup: int = 2,
) -> dict[str, tuple[float, float]]:
    """``{name: (median ms, median of the per-round ratio to the first candidate)}``."""
    times = round_robin(fns, repeats, device, warmup)
    anchor = times[next(iter(fns))]
    return {
        name: (1e3 * statistics.median(t), statistics.median(a / b for a, b in zip(t, anchor)))
        for name, t in times.items()
    }


def median_min_table(times: dict[str, list[float]], anchor: str, width: int = 40) -> list[str]:
    """Rows ``name  median  ratio  min  ratio``: each statistic over rounds, divided by the
    anchor's same statistic (the minimum is the less load-sensitive one on a shared CPU)."""
    base, base_min = statistics.median(times[anchor]), min(times[anchor])
    rows = [f"{'variant':{width}s} {'median':>9s} {'ratio':>6s} {'min':>9s} {'ratio':>6s}"]
    for name, ts in times.items():
        t, t_min = statistics.median(ts), min(ts)
        rows.append(
            f"{name:{width}s} {t * 1e3:7.2f}ms {t / base:6.3f} {t_min * 1e3:7.2f}ms {t_min / base_min:6.3f}"
        )
    return rows


def add_device_arguments(parser) -> None:
    """``--device``, ``--threads`` (0: leave torch's default) and ``--dtype`` options."""
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])


def apply_device_arguments(args) -> tuple[torch.device, torch.dtype]:
    """Set the thread count from ``args`` and return ``(device, dtype)``."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return torch.device(args.device), getattr(torch, args.dtype)
