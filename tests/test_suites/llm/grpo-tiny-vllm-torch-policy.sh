#!/bin/bash
# The vLLM FP8 engine colocated with the torch policy on one GPU, the default tiny job (docs/vllm-fp8-rollout.md).
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-vllm-torch-policy
S=${STEPS:-6}
export VLLM_USE_DEEP_GEMM=0
run_grpo fp8 examples/configs/grpo_math_tiny_fp8.yaml policy.device=cuda policy.generation.backend=vllm \
  policy.generation.vllm_cfg.gpu_memory_utilization=0.3 grpo.max_num_steps=$S grpo.val_period=3 || exit 1
check fp8 "count(timing/step) >= $S" 'max(mismatch/gen_kl_error) < 5e-3' 'mean(timing/step[1:]) < 10'
