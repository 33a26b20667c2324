#!/bin/bash
# The mission command at 8B on one 4-GPU node, the layout a user runs there (docs/performance.md), by GPU memory
# (MISSION_LAYOUT=auto, the default; or tp1 / tp2):
#   tp1 (GPUs of 100 GiB or more, e.g. H200): Megatron tensor parallel 1 x data parallel 4 (MISSION_GPUS),
#        16,384-token packed micro-batches, CUDA IPC refit (each rank to the engine on its GPU). The 8B FP8
#        trainer's state does not fit an 80 GB GPU at tensor parallel 1 (the preflight refuses it);
#   tp2 (80 GB GPUs): tensor parallel 2 (the configs') x data parallel 2 (MISSION_GPUS / 2; on 8 GPUs the configs'
#        own layout), 4,096-token micro-batches (the configs'), refit over the Ray object store (each bucket put
#        once, read by all the engines).
#   Both: sequence packing on, one vLLM engine of tensor parallel 1 per GPU, colocated with the trainer.
# RL-shaped step: 32 GSM8K prompts x 16 responses of up to 1,024 tokens (random weights run to the limit), one
# optimizer step of 512 sequences. Runs side by side: bf16, fp8 (W8A8 blockwise rollout with DeepGEMM + TE
# blockwise training + TIS), fp8kv (fp8 + FP8 KV cache); also fp8tw (tensorwise training), fp8v1 / fp8kvv1 (fp8 /
# fp8kv on vLLM's V1 model runner, vLLM 0.22's own choice for FP8; the configs pin V2 for every precision); then the
# report and the checks of the targets:
# FP8 step <= 0.80 x BF16, FP8 + FP8 KV <= 0.72 x, every phase of FP8 <= its BF16 time. Step 1 (warm-up) is
# left out of every mean.
#   RUNS     which runs, in order (default "bf16 fp8 fp8kv"); one call per run where calls are time-limited: the
#            report and checks join whatever runs $OUT holds
#   STEPS    GRPO steps per run (default 4); MAX_NEW  response limit (default 1024); MISSION_ARGS more overrides
#            for every run; MISSION_FP8_ARGS for the FP8 runs only (e.g. policy.megatron_cfg.fp8_cfg.fp8_param=true)
#   PROMPTS x SAMPLES  the step's prompts and responses per prompt (default 32 x 16; one optimizer step of all)
#   MISSION_GPUS  the node's GPUs the runs use (default 4; mission-8b-8gpu.sh sets 8): cluster.gpus_per_node, data
#            parallel = MISSION_GPUS / tensor parallel, one engine per GPU, the ceiling at the per-engine batch
#   MISSION_REPORT_ARGS  more tools/mission_report.py arguments (mission-8b-8gpu.sh: the scaling from 4 GPUs)
#   CHECKS=0 print the report only
#   CEILING=1 (default) first measures the rollout ceiling: each engine of tools/bench_rollout.py alone on one GPU
#            (bf16 on GPU 0; the FP8 engines round robin on GPUs 1..N-1, which also fills DeepGEMM's kernel cache),
#            at the runs' per-engine batch (PROMPTS x SAMPLES / MISSION_GPUS responses of MAX_NEW tokens, 128 by
#            default, seeded per request as the rollout is);
#            the report then gives each FP8 run's step at the engine's own gain beside its target. Once per $OUT
#            (ceiling.json); CEILING=0 skips it. CEILING_FP8: the FP8 engines (default
#            fp8-deepgemm-v2,fp8-deepgemm-kv-v2, the runner the configs pin; add fp8-deepgemm for the model-runner
#            A/B: vLLM 0.22 runs FP8 on its V1 runner unless told, docs/performance.md). Each engine also times a
#            full refit from a bf16 state dict on its GPU (bench_rollout --refit, buckets of the configs' 256 MiB):
#            one CUDA IPC handle per tensor, as the runs refit, against packed buckets (policy.weight_sync.packed)
#   TRAIN_CEILING=1 (default, with the rollout ceiling) meanwhile times the training engine alone on the last
#            GPU(s): tools/bench_train.py --workload rl, megatron-core + TE on the 8B shape cut to 8 layers, packed
#            micro-batches of the layout's train_mb_tokens at its tensor parallel size, TRAIN_CEILING_RECIPES
#            (default bf16,e4m3-blockwise,e4m3-tensorwise) ($OUT/train_ceiling.json): the report's engines' bound
#            puts log-probs and training at that FP8 gain
# Diagnostics of the same command: memory/train_* in metrics.jsonl (peak allocated / reserved, allocator retries),
# gpu_mem_<run>.csv and gpu_procs_<run>.csv (nvidia-smi per GPU and per process), and with policy.profile.dir set
# a torch.profiler table of 6 micro-batches of training call 3 per rank (nemo_fp8/utils/profiling.py)
source "$(dirname "$0")/../common.sh"
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1500}
suite_init mission-8b-4gpu
# the checkpoint (host work) is written while the rollout ceiling below uses the GPUs
[ -f models/qwen3-8b-random/config.json ] || { "$PYTHON" tools/write_random_checkpoint.py --out models/qwen3-8b-random \
  ${MISSION_TOKENIZER:+--tokenizer-from $MISSION_TOKENIZER} 2>&1 | tail -2 & }
