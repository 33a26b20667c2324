#!/bin/bash
# FP8 rollout throughput against BF16 on the Qwen3-30B-A3B shape (dummy weights, CUTLASS linears, Triton fused
# MoE, routers kept BF16), 256 prompts x (256 in, 1024 out) (docs/performance.md).
source "$(dirname "$0")/../common.sh"; suite_init bench-rollout-moe
timeout "$SUITE_TIMEOUT" "$PYTHON" tools/bench_rollout.py ${BENCH_ARGS:---models moe --precisions bf16,fp8-cutlass,fp8-kv \
  --num-prompts 256 --output-len 1024 --rl-prompts 32 --rl-samples 16} --timeout 900 --out "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -30
"$PYTHON" tools/check_metrics.py "$OUT/bench.json" --by precision --out "$OUT/checks.md" \
  "ratio(fp8-cutlass/fixed_tok_s[0], bf16/fixed_tok_s[0]) > ${MIN_FP8:-1.1}" "ratio(fp8-kv/kv_tokens[0], bf16/kv_tokens[0]) > 2"
