#!/usr/bin/env bash
# One device call on a node of N GPUs (N = `nvidia-smi -L` count; plans exist for 8 and 2):
#   1. bench/dispatch_gpu.py   EP dispatchers vs top-k 1..8, with the planner's picks merged
#   2. bench/layers_gpu.py     Ulysses SP vs TP attention, EP vs expert-TP FFN blocks
#   3. bench/train_step.py     moeplan search's plan and the Megatron baseline (bench/gpu_plans/xN),
#                              then bench/speedup_report.py and bench/gpu_fidelity.py
#   4. bench/parity_gpu.py     SP = EP = N with each dispatcher against the one-GPU reference
# Each result lands in $OUT as soon as it exists; logs are files in $OUT (their ends printed).
# A whole-run budget (BUDGET seconds, default 530) caps every step's timeout; a step that cannot
# start with at least 30 s left is skipped. Usage (repo root, pydantic wheels in .whl/):
#   bash bench/x8_campaign.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-530}
STEPS=${STEPS:-5}
N=$(nvidia-smi -L | wc -l)
PLANS=bench/gpu_plans/x$N
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n 1
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
echo "N=$N budget=${BUDGET}s"

# step NAME CAP cmd...: run with timeout min(CAP, budget left), log to $OUT/NAME.log
step() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 30 ]; then echo "=== $name: skipped (${left}s of budget left)"; return 1; fi
  local limit=$((cap < left ? cap : left))
  echo "=== $name (timeout ${limit}s, t=${SECONDS}s)"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "exit $rc after $((SECONDS))s"
  grep -v -e "FutureWarning" -e "return func" "$OUT/$name.log" | tail -n 12
  return $rc
}
TR="torchrun --standalone --nproc-per-node $N"

PICKS=bench/results/dispatch_planner_x$N.json
step dispatch 120 $TR bench/dispatch_gpu.py --out "$OUT/dispatch_x$N.json" --picks "$PICKS"
step layers 130 $TR bench/layers_gpu.py --out "$OUT/layers_x$N.json"

if [ -d "$PLANS" ]; then
  for name in mixtral2l_search_best mixtral2l_megatron; do
    step "train_step_$name" 110 $TR bench/train_step.py --plan "$PLANS/$name.json" \
      --steps "$STEPS" --warmup 2 --out "$OUT/train_step_$name.json"
  done
  if [ -f "$OUT/train_step_mixtral2l_search_best.json" ] && \
     [ -f "$OUT/train_step_mixtral2l_megatron.json" ]; then
    python3 bench/speedup_report.py --best "$OUT/train_step_mixtral2l_search_best.json" \
      --baseline "$OUT/train_step_mixtral2l_megatron.json" --out "$OUT/speedup_x$N.json"
  fi
  python3 bench/gpu_fidelity.py --runs "$OUT" --plans "$PLANS" --name "gpu_fidelity_x$N" \
    > "$OUT/fidelity.log" 2>&1 && cp "bench/results/gpu_fidelity_x$N.json" "$OUT/"
  tail -n 6 "$OUT/fidelity.log"
  for d in a2a ag; do
    name=mixtral2l_sp${N}_ep${N}_$d
    step "parity_$name" 150 $TR bench/parity_gpu.py --plan "$PLANS/$name.json" \
      --out "$OUT/parity_$name.json"
  done
else
  echo "no plans for $N GPUs under $PLANS (python bench/make_gpu_plans.py --search writes 8 and 2)"
fi
echo "done in ${SECONDS}s"; ls -l "$OUT"
