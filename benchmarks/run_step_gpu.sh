#!/bin/bash
# The train-step benchmarks the README's tables come from, on one H200; everything lands in $OUT.
#   OUT=/tmp/out INFIR2_GIT_COMMIT=<sha> bash benchmarks/run_step_gpu.sh STAGE [deadline s]
# STAGE: 1p5b (GPU tests of the model, then 1.5B at 2 x 8192, document mask),
#        fused (GPU tests of the fused MLP kernels, their benchmark against the separate
#        passes, then 1.5B at 2 x 8192: bf16, infir2 without and with the fused MLP, each
#        profiled, compiled HLO kept for attributing the profile's fusions),
#        fused2 (the fused kernels' configs with ptxas' register report, the fused MLP's
#        GPU test, then 1.5B at 2 x 8192: infir2 and bf16, scanned and unrolled layers),
#        pair (1.5B at 2 x 8192: infir2 and bf16 only, profiled: the short re-measure),
#        rest (the packed attention's GPU tests with both document kernels, then 1.5B at
#        2 x 8192, profiled: infir2 and bf16 scanned and unrolled, infir2 with FA3 varlen),
#        layout (the fused MLP's GPU test, then 1.5B at 2 x 8192, profiled: infir2 and bf16
#        unrolled, infir2 unrolled saving the FP8 residuals, infir2 scanned),
#        unrolled (1.5B at 2 x 8192, profiled, all unrolled: bf16, infir2, infir2 saving the
#        FP8 residuals, that with Adam's moments in FP8: the layout fix and memory for speed),
#        fast (the Pallas-vs-XLA GEMM tests, then 1.5B at 2 x 8192, profiled, unrolled: bf16,
#        configs/1p5b.py:fast's infir2, that with FA3 varlen, that with Adam's moments in FP8),
#        fusedbwd (the fused SwiGLU backward's GPU test and bisect, then 1.5B at 2 x 8192,
#        profiled, unrolled: bf16, the fast infir2 without and with precision.fused_mlp_backward),
#        pipe (1.5B at 2 x 8192, profiled, unrolled: bf16, the fast infir2 profiled with XLA's
#        command buffers left on (where the step's idle time is), the fast infir2; each
#        timed pipelined as the trainer runs steps and blocked as before),
#        mem (1.5B at 2 x 8192: bf16 unrolled, infir2 as configs/1p5b.py has it, the fast
#        infir2 and save_dots infir2 each with fp8 moments and the chunked loss: the memory
#        target's candidates, 0.71x / 0.59x of bf16 by benchmarks/peak_buffers.py),
#        memfast (1.5B at 2 x 8192: the fast infir2 with fp8 moments and the chunked loss, the
#        default infir2 of configs/1p5b.py, the fast infir2: the memory target's candidate
#        against the default's time, in the fewest compiles),
#        fusedloss (1.5B at 2 x 8192, unrolled: bf16, the fast infir2, that with the fused
#        head and loss (model.loss_fused, loss_chunk 2048), bf16 with it, configs/1p5b.py:lean
#        with it: the loss without float32 logits against the whole-row loss's time),
#        7bfused (7B at 4 x 4096, document mask: bf16, infir2, infir2 without the fused backward),
#        7b (7B at 4 x 4096, document mask, Adam's moments fp32 / fp8 / bf16),
#        remat (1.5B at 2 x 8192, the fused loss: infir2 as configs/1p5b.py has it (scanned),
#        then unrolled bf16 and infir2 each with its usual remat and with none, the memory
#        the fused loss freed spent on no recomputation),
#        7bmem (7B at 4 x 4096: infir2 as configs/7b.py has it, and unrolled with fp8
#        moments, the fused loss and the fused FP8 AdamW step: the <= 78 GiB candidate),
#        lean (1.5B at 2 x 8192: bf16, the default infir2, that with fp8 moments),
#        quantlean (the quantize kernels "lean" vs "full" alone at the 1.5B's shapes, then
#        1.5B at 2 x 8192: bf16, infir2 lean and full, bf16 with three q/k/v products),
#        7bspeed (7B at 4 x 4096: bf16 as configs/7b.py has it, infir2 unrolled with fp8
#        moments, the fused loss and the fused FP8 AdamW step under save_dots and save_dots_fp8),
#        triton (1.5B at 2 x 8192, profiled: bf16, the default infir2, that with
#        precision.quantize_backend=triton: issue 33's Triton quantizers in the step),
#        7bunrolled (7B at 4 x 4096, full remat, unrolled: bf16, infir2 with fp8 moments, the
#        fused loss and the fused FP8 AdamW step (the <= 78 GiB candidate), infir2),
#        7bpeak (issue 35: the <= 78 GiB candidate's buffers from the GPU's own autotuned
#        compile, with and without XLA's Triton GEMMs, then its step without them),
#        7bfast (7B unrolled, FP8 moments, the fused loss: bf16 with save_dots beside infir2
#        with save_dots_fp8; then the <= 78 GiB candidate's autotuned buffers with the time left),
#        qkv (1.5B at 2 x 8192: bf16, infir2 (q|k|v fused), infir2 with three q/k/v products),
#        shared (1.5B at 2 x 8192: bf16 and infir2 with the float32 embedding-gradient sums
#        (sorted) and the one-pass log-sum-exp, bf16 with the whole-table form session 28
#        timed, infir2 with both old forms: the shared part's two fixes),
#        sharedlean (session 29: the shared stage's four rows and the lean stage's FP8-moment row),
#        normed (session 29: bf16, infir2, infir2 with precision.fused_norm),
#        7bmaster (session 30: the 7B candidate differentiating the float32 masters beside
#        the bf16 copies: INFIR2_GRAD_INPUTS=master's time and peak),
#        normedpair (session 30: the normed kernel's GPU check and time alone, then infir2
#        without and with precision.fused_norm, profiled), rope (the normed check, bf16,
#        infir2, infir2 with INFIR2_ROPE=per_layer, with INFIR2_GRAD_BARRIER=always and with
#        fused_norm: sessions 31-32's A/Bs),
#        7bcand (session 29: the <= 78 GiB 7B candidate alone, for an 80 GB H100, then its
#        buffers from the autotuned compile),
#        startup (the trainer's start-up phases on the 1.5B config, cold then warm cache).
# Needs the wheels of ../shared/device/wheels.sh in .whl/ (carry it).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/step_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > /tmp/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
STAGE=${1:-1p5b}
DEADLINE=${2:-400}
COMMON=(--tokens_per_step=16384 --data=text --override=data.tokenizer=default
        --override=opt.warmup_steps=10 --noise_run=0)
