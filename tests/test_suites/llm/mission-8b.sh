#!/bin/bash
# The mission command at 8B (Qwen3-8B shape, random bf16 weights, GSM8K prompts), FP8 then BF16, then the side-by-side
# report (tools/mission_report.py: per-step phases, rollout tokens/s, peak GPU memory) (docs/performance.md). Checks:
# every step of each run ran (no step-time target: the 4-GPU mission suite checks those).
# Recipes: examples/configs/recipes/llm/mission-8b/{configs-layout,one-gpu}.yaml (BF16; the FP8 run adds
# examples/configs/recipes/llm/arms/fp8.yaml): 8 x 8 responses of up to 1,024 tokens, 3 steps.
#   MISSION_LAYOUT  configs-layout (default: the configs' 8 GPUs) or one-gpu (tensor parallel 1, half of Adam's state
#                   on the host, bf16 gradient buffer, the refit over CUDA IPC, the engine at 30% of the GPU)
#   MISSION_RUNS  "fp8 bf16" (default); one at a time where a call is time-limited (the report joins them)
#   MISSION_ARGS  overrides for a one-off experiment; MISSION_TOKENIZER: a tokenizer folder for the random checkpoint;
#   NEMO_FP8_SHARED_DATA: the folder holding gsm8k/ (default: the recipe's ../shared/data)
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1500}  # this suite's default; common.sh's is 560 s
source "$(dirname "$0")/../common.sh"; suite_init mission-8b
[ -f models/qwen3-8b-random/config.json ] || "$PYTHON" tools/write_random_checkpoint.py --out models/qwen3-8b-random \
  ${MISSION_TOKENIZER:+--tokenizer-from $MISSION_TOKENIZER} 2>&1 | tail -2
recipe=examples/configs/recipes/llm/mission-8b/${MISSION_LAYOUT:-configs-layout}.yaml
S=$("$PYTHON" tools/recipe.py get "$recipe" grpo.max_num_steps) || exit 2
data=()
[ -z "${NEMO_FP8_SHARED_DATA:-}" ] || data=(data.train_path="$NEMO_FP8_SHARED_DATA/gsm8k/train.jsonl"
                                             data.val_path="$NEMO_FP8_SHARED_DATA/gsm8k/test.jsonl")
for v in ${MISSION_RUNS:-fp8 bf16}; do
  arm=(); [ "$v" = fp8 ] && mapfile -t arm < <("$PYTHON" tools/recipe.py overrides examples/configs/recipes/llm/arms/fp8.yaml)
  mkdir -p "$OUT/$v"
  nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500 > "$OUT/gpu_mem_$v.csv" 2>/dev/null & SMI=$!
  # the host memory used (MiB) every 5 s: the optimizer CPU offload and the colocated offload live there
  while true; do echo "$(date +%T) $(free -m | awk "/^Mem:/{print \$3}")"; sleep 5; done > "$OUT/host_mem_$v.log" & HOSTMEM=$!
  # shellcheck disable=SC2086
  run_grpo "$v" "$recipe" "${arm[@]}" "${data[@]}" ${MISSION_ARGS:-}
  kill $SMI $HOSTMEM 2>/dev/null
  echo "mission $v: host memory used at most $(sort -k2 -n "$OUT/host_mem_$v.log" | tail -1 | cut -d" " -f2) MiB"
done
report_runs   # every run so far, an earlier call's too (MISSION_RUNS=bf16 after fp8)
check_runs $(for v in ${MISSION_RUNS:-fp8 bf16}; do echo "count($v:timing/step)>=$S"; done)
