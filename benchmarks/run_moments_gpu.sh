#!/bin/bash
# The fp8-moments update benchmark on one H200; everything lands in $OUT.
#   OUT=/tmp/out INFIR2_GIT_COMMIT=<sha> bash benchmarks/run_moments_gpu.sh [configs]
# Needs the wheels of ../shared/device/wheels.sh in .whl/ (carry it): ml-collections.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moments_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$OUT/env.txt"
CONFIGS=${1:-configs/1p5b.py,configs/7b.py}
python3 benchmarks/moments_update.py --tiny --steps=2 --iters=3 --out="$OUT/moments_update_tiny.json" 2>&1 \
  | grep --line-buffered -v "^W0000\|^I0000" | tail -8 | tee "$OUT/tiny.log"
python3 benchmarks/moments_update.py --configs="$CONFIGS" --steps=2 --iters=10 \
  --out="$OUT/moments_update_h200.json" 2>&1 | grep --line-buffered -v "^W0000\|^I0000" | tee "$OUT/bench.log" | tail -30
