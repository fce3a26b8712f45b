"""A tiny model's Manifold Muon step against torch.optim.Muon on the same matrices, idle and under load.

    python benchmarks/bench_tiny_model.py [--layers 2] [--width 64] [--steps 30] [--warmup 5]
        [--load 0,2] [--threads default,1] [--anchor auto|bfloat16|float32]

The model is a Hugging Face LLaMA built from a tiny config (no download): ``--layers`` decoder
layers of width ``--width`` (MLP width ``2.6875 x width``, 4 heads, a 256-token vocabulary), the
size a researcher prototypes on. Its hidden matrices get the HETERO policy (attention on Stiefel,
MLP on DGram) with ManifoldMuon, and the same matrices torch.optim.Muon; one backward pass gives
the gradients, and only the optimizer steps are timed, alternating, over ``--steps`` steps after
``--warmup``. Printed: the median milliseconds per step of each and their ratio, for every
``--threads`` setting (``default``: torch's) and every ``--load`` (the number of busy processes
started beside the benchmark: a shared machine, where a parallel region waits for threads that are
not scheduled).

``--anchor``: ``torch.optim.Muon`` iterates its Newton–Schulz in bfloat16, emulated (many times
slower) on CPUs without AVX512-BF16 or AMX; ``auto`` (default) times it where bfloat16 is native
and ``torch.optim.Muon`` with a float32 Newton–Schulz elsewhere (``_anchors.py``), the precision
ManifoldMuon's ``ns_dtype="auto"`` takes there; the second line says which.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from _anchors import ANCHORS, bfloat16_line, muon_anchor
from manifoldlib.optim import ManifoldMuon, assign_parameters


def _busy(stop) -> None:
    x = 1.0
    while not stop.is_set():
        for _ in range(100_000):
            x = x * 1.0000001 + 1e-9


def tiny_llama(layers: int, width: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=int(2.6875 * width),
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--load", default="0", help="comma-separated counts of busy processes")
    parser.add_argument("--threads", default="default,1", help="comma-separated: default or an int")
    parser.add_argument("--anchor", default="auto", choices=ANCHORS,
                        help="Muon anchor precision: auto (bfloat16 where native, else float32)")
    args = parser.parse_args()
    anchor_name, anchor_cls = muon_anchor(args.anchor, torch.device("cpu"))
    model = tiny_llama(args.layers, args.width)
    assignment = assign_parameters(model, "hetero")
    named = dict(model.named_parameters())
    groups = {}
    for name, manifold in assignment.items():
        if manifold is not None:
            groups.setdefault(manifold, []).append(named[name])
    matrices = [p for ps in groups.values() for p in ps]
    idx = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    model(idx, labels=idx).loss.backward()
    grads = [p.grad.clone() for p in matrices]
    print(f"tiny LLaMA: {args.layers} layers, width {args.width}; {len(matrices)} hidden matrices "
          f"({', '.join(f'{k}: {len(v)}' for k, v in groups.items())}); default threads {torch.get_num_threads()}")
    print(f"{bfloat16_line(torch.device('cpu'))}; anchor: {anchor_name}")
    default_threads = torch.get_num_threads()
    for load in (int(x) for x in args.load.split(",")):
        stop = mp.Event()
        workers = [mp.Process(target=_busy, args=(stop,), daemon=True) for _ in range(load)]
        for w in workers:
            w.start()
        try:
            for setting in args.threads.split(","):
                torch.set_num_threads(default_threads if setting == "default" else int(setting))
                clones = [torch.nn.Parameter(p.detach().clone()) for p in matrices]
                muon = anchor_cls(clones, lr=0.02, weight_decay=0.0)
                ours = ManifoldMuon([{"params": ps, "manifold": k} for k, ps in groups.items()], lr=0.02,
                                    weight_decay=0.0)
                mine, theirs = [], []
                for step in range(args.warmup + args.steps):
                    for p, q, g in zip(matrices, clones, grads):
                        p.grad, q.grad = g, g
                    t0 = time.perf_counter()
                    muon.step()
                    t1 = time.perf_counter()
                    ours.step()
                    t2 = time.perf_counter()
                    if step >= args.warmup:
                        theirs.append(t1 - t0)
                        mine.append(t2 - t1)
                a, b = statistics.median(mine) * 1e3, statistics.median(theirs) * 1e3
                print(f"load {load}, threads {setting:>7s}: ManifoldMuon hetero {a:8.2f} ms  anchor "
                      f"{b:7.2f} ms  ratio {a / b:6.2f}", flush=True)
        finally:
            stop.set()
            for w in workers:
                w.join()
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
