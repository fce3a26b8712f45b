"""Manifold Muon step time against torch.optim.Muon (the anchor) and AdamW, measured in one process.

Matrices: GPT-small shapes, 768x768 (attention) and 768x3072 / 3072x768 (MLP). The gradients are
a fixed low-rank signal plus fresh noise each step (consecutive steps are correlated, as in
training, so the warm start has something to reuse). Prints, per optimizer: seconds per step,
the anchor's seconds per step in the same run, the ratio to torch.optim.Muon (median of per-step
ratios, each against an anchor step run just before on the same gradients), dual iterations per
matrix per step, and the largest relative tangent residual of the dual solutions.

    python benchmarks/bench_manifold_muon.py [--steps 3] [--warmup 1] [--threads 2] [--max-iter N]
        [--tol 1e-3] [--msign ns|polar-express|...] [--only stiefel,dgram] [--shapes 3072x768,768x3072]
        [--layers 12] [--device cuda] [--spectral auto|eigh|products] [--sync-free auto|on|off]
        [--anchor auto|bfloat16|float32]

``--anchor``: ``torch.optim.Muon`` runs its Newton–Schulz in bfloat16, which is emulated (20–40
times slower per step) on CPUs without AVX512-BF16 or AMX; ``auto`` (default) times it where
bfloat16 is native and ``torch.optim.Muon`` with a float32 Newton–Schulz elsewhere
(``_anchors.py``); the second line says which. ``ManifoldMuon euclidean`` uses the same precision
(``ns_dtype="auto"``).

``--layers N`` repeats the shapes N times: ``--layers 12`` is the GPT-2-small set of twelve blocks
(48 matrices, 24 of each shape class), the size at which batching same-shape solves is measured.

``--warmup`` untimed steps come first (default 1: allocation and the first multiplier). The
momentum buffers take about 1/(1 - 0.95) = 20 steps to fill, and the dual solves of those first
steps are easier than later ones (three Anderson steps instead of four on the tall matrices), so
``--warmup 25`` measures the steady state of a training run.

``--spectral`` and ``--sync-free`` set the dual options of the same names
(:class:`manifoldlib.optim.DualOptions`): ``auto`` evaluates the dual with Gram-form Newton–Schulz
products on CUDA and for narrow matrices, a fixed number of iterations and no host read there, and
with one eigh per evaluation (stopping at convergence) for wide matrices on a CPU. Every step stacks
the same-shape matrices into banks and solves each bank as one batched problem.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _anchors import ANCHORS, bfloat16_line, muon_anchor

from manifoldlib.optim import ManifoldMuon

SHAPES = [(768, 768), (768, 768), (3072, 768), (768, 3072)]
#: ``--sync-free`` -> DualOptions' ``sync_free``.
SYNC_FREE = {"auto": None, "on": True, "off": False}
DEVICE = torch.device("cpu")  # --device


def _gradients(steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    signal = []
    for m, n in SHAPES:
        u = torch.randn(m, 16, generator=g) / m**0.5
        v = torch.randn(16, n, generator=g) / n**0.5
        signal.append(u @ v)
    out = []
    for _ in range(steps):
        out.append([(s + 0.3 * torch.randn(s.shape, generator=g) / max(s.shape) ** 0.5).to(DEVICE) for s in signal])
    return out


def _params(seed: int = 1) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((0.02 * torch.randn(m, n, generator=g)).to(DEVICE)) for m, n in SHAPES]


def _hetero_groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """The seed's HETERO policy on these shapes: square (attention) Stiefel, the rest (MLP) DGram."""
    groups = [
        {"params": [p for p in params if p.size(0) == p.size(1)], "manifold": "stiefel"},
        {"params": [p for p in params if p.size(0) != p.size(1)], "manifold": "dgram"},
    ]
    return [group for group in groups if group["params"]]


def _timed_step(opt, params, grads) -> float:
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    _synchronize()
    start = time.perf_counter()
    opt.step()
    _synchronize()
    return time.perf_counter() - start


def _synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _run(make, anchor_make, grads, warmup: int = 1) -> dict:
    """Time ``make``'s optimizer; each step is paired with an anchor step run just before it on
    the same gradients, and the ratio is the median of the per-step ratios (robust to the load of
    a shared machine drifting during the run)."""
    params, anchor_params = _params(), _params()
    opt, anchor = make(params), anchor_make(anchor_params)
    times, anchor_times, ratios, iters, residuals = [], [], [], [], []
    for k, step_grads in enumerate(grads):
        t_anchor = _timed_step(anchor, anchor_params, step_grads)
        t_opt = _timed_step(opt, params, step_grads)
        if k < warmup:  # warm-up steps (allocation, first multiplier, momentum), not timed
            continue
        times.append(t_opt)
        anchor_times.append(t_anchor)
        ratios.append(t_opt / t_anchor)
        for p in params:
            state = opt.state[p]
            iters.append(int(state.get("dual_iterations", 0)))  # 0-dim tensors: read after the timing
            residuals.append(float(state.get("dual_residual", 0.0)))
    return {
        "time": statistics.median(times),
        "anchor": statistics.median(anchor_times),
        "ratio": statistics.median(ratios),
        "iters": statistics.mean(iters) if iters else 0.0,
        "max_iters": max(iters) if iters else 0,
        "residual": max(residuals) if residuals else 0.0,
    }


