"""Parameters held by one GPU of each pipeline stage, split into the two sync groups."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plans.plan import Degrees, Plan
from plans.specs import ModelSpec


@dataclass(frozen=True)
class StageParams:
    """Parameters on one GPU of a pipeline stage."""

    dense: float
    """Attention, norms, router, shared experts, dense FFNs, embedding / LM head: replicated
    over dp x cp x sp (split by tp)."""
    expert: float
    """Routed experts: E/ep experts, each split by etp; replicated over edp."""

    @property
    def total(self) -> float:
        return self.dense + self.expert


def chunk_dense_layers(stage_layers: tuple[int, ...], dense_layers: int) -> tuple[int, ...]:
    """Dense-FFN layers in each model chunk: the model's first ``dense_layers`` layers."""
    if not dense_layers:
        return (0,) * len(stage_layers)
    out, first = [], 0
    for n in stage_layers:
        out.append(max(0, min(first + n, dense_layers) - first))
        first += n
    return tuple(out)


@lru_cache(maxsize=4096)
def stage_params(model: ModelSpec, degrees: Degrees, stage_layers: tuple[int, ...]) -> tuple[
        StageParams, ...]:
    """Per physical stage; chunk c of an interleaved schedule lives on stage c mod pp."""
    d, m = degrees, model
    attention = m.attention_params / d.tp + 2 * m.hidden
    moe_dense = attention + m.router_params + m.shared_expert_params / d.etp
    dense_layer = attention + m.dense_ffn_params / d.tp
    experts = m.experts // d.ep * m.expert_params / d.etp
    vocab = m.vocab * m.hidden / d.tp
    dense = [0.0] * d.pp
    expert = [0.0] * d.pp
    for c, (n, n_dense) in enumerate(
        zip(stage_layers, chunk_dense_layers(stage_layers, m.dense_layers), strict=True)
    ):
        dense[c % d.pp] += n_dense * dense_layer + (n - n_dense) * moe_dense
        expert[c % d.pp] += (n - n_dense) * experts
    dense[0] += vocab
    # The last stage holds the LM head (a copy of a tied embedding when pp > 1) and final norm.
    dense[-1] += m.hidden + (vocab if d.pp > 1 or not m.tied_embeddings else 0)
    return tuple(StageParams(a, b) for a, b in zip(dense, expert, strict=True))


def stage_params_of(plan: Plan) -> tuple[StageParams, ...]:
    return stage_params(plan.model, plan.degrees, plan.stage_layers)
