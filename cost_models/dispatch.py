"""The token permutation of an MoE layer as moeplan's eager runtime runs it, pass by pass.

Counted from runtime/moe.py and runtime/parallel/expert.py in rows of one token's activations
(hidden x activation bytes): R rows routed to this rank's experts, T tokens on this rank, G
tokens after an all-gather (n x T). The unit passes (read + write of every row touched):

- a row gather ``x[idx]``: reads R rows, writes R: 2R;
- its autograd backward: a zeroed buffer of the source's rows plus an accumulating scatter of
  R rows (read, read-modify-write): 3R + rows of the source;
- the weighted scatter (runtime.moe.weighted_scatter): the weighting multiply 2R, a zeroed
  output, its out-of-place copy and the index-add of R rows: 5R + 3 x output rows; backward:
  the index-add's gather 2R, the multiply's two gradients 4R: 6R.

Index and count arithmetic over token ids (argsort, cumsum) is small beside rows of thousands of
bytes and left out. Fused kernels (plans.Kernels.fused) make one pass each way instead (their
bytes are layer_graph's own), except where every slot is routed: there the fused set permutes
by gathers both ways (``fused_every_slot``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plans.enums import Dispatch


@dataclass(frozen=True)
class Passes:
    """Rows moved by one memory-bound step: ``routed`` x R + ``tokens`` x (its token rows)."""

    routed: float
    tokens: float

    def rows(self, routed_rows: float, token_rows: float) -> float:
        return self.routed * routed_rows + self.tokens * token_rows


@dataclass(frozen=True)
class EagerPermutation:
    """Forward and backward passes of the dispatch side (before the expert GEMMs) and the
    combine side (after them). Token rows are T for the all-to-all and local dispatchers and
    G = n x T for the all-gather dispatcher."""

    dispatch_fwd: Passes
    dispatch_bwd: Passes
    combine_fwd: Passes
    combine_bwd: Passes
    host_sync: bool
    """The forward waits on the host (split sizes, or kept rows) before the collective."""


_GATHER = Passes(2, 0)
_GATHER_BWD = Passes(3, 1)
_WEIGHTED_SCATTER = Passes(5, 3)
_WEIGHTED_SCATTER_BWD = Passes(6, 0)


def _plus(*ps: Passes) -> Passes:
    return Passes(sum(p.routed for p in ps), sum(p.tokens for p in ps))


LOCAL = EagerPermutation(
    # runtime.moe.LocalDispatcher: gather rows in expert order; weighted scatter back. Dropless
    # routing needs no host sync (sort_by_expert keeps every slot).
    dispatch_fwd=_GATHER, dispatch_bwd=_GATHER_BWD,
    combine_fwd=_WEIGHTED_SCATTER, combine_bwd=_WEIGHTED_SCATTER_BWD,
    host_sync=False,
)

ALL_TO_ALL = EagerPermutation(
    # AllToAllDispatcher: gather rows, all-to-all, regroup the received rows (received[order]:
    # a gather over R rows); combine: un-regroup (expert_out[inverse]), all-to-all back,
    # weighted scatter. The split sizes are read on the host before the all-to-all.
    dispatch_fwd=_plus(_GATHER, _GATHER),
    dispatch_bwd=_plus(_GATHER_BWD, Passes(4, 0)),  # the regroup's backward scatters R into R
    combine_fwd=_plus(_GATHER, _WEIGHTED_SCATTER),
    combine_bwd=_plus(Passes(4, 0), _WEIGHTED_SCATTER_BWD),
    host_sync=True,
)

ALL_GATHER = EagerPermutation(
    # AllGatherDispatcher / ExpertTPDispatcher: all-gather tokens, gather the locally routed
    # rows; combine: weighted scatter into the gathered tokens, reduce-scatter. Filtering the
    # slots of other ranks' experts (torch.nonzero) waits on the host.
    dispatch_fwd=_GATHER, dispatch_bwd=_GATHER_BWD,
    combine_fwd=_WEIGHTED_SCATTER, combine_bwd=_WEIGHTED_SCATTER_BWD,
    host_sync=True,
)


def fused_every_slot(regroup: bool) -> tuple[Passes, Passes, Passes, Passes]:
    """The fused kernel set's permutation when every routed slot stays (dropless; one rank or
    all-to-all dispatch: runtime.kernels' _ExpandRows, permute_rows and weighted_sum), as
    (dispatch forward, dispatch backward, combine forward, combine backward):

    - the gather to expert order 2R; its gradient gathers by the inverse permutation 2R and
      sums each token's k rows R + T;
    - the combine gathers back to slot order 2R and sums each token's weighted rows in one
      compiled pass R + T; its gradient writes the rows' gradient reading the token's 2R + T,
      then the inverse gather 2R;
    - with ``regroup`` (all-to-all over several ranks) the received rows' regroup and its
      inverse are permutations too: 2R each, each way.

    No atomic index-add anywhere (the eager set's scatters)."""
    r = Passes(2, 0) if regroup else Passes(0, 0)
    return (_plus(Passes(2, 0), r), _plus(Passes(3, 1), r),
            _plus(r, Passes(3, 1)), _plus(Passes(4, 1), r))


def eager_permutation(dispatch: Dispatch | None, group: int) -> EagerPermutation:
    """The passes of the dispatcher the runtime installs: local on one rank (EP = 1; the EP
    transform installs no dispatcher), else by ``dispatch``; ``None`` is expert TP's
    all-gather dispatcher."""
    if group == 1:
        return LOCAL
    if dispatch is not None and dispatch.moves_routed_copies:
        # deepep: no moeplan runtime runs it (plans.execution); priced as the all-to-all
        # dispatcher's permutation around its collectives
        return ALL_TO_ALL
    return ALL_GATHER
