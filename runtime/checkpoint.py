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
from pathlib import Path, PurePosixPath
from typing import Annotated

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError
from torch.distributed.checkpoint.api import CheckpointException

from plans import Plan, SpecError
from plans.enums import OptimizerSharding
from plans.errors import describe
from plans.io import read_text, write_atomic
from runtime.trainer import Trainer

COMPLETE = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
RUN = "run.json"


# ---- typed documents: the manifest of one checkpoint, the record of the run ---------------------


class _Doc(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _relative(path: str) -> str:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts:
        raise ValueError(f"{path!r} is not a path inside the checkpoint")
    return path


class FileEntry(_Doc):
    size: NonNegativeInt
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(_Doc):
    """``manifest.json``: the step and every file of one checkpoint with its size and SHA-256."""

    step: NonNegativeInt
    files: dict[Annotated[str, AfterValidator(_relative)], FileEntry] = Field(min_length=1)


class DataRecord(_Doc):
    path: str
    bytes: NonNegativeInt


class RunRecord(_Doc):
    """``run.json``: which run wrote a checkpoint directory. ``job`` identifies the training run
    (model, training spec, data, seed): another job's checkpoints are never resumed or mixed in.
    ``layout`` is the plan's parallel layout, whose keys the checkpoints are written under."""

    job: str
    """SHA-256 of the model, the training spec, the data and the seed."""
    plan_sha256: str
    layout: str
    seed: int
    data: DataRecord | None

    @staticmethod
    def of(plan: Plan, data: Path | None, seed: int) -> RunRecord:
        data_rec = None
        if data is not None:
            data_rec = DataRecord(path=str(data.resolve()), bytes=data.stat().st_size)
        job = {"model": plan.model.model_dump(mode="json"),
               "training": plan.training.model_dump(mode="json"),
               "data": data_rec.model_dump() if data_rec else None, "seed": seed}
        d = plan.degrees
        layout = (f"pp{d.pp} vpp{d.vpp} dp{d.dp} {plan.attention.kind}{d.attention_group} "
                  f"{plan.ffn.kind} ep{d.ep} etp{d.etp} "
                  f"optimizer_sharding={plan.optimizer_sharding}")
        return RunRecord(job=_digest(job), plan_sha256=_digest(plan.model_dump(mode="json")),
                         layout=layout, seed=seed, data=data_rec)


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def read_record(ckpt_dir: Path) -> RunRecord | None:
    """The run record of ``ckpt_dir``; None when there is none; SpecError when it is damaged."""
    path = ckpt_dir / RUN
    if not path.exists():
        return None
    where = f"--ckpt-dir: {path}"
    try:
        return RunRecord.model_validate_json(read_text(path, where, "json"))
    except ValidationError as e:
        raise SpecError(f"{where}: {describe(e)}") from None


def write_record(ckpt_dir: Path, record: RunRecord) -> None:
    write_atomic(ckpt_dir / RUN, record.model_dump_json(indent=1), "--ckpt-dir", force=True)


def check_run(ckpt_dir: Path, record: RunRecord, resume: bool, overwrite: bool) -> None:
    """Refuse (one line) to mix two runs in one checkpoint directory: resuming another job's
    checkpoints, resuming under another layout (not resharded yet), or starting afresh over
    another run's checkpoints without ``overwrite``."""
    if overwrite or not ckpt_dir.is_dir() or not complete(ckpt_dir):
        return
    theirs = read_record(ckpt_dir)
    if theirs is None:
        raise SpecError(f"--ckpt-dir: {ckpt_dir} holds checkpoints without a {RUN} (written "
                        "by another program or an older moeplan); pass --overwrite to replace "
                        "them")
    if theirs.job != record.job:
        what = ("seed" if theirs.seed != record.seed else
                "data" if theirs.data != record.data else "model or training spec")
        hint = "pass --overwrite to replace them" if not resume else "it cannot be resumed"
        raise SpecError(f"--ckpt-dir: {ckpt_dir} holds checkpoints of another run (its {what} "
                        f"differs); {hint}")
    if resume and theirs.layout != record.layout and not (
            reshardable(theirs.layout) and reshardable(record.layout)):
        raise SpecError(f"--resume: the checkpoints in {ckpt_dir} were written under layout "
                        f"'{theirs.layout}', this run is '{record.layout}'; resharding needs "
                        "optimizer_sharding none in both plans: ZeRO-1 buckets are not "
                        "resharded")
    if not resume and theirs.layout != record.layout:
        raise SpecError(f"--ckpt-dir: {ckpt_dir} holds this run's checkpoints under layout "
                        f"'{theirs.layout}'; pass --resume with that plan, or --overwrite")
    if not resume:  # starting at step 1 would overwrite them one by one
        raise SpecError(f"--ckpt-dir: {ckpt_dir} holds this run's checkpoints up to step "
                        f"{complete(ckpt_dir)[0][0]}; pass --resume or --overwrite")


# ---- disk space ---------------------------------------------------------------------------------

GIB = 2**30


def checkpoint_bytes(plan: Plan, param_bytes: int) -> int:
    """Bytes one checkpoint of ``plan`` writes, all ranks together: every parameter once (DCP
    keeps one copy of replicated keys; shards are disjoint) in the parameter dtype
    (``param_bytes``: 2 for bf16 on GPUs, 4 for fp32 on CPU), plus its optimizer states in
    fp32 (Optimizer.state_bytes_per_param), ZeRO-1 slices or whole (the same total); an fp32
    parameter is its own master weight (runtime.parallel.optimizer._master), stored once.
    DCP's metadata and the manifest add a few percent."""
    own_master = 4 if param_bytes == 4 else 0
    per_param = param_bytes + plan.training.optimizer.state_bytes_per_param - own_master
    return plan.model.total_params * per_param


def size_text(n: int) -> str:
    """Bytes for a reader: GiB from one GiB up, MiB below."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def free_bytes(folder: Path) -> int:
    """Free bytes, for an unprivileged writer, on the filesystem that holds (or will hold)
    ``folder``: its nearest existing ancestor's."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_space(ckpt_dir: Path, needed: int) -> None:
    """Refuse a checkpoint folder whose filesystem cannot hold one checkpoint."""
    free = free_bytes(ckpt_dir)
    if free < needed:
        raise SpecError(f"--ckpt-dir: {ckpt_dir} has {size_text(free)} free, one checkpoint "
                        f"of this plan takes {size_text(needed)}")


class CheckpointWriteFailed(Exception):
    """A checkpoint could not be written (no space, an I/O error); its partial folder is
    removed and the earlier complete checkpoints are kept."""

    def __init__(self, rank: int, step: int, folder: Path, needed: int, reason: str):
        free = free_bytes(folder)
        super().__init__(f"rank {rank}: writing the checkpoint of step {step} to {folder} "
                         f"failed ({reason}); it needs {size_text(needed)}, "
                         f"{size_text(free)} are free; removed its partial "
                         f".tmp-step-{step}, earlier checkpoints are kept")


def prune(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns the deleted ones."""
    gone = [p for _, p in complete(ckpt_dir)[keep:]]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def reshardable(layout: str) -> bool:
    """Checkpoints of this layout can be loaded under another: every tensor is stored under its
    parameter's global name, whole or as equal slices along one dimension (``.shard<i>of<n>``);
    ZeRO-1 stores flat bucket slices whose composition depends on the layout."""
    return layout.endswith(f"optimizer_sharding={OptimizerSharding.none}")


def clear(ckpt_dir: Path) -> None:
    """Delete every checkpoint and the run record of ``ckpt_dir`` (``--overwrite``)."""
    for p in [*ckpt_dir.glob("step-*"), *ckpt_dir.glob(".tmp-step-*")]:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
    (ckpt_dir / RUN).unlink(missing_ok=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def state_dict(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {
        f"model.{trainer.checkpoint_key(name)}": p.data
        for name, p in trainer.model.named_parameters()
    }
    # the routers' expert biases: state of the run outside the gradient (runtime.moe)
    out.update({f"model.{name}": b for name, b in trainer.model.named_buffers()
                if name.endswith("router.expert_bias")})
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
    files = {str(p.relative_to(root)): FileEntry(size=p.stat().st_size, sha256=_sha256(p))
             for p in _files(root)}
    write_atomic(root / MANIFEST, Manifest(step=step, files=files).model_dump_json(indent=1),
                 "--ckpt-dir", force=True)


def verify(root: Path) -> str | None:
    """What is wrong with checkpoint ``root``, or None when every file matches its manifest
    (a typed document: a manifest of any other shape is reported, never trusted)."""
    if not (root / MANIFEST).exists():
        return f"{MANIFEST} is missing"
    try:
        manifest = Manifest.model_validate_json(read_text(root / MANIFEST, MANIFEST, "json"))
    except SpecError as e:
        return f"{MANIFEST} is unreadable ({str(e).removeprefix(MANIFEST + ': ')})"
    except ValidationError as e:
        return f"{MANIFEST} is unreadable ({describe(e)})"
    if (m := COMPLETE.match(root.name)) and int(m.group(1)) != manifest.step:
        return f"{MANIFEST} is for step {manifest.step}"
    for rel, meta in manifest.files.items():
        path = root / rel
        if not path.is_file() or path.is_symlink():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != meta.size:
            return f"{rel} has {size} bytes, {meta.size} were written"
        if _sha256(path) != meta.sha256:
            return f"{rel} does not match its SHA-256"
    return None


def find_resumable(
    ckpt_dir: Path, report: Callable[[str], None] = print
) -> tuple[Path, int] | None:
    """The newest checkpoint that passes ``verify``; each skipped one is reported in a line."""
    named = sorted(((int(m.group(1)), p) for p in ckpt_dir.glob("step-*")
                    if (m := COMPLETE.match(p.name))), reverse=True)
    for step, path in named:
        problem = verify(path) if path.is_dir() else "not a directory"
        if problem is None:
            return path, step
        report(f"warning: checkpoint {path} is damaged ({problem}); trying the previous one")
    return None


def save(trainer: Trainer, ckpt_dir: Path, step: int, needed: int = 0) -> Path:
    """Save after ``step`` steps have completed. A write that fails (OSError on this rank, or
    DCP's CheckpointException gathering one from any rank) removes ``.tmp-step-N`` and raises
    CheckpointWriteFailed (``needed``: the checkpoint's bytes, for its message)."""
    tmp, final = ckpt_dir / f".tmp-step-{step}", ckpt_dir / f"step-{step}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    rank0 = rank == 0
    if rank0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    state = state_dict(trainer)
    state["trainer.step"].fill_(step)
    try:
        dcp.save(state, checkpoint_id=str(tmp))
        _barrier()
        if rank0:
            write_manifest(tmp, step)
    except (OSError, CheckpointException, SpecError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteFailed(rank, step, ckpt_dir, needed, _write_error(e)) from None
    if rank0:
        if final.is_symlink() or (final.exists() and not final.is_dir()):
            final.unlink()
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def _write_error(e: BaseException) -> str:
    """The first line of a failed write's reason: the OSError's own text (DCP wraps each
    rank's failure in a CheckpointException, whose line names the ranks and the error)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, OSError) and cause.strerror:
                return cause.strerror
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# a stored key: "model.<name>[.shard<i>of<n>]" or "optim.<name>[.shard<i>of<n>].<state>"
_KEY = re.compile(r"^(?P<head>model|optim)\.(?P<base>.+?)(?:\.shard(?P<i>\d+)of(?P<n>\d+))?"
                  r"(?P<tail>\.(?:master|exp_avg|exp_avg_sq|step))?$")


def _group(key: str) -> tuple[str, str, str] | None:
    m = _KEY.match(key)
    return (m["head"], m["base"], m["tail"] or "") if m else None


def load(trainer: Trainer, path: Path) -> int:
    """Load in place; returns the number of completed steps stored. A tensor stored under
    another layout (whole, or sliced in other pieces or along another dimension) is rebuilt
    whole from its stored pieces and this rank's piece taken (``reshard``)."""
    state = state_dict(trainer)
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    same = {k: t for k, t in state.items()
            if k in meta and tuple(getattr(meta[k], "size", ())) == tuple(t.shape)}
    other = {k: t for k, t in state.items() if k not in same}
    if not other:
        dcp.load(state, checkpoint_id=str(path))
        return int(state["trainer.step"])
    stored: dict[tuple[str, str, str], list[tuple[int, str]]] = {}
    for key in meta:
        m = _KEY.match(key)
        if m and hasattr(meta[key], "size"):
            stored.setdefault(_group(key), []).append((int(m["i"] or 0), key))
    pieces: dict[str, torch.Tensor] = {}
    sources: dict[str, list[str]] = {}
    for key in other:
        found = sorted(stored.get(_group(key) or ("", key, ""), []))
        if not found:
            raise SpecError(f"--resume: {path} holds no {key} (was it written for this model?)")
        sources[key] = [k for _, k in found]
        for k in sources[key]:
            pieces[k] = torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype)
    dcp.load({**same, **pieces}, checkpoint_id=str(path))
    shard_of = {trainer.checkpoint_key(n): trainer.pm.shards.get(n)
                for n, _ in trainer.model.named_parameters()}
    for key, target in other.items():
        mine = shard_of.get(_group(key)[1] + _shard_suffix(key))
        target.copy_(reshard([pieces[k] for k in sources[key]], target, mine, key))
    return int(state["trainer.step"])


def _shard_suffix(key: str) -> str:
    m = _KEY.match(key)
    return f".shard{m['i']}of{m['n']}" if m and m["i"] is not None else ""


def reshard(stored: list[torch.Tensor], target: torch.Tensor, mine, key: str) -> torch.Tensor:
    """This rank's piece of a tensor stored as ``stored`` (its pieces in order, or the whole):
    whole = the pieces joined along the one dimension where they are smaller than the whole,
    then ``mine`` (a runtime.model.Shard, None for a whole tensor) taken from it."""
    if target.dim() == 0:  # AdamW's step count: the same on every piece
        return stored[0]
    full = list(target.shape)
    if mine is not None:
        full[mine.dim] *= mine.parts
    whole = stored[0]
    if len(stored) > 1:
        dims = [d for d in range(whole.dim()) if whole.shape[d] * len(stored) == full[d]]
        if len(dims) != 1:
            raise SpecError(f"--resume: cannot rebuild {key} from {len(stored)} pieces of "
                            f"{tuple(whole.shape)} (whole {tuple(full)})")
        whole = torch.cat(stored, dim=dims[0])
    if list(whole.shape) != full:
        raise SpecError(f"--resume: {key} is stored as {tuple(whole.shape)}, this layout needs "
                        f"{tuple(full)} (another model?)")
    return whole if mine is None else mine.take(whole)
