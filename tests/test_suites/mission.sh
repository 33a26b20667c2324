# The 8B mission suites' shared body (mission-8b-4gpu.sh, mission-8b-8gpu.sh); source it after common.sh and
# suite_init, then:
#   mission_suite <default layout> [tools/mission_report.py arguments...]
# The runs' configs are recipes: examples/configs/recipes/llm/<suite>/<layout>.yaml (BF16) plus, for each FP8
# run, arm fragments from examples/configs/recipes/llm/arms/ (tools/recipe.py overrides). What is left to the
# environment is the host and what to run:
#   MISSION_LAYOUT  the layout recipe (default: the suite's; auto: tp1 on GPUs of 100 GiB or more, else tp2)
#   MISSION_GPUS    GPUs the runs use (default: the recipe's cluster.gpus_per_node); data parallel = GPUs /
#                   the recipe's tensor x pipeline parallel
#   NEMO_FP8_SHARED_DATA  the folder holding gsm8k/ (default: the recipe's ../shared/data)
#   MISSION_TOKENIZER     a tokenizer folder for the random checkpoint
#   RUNS      which runs, in order (default "bf16 fp8 fp8kv"; also fp8tw, fp8v1, fp8kvv1); one call per run where
#             calls are time-limited: the report and checks join whatever runs $OUT holds
#   CEILING=0 / TRAIN_CEILING=0  skip the rollout / training ceilings; CHECKS=0 print the report only
#   MISSION_ARGS  overrides for a one-off experiment (e.g. policy.profile.dir=...); a measured claim's settings
#             belong in a recipe
MISSION_ARMS=examples/configs/recipes/llm/arms

mission_layout() {  # the layout recipe's name: MISSION_LAYOUT, else $1; auto: by the smallest GPU's memory
  local layout=${MISSION_LAYOUT:-$1} min_mib
  if [ "$layout" = auto ]; then
    min_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1)
    layout=tp2; [ "${min_mib:-0}" -ge 102400 ] && layout=tp1
  fi
  echo "$layout"
}

mission_arms() {  # the arm fragments of run $1 (none: the layout recipe's BF16)
  case $1 in
    bf16) echo "" ;;
    fp8) echo "fp8" ;;
    fp8kv) echo "fp8 fp8-kv-cache" ;;
    fp8tw) echo "fp8 fp8-tensorwise" ;;
    fp8v1) echo "fp8 vllm-v1-runner" ;;
    fp8kvv1) echo "fp8 fp8-kv-cache vllm-v1-runner" ;;
    *) echo "unknown run $1 (bf16, fp8, fp8kv, fp8tw, fp8v1, fp8kvv1)" >&2; return 2 ;;
  esac
}

mission_checkpoint() {  # the recipes' policy.model_name: Qwen3-8B's shape with random bf16 weights, once
  [ -f models/qwen3-8b-random/config.json ] || "$PYTHON" tools/write_random_checkpoint.py \
    --out models/qwen3-8b-random ${MISSION_TOKENIZER:+--tokenizer-from $MISSION_TOKENIZER} 2>&1 | tail -2
}

mission_ceilings() {  # the rollout ceiling (each engine alone) and the training engine's, into $OUT
  local per_engine=$1 max_new=$2 train_tp=$3 mb_tokens=$4 ngpu ntrain neng train_gpus train_after g i
  local bench=(tools/bench_rollout.py --models dense --num-prompts "$per_engine" --input-len 160
               --output-len "$max_new" --rl-prompts 0 --fixed-seeded --gpu-mem 0.6 --timeout 900 --refit)
  CUDA_VISIBLE_DEVICES=0 "$PYTHON" "${bench[@]}" --precisions bf16 --out "$OUT/ceiling_bf16.json" \
    > "$OUT/ceiling_bf16.log" 2>&1 &
  # the FP8 engines over GPUs 1..N-1, round robin, one after another on a GPU (DeepGEMM's cache takes concurrent
  # writers: vLLM's tensor-parallel workers compile into it at once)
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$ngpu" -ge 2 ] || ngpu=2
  local fp8_engines=(fp8-deepgemm-v2 fp8-deepgemm-kv-v2)
  # the training engine on the last train_tp GPUs while the FP8 engines take GPUs 1..; after them if none is left
  ntrain=0; [ "${TRAIN_CEILING:-1}" = 1 ] && ntrain=$train_tp
  neng=$((ngpu - 1 - ntrain)); train_gpus=$(seq -s, $((ngpu - ntrain)) $((ngpu - 1))); train_after=0
  [ "$neng" -ge 1 ] || { neng=$((ngpu - 1)); train_gpus=$(seq -s, 1 "$ntrain"); train_after=1; }
  declare -A on_gpu=()
  for i in "${!fp8_engines[@]}"; do
    g=$((1 + i % neng)); on_gpu[$g]="${on_gpu[$g]:+${on_gpu[$g]},}${fp8_engines[$i]}"
  done
  for g in "${!on_gpu[@]}"; do
    CUDA_VISIBLE_DEVICES=$g "$PYTHON" "${bench[@]}" --precisions "${on_gpu[$g]}" --out "$OUT/ceiling_fp8_gpu$g.json" \
      > "$OUT/ceiling_fp8_gpu$g.log" 2>&1 &
  done
  train_bench() {
    CUDA_VISIBLE_DEVICES=$train_gpus "$PYTHON" tools/bench_train.py --workload rl --shapes dense --rl-packing packed \
      --recipes bf16,e4m3-blockwise,e4m3-tensorwise --tp "$train_tp" --rl-train-mb-tokens "$mb_tokens" \
      --rl-responses 64 --rl-prompt 160 --rl-response-min "$max_new" --rl-response-max "$max_new" \
      --steps 3 --warmup 1 --json "$OUT/train_ceiling.json" > "$OUT/train_ceiling.log" 2>&1
  }
  if [ "$ntrain" -gt 0 ] && [ "$train_after" = 0 ]; then train_bench & fi
  wait
  if [ "$ntrain" -gt 0 ] && [ "$train_after" = 1 ]; then train_bench; fi
  [ "$ntrain" -gt 0 ] && tail -n 6 "$OUT/train_ceiling.log"
  "$PYTHON" -c 'import json, sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=1))' \
    "$OUT"/ceiling_bf16.json "$OUT"/ceiling_fp8_gpu*.json > "$OUT/ceiling.json" && tail -n 4 "$OUT"/ceiling_fp8_gpu*.log
}

