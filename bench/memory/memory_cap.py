"""Does a plan train within the memory the cost model predicts for it? Each rank caps its
caching allocator at the plan's predicted peak (``torch.cuda.set_per_process_memory_fraction``,
the peak of ``cost_models.memory_breakdown`` for the plan as this runtime executes it) and runs
warm-up and measured steps.

Why this is the test of a memory prediction: with expandable segments (runtime.memory) a
request that finds no free block large enough first unmaps every free cached page and retries
(``num_alloc_retries``), so the reserved bytes an uncapped run reaches on a large GPU include
fragments the allocator gives back under pressure. Ran under the cap, the step either fits (its
retries and step time say what the pressure cost) or stops with CUDA's out-of-memory error.

    torchrun --nproc-per-node N -m bench.memory.memory_cap --plan PLAN --out RESULT.json

Rank 0 writes the result when every rank finished; a rank that runs out of memory writes
RESULT.rank<r>.oom.json at once (its peers then wait in a collective until the launch's
timeout)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench._meta import bad_input, write_result
from bench.steps.train_step import ranks_per_gpu, setup
from cost_models.memory import memory_breakdown
from plans.execution import executed_plan, record
from runtime.data import SyntheticTokens
from runtime.memory import GIB
from runtime.parallel.mesh import end_process_groups
from runtime.parallel.parallelize import backend_of
from runtime.trainer import build_trainer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0,
                   help="cap at this multiple of the predicted peak (below 1: a control that "
                   "must run out of memory when the allocated peak is above the cap)")
    p.add_argument("--share-gpu", action="store_true",
                   help="ranks share the visible GPUs over gloo, each capped at the prediction "
                   "(more ranks than GPUs; the step times are then not the layout's)")
    a = p.parse_args(argv)
    plan, rank, world, device = setup(a.plan, a.share_gpu)
    if device.type != "cuda":
        return bad_input("memory_cap.py caps a CUDA device's allocator; no GPU here")
    ran = executed_plan(plan, backend_of(device))
    predicted = memory_breakdown(ran).peak_bytes
    cap = a.scale * predicted
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, a.seed)
    facts = {"plan": str(a.plan), "world": world, "ranks_per_gpu": ranks_per_gpu(world, device),
             "cap_gib": cap / GIB, "predicted_peak_gib": predicted / GIB, "scale": a.scale,
             "deviations": record(plan, backend_of(device))}
    try:
        trainer = build_trainer(plan, rank, world, device, a.seed, data)
        for step in range(a.warmup):
            trainer.train_step(step)
        torch.cuda.reset_peak_memory_stats(device)
        times = [trainer.train_step(step).step_time_s  # its wall time, synchronised
                 for step in range(a.warmup, a.warmup + a.steps)]
    except torch.OutOfMemoryError as e:
        write_result(a.out.with_suffix(f".rank{rank}.oom.json"),
                     {**facts, "rank": rank, "fits": False,
                      "error": str(e).splitlines()[0][:300]})
        print(f"rank {rank}: out of memory under a cap of {cap / GIB:.2f} GiB", file=sys.stderr,
              flush=True)
        return 1
    s = torch.cuda.memory_stats(device)
    mine = {"allocated_peak_gib": s["allocated_bytes.all.peak"] / GIB,
            "reserved_peak_gib": s["reserved_bytes.all.peak"] / GIB,
            "alloc_retries": s.get("num_alloc_retries", 0),
            "step_time_s": sum(times) / len(times)}
    per_rank = [mine]
    backend = dist.get_backend() if world > 1 else "none"
    if world > 1:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine)
        end_process_groups()
    if rank == 0:
        write_result(a.out, {**facts, "plan_summary": plan.summary(), "backend": backend,
                             "fits": True, "per_rank": per_rank})
        worst = max(r["reserved_peak_gib"] for r in per_rank)
        retries = max(r["alloc_retries"] for r in per_rank)
        print(f"{plan.summary()}\n  fits under {cap / GIB:.2f} GiB: reserved peak "
              f"{worst:.2f} GiB, {retries} allocation retries", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
