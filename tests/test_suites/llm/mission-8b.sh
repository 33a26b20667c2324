#!/bin/bash
# The mission command at 8B (Qwen3-8B shape, random bf16 weights, GSM8K prompts), FP8 then BF16, then the side-by-side
# report (tools/mission_report.py: per-step phases, rollout tokens/s, peak GPU memory) (docs/performance.md).
#   MISSION_RUNS  "fp8 bf16" (default); one at a time where a call is time-limited (the report joins them)
#   MISSION_ONE_GPU=1  the one-GPU layout: tensor parallel 1, half of Adam's state on the host, bf16 gradient
#                      buffer, the refit over CUDA IPC, the engine at 30% of the GPU
#   MISSION_ARGS  more overrides; MISSION_TOKENIZER: a tokenizer folder for the random checkpoint; STEPS (3)
# The 4-GPU mission suite builds on this one (same runs, more overrides, step-time ratio checks).
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1500}  # this suite's default; common.sh's is 560 s
source "$(dirname "$0")/../common.sh"; suite_init mission-8b
[ -f models/qwen3-8b-random/config.json ] || "$PYTHON" tools/write_random_checkpoint.py --out models/qwen3-8b-random \
  ${MISSION_TOKENIZER:+--tokenizer-from $MISSION_TOKENIZER} 2>&1 | tail -2
D=${NEMO_FP8_SHARED_DATA:-../shared/data}/gsm8k; S=${STEPS:-3}
ONE_GPU="cluster.gpus_per_node=1 policy.data_parallel_size=1 policy.megatron_cfg.tensor_model_parallel_size=1
  policy.megatron_cfg.sequence_parallel=false
  policy.megatron_cfg.optimizer.use_precision_aware_optimizer=true policy.megatron_cfg.optimizer.optimizer_cpu_offload=true
  policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5
  policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32=false policy.weight_sync.method=cuda_ipc
  policy.generation.vllm_cfg.gpu_memory_utilization=0.3"
for v in ${MISSION_RUNS:-fp8 bf16}; do
  mkdir -p "$OUT/$v"
  nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500 > "$OUT/gpu_mem_$v.csv" 2>/dev/null & SMI=$!
  # the host memory used (MiB) every 5 s: the optimizer CPU offload and the colocated offload live there
  while true; do echo "$(date +%T) $(free -m | awk "/^Mem:/{print \$3}")"; sleep 5; done > "$OUT/host_mem_$v.log" & HOSTMEM=$!
  run_grpo "$v" "examples/configs/grpo_math_8B_megatron$([ "$v" = fp8 ] && echo _fp8).yaml" \
    policy.model_name=models/qwen3-8b-random grpo.max_num_steps="$S" grpo.val_at_end=false data.dataset=gsm8k \
    data.train_path="$D/train.jsonl" data.val_path="$D/test.jsonl" grpo.num_prompts_per_step=8 \
    grpo.num_generations_per_prompt=8 policy.train_global_batch_size=64 policy.generation.max_new_tokens=1024 \
    ${MISSION_ONE_GPU:+$ONE_GPU} ${MISSION_ARGS:-}
  kill $SMI $HOSTMEM 2>/dev/null
  echo "mission $v: host memory used at most $(sort -k2 -n "$OUT/host_mem_$v.log" | tail -1 | cut -d" " -f2) MiB"
done
report_runs   # every run so far, an earlier call's too (MISSION_RUNS=bf16 after fp8)
check_runs $(for v in ${MISSION_RUNS:-fp8 bf16}; do echo "count($v:timing/step)>=$S"; done)