mission_suite() {
  local layout recipe v arms G G0 TP PPL MP MB P N MAX_NEW S host=() arm_args=() checks=() ceiling=() target phase
  layout=$(mission_layout "$1"); shift
  recipe=examples/configs/recipes/llm/$SUITE/$layout.yaml
  [ -f "$recipe" ] || { echo "MISSION_LAYOUT=$layout: no recipe $recipe (valid:" \
    "$(ls "examples/configs/recipes/llm/$SUITE" | sed 's/\.yaml$//' | tr '\n' ' ')auto)"; exit 2; }
  read -r G0 TP PPL MB P N MAX_NEW S <<< "$("$PYTHON" tools/recipe.py get "$recipe" cluster.gpus_per_node \
    policy.megatron_cfg.tensor_model_parallel_size policy.megatron_cfg.pipeline_model_parallel_size \
    policy.sequence_packing.train_mb_tokens grpo.num_prompts_per_step \
    grpo.num_generations_per_prompt policy.generation.max_new_tokens grpo.max_num_steps | tr '\n' ' ')"
  [ -n "$S" ] || exit 2
  G=${MISSION_GPUS:-$G0}; MP=$((TP * PPL))  # model parallel: tensor x pipeline
  [ $((G % MP)) = 0 ] && [ $((P * N % G)) = 0 ] || {
    echo "MISSION_GPUS=$G: needs a multiple of the layout's tensor x pipeline parallel $MP that divides $P x $N" \
      "responses"
    exit 2; }
  [ "$G" = "$G0" ] || host+=(cluster.gpus_per_node="$G" policy.data_parallel_size=$((G / MP)))
  [ -z "${NEMO_FP8_SHARED_DATA:-}" ] || host+=(data.train_path="$NEMO_FP8_SHARED_DATA/gsm8k/train.jsonl"
                                               data.val_path="$NEMO_FP8_SHARED_DATA/gsm8k/test.jsonl")
  for v in ${RUNS:-bf16 fp8 fp8kv}; do mission_arms "$v" > /dev/null || exit 2; done  # before any work
  echo "layout: $layout ($recipe${host[*]:+; $G GPUs})"
  # the checkpoint (host work) is written while the rollout ceiling below uses the GPUs
  mission_checkpoint &
  if [ "${CEILING:-1}" = 1 ] && [ ! -s "$OUT/ceiling.json" ]; then
    mission_ceilings $((P * N / G)) "$MAX_NEW" "$TP" "$MB"
  fi
  wait  # the checkpoint
  for v in ${RUNS:-bf16 fp8 fp8kv}; do
    arms=$(mission_arms "$v") || exit 2
    arm_args=()
    # shellcheck disable=SC2086
    [ -z "$arms" ] || mapfile -t arm_args < <("$PYTHON" tools/recipe.py overrides $(printf "$MISSION_ARMS/%s.yaml " $arms))
    mkdir -p "$OUT/$v"
    nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500 > "$OUT/gpu_mem_$v.csv" 2>/dev/null & SMI=$!
    # per process (trainer rank or engine), every 2 s: who holds a GPU's memory while the engines sleep
    nvidia-smi --query-compute-apps=timestamp,gpu_uuid,pid,used_memory --format=csv -lms 2000 \
      > "$OUT/gpu_procs_$v.csv" 2>/dev/null & PROCS=$!
    # shellcheck disable=SC2086
    run_grpo "$v" "$recipe" "${arm_args[@]}" "${host[@]}" ${MISSION_ARGS:-}
    kill $SMI $PROCS 2>/dev/null
  done
  [ -s "$OUT/ceiling.json" ] && ceiling=(--ceiling "$OUT/ceiling.json"
    --targets fp8=0.80,fp8kv=0.72,fp8tw=0.80,fp8v1=0.80,fp8kvv1=0.72)
  [ -s "$OUT/ceiling.json" ] && [ -s "$OUT/train_ceiling.json" ] && ceiling+=(--train-ceiling "$OUT/train_ceiling.json")
  report_runs --baseline bf16 "${ceiling[@]}" "$@"
  [ "${CHECKS:-1}" = 0 ] && exit 0
  # the targets: FP8 step <= 0.80 x BF16 (FP8 + FP8 KV <= 0.72 x), every phase of FP8 <= its BF16 time; step 1
  # (warm-up) left out of every mean
  for v in fp8 fp8kv fp8tw fp8v1 fp8kvv1; do
    [ -f "$OUT/$v/metrics.jsonl" ] || continue
    target=0.80; case $v in fp8kv*) target=0.72 ;; esac
    checks+=("ratio(mean($v:timing/step[1:]), mean(bf16:timing/step[1:])) <= $target")
    [ "$target" = 0.72 ] && continue
    for phase in generation refit logprobs training; do
      checks+=("ratio(mean($v:timing/$phase[1:]), mean(bf16:timing/$phase[1:])) <= 1.0")
    done
  done
  check_runs "count(bf16:timing/step) >= $S" "${checks[@]}"
}
