"""Training entry point, run under torchrun:

    torchrun --nproc-per-node N -m runtime.train --plan PLAN [options]

The options are plans.run_options.RUN_OPTIONS (the same as `moeplan train`'s): steps, data (a
raw token file or a Megatron indexed dataset), learning-rate schedule, weight decay, seed,
checkpoints, the JSON-lines log and TensorBoard. Reads RANK, WORLD_SIZE and LOCAL_RANK; NCCL
with bf16 parameters (fp32 optimizer masters) on CUDA, gloo and fp32 on CPU.
Bad input (plan missing or invalid, unsupported field, world size mismatch, a predicted peak
memory above the GPU's free memory, a --ckpt-dir whose filesystem cannot hold one checkpoint,
a log of another run) prints one line naming the field and the reason and exits with status 2.
Running out of device memory prints one line with the predicted and measured peaks and exits
with status 1; so does a checkpoint write that fails (no space, I/O error: the rank, the step,
the folder and the sizes; its partial folder removed, earlier checkpoints kept). A failed or
timed-out collective (a peer died, ``--timeout-s`` passed) prints one line and exits with
status 1; SIGTERM (torchrun stopping the other ranks after one failed) prints one line and
exits with status 143.
Rank 0 ends a run with a summary (steps, tokens, checkpoints, log) and a line giving the first
step's time (compilation, which a relaunch loads from torch.compile's caches,
runtime.compile_cache) apart from the median of the steps after it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed as dist

from plans import Plan, SpecError
from plans.catalog import load_plan
from plans.execution import UnsupportedFeature, deviations, record
from plans.io import check_appendable, check_folder_target
from plans.proc import die_with_parent
from plans.run_options import RUN_OPTIONS, LrSchedule, TokenDtype
from runtime import checkpoint
from runtime.compile_cache import CacheCounts, cache_counts, use_cache_dir
from runtime.data import NUMPY_DTYPE, SyntheticTokens, TokenFile, TokenSource
from runtime.indexed import indexed_prefix, read_index
from runtime.machine import check_machine
from runtime.memory import InsufficientMemory, check_fits, configure_allocator, out_of_memory_line
from runtime.parallel.mesh import WorldSizeMismatch, end_process_groups, start_process_group
from runtime.parallel.optimizer import OptimizerConfig
from runtime.parallel.parallelize import backend_of, check_supported, launch_backend
from runtime.trainer import StepMetrics, build_trainer, model_options

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_SIGTERM = 128 + signal.SIGTERM


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Bad options are one line, exit 2, like every other bad input."""
        self.exit(EXIT_BAD_INPUT, f"error: {message.removeprefix('argument ')}\n")


def _positive(kind: type, flag: str, minimum: float | None):
    def parse(text: str):
        value = kind(text)
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = _Parser(prog="python -m runtime.train", description=__doc__.split("\n")[0])
    p.add_argument("--plan", required=True, type=Path, help="plan file (YAML or JSON)")
    for o in RUN_OPTIONS:
        flags = [o.flag, *o.aliases]
        if o.kind is bool:
            p.add_argument(*flags, dest=o.dest, action="store_true", help=o.help)
        elif issubclass(o.kind, StrEnum):
            p.add_argument(*flags, dest=o.dest, type=o.kind, choices=list(o.kind),
                           default=o.default, help=o.help)
        else:
            p.add_argument(*flags, dest=o.dest, default=o.default, help=o.help,
                           type=_positive(o.kind, o.flag, o.minimum))
    return p.parse_args(argv)


def make_data(args: argparse.Namespace, plan: Plan) -> TokenSource:
    t = plan.training
    if args.data is None:
        return SyntheticTokens(t.global_batch, t.seq_len, plan.model.vocab, args.seed)
    path, dtype = data_file(args)
    return TokenFile(path, dtype, t.global_batch, t.seq_len, args.seed, plan.model.vocab)


