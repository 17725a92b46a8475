"""Checkpoints with torch.distributed.checkpoint (DCP).

Keys are global: a parameter is stored under its plain-model name, plus ``.shard<i>of<n>`` when
this rank holds a slice, so replicas write one copy (DCP deduplicates equal keys) and shards
never collide. A checkpoint is written to ``.tmp-step-N`` and renamed to ``step-N`` once every
rank has finished, so a directory named ``step-N`` is always complete. Rank 0 then writes
``manifest.json`` (size and SHA-256 of every file) before the rename; ``find_resumable`` checks
it and skips a damaged checkpoint (file missing, truncated or altered, manifest missing or
unreadable) for the previous valid one.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from runtime.trainer import Trainer

COMPLETE = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"


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


def complete(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Renamed (complete) checkpoints, newest first."""
    found = [
        (int(m.group(1)), p)
        for p in ckpt_dir.glob("step-*")
        if (m := COMPLETE.match(p.name)) and p.is_dir()
    ]
    return sorted(found, reverse=True)


def latest(ckpt_dir: Path) -> tuple[Path, int] | None:
    """The newest complete checkpoint and its step (not verified)."""
    found = complete(ckpt_dir)
    return (found[0][1], found[0][0]) if found else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path, step: int) -> None:
    files = {
        str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in _files(root)
    }
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    tmp.rename(root / MANIFEST)


def verify(root: Path) -> str | None:
    """What is wrong with checkpoint ``root``, or None when every file matches its manifest."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    if (m := COMPLETE.match(root.name)) and int(m.group(1)) != step:
        return f"{MANIFEST} is for step {step}"
    if not files:
        return f"{MANIFEST} lists no files"
    for rel, meta in files.items():
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{rel} has {size} bytes, {meta['size']} were written"
        if _sha256(path) != meta["sha256"]:
            return f"{rel} does not match its SHA-256"
    return None


def find_resumable(
    ckpt_dir: Path, report: Callable[[str], None] = print
) -> tuple[Path, int] | None:
    """The newest checkpoint that passes ``verify``; each skipped one is reported in a line."""
    for step, path in complete(ckpt_dir):
        problem = verify(path)
        if problem is None:
            return path, step
        report(f"warning: checkpoint {path} is damaged ({problem}); trying the previous one")
    return None


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
        write_manifest(tmp, step)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def load(trainer: Trainer, path: Path) -> int:
    """Load in place; returns the number of completed steps stored."""
    state = state_dict(trainer)
    dcp.load(state, checkpoint_id=str(path))
    return int(state["trainer.step"])
