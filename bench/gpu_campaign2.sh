#!/usr/bin/env bash
# One device call on 2 H200s: bench/train_step.py for every plan in bench/gpu_plans and the bf16
# parity check of the 2-GPU layouts against the 1-GPU reference. Results land in $OUT/results.tgz.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results/h200
STEPS=${STEPS:-5}
for plan in bench/gpu_plans/*.json; do
  name=$(basename "$plan" .json)
  n=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['cluster']['gpus'])" "$plan")
  echo "=== train_step $name ($n GPU)"
  timeout 80 torchrun --standalone --nproc-per-node "$n" bench/train_step.py --plan "$plan" \
    --steps "$STEPS" --warmup 2 --out "bench/results/h200/train_step_$name.json" \
    > "bench/results/h200/train_step_$name.log" 2>&1
  echo "exit $?"; tail -n 2 "bench/results/h200/train_step_$name.log"
done
for name in mixtral2l_sp2_ep2_a2a mixtral2l_sp2_ep2_ag mixtral2l_tp2_etp2 mixtral4l_pp2_vpp2; do
  echo "=== parity $name"
  timeout 100 torchrun --standalone --nproc-per-node 2 bench/parity_gpu.py \
    --plan "bench/gpu_plans/$name.json" --out "bench/results/h200/parity_$name.json" \
    > "bench/results/h200/parity_$name.log" 2>&1
  echo "exit $?"; tail -n 3 "bench/results/h200/parity_$name.log"
done
tar czf "$OUT/results.tgz" bench/results/h200