def data_file(args: argparse.Namespace) -> tuple[Path, type]:
    """The token file ``--data`` names and its numpy dtype: a Megatron indexed dataset's
    ``.bin`` (its dtype from the ``.idx``), or a raw token file."""
    if (prefix := indexed_prefix(args.data)) is not None:
        if args.data_dtype is not None:
            raise SpecError(f"--data-dtype: {args.data} is an indexed dataset, whose .idx "
                            "names its dtype")
        index = read_index(prefix)
        return index.bin, index.dtype
    dtype = args.data_dtype or TokenDtype.from_path(args.data)
    if dtype is None:
        raise SpecError(f"--data-dtype: needed for {args.data} (suffix is not .u16 or .u32, "
                        "and no PREFIX.idx is beside it)")
    return args.data, NUMPY_DTYPE[dtype]


def validate(args: argparse.Namespace, world: int) -> tuple[Plan, TokenSource]:
    plan = load_plan(args.plan)
    check_supported(plan, launch_backend())
    if plan.degrees.world != world:
        d = plan.degrees
        raise WorldSizeMismatch(
            f"degrees: plan needs pp x dp x cp x sp x tp = {d.pp} x {d.dp} x {d.cp} x {d.sp} x "
            f"{d.tp} = {d.world} processes, launched with WORLD_SIZE={world}"
        )
    for flag, value in (("--ckpt-every", args.ckpt_every), ("--ckpt-keep", args.ckpt_keep),
                        ("--resume", args.resume)):
        if value and args.ckpt_dir is None:
            raise SpecError(f"{flag}: needs --ckpt-dir")
    if args.overwrite and args.resume:
        raise SpecError("--overwrite: cannot be combined with --resume")
    lr = args.lr if args.lr is not None else OptimizerConfig.lr
    if args.min_lr > lr:
        raise SpecError(f"--min-lr ({args.min_lr:g}) is above --lr ({lr:g})")
    if args.compile_cache is not None:
        check_folder_target(args.compile_cache, "--compile-cache")
    data = make_data(args, plan)
    record = run_record(args, plan)
    if args.log_file is not None:
        check_appendable(args.log_file, "--log-file")
        check_log(args.log_file, record, args.resume)
    if args.ckpt_dir is not None:
        check_folder_target(args.ckpt_dir, "--ckpt-dir")
        checkpoint.check_run(args.ckpt_dir, record, args.resume, args.overwrite)
        if args.ckpt_every:
            checkpoint.check_space(args.ckpt_dir, checkpoint_size(plan))
    return plan, data


def checkpoint_size(plan: Plan) -> int:
    """One checkpoint's bytes as this machine writes it (bf16 parameters on CUDA, fp32 on
    CPU: runtime.trainer's parameter dtype)."""
    return checkpoint.checkpoint_bytes(plan, 2 if torch.cuda.is_available() else 4)


def run_id(record: checkpoint.RunRecord) -> str:
    """The run a log record belongs to: the job's digest (model, training spec, data, seed),
    so a resumed run keeps its id."""
    return record.job[:16]


def check_log(log: Path, record: checkpoint.RunRecord, resume: bool) -> None:
    """A log holds one run: another run's log is refused, and so is this run's own unless it
    resumes (a fresh start would repeat its steps)."""
    if not log.is_file() or log.stat().st_size == 0:
        return
    last = log.read_text(errors="replace").strip().splitlines()[-1]
    try:
        theirs = json.loads(last).get("run_id")
    except (json.JSONDecodeError, AttributeError):
        theirs = None
    if theirs != run_id(record):
        raise SpecError(f"--log-file: {log} holds the records of another run "
                        f"({theirs or 'without a run id'}; this run is {run_id(record)}); "
                        "give another file")
    if not resume:
        raise SpecError(f"--log-file: {log} already holds steps of this run; pass --resume to "
                        "continue it, or give another file")


