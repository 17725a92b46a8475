"""The contract between planner and runtime: specs, the Plan schema and the catalog."""

from plans.errors import SpecError
from plans.plan import (
    EPFFN,
    SCHEMA_VERSION,
    TPFFN,
    AttentionStrategy,
    CPAttention,
    Degrees,
    Dispatch,
    FFNStrategy,
    MeshAxis,
    OptimizerSharding,
    Overlap,
    PipelineSchedule,
    Plan,
    Prediction,
    Recompute,
    TPAttention,
    UlyssesAttention,
)
from plans.specs import (
    ClusterSpec,
    Efficiency,
    GPUSpec,
    ModelSpec,
    NetworkSpec,
    NodeSpec,
    Optimizer,
    Precision,
    TrainingSpec,
)

__all__ = [
    "SCHEMA_VERSION", "AttentionStrategy", "CPAttention", "ClusterSpec", "Degrees", "Dispatch",
    "EPFFN", "Efficiency", "FFNStrategy", "GPUSpec", "MeshAxis", "ModelSpec", "NetworkSpec",
    "NodeSpec", "Optimizer", "OptimizerSharding", "Overlap", "PipelineSchedule", "Plan",
    "Precision", "Prediction", "Recompute", "SpecError", "TPAttention", "TPFFN", "TrainingSpec",
    "UlyssesAttention",
]
