#!/bin/bash
# The refit over CUDA IPC (policy.weight_sync.method=cuda_ipc) against the object store, FP8 and BF16, on the tiny
# model (docs/vllm-fp8-rollout.md): the FP8 refit's bytes halve (e4m3 + scale_inv), the learning metrics agree.
# Recipes: examples/configs/recipes/llm/grpo-tiny-megatron-cuda-ipc/{fp8,fp8ipc,bf16ipc}.yaml.
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-cuda-ipc
export VLLM_USE_DEEP_GEMM=0; R=examples/configs/recipes/llm/grpo-tiny-megatron-cuda-ipc
S=$("$PYTHON" tools/recipe.py get $R/fp8.yaml grpo.max_num_steps) || exit 2
for run in fp8 fp8ipc bf16ipc; do run_grpo $run $R/$run.yaml || exit 1; done
report_runs --baseline fp8
check_runs "count(fp8ipc:timing/step) >= $S" "count(bf16ipc:timing/step) >= $S" \
  'ratio(last(fp8ipc:refit/gbytes), last(fp8:refit/gbytes)) < 0.6' \
  'abs(ratio(mean(fp8ipc:mismatch/gen_kl_error), mean(fp8:mismatch/gen_kl_error)) - 1) < 0.2'