D=${NEMO_FP8_SHARED_DATA:-../shared/data}/gsm8k; S=${STEPS:-4}
layout=${MISSION_LAYOUT:-auto}
if [ "$layout" = auto ]; then
  min_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sort -n | head -1)
  layout=tp2; [ "${min_mib:-0}" -ge 102400 ] && layout=tp1
fi
G=${MISSION_GPUS:-4}; P=${PROMPTS:-32}; N=${SAMPLES:-16}
case $layout in
  tp1) layout_args="policy.megatron_cfg.tensor_model_parallel_size=1 policy.data_parallel_size=$G
        policy.sequence_packing.train_mb_tokens=16384 policy.weight_sync.method=cuda_ipc"; train_tp=1 mb_tokens=16384 ;;
  tp2) layout_args="policy.data_parallel_size=$((G / 2))"; train_tp=2 mb_tokens=4096 ;;  # the configs' own
  *) echo "MISSION_LAYOUT=$layout: valid are auto, tp1, tp2"; exit 2 ;;
esac
[ $((G % train_tp)) = 0 ] && [ $((P * N % G)) = 0 ] || {
  echo "MISSION_GPUS=$G: needs a multiple of the layout's tensor parallel $train_tp that divides PROMPTS x SAMPLES"
  exit 2; }
echo "layout: $layout ($(echo $layout_args))"
if [ "${CEILING:-1}" = 1 ] && [ ! -s "$OUT/ceiling.json" ]; then
  bench=(tools/bench_rollout.py --models dense --num-prompts $((P * N / G)) --input-len 160 --output-len "${MAX_NEW:-1024}"
         --rl-prompts 0 --fixed-seeded --gpu-mem 0.6 --timeout 900 --refit)
  CUDA_VISIBLE_DEVICES=0 "$PYTHON" "${bench[@]}" --precisions bf16 --out "$OUT/ceiling_bf16.json" \
    > "$OUT/ceiling_bf16.log" 2>&1 &
  # the FP8 engines over GPUs 1..N-1, round robin, one after another on a GPU (DeepGEMM's cache takes concurrent
  # writers: vLLM's tensor-parallel workers compile into it at once)
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$ngpu" -ge 2 ] || ngpu=2
  IFS=, read -ra fp8_engines <<< "${CEILING_FP8:-fp8-deepgemm-v2,fp8-deepgemm-kv-v2}"
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
      --recipes "${TRAIN_CEILING_RECIPES:-bf16,e4m3-blockwise,e4m3-tensorwise}" --tp "$train_tp" \
      --rl-train-mb-tokens "$mb_tokens" \
      --rl-responses 64 --rl-prompt 160 --rl-response-min "${MAX_NEW:-1024}" --rl-response-max "${MAX_NEW:-1024}" \
      --steps 3 --warmup 1 --json "$OUT/train_ceiling.json" > "$OUT/train_ceiling.log" 2>&1
  }
  if [ "$ntrain" -gt 0 ] && [ "$train_after" = 0 ]; then train_bench & fi
  wait
  if [ "$ntrain" -gt 0 ] && [ "$train_after" = 1 ]; then train_bench; fi
  [ "$ntrain" -gt 0 ] && tail -n 6 "$OUT/train_ceiling.log"
  "$PYTHON" -c 'import json, sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=1))' \
    "$OUT"/ceiling_bf16.json "$OUT"/ceiling_fp8_gpu*.json > "$OUT/ceiling.json" && tail -n 4 "$OUT"/ceiling_fp8_gpu*.log
