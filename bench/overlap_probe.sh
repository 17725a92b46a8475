#!/usr/bin/env bash
# Issue 11's overlap probe (one device call on nvidia-h200-x2): the MoE layer bench at EP = 2
# with the GEMMs leaving SMs free (torch's SM carve-out) and NCCL's CTAs capped to them
# (NCCL_MAX_CTAS, NCCL_MAX_NCHANNELS, NCCL_MAX_P2P_NCHANNELS), at 2 and 4 chunks.
#   OUT=... bash bench/overlap_probe.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/out}
mkdir -p "$O"
T="torchrun --nproc-per-node 2 bench/moe_layer_gpu.py --no-peer"
run() { local name=$1; shift; echo "== $name $(date +%T)"; timeout "${LIMIT:-150}" "$@" > "$O/$name.log" 2>&1; echo "rc $? $(date +%T)"; grep -E " ms" "$O/$name.log" | tail -8; }
capped() { local c=$1; shift; NCCL_MAX_CTAS=$c NCCL_MIN_CTAS=1 NCCL_MAX_NCHANNELS=$c NCCL_MIN_NCHANNELS=1 NCCL_MAX_P2P_NCHANNELS=$c "$@"; }
for c in ${CARVEOUTS:-8 16 24}; do
  capped $c run x2_carve$c $T --sm-carveout $c --out "$O/x2_carve$c.json"
done
run x2_carve16_free $T --sm-carveout 16 --out "$O/x2_carve16_free.json"
capped 16 run x2_carve16_c4 $T --sm-carveout 16 --chunks 4 --out "$O/x2_carve16_c4.json"
