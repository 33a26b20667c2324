#!/bin/bash
# The GPU checks of the README's "On a GPU host" sections, by name, within one time budget:
#
#   DEADLINE=560 bash tools/gpu_jobs.sh mtest kvtest        # names below; DEADLINE: seconds for all of them
#
# On the project's GPU host the stack comes from ../shared/gpu-host (.stage/install.sh writes
# /tmp/gpu-site/env.sh; it is installed here on first use). Elsewhere, have vLLM / TE / megatron-core /
# Megatron-Bridge importable. Logs (and metrics) go to $OUT (default logs/gpu_jobs).
#   mtest   megatron GPU tests (K: pytest -k filter, default all)   vtest   vLLM FP8 tests (dense + MoE)
#   x2      every check that needs two GPUs (nvidia-h200-x2), in one go: the vLLM engine of tensor parallel 2
#           (tests/gpu/test_vllm_tp2.py), the refit over NCCL to an engine on its own GPU
#           (tests/gpu/test_weight_sync_nccl.py), Megatron tensor parallel 2 vs 1 (test_tensor_parallel_2_matches_1)
#   kvtest  FP8 KV cache tests                                      e2e     tiny megatron GRPO: E2E="fp8 bf16 fp16" (FP8
#           rollout + FP8 training, all BF16, FP8 rollout + FP16 training with loss scaling; fp8ipc: fp8 with the
#           refit over CUDA IPC, policy.weight_sync.method=cuda_ipc; bf16ipc, kv, kvipc: the same pairs for BF16 and
#           for the FP8 KV cache)
#   kvgrpo  tiny megatron FP8 GRPO with FP8 KV cache (STEPS)        btrain  tools/bench_train.py (BT_ARGS)
#   kvbench tools/bench_rollout.py (BENCH_ARGS)                     small   tools/make_small_model.py, in the background
#   parity  tools/compare_precision.py --backend gpu, in the background (PARITY_ARGS), after a running `small`;
#           logs in PARITY_DIR (default logs/compare/gpu; another name for the second half of runs split over two
#           hosts, joined later by compare_precision --report-only --also)
#   sweep   BF16-only GRPO runs of the parity config side by side, in the background, after a running `small`:
#           SWEEP="name key=value ...;name key=value ..." (one run per ';' item, all at once on the GPU, logs in
#           logs/sweep/<name>): which learning rate / batch makes the BF16 baseline learn, before the parity run
#   sweeprep each sweep run's validation accuracy (overall and per data source) by step, and its metrics, to $OUT
#   wait    sleep until the deadline or the background jobs end, then show their logs     sh      bash -c "$CMD"
#   report  the parity plot/table from the logs so far (compare_precision --report-only) + small model report, to $OUT
#   updvis  tools/fp8_update_visibility.py from the small model to each parity run's last checkpoint (UV_BEFORE,
#           UV_ARGS): how much of the trained update each run's FP8 engine saw, to $OUT/updvis.log
#   dgcache pack the DeepGEMM kernel cache ($DG_JIT_CACHE_DIR, default .dgcache) into $OUT/dgcache.tgz
#   prof    tools/profile_rollout.py (PROF_ARGS): kernel time per decode step by category, BF16 vs FP8
#   mission the 8B mission command, FP8 then BF16 (MISSION_RUNS="fp8 bf16", STEPS, MISSION_ARGS: more overrides,
#           MISSION_TOKENIZER, MISSION_ONE_GPU=1: the one-GPU layout ONE_GPU_8B below), then tools/mission_report.py on every run so far: per-step phases, rollout tokens/s and
#           peak memory per GPU side by side
#   dgwarm  compile DeepGEMM's kernels for a shape (DG_MODEL, default dense) with a 1-layer engine at 10% of the GPU,
#           in the background (about 4.5 min on the H200): a later kvbench with fp8-deepgemm* starts warm
#   rollbench in the background, one after the other: dgwarm's DeepGEMM warm-up for DG_MODEL, then
#           tools/bench_rollout.py (BENCH_ARGS, default: DG_MODEL's shape, bf16 / fp8-deepgemm / fp8-deepgemm-inductor
#           (vLLM's group quantizer as Inductor-fused torch code) and both with the FP8 KV cache, 512 x (256, 2048)),
#           then tools/profile_rollout.py at a decode batch of 256 (PROF_ARGS; none: skip); ~22 min for the dense
#           shape; logs in logs/rollbench, copied to $OUT by `wait`
set -u
START=$(date +%s); DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
if [ ! -f /tmp/gpu-site/env.sh ] && [ -f .stage/install.sh ] && command -v nvidia-smi > /dev/null; then
  bash .stage/install.sh > /tmp/install.log 2>&1 || { tail -30 /tmp/install.log; exit 3; }
