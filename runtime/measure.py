"""Measuring calls on a launch's devices: a plan checked against the launch (``check_plan``,
``launch_plan``), the launch joined (``init``, ``finish``), the device released between
measurements (``release``), one call timed on an idle GPU (``timed``) and its kernels timed
with the host ahead (``device_timed``, ``spun``), the slowest rank's value (``slowest``).
Medians after warm-up: CUDA events on GPU, wall clock on CPU; the result written with its
metadata (``write_measurement``). `moeplan sweep` (runtime/sweep.py), `moeplan overlap`
(runtime/beside.py), `moeplan dispatch` (runtime/dispatch_sweep.py), `moeplan parity`
(runtime/parity.py), `moeplan memory` (runtime/memory_probe.py) and bench/'s scripts measure
with these."""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plans import Plan, SpecError
from plans.catalog import load_plan
from plans.execution import UnsupportedFeature
from plans.io import check_destination, write_atomic
from runtime.parallel.mesh import end_process_groups, start_process_group
from runtime.parallel.parallelize import check_supported, launch_backend
from runtime.provenance import metadata

EXIT_BAD_INPUT = 2


def refuse(message: str) -> int:
    """``error: message`` on stderr from rank 0 (one line a launch); the bad-input status."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def check_plan(plan_path: Path, world: int, local_rank: int, share_gpu: bool = False) -> Plan:
    """The plan, or SpecError / UnsupportedFeature / ValueError saying why it cannot run in a
    launch of ``world`` processes (``share_gpu``: see ``init``)."""
    cuda = torch.cuda.is_available()
    plan = load_plan(plan_path)
    check_supported(plan, launch_backend())
    if plan.degrees.world != world:
        raise SpecError(f"degrees: plan needs {plan.degrees.world} processes, launched with "
                        f"WORLD_SIZE={world}")
    if share_gpu and cuda and plan.degrees.pp > 1:
        raise SpecError("degrees.pp: --share-gpu runs over gloo, which cannot send CUDA "
                        "tensors between pipeline stages; use one GPU per rank")
    if cuda and not share_gpu and local_rank >= torch.cuda.device_count():
        raise SpecError(f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} GPU(s) "
                        f"are visible (one rank per GPU; --share-gpu to check numerics)")
    return plan


def launch_plan(plan_path: Path, out: Path, force: bool, share_gpu: bool = False) -> Plan | None:
    """The plan of this launch (``check_plan``), ``out`` checked before any work; None after
    ``refuse`` said why not."""
    try:
        plan = check_plan(plan_path, int(os.environ.get("WORLD_SIZE", 1)),
                          int(os.environ.get("LOCAL_RANK", 0)), share_gpu)
        check_destination(out, "--out", force)
    except (SpecError, UnsupportedFeature, ValueError) as e:
        refuse(str(e))
        return None
    return plan


def write_measurement(out: Path, doc: dict, force: bool, summary: str,
                      indent: int = 2) -> int:
    """``doc`` after the metadata every result carries (runtime.provenance), written to ``out``
    in one step (plans.io), then ``summary`` printed: 0, or EXIT_BAD_INPUT after ``refuse``
    said why not."""
    try:
        write_atomic(out, json.dumps({**metadata(), **doc}, indent=indent) + "\n", "--out",
                     force)
    except SpecError as e:
        return refuse(str(e))
    print(summary)
    return 0


def init(timeout: timedelta = timedelta(minutes=5), share_gpu: bool = False
         ) -> tuple[int, int, torch.device, torch.dtype]:
    """(rank, world, device, dtype), the process group joined as runtime.train joins it: NCCL,
    bf16 and one GPU a rank on CUDA, gloo and fp32 on CPU; its collectives wait ``timeout``
    for a late peer. ``share_gpu``: the ranks share the visible GPUs round-robin over gloo
    (CUDA tensors staged through host memory, which NCCL refuses): each rank's memory and
    numerics, never the layout's speed."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local % torch.cuda.device_count() if share_gpu else local)
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    if world > 1 and share_gpu:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    elif world > 1:
        start_process_group(rank, world, device, timeout)
    return rank, world, device, dtype


def finish(world: int) -> None:
    if world > 1:
        end_process_groups()


def release(device: torch.device) -> None:
    """Give the device back what dropped models left (autograd hooks keep reference cycles:
    collected first), its peak statistics reset for the next measurement."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def slowest(value: float, device: torch.device) -> float:
    """The maximum of ``value`` over ranks (a step waits for its slowest rank)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
          barrier: bool = True) -> float:
    """Median seconds of ``fn`` on this rank after ``warmup`` calls. With ``barrier`` ranks line
    up before each repeat, so a collective's time does not include waiting for a late peer
    (without: kernels each rank times alone)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if barrier and dist.is_initialized():
            dist.barrier()
        _sync(device)
        if device.type == "cuda":
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
                 ) -> float:
    """Median seconds of ``fn``'s kernels with the host ahead of the GPU: a spin kernel
    (``torch.cuda._sleep``) holds the GPU while the host queues ``fn``, so the timed span holds
    the kernels and the gaps between them and none of the host's dispatch, as in a step whose
    host runs ahead. ``timed`` times one call on an idle GPU, dispatch included. On CPU the two
    are the same."""
    return spun(fn, device, warmup, repeats)[0]


def spun(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int
         ) -> tuple[float, float]:
    """(device, host) medians of ``fn`` behind a spin kernel that lasts twice the host's time
    for one call (measured first): the GPU's span from the spin's end to ``fn``'s last kernel,
    and the host's time to issue ``fn``. On CPU both are the wall time."""
    if device.type != "cuda":
        wall = timed(fn, device, warmup, repeats, barrier=False)
        return wall, wall
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    host_s = time.perf_counter() - t0  # an upper bound of the dispatch: it waits for nothing
    _sync(device)
    spin = _spin_cycles_per_s(device) * (2 * host_s + 50e-6)
    device_times, host_times = [], []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(spin))
        a.record()
        t0 = time.perf_counter()
        fn()
        host_times.append(time.perf_counter() - t0)
        b.record()
        b.synchronize()
        device_times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(device_times), statistics.median(host_times)


def _spin_cycles_per_s(device: torch.device) -> float:
    """Clock cycles per second of ``torch.cuda._sleep``'s spin, timed once."""
    cycles = 10_000_000
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    return cycles / (a.elapsed_time(b) / 1e3)
