"""The runtime's two EP dispatchers timed over shapes and top-k: what `moeplan calibrate
--dispatch` fits the eager dispatch's factors (efficiency.gather_scatter, dispatch_floor_us)
from.

    moeplan dispatch --nproc-per-node 2 --out dispatch.json
    (or: torchrun --standalone --nproc-per-node 2 -m runtime.dispatch_sweep --out dispatch.json)

N ranks are the EP group. At each shape (hidden size, experts, sequence length) and top-k from
1: tokens per rank = sequence / N (micro-batch 1, the sequence sharded as under Ulysses SP =
EP = N), random routing (k distinct experts per token, random softmax weights); the runtime's
AllToAllDispatcher and AllGatherDispatcher (runtime/parallel/expert.py) run dispatch then
combine (identity experts), forward alone and forward + backward. Times: runtime.measure,
medians after warm-up, the slowest rank's. The crossover top-k is the first at which
all-gather + reduce-scatter measured faster than all-to-all.

Measurements only (``plans.results.DispatchSweep``): planner.dispatch_fit prices every point
with the cost model when it fits or reports. ``--smoke`` runs a tiny grid (a CPU check: gloo,
fp32). Bad input: one line naming the field, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plans import Dispatch, SpecError
from plans.io import check_destination
from plans.layout import tokens_per_rank
from plans.notation import DISPATCH_KEYS
from runtime.measure import EXIT_BAD_INPUT, finish, init, slowest, timed, write_measurement
from runtime.moe import Routing
from runtime.parallel.expert import AllGatherDispatcher, AllToAllDispatcher

DISPATCHES = (Dispatch.all_to_all, Dispatch.allgather_reduce_scatter)
"""The dispatchers the runtime runs eagerly, by their names in the result (``a2a``, ``ag_rs``)."""
GRID = {"hidden": [2048, 4096], "experts": [8, 32, 128], "seq": [4096, 16384],
        "max_top_k": 8, "warmup": 3, "repeats": 10}
"""The default grid: the shapes h200-runtime's factors were fitted to."""
SMOKE = {"hidden": [32, 64], "experts": [4], "seq": [64, 128], "max_top_k": 2, "warmup": 1,
         "repeats": 2}


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers"
                                         ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.dispatch_sweep",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the measurement's JSON")
    p.add_argument("--hidden", type=_ints, help=f"hidden sizes (default {GRID['hidden']})")
    p.add_argument("--experts", type=_ints, help=f"expert counts (default {GRID['experts']})")
    p.add_argument("--seq", type=_ints, help=f"sequence lengths, tokens per rank = seq / N "
                                             f"(default {GRID['seq']})")
    p.add_argument("--max-top-k", type=int, help=f"top-k 1 .. this (default {GRID['max_top_k']})")
    p.add_argument("--warmup", type=int, help=f"calls before timing (default {GRID['warmup']})")
    p.add_argument("--repeats", type=int, help=f"timed calls (default {GRID['repeats']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny grid (a CPU check)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    # the grid: what was given, else the smoke grid or the default
    for key, value in (SMOKE if args.smoke else GRID).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def check(args: argparse.Namespace, world: int) -> None:
    """One-line SpecError for a grid this launch cannot run."""
    if world < 2:
        raise SpecError("WORLD_SIZE: run under torchrun with at least 2 processes (the EP "
                        "group)")
    for name in ("max_top_k", "repeats"):
        if getattr(args, name) < 1:
            raise SpecError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.warmup < 0:
        raise SpecError("--warmup: must be >= 0")
    for option, values in (("--experts", args.experts), ("--seq", args.seq)):
        if bad := [v for v in values if v % world]:
            raise SpecError(f"{option}: {world} ranks must divide {bad[0]}")


def dispatcher(d: Dispatch, experts: int, rank: int, world: int):
    group = dist.group.WORLD
    if d == Dispatch.all_to_all:
        return AllToAllDispatcher(experts, group, world)
    return AllGatherDispatcher(experts, group, world, rank)


def time_row(args, x: torch.Tensor, grad_out: torch.Tensor, experts: int, k: int,
             rank: int, world: int, gen: torch.Generator) -> dict:
    """One top-k of one shape: each dispatcher's dispatch + combine, forward and forward +
    backward, the slowest rank's median."""
    device = x.device
    tokens = x.shape[0]
    scores = torch.rand(tokens, experts, device=device, generator=gen)
    indices = scores.topk(k, dim=-1).indices
    logits = torch.randn(tokens, k, device=device, generator=gen)
    row: dict = {"top_k": k, "tokens_per_rank": tokens}
    for d in DISPATCHES:
        disp = dispatcher(d, experts, rank, world)

        def step(backward: bool, disp=disp) -> None:
            xs = x.detach().requires_grad_(backward)
            w = torch.softmax(logits, -1).requires_grad_(backward)
            rows, _, handle = disp.dispatch(xs, Routing(indices, w, torch.zeros((), device=device)))
            y = disp.combine(rows, handle)
            if backward:
                y.backward(grad_out)

        fwd = timed(lambda step=step: step(False), device, args.warmup, args.repeats)
        fwd_bwd = timed(lambda step=step: step(True), device, args.warmup, args.repeats)
        row[DISPATCH_KEYS[d]] = {"measured": {"fwd_s": slowest(fwd, device),
                                              "fwd_bwd_s": slowest(fwd_bwd, device)}}
    return row


def crossover(rows: list[dict], key: str) -> int | None:
    """The first top-k at which all-gather + reduce-scatter measured faster than all-to-all."""
    a2a, ag = (DISPATCH_KEYS[d] for d in DISPATCHES)
    return next((r["top_k"] for r in rows
                 if r[ag]["measured"][key] < r[a2a]["measured"][key]), None)


def measure_shape(args, hidden: int, experts: int, seq: int, rank: int, world: int,
                  dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    tokens = int(tokens_per_rank(1, seq, world))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    grad_out = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
    rows = []
    for k in range(1, min(args.max_top_k, experts) + 1):
        rows.append(time_row(args, x, grad_out, experts, k, rank, world, gen))
        if rank == 0:
            a, g = (rows[-1][DISPATCH_KEYS[d]]["measured"]["fwd_bwd_s"] for d in DISPATCHES)
            print(f"h{hidden} e{experts} t{tokens} top-{k}: fwd+bwd a2a {a * 1e3:8.3f} ms, "
                  f"ag+rs {g * 1e3:8.3f} ms", flush=True)
    return {"hidden": hidden, "experts": experts, "seq_len": seq, "tokens_per_rank": tokens,
            "rows": rows, "crossover_top_k": {"measured_fwd": crossover(rows, "fwd_s"),
                                              "measured_fwd_bwd": crossover(rows, "fwd_bwd_s")}}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        check(args, int(os.environ.get("WORLD_SIZE", 1)))
        check_destination(args.out, "--out", args.force)
    except SpecError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    rank, world, device, dtype = init(timedelta(minutes=10))
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    configs = [measure_shape(args, h, e, s, rank, world, dtype, device, gen)
               for h in args.hidden for e in args.experts for s in args.seq]
    backend = dist.get_backend()
    finish(world)
    if rank != 0:
        return 0
    doc = {"benchmark": "EP dispatch + combine of the runtime's dispatchers over shapes and "
           "top-k", "world": world, "backend": backend,
           "dtype": str(dtype).removeprefix("torch."), "micro_batch": 1,
           "warmup": args.warmup, "repeats": args.repeats, "configs": configs}
    return write_measurement(args.out, doc, args.force,
                             f"{len(configs)} shapes; wrote {args.out}", indent=1)


if __name__ == "__main__":
    sys.exit(main())
