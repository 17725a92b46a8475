"""Where a training step's time goes, kernel by kernel: torch.profiler over a few steps of a
plan on one process (one GPU, or CPU).

    python bench/profile_step.py --plan PLAN --out bench/results/NAME.json [--steps 2]

Writes JSON: metadata, the plan summary, wall time per step, device busy time per step (sum of
kernel durations: one stream, so they do not overlap) and the idle fraction (launch and host
overheads the cost model does not count), device time per kernel class (GEMM, grouped GEMM,
attention, elementwise, reduction / indexing / sorting, copies, communication), and the
slowest kernels. On CPU the "kernels" are the profiler's CPU operators.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from _meta import metadata  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from train_step import setup  # noqa: E402

from runtime.data import SyntheticTokens  # noqa: E402
from runtime.trainer import build_trainer  # noqa: E402

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
    """Kernel (or CPU operator) name -> (calls, seconds). On CUDA only device kernels."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="slowest kernels listed")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    plan, _, world, device = setup(args.plan)
    if world != 1:
        print("error: --plan: profile_step.py runs one process (a 1-GPU plan)", file=sys.stderr)
        return 2
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, args.seed)
    trainer = build_trainer(plan, 0, 1, device, args.seed, data)
    for step in range(args.warmup):
        trainer.train_step(step)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            trainer.train_step(step)
        wall = (time.perf_counter() - t0) / args.steps
    kernels = kernel_times(prof, cuda)
    busy = sum(s for _, s in kernels.values()) / args.steps
    classes: dict[str, float] = defaultdict(float)
    for name, (_, s) in kernels.items():
        classes[classify(name)] += s / args.steps
    slowest = sorted(kernels.items(), key=lambda kv: -kv[1][1])[: args.top]
    result = {
        **metadata(),
        "plan": str(args.plan),
        "plan_summary": plan.summary(),
        "profiled_steps": args.steps,
        "step_wall_s": wall,
        "device_busy_s": busy,
        "idle_fraction": max(0.0, 1 - busy / wall),
        "class_s": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "slowest": [{"name": n[:160], "class": classify(n), "calls_per_step": c / args.steps,
                     "s_per_step": s / args.steps} for n, (c, s) in slowest],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{plan.summary()}: wall {wall * 1e3:.1f} ms/step, busy {busy * 1e3:.1f} ms "
          f"(idle {result['idle_fraction']:.0%}) -> {args.out}")
    for k, v in result["class_s"].items():
        print(f"  {k:22s} {v * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
