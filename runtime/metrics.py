"""Per-component timers and step metrics. The components are ``plans.Component`` (the names
the cost model, the profiler, calibration and the benchmarks share; ``plans.TIMER_OF`` says
which layer operators each one times).

On CUDA a region is a pair of CUDA events on the current stream (read once per step, after a
synchronize), so timing adds no synchronisation inside the step; on CPU it is wall time.
A region measures forward work; its backward is timed as ``<component>_bwd`` by two identity
autograd nodes around the operation (``backward_from`` on its output starts the clock when the
gradient arrives, ``backward_to`` on its input stops it when the input's gradient is made).
With recomputation the recomputed forward counts again in the forward components.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.autograd import Function

from plans.operators import COMPONENT_KEYS, Component

__all__ = ["COMPONENT_KEYS", "Component", "Timers", "peak_memory_gib", "timed"]


RegionObserver = Callable[[str, bool], None]
"""Called with a region's name when it opens (True) and closes (False)."""


class Timers:
    def __init__(self, device: torch.device, observers: tuple[RegionObserver, ...] = ()):
        self.cuda = device.type == "cuda"
        self.observers = observers
        self._cpu: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[str, object] = {}

    def _notify(self, key: str, opening: bool) -> None:
        for observe in self.observers:
            observe(key, opening)

    @contextmanager
    def region(self, name: Component) -> Iterator[None]:
        self._notify(name.value, True)
        try:
            yield from self._timed(name)
        finally:
            self._notify(name.value, False)

    def _timed(self, name: Component) -> Iterator[None]:
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

    def start(self, name: Component | str) -> None:
        """Open a region closed by ``stop`` (for module hooks, which cannot hold a context)."""
        key = name if isinstance(name, str) else name.value
        self._notify(key, True)
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[key] = event
        else:
            self._open[key] = time.perf_counter()

    def backward_from(self, y: torch.Tensor, name: Component) -> torch.Tensor:
        """``y`` unchanged; its gradient's arrival starts region ``<name>_bwd``."""
        if not y.requires_grad:
            return y
        return _BackwardMark.apply(y, self, f"{name.value}_bwd", True)

    def backward_to(self, x: torch.Tensor, name: Component) -> torch.Tensor:
        """``x`` unchanged; the making of its gradient stops region ``<name>_bwd``."""
        if not x.requires_grad:
            return x
        return _BackwardMark.apply(x, self, f"{name.value}_bwd", False)

    def stop(self, name: Component | str) -> None:
        key = name if isinstance(name, str) else name.value
        began = self._open.pop(key, None)
        if began is None:  # a backward region whose start node did not run (no gradient)
            return
        self._notify(key, False)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((key, began, end))
        else:
            self._cpu[key] += time.perf_counter() - began

    def collect(self) -> dict[str, float]:
        """Seconds per component (every COMPONENT_KEYS entry) since the last collect, and
        reset."""
        out = dict.fromkeys(COMPONENT_KEYS, 0.0)
        out.update(self._cpu)
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                out[name] = out.get(name, 0.0) + start.elapsed_time(end) / 1e3
        self._cpu.clear()
        self._events.clear()
        return out


class _BackwardMark(Function):
    @staticmethod
    def forward(ctx, x, timers, key, opens):
        ctx.timers, ctx.key, ctx.opens = timers, key, opens
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (ctx.timers.start if ctx.opens else ctx.timers.stop)(ctx.key)
        return grad, None, None, None


def timed(timers: Timers | None, name: Component, fn, x: torch.Tensor, *args):
    """``fn(x, *args)`` with its forward timed as ``name`` and its backward as ``name_bwd``."""
    if timers is None:
        return fn(x, *args)
    x = timers.backward_to(x, name)
    with timers.region(name):
        y = fn(x, *args)
    return timers.backward_from(y, name)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size of the process (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss * 1024 / 2**30
