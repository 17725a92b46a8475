"""The plan's parallelism as ordered transforms of the plain (meta-device) model:
pipeline stage -> attention (Ulysses or TP; Ulysses in overlapped head groups, and the experts
in overlapped token chunks, when the plan runs inter-operator overlap) -> experts (EP) ->
gradient-accumulation fusion -> recomputation (checkpointed modules, the experts' activation)
-> timers.
Weights are materialised afterwards from the seed, so every layout starts identical."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from plans import (
    EPFFN,
    RECOMPUTED,
    TPFFN,
    LayerOperator,
    MeshAxis,
    Plan,
    Recompute,
    RecomputeModule,
    TPAttention,
    UlyssesAttention,
)
from plans.execution import Backend, check, executed_value
from plans.layout import accumulates_head_in_gemm, moe_chunks, ulysses_chunks
from plans.operators import MODULE_OPERATORS, recomputed_operators
from runtime.loss import VocabShard
from runtime.metrics import Component, Timers, timed
from runtime.mla import MLACore
from runtime.model import AttentionCore, Shard, Transformer, TransformerBlock
from runtime.moe import GroupedExperts
from runtime.parallel.attention import apply_tensor_parallel_attention, apply_ulysses
from runtime.parallel.data_parallel import replication_groups
from runtime.parallel.expert import apply_expert_parallel, apply_expert_tensor_parallel
from runtime.parallel.grad_accumulation import apply_grad_accumulation_fusion
from runtime.parallel.mesh import Mesh
from runtime.parallel.overlap import apply_inter_op_overlap
from runtime.parallel.pipeline import apply_pipeline
from runtime.parallel.tensor import apply_tensor_parallel_rest
from runtime.parallel.wrappers import (
    ActivationRecomputed,
    InPlaceOf,
    Recomputed,
    Timed,
    plain,
    replace,
)


def backend_of(device: torch.device) -> Backend:
    return Backend.cuda_nccl if device.type == "cuda" else Backend.cpu_gloo


def launch_backend() -> Backend:
    """The backend a launch on this machine runs on (CUDA and NCCL when a GPU is visible)."""
    return Backend.cuda_nccl if torch.cuda.is_available() else Backend.cpu_gloo


def check_supported(plan: Plan, backend: Backend) -> None:
    """Refuse, before any work, a plan field this runtime cannot run on ``backend``: the
    capability table (plans.execution) decides, one line naming the field."""
    check(plan, backend)


RECOMPUTE_MODULES: tuple[tuple[type[nn.Module], frozenset[LayerOperator],
                               type[InPlaceOf]], ...] = (
    (AttentionCore, RECOMPUTED[Recompute.selective], Recomputed),  # GQA's core
    (MLACore, RECOMPUTED[Recompute.selective], Recomputed),
    (TransformerBlock, RECOMPUTED[Recompute.full], Recomputed),
    # the routed experts' activation (moe_act), their GEMMs' inputs and outputs kept
    (GroupedExperts, MODULE_OPERATORS[RecomputeModule.moe_act], ActivationRecomputed),
)
"""The modules recomputation can wrap, the layer operators each one's wrapper reruns, and the
wrapper: activation checkpointing of the whole module, or the experts' activation rerun into
fc2's freed input."""


_MOE_OPERATORS = MODULE_OPERATORS[RecomputeModule.moe]
"""The operators of an MoE layer's FFN, which a dense layer does not run."""


def apply_recompute(model: Transformer, operators: frozenset[LayerOperator]) -> None:
    """Recompute ``operators`` (``plans.recomputed_operators`` of the plan's policy and
    modules, the set the cost model prices) in backward: wrap, in each layer, the outermost
    modules whose wrapper reruns only operators of the set, and refuse a set they do not cover
    exactly (of the operators the layer runs: a dense layer has no experts)."""
    if not operators:
        return
    for key, block in list(model.layers.items()):
        covered: set[LayerOperator] = set()
        wrapped: list[tuple[str, type[InPlaceOf]]] = []  # ("" is the block itself)
        for name, module in block.named_modules():
            if any(w == "" or name.startswith(f"{w}.") for w, _ in wrapped):
                continue  # inside a module already recomputed
            runs = next(((ops, wrapper) for kind, ops, wrapper in RECOMPUTE_MODULES
                         if isinstance(plain(module), kind)), None)
            if runs is not None and runs[0] <= operators:
                covered |= runs[0]
                wrapped.append((name, runs[1]))
        runs = operators if block.moe is not None else operators - _MOE_OPERATORS
        if missing := runs - covered:
            raise ValueError(f"recompute: this runtime has no module that runs only "
                             f"{', '.join(sorted(missing))}")
        for name, wrapper in wrapped:
            if name:
                replace(block, name, wrapper(block.get_submodule(name)))
            else:
                model.layers[key] = wrapper(block)


def apply_expert_timers(model: Transformer, timers: Timers) -> None:
    """Time each layer's grouped expert GEMMs, forward and backward."""
    for moe in model.moe_layers():
        moe.experts = Timed(moe.experts, functools.partial(timed, timers,
                                                           Component.expert_compute))


@dataclass
class ParallelModel:
    model: Transformer
    mesh: Mesh
    shards: dict[str, Shard]
    """This rank's slice of every sharded parameter (by local parameter name)."""
    replication: dict[str, tuple[MeshAxis, ...]]
    """Groups each parameter's gradient is summed over."""
    vocab: VocabShard | None = None
    """This rank's rows of a vocabulary split by TP (the loss runs over the shards)."""


def parallelize(model: Transformer, plan: Plan, mesh: Mesh, timers: Timers | None,
                backend: Backend) -> ParallelModel:
    check_supported(plan, backend)
    shards: dict[str, Shard] = {}
    apply_pipeline(model, mesh, plan.stage_layers)
    overlap = executed_value("overlap", plan.overlap, backend)
    if isinstance(plan.attention, UlyssesAttention):
        apply_ulysses(model, mesh, timers,
                      ulysses_chunks(overlap, plan.attention, plan.model, plan.degrees.sp))
    vocab = None
    if isinstance(plan.attention, TPAttention):
        apply_tensor_parallel_attention(model, mesh, shards, timers)
        vocab = apply_tensor_parallel_rest(model, mesh, shards)
    attention_shards = set(shards)
    if isinstance(plan.ffn, EPFFN):
        apply_expert_parallel(model, mesh, plan.ffn.dispatch, shards, timers)
        apply_inter_op_overlap(model.moe_layers(), moe_chunks(overlap, plan.ffn, plan.degrees.ep))
    elif isinstance(plan.ffn, TPFFN):
        apply_expert_tensor_parallel(model, mesh, shards, timers)
    expert_shards = set(shards) - attention_shards
    if executed_value("grad_accumulation_fusion", plan.grad_accumulation_fusion, backend):
        apply_grad_accumulation_fusion(model, accumulates_head_in_gemm(
            True, plan.cross_entropy, plan.model, plan.degrees.pp))
    apply_recompute(model, recomputed_operators(plan.recompute, plan.recompute_modules))
    if timers is not None:
        apply_expert_timers(model, timers)
    groups = replication_groups(model, mesh, shards, expert_shards)
    return ParallelModel(model, mesh, shards, groups, vocab)
