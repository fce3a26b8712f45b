"""One AdamW training step of the reference GPT, each connection as a ratio to Pre-LN.

    python benchmarks/bench_gpt_step.py [--n-embd 256] [--n-layer 4] [--n-head 4] [--batch 8]
        [--block 256] [--threads 1] [--repeats 10] [--connections spheret,pre-ln,...] [--compile]

A step is forward, loss, backward and ``AdamW.step()`` on a fixed random batch. The models are
timed round robin in one process (median of ``--repeats`` rounds) so machine load hits all alike;
the anchor is ``pre-ln``. Ratios are printed for the median and for the minimum over rounds. ``spheret`` is p = 1 (Proj-SpheretNorm); ``spheret-eager`` is the same
model on the plain-autograd reference path instead of the analytic backward.
"""

from __future__ import annotations

import argparse

import torch
from _timing import median_min_table, round_robin

from models import GPT, GPTConfig


def _variant(name: str) -> dict:
    if name == "spheret-eager":
        return {"connection": "spheret", "p": 1.0, "fused": False}
    if name == "spheret-exp":
        return {"connection": "spheret", "retraction": "exp"}
    if name == "spheret":
        return {"connection": "spheret", "p": 1.0}
    return {"connection": name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--connections", default="pre-ln,spheret,spheret-eager,spheret-exp,geonorm,post-ln,peri-ln,pre-dyt,keel")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.connections.split(",")
    if names[0] != "pre-ln":
        names = ["pre-ln"] + [n for n in names if n != "pre-ln"]
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (args.batch, args.block + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]
    steps = {}
    for name in names:
        torch.manual_seed(0)
        cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                        block_size=args.block, **_variant(name))
        model = GPT(cfg)
        fn = torch.compile(model) if args.compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(fn=fn, opt=opt):
            _, loss = fn(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        steps[name] = step
    times = round_robin(steps, args.repeats, warmup=2)  # the warm-up also compiles
    print(f"GPT d={args.n_embd} L={args.n_layer} batch={args.batch}x{args.block}, "
          f"{torch.get_num_threads()} thread(s), compile={args.compile}, {args.repeats} rounds")
    print("\n".join(median_min_table(times, "pre-ln", width=15)))


if __name__ == "__main__":
    main()
