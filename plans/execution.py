"""What moeplan's runtime (``runtime/``) executes of a plan: the one capability table.

For every plan field and value, per backend, one of three answers:

- ``executed``: the runtime runs it as written;
- ``runs_as``: the runtime runs another value of the field with the same maths (a slower
  schedule, not other numbers): the launch prints it, results record it, and the cost model
  prices the run as executed (``executed_plan``), never as written;
- ``refused``: the runtime cannot run it; the launch fails before any work with one line
  naming the field (``check``).

The runtime's launch check, ``moeplan search --runnable`` and the pricing of measured runs
(calibration, fidelity) read this table; nothing else decides. A test checks that it covers
every field of the Plan schema and every value of its enum and boolean fields.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum, StrEnum

from pydantic import BaseModel

from plans.errors import SpecError
from plans.plan import Plan

GRAD_SYNC_BUCKET_PARAMS = 40_000_000
"""Parameters per gradient-sync bucket: the runtime's buckets (runtime.parallel.data_parallel)
and the cost model's last, unhidden bucket (cost_models.grad_sync). Megatron-LM DDP's default
(``bucket_size`` = max(40M, 1M x dp) in megatron/core/distributed/distributed_data_parallel.py;
the dp term only matters past 40 replicas)."""


class Backend(StrEnum):
    """Where the runtime runs: the parameter dtype and the collectives differ."""

    cpu_gloo = "cpu_gloo"
    """CPU processes over gloo: fp32 parameters and compute (the parity reference)."""
    cuda_nccl = "cuda_nccl"
    """CUDA GPUs over NCCL: bf16 parameters and compute, fp32 optimizer masters."""


class Support(StrEnum):
    executed = "executed"
    runs_as = "runs_as"
    refused = "refused"


class _Any:
    """Every value of a field (sizes, specs, degrees): what the rule says holds for all."""

    def __repr__(self) -> str:
        return "*"


ANY = _Any()


@dataclass(frozen=True)
class Capability:
    field: str
    """Dotted path of the plan field, e.g. ``attention.kind`` or ``training.precision``."""
    value: object
    """The planned value (an enum member, a bool, a string tag, or ANY)."""
    support: Support
    reason: str = ""
    runs: object = None
    """For ``runs_as``: the value the runtime executes instead."""
    backends: tuple[Backend, ...] = tuple(Backend)

    def matches(self, value: object, backend: Backend) -> bool:
        return backend in self.backends and (self.value is ANY or self.value == value)


def _executed(field: str, *values: object, reason: str = "",
              backends: tuple[Backend, ...] = tuple(Backend)) -> tuple[Capability, ...]:
    return tuple(Capability(field, v, Support.executed, reason, backends=backends)
                 for v in values)


_INTER_OP_WHAT = (
    "EP layers (ep > 1) dispatch and combine in plans.layout.INTER_OP_CHUNKS token chunks, "
    "their collectives on a communication stream beside the expert GEMMs and permutations "
    "(runtime.parallel.overlap); Ulysses attention (sp > 1) moves its heads in "
    "plans.layout.ulysses_chunks head groups, each group's all-to-alls beside the other "
    "group's attention core (runtime.parallel.attention); TP attention's and expert TP's "
    "collectives block")
_INTRA_OP_WHY = "no tile-level fused communication kernels; the inter-operator overlap runs"
_BF16_WHY = "GEMMs run in bf16; fp8 applies to the gradient sync only"
_CPU_WHY = "CPU runs fp32 parameters and compute (the parity reference)"

TABLE: tuple[Capability, ...] = (
    Capability("target", "moeplan", Support.executed),
    Capability("cuda_graphs", "none", Support.executed),
    *(Capability("cuda_graphs", v, Support.refused, "moeplan's runtime captures no CUDA graphs")
      for v in ("moe_router", "attn_moe_router")),
    Capability("target", "megatron", Support.refused,
               "the plan is for Megatron-Core: launch it with `moeplan export --to megatron`"),
    # the job: the model and batch are built as written; the cluster is the launch's
    *_executed("model", ANY, reason="every ModelSpec the schema accepts, dropout aside"),
    Capability("model.dropout", False, Support.executed),
    Capability("model.dropout", True, Support.refused,
               "the model asks for dropout; this runtime trains without (set model.dropout 0)"),
    *_executed("cluster", ANY, reason="the launch's GPUs; the spec gives peak FLOP/s for MFU"),
    *_executed("training.global_batch", ANY),
    *_executed("training.seq_len", ANY),
    *_executed("training.routing_skew", ANY, reason="the router routes as it learns; the cost "
               "model prices the skew and the runtime logs the measured one (routing_skew)"),
    *_executed("training.optimizer", "adam", reason="AdamW (decoupled weight decay) on fp32 "
               "masters"),
    *_executed("training.optimizer", "sgd", reason="plain SGD (no momentum) on fp32 masters"),
    Capability("training.precision", "bf16", Support.executed, backends=(Backend.cuda_nccl,)),
    Capability("training.precision", "fp8", Support.runs_as, _BF16_WHY, "bf16",
               (Backend.cuda_nccl,)),
    Capability("training.precision", "bf16", Support.runs_as, _CPU_WHY, "fp32",
               (Backend.cpu_gloo,)),
    Capability("training.precision", "fp8", Support.runs_as, _CPU_WHY, "fp32",
               (Backend.cpu_gloo,)),
    Capability("training.precision", "fp32", Support.refused,
               "training is mixed precision (bf16 or fp8)"),
    # the layout
    *_executed("degrees", ANY, reason="pp, vpp, dp, sp, tp, ep, etp; cp only with cp attention"),
    *_executed("stage_layers", ANY),
    *_executed("micro_batch_size", ANY),
    *_executed("attention.kind", "ulysses_sp", "tp",
               reason="tp: Megatron-LM's tensor parallelism, the attention heads, the dense FFNs "
               "and the vocabulary (embedding, LM head, loss) split over tp with the sequence "
               "sharded between them (runtime.parallel.attention, runtime.parallel.tensor)"),
    Capability("attention.kind", "cp", Support.refused,
               "no context-parallel attention (priced for comparison only); use ulysses_sp "
               "or tp"),
    Capability("attention.zigzag", ANY, Support.refused, "context-parallel attention only"),
    *_executed("ffn.kind", "ep", "tp",
               reason="tp: expert TP, every routed expert and the shared experts split over "
               "etp, the group's tokens all-gathered before and the partial sums "
               "reduce-scattered after (runtime.parallel.expert.ExpertTPDispatcher)"),
    *_executed("ffn.dispatch", "all_to_all", "allgather_reduce_scatter"),
    *_executed("ffn.capacity_factor", ANY, reason="null is dropless"),
    *_executed("schedule", "1f1b", "interleaved_1f1b"),
    # how a step runs
    Capability("overlap", "none", Support.executed),
    Capability("overlap", "inter_op", Support.executed, _INTER_OP_WHAT),
    Capability("overlap", "inter_intra_op", Support.runs_as, _INTRA_OP_WHY, "inter_op"),
    *_executed("recompute", "none", "selective", "full",
               reason="selective reruns the attention core (RoPE and SDPA)"),
    *_executed("cross_entropy", "chunked", "materialized"),
    *_executed("kernels", "eager", "fused",
               reason="fused: torch.compile regions (runtime.kernels; inductor's C++ backend "
               "on CPU), the chunked loss's softmax and gradient one region per chunk and its "
               "weight gradient summed in fp32 inside the GEMMs on CUDA; the router and the "
               "materialized loss stay eager"),
    *_executed("optimizer_sharding", "none", "zero1"),
    *_executed("grad_sync_precision", "fp32", "bf16", "fp8",
               reason="fp8: E4M3 payloads in 1 x 128 blocks, fp32 sums"),
    *_executed("grad_sync_overlap", False, True,
               reason="true: buckets of 40M parameters launched from the last micro-batch's "
               "backward hooks, waited for before the optimizer"),
    *_executed("grad_accumulation_fusion", False, True,
               reason="true: the blocks' Linear layers, and routed experts where "
               "plans.layout.accumulates_experts_in_gemm holds (few wide experts per rank, one "
               "matmul each), add their weight gradients into the main gradients inside the GEMM "
               "(addmm); the grouped-GEMM experts, the embedding and the LM head add theirs in a "
               "separate pass (runtime.parallel.grad_accumulation)"),
)
"""The capability table: every plan field, every value, per backend."""

NOT_EXECUTED = ("schema_version", "prediction")
"""Plan fields that describe the plan and instruct nothing."""


def _text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return value.value if isinstance(value, Enum) else str(value)


def lookup(field: str, value: object, backend: Backend) -> Capability:
    """The table's answer for ``field`` = ``value`` on ``backend`` (first matching row)."""
    text = value if isinstance(value, bool) or value is ANY else _text(value)
    for row in TABLE:
        if row.field == field and row.matches(text, backend):
            return row
    raise KeyError(f"plans.execution.TABLE has no row for {field} = {_text(value)} on {backend}")


