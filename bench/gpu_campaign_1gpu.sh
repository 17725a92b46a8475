#!/usr/bin/env bash
# One device call on one H200: bench/train_step.py for the 1-GPU plans (bench/gpu_plans/
# mixtral2l_1gpu*.json, or those named in TRAIN), then the bf16 parity check of 2-rank layouts
# with both ranks on the one GPU over gloo (--share-gpu: the layouts' numerics on the GPU
# kernels; NCCL on two GPUs is bench/gpu_campaign2.sh's), for the plans named in PARITY;
# bench/profile_step.py for the 1-GPU plans named in PROFILE (none by default).
# Results go to bench/results/h200 and are re-packed into $OUT/results.tgz after every run, so
# a timeout loses nothing. A whole-run budget (BUDGET s, default 540) caps each run's timeout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; RES=bench/results/h200; mkdir -p "$OUT" "$RES"
BUDGET=${BUDGET:-540}
TRAIN=${TRAIN:-$(ls bench/gpu_plans/mixtral2l_1gpu*.json | xargs -n1 basename | sed 's/.json$//')}
PARITY=${PARITY:-mixtral2l_sp2_ep2_a2a mixtral2l_tp2_etp2}
pack() { tar czf "$OUT/results.tgz" "$RES"; }
step() {  # step NAME CAP cmd...: timeout min(CAP, budget left), log to $RES/NAME.log
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 40 ]; then echo "=== $name: skipped (${left}s left)"; return 1; fi
  local limit=$((cap < left ? cap : left))
  echo "=== $name (timeout ${limit}s, t=${SECONDS}s)"
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1
  echo "exit $? at t=${SECONDS}s"; grep -v -e FutureWarning -e "return func" "$RES/$name.log" | tail -n 3
  pack
}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for name in $TRAIN; do
  step "train_step_$name" 150 python3 bench/train_step.py --plan "bench/gpu_plans/$name.json" \
    --steps "${STEPS:-5}" --warmup 2 --out "$RES/train_step_$name.json"
done
for name in ${PROFILE:-}; do
  step "profile_$name" 120 python3 bench/profile_step.py --plan "bench/gpu_plans/$name.json" \
    --out "$RES/profile_$name.json"
done
for name in $PARITY; do
  step "parity_shared_$name" 200 torchrun --standalone --nproc-per-node 2 bench/parity_gpu.py \
    --share-gpu --plan "bench/gpu_plans/$name.json" --out "$RES/parity_shared_$name.json"
done