fi
[ -f /tmp/gpu-site/env.sh ] && source /tmp/gpu-site/env.sh
export PYTHONUNBUFFERED=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
# DeepGEMM compiles its kernels on first use (minutes on a fresh host): keep them in the checkout so a
# later run (or host, given the folder) starts warm; `dgcache` packs them into $OUT.
export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-$PWD/.dgcache}
OUT=${OUT:-logs/gpu_jobs}; mkdir -p "$OUT"
PD=${PARITY_DIR:-logs/compare/gpu}
# dgwarm's engine (also rollbench's first step): DeepGEMM compiles its kernels for the shape's GEMMs; 1 layer, 10% of the GPU
DGWARM="python3 tools/bench_rollout.py --models ${DG_MODEL:-dense} --num-layers ${DG_MODEL:-dense}=1 --precisions fp8-deepgemm
  --gpu-mem 0.1 --num-prompts 8 --output-len 16 --rl-prompts 2 --rl-samples 2 --timeout 900"
TINY="examples/configs/grpo_math_tiny_megatron_fp8.yaml"
# MISSION_ONE_GPU=1: the 8B mission on one GPU (README): tensor parallel 1, half of Adam's state offloaded to the host
# (megatron-core's HybridDeviceOptimizer), bf16 gradient buffer, the refit over CUDA IPC (no host copy of the weights)
ONE_GPU_8B="cluster.gpus_per_node=1 policy.megatron_cfg.tensor_model_parallel_size=1 policy.megatron_cfg.sequence_parallel=false
  policy.megatron_cfg.optimizer.use_precision_aware_optimizer=true policy.megatron_cfg.optimizer.optimizer_cpu_offload=true
  policy.megatron_cfg.optimizer.optimizer_offload_fraction=0.5
  policy.megatron_cfg.distributed_data_parallel_config.grad_reduce_in_fp32=false policy.weight_sync.method=cuda_ipc
  policy.generation.vllm_cfg.gpu_memory_utilization=0.3"
