"""A plan's training step probed for device memory: its peak, per phase and per module.

    moeplan memory PLAN --out memory.json
    (or: torchrun --standalone --nproc-per-node N -m runtime.memory_probe --plan PLAN
    --out memory.json, N the plan's GPU count)

Builds the runtime's trainer for the plan, runs one warm-up step (the optimizer states and the
allocator's pools exist after it), then one probed step that records per rank

- the resident bytes at the step's start (parameters, main gradients, optimizer states) and the
  trainer's own count of them (``state_bytes``);
- per phase (forward, loss, backward, grad_sync, optimizer; ``runtime.memory.MemoryPhases``)
  the peak allocated bytes while the phase was open and the allocated bytes when it closed;
- the step's peak allocated and peak reserved bytes (the caching allocator's pools: what the
  device must hold);
- bytes each module keeps after its forward of the first micro-batch (allocated after minus
  before: the activations it saves for backward plus its output), per layer and operator.

A step that runs out of memory is recorded as such, with the allocator's numbers at the
failure. Rank 0 writes JSON (every rank's numbers inside) with metadata (GPU, torch, commit,
date); ``document`` is its shape, which bench/memory/memory_suite.py writes for each of its
cases too. Measurements only: the cost model's prediction is not computed here. CUDA only (the
allocator's counters); bad input: one line naming the field, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from runtime.memory import GIB, MemoryPhases, configure_allocator

configure_allocator()  # as the runtime's launch does (runtime.train), before CUDA allocates

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from plans import Plan  # noqa: E402
from plans.execution import record  # noqa: E402
from runtime.data import SyntheticTokens  # noqa: E402
from runtime.measure import (  # noqa: E402
    EXIT_BAD_INPUT,
    finish,
    init,
    launch_plan,
    refuse,
    release,
    write_measurement,
)
from runtime.parallel.parallelize import backend_of  # noqa: E402
from runtime.trainer import build_trainer  # noqa: E402


def module_probes(model: torch.nn.Module, device: torch.device, armed: list[bool]) -> dict:
    """Forward hooks recording, while ``armed[0]``, the allocated bytes each module leaves behind
    (after minus before its forward), keyed by the module's path; the first call of each module
    only (the first micro-batch's forward, not the recomputed one)."""
    kept: dict[str, int] = {}
    before: dict[str, int] = {}
    named = {
        name: m for name, m in model.named_modules()
        if name and name.split(".")[-1] in {
            "attention_norm", "attention", "core", "ffn_norm", "moe", "feed_forward", "router",
            "experts", "shared", "norm", "output", "tok_embeddings",
        } or (name.startswith("layers.") and name.count(".") == 1)
    }

    def pre(name):
        def hook(_module, _inputs):
            if armed[0] and name not in kept:
                before[name] = torch.cuda.memory_allocated(device)
        return hook

    def post(name):
        def hook(_module, _inputs, _output):
            if armed[0] and name in before and name not in kept:
                kept[name] = torch.cuda.memory_allocated(device) - before.pop(name)
        return hook

    handles = []
    for name, m in named.items():
        handles.append(m.register_forward_pre_hook(pre(name)))
        handles.append(m.register_forward_hook(post(name)))
    return {"kept": kept, "handles": handles}


def probe_step(name: str, plan: Plan, rank: int, world: int, device: torch.device,
               seed: int) -> dict:
    """This rank's numbers of ``plan``'s probed step (see the module docstring), its trainer
    dropped and the device released afterwards."""
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, seed)
    out: dict = {"case": name, "plan_summary": plan.summary(),
                 "plan": plan.model_dump(mode="json")}
    trainer = None
    t0 = time.perf_counter()
    try:
        trainer = build_trainer(plan, rank, world, device, seed, data)
        out["build_s"] = time.perf_counter() - t0
        trainer.train_step(0)  # warm-up: optimizer pools, NCCL buffers, kernels
        phases = MemoryPhases(device)
        armed = [True]
        probes = module_probes(trainer.model, device, armed)
        trainer.timers.observers = (phases,)
        torch.cuda.synchronize(device)
        resident = torch.cuda.memory_allocated(device)
        phases.start()
        trainer.forward_backward(1)
        armed[0] = False
        trainer.sync_gradients()
        trainer.optimizer_step()
        phases.finish()
        for h in probes["handles"]:
            h.remove()
        out.update(
            status="ok",
            resident_bytes=resident,
            state_bytes=trainer.state_bytes(),
            peak_allocated_bytes=phases.peak_allocated,
            peak_reserved_bytes=phases.peak_reserved,
            phase_peak_bytes=dict(phases.peak),
            phase_end_bytes=dict(phases.end),
            module_kept_bytes=probes["kept"],
        )
    except torch.OutOfMemoryError as e:
        out.update(status="oom", error=str(e).splitlines()[0][:300],
                   peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved(device))
    out["device_total_bytes"] = torch.cuda.get_device_properties(device).total_memory
    out["run_s"] = time.perf_counter() - t0
    if trainer is not None:
        # its gradient-sync hooks on the parameters keep the optimizer and its buffers alive
        trainer.close()
    del trainer
    release(device)
    return out


def document(name: str, plan: Plan, result: dict, rank: int, world: int,
             device: torch.device) -> dict | None:
    """The result of ``name``'s probed step (``probe_step``'s ``result`` on every rank)
    gathered on rank 0: the allocator's settings, the plan, the runtime's deviations from it
    and every rank's numbers; None on the other ranks."""
    ranks = [result]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, result)
    if rank != 0:
        return None
    return {"allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "world": world, "case": name, "plan_summary": result["plan_summary"],
            "plan": result["plan"],
            "deviations": record(plan, backend_of(device)),
            "ranks": [{k: v for k, v in r.items() if k not in ("plan", "plan_summary")}
                      for r in ranks]}


def line(doc: dict) -> str:
    """One line of a probed step: its status and the peaks of its busiest rank."""
    ranks = doc["ranks"]
    peak = max(r["peak_reserved_bytes"] for r in ranks) / GIB
    alloc = max(r["peak_allocated_bytes"] for r in ranks) / GIB
    return (f"{doc['case']}: {ranks[0]['status']} peak {alloc:.2f} GiB allocated, "
            f"{peak:.2f} GiB reserved ({ranks[0]['run_s']:.0f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        return refuse("memory: probes a CUDA device's allocator; no GPU here")
    plan = launch_plan(args.plan, args.out, args.force)
    if plan is None:
        return EXIT_BAD_INPUT
    rank, world, device, _ = init()
    result = probe_step(args.plan.stem, plan, rank, world, device, args.seed)
    doc = document(args.plan.stem, plan, result, rank, world, device)
    finish(world)
    if doc is None:
        return 0
    return write_measurement(args.out, doc, args.force, f"{line(doc)} -> {args.out}",
                             indent=1)


if __name__ == "__main__":
    sys.exit(main())
