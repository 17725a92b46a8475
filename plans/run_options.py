"""The training options of a run, declared once: ``python -m runtime.train`` builds its argparse
parser from them and ``moeplan train`` its typer options, so both take the same names, types
and defaults (the launcher passes them through unchanged)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class TokenDtype(StrEnum):
    """Width of a raw token file's little-endian unsigned ids."""

    u16 = "u16"
    u32 = "u32"

    @classmethod
    def from_path(cls, path: Path) -> TokenDtype | None:
        suffix = path.suffix.lstrip(".")
        return cls(suffix) if suffix in cls.__members__ else None


class LrSchedule(StrEnum):
    """The learning rate over the steps (runtime.train.learning_rate)."""

    constant = "constant"
    """--lr at every step (after --warmup-steps of linear warmup, if any)."""
    cosine = "cosine"
    """Linear warmup over --warmup-steps to --lr, then a cosine decay to --min-lr at --steps."""


@dataclass(frozen=True)
class RunOption:
    """One option of a training run."""

    flag: str
    kind: type
    """int, float, Path, bool (a switch) or a StrEnum (its values are the choices)."""
    default: object
    help: str
    aliases: tuple[str, ...] = ()
    minimum: float | None = None
    launcher: bool = True
    """Also an option of `moeplan train` (else the runtime's alone)."""

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


RUN_OPTIONS: tuple[RunOption, ...] = (
    RunOption("--steps", int, 10, "Optimizer steps to reach (with --resume: the step to "
              "reach).", minimum=1),
    RunOption("--data", Path, None, "Token data: a raw token file (.u16/.u32), or a "
              "Megatron-LM indexed dataset (PREFIX, PREFIX.bin or PREFIX.idx); synthetic "
              "tokens when absent."),
    RunOption("--data-dtype", TokenDtype, None, "Token width of a raw --data file (default: "
              "its suffix .u16/.u32)."),
    # torchrun's parser takes a bare --log before the script for its --log-dir: --log-file is
    # the name; --log is kept after the script
    RunOption("--log-file", Path, None, "JSON-lines log, one record per step, each with the "
              "run id and the plan's hash; a log of another run is refused, a resumed run "
              "continues its own.", aliases=("--log",)),
    RunOption("--tensorboard-dir", Path, None, "TensorBoard scalars (loss, learning rate, "
              "tokens/s, MFU, step time, peak memory) when tensorboard is installed."),
    RunOption("--ckpt-dir", Path, None, "Folder of checkpoints (torch DCP), one per saved "
              "step."),
    RunOption("--ckpt-every", int, 0, "Save a checkpoint every K steps (needs --ckpt-dir; "
              "0: never).", minimum=0),
    RunOption("--ckpt-keep", int, 0, "Keep the newest K complete checkpoints, deleting older "
              "ones after each save (0: keep all).", minimum=0),
    RunOption("--resume", bool, False, "Continue from the newest checkpoint in --ckpt-dir."),
    RunOption("--overwrite", bool, False, "Start afresh in a --ckpt-dir holding checkpoints "
              "(they are deleted first); without it such a folder is refused."),
    RunOption("--seed", int, 0, "Seed of the initial weights and of the data order."),
    RunOption("--lr", float, None, "Peak learning rate (default: runtime.parallel.optimizer."
              "OptimizerConfig's).", minimum=0.0),
    RunOption("--lr-schedule", LrSchedule, LrSchedule.constant, "Learning-rate schedule: "
              "constant, or cosine (warmup, then decay to --min-lr at --steps)."),
    RunOption("--warmup-steps", int, 0, "Steps of linear warmup from 0 to --lr.", minimum=0),
    RunOption("--min-lr", float, 0.0, "The cosine schedule's floor, reached at --steps.",
              minimum=0.0),
    RunOption("--weight-decay", float, None, "Decoupled weight decay of the matrices (default: "
              "runtime.parallel.optimizer.OptimizerConfig's).", minimum=0.0),
    RunOption("--clip-grad", float, 0.0, "Clip the gradients to this global L2 norm, over "
              "every parameter shard (0: no clipping).", minimum=0.0),
    RunOption("--aux-loss-coeff", float, None, "Balance-loss weight (default: the model's, "
              "ModelSpec.aux_loss_coeff).", minimum=0.0),
    RunOption("--per-expert-balance", bool, False, "Plain per-expert balance loss instead of "
              "one per EP rank."),
    RunOption("--timeout-s", float, 600.0, "Collective timeout: a rank waiting longer on a "
              "dead peer fails.", minimum=0.0),
    RunOption("--compile-cache", Path, None, "Folder of torch.compile's caches, shared by "
              "every plan and launch: a relaunch loads its compiled kernels (default: "
              "$TORCHINDUCTOR_CACHE_DIR, else ~/.cache/moeplan/torch_compile)."),
    RunOption("--check", bool, False, "Check the plan, data, output paths, free disk and this "
              "machine (LOCAL_WORLD_SIZE ranks), print nothing and exit 0 when all is well; "
              "start nothing.", launcher=False),
)


def run_argv(values: dict[str, object]) -> list[str]:
    """Command-line words for the options in ``values`` (by dest) that differ from their
    defaults, in the table's order."""
    out: list[str] = []
    for o in RUN_OPTIONS:
        value = values.get(o.dest, o.default)
        if value is None or value == o.default:
            continue
        out += [o.flag] if o.kind is bool else [o.flag, str(value)]
    return out