fi
wait  # the checkpoint
for v in ${RUNS:-bf16 fp8 fp8kv}; do
  case $v in
    bf16) cfg=examples/configs/grpo_math_8B_megatron.yaml; extra="" ;;
    fp8) cfg=examples/configs/grpo_math_8B_megatron_fp8.yaml; extra="${MISSION_FP8_ARGS:-}" ;;
    fp8kv) cfg=examples/configs/grpo_math_8B_megatron_fp8.yaml
      extra="policy.generation.vllm_cfg.kv_cache_dtype=fp8 ${MISSION_FP8_ARGS:-}" ;;
    fp8tw) cfg=examples/configs/grpo_math_8B_megatron_fp8.yaml
      extra="policy.megatron_cfg.fp8_cfg.fp8_recipe=tensorwise ${MISSION_FP8_ARGS:-}" ;;
    fp8v1) cfg=examples/configs/grpo_math_8B_megatron_fp8.yaml
      extra="policy.generation.vllm_cfg.model_runner=v1 ${MISSION_FP8_ARGS:-}" ;;
    fp8kvv1) cfg=examples/configs/grpo_math_8B_megatron_fp8.yaml
      extra="policy.generation.vllm_cfg.kv_cache_dtype=fp8 policy.generation.vllm_cfg.model_runner=v1 ${MISSION_FP8_ARGS:-}" ;;
    *) echo "unknown run $v (bf16, fp8, fp8kv, fp8tw, fp8v1, fp8kvv1)"; exit 2 ;;
  esac
  mkdir -p "$OUT/$v"
  nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500 > "$OUT/gpu_mem_$v.csv" 2>/dev/null & SMI=$!
  # per process (trainer rank or engine), every 2 s: who holds a GPU's memory while the engines sleep
  nvidia-smi --query-compute-apps=timestamp,gpu_uuid,pid,used_memory --format=csv -lms 2000 \
    > "$OUT/gpu_procs_$v.csv" 2>/dev/null & PROCS=$!
  # shellcheck disable=SC2086
  run_grpo "$v" "$cfg" cluster.gpus_per_node="$G" $layout_args policy.model_name=models/qwen3-8b-random grpo.max_num_steps="$S" \
    grpo.val_at_end=false data.dataset=gsm8k data.train_path="$D/train.jsonl" data.val_path="$D/test.jsonl" \
    grpo.num_prompts_per_step="$P" grpo.num_generations_per_prompt="$N" policy.train_global_batch_size=$((P * N)) \
    policy.generation.max_new_tokens="${MAX_NEW:-1024}" $extra ${MISSION_ARGS:-}
  kill $SMI $PROCS 2>/dev/null
done
ceiling=(); [ -s "$OUT/ceiling.json" ] && ceiling=(--ceiling "$OUT/ceiling.json" --targets fp8=0.80,fp8kv=0.72,fp8tw=0.80,fp8v1=0.80,fp8kvv1=0.72)
[ -s "$OUT/ceiling.json" ] && [ -s "$OUT/train_ceiling.json" ] && ceiling+=(--train-ceiling "$OUT/train_ceiling.json")
# shellcheck disable=SC2086
report_runs --baseline bf16 "${ceiling[@]}" ${MISSION_REPORT_ARGS:-}
[ "${CHECKS:-1}" = 0 ] && exit 0
checks=()
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
