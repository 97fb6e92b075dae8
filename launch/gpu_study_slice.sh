#!/bin/bash
# One slice of the GPU study (issue 38, reports/gpu_study/HOW_TO_RUN.md) on a lent GPU machine
# that reaches no registry; its results land in $OUT/gpu_study.tgz.
#   OUT=/tmp/out bash launch/gpu_study_slice.sh BUDGET_S
# Unpack the archive here, copy its runs/ into reports/gpu_study/runs and rebuild the report
# (HOW_TO_RUN.md). Needs .whl/ (carried) and SmolLM2's GGUF: either already assembled in
# /tmp/stage by an earlier call on this machine, or its three parts smollm2.part00..02 in
# /tmp/stage (earlier calls that carried .stage_a and .stage_b) or in a carried .stage_?
# folder (.stage_c, this call). Converts it once to /tmp/smollm2_hf, then
# runs the study for BUDGET_S seconds (its runs checkpoint in /tmp/gpu_study: a second call
# on the same warm machine resumes them).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/study_out}
BUDGET=${1:-400}
STUDY=${STUDY:-configs/study_smollm2.py}       # (configs/study_smollm2.py:tiny to try it on a CPU)
# The results folder lives outside the repository on the machine, so a second call on the
# same warm machine finds the first one's finished runs; it starts from the committed ones.
RESULTS=${RESULTS:-/tmp/gpu_study_report/runs}
if [[ ! -d $RESULTS && -d reports/gpu_study/runs ]]; then
  mkdir -p "$(dirname "$RESULTS")" && cp -r reports/gpu_study/runs "$RESULTS"
fi
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$OUT" /tmp/stage
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > /tmp/pip.log 2>&1 || { tail -5 /tmp/pip.log; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 INFIR2_SMOLLM2_GGUF=/tmp/stage/smollm2.gguf
for d in .stage_?; do [[ -d $d ]] && cp "$d"/* /tmp/stage/; done
if [[ ! -f $INFIR2_SMOLLM2_GGUF ]]; then
  PARTS=(/tmp/stage/smollm2.part00 /tmp/stage/smollm2.part01 /tmp/stage/smollm2.part02)
  for part in "${PARTS[@]}"; do
    if [[ ! -f $part ]]; then
      echo "error: no GGUF: $part is missing (carry .stage_a, .stage_b, .stage_c in three" \
           "calls one right after the other: HOW_TO_RUN.md)"; exit 2
    fi
  done
  cat "${PARTS[@]}" > "$INFIR2_SMOLLM2_GGUF.tmp"
  if [[ $(sha256sum < "$INFIR2_SMOLLM2_GGUF.tmp" | cut -d' ' -f1) != "$GGUF_SHA256" ]]; then
    echo "error: the assembled GGUF's sha256 is not $GGUF_SHA256"; exit 2
  fi
  mv "$INFIR2_SMOLLM2_GGUF.tmp" "$INFIR2_SMOLLM2_GGUF"
fi
if [[ ! -f /tmp/smollm2_hf/config.json ]]; then
  t0=$SECONDS
  python3 -c "import sys; sys.path.insert(0, 'scripts'); import check_smollm2 as c; c.convert('/tmp/smollm2_hf')" \
    > /tmp/convert.log 2>&1 || { tail -20 /tmp/convert.log; exit 3; }
  echo "converted SmolLM2 to /tmp/smollm2_hf in $((SECONDS - t0)) s"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv > "$OUT/env.txt"
python3 -m infir2_jax.ablation.study --study="$STUDY" --budget_s="$BUDGET" \
  --grace_s=30 --results="$RESULTS" --workdir=/tmp/gpu_study 2>&1 \
  | grep -vE "onstant.folding|slow_operation|^$" | tee "$OUT/study.log" | tail -40
# the work directory's logs of runs still in flight, for reading why one is slow or failed
tail -n 30 /tmp/gpu_study/*/train.log > "$OUT/run_logs_tail.txt" 2>/dev/null
tar czf "$OUT/gpu_study.tgz" -C "$(dirname "$RESULTS")" .   # few files come back: one archive
