#!/usr/bin/env bash
# One device call on 2 H200s (NCCL): the bf16 parity check of the 2-GPU layouts named in
# PARITY against the one-GPU references (bf16 and fp32), then bench/train_step.py for the
# 2-GPU plans named in TRAIN (default: every 2-GPU plan in bench/gpu_plans). Results go to
# bench/results/h200 and are re-packed into $OUT/results.tgz after every run, so a timeout
# loses nothing. A whole-run budget (BUDGET s, default 540) caps each run's timeout.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; RES=bench/results/h200; mkdir -p "$OUT" "$RES"
BUDGET=${BUDGET:-540}
gpus() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['cluster']['gpus'])" "$1"; }
PARITY=${PARITY-mixtral2l_sp2_ep2_a2a mixtral2l_tp2_etp2 mixtral2l_sp2_ep2_ag mixtral4l_pp2_vpp2}
if [ -z "${TRAIN+x}" ]; then
  TRAIN=$(for p in bench/gpu_plans/*.json; do [ "$(gpus "$p")" = 2 ] && basename "$p" .json; done)
fi
pack() { tar czf "$OUT/results.tgz" "$RES"; }
step() {  # step NAME CAP cmd...: timeout min(CAP, budget left), log to $RES/NAME.log
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 40 ]; then echo "=== $name: skipped (${left}s left)"; return 1; fi
  local limit=$((cap < left ? cap : left))
  echo "=== $name (timeout ${limit}s, t=${SECONDS}s)"
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1
  echo "exit $? at t=${SECONDS}s"; grep -v -e FutureWarning -e "return func" "$RES/$name.log" | tail -n 2
  pack
}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
TR="torchrun --standalone --nproc-per-node 2"
for name in $PARITY; do
  step "parity_$name" 200 $TR bench/parity_gpu.py --plan "bench/gpu_plans/$name.json" \
    --out "$RES/parity_$name.json"
done
for name in $TRAIN; do
  step "train_step_$name" 120 $TR bench/train_step.py --plan "bench/gpu_plans/$name.json" \
    --steps "${STEPS:-5}" --warmup 2 --out "$RES/train_step_$name.json"
done
