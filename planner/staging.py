"""Split transformer layers over pipeline chunks with an ILP that minimises the slowest stage.

Stage s of pp holds chunks s, s + pp, ... (interleaved 1F1B places chunk c on stage c mod pp).
The first chunk also runs the embedding (and the dense layers, which must sit in it), the last
chunk the final norm, LM head and loss. Minimise T subject to, for every stage s,
    T >= layer_s x (layers of its chunks) + its extra work,
with a small second term that evens out chunk sizes so no chunk is left empty or oversized.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache

import pulp

# Costs are rounded to this fraction of a layer before solving, so that near-identical
# candidates share one solve (the ILP result is cached on the rounded key).
_COST_GRAIN = 0.05


@dataclass(frozen=True)
class SplitCosts:
    """Per-micro-batch forward+backward seconds, as cost_models.stage_costs gives them."""

    layer_s: float
    embedding_s: float
    head_s: float
    dense_extra_s: float = 0.0
    """Extra cost of the leading dense layers over MoE layers, all of them together."""


def split_layers(layers: int, pp: int, vpp: int, costs: SplitCosts, dense_layers: int = 0
                 ) -> tuple[int, ...]:
    """Layers of each of the pp x vpp chunks, in pipeline order."""
    unit = costs.layer_s
    key = (
        layers,
        pp,
        vpp,
        dense_layers,
        round((costs.embedding_s + costs.dense_extra_s) / unit / _COST_GRAIN),
        round(costs.head_s / unit / _COST_GRAIN),
    )
    return _solve(*key)


@cache
def _solve(layers: int, pp: int, vpp: int, dense_layers: int, first_extra: int, last_extra: int
           ) -> tuple[int, ...]:
    chunks = pp * vpp
    if chunks > layers:
        raise ValueError(f"pp x vpp ({pp} x {vpp} = {chunks}) exceeds model.layers ({layers})")
    grain = 1 / _COST_GRAIN  # costs below are in units of one layer / grain
    prob = pulp.LpProblem("stage_split", pulp.LpMinimize)
    x = [_variable(prob, f"x{c}", 1, layers, "Integer") for c in range(chunks)]
    slowest = _variable(prob, "slowest", 0, None, "Continuous")
    biggest_chunk = _variable(prob, "biggest_chunk", 0, None, "Continuous")
    prob += slowest + 1e-3 * biggest_chunk
    prob += pulp.lpSum(x) == layers
    prob += x[0] >= max(1, dense_layers)
    for c in range(chunks):
        prob += biggest_chunk >= x[c]
    for s in range(pp):
        mine = range(s, chunks, pp)
        extra = (first_extra if 0 in mine else 0) + (last_extra if chunks - 1 in mine else 0)
        prob += slowest >= pulp.lpSum(x[c] for c in mine) + extra / grain
    with warnings.catch_warnings():
        # PuLP 3.x flags its bundled CBC as deprecated in favour of a system CBC; it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"stage split ILP ended {pulp.LpStatus[status]} for {layers} layers "
                           f"on {chunks} chunks")
    return tuple(int(round(v.value())) for v in x)


def _variable(prob: pulp.LpProblem, name: str, low: float, up: float | None, cat: str):
    """PuLP 3 attaches variables to the problem; PuLP 2 creates them free-standing."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)
