#!/usr/bin/env bash
# One device call on 2 H200s (NCCL): the bf16 parity check of the 2-GPU layouts named in
# PARITY against the one-GPU references (bf16 and fp32), then bench/train_step.py for the
# 2-GPU plans named in TRAIN (default: every 2-GPU plan in bench/gpu_plans). Results:
# bench/results/h200, packed into $OUT/results.tgz (bench/_campaign.sh).
source "$(dirname "$0")/_campaign.sh"
gpus() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['cluster']['gpus'])" "$1"; }
PARITY=${PARITY-mixtral2l_sp2_ep2_a2a mixtral2l_tp2_etp2 mixtral2l_sp2_ep2_ag mixtral4l_pp2_vpp2}
if [ -z "${TRAIN+x}" ]; then
  TRAIN=$(for p in bench/gpu_plans/*.json; do [ "$(gpus "$p")" = 2 ] && basename "$p" .json; done)
fi
TR="torchrun --standalone --nproc-per-node 2"
for name in $PARITY; do
  step "parity_$name" 200 $TR bench/parity_gpu.py --plan "bench/gpu_plans/$name.json" \
    --out "$RES/parity_$name.json"
done
for name in $TRAIN; do
  step "train_step_$name" 120 $TR bench/train_step.py --plan "bench/gpu_plans/$name.json" \
    --steps "${STEPS:-5}" --warmup 2 --out "$RES/train_step_$name.json"
done
