"""Data-parallel gradient reduce-scatter and parameter all-gather (ZeRO-1, per step)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cost_models import comm
from cost_models.params import StageParams, part_params, stage_params
from plans.execution import GRAD_SYNC_BUCKET_PARAMS
from plans.layout import stride
from plans.plan import Degrees, MeshAxis
from plans.specs import ClusterSpec, ModelSpec, Precision


@dataclass(frozen=True)
class GradSync:
    reduce_scatter_s: float
    """Gradients, dense over dp x cp x sp then experts over edp."""
    all_gather_s: float
    """Updated parameters, the same groups and bytes."""
    last_reduce_scatter_s: float = 0.0
    """The reduce-scatter of each group's last bucket, the one the backward completes last
    (``last_bucket_params``)."""
    last_all_gather_s: float = 0.0
    """The all-gather of the same buckets (the second half of their all-reduce)."""

    @property
    def total_s(self) -> float:
        return self.reduce_scatter_s + self.all_gather_s


def last_bucket_params(group: float, first: float) -> float:
    """Parameters of a sync group's last bucket: the runtime fills buckets in reverse
    registration order and never splits a parameter, so the last one holds the group's
    first-registered parameter (``first``: the embedding on the first stage, a layer's first
    expert matrix) and at least GRAD_SYNC_BUCKET_PARAMS, within the group's total."""
    return min(group, max(first, GRAD_SYNC_BUCKET_PARAMS))


@lru_cache(maxsize=4096)
def grad_sync(params: StageParams, degrees: Degrees, cluster: ClusterSpec,
              precision: Precision, first: StageParams | None = None) -> GradSync:
    """Buffers in ``precision`` bytes per parameter (fp32 4, bf16 2, fp8 1; paper Sec. 5);
    ``first``: each group's first-registered parameter (``last_bucket_params``).

    Dense weights are replicated over the dp x cp x sp ranks of stride tp (rank order
    (tp | sp | cp), dp, pp); experts over the edp ranks of stride ep x etp. Both groups
    span nodes per that order, so the sync is hierarchical: NVLink inside, network across."""
    d, g = degrees, cluster.node.gpus_per_node
    first = first or StageParams(0.0, 0.0)
    groups = ((params.dense, first.dense, comm.group_layout(d.dp * d.cp * d.sp, d.tp, g)),
              (params.expert, first.expert,
               comm.group_layout(d.edp, stride(d, MeshAxis.edp), g)))
    rs = ag = last_rs = last_ag = 0.0
    for n, first_n, layout in groups:
        rs += comm.reduce_scatter_s(n * precision.bytes, layout, cluster)
        ag += comm.all_gather_s(n * precision.bytes, layout, cluster)
        last = last_bucket_params(n, first_n) * precision.bytes
        last_rs += comm.reduce_scatter_s(last, layout, cluster)
        last_ag += comm.all_gather_s(last, layout, cluster)
    return GradSync(rs, ag, last_rs, last_ag)


@lru_cache(maxsize=4096)
def stage_grad_syncs(
    model: ModelSpec, degrees: Degrees, stage_layers: tuple[int, ...], cluster: ClusterSpec,
    precision: Precision,
) -> tuple[tuple[int, GradSync], ...]:
    """(stage, ``grad_sync``) for the first stage of each distinct sync: a later stage with the
    same sync has a wider window (see evaluate), so it is never the worst."""
    parts = part_params(model, degrees)
    # SwiGLU experts: three matrices of equal size per layer, the first registered first
    expert_matrix = parts.moe_layer.expert / 3
    out: dict[GradSync, int] = {}
    for i, p in enumerate(stage_params(model, degrees, stage_layers)):
        first = StageParams(parts.embedding.dense if i == 0 else 0.0,
                            expert_matrix if p.expert else 0.0)
        out.setdefault(grad_sync(p, degrees, cluster, precision, first), i)
    return tuple((i, gs) for gs, i in out.items())


def exposed_grad_sync_s(sync: GradSync, window_s: float, drain_s: float, overlap: bool,
                        hidden_share: float, sharded: bool) -> float:
    """The sync time the step waits for, as the runtime runs it (runtime.parallel.
    data_parallel.BucketLauncher). Without overlap every bucket's collectives run after the
    backward. With it each bucket's collective (the reduce-scatter under ZeRO-1, the whole
    all-reduce without) is launched as the last micro-batch's backward completes the bucket:
    together they hide behind that backward and the drain of the earlier stages
    (``window_s``), at most ``hidden_share`` (efficiency.overlap) of it, but the last bucket
    starts only when this stage's backward ends, so only the drain (``drain_s``) can hide it.
    The ZeRO-1 parameter all-gather follows the optimizer step, exposed either way."""
    if not overlap:
        return sync.total_s
    if sharded:
        launched, last, after = sync.reduce_scatter_s, sync.last_reduce_scatter_s, sync.all_gather_s
    else:
        launched = sync.total_s
        last, after = sync.last_reduce_scatter_s + sync.last_all_gather_s, 0.0
    return max(launched - window_s * hidden_share, last - drain_s * hidden_share, 0.0) + after
