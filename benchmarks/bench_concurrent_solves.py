"""ManifoldMuon with its matrices solved side by side (``workers``) against one at a time, on a CPU.

For each shape set, three optimizers on the same gradients in one process, stepped in rotating
order each step: ``workers=1`` (the anchor: one matrix at a time, all threads), ``workers="auto"``
(what the optimizer decides; the table prints its decision) and ``workers=<threads>`` (forced side
by side). Prints the median seconds per step and the median of the per-step ratios to the anchor.
A first table times the primitive that motivates it: ``n x n`` eighs and products, one after the
other on all threads against side by side on one thread each.

    python benchmarks/bench_concurrent_solves.py [--steps 4] [--threads 2] [--manifold stiefel]
        [--sets gpt,tall,imbalanced,square,block256] [--scale 1] [--size 768]

``--scale k`` divides every dimension of the sets by ``k`` (a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from manifoldlib.optim import ManifoldMuon
from manifoldlib.optim.concurrent_solves import resolve_workers

SETS = {
    "gpt": [(768, 768), (768, 768), (3072, 768), (768, 3072)],
    "tall": [(3072, 768), (768, 3072)],
    "imbalanced": [(3072, 768), (768, 768)],
    "square": [(768, 768), (768, 768)],
    "block256": [(256, 256), (256, 256), (1024, 256), (256, 1024)] * 2,
}


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _primitives(threads: int, n: int = 768) -> None:
    pool = ThreadPoolExecutor(threads)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4 * n, n, generator=g) for _ in range(threads)]
    grams = [x.mT @ x / x.size(0) for x in xs]

    def side_by_side(fn):
        def run():
            def one(i):
                torch.set_num_threads(1)
                return fn(i)
            list(pool.map(one, range(threads)))
            torch.set_num_threads(threads)
        return run

    def one_after_another(fn):
        return lambda: [fn(i) for i in range(threads)]

    print(f"{threads} x primitive, {threads} threads one after another vs side by side on one thread each")
    print(f"{'primitive':34s} {'after (ms)':>11s} {'side (ms)':>10s} {'ratio':>6s}")
    for name, fn in [
        (f"eigh {n}^2 float32", lambda i: torch.linalg.eigh(grams[i])),
        (f"eigvalsh {n}^2 float32", lambda i: torch.linalg.eigvalsh(grams[i])),
        (f"mm {n}^3 float32", lambda i: grams[i] @ grams[i]),
        (f"Gram {4 * n}x{n} float32", lambda i: xs[i].mT @ xs[i]),
    ]:
        after = _best(one_after_another(fn))
        side = _best(side_by_side(fn))
        print(f"{name:34s} {after * 1e3:11.1f} {side * 1e3:10.1f} {side / after:6.2f}")
    pool.shutdown()


def _params(shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.02 * torch.randn(*s, generator=g)) for s in shapes]


def _gradients(shapes, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    signal = [(torch.randn(m, 16, generator=g) / m**0.5) @ (torch.randn(16, n, generator=g) / n**0.5) for m, n in shapes]
    return [[s + 0.3 * torch.randn(s.shape, generator=g) / max(s.shape) ** 0.5 for s in signal] for _ in range(steps)]


def _compare(name: str, shapes, manifold: str, steps: int, threads: int) -> None:
    configs = {"one at a time": 1, "auto": "auto", f"side by side ({threads})": threads}
    runs = {}
    for label, workers in configs.items():
        params = _params(shapes)
        runs[label] = (params, ManifoldMuon(params, manifold=manifold, lr=0.02, weight_decay=0.0, workers=workers))
    times = {label: [] for label in configs}
    order = list(configs)
    for k, grads in enumerate(_gradients(shapes, steps + 1)):
        for label in order:
            params, opt = runs[label]
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            start = time.perf_counter()
            opt.step()
            if k:  # the first step allocates and builds the first multipliers: not timed
                times[label].append(time.perf_counter() - start)
        order = order[1:] + order[:1]
    anchor = times["one at a time"]
    decided = resolve_workers("auto", shapes, threads)
    print(f"\nset {name}: {len(shapes)} {manifold} matrices {sorted(set(shapes))}, auto decides {decided} worker(s)")
    print(f"{'workers':28s} {'s/step':>8s} {'ratio':>7s}")
    for label in configs:
        ratio = statistics.median(t / a for t, a in zip(times[label], anchor))
        print(f"{label:28s} {statistics.median(times[label]):8.3f} {ratio:7.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one untimed)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--manifold", default="stiefel", help="stiefel or dgram")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {', '.join(SETS)}")
    parser.add_argument("--size", type=int, default=768, help="n of the primitives table")
    parser.add_argument("--scale", type=int, default=1, help="divide every set dimension by this")
    args = parser.parse_args()
    unknown = [s for s in args.sets.split(",") if s not in SETS]
    if unknown:
        raise SystemExit(f"unknown sets {unknown}; valid: {', '.join(SETS)}")
    if args.threads < 2:
        raise SystemExit(f"--threads must be >= 2 to compare side by side, got {args.threads}")
    torch.set_num_threads(args.threads)
    _primitives(args.threads, args.size)
    for name in args.sets.split(","):
        shapes = [(m // args.scale, n // args.scale) for m, n in SETS[name]]
        _compare(name, shapes, args.manifold, args.steps, args.threads)


if __name__ == "__main__":
    main()
