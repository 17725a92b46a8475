"""Measured training-step time of a plan, for comparison with the cost model's prediction.

    torchrun --nproc-per-node N -m bench.steps.train_step --plan PLAN --steps S --warmup W \
        --out bench/results/NAME.json
    torchrun --nproc-per-node N -m bench.steps.train_step --plans P1 P2 ... --out-dir DIR

With ``--plans``, one launch measures every listed plan whose GPU count is the launch's world
size (others are skipped), one after another in the same processes, each written to
DIR/train_step_<plan file stem>.json (what a launch per plan writes, without a torchrun and
NCCL start-up per plan: the fidelity suite's campaign runs this way).

Runs W warm-up steps, then S measured steps of the runtime on synthetic tokens (NCCL and bf16
autocast on CUDA, gloo and fp32 on CPU). Step time is the slowest rank's wall time of each
step, averaged over the measured steps; MFU counts ModelSpec.flops_per_token (the cost model's
count) against world x the plan's GPU bf16 peak. Rank 0 writes JSON: metadata (GPU, torch,
commit, date), the plan summary, the measurement, per-component times (mean over steps and
ranks, and per rank), peak memory per rank and the plan's prediction when it has one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

from runtime.memory import (  # noqa: E402
    GIB,
    allocator_breakdown,
    configure_allocator,
    memory_timeline,
)

configure_allocator()  # as the runtime's launch does (runtime.train), before CUDA allocates

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench._dist_bench import finish, init, release, slowest, step_times  # noqa: E402
from bench._meta import bad_input, write_result  # noqa: E402
from plans import Plan, SpecError, layout  # noqa: E402
from plans.catalog import load_plan  # noqa: E402
from plans.execution import UnsupportedFeature, record  # noqa: E402
from plans.plan import MeshAxis  # noqa: E402
from runtime.compile_cache import cache_counts, compile_phases, use_cache_dir  # noqa: E402
from runtime.data import SyntheticTokens  # noqa: E402
from runtime.measure import check_plan  # noqa: E402
from runtime.metrics import COMPONENT_KEYS  # noqa: E402
from runtime.parallel.attention import head_groups  # noqa: E402
from runtime.parallel.parallelize import backend_of  # noqa: E402
from runtime.trainer import build_trainer  # noqa: E402

TIMEOUT = timedelta(minutes=10)
"""How long a collective waits for a late rank."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    one = p.add_mutually_exclusive_group(required=True)
    one.add_argument("--plan", type=Path)
    one.add_argument("--plans", type=Path, nargs="+",
                     help="several plans in one launch (those of the launch's world size)")
    p.add_argument("--steps", type=int, default=10, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run before measuring")
    p.add_argument("--out", type=Path, help="JSON result (written by rank 0); with --plan")
    p.add_argument("--out-dir", type=Path, help="folder of the results; with --plans")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-timeline", action="store_true",
                   help="one more unmeasured step with the allocator's history recorded: what "
                   "is live when the reserved bytes peak (runtime.memory.memory_timeline)")
    p.add_argument("--compile-cache", type=Path,
                   help="folder of torch.compile's caches (runtime.compile_cache; default: "
                   "$TORCHINDUCTOR_CACHE_DIR, else ~/.cache/moeplan/torch_compile)")
    p.add_argument("--share-gpu", action="store_true",
                   help="ranks share the visible GPUs over gloo (more ranks than GPUs): each "
                   "rank's memory, never the layout's speed; with --plan")
    args = p.parse_args(argv)
    if args.share_gpu and args.plan is None:
        p.error("--share-gpu goes with --plan")
    if (args.plan is not None) != (args.out is not None) or (args.plans is None) != (
            args.out_dir is None):
        p.error("--plan goes with --out, --plans with --out-dir")
    return args


