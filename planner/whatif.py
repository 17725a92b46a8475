"""What-if analysis: change the hardware, re-plan, and see what the best layout becomes."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from enum import StrEnum

from planner.search import SearchResult, Session, check_searches, search
from planner.space import SearchSpace
from plans import ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec


class Knob(StrEnum):
    """Hardware knobs, and how much communication the runtime hides beside compute. Values are
    absolute (in the unit named) or multipliers like `2x`."""

    gpu_tflops = "gpu_tflops"
    """Dense bf16 TFLOP/s (fp8 scales with it)."""
    hbm_gib = "hbm_gib"
    hbm_tb_s = "hbm_tb_s"
    nvlink_gb_s = "nvlink_gb_s"
    """NVLink GB/s per GPU per direction."""
    nvlink_domain = "nvlink_domain"
    """GPUs per NVLink domain (8 for a node, 72 for an NVL72 rack)."""
    network_gb_s = "network_gb_s"
    """Scale-out GB/s per GPU per direction."""
    overlap_share = "overlap_share"
    """Share of communication hidden while compute runs beside it, 0 to 1
    (efficiency.overlap): what copy-engine transfers would buy over NCCL beside the GEMMs,
    which hid none of it on H200s (`moeplan calibrate --overlap`)."""


@dataclass(frozen=True)
class Setting:
    knob: Knob
    text: str
    """As the user wrote it: `2x` or `900`."""

    def apply(self, cluster: ClusterSpec) -> ClusterSpec:
        data = cluster.model_dump()
        gpu, node, net = data["gpu"], data["node"], data["network"]
        current = {
            Knob.gpu_tflops: gpu["bf16_dense_tflops"],
            Knob.hbm_gib: gpu["hbm_gib"],
            Knob.hbm_tb_s: gpu["hbm_tb_s"],
            Knob.nvlink_gb_s: node["nvlink_gb_s"],
            Knob.nvlink_domain: node["gpus_per_node"],
            Knob.network_gb_s: cluster.network_gb_s_per_gpu,
            Knob.overlap_share: cluster.efficiency.overlap,
        }[self.knob]
        value = self.value(current)
        if self.knob == Knob.gpu_tflops:
            gpu["fp8_dense_tflops"] *= value / gpu["bf16_dense_tflops"]
            gpu["bf16_dense_tflops"] = value
        elif self.knob in (Knob.hbm_gib, Knob.hbm_tb_s):
            gpu[self.knob.value] = value
        elif self.knob == Knob.nvlink_gb_s:
            node["nvlink_gb_s"] = value
        elif self.knob == Knob.overlap_share:
            data["efficiency"]["overlap"] = value
        elif self.knob == Knob.nvlink_domain:
            if value != int(value):
                raise SpecError(f"--vary nvlink_domain: {self.text} is not a whole GPU count")
            per_gpu_nic = net["nics_per_node"] / node["gpus_per_node"]
            node["gpus_per_node"] = int(value)
            # keep scale-out bandwidth per GPU: NICs grow with the domain
            net["nics_per_node"] = max(1, round(per_gpu_nic * int(value)))
        else:
            net["nic_gb_s"] *= value / current
        try:
            return ClusterSpec.model_validate(data)
        except Exception as e:  # pydantic ValidationError
            from plans.errors import describe

            raise SpecError(f"--vary {self.knob}={self.text}: {describe(e)}") from None

    def value(self, current: float) -> float:
        text = self.text.strip().lower()
        try:
            number = float(text[:-1]) if text.endswith("x") else float(text)
        except ValueError:
            raise SpecError(f"--vary {self.knob}: {self.text!r} is not a number or a "
                            "multiplier like 2x") from None
        if not math.isfinite(number):
            raise SpecError(f"--vary {self.knob}: {self.text!r} must be a finite number")
        if self.knob == Knob.overlap_share:
            if number < 0:
                raise SpecError(f"--vary {self.knob}: {self.text!r} must be 0 or more")
        elif number <= 0:
            raise SpecError(f"--vary {self.knob}: {self.text!r} must be positive")
        return current * number if text.endswith("x") else number


def parse_vary(spec: str) -> list[Setting]:
    """`KNOB=V1,V2,...` -> one Setting per value."""
    if "=" not in spec:
        raise SpecError(f"--vary: {spec!r} must look like KNOB=V1,V2 (knobs: "
                        f"{', '.join(k.value for k in Knob)})")
    name, values = spec.split("=", 1)
    try:
        knob = Knob(name.strip())
    except ValueError:
        raise SpecError(f"--vary: unknown knob {name.strip()!r}; knobs: "
                        f"{', '.join(k.value for k in Knob)}") from None
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise SpecError(f"--vary {knob}: no values given")
    if len(set(items)) < len(items):
        twice = next(v for v in items if items.count(v) > 1)
        raise SpecError(f"--vary {knob}: value {twice!r} given twice")
    return [Setting(knob, v) for v in items]


def check_knobs_once(varies: list[list[Setting]]) -> None:
    """Each knob in one --vary: two would multiply into one point, not make a grid."""
    seen: set[Knob] = set()
    for settings in varies:
        knob = settings[0].knob
        if knob in seen:
            raise SpecError(f"--vary {knob}: given twice; list its values in one --vary "
                            f"({knob}=V1,V2)")
        seen.add(knob)


@dataclass(frozen=True)
class Point:
    settings: tuple[Setting, ...]
    cluster: ClusterSpec
    result: SearchResult
    machine: str | None = None
    """The cluster's name as given, where several machines are compared."""

    @property
    def label(self) -> str:
        knobs = ", ".join(f"{s.knob}={s.text}" for s in self.settings)
        if self.machine is not None:
            return f"{self.machine}, {knobs}" if knobs else self.machine
        return knobs or "as given"


