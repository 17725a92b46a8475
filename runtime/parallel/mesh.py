"""A plan's process groups, on torch's DeviceMesh with named dimensions.

The rank layout is ``plans.layout`` (the one definition the cost model uses too): three views
of the same ranks, each a DeviceMesh whose named dimensions are ``plans.MeshAxis`` members,

    attention view  (pp, dp, attn)        Ulysses / TP attention over attn, TP weights over dp
    FFN view        (pp, edp, ep, etp)    dispatch over ep, expert TP over etp, experts over edp
    stage view      (pp, stage)           dense weights' gradients over every rank of a stage

plus the tied-embedding pairs (``embed``: first and last stage), which are no mesh dimension
and get their own groups. A group of one rank is None (no traffic); a one-process run builds
no DeviceMesh (it needs an initialised process group).
"""

from __future__ import annotations

import atexit
import gc
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from plans import Degrees, MeshAxis, Plan
from plans.layout import VIEWS, coordinate, group_of, groups, stage_peer, view_shape


@dataclass
class Mesh:
    """This rank's place in the layout and its process groups along every axis."""

    degrees: Degrees
    rank: int
    groups: dict[MeshAxis, dist.ProcessGroup | None] = field(default_factory=dict)
    members: dict[MeshAxis, list[int]] = field(default_factory=dict)
    views: tuple[DeviceMesh, ...] = ()
    """The DeviceMesh of each view (empty for one process)."""

    @property
    def world(self) -> int:
        return self.degrees.world

    def coord(self, axis: MeshAxis) -> int:
        return coordinate(self.rank, self.degrees, axis)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.coord(MeshAxis.pp)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.degrees.pp - 1

    def stage_peer(self, offset: int) -> int:
        """Global rank at the same position on the stage ``offset`` stages away."""
        return stage_peer(self.rank, self.degrees, offset)

    def size(self, axis: MeshAxis) -> int:
        return len(self.members[axis])

    def index(self, axis: MeshAxis) -> int:
        return self.members[axis].index(self.rank)

    def close(self) -> None:
        """Destroy the process groups this mesh created (its views' dimensions and the
        embedding pair), once every rank is done with them: a process that builds another
        trainer would otherwise keep every earlier one's communicators (gloo: three polling
        threads each). The default group stays."""
        if not self.views:
            return
        dist.barrier()
        seen: dict[int, dist.ProcessGroup] = {}
        for dm in self.views:
            for name in dm.mesh_dim_names or ():
                pg = dm.get_group(name)
                seen[id(pg)] = pg
        if (embed := self.groups.get(MeshAxis.embed)) is not None:
            seen[id(embed)] = embed
        for pg in seen.values():
            if pg is not dist.GroupMember.WORLD:
                dist.destroy_process_group(pg)
        self.views = ()
        self.groups = dict.fromkeys(self.groups)


class WorldSizeMismatch(ValueError):
    """The launch's world size differs from the plan's."""


def build_mesh(plan: Plan, rank: int, world: int, device_type: str = "cpu") -> Mesh:
    """Process groups of ``plan`` for this rank; raises WorldSizeMismatch before any work when
    the launch has another world size than the plan."""
    d = plan.degrees
    if d.world != world:
        raise WorldSizeMismatch(
            f"degrees: plan needs pp x dp x cp x sp x tp = {d.pp} x {d.dp} x {d.cp} x {d.sp} x "
            f"{d.tp} = {d.world} processes, launched with WORLD_SIZE={world}"
        )
    mesh = Mesh(degrees=d, rank=rank)
    for axis in MeshAxis:
        mesh.members[axis] = group_of(rank, d, axis)
        mesh.groups[axis] = None
    if world == 1:
        return mesh
    # every rank builds the same views and groups in the same order (new_group's rule)
    ranks = torch.arange(world)
    views = []
    for view in VIEWS:
        names = tuple(a.value for a in view)
        dm = DeviceMesh(device_type, ranks.view(view_shape(d, view)), mesh_dim_names=names)
        views.append(dm)
        for axis in view:
            if mesh.groups[axis] is None and len(mesh.members[axis]) > 1:
                mesh.groups[axis] = dm.get_group(axis.value)
    mesh.views = tuple(views)
    for pair in groups(d, MeshAxis.embed):
        pg = dist.new_group(pair) if len(pair) > 1 else None
        if rank in pair:
            mesh.groups[MeshAxis.embed] = pg
    for axis, pg in mesh.groups.items():
        if pg is not None and dist.get_process_group_ranks(pg) != mesh.members[axis]:
            raise RuntimeError(f"mesh: the {axis} group {dist.get_process_group_ranks(pg)} is "
                               f"not plans.layout's {mesh.members[axis]}")
    return mesh


def start_process_group(rank: int, world: int, device: torch.device, timeout: timedelta,
                        init_method: str | None = None) -> None:
    """Join the launch's default process group: NCCL bound to this rank's GPU on CUDA, gloo
    on CPU (``init_method``: the rendezvous, the launcher's environment when None)."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=timeout,
                            device_id=device if cuda else None)


def end_process_groups() -> None:
    """End a distributed run: every rank past its last collective (a barrier: gloo aborts a
    peer whose pair closes under it), then every process group destroyed while the interpreter
    is still whole.

    A gloo worker thread drops a finished collective's tensors after it has woken the rank
    waiting on it, and dropping a tensor that Python has seen takes the GIL. Once Python is
    finalising, a thread that takes the GIL is ended, and ending it inside that C++ destructor
    aborts the process ("terminate called without an active exception"; torch 2.13 CPU, about
    one exit in ten with the machine loaded: the core dump has ``ProcessGroupGloo::runLoop``
    in ``~AsyncBarrierWork`` under ``PyThread_exit_thread``). A group's destructor joins its
    worker threads, so the groups must die before finalisation; destroy_process_group only
    unregisters them, and a reference cycle (a dispatcher inside a module cycle) can keep one
    alive until the collector runs at finalisation. So a collection is registered to run at
    exit, before finalisation, when the caller's frames (which may hold a group) are gone."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    atexit.register(gc.collect)
