"""Bytes Manifold Muon's FSDP2 step moves between ranks, for simulated ranks (no process group).

    python benchmarks/bench_fsdp_exchange.py [--blocks 12] [--width 768] [--ranks 2,4,8] [--dtype float32]

The matrix set is GPT-2 small's (per block four ``width x width`` attention matrices, one
``4 width x width`` and one ``width x 4 width`` MLP matrix), each row-sharded as ``fully_shard``
places it. Each step moves every matrix's rows that are not on its owner to the owner (the weights
:math:`W` and the momentum update :math:`U`, plus the dual's warm start on a manifold) and the new
rows back (plus the warm start and five scalars). The minimum is each matrix's rows moved once each
way. A Euclidean matrix sends :math:`U` to its owner and gets Muon's direction back (in
``--ns-dtype``); a manifold's also needs :math:`W` at the owner. The plan is the one ``manifoldlib.optim.fsdp`` runs (a test checks the bytes a real gloo run
sends against it); the owners are balanced by solve cost, and the last column is the heaviest rank's
solve cost over the mean.
"""

from __future__ import annotations

import argparse

import torch

from manifoldlib.distributed import assign_owners, rank_loads
from manifoldlib.optim.fsdp import redistribution_plan


def shapes(blocks: int, width: int) -> list[tuple[int, int]]:
    """GPT-2's block matrices, ``blocks`` times."""
    return [(width, width)] * 4 * blocks + [(4 * width, width), (width, 4 * width)] * blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    parser.add_argument("--ns-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="the Euclidean Newton-Schulz dtype (ns_dtype='auto' on a GPU: bfloat16)")
    args = parser.parse_args()
    sizes = shapes(args.blocks, args.width)
    dtype = getattr(torch, args.dtype)
    megabytes = sum(m * n for m, n in sizes) * torch.empty((), dtype=dtype).element_size() / 2**20
    print(f"{len(sizes)} matrices ({args.blocks} blocks of width {args.width}), {args.dtype}, "
          f"{megabytes:.1f} MiB of weights; Euclidean direction in {args.ns_dtype}")
    print(f"{'ranks':>5}  {'kind':<21} {'to owners':>10} {'back':>10} {'total':>10} {'minimum':>10} "
          f"{'x minimum':>9} {'max/mean solve':>14}")
    for world in (int(r) for r in args.ranks.split(",")):
        owners = assign_owners(sizes, world)
        loads = rank_loads(sizes, owners, world)
        balance = max(loads) / (sum(loads) / world)
        for kind, constrained in (("stiefel / dgram", True), ("euclidean", False)):
            plan = redistribution_plan(sizes, dtype, world, constrained=constrained,
                                       ns_dtype=getattr(torch, args.ns_dtype))
            mib = {k: v / 2**20 for k, v in plan.items()}
            print(f"{world:>5}  {kind:<21} {mib['to_owners']:>8.1f}Mi {mib['to_shards']:>8.1f}Mi "
                  f"{mib['total']:>8.1f}Mi {mib['minimum']:>8.1f}Mi {plan['total'] / plan['minimum']:>9.2f} "
                  f"{balance:>14.2f}")


if __name__ == "__main__":
    main()
