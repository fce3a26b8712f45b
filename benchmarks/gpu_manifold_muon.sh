#!/usr/bin/env bash
# The GPU check of issue 19 (items 4 and 7), ready for a lent machine: one short script, at most
# 320 s by its timeouts. Run from the repository root:  bash benchmarks/gpu_manifold_muon.sh [OUT_DIR]
# Prints torch/CUDA versions, then ManifoldMuon against torch.optim.Muon on the GPT-2-small set of
# twelve blocks (--layers 12: 48 matrices, 768x768, 768x768, 3072x768, 768x3072 per block;
# Euclidean, Stiefel, HETERO) on the products path (the CUDA default), same-shape matrices solved as
# one batched dual (--batch on) and one at a time (--batch off); the dual's eigh path on the same
# set; and one block of DGram (its two square solves are the documented slow case). Each run prints
# s/step, the anchor's s/step, the ratio and the dual iterations. Goal (issue 19): Stiefel and
# HETERO <= 3x torch.optim.Muon on the twelve blocks.
set -euo pipefail
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$out/gpu_env.txt"
bench="python3 benchmarks/bench_manifold_muon.py --device cuda"
for batch in on off; do
    timeout 100 $bench --layers 12 --steps 5 --warmup 3 --batch "$batch" \
        --only "ManifoldMuon euclidean,ManifoldMuon stiefel,hetero" | tee "$out/gpu_bench_products_batch_$batch.txt" \
        || echo "batch $batch: failed or timed out"
done
timeout 70 $bench --layers 12 --steps 4 --warmup 2 --spectral eigh --only "ManifoldMuon stiefel,hetero" \
    | tee "$out/gpu_bench_eigh.txt" || echo "eigh: failed or timed out"
timeout 50 $bench --steps 3 --warmup 2 --batch on --only "ManifoldMuon dgram" \
    | tee "$out/gpu_bench_dgram_block.txt" || echo "dgram: failed or timed out"
