"""Host synchronizations of Manifold Muon's steps as a training loop meets them, counted by the device.

    python benchmarks/check_step_syncs.py [--device cuda] [--blocks 2] [--width 768] [--steps 3]

On CUDA every step after a plan's first runs under ``torch.cuda.set_sync_debug_mode("warn")``,
torch's own report of each call that makes the host wait for the GPU (``.item()``, a blocking copy
from pageable host memory, ``nonzero``, ...): the ground truth that
:func:`manifoldlib.testing.count_ops` estimates from the operators on a CPU. Elsewhere the same
steps are counted with ``count_ops``. Each case prints its synchronizations per step and, on CUDA,
where in Python they were made.

Cases, on GPT-2's block matrices (``bench_step_counts.shapes``): Euclidean, Stiefel and HETERO
at one learning rate; Stiefel with the attention matrices in two groups at different learning
rates (one bank, per-member step sizes) under a ``LambdaLR`` schedule, and DGram with weight decay
the same way (per-member decay factors); Stiefel with a non-finite gradient in one matrix. Every
optimizer runs its default path on CUDA (the products path without host reads) and that path
named on another device (``dual={"spectral": "products", "sync_free": True}``; a CPU's default
for matrices of 256 columns or more reads the host by design). The first step of each plan reads
the host on purpose (its checks) and is not counted.
"""

from __future__ import annotations

import argparse
import collections
import warnings

import torch
from bench_step_counts import make_params, optimizer, set_gradients, shapes

from manifoldlib.optim import ManifoldMuon
from manifoldlib.testing import count_ops


def two_rates(manifold: str, weight_decay: float):
    """A factory: the square matrices at lr 0.02, then half of them at 0.01 (the same bank), a schedule."""
    def make(params, dual):
        square = [p for p in params if p.size(0) == p.size(1)]
        groups = [{"params": square[::2]}, {"params": square[1::2], "lr": 0.01}]
        opt = ManifoldMuon(groups, lr=0.02, manifold=manifold, weight_decay=weight_decay, dual=dual)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + t))
    return make


def one_rate(kind: str):
    return lambda params, dual: (optimizer(kind, params, dual), None)


CASES = {
    "euclidean": (one_rate("euclidean"), False),
    "stiefel": (one_rate("stiefel"), False),
    "hetero": (one_rate("hetero"), False),
    "stiefel, two learning rates, LambdaLR": (two_rates("stiefel", 0.0), False),
    "dgram, two learning rates and decay, LambdaLR": (two_rates("dgram", 0.1), False),
    "stiefel, one non-finite gradient": (one_rate("stiefel"), True),
}


def cuda_syncs(step) -> collections.Counter:
    """Where ``step()`` made the host wait for the GPU, by ``file:line`` (torch's sync debug mode)."""
    where: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    for w in caught:
        if "synchroniz" in str(w.message):
            where[f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}"] += 1
    return where


def run(name: str, factory, nonfinite: bool, sizes, device: torch.device, steps: int) -> None:
    params = make_params(sizes, device)
    opt, schedule = factory(params, None if device.type == "cuda" else {"spectral": "products", "sync_free": True})
    counted = []
    where: collections.Counter = collections.Counter()
    for step in range(steps + 1):
        set_gradients(params, step)
        if nonfinite:
            params[0].grad[0, 0] = float("nan")

        def one_step():
            opt.step()
            if schedule is not None:
                schedule.step()
        if step == 0:  # the plan's first step: its checks read the host
            one_step()
        elif device.type == "cuda":
            found = cuda_syncs(one_step)
            counted.append(sum(found.values()))
            where.update(found)
        else:
            counted.append(count_ops(one_step).syncs)
    print(f"{name:48s} syncs per step after the first: {counted}")
    for place, n in where.most_common(5):
        print(f"    {n:3d} at {place}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = shapes(args.blocks, args.width)
    how = "torch.cuda.set_sync_debug_mode" if device.type == "cuda" else "manifoldlib.testing.count_ops"
    print(f"{len(sizes)} matrices ({args.blocks} blocks of width {args.width}) on {device}, counted by {how}")
    for name, (factory, nonfinite) in CASES.items():
        run(name, factory, nonfinite, sizes, device, args.steps)


if __name__ == "__main__":
    main()
