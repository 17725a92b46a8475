"""Where a training step's time goes, kernel by kernel: torch.profiler over a few steps of a
1-GPU plan, the input of `moeplan calibrate`.

    python -m runtime.profile --plan PLAN --out PROFILE.json [--steps 2] [--warmup 2]
    (or: moeplan profile PLAN --out PROFILE.json)

Writes JSON: what ran (runtime.provenance: commit, date, torch, GPU), the
plan summary, wall time per step, device busy time per step (sum of kernel durations: one
stream, so they do not overlap), the idle fraction (launch and host overheads), the kernels
launched per step, device time
per kernel class (GEMM, grouped GEMM, attention, elementwise, reduction / indexing / sorting,
copies, communication), the runtime's timer components per step (``plans.Component``, the
names of the cost model's ``components_s``) and the slowest kernels. On CPU the "kernels" are
the profiler's top-level CPU operators. Bad input: one line naming the field, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from plans import COMPONENT_KEYS, Plan, SpecError
from plans.catalog import load_plan
from plans.execution import UnsupportedFeature, record
from plans.io import check_destination, write_atomic
from runtime.data import SyntheticTokens
from runtime.parallel.parallelize import backend_of, check_supported, launch_backend
from runtime.provenance import metadata
from runtime.trainer import Trainer, build_trainer

EXIT_BAD_INPUT = 2
KERNEL_CLASSES = (
    # first match wins; patterns over CUDA kernel names (cuBLAS / CUTLASS / flash / ATen)
    ("communication", r"nccl|all_to_all|allgather|reducescatter"),
    ("grouped_gemm", r"grouped|GroupProblemShape|group_gemm"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn_generated"),
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|ampere_|matmul|wgmma|cublas"),
    ("copy", r"memcpy|memset|copy|cat|CatArrayBatched|fill"),
    ("reduction_index_sort", r"reduce|sort|scan|index|scatter|gather|topk|radix|bincount|"
                             r"nonzero|cumsum|argmax|softmax|nll|cross_entropy|embedding|norm"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|silu|mul|add|pow|rsqrt|"
                    r"foreach|fused_adam|adam"),
)


def classify(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def kernel_times(prof, cuda: bool) -> dict[str, tuple[int, float]]:
    """Kernel (or top-level CPU operator) name -> (calls, seconds)."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            dur = e.time_range.elapsed_us()  # a device-side kernel: its own duration
        else:
            if e.device_type != torch.autograd.DeviceType.CPU or e.cpu_parent is not None:
                continue
            dur = e.cpu_time_total
        out[e.name][0] += 1
        out[e.name][1] += dur / 1e6
    return {k: (c, s) for k, (c, s) in out.items()}


def profile_steps(trainer: Trainer, plan: Plan, steps: int, warmup: int, top: int = 25
                  ) -> dict:
    """Run ``warmup`` steps, then profile ``steps`` more; the measurement as a JSON document."""
    for step in range(warmup):
        trainer.train_step(step)
    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    components = dict.fromkeys(COMPONENT_KEYS, 0.0)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for step in range(warmup, warmup + steps):
            for k, v in trainer.train_step(step).components_s.items():
                components[k] += v / steps
        wall = (time.perf_counter() - t0) / steps
    kernels = kernel_times(prof, cuda)
    busy = sum(s for _, s in kernels.values()) / steps
    classes: dict[str, float] = defaultdict(float)
    for name, (_, s) in kernels.items():
        classes[classify(name)] += s / steps
    slowest = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        **metadata(),
        "plan_summary": plan.summary(),
        "model": plan.model.name,
        "deviations": record(plan, backend_of(trainer.device)),
        "profiled_steps": steps,
        "step_wall_s": wall,
        "device_busy_s": busy,
        "idle_fraction": max(0.0, 1 - busy / wall),
        "kernel_calls_per_step": sum(c for c, _ in kernels.values()) / steps,
        "class_s": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "components_s": components,
        "slowest": [{"name": n[:160], "class": classify(n), "calls_per_step": c / steps,
                     "s_per_step": s / steps} for n, (c, s) in slowest],
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.profile",
                                description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="slowest kernels listed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.steps < 1 or args.warmup < 0 or args.top < 1:
            raise SpecError("--steps and --top must be >= 1, --warmup >= 0")
        plan = load_plan(args.plan)
        check_supported(plan, launch_backend())
        if plan.degrees.world != 1:
            raise SpecError(f"degrees: profiling runs one process; the plan needs "
                            f"{plan.degrees.world} GPUs")
        if int(os.environ.get("WORLD_SIZE", 1)) != 1:
            raise SpecError("WORLD_SIZE: run one process, not under torchrun")
        check_destination(args.out, "--out", args.force)
    except (SpecError, UnsupportedFeature, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, args.seed)
    trainer = build_trainer(plan, 0, 1, device, args.seed, data)
    result = {"plan": str(args.plan), **profile_steps(trainer, plan, args.steps, args.warmup,
                                                      args.top)}
    try:
        write_atomic(args.out, json.dumps(result, indent=2) + "\n", "--out", args.force)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{plan.summary()}: wall {result['step_wall_s'] * 1e3:.1f} ms/step, busy "
          f"{result['device_busy_s'] * 1e3:.1f} ms (idle {result['idle_fraction']:.0%}) -> "
          f"{args.out}")
    for k, v in result["class_s"].items():
        print(f"  {k:22s} {v * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
