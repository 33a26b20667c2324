#!/bin/bash
# Where a decode step's GPU time goes, BF16 against FP8 (GEMM, attention, activation quantization, ...), one
# in-process engine per precision (docs/performance.md). PROF_ARGS: profile_rollout.py arguments.
source "$(dirname "$0")/../common.sh"; suite_init profile-rollout
VLLM_USE_DEEP_GEMM=${VLLM_USE_DEEP_GEMM:-0} timeout "$SUITE_TIMEOUT" "$PYTHON" tools/profile_rollout.py \
  ${PROF_ARGS:---precisions bf16,fp8-cutlass --batch 64 --output-len 256} --timeout $((SUITE_TIMEOUT - 20)) \
  --out "$OUT/prof.json" 2>&1 | tee "$OUT/prof.log" | tail -30
exit "${PIPESTATUS[0]}"
