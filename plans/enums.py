"""The plan's enumerations, importable without pydantic (the CLI declares its options with
them before any model is loaded)."""

from __future__ import annotations

from enum import StrEnum


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"

    @property
    def bytes(self) -> int:
        return {"fp32": 4, "bf16": 2, "fp8": 1}[self.value]


class Overlap(StrEnum):
    """Communication-computation overlap inside a layer (paper Sec. 4)."""

    none = "none"
    inter_op = "inter_op"
    """Independent operators' communication hidden behind compute (hand-scheduled layer)."""
    inter_intra_op = "inter_intra_op"
    """Plus tile-level fused communication inside GEMMs (copy engines)."""


class Recompute(StrEnum):
    none = "none"
    selective = "selective"
    """The paper's selective rematerialisation: keep about half the activations."""
    full = "full"
    """Keep only each layer's input; recompute the whole layer in backward."""


class AttentionKind(StrEnum):
    """The kinds of attention strategy (the tags of plans.plan.AttentionStrategy)."""

    ulysses_sp = "ulysses_sp"
    tp = "tp"
    cp = "cp"
