#!/bin/bash
# The Megatron-core + TransformerEngine backend's GPU tests (docs/megatron-fp8-training.md): HF <-> Megatron
# round trip, log-probs against the torch reference within the bf16 noise floor, FP8 recipes lower the loss, checkpoint,
# fusions, precision-aware optimizer, offload round trip; sequence packing (its tensor-parallel-2 case needs two
# GPUs) and the micro-batch path without host syncs. K: a pytest -k filter.
source "$(dirname "$0")/../common.sh"; suite_init gpu-tests-megatron
run_gpu_pytest tests/gpu/test_megatron_policy.py tests/gpu/test_megatron_packing.py tests/gpu/test_host_syncs.py \
  ${K:+-k "$K"}
