"""msign cost and accuracy relative to the SVD polar factor, measured in the same process.

    python benchmarks/bench_msign.py [--rows 1024] [--cols 256] [--batch 1] [--repeats 10]
                                     [--device cpu] [--dtype float32]

For each method (``jordan5`` and ``polar-express`` presets, the convergent ``newton-schulz``
and ``newton`` iterations) prints the median time and its ratio to ``msign(x, "svd")`` on the
same Gaussian matrix (timed round robin, median of per-round ratios, so machine load affects
all alike), and the accuracy: the range of the output's singular values and the relative
Frobenius distance to the SVD result.
"""

from __future__ import annotations

import argparse

import torch
from _timing import add_device_arguments, apply_device_arguments, round_robin_ms

from manifoldlib.functional import msign


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = apply_device_arguments(args)
    g = torch.Generator(device=device).manual_seed(0)
    shape = ((args.batch,) if args.batch > 1 else ()) + (args.rows, args.cols)
    x = torch.randn(*shape, generator=g, dtype=dtype, device=device)  # (..., m, n)
    ref = msign(x, "svd").double()

    print(
        f"msign, x: {tuple(shape)} {args.dtype} on {device}, median of {args.repeats}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    methods = ("svd", "jordan5", "polar-express", "newton-schulz", "newton")
    timed = round_robin_ms({m: (lambda m=m: msign(x, m)) for m in methods}, args.repeats, device)
    print(
        f"{'method':<16}{'ms':>9}{'ratio vs svd':>14}{'min sv':>9}{'max sv':>9}"
        f"{'rel err vs svd':>16}"
    )
    for method in methods:
        out = msign(x, method).double()
        sv = torch.linalg.svdvals(out)
        err = float(torch.linalg.matrix_norm(out - ref).max() / torch.linalg.matrix_norm(ref).max())
        ms, ratio = timed[method]
        print(
            f"{method:<16}{ms:>9.2f}{ratio:>14.2f}{float(sv.min()):>9.4f}{float(sv.max()):>9.4f}{err:>16.2e}"
        )


if __name__ == "__main__":
    main()
