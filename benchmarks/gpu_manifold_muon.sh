#!/usr/bin/env bash
# The GPU check of issue 19 (items 4 and 7), ready for a lent machine: one short script, about
# 3-4 minutes on an H200. Run from the repository root:  bash benchmarks/gpu_manifold_muon.sh [OUT_DIR]
# Prints torch/CUDA versions, then ManifoldMuon against torch.optim.Muon on the GPT-2-small block
# (Stiefel, HETERO, DGram) on the products path (the CUDA default) with same-shape matrices
# solved as one batched dual (--batch on) and one at a time (--batch off), and the dual's eigh
# path for comparison. Each run prints s/step, the anchor's s/step and the dual iterations.
set -euo pipefail
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$out/gpu_env.txt"
runs="ManifoldMuon euclidean,ManifoldMuon stiefel,hetero,ManifoldMuon dgram"
for batch in on off; do
    timeout 80 python3 benchmarks/bench_manifold_muon.py --device cuda --steps 5 --warmup 3 --batch "$batch" \
        --only "$runs" | tee "$out/gpu_bench_products_batch_$batch.txt" || echo "batch $batch: failed or timed out"
done
timeout 60 python3 benchmarks/bench_manifold_muon.py --device cuda --steps 5 --warmup 3 --spectral eigh \
    --only "ManifoldMuon stiefel,hetero" | tee "$out/gpu_bench_eigh.txt" || echo "eigh: failed or timed out"
