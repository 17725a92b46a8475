"""Router scoring beyond the softmax top-k of runtime.kernels.route: sigmoid scores, the
aux-loss-free expert bias and group-limited routing (DeepSeek-V3, arXiv 2412.19437
Sec. 2.1.2; Hugging Face's modeling_deepseek_v3 MoEGate), and the routed scaling factor.

Per token, over the fp32 router logits:
- scores: sigmoid (or softmax) of the logits; the gate weights are the scores;
- choice: the scores plus the expert bias (selection only: the bias never reaches the gate
  weights, and no gradient flows through the choice);
- group-limited routing: the experts form ``groups`` equal contiguous groups; a group's score
  is the sum of its two highest choice scores (its one score with one expert per group); the
  ``groups_per_token`` best groups are kept and the top-k experts chosen inside them;
- the kept scores are renormalised to sum to one unless the model keeps the softmax's
  (router_pre_softmax), then multiplied by the routed scaling factor.
The balance statistics use the scores normalised over the experts (a softmax's already are;
sigmoid scores divided by their sum, as Megatron-Core's aux loss for sigmoid routers).

The expert bias is updated after every training step (``updated_expert_bias``), outside the
gradient, from the routed slots per expert over the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plans.enums import RouterScore
from plans.specs import ModelSpec
from runtime.kernels import count_per_expert

GROUP_SCORE_EXPERTS = 2
"""A group's score sums its this many highest choice scores (DeepSeek-V3's MoEGate)."""


@dataclass(frozen=True)
class Scoring:
    """How a router scores and chooses experts, from the model's fields."""

    score: RouterScore
    expert_bias: bool
    scaling: float
    groups: int
    groups_per_token: int

    @classmethod
    def of(cls, m: ModelSpec) -> Scoring | None:
        """The model's scoring; None for the plain softmax top-k (runtime.kernels.route)."""
        s = cls(m.router_score, m.router_expert_bias, m.routed_scaling_factor,
                m.expert_groups, m.groups_per_token)
        plain = cls(RouterScore.softmax, False, 1.0, s.groups, s.groups)
        return None if s == plain else s


def group_mask(choice: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """[T, E] true on the experts of each token's ``keep`` best groups (the module doc)."""
    tokens, experts = choice.shape
    per_group = experts // groups
    grouped = choice.view(tokens, groups, per_group)
    score = grouped.topk(min(GROUP_SCORE_EXPERTS, per_group), dim=-1).values.sum(-1)
    best = score.topk(keep, dim=-1).indices
    mask = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, best, True)
    return mask.repeat_interleave(per_group, dim=1)


def updated_expert_bias(bias: torch.Tensor, slots: torch.Tensor, rate: float) -> torch.Tensor:
    """The aux-loss-free update (DeepSeek-V3 Sec. 2.1.2; Megatron-Core's
    get_updated_expert_bias): ``bias + rate x sign(mean - slots)``, ``slots`` the routed slots
    per expert (last dimension) over one step's tokens, ``mean`` their mean over the experts.
    The sign ignores a common factor of the slots, so any set of ranks that each count the
    same tokens the same number of times gives the same update."""
    mean = slots.mean(-1, keepdim=True)
    return bias + rate * torch.sign(mean - slots).to(bias.dtype)


def route_scored(logits: torch.Tensor, top_k: int, renormalize: bool, scoring: Scoring,
                 bias: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """runtime.kernels.route's outputs (weights, indices, slots per expert, summed normalised
    score per expert) under ``scoring`` with the expert ``bias`` (None: no bias)."""
    logits = logits.float()
    if scoring.score == RouterScore.sigmoid:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
    else:
        scores = probs = torch.softmax(logits, dim=-1)
    choice = scores.detach()
    if bias is not None:
        choice = choice + bias.float()
    if scoring.groups_per_token < scoring.groups:
        keep = group_mask(choice, scoring.groups, scoring.groups_per_token)
        choice = choice.masked_fill(~keep, float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if scoring.scaling != 1.0:
        weights = weights * scoring.scaling
    counts = count_per_expert(indices, probs.shape[1]).to(probs.dtype)
    return weights, indices, counts, probs.sum(0)
