#!/bin/bash
# End to end on the tiny model: vLLM FP8 rollout + Megatron FP8 (e4m3 blockwise) training + TIS, and the BF16
# twin (docs/megatron-fp8-training.md). Checks: every step ran, the FP8 mismatch stays small and above BF16's.
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-fp8
export VLLM_USE_DEEP_GEMM=0; S=${STEPS:-5}
run_grpo fp8 examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S || exit 1
run_grpo bf16 examples/configs/grpo_math_tiny_megatron_fp8.yaml grpo.max_num_steps=$S policy.megatron_cfg.fp8_cfg.enabled=false \
  policy.generation.vllm_cfg.precision=bfloat16 || exit 1
report_runs --baseline bf16
check_runs "count(fp8:timing/step) >= $S" "count(bf16:timing/step) >= $S" 'max(fp8:mismatch/gen_kl_error) < 5e-3' \
  'max(bf16:mismatch/gen_kl_error) < 1e-3' 'ratio(mean(fp8:mismatch/gen_kl_error), mean(bf16:mismatch/gen_kl_error)) > 1' \
  'mean(fp8:timing/step[1:]) < 15' 'ratio(last(fp8:refit/gbytes), last(bf16:refit/gbytes)) < 1.05'
