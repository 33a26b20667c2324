#!/bin/bash
# BF16-only GRPO runs of the parity config side by side on one GPU, to pick the learning rate / batch at which the
# BF16 baseline learns before a parity run (docs/learning-parity.md). Builds the small model if missing.
#   SWEEP="name key=value ...;name key=value ..."  one run per ';' item, all at once, each item's overrides on top
#   of the recipe examples/configs/recipes/llm/bf16-lr-sweep/variants-base.yaml (the parity config, checkpoints off)
# Prints each run's train reward by 10 steps and its validation accuracy per data source.
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1500}  # this suite's default; common.sh's is 560 s
source "$(dirname "$0")/../common.sh"; suite_init bf16-lr-sweep
[ -f models/small-qwen3/small_model_spec.json ] || "$PYTHON" tools/make_small_model.py --out models/small-qwen3 \
  ${SMALL_ARGS:---max-steps 2000 --max-minutes 10} > "$OUT/small.log" 2>&1 || { tail -20 "$OUT/small.log"; exit 1; }
n=$(echo "${SWEEP:?SWEEP=\"name key=value ...;...\"}" | tr ";" "\n" | grep -c .)
echo "$SWEEP" | tr ";" "\n" | grep . | while read -r name over; do
  # --parallel $n: compare_precision sizes each engine (fixed KV cache) for $n runs sharing the GPU
  timeout "$SUITE_TIMEOUT" "$PYTHON" tools/compare_precision.py --backend gpu --variants bf16 --parallel "$n" \
    --config examples/configs/recipes/llm/bf16-lr-sweep/variants-base.yaml --out-dir "$OUT/$name" $over > "$OUT/$name.log" 2>&1 &
  sleep 15  # spread the engines start-up
done
wait
rc=0
for d in "$OUT"/*/bf16; do
  name=$(basename "$(dirname "$d")")
  "$PYTHON" tools/check_metrics.py "$d" "count(timing/step) >= 10" "mean(train/reward_mean[0:10]) >= 0" \
    "mean(train/reward_mean[-10:]) >= 0" "last(val/accuracy) >= 0" | sed "s/^/$name: /" || rc=1
done
exit $rc
