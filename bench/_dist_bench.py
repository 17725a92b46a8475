"""Shared pieces of the GPU benchmarks: the launch and the timing of runtime.measure (one
owner: `moeplan sweep` times with them too; the scripts import them from here), a step's time
fields, and raw collectives of the sizes the cost model's Transfers name. Imports torch, plans
and cost_models (never planner)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
import torch.distributed as dist

from cost_models.compute import ACT_BYTES
from cost_models.volumes import Collective, Transfer
from plans import Plan
from plans.specs import mfu
from runtime.measure import device_timed, finish, init, slowest, spun, timed  # noqa: F401
from runtime.parallel.comm import all_gather_into, reduce_scatter_into


def release(device: torch.device) -> None:
    """Give the device back what dropped models left (autograd hooks keep reference cycles:
    collected first), its peak statistics reset for the next measurement."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def step_times(warm: list[float], times: list[float], plan: Plan, world: int) -> dict:
    """A training step's time fields of a result: the warm-up steps (the first step apart),
    the mean and median of the timed ones, tokens per second and MFU (plans.specs.mfu) of
    ``plan``'s job on ``world`` GPUs."""
    t = plan.training
    mean = sum(times) / len(times)
    return {"warmup_step_times_s": warm, "first_step_s": (warm or times)[0],
            "step_time_s": mean, "step_times_s": times,
            "step_median_s": sorted(times)[len(times) // 2],
            "tokens_per_s": t.tokens_per_step / mean,
            "mfu": mfu(plan.model, t.seq_len, t.tokens_per_step, mean, world, plan.cluster.gpu)}


def elements(transfer: Transfer, n: int) -> int:
    """Elements of one buffer of ``transfer`` (ACT_BYTES each), rounded up to a multiple of n."""
    count = int(round(transfer.buffer_bytes / ACT_BYTES))
    return -(-count // n) * n


def collective_fn(transfer: Transfer, device: torch.device, dtype: torch.dtype
                  ) -> Callable[[], object]:
    """The collective ``transfer`` describes over the default group, with its buffer sizes:
    one rank's send buffer for all-to-all, the full gathered buffer for all-gather and
    reduce-scatter. (On CPU the buffers are fp32, twice the bytes the cost model counts.)"""
    n = dist.get_world_size()
    count = elements(transfer, n)
    full = torch.randn(count, device=device, dtype=dtype)
    shard = torch.randn(count // n, device=device, dtype=dtype)
    match transfer.collective:
        case Collective.all_to_all:
            out = torch.empty_like(full)
            return lambda: dist.all_to_all_single(out, full)
        case Collective.all_gather:
            return lambda: all_gather_into(full, shard)
        case Collective.reduce_scatter:
            return lambda: reduce_scatter_into(shard, full)
    raise ValueError(f"no timing for {transfer.collective}")
