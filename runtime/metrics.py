"""Per-component timers and step metrics.

On CUDA a region is a pair of CUDA events on the current stream (read once per step, after a
synchronize), so timing adds no synchronisation inside the step; on CPU it is wall time.
Regions measure forward-pass work only (backward runs inside autograd).
"""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import torch


class Component(StrEnum):
    attention_comm = "attention_comm"
    attention_core = "attention_core"
    dispatch = "dispatch"
    expert_compute = "expert_compute"
    combine = "combine"
    pipeline_comm = "pipeline_comm"
    forward = "forward"
    """Forward compute of the pipeline schedule (includes the forward regions above)."""
    backward = "backward"
    """Backward of the pipeline schedule (includes the ``_bwd`` regions)."""
    forward_backward = "forward_backward"
    grad_sync = "grad_sync"
    optimizer = "optimizer"


class Timers:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._cpu: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[str, object] = {}

    @contextmanager
    def region(self, name: Component) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name.value, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._cpu[name.value] += time.perf_counter() - t0

    def start(self, name: Component) -> None:
        """Open a region closed by ``stop`` (for module hooks, which cannot hold a context)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[name.value] = event
        else:
            self._open[name.value] = time.perf_counter()

    def stop(self, name: Component) -> None:
        began = self._open.pop(name.value)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((name.value, began, end))
        else:
            self._cpu[name.value] += time.perf_counter() - began

    def collect(self) -> dict[str, float]:
        """Seconds per component since the last collect, and reset."""
        out = dict(self._cpu)
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._cpu.clear()
        self._events.clear()
        return out


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size of the process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss * 1024 / 2**30
