"""Rank layout and process groups of a plan.

Rank order, innermost first (Megatron/MegaScale convention, paper Sec. 3): the attention axis
(sp, tp or cp) inside an NVLink domain, then dp, then pp. The FFN folds the same non-pipeline
ranks of a stage into (etp, ep, edp), etp innermost ("MoE parallel folding", Megatron-Core):

    rank  = (pp_i * dp + dp_i) * A + a_i            A = cp x sp x tp
    local = dp_i * A + a_i = (edp_i * ep + ep_i) * etp + etp_i
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch.distributed as dist

from plans import Degrees, Plan


class Group(StrEnum):
    """Process groups the runtime talks over."""

    attn = "attn"
    """The ranks sharing one sequence's attention (sp, tp or cp)."""
    dp = "dp"
    """Same attention shard, other data replicas: replication group of TP-sharded weights."""
    stage = "stage"
    """Every rank of a pipeline stage (dp x attention): replication group of dense weights."""
    ep = "ep"
    etp = "etp"
    """Ranks holding slices of the same experts (expert tensor parallelism)."""
    edp = "edp"
    """Same experts, other EP groups: replication group of expert weights."""
    embed = "embed"
    """First and last stage ranks at the same position: the two copies of tied embeddings."""


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    attn: int
    edp: int
    ep: int
    etp: int


def coords_of(rank: int, d: Degrees) -> Coords:
    a = d.attention_group
    stage_size = d.dp * a
    local = rank % stage_size
    return Coords(
        pp=rank // stage_size,
        dp=local // a,
        attn=local % a,
        edp=local // (d.ep * d.etp),
        ep=(local // d.etp) % d.ep,
        etp=local % d.etp,
    )


def group_members(d: Degrees) -> dict[Group, list[list[int]]]:
    """Every group of every kind, as rank lists, in a fixed order (all ranks create all groups
    in the same order, as torch.distributed.new_group requires)."""
    a = d.attention_group
    stage_size = d.dp * a
    out: dict[Group, list[list[int]]] = {g: [] for g in Group}
    for pp in range(d.pp):
        base = pp * stage_size
        for dp in range(d.dp):
            out[Group.attn].append([base + dp * a + i for i in range(a)])
        for i in range(a):
            out[Group.dp].append([base + dp * a + i for dp in range(d.dp)])
        out[Group.stage].append([base + i for i in range(stage_size)])
        for edp in range(d.edp):
            for etp in range(d.etp):
                out[Group.ep].append(
                    [base + (edp * d.ep + ep) * d.etp + etp for ep in range(d.ep)]
                )
        for edp in range(d.edp):
            for ep in range(d.ep):
                first = base + (edp * d.ep + ep) * d.etp
                out[Group.etp].append([first + i for i in range(d.etp)])
        for i in range(d.ep * d.etp):
            out[Group.edp].append([base + edp * d.ep * d.etp + i for edp in range(d.edp)])
    last = (d.pp - 1) * stage_size
    out[Group.embed] = [[i, last + i] if d.pp > 1 else [i] for i in range(stage_size)]
    return out


@dataclass
class Mesh:
    """This rank's coordinates and process groups; a group of one rank is None (no traffic)."""

    degrees: Degrees
    rank: int
    coords: Coords
    groups: dict[Group, dist.ProcessGroup | None] = field(default_factory=dict)
    members: dict[Group, list[int]] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.degrees.world

    @property
    def first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.coords.pp == self.degrees.pp - 1

    def stage_peer(self, offset: int) -> int:
        """Global rank at the same position on the stage ``offset`` stages away."""
        return self.rank + offset * self.degrees.dp * self.degrees.attention_group

    def size(self, g: Group) -> int:
        return len(self.members[g])

    def index(self, g: Group) -> int:
        return self.members[g].index(self.rank)


class WorldSizeMismatch(ValueError):
    """The launch's world size differs from the plan's."""


def build_mesh(plan: Plan, rank: int, world: int) -> Mesh:
    """Process groups of ``plan`` for this rank; raises WorldSizeMismatch before any work when
    the launch has another world size than the plan."""
    d = plan.degrees
    if d.world != world:
        raise WorldSizeMismatch(
            f"degrees: plan needs pp x dp x cp x sp x tp = {d.pp} x {d.dp} x {d.cp} x {d.sp} x "
            f"{d.tp} = {d.world} processes, launched with WORLD_SIZE={world}"
        )
    mesh = Mesh(degrees=d, rank=rank, coords=coords_of(rank, d))
    for g, lists in group_members(d).items():
        for ranks in lists:
            pg = dist.new_group(ranks) if world > 1 and len(ranks) > 1 else None
            if rank in ranks:
                mesh.groups[g] = pg
                mesh.members[g] = ranks
    return mesh
