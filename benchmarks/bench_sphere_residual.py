"""Forward + backward of one SphereResidual against LayerNorm + add, as ratios to that anchor.

    python benchmarks/bench_sphere_residual.py [--rows 8192] [--dim 768] [--threads 1] [--repeats 15]
        [--no-compile]

The anchor is the Post-LN-style update ``LayerNorm(h + f)`` (``nn.LayerNorm`` with affine
parameters), forward and backward into ``h`` and ``f``, measured in the same process. Every
candidate is timed interleaved with the anchor (round robin, median of ``--repeats`` rounds), so
machine load affects both alike. Ratios < 1 are faster than the anchor; they are printed for the
median and for the minimum over rounds (the minimum is the less load-sensitive on a shared CPU). Compiled variants use
``torch.compile`` (inductor; needs a C++ compiler on CPU) and are skipped if compilation fails.

Eager fused variants use the C++ CPU kernels when they are built (the default path); the
gnomonic update is also timed with them switched off ("fused (ATen)"), in the same rounds. The
compiled fused update runs the same row kernels (opaque operators in inductor's graph); its ratio
to the compiled anchor is printed last.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _timing import median_min_table, round_robin

from manifoldlib import _cpu_kernels
from manifoldlib.nn import SphereResidual


def _fwd_bwd(fn, h, f, g):
    def step():
        h.grad = None
        f.grad = None
        out = fn(h, f)
        out.backward(g)

    return step


def _aten_only(fn):
    """``fn`` with the C++ kernels switched off (the forward picks the path its backward takes)."""

    def call(h, f):
        with _cpu_kernels.disabled():
            return fn(h, f)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, d = args.rows, args.dim
    h = torch.randn(n, d)
    h = (d**0.5 * h / h.norm(dim=-1, keepdim=True)).requires_grad_(True)
    f = (0.3 * torch.randn(n, d)).requires_grad_(True)
    g = torch.randn(n, d)

    layer_norm = torch.nn.LayerNorm(d)
    anchor = lambda a, b: layer_norm(a + b)
    gnomonic = SphereResidual(d, retraction="gnomonic")
    kernels = _cpu_kernels.available()
    if not kernels:
        print(f"C++ CPU kernels unavailable ({_cpu_kernels.ENV_VAR}=0, or the build failed)")
    candidates = {
        "gnomonic fused (C++ kernels)": gnomonic,
        "gnomonic fused (ATen)": _aten_only(gnomonic),
        "gnomonic eager autograd": SphereResidual(d, retraction="gnomonic", fused=False),
        "exp fused": SphereResidual(d, retraction="exp"),
        "exp eager autograd": SphereResidual(d, retraction="exp", fused=False),
        "cayley fused": SphereResidual(d, retraction="cayley"),
        "p=1.5 fused": SphereResidual(d, retraction="p", p=1.5),
    }
    if not kernels:
        del candidates["gnomonic fused (C++ kernels)"]
    steps = {name: _fwd_bwd(mod, h, f, g) for name, mod in candidates.items()}
    if not args.no_compile:
        compiled = {
            "LayerNorm + add compiled": torch.compile(anchor),
            "gnomonic eager autograd compiled": torch.compile(SphereResidual(d, retraction="gnomonic", fused=False)),
            "gnomonic fused compiled": torch.compile(SphereResidual(d, retraction="gnomonic")),
            "exp eager autograd compiled": torch.compile(SphereResidual(d, retraction="exp", fused=False)),
        }
        for name, fn in compiled.items():
            try:
                step = _fwd_bwd(fn, h, f, g)
                step()  # compile now
                steps[name] = step
            except Exception as err:  # noqa: BLE001 - report and continue without this variant
                print(f"skipped {name}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
    steps = {"LayerNorm + add (anchor)": _fwd_bwd(anchor, h, f, g), **steps}
    times = round_robin(steps, args.repeats, warmup=1)
    print(f"shape ({n}, {d}) float32, {torch.get_num_threads()} thread(s), {args.repeats} rounds")
    print("\n".join(median_min_table(times, "LayerNorm + add (anchor)")))
    gnomonic_key = "gnomonic fused (C++ kernels)" if kernels else "gnomonic fused (ATen)"
    for stat, label in ((statistics.median, "median"), (min, "min")):
        ratio = stat(times["exp fused"]) / stat(times[gnomonic_key])
        print(f"exp / gnomonic (fused, {label}): {ratio:.2f}x")
        if kernels:
            aten, cpp = times["gnomonic fused (ATen)"], times["gnomonic fused (C++ kernels)"]
            print(f"gnomonic fused, ATen / C++ kernels ({label}): {stat(aten) / stat(cpp):.2f}x")
        if "gnomonic fused compiled" in times and "LayerNorm + add compiled" in times:
            ratio = stat(times["gnomonic fused compiled"]) / stat(times["LayerNorm + add compiled"])
            print(f"gnomonic fused compiled / LayerNorm + add compiled ({label}): {ratio:.2f}x")


if __name__ == "__main__":
    main()
