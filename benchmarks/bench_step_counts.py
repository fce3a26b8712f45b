"""Manifold Muon's step counted, device-independently, and timed against torch.optim.Muon, in one run.

    python benchmarks/bench_step_counts.py [--blocks 12] [--width 768] [--only euclidean,stiefel,hetero]
        [--time-blocks 1] [--time-steps 3] [--warmup 10] [--threads 2] [--device cpu] [--anchor auto]

The matrix set is GPT-2 small's: per block four ``width x width`` attention matrices, one
``4 width x width`` and one ``width x 4 width`` MLP matrix (``--blocks 12 --width 768``: 72 matrices,
85M parameters). Gradients are a fixed low-rank signal plus fresh noise each step.

**Counts** (one step after one warm-up step, ``manifoldlib.testing.count_ops``): the ATen operators
that are not views (about one kernel launch each on a GPU), the host synchronizations
(``_local_scalar_dense``, ``nonzero``, ...) and the FLOPs of ``torch.optim.Muon`` and of
``ManifoldMuon`` on the *products* path without host reads (``dual={"spectral": "products",
"sync_free": True}``, the CUDA default: a fixed number of dual iterations), each with its ratio to Muon. They are the same on every
device, so a CPU run predicts a GPU step's launch and synchronization budget.

**Time** (``--time-blocks`` blocks, the optimizer's default path on ``--device``, the median of
``--time-steps`` steps after ``--warmup``, each step against an anchor step on the same gradients run
just before it): ratio to ``torch.optim.Muon``, or to Muon with its Newton-Schulz in float32 where
bfloat16 products are emulated (``--anchor``, see ``_anchors.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _anchors import ANCHORS, bfloat16_line, muon_anchor
from _timing import sync

from manifoldlib.optim import ManifoldMuon
from manifoldlib.testing import count_ops

KINDS = ("euclidean", "stiefel", "hetero")


def shapes(blocks: int, width: int) -> list[tuple[int, int]]:
    """GPT-2's block matrices, ``blocks`` times."""
    return [(width, width)] * 4 * blocks + [(4 * width, width), (width, 4 * width)] * blocks


def make_params(sizes, device) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter((0.02 * torch.randn(m, n, generator=g)).to(device)) for m, n in sizes]


def set_gradients(params, step: int) -> None:
    """A rank-16 signal fixed per shape plus fresh noise (consecutive steps correlate, as in training)."""
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        m, n = p.shape
        gs = torch.Generator().manual_seed(7 * m + n)
        signal = (torch.randn(m, 16, generator=gs) / m**0.5) @ (torch.randn(16, n, generator=gs) / n**0.5)
        p.grad = (signal + 0.3 * torch.randn(m, n, generator=g) / max(m, n) ** 0.5).to(p.device)


def optimizer(kind: str, params, dual=None) -> torch.optim.Optimizer:
    """ManifoldMuon of one kind: every matrix Euclidean or Stiefel, or HETERO (square ones, the
    attention matrices, on Stiefel; the rest, MLP, on DGram)."""
    if kind == "hetero":
        groups = [{"params": [p for p in params if p.size(0) == p.size(1)], "manifold": "stiefel"},
                  {"params": [p for p in params if p.size(0) != p.size(1)], "manifold": "dgram"}]
        return ManifoldMuon(groups, lr=0.02, weight_decay=0.0, dual=dual)
    return ManifoldMuon(params, lr=0.02, weight_decay=0.0, manifold=kind, dual=dual)


def counts(factory, sizes, device):
    params = make_params(sizes, device)
    opt = factory(params)
    set_gradients(params, 0)
    opt.step()
    set_gradients(params, 1)
    return count_ops(opt.step)


def timed(factory, anchor_factory, sizes, device, warmup: int, steps: int) -> tuple[float, float]:
    params, anchor_params = make_params(sizes, device), make_params(sizes, device)
    opt, anchor = factory(params), anchor_factory(anchor_params, lr=0.02, weight_decay=0.0)
    ratios, seconds = [], []
    for step in range(warmup + steps):
        set_gradients(params, step)
        set_gradients(anchor_params, step)
        sync(device)
        t0 = time.perf_counter()
        anchor.step()
        sync(device)
        t1 = time.perf_counter()
        opt.step()
        sync(device)
        t2 = time.perf_counter()
        if step >= warmup:
            ratios.append((t2 - t1) / (t1 - t0))
            seconds.append(t2 - t1)
    return statistics.median(seconds), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--only", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    parser.add_argument("--time-blocks", type=int, default=1, help="blocks of the timed set (0: no timing)")
    parser.add_argument("--time-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--anchor", default="auto", choices=ANCHORS)
    args = parser.parse_args()
    kinds = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; valid: {', '.join(KINDS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = shapes(args.blocks, args.width)
    print(f"{len(sizes)} matrices ({args.blocks} blocks of width {args.width}), {device}, "
          f"{torch.get_num_threads()} threads")
    print("counts: one step, ManifoldMuon on the products path (sync-free)")
    print(f"{'optimizer':28s} {'ops':>7s} {'x Muon':>7s} {'syncs':>6s} {'GFLOP':>9s} {'x Muon':>7s}")
    muon = counts(lambda ps: torch.optim.Muon(ps, lr=0.02), sizes, device)
    print(f"{'torch.optim.Muon':28s} {muon.ops:7d} {1.0:7.2f} {muon.syncs:6d} {muon.flops / 1e9:9.1f} {1.0:7.2f}")
    for kind in kinds:
        c = counts(lambda ps, k=kind: optimizer(k, ps, {"spectral": "products", "sync_free": True}), sizes, device)
        print(f"{'ManifoldMuon ' + kind:28s} {c.ops:7d} {c.ops / muon.ops:7.2f} {c.syncs:6d} "
              f"{c.flops / 1e9:9.1f} {c.flops / max(muon.flops, 1):7.2f}", flush=True)
    if args.time_blocks <= 0:
        return
    label, anchor_factory = muon_anchor(args.anchor, device)
    time_sizes = shapes(args.time_blocks, args.width)
    print(f"time: {len(time_sizes)} matrices, the default path on {device}, median of {args.time_steps} "
          f"steps after {args.warmup}; {bfloat16_line(device)}; anchor: {label}")
    for kind in kinds:
        seconds, ratio = timed(lambda ps, k=kind: optimizer(k, ps), anchor_factory, time_sizes, device,
                               args.warmup, args.time_steps)
        print(f"{'ManifoldMuon ' + kind:28s} {seconds:8.3f} s/step {ratio:6.2f} x anchor", flush=True)


if __name__ == "__main__":
    main()