def executed_value(field: str, value: object, backend: Backend) -> object:
    """The value of ``field`` the runtime runs on ``backend`` when the plan says ``value``
    (``value`` itself unless the table says runs_as), in the field's type."""
    row = lookup(field, value, backend)
    return _typed(value, row.runs) if row.support == Support.runs_as else value


def executes(field: str, value: object, backend: Backend = Backend.cuda_nccl) -> bool:
    """Whether the runtime runs ``field`` = ``value`` as written."""
    return lookup(field, value, backend).support == Support.executed


def plan_fields(plan: Plan) -> Iterator[tuple[str, object]]:
    """(dotted field, value) of every instruction in ``plan``: the specs whole, the strategies
    and the training spec field by field."""
    for name in type(plan).model_fields:
        if name in NOT_EXECUTED:
            continue
        value = getattr(plan, name)
        if name in ("attention", "ffn", "training"):
            for sub in type(value).model_fields:
                yield f"{name}.{sub}", getattr(value, sub)
        else:
            yield name, value
        if name == "model":
            yield "model.dropout", value.dropout > 0  # whether the model asks for dropout


def _answers(plan: Plan, backend: Backend) -> Iterator[tuple[Capability, object]]:
    for field, value in plan_fields(plan):
        if isinstance(value, BaseModel | tuple) or value is None:
            yield lookup(field, ANY, backend), value
        elif isinstance(value, Enum | bool | str):
            yield lookup(field, value, backend), value
        else:
            yield lookup(field, ANY, backend), value


