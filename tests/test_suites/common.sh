# Shared part of every GPU suite (NeMo-RL's tests/test_suites idea): source it from a suite script, then
#   suite_init <name>                 stage the GPU stack, set the environment, make $OUT (logs/suites/<name>)
#   run_grpo <run> <config> [key=value...]  examples/run_grpo_math.py into $OUT/<run> (metrics.jsonl, run.log)
#   run_gpu_pytest <path-or-node...>  the GPU tests (pytest -m gpu), log in $OUT/pytest.log
#   check <run> <check...>            tools/check_metrics.py on $OUT/<run>: a PASS/FAIL table, nonzero on a FAIL
#   check_runs <check...>             the same across every run of the suite, each named by its folder (fp8:key)
#   report_runs [--baseline NAME]     the results table of every run (tools/mission_report.py): $OUT/report.md
#   sample_host_memory                the host's used memory every 5 s as JSON lines (host/used_gib), until killed:
#                                     `sample_host_memory > "$OUT/host_mem_<run>.jsonl" &`; report_runs reads it
# Environment: PYTHON (the interpreter with the GPU stack, default python3), SUITE_TIMEOUT (seconds for the suite's main command, default 560), OUT (default
# logs/suites/<name>). A run's config is a recipe, examples/configs/recipes/llm/<suite>/*.yaml (tools/recipe.py get
# reads its values, e.g. the step count a check counts). The GPU stack: where /tmp/gpu-site/env.sh
# is missing and .stage/install.sh is there (../shared/gpu-host/stage.sh wrote it), it is installed first;
# elsewhere (the container, a host of your own) vLLM / TransformerEngine / megatron-core must be importable.
set -uo pipefail
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2

suite_init() {
  SUITE=$1
  if [ ! -f /tmp/gpu-site/env.sh ] && [ -f .stage/install.sh ] && command -v nvidia-smi > /dev/null; then
    bash .stage/install.sh > /tmp/install.log 2>&1 || { tail -30 /tmp/install.log; exit 3; }
  fi
  # shellcheck disable=SC1091
  [ -f /tmp/gpu-site/env.sh ] && source /tmp/gpu-site/env.sh
  # PYTHONPATH: the staged host has the stack but not this checkout installed (pip install -e . elsewhere)
  export PYTHONUNBUFFERED=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 PYTHONPATH=$REPO:${PYTHONPATH:-}
  # DeepGEMM compiles its kernels on first use (minutes): keep them in the checkout for the next suite
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$REPO/.dgcache}
  OUT=${OUT:-logs/suites/$SUITE}; mkdir -p "$OUT"
  SUITE_TIMEOUT=${SUITE_TIMEOUT:-560}
  echo "=== suite $SUITE -> $OUT ($(date -u +%FT%TZ))"
  # the cards of the run, for its tables; clocks and power limit because hosts of one kind differ in FP8 gain
  if nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version,clocks.max.sm,power.limit \
      --format=csv > "$OUT/gpus.csv" 2>/dev/null; then cat "$OUT/gpus.csv"
  else rm -f "$OUT/gpus.csv"; echo "no nvidia-smi: no GPU here"; fi
}

run_grpo() {
  local run=$1 config=$2; shift 2
  mkdir -p "$OUT/$run"
  timeout "$SUITE_TIMEOUT" "$PYTHON" examples/run_grpo_math.py --overwrite --config "$config" \
    logger.log_dir="$OUT/$run" checkpointing.enabled=false "$@" 2>&1 | tee "$OUT/$run/run.log" | tail -25
  local rc=${PIPESTATUS[0]}; echo "run $run: rc=$rc"; return "$rc"
}

run_gpu_pytest() {
  VLLM_USE_DEEP_GEMM=${VLLM_USE_DEEP_GEMM:-0} timeout "$SUITE_TIMEOUT" "$PYTHON" -m pytest -q -s -m gpu "$@" \
    -p no:cacheprovider 2>&1 | tee -a "$OUT/pytest.log" | grep -v "^(EngineCore\|^INFO\|^WARNING" | tail -40
  return "${PIPESTATUS[0]}"
}

check() {
  local run=$1; shift
  "$PYTHON" tools/check_metrics.py "$OUT/$run" "$@" --out "$OUT/$run/checks.md"
}

check_runs() {
  local runs=() d
  # a folder fp8+tis is the run fp8_tis (a run name is letters, digits, _ and -)
  for d in "$OUT"/*/; do n=$(basename "$d"); [ -f "$d/metrics.jsonl" ] && runs+=(--run "${n//+/_}=$d"); done
  "$PYTHON" tools/check_metrics.py "${runs[@]}" "$@" --out "$OUT/checks.md"
}

report_runs() {
  # every run of the suite side by side (per-step phases, rollout tokens/s, peak GPU memory from $OUT/gpu_mem_<run>.csv
  # and peak host memory from $OUT/host_mem_<run>.jsonl where the suite recorded them, ratios to the baseline run,
  # bf16 by default)
  local specs=() d n spec
  for d in "$OUT"/*/; do
    n=$(basename "$d"); [ -f "$d/metrics.jsonl" ] || continue
    spec="$n=$d"
    [ -s "$OUT/gpu_mem_$n.csv" ] && spec+=",$OUT/gpu_mem_$n.csv"
    [ -s "$OUT/host_mem_$n.jsonl" ] && spec+=",$OUT/host_mem_$n.jsonl"
    specs+=("$spec")
  done
  [ ${#specs[@]} -gt 0 ] || { echo "report_runs: no run with metrics.jsonl under $OUT"; return 1; }
  "$PYTHON" tools/mission_report.py "${specs[@]}" "$@" --out "$OUT/report.md"
}

sample_host_memory() {
  # free -m's "used" (MiB, buffers and page cache left out) every 5 s, one metrics row a sample: a file of these rows
  # is a run for tools/check_metrics.py (--run NAME=FILE, checks on host/used_gib) and for report_runs
  local i=0
  while true; do
    i=$((i + 1))
    free -m | awk -v i="$i" '/^Mem:/ { printf "{\"step\": %d, \"host/used_gib\": %.3f}\n", i, $3 / 1024 }'
    sleep 5
  done
}
