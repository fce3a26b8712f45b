"""Training-step overhead of SEL charts on models.GPT, as ratios against the plain model.

Copies of one GPT (same initial weights) are timed in the same process, interleaved, so
machine load hits all of them alike:

* ``plain``  — the model as built (the anchor, ratio 1.00);
* ``sel``    — SEL (mismatched init) on every block linear map (``attn.q/k/v/o``, ``mlp.fc/proj``),
  its forward rule on the C++ CPU kernels where they are built (:mod:`manifoldlib._cpu_kernels`);
* ``sel-aten`` — the same model with the kernels switched off (the ATen autograd function);
* ``merged`` — the SEL model after :func:`manifoldlib.charts.merge_charts` (plain linears again);
* ``sel-compile`` (with ``--compile``) — SEL with ``impl="compile"`` (:func:`torch.compile`).

A training step is forward + backward + AdamW step on one batch of ``batch x block`` tokens; an
inference step is a ``torch.no_grad`` forward in eval mode. Each round times every variant back
to back; the script prints, per variant, the median over rounds of its time divided by
``plain``'s time in the same round (wall clock and process CPU time), with the interquartile
range.

Usage::

    python benchmarks/bench_sel.py --threads 1 --compile  # d=512, 4 layers, 8 x 128 tokens
    python benchmarks/bench_sel.py --n-embd 256 --batch 4 --quick
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from _timing import sync

from manifoldlib import _cpu_kernels
from manifoldlib.charts import SEL, apply_chart, merge_charts
from models import GPT, GPTConfig


def in_blocks(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and name.startswith("blocks.")


def build(args) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        vocab_size=256,
        block_size=args.block,
        connection="pre-ln",
    )
    plain = GPT(cfg).to(args.device)
    sel = copy.deepcopy(plain)
    apply_chart(sel, SEL, include=in_blocks)
    merged = copy.deepcopy(sel)
    merge_charts(merged)
    models = {"plain": plain, "sel": sel, "sel-aten": copy.deepcopy(sel), "merged": merged}
    if args.compile:
        compiled = copy.deepcopy(plain)
        apply_chart(compiled, functools.partial(SEL, impl="compile"), include=in_blocks)
        models["sel-compile"] = compiled
    return models


def timed(fn, steps: int, device: str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) per call of ``fn``."""
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def train_step(model, opt, idx, targets, aten=False):
    def step():
        with _cpu_kernels.disabled() if aten else contextlib.nullcontext():
            _, loss = model(idx, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return step


def infer_step(model, idx, aten=False):
    @torch.no_grad()
    def step():
        with _cpu_kernels.disabled() if aten else contextlib.nullcontext():
            model(idx)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds (median)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="1 step x 5 rounds")
    parser.add_argument("--compile", action="store_true", help="also time SEL(impl='compile')")
    parser.add_argument(
        "--adamw", choices=("fused", "foreach", "for-loop"), default="for-loop",
        help="torch.optim.AdamW implementation of every variant (torch's CPU default: for-loop)",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 1, 5
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    models = build(args)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.batch, args.block + 1), generator=g).to(args.device)
    idx, targets = data[:, :-1], data[:, 1:]
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[args.adamw]
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, **impl) for k, m in models.items()}
    kinds = {
        "train step (fwd+bwd+AdamW)": {
            k: train_step(m, opts[k], idx, targets, aten=k == "sel-aten") for k, m in models.items()
        },
        "inference forward (eval, no_grad)": {
            k: infer_step(m, idx, aten=k == "sel-aten") for k, m in models.items()
        },
    }
    for k in models:  # warm-up: allocator, kernels, AdamW state, torch.compile
        for steps in kinds.values():
            steps[k]()
            steps[k]()

    n_chart = sum(p.numel() for n, p in models["sel"].named_parameters() if ".original" in n)
    print(
        f"GPT d={args.n_embd} layers={args.n_layer} tokens/step={args.batch * args.block} "
        f"charted weights={n_chart / 1e6:.2f}M device={args.device} "
        f"threads={torch.get_num_threads()} AdamW={args.adamw} "
        f"rounds={args.repeats} x {args.steps} steps"
    )
    # Each round times every variant back to back (in rotating order), and ratios are taken
    # within the round, so a load spike on a shared machine hits numerator and anchor alike.
    # The median over rounds of these paired ratios is reported, for wall and for CPU time.
    for title, steps in kinds.items():
        for model in models.values():
            model.train(title.startswith("train"))
        ratios = {k: {"wall": [], "cpu": []} for k in models}
        anchor_ms = []
        names = list(models)
        for r in range(args.repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            times = {k: timed(steps[k], args.steps, args.device) for k in order}
            anchor_ms.append(times["plain"][0] * 1e3)
            for k in names:
                ratios[k]["wall"].append(times[k][0] / times["plain"][0])
                ratios[k]["cpu"].append(times[k][1] / times["plain"][1])
        print(f"{title}: plain median {statistics.median(anchor_ms):.1f} ms wall")
        for k in names:
            w, c = ratios[k]["wall"], ratios[k]["cpu"]
            print(
                f"  {k:11s} ratio wall {statistics.median(w):.3f} (IQR {_iqr(w)})   "
                f"ratio cpu {statistics.median(c):.3f} (IQR {_iqr(c)})"
            )


def _iqr(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[0]:.3f}-{q[2]:.3f}"


if __name__ == "__main__":
    main()