class UnsupportedFeature(SpecError):
    """A plan field this runtime cannot run: one line naming the field and the reason."""


def refusals(plan: Plan, backend: Backend) -> list[str]:
    """One line per plan field the runtime cannot run on ``backend``."""
    return [f"{row.field}: {_text(value)} is not run by this runtime ({backend}): {row.reason}"
            for row, value in _answers(plan, backend) if row.support == Support.refused]


def check(plan: Plan, backend: Backend) -> None:
    """Refuse, before any work, a plan with a field the runtime cannot run (the first one)."""
    if found := refusals(plan, backend):
        raise UnsupportedFeature(found[0])


@dataclass(frozen=True)
class Deviation:
    """A plan field this runtime runs as another value with the same maths: the run is the
    plan's layout and numbers, only slower or with more traffic."""

    field: str
    planned: str
    executed: str
    reason: str

    def note(self) -> str:
        return f"note: {self.field}: planned {self.planned}, runs {self.executed}: {self.reason}"


def _deviating(plan: Plan, backend: Backend) -> list[tuple[Capability, object]]:
    return [(row, value) for row, value in _answers(plan, backend)
            if row.support == Support.runs_as]


def deviations(plan: Plan, backend: Backend = Backend.cuda_nccl) -> list[Deviation]:
    """The plan fields this runtime runs as another value on ``backend`` (``check`` refuses
    the ones it cannot run at all). Hold a measurement against the plan as executed."""
    return [Deviation(row.field, _text(value), _text(row.runs), row.reason)
            for row, value in _deviating(plan, backend)]


def _typed(current: object, text: object) -> object:
    """The table's value ``text`` in the type of the field's current value."""
    return type(current)(text) if isinstance(current, Enum) else text


