#!/bin/bash
# Kernel GPU tests + GEMM and quantization benchmarks on one Hopper GPU; everything lands in $OUT.
#   OUT=/tmp/out bash benchmarks/run_kernels_gpu.sh [all|tests|gemm|quantize|wgrad] [gemm deadline s] [models]
# Seven files come back: env.txt gpu_tests.log gemm.log ptxas.txt gemm_h200.json quantize.log
# quantize_h200.json. Each stage has its own time limit so one slow stage cannot eat the rest.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
STAGE=${1:-all}
GEMM_DEADLINE=${2:-150}
MODELS=${3:-1p5b,7b}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$OUT/env.txt" 2>&1
if [[ $STAGE == all || $STAGE == tests ]]; then
  timeout 120 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $STAGE == all || $STAGE == gemm ]]; then
  MOSAIC_GPU_DUMP_PTXAS=1 timeout $((GEMM_DEADLINE + 90)) python3 benchmarks/gemm.py \
    --out "$OUT/gemm_h200.json" --sweep --deadline "$GEMM_DEADLINE" --models "$MODELS" \
    > "$OUT/gemm.log" 2>&1
  grep -E "^compiling|registers|spill|stack frame|bytes smem" "$OUT/gemm.log" > "$OUT/ptxas.txt"
  grep -vE "ptxas|^compiling|^$" "$OUT/gemm.log" | tail -40
fi
if [[ $STAGE == wgrad ]]; then  # session 19's SASS reading: the promotion moved past the release
  timeout 240 python3 benchmarks/gemm.py --out "$OUT/gemm_wgrad_h200.json" --models 1p5b,7b \
    --shapes wgrad --variants 'scales_first=True,tile_n=128;scales_first=True,tile_n=128' \
    --baselines 0 --breakdown 0 --deadline 180 2>&1 | grep -vE "ptxas|^$" | tail -30
fi
if [[ $STAGE == all || $STAGE == quantize ]]; then
  timeout 100 python3 benchmarks/quantize.py --out "$OUT/quantize_h200.json" --deadline 55 2>&1 \
    | tee "$OUT/quantize.log"
fi
