#!/bin/bash
# FP8 rollout + FP16 training with dynamic loss scaling on the tiny model (docs/megatron-fp8-training.md):
# every step runs (an overflow skips an update instead of stopping the run).
# Recipe: examples/configs/recipes/llm/grpo-tiny-megatron-fp16/fp16.yaml.
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-fp16
export VLLM_USE_DEEP_GEMM=0; R=examples/configs/recipes/llm/grpo-tiny-megatron-fp16
S=$("$PYTHON" tools/recipe.py get $R/fp16.yaml grpo.max_num_steps) || exit 2
run_grpo fp16 $R/fp16.yaml || exit 1
check fp16 "count(timing/step) >= $S" 'max(mismatch/gen_kl_error) < 5e-3'
