#!/usr/bin/env bash
# Every GPU check the open issues name, as one command for a lent machine (at most 570 s by the
# scripts' timeouts, inside one 10-minute call): benchmarks/gpu_sel.sh (SEL on CUDA, issue 22), then
# benchmarks/gpu_manifold_muon.sh (Manifold Muon: counts, banked step time, GPT-2-small share, issue 40). Output under
# OUT_DIR (default $OUT, else /tmp).
#
# The lent H200's image has torch, pytest and hypothesis but not geoopt. Prepare it here, once:
#     echo /.whl/ >> .git/info/exclude
#     python -m pip download --no-deps --only-binary=:all: -d .whl geoopt==0.5.1
# then run with `.whl` carried:  bash benchmarks/gpu_checks.sh
# (the wheels in .whl are installed to /tmp/site and put on PYTHONPATH with the repository root).
set -uo pipefail
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"
site=/tmp/site
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 1; }
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import geoopt, manifoldlib" || { echo "manifoldlib does not import: carry geoopt (see the header)"; exit 1; }
bash benchmarks/gpu_sel.sh "$out" 2>&1 | tee "$out/gpu_sel.log"
bash benchmarks/gpu_manifold_muon.sh "$out" 2>&1 | tee "$out/gpu_manifold_muon.log"