def run_record(args: argparse.Namespace, plan: Plan) -> checkpoint.RunRecord:
    return checkpoint.RunRecord.of(plan, None if args.data is None else data_file(args)[0],
                                   args.seed)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """The learning rate of 0-based ``step``: linear warmup over --warmup-steps (step i at
    (i + 1) / warmup of --lr), then --lr (constant) or a half cosine from --lr at the end of
    the warmup to --min-lr at --steps (cosine)."""
    peak = args.lr if args.lr is not None else OptimizerConfig.lr
    if step < args.warmup_steps:
        return peak * (step + 1) / args.warmup_steps
    if args.lr_schedule == LrSchedule.constant:
        return peak
    span = max(args.steps - args.warmup_steps, 1)
    progress = min((step - args.warmup_steps) / span, 1.0)
    return args.min_lr + 0.5 * (peak - args.min_lr) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class RunLog:
    """Where rank 0 reports each step: the terminal, the JSON-lines log (every record with the
    run id and the plan's hash, and the plan fields the run executed differently, which the
    cost model prices it by: plans.execution.record) and TensorBoard."""

    path: Path | None
    run_id: str
    plan_sha256: str
    ran: list[dict]
    board: object | None = None

    def step(self, m: StepMetrics, lr: float, compiled: CacheCounts | None = None) -> None:
        """Print a step's line and append its record; ``compiled``: the graphs the step
        loaded from the compile cache or compiled."""
        line = (
            f"step {m.step + 1} loss {m.loss:.4f} lr {lr:.3g} tok/s {m.tokens_per_s:,.0f} "
            f"mfu {m.mfu:.2%} step {m.step_time_s * 1e3:.0f} ms peak "
            f"{m.peak_memory_gib:.2f} GiB"
        )
        if m.grad_norm is not None:  # --clip-grad: the norm before clipping
            line += f" grad norm {m.grad_norm:.3g}"
        compiled = compiled or CacheCounts()
        if compiled.hits or compiled.misses:
            line += f" (graphs: {compiled.hits} from cache, {compiled.misses} compiled)"
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"run_id": self.run_id, "plan_sha256": self.plan_sha256,
                                    **asdict(m), "step": m.step + 1, "lr": lr,
                                    "deviations": self.ran,
                                    "compiled_graphs": compiled.as_dict()}) + "\n")
        if self.board is not None:
            for name, value in (("loss", m.loss), ("lr", lr), ("tokens_per_s", m.tokens_per_s),
                                ("mfu", m.mfu), ("step_time_s", m.step_time_s),
                                ("peak_memory_gib", m.peak_memory_gib),
                                ("grad_norm", m.grad_norm)):
                if value is not None:
                    self.board.add_scalar(f"train/{name}", value, m.step + 1)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def tensorboard(folder: Path | None):
    """A TensorBoard writer into ``folder``, or None (no folder, or tensorboard missing: a
    note says so)."""
    if folder is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("note: --tensorboard-dir: tensorboard is not installed (pip install tensorboard); "
              "no scalars are written", file=sys.stderr, flush=True)
        return None
    return SummaryWriter(str(folder))


def compile_summary(step_times_s: list[float], compiled: CacheCounts, cache: Path) -> str:
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


@dataclass
class Progress:
    """The step a run is in, for the lines that say where it stopped; ``main`` owns it and
    the loop advances it."""

    step: int = 0


def _on_sigterm(rank: int, progress: Progress):
    def handler(_signum, _frame):
        print(f"error: rank {rank}: stopped by SIGTERM during step {progress.step + 1} "
              "(the launcher was stopped, or stopped the ranks after one failed)",
              file=sys.stderr, flush=True)
        os._exit(EXIT_SIGTERM)

    return handler


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help, or a bad option's line (already printed)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
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
    progress = Progress()
    owns_group = world > 1 and not dist.is_initialized()
    if owns_group:
        # NCCL's watchdog aborts the communicator on an error or timeout instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        start_process_group(rank, world, device, timedelta(seconds=args.timeout_s))
        signal.signal(signal.SIGTERM, _on_sigterm(rank, progress))
    if rank == 0:
        for d in deviations(plan, backend_of(device)):
            print(d.note(), file=sys.stderr, flush=True)
    try:
        return _train(args, plan, data, rank, world, device, owns_group, cache, progress)
    except torch.OutOfMemoryError:
        print(out_of_memory_line(plan, device, rank, progress.step), file=sys.stderr,
              flush=True)
        return EXIT_FAILED
    except checkpoint.CheckpointWriteFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except (dist.DistError, RuntimeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: rank {rank}: training stopped during step {progress.step + 1}: "
              f"a collective failed (a peer died or --timeout-s passed): {reason}",
              file=sys.stderr, flush=True)
        return EXIT_FAILED


