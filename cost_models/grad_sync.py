"""Data-parallel gradient reduce-scatter and parameter all-gather (ZeRO-1, per step)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cost_models import comm
from cost_models.params import StageParams, stage_params
from plans.layout import stride
from plans.plan import Degrees, MeshAxis
from plans.specs import ClusterSpec, ModelSpec, Precision


@dataclass(frozen=True)
class GradSync:
    reduce_scatter_s: float
    """Gradients, dense over dp x cp x sp then experts over edp."""
    all_gather_s: float
    """Updated parameters, the same groups and bytes."""

    @property
    def total_s(self) -> float:
        return self.reduce_scatter_s + self.all_gather_s


@lru_cache(maxsize=4096)
def grad_sync(params: StageParams, degrees: Degrees, cluster: ClusterSpec,
              precision: Precision) -> GradSync:
    """Buffers in ``precision`` bytes per parameter (fp32 4, bf16 2, fp8 1; paper Sec. 5).

    Dense weights are replicated over the dp x cp x sp ranks of stride tp (rank order
    (tp | sp | cp), dp, pp); experts over the edp ranks of stride ep x etp. Both groups
    span nodes per that order, so the sync is hierarchical: NVLink inside, network across."""
    d, g = degrees, cluster.node.gpus_per_node
    dense = comm.group_layout(d.dp * d.cp * d.sp, d.tp, g)
    expert = comm.group_layout(d.edp, stride(d, MeshAxis.edp), g)
    dense_bytes = params.dense * precision.bytes
    expert_bytes = params.expert * precision.bytes
    rs = (comm.reduce_scatter_s(dense_bytes, dense, cluster)
          + comm.reduce_scatter_s(expert_bytes, expert, cluster))
    ag = (comm.all_gather_s(dense_bytes, dense, cluster)
          + comm.all_gather_s(expert_bytes, expert, cluster))
    return GradSync(rs, ag)


@lru_cache(maxsize=4096)
def stage_grad_syncs(
    model: ModelSpec, degrees: Degrees, stage_layers: tuple[int, ...], cluster: ClusterSpec,
    precision: Precision,
) -> tuple[tuple[int, GradSync], ...]:
    """(stage, ``grad_sync``) for the first stage of each distinct sync: a later stage with the
    same sync has a wider window (see evaluate), so it is never the worst."""
    out: dict[GradSync, int] = {}
    for i, p in enumerate(stage_params(model, degrees, stage_layers)):
        out.setdefault(grad_sync(p, degrees, cluster, precision), i)
    return tuple((i, gs) for gs, i in out.items())


def exposed_grad_sync_s(sync: GradSync, bwd_window_s: float, fwd_window_s: float,
                        overlap: bool, hidden_share: float) -> float:
    """With overlap, bucketed reduce-scatter runs behind the backward of the last micro-batch
    (``bwd_window_s``) and the all-gather behind the next step's first forward
    (``fwd_window_s``); at most ``hidden_share`` (efficiency.overlap) of a window hides it."""
    if not overlap:
        return sync.total_s

    def exposed(t: float, window: float) -> float:
        return t - min(t, window) * hidden_share

    return exposed(sync.reduce_scatter_s, bwd_window_s) + exposed(sync.all_gather_s, fwd_window_s)