def ranks_per_gpu(world: int, device: torch.device) -> int:
    """Ranks on each GPU of the launch: above 1 under --share-gpu, where each rank's memory is
    its own and the step times are not the layout's."""
    return -(-world // torch.cuda.device_count()) if device.type == "cuda" else 1


def setup(plan_path: Path, share_gpu: bool = False):
    """(plan, rank, world, device) with the process group joined (runtime.measure.init,
    ``share_gpu`` there); exits 2 on bad input."""
    try:
        plan = check_plan(plan_path, int(os.environ.get("WORLD_SIZE", 1)),
                          int(os.environ.get("LOCAL_RANK", 0)), share_gpu)
    except (SpecError, UnsupportedFeature, ValueError) as e:
        sys.exit(bad_input(str(e), int(os.environ.get("RANK", 0))))
    return (plan, *init(TIMEOUT, share_gpu)[:3])


def measure(plan: Plan, plan_path: Path, rank: int, world: int, device: torch.device,
            steps: int, warmup: int, seed: int, memory_history: bool = False) -> dict | None:
    """``warmup`` then ``steps`` measured steps of ``plan``; the result document on rank 0."""
    t = plan.training
    data = SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, seed)
    built = time.perf_counter()
    trainer = build_trainer(plan, rank, world, device, seed, data)
    build_s = time.perf_counter() - built
    groups = head_groups(trainer.model)
    began, after_first = cache_counts(), None
    warm_times = []
    for step in range(warmup):
        warm_times.append(slowest(trainer.train_step(step).step_time_s, device))
        after_first = after_first or cache_counts()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    components = dict.fromkeys(COMPONENT_KEYS, 0.0)
    skews: list[tuple[float, float]] = []
    rows: list[int] | None = None  # per MoE layer of this rank, summed over the steps
    for step in range(warmup, warmup + steps):
        m = trainer.train_step(step)
        times.append(slowest(m.step_time_s, device))
        after_first = after_first or cache_counts()  # no warm-up: the first is measured
        losses.append(m.loss)
        for k, v in m.components_s.items():
            components[k] = components.get(k, 0.0) + v / steps
        if m.routing_skew is not None:
            skews.append((m.routing_skew, m.routing_skew_max))
        if m.expert_rows is not None:
            rows = m.expert_rows if rows is None else [a + b for a, b in
                                                       zip(rows, m.expert_rows, strict=True)]
    compiled = {"first_step": (after_first - began).as_dict(),
                "after_first_step": (cache_counts() - after_first).as_dict(),
                "phases_s": compile_phases()}
    peak = m.peak_memory_gib
    # the caching allocator's peak reserved bytes: what the cost model's peak predicts (read
    # before the unmeasured step that counts host syncs)
    reserved = (torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda"
                else peak)
    allocator = allocator_breakdown(device)
    syncs = host_syncs(trainer, warmup + steps, device)
    timeline = (memory_timeline(lambda: trainer.train_step(warmup + steps + 1), device)
                if memory_history else None)
    extra = {"allocator": allocator, "memory_timeline": timeline, "host_syncs": syncs}
    gathered: list = [((components, peak, reserved, skews, rows), extra)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, ((components, peak, reserved, skews, rows), extra))
    trainer.close()  # its process groups: a launch measures several plans
    if rank != 0:
        return None
    per_rank, extras = [m for m, _ in gathered], [e for _, e in gathered]
    keys = sorted({k for c, *_ in per_rank for k in c})
    # max / mean routed slots per expert (runtime.moe.routing_skew): mean and max over steps,
    # ranks, MoE layers and micro-batches
    all_skews = [s for _, _, _, rank_skews, _ in per_rank for s in rank_skews]
    rows_per_rank = [r for *_, r in per_rank]
    return {
        "world": world,
        "backend": dist.get_backend() if world > 1 else "none",
        "ranks_per_gpu": ranks_per_gpu(world, device),
        "plan": str(plan_path),
        "plan_summary": plan.summary(),
        "optimizer_sharding": plan.optimizer_sharding.value,
        "warmup_steps": warmup,
        "measured_steps": steps,
        **step_times(warm_times, times, plan, world),
        "build_s": build_s,
        "compiled_graphs": compiled,
        "compile_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "tokens_per_step": t.tokens_per_step,
        "flops_per_token": plan.model.flops_per_token(t.seq_len),
        "losses": losses,
        "peak_memory_gib_per_rank": [p for _, p, *_ in per_rank],
        "peak_reserved_gib_per_rank": [r for _, _, r, *_ in per_rank],
        "allocator_per_rank": [e["allocator"] for e in extras],
        **({"memory_timeline_per_rank": [e["memory_timeline"] for e in extras]}
           if memory_history else {}),
        "components_s": {k: sum(c.get(k, 0.0) for c, *_ in per_rank) / world for k in keys},
        "components_s_per_rank": [c for c, *_ in per_rank],
        "routing_skew": (sum(s for s, _ in all_skews) / len(all_skews) if all_skews else None),
        "routing_skew_max": max((h for _, h in all_skews), default=None),
        "expert_rows_per_rank": [None if r is None else sum(r) for r in rows_per_rank],
        "expert_rows_per_rank_layer": rows_per_rank,
        "ep_rank_load_step": ep_rank_load(plan, [None if r is None else [sum(r)]
                                                 for r in rows_per_rank]),
        "ep_rank_load_layer": ep_rank_load(plan, rows_per_rank),
        "host_syncs_per_rank": [e["host_syncs"] for e in extras],
        "prediction": plan.prediction.model_dump() if plan.prediction else None,
        "deviations": record(plan, backend_of(device)),
        "ulysses_head_groups": groups,
    }