# The 1.5B at 2 x 8192, 20 pipelined steps a row: step_1p5b RECIPES LINES [more flags].
step_1p5b() {
  local recipes=$1 lines=$2; shift 2
  timeout $((DEADLINE + 220)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes="$recipes" \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=220 \
    --deadline_s="$DEADLINE" "$@" --out="$OUT/train_step_1p5b_8k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -"$lines"
}
# The RMSNorm -> quantize kernel's GPU test (session 30's rounding fix), ~60 s.
normed_gpu_check() {
  timeout 80 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -p no:cacheprovider \
    -k "quantize_normed" 2>&1 | grep -E "passed|failed|differs" | tail -6 | tee "$OUT/gpu_tests.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$OUT/env.txt"
for d in .stage_?; do  # a part of the study's GGUF, for its slice that follows at once
  [[ -d $d ]] && mkdir -p /tmp/stage && cp "$d"/* /tmp/stage/ && ls -la /tmp/stage | tail -1
done
if [[ $STAGE == 1p5b ]]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_packed_attention.py \
    tests/test_precision_dot_general.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  timeout $((DEADLINE + 200)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=bf16,infir2,infir2~model.loss_chunk=2048,bf16~model.loss_chunk=2048,infir2~opt.moments=fp8 \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=44 --steps=40 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_1p5b_8k.json" 2>&1 | tail -30
elif [[ $STAGE == fused ]]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "fused or scanned_remat" 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  timeout 150 python3 benchmarks/fused_quantize.py --out "$OUT/fused_quantize.json" 2>&1 | tail -8
  timeout $((DEADLINE + 200)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=bf16,infir2~precision.fused_mlp=False,infir2 \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=30 --steps=24 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof --hlo_dir="$OUT" \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | tail -40
elif [[ $STAGE == fused2 ]]; then
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 benchmarks/fused_quantize.py \
    --out "$OUT/fused_quantize.json" > /tmp/fq.log 2>&1
  grep -E "^(fwd|bwd) " /tmp/fq.log
  grep -iE "entry function|registers|spill|smem" /tmp/fq.log | head -60 > "$OUT/fused_ptxas.txt"
  head -12 "$OUT/fused_ptxas.txt"
  timeout 100 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "fused_mlp_pallas" 2>&1 | grep -vE "onstant.folding|slow_operation|reduce_max|^$|If you|This isn" \
    | tail -30 > "$OUT/gpu_tests.log"
  tail -4 "$OUT/gpu_tests.log"
  timeout $((DEADLINE + 260)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=infir2,bf16,infir2~model.scan_layers=False,bf16~model.scan_layers=False \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=30 --steps=24 --variant_timeout_s=260 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -45
elif [[ $STAGE == pair ]]; then
  timeout $((DEADLINE + 200)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=infir2,bf16 --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 \
    --variant_timeout_s=200 --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -30
elif [[ $STAGE == rest ]]; then
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_packed_attention.py \
    2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
  timeout $((DEADLINE + 120)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=infir2,bf16,infir2~model.scan_layers=False,bf16~model.scan_layers=False,infir2~model.document_kernel=fa3_varlen \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == layout ]]; then
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "fused_mlp_pallas" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -4 \
    | tee "$OUT/gpu_tests.log"
  timeout $((DEADLINE + 120)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=infir2~model.scan_layers=False,bf16~model.scan_layers=False,infir2~model.scan_layers=False~model.remat=save_dots_fp8,infir2 \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == unrolled ]]; then
  U=model.scan_layers=False
  timeout $((DEADLINE + 400)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=bf16~$U,infir2~$U,infir2~$U~model.remat=save_dots_fp8,infir2~$U~model.remat=save_dots_fp8~opt.moments=fp8 \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == fast ]]; then
  F=model.scan_layers=False~model.remat=save_dots_fp8
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_precision_dot_general.py \
    2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -4 | tee "$OUT/gpu_tests.log"
  timeout $((DEADLINE + 400)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=bf16~model.scan_layers=False,infir2~$F,infir2~$F~model.document_kernel=fa3_varlen,infir2~$F~opt.moments=fp8 \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=240 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == fusedbwd ]]; then
  F=model.scan_layers=False~model.remat=save_dots_fp8
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py \
    -k "fused_quantize_on_gpu and swiglu_bwd" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" \
    | tail -4 | tee "$OUT/gpu_tests.log"
  timeout 120 python3 benchmarks/fused_bwd_bisect.py --out="$OUT/fused_bwd_bisect.json" 2>&1 \
    | grep -v "^W0000\|^I0000" | tail -12
  timeout $((DEADLINE + 200)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=bf16~model.scan_layers=False,infir2~$F~precision.fused_mlp_backward=False,infir2~$F \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == pipe ]]; then
  F=model.scan_layers=False~model.remat=save_dots_fp8
  timeout $((DEADLINE + 200)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=bf16~model.scan_layers=False,infir2~$F~--xla_enable_command_buffers_during_profiling=true,infir2~$F \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --profile_dir=/tmp/prof \
    --out="$OUT/train_step_1p5b_8k.json" 2>&1 | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == mem ]]; then
  U=model.scan_layers=False; F=$U~model.remat=save_dots_fp8; L=opt.moments=fp8~model.loss_chunk=2048
  timeout $((DEADLINE + 260)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=bf16~$U,infir2~$F~$L,infir2,infir2~$U~$L \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=260 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_1p5b_8k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == memfast ]]; then
  F=model.scan_layers=False~model.remat=save_dots_fp8; L=opt.moments=fp8~model.loss_chunk=2048
  timeout $((DEADLINE + 200)) python3 benchmarks/train_step.py --config=configs/1p5b.py \
    --recipes=infir2~$F~$L,infir2,infir2~$F \
    --seq_lens=8192 "${COMMON[@]}" --override=steps=26 --steps=20 --variant_timeout_s=200 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_1p5b_8k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -40
elif [[ $STAGE == fusedloss ]]; then
  F=model.scan_layers=False~model.remat=save_dots_fp8; C=model.loss_chunk=2048~model.loss_fused=True
  L=$F~opt.moments=fp8~model.loss_chunk=2048
  step_1p5b bf16~model.scan_layers=False,infir2~$F,infir2~$F~$C,bf16~model.scan_layers=False~$C,infir2~$L~model.loss_fused=True 40
elif [[ $STAGE == 7bfused ]]; then
  timeout $((DEADLINE + 230)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=bf16,infir2,infir2~precision.fused_mlp_backward=False \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=16 --steps=12 --variant_timeout_s=230 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -30
elif [[ $STAGE == 7b ]]; then
  timeout $((DEADLINE + 230)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=bf16,infir2~opt.moments=fp8,infir2,infir2~opt.moments=bf16 \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=16 --steps=12 --variant_timeout_s=230 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 | tail -30
elif [[ $STAGE == remat ]]; then
  # Memory spent on speed at 1.5B (issues 34, 35): with the fused loss (configs/1p5b.py's
  # default since session 21) bf16 peaks at 46.6 GiB and :fast at 50.9, so keeping every
  # activation (remat none: no recomputed norms, SwiGLU, RoPE) may fit and be faster.
  step_1p5b infir2,bf16~model.scan_layers=False,bf16~model.scan_layers=False~model.remat=none,infir2~model.scan_layers=False~model.remat=save_dots_fp8,infir2~model.scan_layers=False~model.remat=none 40
elif [[ $STAGE == 7bmem ]]; then
  # Issue 35's 7B memory target (<= 78 GiB at no more than infir2's default time): infir2 as
  # configs/7b.py has it (scanned, full remat) and configs/7b.py:lean's settings: unrolled,
  # FP8 moments (the fused FP8 AdamW step), the fused loss 1024 tokens at a time (with 2048
  # and float32 layer gradients: 78.9 GiB on the H200 in session 25, 1255.2 ms; since session
  # 26 every projection's gradient stays bf16: deviceless 74.2 -> 66.7 GiB).
  U=model.scan_layers=False; M=opt.moments=fp8~model.loss_chunk=1024~model.loss_fused=True
  timeout $((DEADLINE + 240)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=infir2,infir2~$U~$M \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=14 --steps=10 --variant_timeout_s=240 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -30
elif [[ $STAGE == lean ]]; then
  # Issue 35's first target at 1.5B: the default (unrolled, save_dots_fp8, fused loss)
  # against :lean (FP8 moments: now the fused FP8 AdamW step), and bf16, in one run.
  step_1p5b bf16,infir2,infir2~opt.moments=fp8 30
elif [[ $STAGE == qkv ]]; then
  # Session 26 (issue 33): q, k and v as one FP8 product (precision.fused_qkv, now the
  # default) against three, with every projection's gradient in bf16 in both, and bf16.
  step_1p5b bf16,infir2,infir2~precision.fused_qkv=False 30
elif [[ $STAGE == shared ]]; then
  # Session 28 (issues 34/33): the embedding's backward sums repeated tokens in float32 (it was
  # a bf16 scatter-add: 4.2 ms of bf16 atomics in the H100 profile) and the loss reads each
  # chunk's float32 logits once for log-sum-exp (max and sum carried together). Session 28
  # timed bf16 with both against both old forms (-5.1 ms) with the whole-table float32 sums
  # (INFIR2_EMBED_GRAD=f32_table: +0.9 GiB at the peak); the default since sorts the tokens
  # (no table-sized float32 buffer). Rows: both recipes as they are, bf16 with the table
  # form, infir2 with both old forms (INFIR2_EMBED_GRAD=autodiff, INFIR2_LOGSUMEXP=two_pass).
  step_1p5b bf16,infir2,bf16~INFIR2_EMBED_GRAD=f32_table,infir2~INFIR2_EMBED_GRAD=autodiff~INFIR2_LOGSUMEXP=two_pass 40
elif [[ $STAGE == quantlean ]]; then
  # Session 27 (issue 33): the quantize kernels leave the clip to the saturating fp8 cast and
  # flush subnormals only where it can matter ("lean") against the session-26 body ("full"):
  # alone (1.5B shapes, outputs checked on the device with saturating and subnormal tiles),
  # then in the step beside bf16 with q|k|v as one product and as three.
  timeout 110 python3 benchmarks/quantize_backends.py --models 1p5b --warps "" --iters 10 \
    --out "$OUT/quantize_lean.json" 2>&1 | grep -vE "^W0000|^I0000|^$" | tail -4
  step_1p5b bf16,infir2,infir2~INFIR2_KERNEL_QUANTIZE=full,bf16~precision.fused_qkv=False 30
elif [[ $STAGE == triton ]]; then
  # Issue 33's design 2 in the step, after run_kernels_gpu.sh triton shows the kernels alone
  # faster: the default infir2 with every 1x128 quantizer (X, dY, SwiGLU's) as a Pallas
  # Triton kernel (precision.quantize_backend=triton) against the Mosaic ones, and bf16.
  # Session 24: the kernels alone were 2.2-3.1x slower, so this stage was not run.
  step_1p5b bf16,infir2,infir2~precision.quantize_backend=triton 30 --profile_dir=/tmp/prof
elif [[ $STAGE == 7bspeed ]]; then
  # Memory spent on speed at 7B (issue 35 item 3): unrolled layers with FP8 moments, the
  # fused loss and the fused FP8 AdamW step leave room for lighter remat (deviceless
  # allocations 101.3 GiB with save_dots, 119.5 with save_dots_fp8, against 121.5 for
  # infir2 with full remat; results/peak_buffers_7b_s21_fused_apply.json).
  # XLA's memory-usage reports of the compiled steps come back too: against the deviceless
  # compile's (benchmarks/peak_buffers.py) they show what the H200's ~6 GiB more is.
  U=model.scan_layers=False~opt.moments=fp8~model.loss_chunk=2048~model.loss_fused=True
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=/tmp/xla_dump --xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_pass_re=NONE" \
  timeout $((DEADLINE + 240)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=bf16,infir2~$U~model.remat=save_dots,infir2~$U~model.remat=save_dots_fp8 \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=14 --steps=10 --variant_timeout_s=240 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -30
  mkdir -p "$OUT/xla_memory" && cp /tmp/xla_dump/*memory-usage-report.txt "$OUT/xla_memory/" 2>/dev/null
  ls "$OUT/xla_memory" | head
elif [[ $STAGE == 7bunrolled ]]; then
  # Issues 34, 33, 35 at 7B in one call: bf16 and infir2 unrolled (full remat as configs/7b.py;
  # at 1.5B unrolling made the step 1.18x faster, the 7B has only been measured scanned),
  # then the <= 78 GiB candidate (unrolled, FP8 moments with the fused step, the fused loss).
  U=model.scan_layers=False; M=opt.moments=fp8~model.loss_chunk=2048~model.loss_fused=True
  timeout $((DEADLINE + 240)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=bf16~$U,infir2~$U~$M,infir2~$U \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=14 --steps=10 --variant_timeout_s=240 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -30
elif [[ $STAGE == 7bpeak ]]; then
  # Issue 35: the <= 78 GiB candidate measured 78.9 GiB on the H200 (session 25) where the
  # deviceless compile allocates 74.2: what the autotuned compile adds, from its own buffer
  # assignment, as XLA picks GEMMs and without XLA's Triton GEMMs (no split-K partials);
  # then the candidate's step without them.
  U=model.scan_layers=False; C=infir2~$U~opt.moments=fp8~model.loss_fused=True~model.loss_chunk=1024
  NT=--xla_gpu_enable_triton_gemm=false
  timeout 150 python3 benchmarks/peak_buffers.py --attached --config=configs/7b.py \
    --seq_len=4096 --batch_size=4 --variants=$C \
    --out="$OUT/peak_buffers_7b_attached.json" 2>&1 | grep -vE "^W0000|^I0000" | tail -16
  XLA_FLAGS=$NT timeout 150 python3 benchmarks/peak_buffers.py --attached --config=configs/7b.py \
    --seq_len=4096 --batch_size=4 --variants=$C \
    --out="$OUT/peak_buffers_7b_attached_no_triton_gemm.json" 2>&1 | grep -vE "^W0000|^I0000" | tail -16
  timeout $((DEADLINE + 230)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=$C~$NT --seq_lens=4096 "${COMMON[@]}" --override=steps=14 --steps=10 \
    --variant_timeout_s=230 --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -12
elif [[ $STAGE == sharedlean ]]; then
  # Session 29: the shared stage's rows (session 28's two fixes to the shared part, the sorted
  # float32 embedding sums now the default) and the lean stage's FP8-moment row (issue 35 at
  # 1.5B) in one run, the most needed rows first.
  step_1p5b bf16,infir2,infir2~opt.moments=fp8,infir2~INFIR2_EMBED_GRAD=autodiff~INFIR2_LOGSUMEXP=two_pass,bf16~INFIR2_EMBED_GRAD=f32_table 40
elif [[ $STAGE == 7bcand ]]; then
  # Session 29 (issue 35): the <= 78 GiB candidate alone (configs/7b.py:lean's settings, the
  # fused loss 1024 tokens at a time; deviceless 66.9 GiB), so it runs on an 80 GB H100: its
  # time and the GPU allocator's own peak. Then its buffers from the autotuned compile.
  U=model.scan_layers=False; M=opt.moments=fp8~model.loss_chunk=1024~model.loss_fused=True
  timeout $((DEADLINE + 100)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=infir2~$U~$M \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=14 --steps=10 --variant_timeout_s=$DEADLINE \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -14
  LEFT=$((560 - SECONDS))
  if (( LEFT > 90 )); then
    timeout $LEFT python3 benchmarks/peak_buffers.py --attached --config=configs/7b.py \
      --seq_len=4096 --batch_size=4 --variants=infir2~$U~$M \
      --out="$OUT/peak_buffers_7b_attached.json" 2>&1 | grep -vE "^W0000|^I0000" | tail -16
  fi
elif [[ $STAGE == normed ]]; then
  # Session 29 (issue 33): precision.fused_norm, the RMSNorm's output quantized straight from
  # the residual stream (kernels.quantize_normed_tiles: no bf16 normed tensor written and read
  # again), against the default infir2 and bf16. Time the kernel alone first
  # (run_kernels_gpu.sh normed).
  step_1p5b bf16,infir2,infir2~precision.fused_norm=True 30
elif [[ $STAGE == 7bmaster ]]; then
  # Session 30 (issue 35): the <= 78 GiB 7B candidate differentiating the float32 masters
  # (INFIR2_GRAD_INPUTS=master: no tree-wide bf16 copy; deviceless 61.7 GiB allocated, 54.8
  # live at the peak, against 66.9) beside the cast copies: its time and the GPU's own peak.
  U=model.scan_layers=False; M=opt.moments=fp8~model.loss_chunk=1024~model.loss_fused=True
  timeout $((DEADLINE + 100)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=infir2~$U~$M~INFIR2_GRAD_INPUTS=master,infir2~$U~$M \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=14 --steps=10 --variant_timeout_s=$DEADLINE \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -14
elif [[ $STAGE == normedpair ]]; then
  # Session 30: the normed stage without its bf16 row, for a short GPU window: the RMSNorm ->
  # quantize kernel's GPU check and its time alone, then infir2 without and with fused_norm.
  normed_gpu_check
  timeout 100 python3 benchmarks/normed_quantize.py --out "$OUT/normed_quantize.json" 2>&1 \
    | grep -vE "^W0000|^I0000|^$" | tail -3
  # profiled: the ~1 ms the kernel saves is under one pair's wall-time noise, not under the
  # profile's CUPTI sums by kind ("other" loses the norm's output, quantization gains it)
  step_1p5b infir2,infir2~precision.fused_norm=True 30 --profile_dir=/tmp/prof
elif [[ $STAGE == rope ]]; then
  # Session 31: the fixed normed kernel's GPU check, then bf16 and infir2 (issues 33/34's
  # ratio and MFU), infir2 with RoPE's tables made in every layer as before (INFIR2_ROPE=
  # per_layer: the A/B of session 31's change), with its gradients through the barrier
  # (INFIR2_GRAD_BARRIER=always: session 32's A/B) and with fused_norm, as the deadline
  # allows (~110 s a variant).
  normed_gpu_check
  step_1p5b bf16,infir2,infir2~INFIR2_ROPE=per_layer,infir2~INFIR2_GRAD_BARRIER=always,infir2~precision.fused_norm=True 44
elif [[ $STAGE == 7bfast ]]; then
  # Issues 33/35's 7B speed target (the fastest infir2 that fits <= 0.72x the fastest bf16
  # that fits), both without the recomputed forward, unrolled, FP8 moments (the fused step)
  # and the fused loss: bf16 with save_dots (deviceless 112.5 GiB, session 25) beside infir2
  # with save_dots_fp8 (119.5); bf16 with full remat measured 1547.3 ms in session 25. Then,
  # with the time left, the <= 78 GiB candidate's buffers from the autotuned compile.
  U=model.scan_layers=False; M=opt.moments=fp8~model.loss_fused=True~model.loss_chunk=2048
  timeout $((DEADLINE + 250)) python3 benchmarks/train_step.py --config=configs/7b.py \
    --recipes=bf16~$U~$M~model.remat=save_dots,infir2~$U~$M~model.remat=save_dots_fp8 \
    --seq_lens=4096 "${COMMON[@]}" --override=steps=14 --steps=10 --variant_timeout_s=250 \
    --deadline_s="$DEADLINE" --out="$OUT/train_step_7b_4k.json" 2>&1 \
    | grep -vE "onstant.folding|slow_operation|^$" | tail -14
  LEFT=$((575 - SECONDS))
  if (( LEFT > 60 )); then
    timeout $LEFT python3 benchmarks/peak_buffers.py --attached --config=configs/7b.py \
      --seq_len=4096 --batch_size=4 \
      --variants=infir2~$U~opt.moments=fp8~model.loss_fused=True~model.loss_chunk=1024 \
      --out="$OUT/peak_buffers_7b_attached.json" 2>&1 | grep -vE "^W0000|^I0000" | tail -16
  fi
elif [[ $STAGE == startup ]]; then
  # cold: empty compilation cache; warm: a fresh run with the cache; resume: the warm run
  # continued from its step-3 checkpoint (cache warm, the 17 GiB state restored).
  for run in cold warm resume; do
    dir=/tmp/su_$run; steps=3
    if [[ $run == resume ]]; then dir=/tmp/su_warm; steps=5; fi
    timeout 200 python3 -m infir2_jax.train --config=configs/1p5b.py --workdir="$dir" \
      --config.steps=$steps --config.eval.every_steps=0 --config.checkpoint.every_steps=0 \
      --config.data.tokenizer=default \
      --config.log.progress_bar=False > "$OUT/startup_$run.log" 2>&1
    echo "$run rc=$?"; grep -iE "start-up|phase|compile|memory" "$OUT/startup_$run.log" | head -8
  done
fi
