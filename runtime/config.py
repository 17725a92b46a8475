"""Runtime options of the model that the ModelSpec does not carry (RoPE base, norm epsilon,
QK norm and routing come from the spec)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plans import ModelSpec
from plans.enums import ExpertGemm, Kernels
from runtime.kernels import KernelOps, kernel_ops


@dataclass(frozen=True)
class ModelOptions:
    aux_loss_coeff: float = 0.01
    """Weight of the load-balance loss (the trainer passes ModelSpec.aux_loss_coeff)."""
    balance_groups: int | None = None
    """Virtual experts of the balance loss: the experts of one EP rank count as one
    (DeepSeek-V2 device-level loss, paper Sec. 3.2); None is the plain per-expert loss."""
    capacity_factor: float | None = None
    """Tokens each expert accepts per source rank, as a multiple of the balanced share;
    None is dropless."""
    init_std: float = 0.02
    kernels: Kernels = Kernels.eager
    """The memory-bound operators' implementation (plan.kernels; runtime.kernels)."""
    expert_gemm: ExpertGemm = ExpertGemm.grouped
    """How the routed experts run their GEMMs (runtime.moe.GroupedExperts)."""


@dataclass(frozen=True)
class ModelConfig:
    spec: ModelSpec
    options: ModelOptions = ModelOptions()
    ops: KernelOps = field(init=False, compare=False)
    """The operator set of ``options.kernels``, built once per model (compiled regions are
    shared by its modules)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", kernel_ops(self.options.kernels))

    @property
    def balance_groups(self) -> int:
        return self.options.balance_groups or self.spec.experts