def host_syncs(trainer, step: int, device: torch.device) -> dict[str, int] | None:
    """One unmeasured step under CUDA's sync debug mode: its implicit host waits (a copy to or
    from pageable memory, ``.item()``, ``.tolist()``, ``nonzero``) counted per source line.
    None on CPU."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = Counter(_source(w.filename, w.lineno) for w in caught
                    if "synchroniz" in str(w.message))
    return dict(where.most_common())


def _source(filename: str, line: int) -> str:
    """``path:line``, the path relative to the repository when the file is in it."""
    path, root = Path(filename).resolve(), HERE.parent
    return f"{path.relative_to(root) if path.is_relative_to(root) else path.name}:{line}"


def ep_rank_load(plan, rows_per_rank: list[list[int] | None]) -> float | None:
    """Mean over the EP groups and the entries of ``rows_per_rank`` (one per MoE layer, or one
    for the whole step) of the group's busiest rank's routed rows over the group's mean: the
    measured cost_models.skew.rank_skew. Per layer it is what paces each layer; over the whole
    step, different layers' hot ranks average out, so it can only be lower. None without
    expert parallelism or counts."""
    if plan.degrees.ep == 1 or any(r is None for r in rows_per_rank):
        return None
    ratios = []
    for group in layout.groups(plan.degrees, MeshAxis.ep):
        for loads in zip(*(rows_per_rank[r] for r in group), strict=True):
            if sum(loads):
                ratios.append(max(loads) * len(loads) / sum(loads))
    return sum(ratios) / len(ratios) if ratios else None


def report(result: dict, out: Path) -> None:
    write_result(out, result)
    print(f"{result['plan_summary']}: step {result['step_time_s'] * 1e3:.1f} ms, "
          f"{result['tokens_per_s']:,.0f} tok/s, MFU {result['mfu']:.2%}, first step "
          f"{result['first_step_s']:.2f} s -> {out}", flush=True)


def runs_of(args: argparse.Namespace, world: int) -> list[tuple[Plan, Path, Path]]:
    """(plan, its file, its result) of each plan the launch measures, or SpecError /
    UnsupportedFeature / ValueError saying why one cannot run here."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.plan is not None:
        return [(check_plan(args.plan, world, local, args.share_gpu), args.plan, args.out)]
    runs = [(check_plan(path, world, local), path, args.out_dir / f"train_step_{path.stem}.json")
            for path in args.plans if load_plan(path).degrees.world == world]
    if not runs:
        raise SpecError(f"--plans: none of them runs on {world} GPU(s)")
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        return bad_input("--steps must be >= 1 and --warmup >= 0")
    use_cache_dir(args.compile_cache)  # before anything compiles
    try:
        runs = runs_of(args, int(os.environ.get("WORLD_SIZE", 1)))
    except (SpecError, UnsupportedFeature, ValueError) as e:
        return bad_input(str(e), int(os.environ.get("RANK", 0)))
    rank, world, device, _ = init(TIMEOUT, args.share_gpu)
    for plan, path, out in runs:
        try:
            result = measure(plan, path, rank, world, device, args.steps, args.warmup, args.seed,
                             args.memory_timeline)
        except torch.OutOfMemoryError as e:
            # every rank of a layout holds its share: they all stop here, and the next plan runs
            print(f"{path}: out of memory on rank {rank}: {str(e).splitlines()[0][:200]}",
                  file=sys.stderr, flush=True)
            result = None
        if result is not None:
            report(result, out)
        release(device)  # its process groups stay: DeviceMesh caches them
    finish(world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
