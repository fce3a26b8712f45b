"""Sphere retraction cost relative to a bare ``F.normalize(x + v)``, measured in the same process.

    python benchmarks/bench_sphere_retractions.py [--rows 8192] [--dim 1024] [--repeats 20]
                                                  [--device cpu] [--dtype float32]

Prints, for ``exp``, ``gnomonic``, ``cayley`` and ``p=1.5``, the median time of the forward pass
and of forward + backward (into ``x`` and ``v``) and its ratio to the anchor
``r * F.normalize(x + v)`` (what a post-LN-like residual would do). Candidates are timed round
robin with the anchor and the ratio is the median of per-round ratios, so machine load affects
both alike. A ratio is what to compare across machines; milliseconds are context only.
"""

from __future__ import annotations

import argparse

import torch
from _timing import add_device_arguments, apply_device_arguments, round_robin_ms
import torch.nn.functional as F

from manifoldlib import Sphere
from manifoldlib.retractions import PRetraction


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    add_device_arguments(parser)
    args = parser.parse_args()
    device, dtype = apply_device_arguments(args)
    radius = args.dim**0.5
    g = torch.Generator(device=device).manual_seed(0)
    sphere = Sphere(radius)
    x = sphere.random(args.rows, args.dim, generator=g, dtype=dtype, device=device)  # (B, D)
    f = torch.randn(args.rows, args.dim, generator=g, dtype=dtype, device=device)  # (B, D) update
    v = sphere.proju(x, f)  # (B, D) tangent
    w = torch.randn_like(x)  # upstream gradient

    def anchor(xx, vv):
        return radius * F.normalize(xx + vv, dim=-1)

    candidates = {
        "normalize (anchor)": anchor,
        "exp": sphere.with_retraction("exp").retr,
        "gnomonic": sphere.with_retraction("gnomonic").retr,
        "cayley": sphere.with_retraction("cayley").retr,
        "p=1.5": sphere.with_retraction(PRetraction(1.5)).retr,
    }

    def forward(fn):
        with torch.no_grad():
            return lambda: fn(x, v)

    def forward_backward(fn):
        xg = x.clone().requires_grad_(True)
        vg = v.clone().requires_grad_(True)

        def run():
            xg.grad = None
            vg.grad = None
            (fn(xg, vg) * w).sum().backward()

        return run

    print(
        f"sphere retractions, x: ({args.rows}, {args.dim}) {args.dtype} on {device}, "
        f"median of {args.repeats}, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    fwd = round_robin_ms(
        {name: forward(fn) for name, fn in candidates.items()}, args.repeats, device
    )
    bwd = round_robin_ms(
        {name: forward_backward(fn) for name, fn in candidates.items()}, args.repeats, device
    )
    print(
        f"{'retraction':<20}{'fwd ms':>10}{'fwd ratio':>11}{'fwd+bwd ms':>13}{'fwd+bwd ratio':>15}"
    )
    for name in candidates:
        print(
            f"{name:<20}{fwd[name][0]:>10.2f}{fwd[name][1]:>11.2f}{bwd[name][0]:>13.2f}{bwd[name][1]:>15.2f}"
        )


if __name__ == "__main__":
    main()
