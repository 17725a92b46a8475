"""Strong and weak scaling studies: the best plan and the baseline at several GPU counts."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from planner.search import SearchResult, check_searches, search
from planner.space import SearchSpace
from plans import ClusterSpec, ModelSpec, SpecError, TrainingSpec, catalog
from plans.errors import describe

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class ScalePoint:
    gpus: int
    training: TrainingSpec
    result: SearchResult


def weak_training(training: TrainingSpec, global_batch: int, gpus: int) -> TrainingSpec:
    """``training`` with weak scaling's global batch at ``gpus``, validated like any batch
    (``model_copy`` would not check it)."""
    try:
        return TrainingSpec.model_validate({**training.model_dump(), "global_batch": global_batch})
    except ValidationError as e:
        raise SpecError(f"--weak: at {gpus:,} GPUs the global batch would be {global_batch:,} "
                        f"sequences: {describe(e)}") from None


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
            job = weak_training(training, weak_seqs_per_replica * replicas, gpus)
        result = search(model, sized, job, space, top=1)
        if result.best is None and result.baseline is None:
            raise SpecError(f"--gpus: no plan of {model.name} fits {gpus} x {sized.gpu.name}")
        points.append(ScalePoint(gpus, job, result))
        if progress is not None:
            progress(i + 1, len(gpu_counts))
    return points
