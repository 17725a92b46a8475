#!/usr/bin/env bash
# One device call on nvidia-h200-x2: the memory suite (bench/memory_suite.py) on 1 and 2 GPUs,
# the plans `moeplan search --runnable` picks for the memory issue's jobs
# (bench/gpu_plans/memory, bench/memory_searched.py), then the runtime's memory guards:
# `runtime.train` of the 2-GPU searched plan, a plan predicted above the GPU's free memory
# (refused before the first step, exit 2) and a plan that runs out of memory (one line with
# predicted and measured peaks, exit 1). CASES=all runs the whole suite first (about 9 min);
# by default only the searched plans. Results in bench/results/h200/memory, packed into
# $OUT/results.tgz (bench/_campaign.sh).
RES=bench/results/h200/memory
source "$(dirname "$0")/_campaign.sh"
TR="torchrun --standalone --nproc-per-node 2"
P=bench/gpu_plans/memory
if [ "${CASES:-}" = all ]; then
  step suite_1gpu 300 env CUDA_VISIBLE_DEVICES=0 python3 bench/memory_suite.py --world 1 \
    --out-dir "$RES"
  step suite_2gpu 300 $TR bench/memory_suite.py --world 2 --out-dir "$RES"
fi
step searched_1gpu 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/memory_suite.py --world 1 \
  --out-dir "$RES" --plan-files $P/searched_*_1gpu.json
step searched_2gpu 200 $TR bench/memory_suite.py --world 2 --out-dir "$RES" \
  --plan-files $P/searched_*_2gpu.json
step train_searched_qwen4l_2gpu 150 $TR -m runtime.train --plan $P/searched_qwen4l_2gpu.json \
  --steps 3
# the guards, on plans derived from a searched one: a prediction above the device, and a
# micro-batch of 16 (the loss alone needs ~111 GiB) under a prediction that lets it start
python3 - <<'PY'
import json
plan = json.load(open("bench/gpu_plans/memory/searched_qwen4l_1gpu.json"))
plan["prediction"]["peak_memory_gib"] = 500.0
json.dump(plan, open("/tmp/too_big.json", "w"))
plan["prediction"]["peak_memory_gib"] = 60.0
plan["micro_batch_size"] = 16
json.dump(plan, open("/tmp/oom.json", "w"))
PY
step guard_preflight 60 env CUDA_VISIBLE_DEVICES=0 python3 -m runtime.train \
  --plan /tmp/too_big.json --steps 1
step guard_oom 120 env CUDA_VISIBLE_DEVICES=0 python3 -m runtime.train --plan /tmp/oom.json \
  --steps 1
exit 0
