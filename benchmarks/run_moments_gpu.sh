#!/bin/bash
# The fp8-moments update benchmark on one H200; everything lands in $OUT.
#   OUT=/tmp/out INFIR2_GIT_COMMIT=<sha> bash benchmarks/run_moments_gpu.sh [configs] [variants]
# First the GPU tests of the Triton kernels against the reference (tests/test_fp8_adam_gpu.py:
# the update's kernel and the fused step's), then the tiny shape set (whole arrays compared:
# the update variants with fp8_reference, the step variants with fp8_reference_step), then
# each config's shapes. The default variants time first what the train step now runs from the
# raw gradient sums to new params (optax_fp32_step, fp8_pallas_step: the non-fused kernel in
# the generic step, fp8_fused_step: optim.make_apply's fused kernel), then the update alone
# (optax_fp32, fp8_pallas) beside session 20's numbers; fp8_jnp and fp8_pallas_precise,
# measured before, are left out of the default to stay inside the timeouts.
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
VARIANTS=${2:-optax_fp32_step,fp8_pallas_step,fp8_fused_step,optax_fp32,fp8_pallas}
timeout 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_fp8_adam_gpu.py 2>&1 \
  | grep -vE "^W0000|^I0000|^$" | tail -8 | tee "$OUT/gpu_tests_moments.log"
timeout 120 python3 benchmarks/moments_update.py --tiny --steps=2 --iters=3 \
  --variants=fp8_reference,fp8_jnp,fp8_pallas,fp8_pallas_precise,fp8_reference_step,fp8_pallas_step,fp8_fused_step \
  --out="$OUT/moments_update_tiny.json" 2>&1 | grep --line-buffered -v "^W0000\|^I0000" \
  | tail -4 | tee "$OUT/tiny.log"
timeout 420 python3 benchmarks/moments_update.py --configs="$CONFIGS" --variants="$VARIANTS" \
  --steps=2 --iters=10 --out="$OUT/moments_update_h200.json" 2>&1 \
  | grep --line-buffered -v "^W0000\|^I0000" | tee "$OUT/bench.log" | grep -E "ms|bit-ident" | tail -20
