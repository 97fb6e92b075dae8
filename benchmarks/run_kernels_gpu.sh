#!/bin/bash
# Kernel GPU tests + GEMM and quantization benchmarks on one Hopper GPU; everything lands in $OUT.
#   OUT=/tmp/out bash benchmarks/run_kernels_gpu.sh [all|tests|gemm|quantize|wgrad|fusedpipe|attn|attndiag|triton|saturate|normed] [gemm deadline s] [models]
# normed: session 29 (issue 33), the RMSNorm -> quantize kernel's GPU test and
# benchmarks/normed_quantize.py (XLA's norm then the quantize kernel vs one normed kernel).
# attndiag: issue 39, benchmarks/fp8_attention_diagnose.py (which scale, if any, lands wrong;
# errors by row and block; the forward with and without the warpgroups' ping-pong vs cuDNN).
# attn: issue 39 at 1.5B / 2 x 8192: the FP8 attention kernel's GPU test, then
# benchmarks/attention.py, the forward alone first (the kernel against cuDNN dense, causal
# and packed and JAX's Mosaic GPU FlashAttention-3), then fwd+bwd.
# triton: issue 33's design 2, the quantizers as Pallas Triton kernels against the Mosaic GPU
# kernels and XLA at the 1.5B's and 7B's shapes (benchmarks/quantize_backends.py), with checks.
# fusedpipe: the fused SwiGLU kernels' GPU test, then the persistent pipelined kernel
# (FusedConfig.programs) against today's in fused_bwd_bisect.py and fused_quantize.py.
# Seven files come back: env.txt gpu_tests.log gemm.log ptxas.txt gemm_h200.json quantize.log
# quantize_h200.json. Each stage has its own time limit so one slow stage cannot eat the rest.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kernels_out}
mkdir -p "$OUT"
for d in .stage_?; do  # a part of the study's GGUF, for its slice that follows at once
  [[ -d $d ]] && mkdir -p /tmp/stage && cp "$d"/* /tmp/stage/
done
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
if [[ $STAGE == qkv ]]; then  # session 26: the fused q|k|v GEMMs against q, k and v apart
  timeout 60 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
    -k "scanned_remat" 2>&1 | tail -4
  timeout 240 python3 benchmarks/gemm.py --out "$OUT/gemm_qkv_h200.json" --models 1p5b,7b \
    --shapes q_proj,k_proj,qkv_proj --baselines 0 --cublas_blockwise 0 --breakdown 0 \
    --deadline 200 2>&1 | grep -vE "ptxas|^$" | tail -30
fi
if [[ $STAGE == all || $STAGE == quantize ]]; then
  timeout 100 python3 benchmarks/quantize.py --out "$OUT/quantize_h200.json" --deadline 55 2>&1 \
    | tee "$OUT/quantize.log"
fi
if [[ $STAGE == fusedpipe ]]; then  # session 21's persistent, pipelined fused kernels
  timeout 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "fused_quantize_on_gpu" 2>&1 | grep -E "passed|failed|Error|differ" | tail -14 \
    | tee "$OUT/gpu_tests.log"
  timeout 150 python3 benchmarks/fused_bwd_bisect.py --out "$OUT/fused_bisect_h200.json" \
    --variants=fwd,fwd_pipelined,bwd,bwd_pipelined,bwd_pipelined_264,copy2_3in,copy2_3in_pipelined \
    2>&1 | grep -vE "^W0000|^I0000|^$" | tail -12
  timeout 200 python3 benchmarks/fused_quantize.py --out "$OUT/fused_quantize_h200.json" 2>&1 \
    | grep -vE "^W0000|^I0000|^$" | tail -8
fi
if [[ $STAGE == triton ]]; then  # issue 33: Mosaic vs Triton (8/16/32 warps) vs XLA quantizers
  timeout 200 python3 benchmarks/quantize_backends.py --out "$OUT/quantize_backends_h200.json" \
    2>&1 | grep -vE "^W0000|^I0000|^$" | tee "$OUT/quantize_backends.log" | tail -12
fi
if [[ $STAGE == saturate ]]; then  # session 27: the lean quantizers' GPU tests, lean vs full
  timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
    -k "quantize" 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  timeout 240 python3 benchmarks/quantize_backends.py --out "$OUT/quantize_saturate.json" \
    --warps "" 2>&1 | grep -vE "^W0000|^I0000|^$" | tee "$OUT/quantize_saturate.log" | tail -8
fi
if [[ $STAGE == normed ]]; then  # session 29 (issue 33): RMSNorm -> quantize as one kernel
  timeout 150 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
    -k "quantize_normed or quantize_tiles" 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  timeout 200 python3 benchmarks/normed_quantize.py --out "$OUT/normed_quantize.json" \
    2>&1 | grep -vE "^W0000|^I0000|^$" | tee "$OUT/normed_quantize.log" | tail -8
fi
if [[ $STAGE == attndiag ]]; then  # issue 39: where the kernel departs from its reference on the GPU
  timeout 200 python3 benchmarks/fp8_attention_diagnose.py --stages exact_s,scales,errors,speed,mgpu \
    --out "$OUT/fp8_attention_diagnose_h200.json" 2>&1 | grep -vE "^W0000|^I0000|^$" \
    | cut -c1-1500 | tee "$OUT/fp8_attention_diagnose.log" | tail -16
fi
if [[ $STAGE == attn ]]; then  # issue 39: our FP8 forward kernel against the BF16 kernels
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_attention_kernel.py \
    2>&1 | grep -E "passed|failed|Error|assert" | tail -8 | tee "$OUT/gpu_tests_attention.log"
  timeout 200 python3 benchmarks/attention.py --shapes=1p5b_8k --fwd_only \
    --out "$OUT/attention_fwd_h200.json" 2>&1 | grep -vE "^W0000|^I0000|^$" | tail -8
  timeout 200 python3 benchmarks/attention.py --shapes=1p5b_8k --out "$OUT/attention_h200.json" \
    2>&1 | grep -vE "^W0000|^I0000|^$" | tail -8
fi
