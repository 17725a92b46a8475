#!/usr/bin/env bash
# Issue 11's overlap probe (one device call on nvidia-h200-x2): the MoE layer bench at EP = 2
# with NCCL's CTAs / channels capped (NCCL_MAX_CTAS, NCCL_MAX_NCHANNELS, NCCL_MAX_P2P_NCHANNELS:
# fewer SMs taken from the expert GEMMs beside which the collectives run), the inter-op
# schedule at 2 and 4 chunks, torchtitan's layer at EP = 2, and our fused layer on 1 GPU.
#   OUT=... bash bench/overlap_probe.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/out}
mkdir -p "$O"
T="torchrun --nproc-per-node 2 bench/moe_layer_gpu.py"
run() { local name=$1; shift; echo "== $name $(date +%T)"; timeout "${LIMIT:-150}" "$@" > "$O/$name.log" 2>&1; echo "rc $? $(date +%T)"; grep -E "ms|peer" "$O/$name.log" | tail -8; }
LIMIT=240 run x2_base $T --out "$O/x2_base.json"
for c in 8 16; do
  NCCL_MAX_CTAS=$c NCCL_MIN_CTAS=1 NCCL_MAX_NCHANNELS=$c NCCL_MIN_NCHANNELS=1 NCCL_MAX_P2P_NCHANNELS=$c \
    run x2_cta$c $T --no-peer --out "$O/x2_cta$c.json"
done
NCCL_MAX_CTAS=8 NCCL_MIN_CTAS=1 NCCL_MAX_NCHANNELS=8 NCCL_MIN_NCHANNELS=1 NCCL_MAX_P2P_NCHANNELS=8 \
  run x2_cta8_c4 $T --no-peer --chunks 4 --out "$O/x2_cta8_c4.json"
run x2_c4 $T --no-peer --chunks 4 --out "$O/x2_c4.json"
LIMIT=200 run x1_fused python3 bench/moe_layer_gpu.py --kernels fused --out "$O/x1_fused.json"
