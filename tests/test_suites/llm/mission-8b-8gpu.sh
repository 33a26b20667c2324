#!/bin/bash
# The mission command at 8B on one 8-GPU node, in the configs' own layout (cluster.gpus_per_node 8: Megatron tensor
# parallel 2 x data parallel 4, eight vLLM engines of tensor parallel 1 colocated, 4,096-token packed micro-batches),
# through the 4-GPU suite's runs, ceilings, report and checks (mission-8b-4gpu.sh: its variables apply), with:
#   STEPS 5, MAX_NEW 2048 (responses up to 2,048 tokens), PROMPTS x SAMPLES 32 x 16 (64 x 32: the configs' own step)
#   MISSION_LAYOUT tp2 (the configs'); tp1 is tensor parallel 1 x data parallel 8 on GPUs of 100 GiB or more
#   SCALE_FROM  a 4-GPU run of the same step (that suite's output folder): the report adds the scaling from 4 to 8
#               GPUs (step time, rollout tokens/s per GPU; tools/mission_report.py --scale-from)
source "$(dirname "$0")/../common.sh"
suite_init mission-8b-8gpu
export OUT MISSION_GPUS=8 MISSION_LAYOUT=${MISSION_LAYOUT:-tp2} STEPS=${STEPS:-5} MAX_NEW=${MAX_NEW:-2048}
[ -z "${SCALE_FROM:-}" ] || [ -d "$SCALE_FROM" ] || { echo "SCALE_FROM=$SCALE_FROM: no such folder"; exit 2; }
export MISSION_REPORT_ARGS="${SCALE_FROM:+--gpus $MISSION_GPUS --scale-from 4=$SCALE_FROM} ${MISSION_REPORT_ARGS:-}"
# the verdict is the 4-GPU suite's: its checks of the targets (FP8 step <= 0.80x BF16, FP8 + FP8 KV <= 0.72x,
# every FP8 phase <= BF16's), its exit status this suite's
bash "$(dirname "$0")/mission-8b-4gpu.sh"
