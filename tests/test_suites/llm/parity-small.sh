#!/bin/bash
# Learning parity on the ~200M small model (docs/learning-parity.md): build it (SFT, a step budget), then GRPO
# variants side by side on one GPU (tools/compare_precision.py --backend gpu), then the report (parity.md, parity.png)
# and, with checkpoints kept, what each FP8 engine saw of the update (UPDVIS=1).
#   SMALL_ARGS  make_small_model.py arguments (default --max-steps 2000 --max-minutes 10); skipped when the model exists
#   PARITY_ARGS compare_precision.py arguments (default: four variants at once); every variant starts from the recipe
#               examples/configs/recipes/llm/parity-small/variants-base.yaml (100 steps, checkpoints off)
# Several hosts: OUT=logs/suites/parity-small-b on the second, then
#   python tools/compare_precision.py --backend gpu --report-only --out-dir logs/suites/parity-small \
#       --also logs/suites/parity-small-b
# Checks: every variant ran its steps, FP8 + TIS's late train reward within MAX_GAP of BF16's.
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1700}  # this suite's default; common.sh's is 560 s
source "$(dirname "$0")/../common.sh"; suite_init parity-small
R=examples/configs/recipes/llm/parity-small
S=$("$PYTHON" tools/recipe.py get $R/variants-base.yaml grpo.max_num_steps) || exit 2
[ -f models/small-qwen3/small_model_spec.json ] || "$PYTHON" tools/make_small_model.py --out models/small-qwen3 \
  ${SMALL_ARGS:---max-steps 2000 --max-minutes 10} > "$OUT/small.log" 2>&1 || { tail -20 "$OUT/small.log"; exit 1; }
cp models/small-qwen3/small_model_spec.json "$OUT/"
# UPDVIS keeps the runs' checkpoints (the recipe turns them off)
timeout "$SUITE_TIMEOUT" "$PYTHON" tools/compare_precision.py --backend gpu --config $R/variants-base.yaml \
  --out-dir "$OUT" ${PARITY_ARGS:---variants bf16,bf16-seed2,fp8,fp8+tis --parallel 4 --stagger-s 10} \
  ${UPDVIS:+checkpointing.enabled=true} > "$OUT/parity.log" 2>&1; tail -40 "$OUT/parity.log"
if [ -n "${UPDVIS:-}" ]; then  # compare_precision puts the checkpoints of logs/X runs in results/X
  for d in results/${OUT#logs/}/*/; do
    last=$(ls -d "$d"step_* 2>/dev/null | sort -t_ -k2 -n | tail -1); [ -n "$last" ] || continue
    echo "== $(basename "$d"): models/small-qwen3 -> $last"
    "$PYTHON" tools/fp8_update_visibility.py --before models/small-qwen3 --after "$last" | tail -n +2
  done 2>&1 | tee "$OUT/updvis.log"
fi
check_runs "count(bf16:timing/step) >= $S" "count(fp8_tis:timing/step) >= $S" \
  "abs(mean(fp8_tis:train/reward_mean[-40:]) - mean(bf16:train/reward_mean[-40:])) < ${MAX_GAP:-0.02}" \
  "max(fp8_tis:mismatch/gen_kl_error) < 5e-3"
