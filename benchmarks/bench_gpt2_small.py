"""GPT-2 small through the trainer: 1-SpheretNorm + ManifoldMuon (hetero) against Pre-LN + AdamW.

    python benchmarks/bench_gpt2_small.py [--steps 300] [--corpus SPEC] [--out DIR]
        [--grad_accum_steps K] [--dtype bfloat16] [--compile true] [--peak_flops P] [--quick]

Each arm is one ``models.train.run_training`` run of the ``gpt2-small`` preset (12 layers, width
768, context 1024, a global batch of 480 sequences), the arms one after the other on the same
device: ``spheret+hetero`` is the preset as it is, ``pre-ln+adamw`` the preset with
``connection=pre-ln optimizer=adamw lr=6e-4``. Printed per arm, over the logged steps after the
first ``--skip`` (compilation and warm-up): tokens/s, MFU (against the device's peak from
``models.throughput.PEAK_FLOPS``, or ``--peak_flops``) and the optimizer's share of the step
time, the last validation loss, and the spheret arm's tokens/s as a ratio to the AdamW arm's.

``--quick`` is the tiny CPU version of the same code path (2 layers of width 64, context 64,
synthetic corpus, 5 steps, float32, no compile): it checks that the script runs, not speed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from models.config import build_config
from models.train import read_metrics, run_training

ARMS = {
    "spheret+hetero": {},
    "pre-ln+adamw": {"connection": "pre-ln", "optimizer": "adamw", "lr": "6e-4"},
}
QUICK = {"n_layer": "2", "n_embd": "64", "n_head": "2", "block_size": "64", "batch_size": "8",
         "grad_accum_steps": "2", "corpus": "synthetic:60000", "dtype": "float32",
         "compile": "false", "device": "cpu", "threads": "1"}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def _run_arm(name: str, overrides: dict, out: Path, steps: int) -> dict:
    cfg = build_config("gpt2-small", overrides={
        **overrides, "steps": str(steps), "warmup_steps": str(max(steps // 10, 1)),
        "eval_interval": str(steps), "eval_batches": "2", "log_interval": "1",
        "checkpoint": "false", "sample_tokens": "0", "progress": "false"})
    summary = run_training(cfg, out / name.replace("+", "_"), echo=False)
    return {"summary": summary, "rows": read_metrics(out / name.replace("+", "_") /
                                                     "metrics.jsonl")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=10, help="logged steps left out (warm-up)")
    parser.add_argument("--corpus", help="corpus spec (default: the preset's)")
    parser.add_argument("--out", help="run directories (default: a temporary directory)")
    parser.add_argument("--grad_accum_steps", help="micro-steps per step (default: preset's)")
    parser.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: preset's)")
    parser.add_argument("--compile", help="true | false (default: preset's)")
    parser.add_argument("--peak_flops", help="per-device peak FLOP/s for MFU")
    parser.add_argument("--quick", action="store_true", help="tiny CPU version (a smoke test)")
    args = parser.parse_args()
    common = dict(QUICK) if args.quick else {}
    for key in ("corpus", "grad_accum_steps", "dtype", "compile", "peak_flops"):
        if getattr(args, key) is not None:
            common[key] = getattr(args, key)
    steps, skip = (5, 1) if args.quick else (args.steps, args.skip)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        results = {name: _run_arm(name, {**common, **arm}, out, steps)
                   for name, arm in ARMS.items()}
    device = results["spheret+hetero"]["summary"]["device"]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"gpt2-small{' (--quick: tiny)' if args.quick else ''}, {steps} steps on {device} "
          f"({name}), logged steps {skip + 1}-{steps}")
    print(f"{'arm':<16}{'tokens/s':>12}{'MFU':>8}{'optimizer':>11}{'val loss':>10}")
    rates = {}
    for arm, result in results.items():
        rows = [r for r in result["rows"] if r["step"] > skip]
        rates[arm] = _mean(rows, "tokens_per_s")
        mfu, share = _mean(rows, "mfu"), _mean(rows, "optimizer_share")
        val = result["summary"].get("val_loss")
        print(f"{arm:<16}{rates[arm]:>12,.0f}"
              f"{f'{100 * mfu:.1f}%' if mfu is not None else 'n/a':>8}"
              f"{f'{100 * share:.1f}%' if share is not None else 'n/a':>11}"
              f"{f'{val:.4f}' if val is not None else 'n/a':>10}")
    print(f"spheret+hetero tokens/s / pre-ln+adamw: "
          f"{rates['spheret+hetero'] / rates['pre-ln+adamw']:.3f}")


if __name__ == "__main__":
    main()
