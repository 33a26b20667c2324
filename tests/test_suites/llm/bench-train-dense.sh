#!/bin/bash
# FP8 training step against BF16 on a Qwen3-8B-shaped slice (8 layers, 2 x 4096 tokens, random weights), each
# recipe in its own process, forward + backward timed in interleaved rounds (docs/performance.md). BT_ARGS: other
# bench_train.py arguments (e.g. --shapes moe). Checks: FP8 tensorwise and blockwise full steps faster than BF16, ours
# within 8% of megatron-core's own forward + backward.
source "$(dirname "$0")/../common.sh"; suite_init bench-train-dense
timeout "$SUITE_TIMEOUT" "$PYTHON" tools/bench_train.py ${BT_ARGS:---shapes dense --recipes bf16,e4m3-tensorwise,e4m3-blockwise --timeout 150} \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -30
"$PYTHON" tools/check_metrics.py "$OUT/bench.json" --by recipe --out "$OUT/checks.md" \
  "ratio(bf16/step_ms[0], e4m3-tensorwise/step_ms[0]) > ${MIN_TENSORWISE:-1.15}" \
  "ratio(bf16/step_ms[0], e4m3-blockwise/step_ms[0]) > ${MIN_BLOCKWISE:-1.08}" \
  "ratio(e4m3-blockwise/fused_ms[0], e4m3-blockwise/raw_ms[0]) < 1.08"
