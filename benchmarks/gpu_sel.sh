#!/usr/bin/env bash
# The GPU check of issue 22 (item 1, SEL on CUDA), ready for a lent machine: one short script,
# at most 250 s by its timeouts. Run from the repository root:  bash benchmarks/gpu_sel.sh [OUT_DIR]
# First the CUDA correctness tests of the chart (impl="fused" takes the compiled expression on
# CUDA: values and gradients against the float64 CPU rule; a charted model trained on CUDA and
# on the CPU), then the training-step overhead of SEL at GPT-2-small scale (d 768, 12 layers,
# 8,192 tokens/step) against the same GPT without charts, with torch's fused AdamW. The goal is
# sel <= 1.03x plain; "merged" is the inference form. ("sel-aten" switches off the CPU kernels
# only: on CUDA it runs what "sel" runs, a second sample of the same path.)
set -euo pipefail
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" | tee "$out/gpu_env.txt"
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/charts/test_sel_cuda.py 2>&1 | tail -5 | tee "$out/gpu_sel_tests.txt" \
    || echo "tests: failed or timed out"
timeout 170 python3 benchmarks/bench_sel.py --device cuda --n-embd 768 --n-layer 12 --n-head 12 --block 1024 \
    --batch 8 --steps 5 --repeats 5 --adamw fused | tee "$out/gpu_bench_sel.txt" || echo "bench: failed or timed out"