def _train(args, plan: Plan, data: TokenSource, rank: int, world: int,
           device: torch.device, owns_group: bool, cache: Path, progress: Progress) -> int:
    optim = {k: v for k, v in (("lr", args.lr), ("weight_decay", args.weight_decay),
                               ("clip_grad", args.clip_grad)) if v is not None}
    trainer = build_trainer(
        plan, rank, world, device, args.seed, data,
        options=model_options(plan, args.aux_loss_coeff, args.per_expert_balance),
        optim=OptimizerConfig(**optim),
    )
    record_ = run_record(args, plan)
    start = 0
    if args.ckpt_dir is not None and args.ckpt_every:
        if rank == 0:  # the run's record first (check_run refused another run's directory)
            if args.overwrite and args.ckpt_dir.is_dir():
                checkpoint.clear(args.ckpt_dir)
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.write_record(args.ckpt_dir, record_)
        if dist.is_initialized():
            dist.barrier()
    if args.resume and (found := resume_point(args.ckpt_dir, rank)) is not None:
        start = checkpoint.load(trainer, found[0])
        if rank == 0:
            print(f"resumed from {found[0]} after step {start}", flush=True)
    log = RunLog(args.log_file, run_id(record_), record_.plan_sha256,
                 record(plan, backend_of(device)),
                 tensorboard(args.tensorboard_dir) if rank == 0 else None)
    needed = checkpoint_size(plan)
    saved: Path | None = None
    times: list[float] = []
    began = counted = cache_counts()
    for step in range(start, args.steps):
        progress.step = step
        lr = learning_rate(step, args)
        trainer.set_learning_rate(lr)
        metrics = trainer.train_step(step)
        now = cache_counts()
        times.append(metrics.step_time_s)
        if rank == 0:
            log.step(metrics, lr, now - counted)
        counted = now
        if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            saved = checkpoint.save(trainer, args.ckpt_dir, step + 1, needed)
            if rank == 0 and args.ckpt_keep:
                checkpoint.prune(args.ckpt_dir, args.ckpt_keep)
    log.close()
    if rank == 0 and times:
        print(compile_summary(times, counted - began, cache), flush=True)
    if rank == 0:
        print(summary(args, plan, start, saved), flush=True)
    # Process groups die while the interpreter is whole (mesh.end_process_groups says why):
    # the trainer's gradient hooks form a cycle that keeps it and its groups alive, so close()
    # unhooks them and destroys the trainer's groups first.
    trainer.close()
    del trainer
    if owns_group:
        end_process_groups()
    return 0


def summary(args, plan: Plan, start: int, saved: Path | None) -> str:
    """The end of a run in one line: the steps and tokens trained, where the checkpoints and
    the log are."""
    steps = args.steps - start
    tokens = steps * plan.training.tokens_per_step
    where = "none"
    if args.ckpt_dir is not None and (kept := checkpoint.complete(args.ckpt_dir)):
        where = (f"{args.ckpt_dir} ({len(kept)} kept, newest step-{kept[0][0]}"
                 f"{'' if saved is not None else ', none saved by this run'})")
    return (f"trained steps {start + 1}..{args.steps} ({steps} steps, {tokens:,} tokens); "
            f"checkpoints: {where}; log: {args.log_file or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
