#!/usr/bin/env bash
# One device call on a node of N GPUs (N = `nvidia-smi -L` count; plans exist for 8 and 2):
#   1. bench/dispatch_gpu.py   EP dispatchers vs top-k 1..8, with the planner's picks merged
#   2. bench/layers_gpu.py     Ulysses SP vs TP attention, EP vs expert-TP FFN blocks
#   3. bench/train_step.py     moeplan search's plan and the Megatron baseline (bench/gpu_plans/xN),
#                              then bench/speedup_report.py and bench/gpu_fidelity.py
#   4. bench/parity_gpu.py     SP = EP = N with each dispatcher against the one-GPU reference
# Results and logs go to bench/results/h200_xN, packed into $OUT/results.tgz after every step
# (bench/_campaign.sh: budget, timeouts). Usage (repo root, pydantic wheels in .whl/):
#   bash bench/x8_campaign.sh
N=$(nvidia-smi -L | wc -l)
RES=${RES:-bench/results/h200_x$N}
source "$(dirname "$0")/_campaign.sh"
STEPS=${STEPS:-5}
PLANS=bench/gpu_plans/x$N
echo "N=$N budget=${BUDGET}s"
TR="torchrun --standalone --nproc-per-node $N"

PICKS=bench/results/dispatch_planner_x$N.json
step dispatch 120 $TR bench/dispatch_gpu.py --cluster h200-runtime --out "$RES/dispatch_x$N.json" \
  --picks "$PICKS"
step layers 130 $TR bench/layers_gpu.py --cluster h200-runtime --out "$RES/layers_x$N.json"

if [ -d "$PLANS" ]; then
  for name in mixtral2l_search_best mixtral2l_megatron; do
    step "train_step_$name" 110 $TR bench/train_step.py --plan "$PLANS/$name.json" \
      --steps "$STEPS" --warmup 2 --out "$RES/train_step_$name.json"
  done
  if [ -f "$RES/train_step_mixtral2l_search_best.json" ] && \
     [ -f "$RES/train_step_mixtral2l_megatron.json" ]; then
    python3 bench/speedup_report.py --best "$RES/train_step_mixtral2l_search_best.json" \
      --baseline "$RES/train_step_mixtral2l_megatron.json" --out "$RES/speedup_x$N.json"
  fi
  python3 bench/gpu_fidelity.py --runs "$RES" --plans "$PLANS" --cluster h200-runtime \
    --name "h200_x$N/gpu_fidelity_x$N" > "$RES/fidelity.log" 2>&1
  tail -n 6 "$RES/fidelity.log"; pack
  for d in a2a ag; do
    name=mixtral2l_sp${N}_ep${N}_$d
    step "parity_$name" 200 $TR bench/parity_gpu.py --plan "$PLANS/$name.json" \
      --out "$RES/parity_$name.json"
  done
else
  echo "no plans for $N GPUs under $PLANS (python bench/make_gpu_plans.py --search writes 8 and 2)"
fi
echo "done in ${SECONDS}s"; ls -l "$RES"
