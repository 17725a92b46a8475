"""Device memory of a run: the allocator set-up, the check of a plan's predicted peak against the
device before the first step, the one-line report of an out-of-memory error, and the per-phase
peaks the memory probe records (`moeplan memory`, runtime/memory_probe.py).

The plan carries the cost model's predicted peak (``prediction.peak_memory_gib``, the caching
allocator's reserved bytes at the step's peak); the runtime never prices a plan itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plans import Plan, SpecError
from runtime.metrics import Component

GIB = 2**30

ALLOCATOR_CONF = "expandable_segments:True"
"""PyTorch's caching allocator with expandable segments: blocks of a freed size class are grown
in place instead of left as fragments, so the reserved peak stays close to the allocated peak
(the cost model's allocator reserve assumes it)."""


def configure_allocator() -> None:
    """Expandable segments unless the user set PYTORCH_CUDA_ALLOC_CONF; call before CUDA's first
    allocation."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_CONF)


class InsufficientMemory(SpecError):
    """The plan's predicted peak does not fit the device's free memory."""


def check_fits(plan: Plan, device: torch.device) -> None:
    """Refuse, before the first step, a plan whose predicted peak exceeds the device's free
    memory (CUDA only: on CPU the launcher checks host memory). A plan without a prediction
    (hand-written) is not checked."""
    if device.type != "cuda" or plan.prediction is None:
        return
    free, total = torch.cuda.mem_get_info(device)
    need = plan.prediction.peak_memory_gib * GIB
    if need > free:
        raise InsufficientMemory(
            f"prediction.peak_memory_gib: the plan needs {need / GIB:.1f} GiB per GPU, "
            f"{torch.cuda.get_device_name(device)} {device.index} has {free / GIB:.1f} GiB free "
            f"of {total / GIB:.1f} GiB (re-plan for this GPU, e.g. moeplan search with a "
            f"smaller --micro-batch or recomputation)"
        )


def out_of_memory_line(plan: Plan, device: torch.device, rank: int, step: int) -> str:
    """What a rank prints when the allocator fails: predicted and measured peaks, no traceback."""
    predicted = (f"{plan.prediction.peak_memory_gib:.1f} GiB" if plan.prediction
                 else "none (plan has no prediction)")
    measured = ""
    if device.type == "cuda":
        measured = (f", measured peak {torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB "
                    f"allocated / {torch.cuda.max_memory_reserved(device) / GIB:.1f} GiB reserved"
                    f" of {torch.cuda.get_device_properties(device).total_memory / GIB:.1f} GiB")
    return (f"error: rank {rank}: out of memory during step {step + 1}: predicted peak "
            f"{predicted}{measured}")


PHASES = (Component.forward, Component.loss, Component.backward, Component.grad_sync,
          Component.optimizer)
"""The phases of a step the memory benchmark reports a peak for (``loss`` is inside
``forward`` on the last stage; a pipeline schedule opens forward and backward once per
micro-batch and chunk)."""
_PHASE_NAMES = frozenset(p.value for p in PHASES)


@dataclass
class MemoryPhases:
    """Peak and closing allocated bytes of every phase of a step, and the step's overall peak
    allocated and reserved bytes. A ``Timers`` observer: each phase boundary reads the
    allocator's peak since the previous boundary, credits it to the phases open, and resets it
    (so a phase's peak is its own even when phases alternate, as forward and backward do in
    1F1B)."""

    device: torch.device
    peak: dict[str, int] = field(default_factory=dict)
    end: dict[str, int] = field(default_factory=dict)
    peak_allocated: int = 0
    peak_reserved: int = 0
    _open: list[str] = field(default_factory=list)

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak.clear()
        self.end.clear()
        self._open.clear()
        self.peak_allocated = self.peak_reserved = 0

    def _read(self) -> None:
        allocated = torch.cuda.max_memory_allocated(self.device)
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved(self.device))
        for name in self._open:
            self.peak[name] = max(self.peak.get(name, 0), allocated)
        torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self, name: str, entering: bool) -> None:
        if name not in _PHASE_NAMES:
            return
        torch.cuda.synchronize(self.device)
        self._read()
        if entering:
            self._open.append(name)
            return
        self._open.remove(name)
        self.end[name] = max(self.end.get(name, 0), torch.cuda.memory_allocated(self.device))

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)
        self._read()


def allocator_breakdown(device: torch.device) -> dict:
    """Where the caching allocator's reserve over the allocated bytes sits, since the last
    ``reset_peak_memory_stats``: the peaks of the allocated bytes, of the active bytes (allocated
    plus blocks freed by their owner but still waiting for another stream's event: a tensor
    ``record_stream``-ed on a stream, NCCL's among them, is reused only once that stream has
    passed the free), of the requested bytes (before rounding) and of the free bytes inside
    split blocks (fragments), all in GiB; the allocation retries (a request that found no block
    freed its cache and tried again); and each stream's reserved segments (expandable segments
    grow one segment per stream, and a block serves only its own stream's requests). Empty off
    CUDA."""
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {
        **{f"{k}_peak_gib": s.get(f"{k}_bytes.all.peak", 0) / GIB
           for k in ("allocated", "active", "requested", "reserved", "inactive_split")},
        "alloc_retries": s.get("num_alloc_retries", 0),
        "reserved_gib_by_stream": _gib_by_stream(
            _reserved_by_stream(device), torch.cuda.current_stream(device).cuda_stream),
    }


def _reserved_by_stream(device: torch.device) -> dict[int, int]:
    """Bytes of the caching allocator's segments on ``device``, per CUDA stream."""
    out: dict[int, int] = {}
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device.index) == device.index:
            out[seg["stream"]] = out.get(seg["stream"], 0) + seg["total_size"]
    return out


