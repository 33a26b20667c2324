#!/bin/bash
# Every check that needs two GPUs (docs/multi-gpu.md): the vLLM engine of tensor parallel 2, the refit over NCCL
# to an engine on its own GPU, Megatron tensor parallel 2 against 1. Needs a host with two GPUs.
source "$(dirname "$0")/../common.sh"; suite_init gpu-tests-2gpu
[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] || { echo "needs two GPUs"; exit 2; }
rc=0
for t in tests/gpu/test_vllm_tp2.py tests/gpu/test_weight_sync_nccl.py \
         "tests/gpu/test_megatron_policy.py::test_tensor_parallel_2_matches_1"; do
  run_gpu_pytest "$t" || rc=1
done
exit $rc
