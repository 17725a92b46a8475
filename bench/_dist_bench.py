"""Shared pieces of the GPU benchmarks: the launch, the timing and the device released
between measurements of runtime.measure (one owner: the runtime's measurements use them too;
the scripts import them from here), and a step's time fields. Imports torch, plans and
the runtime (never cost_models or planner)."""

from __future__ import annotations

from plans import Plan
from plans.specs import mfu
from runtime.measure import (  # noqa: F401
    device_timed,
    finish,
    init,
    release,
    slowest,
    spun,
    timed,
)


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
