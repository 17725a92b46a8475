"""Split transformer layers over pipeline stages: the split whose slowest stage is the fastest.

Stage s of pp holds chunks s, s + pp, ... (interleaved 1F1B places chunk c on stage c mod pp).
The first stage also runs the embedding and the dense layers (which must sit in its first
chunk), the last stage the final norm, LM head and loss. The middle stages carry no extra work,
so an optimal split gives each of them n or n + 1 layers, and a split is fixed by the layers of
the two end stages. Costs are counted in grains (a quarter of a layer), so every stage time is
a whole number of grains and the optimum is exact and lexicographic (_ends): the least slowest
stage, then the most layers on the end stages (they carry the extras), then the fewest on the
first. Each stage's layers are then dealt over its vpp chunks as evenly as possible.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from plans.layout import stage_of_chunk

_COST_GRAIN = 0.25
"""Costs are rounded to this fraction of a layer, so that near-identical candidates share one
split (cached on the rounded key)."""


@dataclass(frozen=True)
class SplitCosts:
    """Per-micro-batch forward+backward seconds, as cost_models.stage_costs gives them."""

    layer_s: float
    embedding_s: float
    head_s: float
    dense_extra_s: float = 0.0
    """Extra cost of the leading dense layers over MoE layers, all of them together."""


def least_layers(pp: int, vpp: int, dense_layers: int) -> int:
    """The fewest layers a split over pp x vpp chunks can hold: every chunk keeps a layer and
    the first chunk also the dense layers."""
    return pp * vpp + max(dense_layers - 1, 0)


def split_layers(layers: int, pp: int, vpp: int, costs: SplitCosts, dense_layers: int = 0
                 ) -> tuple[int, ...]:
    """Layers of each of the pp x vpp chunks, in pipeline order; ValueError (one line) when
    the model has fewer layers than ``least_layers``."""
    unit = costs.layer_s
    first = round((costs.embedding_s + costs.dense_extra_s) / unit / _COST_GRAIN)
    last = round(costs.head_s / unit / _COST_GRAIN)
    return _solve(layers, pp, vpp, dense_layers, first, last)


@cache
def _solve(layers: int, pp: int, vpp: int, dense_layers: int, first_extra: int, last_extra: int
           ) -> tuple[int, ...]:
    if pp * vpp > layers:
        raise ValueError(f"pp x vpp ({pp} x {vpp} = {pp * vpp}) exceeds model.layers ({layers})")
    if (least := least_layers(pp, vpp, dense_layers)) > layers:
        raise ValueError(f"model.layers ({layers}): pp x vpp = {pp} x {vpp} chunks of a layer "
                         f"or more, the first holding the {dense_layers} dense layers, need "
                         f"{least}")
    if pp == 1:
        return _deal(layers, vpp, dense_layers)
    n_first, n_last = _ends(layers, pp, vpp, dense_layers, first_extra, last_extra)
    middle = pp - 2
    n, k = divmod(layers - n_first - n_last, middle) if middle else (0, 0)
    per_stage = [n_first, *(n + (1 if i < k else 0) for i in range(middle)), n_last]
    stage_chunks = [_deal(count, vpp, dense_layers if s == 0 else 0)
                    for s, count in enumerate(per_stage)]
    # chunk c lives on stage c mod pp, as its (c // pp)-th chunk
    return tuple(stage_chunks[stage_of_chunk(c, pp)][c // pp] for c in range(pp * vpp))


def _ends(layers: int, pp: int, vpp: int, dense_layers: int, first_extra: int,
          last_extra: int) -> tuple[int, int]:
    """The layers (n_first, n_last) of the end stages of the optimal split, extras in grains.

    Under a slowest time of S grains the first stage holds at most floor((S - extra_first) /
    grain) layers, the last floor((S - extra_last) / grain), each middle stage floor(S /
    grain), and the middle stages together any total from (pp - 2) vpp to (pp - 2) times
    theirs (n + 1 layers on some only where n + 1 fits). S is reachable iff those caps hold
    the layers, which grows with S: bisect for the least. The end stages then take as many
    layers as their caps allow and leave the middle stages theirs least, and of the splits
    holding that many, the first stage takes the fewest (the last is filled first)."""
    grain = round(1 / _COST_GRAIN)
    middle = pp - 2
    least_first = max(vpp, dense_layers + vpp - 1)

    def caps(s: int) -> tuple[int, int, int]:  # s: the slowest time in grains
        return (min((s - first_extra) // grain, layers), min((s - last_extra) // grain, layers),
                min(s // grain, layers))

    def reachable(s: int) -> bool:
        first, last, each = caps(s)
        return (first >= least_first and last >= vpp and (not middle or each >= vpp)
                and first + last + middle * each >= layers)

    low, high = 0, grain * layers + max(first_extra, last_extra, 0)
    while low < high:
        mid = (low + high) // 2
        if reachable(mid):
            high = mid
        else:
            low = mid + 1
    first, last, _ = caps(low)
    ends = min(first + last, layers - middle * vpp)
    n_first = max(least_first, ends - last)
    return n_first, ends - n_first


def _deal(count: int, chunks: int, first_at_least: int) -> tuple[int, ...]:
    """`count` layers over `chunks` chunks as evenly as possible, the first holding at least
    `first_at_least` (the dense layers)."""
    first = max(first_at_least, -(-count // chunks) if chunks > 1 else count)
    first = min(first, count - (chunks - 1))
    rest = count - first
    if chunks == 1:
        return (count,)
    base, extra = divmod(rest, chunks - 1)
    return (first, *(base + (1 if i < extra else 0) for i in range(chunks - 1)))
