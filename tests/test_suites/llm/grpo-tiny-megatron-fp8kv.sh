#!/bin/bash
# FP8 KV cache end to end on the tiny model: vLLM FP8 + FP8 KV rollout, Megatron FP8 training, TIS, scales
# recalibrated every step, over the object store and over CUDA IPC (docs/fp8-kv-cache.md).
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-fp8kv
export VLLM_USE_DEEP_GEMM=0; S=${STEPS:-6}
run_grpo kv examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S grpo.val_period=3 policy.generation.vllm_cfg.kv_cache_dtype=fp8 || exit 1
run_grpo kvipc examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S grpo.val_period=3 policy.generation.vllm_cfg.kv_cache_dtype=fp8 \
  policy.weight_sync.method=cuda_ipc || exit 1
check_runs "count(kv:timing/step) >= $S" "count(kvipc:timing/step) >= $S" 'max(kv:mismatch/gen_kl_error) < 0.1' \
  'max(kvipc:mismatch/gen_kl_error) < 0.1' 'count(kv:val/accuracy) >= 2'