def _gib_by_stream(streams: dict[int, int], current: int) -> dict[str, float]:
    """GiB per stream, the training stream named ``current``."""
    return {("current" if s == current else str(s)): b / GIB for s, b in sorted(streams.items())}


def memory_timeline(run_step: Callable[[], object], device: torch.device, top: int = 12) -> dict:
    """Run ``run_step`` (one training step) with the caching allocator's history recorded and
    replay it: at the moment the reserved bytes peak, the allocated bytes, the active bytes
    (allocated plus blocks freed but waiting for another stream's event), the reserved bytes of
    each stream, and the live allocations grouped by the repository source line that made them
    (the largest ``top`` groups), all in GiB; and the step's allocated peak. The free pages are
    released first (``empty_cache``), so the step maps what it needs anew and the replay, which
    starts from the allocator's counters before the step, sees the reserved peak form. Empty
    off CUDA."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    # expandable segments keep their pages mapped: release the free ones, so the step maps
    # (and the history records) every page its peak needs
    torch.cuda.empty_cache()
    base_alloc = torch.cuda.memory_allocated(device)
    base_streams = _reserved_by_stream(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=2_000_000)
    try:
        run_step()
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return replay_history(trace, base_alloc, base_streams,
                          torch.cuda.current_stream(device).cuda_stream, top)


def replay_history(trace: list[dict], base_alloc: int, base_streams: dict[int, int],
                   current: int, top: int = 12) -> dict:
    """``memory_timeline``'s replay of an allocator history (``torch.cuda.memory._snapshot()``'s
    device trace: alloc, free_requested, free_completed, segment_alloc / segment_map,
    segment_free / segment_unmap) from ``base_alloc`` allocated bytes and ``base_streams``
    reserved bytes per stream; ``current`` names the training stream. The state kept is the one
    at the first moment the reserved bytes reach their maximum."""
    allocated = active = base_alloc
    streams = dict(base_streams)
    live: dict[int, tuple[int, str]] = {}  # blocks allocated during the step: size, source
    best = (sum(streams.values()), allocated, active, dict(streams), dict(live))
    peak_allocated = allocated
    for e in trace:
        action, size, addr = e["action"], e["size"], e["addr"]
        if action == "alloc":
            allocated += size
            active += size
            live[addr] = (size, _source_of(e.get("frames", ())))
        elif action == "free_requested":  # the owner let go; another stream may still read it
            allocated -= size
            live.pop(addr, None)
        elif action == "free_completed":
            active -= size
        elif action in ("segment_alloc", "segment_map"):
            streams[e["stream"]] = streams.get(e["stream"], 0) + size
        elif action in ("segment_free", "segment_unmap"):
            streams[e["stream"]] = streams.get(e["stream"], 0) - size
        else:
            continue
        peak_allocated = max(peak_allocated, allocated)
        if sum(streams.values()) > best[0]:
            best = (sum(streams.values()), allocated, active, dict(streams), dict(live))
    reserved, allocated, active, streams, live = best
    by_source: dict[str, int] = {}
    for size, source in live.values():
        by_source[source] = by_source.get(source, 0) + size
    return {
        "reserved_peak_gib": reserved / GIB,
        "allocated_peak_gib": peak_allocated / GIB,
        "allocated_at_peak_gib": allocated / GIB,
        "active_at_peak_gib": active / GIB,
        "reserved_at_peak_gib_by_stream": _gib_by_stream(streams, current),
        "step_allocations_live_at_peak_gib": sum(s for s, _ in live.values()) / GIB,
        "live_at_peak_gib_by_source": {k: v / GIB for k, v in sorted(
            by_source.items(), key=lambda kv: -kv[1])[:top]},
    }


REPOSITORY = Path(__file__).resolve().parent.parent
"""The checkout this runtime runs from: allocations are attributed to its source lines."""


def _source_of(frames, root: Path = REPOSITORY) -> str:
    """The innermost frame in the repository at ``root`` (``runtime/moe.py:181``), else the
    innermost frame."""
    prefix = f"{root}/"
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(prefix):
            return f"{name[len(prefix):]}:{f.get('line', 0)}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line', 0)}" if frames else "?"
