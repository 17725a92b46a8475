#!/usr/bin/env bash
# One device call on one H200: bench/train_step.py for the 1-GPU plans (bench/gpu_plans/
# mixtral2l_1gpu*.json, or those named in TRAIN), then the bf16 parity check of 2-rank layouts
# with both ranks on the one GPU over gloo (--share-gpu: the layouts' numerics on the GPU
# kernels; NCCL on two GPUs is bench/gpu_campaign2.sh's), for the plans named in PARITY;
# python -m runtime.profile for the 1-GPU plans named in PROFILE (none by default).
# Results: bench/results/h200, packed into $OUT/results.tgz (bench/_campaign.sh).
source "$(dirname "$0")/_campaign.sh"
TRAIN=${TRAIN:-$(ls bench/gpu_plans/mixtral2l_1gpu*.json | xargs -n1 basename | sed 's/.json$//')}
PARITY=${PARITY:-mixtral2l_sp2_ep2_a2a mixtral2l_tp2_etp2}
for name in $TRAIN; do
  step "train_step_$name" 150 python3 bench/train_step.py --plan "bench/gpu_plans/$name.json" \
    --steps "${STEPS:-5}" --warmup 2 --out "$RES/train_step_$name.json"
done
for name in ${PROFILE:-}; do
  step "profile_$name" 120 python3 -m runtime.profile --plan "bench/gpu_plans/$name.json" \
    --out "$RES/profile_$name.json"
done
for name in $PARITY; do
  step "parity_shared_$name" 200 torchrun --standalone --nproc-per-node 2 bench/parity_gpu.py \
    --share-gpu --plan "bench/gpu_plans/$name.json" --out "$RES/parity_shared_$name.json"
done