# Run the command line $1 in the background once a running `small` build has written the model (right away when none
# runs), its output in $2 (parity, sweep).
after_small() {
  setsid nohup bash -c 'while pgrep -f make_small_mode[l] > /dev/null; do sleep 5; done
    [ -f models/small-qwen3/small_model_spec.json ] || { echo "no small model: see small.log"; exit 1; }
    exec '"$1" > "$2" 2>&1 < /dev/null &
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi: no GPU here"
for job in "$@"; do
  L=$(left); echo "=== $job (${L}s left) $(date +%T)"
  [ "$L" -lt 20 ] && [ "$job" != report ] && { echo "skipped: deadline"; continue; }  # report: seconds, and it is what comes back
  case $job in
    mtest) VLLM_USE_DEEP_GEMM=0 timeout $((L-5)) python3 -m pytest -q -s -m gpu tests/gpu/test_megatron_policy.py \
             -k "${K:-}" -p no:cacheprovider 2>&1 | tee "$OUT/mtest.log" | tail -40 ;;
    vtest) VLLM_USE_DEEP_GEMM=0 timeout $((L-5)) python3 -m pytest -q -s -m gpu tests/gpu/test_vllm_fp8.py \
             tests/gpu/test_vllm_moe_pow2.py -p no:cacheprovider 2>&1 | tee "$OUT/vtest.log" | tail -40 ;;
    x2) [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] || { echo "x2: needs two GPUs (nvidia-h200-x2)"; continue; }
        for t in tests/gpu/test_vllm_tp2.py tests/gpu/test_weight_sync_nccl.py \
                 "tests/gpu/test_megatron_policy.py::test_tensor_parallel_2_matches_1"; do
          VLLM_USE_DEEP_GEMM=0 timeout $(( $(left) - 5 )) python3 -m pytest -q -s -m gpu "$t" -p no:cacheprovider 2>&1 \
            | tee -a "$OUT/x2.log" | grep -v "^(EngineCore\|^INFO\|^WARNING" | tail -25
        done ;;
    kvtest) VLLM_USE_DEEP_GEMM=0 timeout $((L-5)) python3 -m pytest -q -s -m gpu tests/gpu/test_vllm_fp8_kv.py \
              -p no:cacheprovider 2>&1 | tee "$OUT/kvtest.log" | tail -40 ;;
    kvgrpo) VLLM_USE_DEEP_GEMM=0 timeout $((L-5)) python3 examples/run_grpo_math.py --config $TINY \
              grpo.max_num_steps=${STEPS:-6} grpo.val_period=3 policy.generation.vllm_cfg.kv_cache_dtype=fp8 \
              logger.log_dir=logs/kvgrpo checkpointing.enabled=false 2>&1 | tee "$OUT/kvgrpo.log" | tail -30
            cp logs/kvgrpo/metrics.jsonl "$OUT/kvgrpo_metrics.jsonl" 2>/dev/null ;;
    e2e) runs=(${E2E:-fp8 bf16 fp16}); n=${#runs[@]}
         for v in "${runs[@]}"; do
           case $v in
             fp8) ex="" ;;
             bf16) ex="policy.megatron_cfg.fp8_cfg.enabled=false policy.generation.vllm_cfg.precision=bfloat16" ;;
             fp16) ex="policy.megatron_cfg.fp8_cfg.enabled=false policy.megatron_cfg.optimizer.bf16=false policy.megatron_cfg.optimizer.fp16=true" ;;
             fp8ipc) ex="policy.weight_sync.method=cuda_ipc" ;;  # = fp8, refit over CUDA IPC: same step-1 metrics
             bf16ipc) ex="policy.megatron_cfg.fp8_cfg.enabled=false policy.generation.vllm_cfg.precision=bfloat16 policy.weight_sync.method=cuda_ipc" ;;
             kvipc) ex="policy.generation.vllm_cfg.kv_cache_dtype=fp8 policy.weight_sync.method=cuda_ipc" ;;  # KV scales over IPC
             kv) ex="policy.generation.vllm_cfg.kv_cache_dtype=fp8" ;;
           esac
           VLLM_USE_DEEP_GEMM=0 timeout $(( $(left) / n )) python3 examples/run_grpo_math.py --config $TINY \
             grpo.max_num_steps=${STEPS:-5} logger.log_dir=logs/e2e_$v checkpointing.enabled=false $ex 2>&1 \
             | tee "$OUT/e2e_$v.log" | tail -25
           cp logs/e2e_$v/metrics.jsonl "$OUT/e2e_${v}_metrics.jsonl" 2>/dev/null
           n=$(( n > 1 ? n - 1 : 1 ))
         done ;;
    kvbench) timeout $((L-5)) python3 tools/bench_rollout.py ${BENCH_ARGS:---models dense --precisions fp8-kv,bf16,fp8-cutlass \
               --num-prompts 512 --output-len 1536} --timeout $((L-20)) 2>&1 | tee "$OUT/kvbench.log" | tail -30 ;;
    btrain) timeout $((L-5)) python3 tools/bench_train.py ${BT_ARGS:---shapes dense --recipes bf16,e4m3-tensorwise,e4m3-blockwise} \
              2>&1 | tee "$OUT/btrain.log" | tail -30 ;;
    small) mkdir -p logs; setsid nohup python3 tools/make_small_model.py --out models/small-qwen3 ${SMALL_ARGS:-} > logs/small.log \
             2>&1 < /dev/null & sleep 30; tail -5 logs/small.log ;;
    parity) mkdir -p logs; after_small "python3 tools/compare_precision.py --backend gpu --out-dir $PD ${PARITY_ARGS:-}" \
              logs/parity.log
            sleep 20; tail -5 logs/parity.log ;;
    sweep) mkdir -p logs/sweep; n=$(echo "${SWEEP:?SWEEP=\"name key=value ...;...\"}" | tr ';' '\n' | grep -c .)
           echo "$SWEEP" | tr ';' '\n' | grep . | while read -r name over; do
             # --parallel $n: compare_precision's memory split (engine share, fixed KV cache) for $n runs on one GPU
             after_small "python3 tools/compare_precision.py --backend gpu --variants bf16 --parallel $n \
               --out-dir logs/sweep/$name checkpointing.enabled=false $over" "logs/sweep/$name.log"
             sleep 15  # spread the engines' start-up
           done; tail -n 3 logs/sweep/*.log ;;
    sweeprep) for d in logs/sweep/*/; do
           m="$d/bf16/metrics.jsonl"; [ -f "$m" ] || { echo "$d: no metrics"; continue; }
           python3 -c 'import sys
