"""The contract between planner and runtime: specs, the Plan schema and the catalog.

Names are imported on first use (PEP 562), so `plans.enums` (the CLI's option types) loads
without pydantic and the models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "SpecError": "plans.errors",
    "AttentionKind": "plans.enums", "Overlap": "plans.enums", "Precision": "plans.enums",
    "Recompute": "plans.enums", "RecomputeModule": "plans.enums", "CrossEntropy": "plans.enums",
    "OptimizerSharding": "plans.enums", "Kernels": "plans.enums", "Dispatch": "plans.enums",
    "Target": "plans.enums", "CudaGraphs": "plans.enums", "Fp8Recipe": "plans.enums",
    **dict.fromkeys(("COMPONENT_KEYS", "Component", "LAYER_REGIONS", "LayerOperator",
                     "RECOMPUTED", "TIMER_OF"), "plans.operators"),
    **dict.fromkeys((
        "EPFFN", "SCHEMA_VERSION", "TPFFN", "AttentionStrategy", "CPAttention", "Degrees",
        "FFNStrategy", "MeshAxis", "PipelineSchedule", "Plan", "Prediction",
        "TPAttention", "UlyssesAttention"), "plans.plan"),
    **dict.fromkeys((
        "ClusterSpec", "Efficiency", "GPUSpec", "ModelSpec", "NetworkSpec", "NodeSpec",
        "Optimizer", "TrainingSpec"), "plans.specs"),
}

__all__ = [
    "COMPONENT_KEYS", "LAYER_REGIONS", "RECOMPUTED", "SCHEMA_VERSION", "TIMER_OF",
    "AttentionKind", "AttentionStrategy", "CPAttention", "ClusterSpec", "Component",
    "CrossEntropy", "CudaGraphs", "LayerOperator",
    "Degrees", "Dispatch", "EPFFN", "Efficiency", "FFNStrategy", "Fp8Recipe", "GPUSpec",
    "Kernels",
    "MeshAxis",
    "ModelSpec", "NetworkSpec", "NodeSpec", "Optimizer", "OptimizerSharding", "Overlap",
    "PipelineSchedule", "Plan",
    "Precision", "Prediction", "Recompute", "RecomputeModule", "SpecError", "TPAttention",
    "TPFFN", "Target",
    "TrainingSpec",
    "UlyssesAttention",
]


SUBMODULES = ("catalog", "errors", "execution", "enums", "hf", "layout", "operators", "results")


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"plans.{name}")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'plans' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from plans.enums import (
        AttentionKind,
        CudaGraphs,
        Dispatch,
        Fp8Recipe,
        Kernels,
        Overlap,
        Precision,
        Recompute,
        RecomputeModule,
        Target,
    )
    from plans.errors import SpecError
    from plans.operators import (
        COMPONENT_KEYS,
        LAYER_REGIONS,
        RECOMPUTED,
        TIMER_OF,
        Component,
        LayerOperator,
    )
    from plans.plan import (
        EPFFN,
        SCHEMA_VERSION,
        TPFFN,
        AttentionStrategy,
        CPAttention,
        Degrees,
        FFNStrategy,
        MeshAxis,
        PipelineSchedule,
        Plan,
        Prediction,
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
        TrainingSpec,
    )
