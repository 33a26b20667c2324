#!/bin/bash
# The refit over CUDA IPC (policy.weight_sync.method=cuda_ipc) against the object store, FP8 and BF16, on the tiny
# model (docs/vllm-fp8-rollout.md): the FP8 refit's bytes halve (e4m3 + scale_inv), the learning metrics agree.
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-cuda-ipc
export VLLM_USE_DEEP_GEMM=0; S=${STEPS:-4}
run_grpo fp8 examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S || exit 1
run_grpo fp8ipc examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S policy.weight_sync.method=cuda_ipc || exit 1
run_grpo bf16ipc examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S policy.megatron_cfg.fp8_cfg.enabled=false \
  policy.generation.vllm_cfg.precision=bfloat16 policy.weight_sync.method=cuda_ipc || exit 1
report_runs --baseline fp8
check_runs "count(fp8ipc:timing/step) >= $S" "count(bf16ipc:timing/step) >= $S" \
  'ratio(last(fp8ipc:refit/gbytes), last(fp8:refit/gbytes)) < 0.6' \
  'abs(ratio(mean(fp8ipc:mismatch/gen_kl_error), mean(fp8:mismatch/gen_kl_error)) - 1) < 0.2'