def executed_plan(plan: Plan, backend: Backend = Backend.cuda_nccl,
                  recorded: list[dict] | None = None) -> Plan:
    """The plan as this runtime runs it on ``backend`` (for the cost model; not re-validated,
    since e.g. fp8 gradient sync over bf16 GEMMs is a combination plans do not offer).
    UnsupportedFeature when a field is refused. ``recorded``: the deviations a measured run
    wrote (``{"field", "executed"}`` each: what the runtime of its commit ran), applied
    instead of this table's."""
    check(plan, backend)
    ran = ([(row.field, value, row.runs) for row, value in _deviating(plan, backend)]
           if recorded is None else
           [(d["field"], v, _parsed(v, d["executed"]))
            for d in recorded for v in (_value_of(plan, d["field"]),)])
    updates: dict[str, dict[str, object]] = {}
    top: dict[str, object] = {"prediction": None}
    for field, value, runs in ran:
        head, _, leaf = field.partition(".")
        if leaf:
            updates.setdefault(head, {})[leaf] = _typed(value, runs)
        else:
            top[head] = _typed(value, runs)
    for head, fields in updates.items():
        top[head] = getattr(plan, head).model_copy(update=fields)
    return plan.model_copy(update=top)


def _value_of(plan: Plan, field: str) -> object:
    value: object = plan
    for part in field.split("."):
        value = getattr(value, part)
    return value


def _parsed(current: object, text: object) -> object:
    return text == "true" if isinstance(current, bool) and isinstance(text, str) else text


_BEFORE_FUSION = ("results without the record predate it, and no runtime before it fused the "
                  "gradient accumulation")


EAGER_STEP_IN_BUCKETS_SINCE = "2026-12-01T09:34:07+00:00"
"""When the runtime's eager optimizer step began casting the main gradients to fp32 one bucket
at a time (commit 029a588 on main): a result measured before it cast every gradient at once,
and its peak is priced that way (``steps_in_buckets``). Runs are made from main's tree of
their day, so a result's date says which runtime made it."""


def steps_in_buckets(measured_on: str | None) -> bool:
    """Whether a run measured on ``measured_on`` (its result's ``date``, ISO 8601) stepped the
    eager optimizer one bucket at a time; a run without a date is taken as the runtime's now."""
    if measured_on is None:
        return True
    try:
        when = datetime.fromisoformat(measured_on)
    except ValueError:
        raise SpecError(f"date: '{measured_on}' is not an ISO 8601 time") from None
    if when.tzinfo is None:  # written without an offset: UTC, as the results are
        when = when.replace(tzinfo=UTC)
    return when >= datetime.fromisoformat(EAGER_STEP_IN_BUCKETS_SINCE)


def record(plan: Plan, backend: Backend) -> list[dict]:
    """What a measured result writes of how its run executed ``plan`` (``deviations``): read
    back by ``executed_as_measured``."""
    return [{"field": d.field, "planned": d.planned, "executed": d.executed}
            for d in deviations(plan, backend)]


def measured_deviations(plan: Plan, recorded: list[dict] | None,
                        backend: Backend = Backend.cuda_nccl) -> list[Deviation]:
    """The fields a measured run executed differently from ``plan`` (``executed_as_measured``)."""
    if recorded is not None:
        return [Deviation(d["field"], d["planned"], d["executed"], "recorded by the run")
                for d in recorded]
    legacy = deviations(plan.model_copy(update={"grad_accumulation_fusion": False}), backend)
    if plan.grad_accumulation_fusion:
        legacy.insert(0, Deviation("grad_accumulation_fusion", "true", "false", _BEFORE_FUSION))
    return legacy


def executed_as_measured(plan: Plan, recorded: list[dict] | None,
                         backend: Backend = Backend.cuda_nccl) -> Plan:
    """The plan as a measured run executed it: the deviations the run recorded
    (bench/train_step.py, ``moeplan profile`` and the runtime's log write them), or, for a
    result that recorded none, this table's with gradient-accumulation fusion run as false:
    results without the record predate it, and no runtime before it fused the gradient
    accumulation."""
    if recorded is None:
        return executed_plan(plan.model_copy(update={"grad_accumulation_fusion": False}), backend)
    return executed_plan(plan, backend, recorded)
