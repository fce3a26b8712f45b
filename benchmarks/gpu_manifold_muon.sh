#!/usr/bin/env bash
# The GPU check of issue 19 item 7, ready for a lent machine: one short script, about 3-5 minutes
# on an H200. Run from the repository root:  bash benchmarks/gpu_manifold_muon.sh [OUT_DIR]
# Prints torch/CUDA versions, then ManifoldMuon against torch.optim.Muon on the GPT-2-small block
# (Stiefel, HETERO, DGram), and the same with the dual's eigh path for comparison.
set -euo pipefail
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$out/gpu_env.txt"
timeout 240 python benchmarks/bench_manifold_muon.py --device cuda --steps 5 --warmup 3 \
    --only "euclidean,stiefel,hetero,dgram" | tee "$out/gpu_bench_products.txt"
timeout 150 python benchmarks/bench_manifold_muon.py --device cuda --steps 5 --warmup 3 --spectral eigh \
    --only "stiefel,hetero" | tee "$out/gpu_bench_eigh.txt"
