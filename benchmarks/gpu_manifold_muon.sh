#!/usr/bin/env bash
# The GPU check of Manifold Muon's banked, sync-free step, ready for a lent machine: one script,
# at most 480 s by its timeouts. Run from the repository root:
#     bash benchmarks/gpu_manifold_muon.sh [OUT_DIR]
# 1. bench_step_counts.py on the GPT-2-small set (12 blocks of width 768, 72 matrices): ops, host
#    syncs and FLOPs against torch.optim.Muon (device-independent; the same numbers as on a CPU),
#    then the time per step of Euclidean, Stiefel and HETERO against torch.optim.Muon on the full
#    set (the CUDA default: products path, no host read).
# 2. bench_manifold_muon.py on the same set: s/step, ratio, dual iterations and residuals per
#    optimizer, and one block of all-DGram (its square matrices take the smoothed dual).
# 3. check_step_syncs.py: torch's own report (set_sync_debug_mode) of every host synchronization in
#    the steps after a plan's first, incl. two learning rates in one bank under a schedule.
# 4. bench_gpt2_small.py: a GPT-2-small training run (1-SpheretNorm + HETERO against Pre-LN + AdamW),
#    tokens/s, MFU and the optimizer's share of the step.
set -uo pipefail
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
    | tee "$out/gpu_env.txt"
timeout 140 python3 benchmarks/bench_step_counts.py --device cuda --blocks 12 --time-blocks 12 --time-steps 5 \
    --warmup 3 | tee "$out/gpu_step_counts.txt" || echo "step counts: failed or timed out"
timeout 100 python3 benchmarks/bench_manifold_muon.py --device cuda --layers 12 --steps 5 --warmup 3 \
    --only "ManifoldMuon euclidean,ManifoldMuon stiefel,hetero" | tee "$out/gpu_bench_manifold_muon.txt" \
    || echo "bench_manifold_muon: failed or timed out"
timeout 30 python3 benchmarks/bench_manifold_muon.py --device cuda --steps 3 --warmup 2 --only "ManifoldMuon dgram" \
    | tee "$out/gpu_bench_dgram_block.txt" || echo "dgram block: failed or timed out"
timeout 40 python3 benchmarks/check_step_syncs.py --device cuda --blocks 2 --steps 3 | tee "$out/gpu_step_syncs.txt" \
    || echo "step syncs: failed or timed out"
timeout 170 python3 benchmarks/bench_gpt2_small.py --steps 30 --skip 10 | tee "$out/gpu_gpt2_small.txt" \
    || echo "gpt2-small: failed or timed out"