def _selects(wanted: str, name: str, names) -> bool:
    """``--only`` entry ``wanted`` selects ``name``: the run of exactly that name if there is one,
    else every run whose name contains it."""
    return wanted == name if wanted in names else wanted in name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones (>= 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-iter", type=int, default=None,
                        help="dual iterations (default: the optimizer's, fixed when sync-free, a cap else)")
    parser.add_argument("--tol", type=float, default=1e-3, help="dual tolerance (relative tangent residual)")
    parser.add_argument("--msign", default="ns", help="msign inside the dual solve (ManifoldMuon msign_method)")
    parser.add_argument("--only", default="",
                        help="comma-separated names or substrings: run only those optimizers (a full name "
                             "selects that run alone)")
    parser.add_argument("--shapes", default="", help="comma-separated MxN shapes (default: the GPT-small block)")
    parser.add_argument("--layers", type=int, default=1, help="repeat the shapes this many times (12: GPT-2 small)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:k] (tensors and optimizer state there)")
    parser.add_argument("--spectral", default="auto", help="dual spectral path: auto, eigh or products")
    parser.add_argument("--sync-free", default="auto", choices=tuple(SYNC_FREE),
                        help="dual sync_free: auto (on the products path), on or off")
    parser.add_argument("--anchor", default="auto", choices=ANCHORS,
                        help="Muon anchor precision: auto (bfloat16 where native, else float32)")
    args = parser.parse_args()
    if args.warmup < 1:
        raise SystemExit(f"--warmup must be >= 1, got {args.warmup}")
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this machine")
    if args.layers < 1:
        raise SystemExit(f"--layers must be >= 1, got {args.layers}")
    if args.shapes:
        SHAPES[:] = [tuple(int(k) for k in item.split("x")) for item in args.shapes.split(",")]
    SHAPES[:] = SHAPES * args.layers
    torch.set_num_threads(args.threads)
    grads = _gradients(args.steps + args.warmup)
    kw = {"lr": 0.02, "weight_decay": 0.0}
    dual = {"tol": args.tol, "max_iter": args.max_iter, "msign_method": args.msign, "spectral": args.spectral,
            "sync_free": SYNC_FREE[args.sync_free]}
    mm = {"dual": dual}
    anchor_name, anchor_cls = muon_anchor(args.anchor, DEVICE)
    runs = {
        anchor_name: lambda ps: anchor_cls(ps, **kw),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
        "ManifoldMuon euclidean": lambda ps: ManifoldMuon(ps, manifold="euclidean", **kw),
        "ManifoldMuon stiefel": lambda ps: ManifoldMuon(ps, manifold="stiefel", **kw, **mm),
        "ManifoldMuon stiefel (no warm start)": lambda ps: ManifoldMuon(
            ps, manifold="stiefel", dual={**dual, "warm_start": False}, **kw
        ),
        "ManifoldMuon stiefel (BB dual steps)": lambda ps: ManifoldMuon(
            ps, manifold="stiefel", dual={**dual, "update": "bb"}, **kw
        ),
        "ManifoldMuon dgram": lambda ps: ManifoldMuon(ps, manifold="dgram", **kw, **mm),
        "ManifoldMuon hetero (square stiefel, tall dgram)": lambda ps: ManifoldMuon(_hetero_groups(ps), **kw, **mm),
        "ManifoldMuon dgram (BB dual steps)": lambda ps: ManifoldMuon(
            ps, manifold="dgram", dual={**dual, "update": "bb"}, **kw
        ),
        "ManifoldMuon dgram (no warm start)": lambda ps: ManifoldMuon(
            ps, manifold="dgram", dual={**dual, "warm_start": False}, **kw
        ),
    }
    block = SHAPES[: len(SHAPES) // args.layers]
    print(f"device {DEVICE}, shapes {block} x {args.layers} layer(s), {args.steps} timed steps after {args.warmup} "
          f"untimed, {args.threads} threads, dual tol {args.tol}, iterations {args.max_iter or 'default'}, dual msign "
          f"{args.msign}, spectral {args.spectral}, sync-free {args.sync_free}, load average {os.getloadavg()[0]:.2f}")
    print(f"{bfloat16_line(DEVICE)}; anchor: {anchor_name}")
    anchor_make = runs[anchor_name]
    print(f"{'optimizer':48s} {'s/step':>8s} {'anchor':>8s} {'ratio':>7s} {'dual it':>8s} {'max it':>7s} "
          f"{'max resid':>10s}")
    wanted = [w for w in args.only.split(",") if w]
    for name, make in runs.items():
        if wanted and "anchor" not in name and not any(_selects(w, name, runs) for w in wanted):
            continue
        r = _run(make, anchor_make, grads, args.warmup)
        print(f"{name:48s} {r['time']:8.3f} {r['anchor']:8.3f} {r['ratio']:7.2f} {r['iters']:8.1f} {r['max_iters']:7d} "
              f"{r['residual']:10.1e}", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