def whatif(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
           varies: list[list[Setting]], space: SearchSpace | None = None,
           progress=None) -> list[Point]:
    """Re-plan at every point of the grid of knob values (the cartesian product); the points
    share what their clusters' speeds leave alone (planner.search.Session)."""
    check_knobs_once(varies)
    check_searches(math.prod(len(v) for v in varies), "--vary")
    grid = list(itertools.product(*varies)) if varies else [()]
    points = []
    session = Session()
    for i, combo in enumerate(grid):
        changed = cluster
        for setting in combo:
            changed = setting.apply(changed)
        points.append(Point(combo, changed, search(model, changed, training, space, top=1,
                                                   session=session)))
        if progress is not None:
            progress(i + 1, len(grid))
    return points


def whatif_machines(model: ModelSpec, clusters: list[tuple[str, ClusterSpec]],
                    training: TrainingSpec, varies: list[list[Setting]],
                    space: SearchSpace | None = None, progress=None) -> list[Point]:
    """Each machine (name as given, cluster at the job's GPU count) re-planned at every point
    of the grid of knob values: machine by machine, the grid inside."""
    check_knobs_once(varies)
    per_machine = math.prod(len(v) for v in varies)
    check_searches(len(clusters) * per_machine, "--cluster" if len(clusters) > 1 else "--vary")
    points: list[Point] = []
    for name, cluster in clusters:
        done = len(points)
        step = None if progress is None else (
            lambda i, n, done=done: progress(done + i, len(clusters) * per_machine))
        points += [replace(p, machine=name)
                   for p in whatif(model, cluster, training, varies, space, progress=step)]
    return points


def plan_changes(before: Plan | None, after: Plan | None) -> list[str]:
    """What differs between two best plans: degrees, strategies, dispatch, options."""
    if before is None or after is None:
        return [] if before is after else ["fits" if after else "no longer fits"]
    out = []
    for axis in ("pp", "vpp", "dp", "sp", "tp", "cp", "ep", "etp"):
        a, b = getattr(before.degrees, axis), getattr(after.degrees, axis)
        if a != b:
            out.append(f"{axis} {a}->{b}")
    if before.attention.kind != after.attention.kind:
        out.append(f"attention {before.attention.kind}->{after.attention.kind}")
    if before.ffn.kind != after.ffn.kind:
        out.append(f"ffn {before.ffn.kind}->{after.ffn.kind}")
    elif before.ffn.kind == "ep" and before.ffn.dispatch != after.ffn.dispatch:
        out.append(f"dispatch {before.ffn.dispatch}->{after.ffn.dispatch}")
    for field in ("micro_batch_size", "schedule", "overlap", "recompute", "grad_sync_precision"):
        a, b = getattr(before, field), getattr(after, field)
        if a != b:
            out.append(f"{field} {a}->{b}")
    return out

