#!/bin/bash
# Pipeline parallelism end to end on two GPUs (docs/multi-gpu.md): the megatron backend's PP tests
# (tests/gpu/test_megatron_pipeline.py: PP 2 and PP 2 x 2 virtual stages against PP 1, every weight exported once;
# tensor parallel 2's norms equal on both ranks after a step), then the tiny FP8 GRPO job on a 4-layer random Qwen3
# at data parallel 2, pipeline parallel 2 and pipeline 2 x virtual 2 (recipes
# examples/configs/recipes/llm/grpo-small-megatron-pp/{dp2,pp2,pp2-vpp2}.yaml). Checks: every step of every run; the
# first step's rollout is the same weights in every layout, so its FP8 mismatch and gradient norm agree with
# dp2's.
source "$(dirname "$0")/../common.sh"; suite_init grpo-small-megatron-pp
[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] || { echo "needs two GPUs"; exit 2; }
export VLLM_USE_DEEP_GEMM=0; R=examples/configs/recipes/llm/grpo-small-megatron-pp
S=$("$PYTHON" tools/recipe.py get $R/dp2.yaml grpo.max_num_steps) || exit 2
rc=0
[ "${PYTESTS:-1}" = 1 ] && { run_gpu_pytest tests/gpu/test_megatron_pipeline.py || rc=1; }
[ -f models/qwen3-small-random/config.json ] || "$PYTHON" tools/write_random_checkpoint.py \
  --out models/qwen3-small-random --set num_hidden_layers=4 --set hidden_size=1024 --set intermediate_size=3072 \
  --set num_attention_heads=8 --set num_key_value_heads=4 2>&1 | tail -2
for run in ${RUNS:-dp2 pp2 pp2-vpp2}; do run_grpo "$run" "$R/$run.yaml" || rc=1; done
report_runs --baseline dp2
checks=()
for run in pp2 pp2-vpp2; do
  [ -f "$OUT/$run/metrics.jsonl" ] || continue
  checks+=("count(${run//-/_}:timing/step) >= $S"
           "abs(ratio(first(${run//-/_}:loss/grad_norm), first(dp2:loss/grad_norm)) - 1) < 0.05"
           "abs(ratio(first(${run//-/_}:mismatch/gen_kl_error), first(dp2:mismatch/gen_kl_error)) - 1) < 0.25")
done
check_runs "count(dp2:timing/step) >= $S" "${checks[@]}" || rc=1
exit $rc
