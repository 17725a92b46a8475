"""Strong and weak scaling studies: the best plan and the baseline at several GPU counts."""

from __future__ import annotations

from dataclasses import dataclass

from planner.search import SearchResult, check_searches, search
from planner.space import SearchSpace
from plans import ClusterSpec, ModelSpec, SpecError, TrainingSpec, catalog

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    training: TrainingSpec
    result: SearchResult


def scale(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, gpu_counts: list[int],
          weak_seqs_per_replica: int | None = None, space: SearchSpace | None = None,
          progress=None) -> list[ScalePoint]:
    """Strong scaling keeps the global batch; weak scaling gives every NVLink-domain replica
    `weak_seqs_per_replica` sequences (global batch = that x gpus / domain size)."""
    check_searches(len(gpu_counts), "--gpus")
    points = []
    for i, gpus in enumerate(gpu_counts):
        sized = catalog.resize(cluster, gpus, "--gpus")
        job = training
        if weak_seqs_per_replica is not None:
            replicas = max(1, gpus // sized.nvlink_domain)
            job = training.model_copy(update={"global_batch": weak_seqs_per_replica * replicas})
        result = search(model, sized, job, space, top=1)
        if result.best is None and result.baseline is None:
            raise SpecError(f"--gpus: no plan of {model.name} fits {gpus} x {sized.gpu.name}")
        points.append(ScalePoint(gpus, job, result))
        if progress is not None:
            progress(i + 1, len(gpu_counts))
    return points