from nemo_fp8.utils.logger import read_metrics
rows = read_metrics(sys.argv[1])
tr = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
chunks = [round(sum(tr[i:i + 10]) / len(tr[i:i + 10]), 3) for i in range(0, len(tr), 10)]
print(sys.argv[2], len(tr), "steps; train reward by 10 steps:", chunks)
for r in rows:
    if "val/accuracy" in r:
        print("  step", r["step"], {k.split("/")[-1]: round(v, 4) for k, v in r.items() if k.startswith("val/accuracy")})' "$m" "$d"
         done; tar czf "$OUT/sweep_logs.tgz" logs/sweep/*/bf16/metrics.jsonl logs/sweep/*/bf16/run.log 2>/dev/null ;;
    wait) # until the deadline or until no background job (small, parity, dgwarm) runs, whichever is first
          while [ "$(left)" -gt 40 ] && pgrep -f "make_small_mode[l]|compare_precisio[n]|bench_rollou[t]|profile_rollou[t]" \
            > /dev/null; do sleep 10; done
          tail -n ${TAIL:-15} logs/small.log logs/parity.log 2>/dev/null
          [ -d logs/rollbench ] && cp logs/rollbench/* "$OUT"/ && grep -hv '^{' logs/rollbench/bench.log logs/rollbench/prof.log \
            2>/dev/null | tail -n ${TAIL:-15}
          for m in "$PD"/*/metrics.jsonl; do [ -f "$m" ] && echo "$m: $(wc -l < "$m") rows"; done ;;
    report) # the parity plot and table from whatever the variants logged so far, and the small model's report, into $OUT
          python3 tools/compare_precision.py --backend gpu --report-only --out-dir "$PD" ${PARITY_ARGS:-} 2>&1 | tail -40
          cp models/small-qwen3/small_model_spec.json "$PD"/parity.md "$PD"/parity.png "$OUT"/ 2>/dev/null
          cp logs/parity.log logs/small.log "$OUT"/ 2>/dev/null
          tar czf "$OUT/parity_logs.tgz" "$PD"/*/metrics.jsonl "$PD"/*/run.log 2>/dev/null ;;
    updvis) # how much of each parity run's update its FP8 engine saw: tools/fp8_update_visibility.py from the small
            # model (UV_BEFORE) to the run's last checkpoint (parity runs that kept checkpointing on), per variant
          R=results/${PD#logs/}  # compare_precision.checkpoint_dir's rule: logs/X -> results/X
          for d in "$R"/*/; do
            last=$(ls -d "$d"step_* 2>/dev/null | sort -t_ -k2 -n | tail -1); [ -n "$last" ] || continue
            echo "== $(basename "$d"): ${UV_BEFORE:-models/small-qwen3} -> $last"
            timeout $(( $(left) - 5 )) python3 tools/fp8_update_visibility.py --before "${UV_BEFORE:-models/small-qwen3}" \
              --after "$last" ${UV_ARGS:-} | tail -n +2
          done 2>&1 | tee "$OUT/updvis.log"
          [ -s "$OUT/updvis.log" ] || echo "no checkpoints under $R (run parity without checkpointing.enabled=false)" ;;
    dgcache) if [ -d "$DG_JIT_CACHE_DIR" ]; then
               tar czf "$OUT/dgcache.tgz" -C "$(dirname "$DG_JIT_CACHE_DIR")" "$(basename "$DG_JIT_CACHE_DIR")" && ls -la "$OUT/dgcache.tgz"
             else echo "no DeepGEMM cache at $DG_JIT_CACHE_DIR (no DeepGEMM engine ran)"; fi ;;
    rollbench) mkdir -p logs/rollbench; M=${DG_MODEL:-dense}
          B=${BENCH_ARGS:---models $M --precisions bf16,fp8-deepgemm,fp8-deepgemm-inductor,fp8-deepgemm-kv,fp8-deepgemm-inductor-kv \
            --num-prompts 512 --output-len 2048 --rl-prompts 0}
          P=${PROF_ARGS:---model $M --precisions fp8-deepgemm,fp8-deepgemm-inductor --batch 256 --output-len 256}
          setsid nohup bash -c "$(echo $DGWARM) > logs/rollbench/dgwarm.log 2>&1
            python3 tools/bench_rollout.py $B --timeout 900 --out logs/rollbench/bench.json > logs/rollbench/bench.log 2>&1
            [ '$P' = none ] || python3 tools/profile_rollout.py $P --out logs/rollbench/prof.json \
              > logs/rollbench/prof.log 2>&1" > /dev/null 2>&1 < /dev/null &
          sleep 20; tail -2 logs/rollbench/dgwarm.log ;;
    prof) timeout $((L-5)) python3 tools/profile_rollout.py ${PROF_ARGS:---precisions bf16,fp8-cutlass} --timeout $((L-20)) \
            2>&1 | tee "$OUT/prof.log" | tail -30 ;;
    dgwarm) setsid nohup $DGWARM > "$OUT/dgwarm.log" 2>&1 < /dev/null & sleep 40; tail -3 "$OUT/dgwarm.log" ;;
    mission) # the mission command at 8B (README "GPU: learning parity and the 8B command"), FP8 then BF16, side by side
          [ -f models/qwen3-8b-random/config.json ] || python3 tools/write_random_checkpoint.py --out models/qwen3-8b-random \
            ${MISSION_TOKENIZER:+--tokenizer-from $MISSION_TOKENIZER} 2>&1 | tail -2
          D=${NEMO_FP8_SHARED_DATA:-../shared/data}/gsm8k; runs=""
          for v in ${MISSION_RUNS:-fp8 bf16}; do
            [ "$(left)" -lt 60 ] && { echo "mission $v skipped: deadline"; continue; }
            mkdir -p logs; nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv -lms 500 > "logs/gpu_mem_$v.csv" \
              2> /dev/null & SMI=$!
            # the host's used memory (MiB) every 5 s: the optimizer CPU offload and the colocated offload live there
            while true; do echo "$(date +%T) $(free -m | awk '/^Mem:/{print $3}')"; sleep 5; done > "logs/host_mem_$v.log" & HOSTMEM=$!
            timeout $(( $(left) - 30 )) python3 examples/run_grpo_math.py --overwrite \
              --config examples/configs/grpo_math_8B_megatron$([ $v = fp8 ] && echo _fp8).yaml \
              policy.model_name=models/qwen3-8b-random grpo.max_num_steps=${STEPS:-3} grpo.val_at_end=false \
              checkpointing.enabled=false data.dataset=gsm8k data.train_path=$D/train.jsonl data.val_path=$D/test.jsonl \
              grpo.num_prompts_per_step=8 grpo.num_generations_per_prompt=8 policy.train_global_batch_size=64 \
              policy.generation.max_new_tokens=1024 logger.log_dir=logs/mission_$v ${MISSION_ONE_GPU:+$ONE_GPU_8B} \
              ${MISSION_ARGS:-} > "$OUT/mission_$v.log" 2>&1
            echo "mission $v: rc=$?"; kill $SMI $HOSTMEM 2> /dev/null; grep -v "Warning\|warn(" "$OUT/mission_$v.log" | tail -8
            cp "logs/host_mem_$v.log" "$OUT/" 2> /dev/null
            echo "mission $v: host memory used at most $(sort -k2 -n "logs/host_mem_$v.log" | tail -1 | awk '{print $2}') MiB"
          done
          for v in fp8 bf16; do  # every run with metrics so far (an earlier call's too: MISSION_RUNS=bf16 after fp8)
            [ -f "logs/mission_$v/metrics.jsonl" ] || continue
            if [ -s "logs/gpu_mem_$v.csv" ]; then cp "logs/gpu_mem_$v.csv" "$OUT/"; runs="$runs $v=logs/mission_$v,logs/gpu_mem_$v.csv"
            else runs="$runs $v=logs/mission_$v"; fi
          done
          [ -n "$runs" ] && python3 tools/mission_report.py $runs --out "$OUT/mission.md" ;;
    sh) bash -c "$CMD" 2>&1 | tail -60 ;;
    *) echo "unknown job $job (see the head of $0)" ;;
  esac
done
echo "=== done $(date +%T), $(left)s left"; nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null
