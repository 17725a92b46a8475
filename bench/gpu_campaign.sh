#!/usr/bin/env bash
# One device call: calibration, then training runs of bench/gpu_plans/*.json on 1 and 2 GPUs.
# Usage on the device machine (repo root; wheels for pydantic in .whl/): bash bench/gpu_campaign.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
NGPU=$(nvidia-smi -L | wc -l)
STEPS=${STEPS:-6}
run() {  # name nproc
  echo "=== train $1 on $2 GPU(s)"
  timeout 300 torchrun --standalone --nproc-per-node "$2" -m runtime.train \
    --plan "bench/gpu_plans/$1.json" --steps "$STEPS" --log-file "$OUT/train_$1.jsonl" \
    > "$OUT/train_$1.log" 2>&1
  echo "exit $?"; tail -n 4 "$OUT/train_$1.log"
}
if [ "${SKIP_CALIBRATION:-0}" != 1 ]; then
  timeout 300 torchrun --standalone --nproc-per-node "$NGPU" bench/calibrate_gpu.py \
    --cluster h200 --out calibration_h200 2>&1 | tail -n 45
  cp bench/results/calibration_h200.json "$OUT/" 2>/dev/null
fi
run mixtral2l_1gpu 1
if [ "$NGPU" -ge 2 ]; then
  for p in mixtral2l_sp2_ep2_a2a mixtral2l_sp2_ep2_ag mixtral2l_dp2_ep2 mixtral2l_tp2_ep2 mixtral2l_pp2; do
    run "$p" 2
  done
fi
