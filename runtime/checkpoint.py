"""Checkpoints with torch.distributed.checkpoint (DCP).

Keys are global: a parameter is stored under its plain-model name, plus ``.shard<i>of<n>`` when
this rank holds a slice, so replicas write one copy (DCP deduplicates equal keys) and shards
never collide. A checkpoint is written to ``.tmp-step-N`` and renamed to ``step-N`` once every
rank has finished, so a directory named ``step-N`` is always complete.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from runtime.trainer import Trainer

COMPLETE = re.compile(r"^step-(\d+)$")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def state_dict(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {
        f"model.{trainer.checkpoint_key(name)}": p.data
        for name, p in trainer.model.named_parameters()
    }
    out.update(trainer.optimizer.checkpoint_state(trainer.checkpoint_key))
    out["trainer.step"] = torch.zeros((), dtype=torch.int64)
    return out


def latest(ckpt_dir: Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint and its step."""
    found = [
        (int(m.group(1)), p)
        for p in ckpt_dir.glob("step-*")
        if (m := COMPLETE.match(p.name)) and p.is_dir()
    ]
    if not found:
        return None
    step, path = max(found)
    return path, step


def save(trainer: Trainer, ckpt_dir: Path, step: int) -> Path:
    """Save after ``step`` steps have completed."""
    tmp, final = ckpt_dir / f".tmp-step-{step}", ckpt_dir / f"step-{step}"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = state_dict(trainer)
    state["trainer.step"].fill_(step)
    dcp.save(state, checkpoint_id=str(tmp))
    _barrier()
    if rank0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def load(trainer: Trainer, path: Path) -> int:
    """Load in place; returns the number of completed steps stored."""
    state = state_dict(trainer)
    dcp.load(state, checkpoint_id=str(path))
    return int(state["trainer.step"])
