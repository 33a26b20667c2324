#!/bin/bash
# The refit alone on one GPU (issue 70): tools/bench_refit.py on the one-GPU 8B configs
# (examples/configs/grpo_math_8B_megatron{,_fp8}_1gpu.yaml, the Qwen3-8B shape with random bf16 weights), BF16 then
# FP8, REFITS refits each with no training between: the run's own workers, refit, engine wake and sleep. Each refit is
# a row of $OUT/<run>/metrics.jsonl (timing/refit_total: refit + wake + sleep; its parts, the transfer's among them;
# refit/gbytes; memory/device_used_gib after the sleep); each run's log ends with the means over the refits after the
# first and the transfer's ratio to its HBM floor. Checks, each run: refit + wake + sleep <= 0.5 s a refit after the
# first (the warm-up), the GPU's memory after the last refit within 1 GiB of after the first.
# No training runs between refits, so the release of a training pass's activation peak is not in these numbers (the
# mission suite's are: mission-8b-1gpu.sh's report has the refit's parts of a real step). The FP8 engines run
# CUTLASS's block-scaled GEMMs (use_deep_gemm=false): DeepGEMM's warm-up on a fresh host takes longer than a run,
# and the kernel format needs CUTLASS.
# Runs: bf16, fp8 (vLLM's checkpoint format: its layerwise reload), bf16-kernel, fp8-kernel (the engine's kernel
# format, vllm_cfg.refit_format=kernel: copied into its parameters), bf16-inplace, fp8-inplace (the kernel format
# with its packed buckets filled in place, policy.weight_sync.pack_in_place=true: not yet run).
# On one H200 a run of 20 refits took 2-3 minutes, start-up included; refit + wake + sleep FP8 / BF16: kernel format
# 0.29 / 0.24 s, checkpoint format 0.52 / 0.40 s (docs/results/2026-12-04-refit-four-formats-1xh200).
# Knobs: RUNS (default "bf16 fp8"), REFITS (default 20), SUITE_TIMEOUT seconds per run (default 420), BENCH_ARGS
# (key=value overrides for every run), MISSION_TOKENIZER and NEMO_FP8_SHARED_DATA as in tests/test_suites/mission.sh.
SUITE_TIMEOUT=${SUITE_TIMEOUT:-420}  # this suite's default; common.sh's is 560 s
source "$(dirname "$0")/../common.sh"
REFITS=${REFITS:-20}
for v in ${RUNS:-bf16 fp8}; do
  case $v in
    bf16|fp8|bf16-kernel|fp8-kernel|bf16-inplace|fp8-inplace) ;;
    *) echo "unknown run $v (bf16, fp8, bf16-kernel, fp8-kernel, bf16-inplace, fp8-inplace)"; exit 2 ;;
  esac
done
if ! [[ $REFITS =~ ^[0-9]+$ ]] || [ "$REFITS" -lt 2 ]; then
  echo "REFITS=$REFITS: need 2 or more (the first is warm-up)"; exit 2
fi
suite_init refit-8b-1gpu
# GSM8K prompts from ../shared/data (or $NEMO_FP8_SHARED_DATA): the configs' DAPO files are the user's own
shared=${NEMO_FP8_SHARED_DATA:-../shared/data}
data=(data.dataset=gsm8k data.train_path="$shared/gsm8k/train.jsonl" data.val_path="$shared/gsm8k/test.jsonl")
# the mission suites' random checkpoint (tests/test_suites/mission.sh's mission_checkpoint), written once
[ -f models/qwen3-8b-random/config.json ] || "$PYTHON" tools/write_random_checkpoint.py --out models/qwen3-8b-random \
  ${MISSION_TOKENIZER:+--tokenizer-from $MISSION_TOKENIZER} 2>&1 | tail -2
checks=()
for v in ${RUNS:-bf16 fp8}; do
  config=examples/configs/grpo_math_8B_megatron_1gpu.yaml args=()
  [ "${v%%-*}" = fp8 ] && config=examples/configs/grpo_math_8B_megatron_fp8_1gpu.yaml \
    args=(policy.generation.vllm_cfg.use_deep_gemm=false)
  [ "$v" != "${v%-kernel}" ] || [ "$v" != "${v%-inplace}" ] && args+=(policy.generation.vllm_cfg.refit_format=kernel)
  [ "$v" != "${v%-inplace}" ] && args+=(policy.weight_sync.pack_in_place=true)
  mkdir -p "$OUT/$v"
  # shellcheck disable=SC2086
  timeout "$SUITE_TIMEOUT" "$PYTHON" tools/bench_refit.py --config "$config" --refits "$REFITS" --out "$OUT/$v" \
    policy.model_name=models/qwen3-8b-random "${data[@]}" "${args[@]}" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/$v/run.log" | tail -25
  echo "run $v: rc=${PIPESTATUS[0]}"
  checks+=("mean($v:timing/refit_total[1:]) <= 0.5"
           "last($v:memory/device_used_gib) - first($v:memory/device_used_gib) <= 1.0")
done
check_runs --missing-fails "${checks[@]}"
