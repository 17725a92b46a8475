"""The cost model's step, in the runtime's timed components (runtime.metrics.Component).

The runtime times regions of one rank's step: attention communication and core, dispatch,
grouped expert GEMMs and combine (forward, and backward as ``<component>_bwd``), the forward
and backward of the pipeline schedule, the loss, stage-to-stage transfers, the whole schedule,
gradient sync and the optimizer. ``bench/steps/train_step.py`` writes their mean over ranks.
``predicted_components`` prices the same regions: the operators of the layer graph that fall
inside each region (``operator_component``, the one mapping), summed over the layers of each
stage and the step's micro-batches, averaged over stages like the measurement.

Operators are priced at their duration, not their exposed time: a timed region on a CUDA
stream lasts as long as its kernels, whether or not another stream runs beside them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from cost_models import pipeline as pl
from cost_models.evaluate import Evaluation, evaluate, head_edge
from cost_models.layer import layer_key
from cost_models.layer_graph import LayerKey, backward_graph, forward_graph
from cost_models.params import stage_layer_counts
from plans.enums import CrossEntropy
from plans.operators import LAYER_REGIONS, TIMER_OF, Component, LayerOperator
from plans.plan import Plan

LAYER_COMPONENTS = tuple(c.value for c in LAYER_REGIONS)
"""Components timed inside a layer, forward and (as ``<name>_bwd``) backward."""
STEP_COMPONENTS = tuple(c.value for c in Component if c not in LAYER_REGIONS)
"""Components of the step around the layers."""


def operator_component(operator: str) -> str | None:
    """The runtime component whose timed region runs a layer-graph operator (forward name,
    without a chunk suffix): plans.TIMER_OF, the one mapping; None for operators timed only
    inside ``forward`` / ``backward`` (norms, projections, router, shared experts,
    residuals)."""
    region = TIMER_OF[LayerOperator(operator.split("@")[0])]
    return region.value if region in LAYER_REGIONS else None


def _forward_name(node: str) -> tuple[str, bool]:
    """(forward operator, is a backward node) of a backward-graph node: ``x.dgrad``,
    ``x.wgrad``, ``x.bwd`` are x's backward; ``recompute.x`` reruns x's forward, which the
    runtime's region times again as forward."""
    if node.startswith("recompute."):
        return node.removeprefix("recompute."), False
    return node.rsplit(".", 1)[0], True


def layer_components(key: LayerKey) -> dict[str, float]:
    """Seconds of one layer, one micro-batch, per layer component (and ``<name>_bwd``)."""
    out: dict[str, float] = defaultdict(float)
    fwd = forward_graph(key)
    for name, op in fwd.nodes(data="op"):
        if (c := operator_component(name)) is not None:
            out[c] += op.duration_s
    bwd = backward_graph(fwd, key.recompute, modules=key.recompute_modules)
    for name, op in bwd.nodes(data="op"):
        forward_op, backward = _forward_name(name)
        if (c := operator_component(forward_op)) is not None:
            out[f"{c}_bwd" if backward else c] += op.duration_s
    return dict(out)


def predicted_components(plan: Plan, e: Evaluation | None = None) -> Mapping[str, float]:
    """One step of ``plan`` in the runtime's components, mean over pipeline stages (as
    bench/steps/train_step.py averages over ranks). Price the plan as executed
    (plans.execution.executed_plan) to hold it against a measurement."""
    e = evaluate(plan) if e is None else e
    d, m = plan.degrees, plan.num_micro_batches
    moe = layer_components(layer_key(plan))
    m_ = plan.model
    dense = (layer_components(layer_key(plan, dense=True))
             if m_.dense_ffn_layers or (m_.mtp_layers and not m_.mtp_layer_is_moe) else moe)
    layers = stage_layer_counts(m_, plan.stage_layers, d.pp)
    keys = [*LAYER_COMPONENTS, *(f"{c}_bwd" for c in LAYER_COMPONENTS)]
    out = {k: m * sum(n * moe.get(k, 0.0) + nd * dense.get(k, 0.0) for n, nd in layers) / d.pp
           for k in keys}
    b = e.breakdown_s
    tokens = pl.micro_batch_tokens(plan)
    # the runtime's loss region holds the cross-entropy, and under the chunked loss the LM
    # head's GEMMs too, its backward ones included (runtime.loss); the materialized loss's
    # GEMM runs in the model's forward
    loss = head_edge(plan, plan.cross_entropy).fwd_s
    if plan.cross_entropy == CrossEntropy.materialized:
        loss -= pl.head_gemm_s(plan.model, plan.cluster, tokens, d.tp)[0]
    out["loss"] = m * loss / d.pp
    out["forward"] = m * sum(e.stage_forward_s) / d.pp
    out["backward"] = m * sum(e.stage_backward_s) / d.pp
    # the runtime's pipeline_comm also holds the waits for a peer that the bubble prices
    out["pipeline_comm"] = b["pp_p2p"]
    out["forward_backward"] = e.step_time_s - b["grad_sync"] - b["optimizer"]
    out["grad_sync"] = b["grad_sync"]
    out["optimizer"] = b["optimizer"]
    return out
