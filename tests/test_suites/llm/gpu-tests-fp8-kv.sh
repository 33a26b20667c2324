#!/bin/bash
# The FP8 KV cache's GPU tests (docs/fp8-kv-cache.md): calibrated scales land in every attention layer, engines
# without scales are refused, new scales change the outputs and the first scales bring them back.
source "$(dirname "$0")/../common.sh"; suite_init gpu-tests-fp8-kv
run_gpu_pytest tests/gpu/test_vllm_fp8_kv.py
