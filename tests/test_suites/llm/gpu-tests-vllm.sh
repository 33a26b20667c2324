#!/bin/bash
# The vLLM FP8 rollout engine's GPU tests, dense and MoE (docs/vllm-fp8-rollout.md): refit bit-exact in fp32 and
# pow2 scale conventions, outputs follow the refit, memory and data pointers unchanged over refits and sleep / wake,
# engine Linear vs Fp8BlockLinear.
source "$(dirname "$0")/../common.sh"; suite_init gpu-tests-vllm
run_gpu_pytest tests/gpu/test_vllm_fp8.py tests/gpu/test_vllm_moe_pow2.py
