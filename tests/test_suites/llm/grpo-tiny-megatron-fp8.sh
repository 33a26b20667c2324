#!/bin/bash
# End to end on the tiny model: vLLM FP8 rollout + Megatron FP8 (e4m3 blockwise) training + TIS, and the BF16
# twin (docs/megatron-fp8-training.md). Checks: every step ran, the FP8 mismatch stays small and above BF16's.
# Recipes: examples/configs/recipes/llm/grpo-tiny-megatron-fp8/{fp8,bf16}.yaml.
source "$(dirname "$0")/../common.sh"; suite_init grpo-tiny-megatron-fp8
export VLLM_USE_DEEP_GEMM=0; R=examples/configs/recipes/llm/grpo-tiny-megatron-fp8
S=$("$PYTHON" tools/recipe.py get $R/fp8.yaml grpo.max_num_steps) || exit 2
for run in fp8 bf16; do run_grpo $run $R/$run.yaml || exit 1; done
report_runs --baseline bf16
check_runs "count(fp8:timing/step) >= $S" "count(bf16:timing/step) >= $S" 'max(fp8:mismatch/gen_kl_error) < 5e-3' \
  'max(bf16:mismatch/gen_kl_error) < 1e-3' 'ratio(mean(fp8:mismatch/gen_kl_error), mean(bf16:mismatch/gen_kl_error)) > 1' \
  'mean(fp8:timing/step[1:]) < 15' 'ratio(last(fp8:refit/gbytes), last(bf16:refit/gbytes)) < 1.05'
