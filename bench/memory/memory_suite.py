"""Memory truth: the peak device memory of training steps of many plans, and its parts.

    python -m bench.memory.memory_suite --world 1 --out-dir bench/results/h200/memory
    torchrun --nproc-per-node 2 -m bench.memory.memory_suite --world 2 --out-dir ...

Runs every case of ``CASES`` whose world size is ``--world`` (or the ``--plan-files``) in
one process per rank, one after another: builds the runtime's trainer for the case's plan, runs
one warm-up step (the optimizer states and the allocator's pools exist after it), then one
probed step that records per rank

- the resident bytes at the step's start (parameters, main gradients, optimizer states) and the
  trainer's own count of them (``state_bytes``);
- per phase (forward, loss, backward, grad_sync, optimizer; ``runtime.memory.MemoryPhases``)
  the peak allocated bytes while the phase was open and the allocated bytes when it closed;
- the step's peak allocated and peak reserved bytes (the caching allocator's pools: what the
  device must hold);
- bytes each module keeps after its forward of the first micro-batch (allocated after minus
  before: the activations it saves for backward plus its output), per layer and operator.

A case that runs out of memory is recorded as such, with the allocator's numbers at the failure.
Each case writes ``memory_<case>.json`` (rank 0; every rank's numbers inside) with metadata
(GPU, torch, commit, date). Predictions are not computed here: ``bench/memory/memory_report.py``
holds
the committed measurements against the cost model of the tree it runs on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from runtime.memory import GIB, MemoryPhases, configure_allocator

configure_allocator()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench._dist_bench import finish, init, release  # noqa: E402
from bench._meta import bad_input, write_result  # noqa: E402
from bench.memory.memory_cases import CASES  # noqa: E402
from plans import Plan  # noqa: E402
from plans.catalog import load_plan  # noqa: E402
from plans.execution import record  # noqa: E402
from runtime.data import SyntheticTokens  # noqa: E402
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


def run_case(name: str, plan: Plan, rank: int, world: int, device: torch.device,
             seed: int) -> dict:
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, required=True, help="run the cases of this many GPUs")
    p.add_argument("--plan-files", type=Path, nargs="*", default=[],
                   help="plan files to run instead of the built-in cases, named by their "
                        "file stem")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != args.world:
        return bad_input(f"--world {args.world} but WORLD_SIZE={world}")
    plans = ({f.stem: load_plan(f) for f in args.plan_files} if args.plan_files
             else {n: case() for n, case in CASES.items()})
    rank, world, device, _ = init()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, plan in plans.items():
        if plan.degrees.world != world:
            continue
        result = run_case(name, plan, rank, world, device, args.seed)
        ranks = [result]
        if world > 1:
            ranks = [None] * world
            dist.all_gather_object(ranks, result)
        if rank == 0:
            doc = {"allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                   "world": world, "case": name, "plan_summary": result["plan_summary"],
                   "plan": result["plan"],
                   "deviations": record(plan, backend_of(device)),
                   "ranks": [{k: v for k, v in r.items() if k not in ("plan", "plan_summary")}
                             for r in ranks]}
            write_result(args.out_dir / f"memory_{name}.json", doc, indent=1)
            peak = max(r["peak_reserved_bytes"] for r in ranks) / GIB
            alloc = max(r["peak_allocated_bytes"] for r in ranks) / GIB
            print(f"{name}: {ranks[0]['status']} peak {alloc:.2f} GiB allocated, "
                  f"{peak:.2f} GiB reserved ({result['run_s']:.0f} s)", flush=True)
    finish(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
