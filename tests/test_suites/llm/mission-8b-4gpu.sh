#!/bin/bash
# The mission command at 8B on one 4-GPU node, the layout a user runs there (docs/performance.md), BF16 against FP8
# (W8A8 blockwise rollout with DeepGEMM + TE blockwise training + TIS) and FP8 + FP8 KV cache. Recipes:
# examples/configs/recipes/llm/mission-8b-4gpu/{tp1,tp2}.yaml, the FP8 runs adding arms/*.yaml fragments
# (tests/test_suites/mission.sh: which run adds which):
#   tp1 (chosen on GPUs of 100 GiB or more, e.g. H200): Megatron tensor parallel 1 x data parallel 4, 16,384-token
#       packed micro-batches, CUDA IPC refit;
#   tp2 (80 GB GPUs): tensor parallel 2 x data parallel 2, 4,096-token micro-batches, refit over the object store.
# Both: sequence packing, one vLLM engine of tensor parallel 1 per GPU colocated with the trainer, 32 GSM8K prompts
# x 16 responses of up to 1,024 tokens, one optimizer step of all 512, 4 steps. Runs: bf16, fp8, fp8kv (RUNS; also
# fp8tw: tensorwise training, fp8v1 / fp8kvv1: vLLM's V1 model runner).
# First (CEILING=0 skips it, once per $OUT) each rollout engine alone on one GPU at the runs' per-engine batch
# (bf16 on GPU 0, the FP8 engines on GPUs 1.., which also fills DeepGEMM's kernel cache), each also timing a full
# refit (one CUDA IPC handle per tensor against packed buckets), and meanwhile the training engine alone on the
# last GPU(s) (TRAIN_CEILING=0 skips it: tools/bench_train.py --workload rl on the 8B shape cut to 8 layers, the
# layout's tensor parallel and micro-batches); the report then gives each FP8 step at the engines' own gains.
# Checks: FP8 step <= 0.80 x BF16, FP8 + FP8 KV <= 0.72 x, every FP8 phase <= its BF16 time (step 1 left out).
# Diagnostics: memory/train_* in metrics.jsonl, gpu_mem_<run>.csv and gpu_procs_<run>.csv (nvidia-smi per GPU and
# per process); with MISSION_ARGS=policy.profile.dir=... a torch.profiler table per rank (nemo_fp8/utils/profiling.py).
# The environment (host, what to run): tests/test_suites/mission.sh.
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1500}  # this suite's default; common.sh's is 560 s
source "$(dirname "$0")/../common.sh"; source "$(dirname "$0")/../mission.sh"
suite_init mission-8b-4gpu
mission_suite auto
