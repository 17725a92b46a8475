"""Analytical cost model of MoE training plans: step time, MFU and memory per GPU.

Pure functions of ``plans`` specs and plans; seconds and bytes throughout.
"""

from cost_models.evaluate import Evaluation, StageCosts, evaluate, stage_costs
from cost_models.layer import LayerTiming, layer_timing
from cost_models.memory import MemoryBreakdown, memory_breakdown

__all__ = [
    "Evaluation", "LayerTiming", "MemoryBreakdown", "StageCosts", "evaluate", "layer_timing",
    "memory_breakdown", "stage_costs",
]
