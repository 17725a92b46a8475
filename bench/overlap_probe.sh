#!/usr/bin/env bash
# Issue 11's overlap probe (one device call on nvidia-h200-x2): the MoE layer bench at EP = 2,
# the inter-op step traced (each stream's busy time, the time streams ran side by side).
#   OUT=... bash bench/overlap_probe.sh   (committed: bench/results/h200/moe_layer/overlap_probes)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
O=${OUT:-/tmp/out}
mkdir -p "$O"
T="torchrun --nproc-per-node 2 -m bench.layers.moe_layer_gpu --no-peer"
run() { local name=$1; shift; echo "== $name $(date +%T)"; timeout "${LIMIT:-150}" "$@" > "$O/$name.log" 2>&1; echo "rc $? $(date +%T)"; grep -E " ms|trace" "$O/$name.log" | tail -12; }
run x2_trace $T --trace --out "$O/x2_trace.json"
