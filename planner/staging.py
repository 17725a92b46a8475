"""Split transformer layers over pipeline stages with an ILP that minimises the slowest stage.

Stage s of pp holds chunks s, s + pp, ... (interleaved 1F1B places chunk c on stage c mod pp).
The first stage also runs the embedding and the dense layers (which must sit in its first
chunk), the last stage the final norm, LM head and loss. The middle stages carry no extra work,
so an optimal split gives each of them n or n + 1 layers; the ILP needs only
    n_first, n_last, n (integers), k (middle stages with n + 1), z (1 if k > 0):
    minimise T  s.t.  n_first + n_last + (pp - 2) n + k = layers,  k <= (pp - 2) z,
                      T >= n_first + extra_first,  T >= n_last + extra_last,  T >= n + z,
and every chunk keeps at least one layer. Each stage's layers are then dealt over its vpp
chunks as evenly as possible. Small and free of symmetry, so it solves in well under a
millisecond. Among splits with the same slowest stage, the end stages are filled first.
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import pulp

from plans.layout import stage_of_chunk

# Costs are rounded to this fraction of a layer before solving, so that near-identical
# candidates share one solve (the result is cached on the rounded key).
_COST_GRAIN = 0.25
_TIE_WEIGHT = _COST_GRAIN / 5
"""The ILP's tie-break weight per end-stage layer, times the model's layers: its whole term
stays below a grain, so it never trades away slowest-stage time."""
_ILP_REL_GAP = 1e-4
"""HiGHS stops once its incumbent is within this share of the optimum (its default
mip_rel_gap; CBC's default gap is tighter)."""


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
    ends = _unique_optimum(layers, pp, vpp, dense_layers, first_extra, last_extra)
    if ends is None:
        ends = _solve_ilp(layers, pp, vpp, dense_layers, first_extra, last_extra)
    n_first, n_last = ends
    middle = pp - 2
    n, k = divmod(layers - n_first - n_last, middle) if middle else (0, 0)
    per_stage = [n_first, *(n + (1 if i < k else 0) for i in range(middle)), n_last]
    stage_chunks = [_deal(count, vpp, dense_layers if s == 0 else 0)
                    for s, count in enumerate(per_stage)]
    # chunk c lives on stage c mod pp, as its (c // pp)-th chunk
    return tuple(stage_chunks[stage_of_chunk(c, pp)][c // pp] for c in range(pp * vpp))


def _unique_optimum(layers: int, pp: int, vpp: int, dense_layers: int, first_extra: int,
                    last_extra: int) -> tuple[int, int] | None:
    """The ILP's optimum (n_first, n_last) where it is unique, else None. In units of the cost
    grain every bound is an integer, so the ILP is lexicographic: the slowest stage first (a
    grain or more apart), then the most layers on the end stages (the tie-break weighs at most
    a fifth of a grain). A slowest time S is reachable iff the stages' caps under it hold the
    layers: the first at most floor(S - extra_first), the last floor(S - extra_last), each
    middle stage floor(S) (n + 1 <= S when k > 0), and the middle stages can hold any total
    from (pp - 2) vpp to (pp - 2) floor(S). Reachability grows with S: bisect for the least.
    The end stages then take min(their caps, layers - (pp - 2) vpp); that pair is unique when
    both sit at their caps (or, without middle stages, when one count fits), and the solver
    answers with it where a split one tie-break step worse is further from the optimum than
    its stopping gap (_ILP_REL_GAP) allows. Otherwise the ILP decides, as it always did."""
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
    if middle:
        ends = min(first + last, layers - middle * vpp)
        if ends != first + last:
            return None
        objective = low / grain - _TIE_WEIGHT / layers * (first + last)
        if _TIE_WEIGHT / layers <= 2 * _ILP_REL_GAP * (abs(objective) + 1):
            return None  # the solver may stop at a split one tie-break step worse
    else:
        lo_first, hi_first = max(least_first, layers - last), min(first, layers - vpp)
        if lo_first != hi_first:
            return None
        first, last = lo_first, layers - lo_first
    return first, last


def _solve_ilp(layers: int, pp: int, vpp: int, dense_layers: int, first_extra: int,
               last_extra: int) -> tuple[int, int]:
    """The ILP of the module doc; its optimum's (n_first, n_last)."""
    extra_first, extra_last = first_extra * _COST_GRAIN, last_extra * _COST_GRAIN
    middle = pp - 2
    least_first = max(vpp, dense_layers + vpp - 1)
    prob = pulp.LpProblem("stage_split", pulp.LpMinimize)
    n_first = _variable(prob, "n_first", least_first, layers, "Integer")
    n_last = _variable(prob, "n_last", vpp, layers, "Integer")
    n = _variable(prob, "n_middle", vpp if middle else 0, layers, "Integer")
    k = _variable(prob, "k", 0, max(middle - 1, 0), "Integer")
    z = _variable(prob, "z", 0, 1 if middle else 0, "Integer")
    slowest = _variable(prob, "slowest", 0, None, "Continuous")
    # tie-break: fill the end stages (their extras are counted); the weight keeps the term
    # below the cost grain, so it never trades away slowest-stage time
    prob += slowest - (_TIE_WEIGHT / layers) * (n_first + n_last)
    prob += n_first + n_last + middle * n + k == layers
    prob += k <= middle * z
    prob += slowest >= n_first + extra_first
    prob += slowest >= n_last + extra_last
    if middle:
        prob += slowest >= n + z
    with _native_stdout_silenced(), warnings.catch_warnings():
        # PuLP 3.x flags its bundled CBC as deprecated in favour of a system CBC; it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        status = prob.solve(_solver())
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"stage split ILP ended {pulp.LpStatus[status]} for {layers} layers "
                           f"on {pp} stages")
    return int(round(n_first.value() or 0)), int(round(n_last.value() or 0))


def _solver() -> pulp.LpSolver:
    """HiGHS in-process (about 0.2 ms a solve) when highspy is installed; else PuLP's bundled
    CBC (a subprocess, about 5 ms a solve)."""
    if pulp.HiGHS(msg=False).available():
        return pulp.HiGHS(msg=False, gapRel=_ILP_REL_GAP)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=10)


@contextmanager
def _native_stdout_silenced():
    """HiGHS prints its banner from C++ on file descriptor 1 whatever msg says; keep stdout
    clean for `--json` by pointing fd 1 at /dev/null during the solve."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


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


def _variable(prob: pulp.LpProblem, name: str, low: float, up: float | None, cat: str):
    """PuLP 3 attaches variables to the problem; PuLP 2 creates them free-standing."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)
