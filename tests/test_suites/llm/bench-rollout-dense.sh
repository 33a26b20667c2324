#!/bin/bash
# FP8 rollout throughput against BF16 on the Qwen3-8B shape (dummy weights), 512 prompts x (256 in, 2048 out)
# and an RL-like 32 x 32, DeepGEMM linears with and without the FP8 KV cache (docs/performance.md). DeepGEMM's kernels
# are compiled first by a 1-layer engine (minutes on a fresh cache, kept in $DG_JIT_CACHE_DIR). BENCH_ARGS: other
# bench_rollout.py arguments. Checks: FP8 linear and FP8 KV faster than BF16 on the fixed workload.
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1500}  # this suite's default (DeepGEMM warm-up + 3 engines); common.sh's is 560 s
source "$(dirname "$0")/../common.sh"; suite_init bench-rollout-dense
"$PYTHON" tools/bench_rollout.py --models dense --num-layers dense=1 --precisions fp8-deepgemm --gpu-mem 0.1 \
  --num-prompts 8 --output-len 16 --rl-prompts 2 --rl-samples 2 --timeout 900 > "$OUT/dgwarm.log" 2>&1
timeout "$SUITE_TIMEOUT" "$PYTHON" tools/bench_rollout.py ${BENCH_ARGS:---models dense --precisions bf16,fp8-deepgemm,fp8-deepgemm-kv \
  --num-prompts 512 --output-len 2048 --rl-prompts 32 --rl-samples 32} --timeout 900 --out "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -30
"$PYTHON" tools/check_metrics.py "$OUT/bench.json" --by precision --out "$OUT/checks.md" \
  "ratio(fp8-deepgemm/fixed_tok_s[0], bf16/fixed_tok_s[0]) > ${MIN_FP8:-1.05}" \
  "ratio(fp8-deepgemm-kv/fixed_tok_s[0], bf16/fixed_tok_s[0]) > ${MIN_FP8_KV:-1.3}" \
  "ratio(fp8-deepgemm-kv/kv_tokens[0], bf16/kv_tokens[0]) > 2"
