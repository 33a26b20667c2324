#!/bin/bash
# FP8 KV cache end to end on the tiny model: vLLM FP8 + FP8 KV rollout, Megatron FP8 training, TIS, scales
# recalibrated every step, over the object store and over CUDA IPC (docs/fp8-kv-cache.md).
# Recipes: examples/configs/recipes/llm/grpo-tiny-megatron-fp8kv/{kv,kvipc}.yaml.
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-fp8kv
export VLLM_USE_DEEP_GEMM=0; R=examples/configs/recipes/llm/grpo-tiny-megatron-fp8kv
S=$("$PYTHON" tools/recipe.py get $R/kv.yaml grpo.max_num_steps) || exit 2
for run in kv kvipc; do run_grpo $run $R/$run.yaml || exit 1; done
check_runs "count(kv:timing/step) >= $S" "count(kvipc:timing/step) >= $S" 'max(kv:mismatch/gen_kl_error) < 0.1' \
  'max(kvipc:mismatch/gen_kl_error) < 0.1' 'count(kv:val/accuracy) >= 2'
