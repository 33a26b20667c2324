#!/bin/bash
# The mission command at 8B on one 8-GPU node, in the 8B configs' layout for 80 GB cards (Megatron tensor parallel 2
# x data parallel 4, eight vLLM engines of tensor parallel 1 colocated, 4,096-token packed micro-batches), with the
# 4-GPU suite's runs, ceilings, report and checks (tests/test_suites/mission.sh; its environment applies). Recipes:
# examples/configs/recipes/llm/mission-8b-8gpu/{tp2,tp1}.yaml: 5 steps of 32 x 16 responses of up to 2,048 tokens;
# tp1 (MISSION_LAYOUT=tp1, GPUs of 100 GiB or more) is the configs' own tensor parallel 1 x data parallel 8, with
# 16,384-token micro-batches and the CUDA IPC refit.
#   SCALE_FROM  a 4-GPU run of the same step (that suite's output folder): the report adds the scaling from 4 to 8
#               GPUs (step time, rollout tokens/s per GPU; tools/mission_report.py --scale-from)
SUITE_TIMEOUT=${SUITE_TIMEOUT:-1500}  # this suite's default; common.sh's is 560 s
source "$(dirname "$0")/../common.sh"; source "$(dirname "$0")/../mission.sh"
suite_init mission-8b-8gpu
[ -z "${SCALE_FROM:-}" ] || [ -d "$SCALE_FROM" ] || { echo "SCALE_FROM=$SCALE_FROM: no such folder"; exit 2; }
mission_suite tp2 ${SCALE_FROM:+--gpus 8 --scale-from "4=$SCALE_FROM"}
