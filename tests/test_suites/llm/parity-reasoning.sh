#!/bin/bash
# Learning parity with room to learn (issue 51, docs/learning-parity.md "The reasoning task"): build the reasoning
# start point (tools/make_small_model.py --task chains: the ~200M small model SFT-ed on arithmetic chains, responses
# of 100-400 tokens), check it solves a minority of its held-out chains, then run the six arms x 3 seeds side by side,
# one GPU per run (tools/compare_precision.py --devices), and check issue 51's targets on the report (parity.json).
# The sixth arm, fp8kv (FP8 KV cache, no correction), is the issue's follow-up: FP8 without correction ran level with
# BF16 (three seeds), so the issue asks for it at the FP8 KV cache's larger mismatch.
#   MODEL          the start point's folder (default models/reasoning-qwen3; built when missing)
#   BUILD_ARGS     make_small_model.py arguments (default: a deterministic 1,300-step build, the same bits on every
#                  host of the same GPU type and software; on one H200 1,300 steps take ~590 s, 2,000 do not fit 10 min)
#   START_MIN/MAX  the start's held-out greedy accuracy must lie in [START_MIN, START_MAX] (default 0.15-0.35)
#   DEVICES        GPU indices (default 0,1,2,3)
#   PARALLEL       runs at once on each GPU (default 4: 16 runs at once, each on 4 of a 64-CPU host's CPUs, the
#                  last 2 of the 18 as slots free; on H200s ~13 s a step for bf16, ~16 for fp8, ~20 for fp8kv+tis:
#                  ~16 min for a wave's 40 steps)
#   VARIANTS       compare_precision.py variants (default all 18 runs, the checked arms' seeds first)
#   PARITY_ARGS    more compare_precision.py arguments / key=value overrides (e.g. grpo.max_num_steps=100)
# One 30-minute lease holds the build (~750 s on an H200) or the 18 runs, not both. Either give the
# built folder as MODEL (kept, or sent in parts: 401 MiB; weights_sha256 in its small_model_spec.json names the
# bits) so that the lease holds only runs, or split the arms over leases with VARIANTS (each lease rebuilds the same
# bits: a4a3a6eb... on three H200 hosts) and join the reports. One H200 (16 CPUs) holds the build and three runs to
# step 40 (DEVICES=0 PARALLEL=3: 748-920 s, the last ending 1,500-1,704 s into the lease); one seed of three arms a
# lease keeps each FP8 run beside the BF16 run of its seed. With MODEL sent in, one H200 holds four runs to step 40
# (DEVICES=0 PARALLEL=4: 840-910 s, ending 985-1,060 s into the lease). The FP8 KV arms are ~25% slower a step with
# 15 runs on a host, not with four on one H200 (14.0 s, as fp8-e2e+tis); runs cut before step 40 are compared with
# bf16 at their last validation. Several hosts or leases:
# OUT=logs/suites/parity-reasoning-b VARIANTS=... on the second, then
#   python tools/compare_precision.py --backend gpu --report-only --out-dir logs/suites/parity-reasoning \
#       --also logs/suites/parity-reasoning-b   (and the checks below on the joint parity.json)
# Checks (issue 51): every arm ran 3 seeds; BF16 gains >= 15 points of validation accuracy and >= 5 standard errors;
# BF16's responses average >= 100 tokens; FP8 + TIS ends within 1.5 points of BF16 (mean of final validations over
# seeds); FP8 + TIS's gen_kl_error <= 1e-3. FP8 end to end + TIS and FP8 KV cache + TIS (established at three seeds:
# +1.2 and +1.9 points) each end no more than 1.5 points behind BF16 (one-sided: ahead is not a parity failure), with
# gen_kl_error <= 1e-3. The no-correction arms (fp8, fp8kv) are measured (parity.md), not judged: at three seeds each
# ran level with its TIS arm, so this task does not show the correction mattering.
# Each arm's config, as compare_precision.py's variant keys make it from the base recipe (a CPU test keeps them equal):
# examples/configs/recipes/llm/parity-reasoning/{bf16,fp8-tis,fp8,fp8kv-tis,fp8kv,fp8-e2e-tis}.yaml
SUITE_TIMEOUT=${SUITE_TIMEOUT:-3600}  # ~30 minutes of runs after a ~12-minute build; common.sh's default is 560 s
source "$(dirname "$0")/../common.sh"; suite_init parity-reasoning
MODEL=${MODEL:-models/reasoning-qwen3}
[ -f "$MODEL/small_model_spec.json" ] || "$PYTHON" tools/make_small_model.py --task chains --out "$MODEL" \
  ${BUILD_ARGS:---max-steps 1300 --max-minutes 12 --deterministic} > "$OUT/build.log" 2>&1 \
  || { tail -20 "$OUT/build.log"; exit 1; }
cp "$MODEL/small_model_spec.json" "$OUT/"
"$PYTHON" - "$MODEL/small_model_spec.json" "${START_MIN:-0.15}" "${START_MAX:-0.35}" <<'PY' || exit 1
import json, sys
ev = json.load(open(sys.argv[1]))["eval"]
lo, hi = float(sys.argv[2]), float(sys.argv[3])
print(f"start point: held-out greedy accuracy {ev['accuracy']:.4f} on {ev['num_samples']} (target {lo}-{hi}), "
      f"{ev.get('response_tokens_mean', float('nan')):.0f} tokens per response; by steps: {ev.get('by_group')}")
sys.exit(0 if lo <= ev["accuracy"] <= hi else 1)
PY
ARMS="bf16 fp8+tis bf16-seed2 fp8+tis-seed2 bf16-seed3 fp8+tis-seed3 fp8 fp8-seed2 fp8-seed3 fp8kv+tis fp8kv+tis-seed2"
ARMS="$ARMS fp8kv+tis-seed3 fp8-e2e+tis fp8-e2e+tis-seed2 fp8-e2e+tis-seed3 fp8kv fp8kv-seed2 fp8kv-seed3"
timeout "$SUITE_TIMEOUT" "$PYTHON" tools/compare_precision.py --backend gpu --out-dir "$OUT" \
  --config examples/configs/recipes/llm/parity-reasoning/bf16.yaml --devices "${DEVICES:-0,1,2,3}" --parallel "${PARALLEL:-4}" --stagger-s 20 \
  --variants "${VARIANTS:-${ARMS// /,}}" policy.model_name="$MODEL" data.train_path="$MODEL/data/rl_train.jsonl" \
  data.val_path="$MODEL/data/val.jsonl" checkpointing.enabled=false ${PARITY_ARGS:-} > "$OUT/parity.log" 2>&1
tail -60 "$OUT/parity.log"
"$PYTHON" tools/check_metrics.py "$OUT/parity.json" --by variant --out "$OUT/checks.md" --missing-fails \
  "last(bf16/seeds) >= 3" "last(fp8_tis/seeds) >= 3" "last(fp8/seeds) >= 3" "last(fp8kv_tis/seeds) >= 3" \
  "last(fp8-e2e_tis/seeds) >= 3" "last(fp8kv/seeds) >= 3" \
  "last(bf16/gain) >= 0.15" "last(bf16/gain_z) >= 5" \
  "last(bf16/response_length_mean) >= 100" \
  "abs(last(fp8_tis/diff_final)) <= 0.015" "last(fp8_tis/gen_kl_error) <= 1e-3" \
  "last(fp8-e2e_tis/diff_final) >= -0.015" "last(fp8-e2e_tis/gen_kl_error) <= 1e-3" \
  "last(fp8kv_tis/diff_final) >= -0.015" "last(fp8kv_tis/gen_kl_error) <= 1e-3"
