#!/bin/bash
# The vLLM FP8 engine colocated with the torch policy on one GPU, the default tiny job (docs/vllm-fp8-rollout.md).
# Recipe: examples/configs/recipes/llm/grpo-tiny-vllm-torch-policy/fp8.yaml.
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-vllm-torch-policy
export VLLM_USE_DEEP_GEMM=0; R=examples/configs/recipes/llm/grpo-tiny-vllm-torch-policy
S=$("$PYTHON" tools/recipe.py get $R/fp8.yaml grpo.max_num_steps) || exit 2
run_grpo fp8 $R/fp8.yaml || exit 1
check fp8 "count(timing/step) >= $S" 'max(mismatch/gen_kl_error) < 5e-3' 'mean(timing/step[1:]) < 10'
