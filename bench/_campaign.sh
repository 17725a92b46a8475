# Shared set-up of the bench/*campaign*.sh device calls (sourced, not run). Results go to $RES
# and are re-packed into $OUT/results.tgz after every step, so a timeout loses nothing and the
# device tool returns one file. A whole-run budget (BUDGET s, default 540) caps each step.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# pydantic is not installed on the GPU machines: cp312 wheels carried in .whl/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; RES=${RES:-bench/results/h200}; mkdir -p "$OUT" "$RES"
BUDGET=${BUDGET:-540}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'x',
           torch.cuda.get_device_name())"

pack() { tar czf "$OUT/results.tgz" "$RES"; }

# step NAME CAP cmd...: run with timeout min(CAP, budget left), log to $RES/NAME.log, re-pack;
# a step that cannot start with 40 s left is skipped
step() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 40 ]; then echo "=== $name: skipped (${left}s left)"; return 1; fi
  local limit=$((cap < left ? cap : left))
  echo "=== $name (timeout ${limit}s, t=${SECONDS}s)"
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "exit $rc at t=${SECONDS}s"
  grep -v -e FutureWarning -e "return func" "$RES/$name.log" | tail -n 3
  pack
  return $rc
}
