"""Training entry point, run under torchrun:

    torchrun --nproc-per-node N -m runtime.train --plan PLAN [--steps N] [--data PATH]
        [--data-dtype u16|u32] [--log FILE | --log-file FILE]
        [--ckpt-dir DIR --ckpt-every K] [--resume] [--seed S] [--lr LR]
        [--aux-loss-coeff C] [--per-expert-balance] [--compile-cache DIR]

Reads RANK, WORLD_SIZE and LOCAL_RANK; NCCL with bf16 parameters (fp32 optimizer masters) on CUDA,
gloo and fp32 on CPU.
Bad input (plan missing or invalid, unsupported field, world size mismatch, a predicted peak
memory above the GPU's free memory) prints one line naming the field and the reason and exits
with status 2. The last line sums the run up: the first step's time (compilation, which a
relaunch loads from torch.compile's caches, runtime.compile_cache) apart from the median of the
steps after it. Running out of device memory prints one line with the predicted and measured
peaks and exits with status 1. A failed or timed-out collective (a
peer died, ``--timeout-s`` passed) prints one line and exits with status 1; SIGTERM (torchrun
stopping the other ranks after one failed) prints one line and exits with status 143.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plans import Plan, SpecError
from plans.catalog import load_plan
from plans.execution import UnsupportedFeature, deviations, record
from plans.io import check_appendable, check_folder_target
from plans.proc import die_with_parent
from runtime import checkpoint
from runtime.compile_cache import CacheCounts, cache_counts, use_cache_dir
from runtime.data import SyntheticTokens, TokenDtype, TokenFile, TokenSource
from runtime.machine import check_machine
from runtime.memory import InsufficientMemory, check_fits, configure_allocator, out_of_memory_line
from runtime.parallel.mesh import WorldSizeMismatch, end_process_groups
from runtime.parallel.optimizer import OptimizerConfig
from runtime.parallel.parallelize import backend_of, check_supported, launch_backend
from runtime.trainer import StepMetrics, build_trainer, model_options

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_SIGTERM = 128 + signal.SIGTERM


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.train", description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path, help="plan file (YAML or JSON)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to reach")
    p.add_argument("--data", type=Path, help="raw token file; synthetic tokens when absent")
    p.add_argument("--data-dtype", type=TokenDtype, choices=list(TokenDtype),
                   help="token width of --data (default: from the suffix .u16/.u32)")
    # torchrun's own parser takes "--log" for an abbreviation of its --log-dir and refuses it;
    # under torchrun spell it --log-file
    p.add_argument("--log", "--log-file", dest="log", type=Path,
                   help="JSON-lines metrics file written by rank 0")
    p.add_argument("--ckpt-dir", type=Path, help="checkpoint directory")
    p.add_argument("--ckpt-every", type=int, default=0, help="save every K steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a --ckpt-dir holding another run's checkpoints: they "
                   "are deleted first (without it such a directory is refused)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=OptimizerConfig.lr)
    p.add_argument("--aux-loss-coeff", type=float, default=None,
                   help="balance-loss weight; default the model's (ModelSpec.aux_loss_coeff)")
    p.add_argument("--per-expert-balance", action="store_true",
                   help="plain per-expert balance loss instead of one per EP rank")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="collective timeout: a rank waiting longer on a dead peer fails")
    p.add_argument("--compile-cache", type=Path,
                   help="folder of torch.compile's caches, shared by every plan and launch "
                   "(default: $TORCHINDUCTOR_CACHE_DIR, else ~/.cache/moeplan/torch_compile)")
    p.add_argument("--check", action="store_true",
                   help="check the plan, data, output paths and this machine (LOCAL_WORLD_SIZE "
                   "ranks), print nothing and exit 0 when all is well; start nothing")
    return p.parse_args(argv)


def make_data(args: argparse.Namespace, plan: Plan) -> TokenSource:
    t = plan.training
    if args.data is None:
        return SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, args.seed)
    dtype = args.data_dtype or TokenDtype.from_path(args.data)
    if dtype is None:
        raise SpecError(f"--data-dtype: needed for {args.data} (suffix is not .u16 or .u32)")
    return TokenFile(args.data, dtype, t.global_batch, t.seq_len, args.seed, plan.model.vocab)


def validate(args: argparse.Namespace, world: int) -> tuple[Plan, TokenSource]:
    plan = load_plan(args.plan)
    check_supported(plan, launch_backend())
    if plan.degrees.world != world:
        d = plan.degrees
        raise WorldSizeMismatch(
            f"degrees: plan needs pp x dp x cp x sp x tp = {d.pp} x {d.dp} x {d.cp} x {d.sp} x "
            f"{d.tp} = {d.world} processes, launched with WORLD_SIZE={world}"
        )
    if args.ckpt_every and args.ckpt_dir is None:
        raise SpecError("--ckpt-every: needs --ckpt-dir")
    if args.resume and args.ckpt_dir is None:
        raise SpecError("--resume: needs --ckpt-dir")
    if args.steps < 1 or args.ckpt_every < 0:
        raise SpecError("--steps must be >= 1 and --ckpt-every >= 0")
    if args.log is not None:
        check_appendable(args.log, "--log")
    if args.overwrite and args.resume:
        raise SpecError("--overwrite: cannot be combined with --resume")
    if args.compile_cache is not None:
        check_folder_target(args.compile_cache, "--compile-cache")
    data = make_data(args, plan)
    if args.ckpt_dir is not None:
        check_folder_target(args.ckpt_dir, "--ckpt-dir")
        checkpoint.check_run(args.ckpt_dir, run_record(args, plan), args.resume, args.overwrite)
    return plan, data


def run_record(args: argparse.Namespace, plan: Plan) -> checkpoint.RunRecord:
    return checkpoint.RunRecord.of(plan, args.data, args.seed)


def report(m: StepMetrics, log: Path | None, ran: list[dict],
           compiled: CacheCounts | None = None) -> None:
    """Print a step's line; append it to ``log`` with the plan fields the run executed
    differently (``ran``, plans.execution.record), which the cost model prices it by, and the
    graphs the step compiled (``compiled``: loaded from the compile cache, or compiled)."""
    line = (
        f"step {m.step + 1} loss {m.loss:.4f} tok/s {m.tokens_per_s:,.0f} mfu {m.mfu:.2%} "
        f"step {m.step_time_s * 1e3:.0f} ms peak {m.peak_memory_gib:.2f} GiB"
    )
    compiled = compiled or CacheCounts()
    if compiled.hits or compiled.misses:
        line += f" (graphs: {compiled.hits} from cache, {compiled.misses} compiled)"
    print(line, flush=True)
    if log is not None:
        record = {**asdict(m), "step": m.step + 1, "deviations": ran,
                  "compiled_graphs": compiled.as_dict()}
        with log.open("a") as f:
            f.write(json.dumps(record) + "\n")


def summary(step_times_s: list[float], compiled: CacheCounts, cache: Path) -> str:
    """The run's last line: its first step (compilation included) apart from the median of the
    steps after it, and what the compile cache gave."""
    first = f"first step {step_times_s[0]:.2f} s"
    rest = sorted(step_times_s[1:])
    if rest:
        first += (f", then {rest[len(rest) // 2] * 1e3:.0f} ms (median of {len(rest)} "
                  f"step{'s' if len(rest) > 1 else ''})")
    return (f"{first}; compiled graphs: {compiled.hits} from cache, {compiled.misses} compiled "
            f"(compile cache {cache})")


def resume_point(ckpt_dir: Path, rank: int) -> tuple[Path, int] | None:
    """Rank 0 picks the newest valid checkpoint (reporting damaged ones); every rank gets it."""
    choice: list = [None]
    if rank == 0:
        choice[0] = checkpoint.find_resumable(
            ckpt_dir, lambda line: print(line, file=sys.stderr, flush=True)
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


class _Progress:
    step = 0


def _on_sigterm(rank: int, progress: type[_Progress]):
    def handler(_signum, _frame):
        print(f"error: rank {rank}: stopped by SIGTERM during step {progress.step + 1} "
              "(the launcher was stopped, or stopped the ranks after one failed)",
              file=sys.stderr, flush=True)
        os._exit(EXIT_SIGTERM)

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: never outlive it
        die_with_parent(signal.SIGTERM)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    try:
        plan, data = validate(args, world)
        if args.check:
            check_machine(plan, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            return 0
    except (SpecError, UnsupportedFeature, WorldSizeMismatch, ValueError) as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cache = use_cache_dir(args.compile_cache)  # before anything compiles
    configure_allocator()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        try:
            check_fits(plan, device)
        except InsufficientMemory as e:
            print(f"error: rank {rank}: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        # NCCL's watchdog aborts the communicator on an error or timeout instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.timeout_s))
        signal.signal(signal.SIGTERM, _on_sigterm(rank, _Progress))
    if rank == 0:
        for d in deviations(plan, backend_of(device)):
            print(d.note(), file=sys.stderr, flush=True)
    try:
        return _train(args, plan, data, rank, world, device, owns_group, cache)
    except torch.OutOfMemoryError:
        print(out_of_memory_line(plan, device, rank, _Progress.step), file=sys.stderr,
              flush=True)
        return EXIT_FAILED
    except (dist.DistError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: rank {rank}: training stopped during step {_Progress.step + 1}: "
              f"a collective failed (a peer died or --timeout-s passed): {reason}",
              file=sys.stderr, flush=True)
        return EXIT_FAILED


def _train(args, plan: Plan, data: TokenSource, rank: int, world: int,
           device: torch.device, owns_group: bool, cache: Path) -> int:
    trainer = build_trainer(
        plan, rank, world, device, args.seed, data,
        options=model_options(plan, args.aux_loss_coeff, args.per_expert_balance),
        optim=OptimizerConfig(lr=args.lr),
    )
    start = 0
    if args.ckpt_dir is not None and args.ckpt_every:
        if rank == 0:  # the run's record first (check_run refused another run's directory)
            if args.overwrite and args.ckpt_dir.is_dir():
                checkpoint.clear(args.ckpt_dir)
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.write_record(args.ckpt_dir, run_record(args, plan))
        if dist.is_initialized():
            dist.barrier()
    if args.resume and (found := resume_point(args.ckpt_dir, rank)) is not None:
        start = checkpoint.load(trainer, found[0])
        if rank == 0:
            print(f"resumed from {found[0]} after step {start}", flush=True)
    ran = record(plan, backend_of(device))
    times: list[float] = []
    began = counted = cache_counts()
    for step in range(start, args.steps):
        _Progress.step = step
        metrics = trainer.train_step(step)
        now = cache_counts()
        times.append(metrics.step_time_s)
        if rank == 0:
            report(metrics, args.log, ran, now - counted)
        counted = now
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            checkpoint.save(trainer, args.ckpt_dir, step + 1)
    # Process groups die while the interpreter is whole (mesh.end_process_groups says why):
    # the trainer's gradient hooks form a cycle that keeps it and its groups alive, so close()
    # unhooks them and destroys the trainer's groups first.
    if rank == 0 and times:
        print(summary(times, counted - began, cache), flush=True)
    trainer.close()
    del trainer
    if owns_group:
        end_process_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
