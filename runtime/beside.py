"""Does communication beside the expert GEMMs hide its time? What `moeplan calibrate --overlap`
fits the share of hidden communication (efficiency.overlap) from.

    moeplan overlap --out beside.json
    (or: torchrun --standalone --nproc-per-node 2 -m runtime.beside --out beside.json)

Per MoE shape at EP = 2: the experts' forward grouped GEMMs on the compute stream, and the
dispatch volume (the half of the routed rows that go to the peer) moved

- by NCCL (`all_to_all_single`, the runtime's dispatcher) on a communication stream, and
- by a peer copy into the peer's receive buffer, opened here through CUDA IPC (`copy_` across
  two GPUs is one `cudaMemcpyPeerAsync`, which a copy engine carries over NVLink) on a copy
  stream (a copy engine leaves the SMs to compute; calibration does not read it),

each alone and each beside the GEMMs. Overlap ratio = both together / max(each alone): 1.0 is
perfect overlap, (a + b) / max(a, b) is none. A profiler pass records which device activity
the peer copy ran as (a memcpy, not a kernel, is what keeps SMs free). Times: runtime.measure,
the slowest rank's.

On CPU (gloo) only the NCCL-shaped path exists: the copy-engine rows say `unavailable`.
``--smoke`` runs the shapes scaled down (a CPU check). Bad input: one line naming the field,
exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from plans import SpecError
from plans.io import check_destination
from runtime.measure import EXIT_BAD_INPUT, finish, init, slowest, timed, write_measurement
from runtime.moe import grouped_mm

SMOKE_SCALE = 0.02
"""--smoke: tokens and widths times this, one warm-up call and one timed repeat."""


@dataclass(frozen=True)
class Shape:
    """One MoE layer at EP = 2: tokens per rank, top-k, model and expert widths, experts."""

    name: str
    tokens: int
    top_k: int
    hidden: int
    ffn: int
    experts: int

    def scaled(self, f: float) -> Shape:
        """A smaller copy (CPU smoke runs): token count and widths times ``f``."""
        return Shape(self.name, max(8, int(self.tokens * f)), self.top_k,
                     max(8, int(self.hidden * f)), max(8, int(self.ffn * f)), self.experts)


SHAPES = (Shape("mixtral-8x7b", 16384, 2, 4096, 14336, 8),
          Shape("qwen3-30b-a3b", 16384, 8, 2048, 768, 128))


def expert_forward(shape: Shape, device: torch.device, dtype: torch.dtype):
    """The local experts' forward grouped GEMMs on this rank's routed rows (balanced)."""
    local = shape.experts // 2
    rows = shape.tokens * shape.top_k
    x = torch.randn(rows, shape.hidden, device=device, dtype=dtype)
    w13 = torch.randn(local, 2 * shape.ffn, shape.hidden, device=device, dtype=dtype) * 0.02
    w2 = torch.randn(local, shape.hidden, shape.ffn, device=device, dtype=dtype) * 0.02
    counts = torch.full((local,), rows // local, device=device, dtype=torch.int64)
    counts[-1] += rows - int(counts.sum())

    def run():
        h = grouped_mm(x, w13, counts)
        return grouped_mm(h[:, : shape.ffn].contiguous(), w2, counts)
    return run


def peer_copy(n: int, device: torch.device, dtype: torch.dtype):
    """A copy of n elements into the peer's receive buffer, or the reason there is none here.
    The peer's buffer is opened in this process through CUDA IPC (torch.multiprocessing's
    reduce_tensor, the handle exchanged over the process group), so the copy is a
    cudaMemcpyPeerAsync from this GPU to the peer's, which a copy engine carries over NVLink."""
    if device.type != "cuda":
        return None, "no CUDA IPC on CPU"
    from torch.multiprocessing.reductions import reduce_tensor

    recv = torch.empty(n, device=device, dtype=dtype)
    handles: list = [None] * dist.get_world_size()
    dist.all_gather_object(handles, reduce_tensor(recv))
    rebuild, args = handles[1 - dist.get_rank()]
    try:
        peer = rebuild(*args)
    except Exception as e:  # the mechanism is what is measured: record why it is missing
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    src = torch.randn(n, device=device, dtype=dtype)

    def copy():
        peer.copy_(src, non_blocking=True)
        # this rank's receive buffer, which the peer writes into, lives as long as the copy
        return recv
    return copy, None


