#!/bin/bash
# FP8 rollout + FP16 training with dynamic loss scaling on the tiny model (docs/megatron-fp8-training.md):
# every step runs (an overflow skips an update instead of stopping the run).
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-fp16
export VLLM_USE_DEEP_GEMM=0; S=${STEPS:-5}
run_grpo fp16 examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S policy.megatron_cfg.fp8_cfg.enabled=false \
  policy.megatron_cfg.optimizer.bf16=false policy.megatron_cfg.optimizer.fp16=true || exit 1
check fp16 "count(timing/step) >= $S" 'max(mismatch/gen_kl_error) < 5e-3'