def peer_access(device: torch.device) -> dict:
    """Whether CUDA lets this GPU address the peer's memory directly (cudaDeviceCanAccessPeer):
    without it a copy across GPUs is staged through host memory, while NCCL may still reach
    the peer its own way."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return {"visible_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
                "can_access_peer": None}
    peer = 1 - device.index if device.index in (0, 1) else 0
    return {"visible_gpus": torch.cuda.device_count(),
            "can_access_peer": torch.cuda.can_device_access_peer(device.index, peer)}


def beside(compute, comm, stream: torch.cuda.Stream | None):
    """compute on the current stream, comm on ``stream`` started at the same point; the
    current stream waits for both."""
    if stream is None:  # CPU: no streams; serial is what it can do
        return lambda: (comm(), compute())

    def run():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            comm()
        out = compute()
        torch.cuda.current_stream().wait_stream(stream)
        return out
    return run


def device_activity(fn, device: torch.device) -> dict[str, float]:
    """Device time per activity name of one call of ``fn`` (a memcpy or a kernel)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            out[e.name[:80]] = out.get(e.name[:80], 0.0) + e.device_time_total / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:5])


def measure(shape: Shape, device, dtype, warmup: int, repeats: int) -> dict:
    compute = expert_forward(shape, device, dtype)
    # EP = 2, balanced routing: half the routed rows go to the peer
    half = shape.tokens * shape.top_k // 2 * shape.hidden
    send = torch.randn(2 * half, device=device, dtype=dtype)
    recv = torch.empty_like(send)

    def nccl():
        dist.all_to_all_single(recv, send)
    copy, missing = peer_copy(half, device, dtype)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def t(fn):
        return slowest(timed(fn, device, warmup, repeats), device)
    row: dict = {"shape": shape.__dict__, "bytes_to_peer": half * send.element_size()}
    row["compute_s"] = c = t(compute)
    row["nccl_s"] = n = t(nccl)
    row["nccl_beside_compute_s"] = nb = t(beside(compute, nccl, stream))
    row["nccl_overlap_ratio"] = nb / max(c, n)
    if copy is None:
        row["copy_engine"] = {"status": "unavailable", "reason": missing}
        return row
    try:
        ce = t(copy)
        ceb = t(beside(compute, copy, stream))
    except torch.AcceleratorError as e:
        row["copy_engine"] = {"status": "failed",
                              "reason": f"CUDA: {str(e).splitlines()[0][:200]}"}
        return row
    row["copy_engine"] = {"status": "ok", "copy_s": ce, "copy_beside_compute_s": ceb,
                          "overlap_ratio": ceb / max(c, ce),
                          "gbps": half * send.element_size() / ce / 1e9,
                          "device_activity_s": device_activity(copy, device)}
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.beside",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the measurement's JSON")
    p.add_argument("--smoke", action="store_true", help="shapes scaled down (a CPU check)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    scale, warmup, repeats = (SMOKE_SCALE, 1, 1) if args.smoke else (1.0, 3, 10)
    rank = int(os.environ.get("RANK", 0))
    try:
        if int(os.environ.get("WORLD_SIZE", 1)) != 2:
            raise SpecError("WORLD_SIZE: this benchmark runs on exactly 2 ranks")
        check_destination(args.out, "--out", args.force)
    except SpecError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    rank, world, device, dtype = init()
    rows = [measure(s.scaled(scale), device, dtype, warmup, repeats) for s in SHAPES]
    backend = dist.get_backend()
    finish(world)
    if rank != 0:
        return 0
    doc = {"benchmark": "copy-engine peer copy vs NCCL beside expert GEMMs", "world": world,
           "backend": backend, "dtype": str(dtype), "peer_access": peer_access(device),
           "rows": rows}
    for r in rows:
        ce = r["copy_engine"]
        ce_text = (f"copy {ce['copy_s'] * 1e3:.2f} ms, beside "
                   f"{ce['copy_beside_compute_s'] * 1e3:.2f} (ratio "
                   f"{ce['overlap_ratio']:.2f})" if ce["status"] == "ok"
                   else f"copy engine {ce['status']}")
        print(f"{r['shape']['name']}: compute {r['compute_s'] * 1e3:.2f} ms, nccl "
              f"{r['nccl_s'] * 1e3:.2f}, beside {r['nccl_beside_compute_s'] * 1e3:.2f} "
              f"(ratio {r['nccl_overlap_ratio']:.2f}); {ce_text}", flush=True)
    return write_measurement(args.out, doc, args.force, f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
