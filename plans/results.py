"""Benchmark results as typed documents: what bench/ and the runtime's measuring commands
(`moeplan profile`, `sweep`, `overlap`, `dispatch`) write and calibration, fidelity and the
reports read (instead of parsing row names). Fields a reader does not use are kept
(``extra="allow"``), so a result round-trips; every committed result under bench/results
parses (tests/bench/test_campaigns.py). Every result carries the ``schema_version`` it was
written in and the facts of the runtime it was measured under (``MEASURED_UNDER``, stamped by
runtime.provenance.metadata). A bad file is a one-line SpecError naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StrictBool,
    ValidationError,
    model_validator,
)

from plans.enums import Dispatch
from plans.errors import SpecError, describe
from plans.io import parse_text, read_text
from plans.notation import DISPATCH_KEYS
from plans.operators import COMPONENT_KEYS
from plans.plan import OptimizerSharding, Prediction

SCHEMA_VERSION = 1
"""The result documents' schema, which this module reads; a document of another is refused."""

@dataclass(frozen=True)
class RuntimeFacts:
    """What the runtime that measured a result executed where it moves the result's price
    (each a field of the result documents; runtime.provenance.metadata stamps this tree's,
    ``MEASURED_UNDER``); cost_models.memory.memory_breakdown prices a result under its own.

    - ``eager_step_in_buckets``: the eager optimizer step casts the main gradients to fp32 and
      steps one bucket at a time (runtime.parallel.optimizer); false: every gradient cast at
      once (cost_models.memory.optimizer_step_workspace prices either);
    - ``loss_grad_over_logits``: the fused chunked loss writes each chunk's gradient over its
      logits (runtime.kernels.cross_entropy_grad_over); false: beside them, 2 bytes a logit
      more (cost_models.memory.loss_bytes);
    - ``head_grad_in_main_grad``: under gradient-accumulation fusion the chunked loss adds the
      LM head's weight gradient into its main gradient (plans.layout.accumulates_head_in_gemm);
      false: summed in fp32 over the chunks and cast at the end of the forward."""

    eager_step_in_buckets: bool = True
    loss_grad_over_logits: bool = True
    head_grad_in_main_grad: bool = True

    @classmethod
    def of(cls, doc: Mapping) -> RuntimeFacts:
        """The facts a result document states; one it leaves out is what the runtime did
        before it was stamped (RESULT_DEFAULTS)."""
        return cls(**{f.name: bool(doc.get(f.name, RESULT_DEFAULTS[f.name])) for f in fields(cls)})


THIS_RUNTIME = RuntimeFacts()
"""The facts of this tree's runtime."""
MEASURED_UNDER = MappingProxyType(asdict(THIS_RUNTIME))
"""THIS_RUNTIME as the fields runtime.provenance.metadata stamps on every result it writes."""
RESULT_DEFAULTS = MappingProxyType({"eager_step_in_buckets": True,
                                    "loss_grad_over_logits": False,
                                    "head_grad_in_main_grad": False})
"""A fact a result document does not state: what the runtime did before it stamped it."""


class Result(BaseModel):
    """Provenance every result carries (bench/_meta.py, runtime/provenance.py)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    SOURCE: ClassVar[str] = ""
    """What writes documents of this kind."""

    schema_version: Literal[SCHEMA_VERSION] = SCHEMA_VERSION
    """The schema the document was written in (every writer stamps it; a document without it
    is read as this one)."""
    commit: str | None = None
    date: str | None = None
    torch: str | None = None
    gpu: str | None = None


# ---- training steps ---------------------------------------------------------------------------


def _known_components(seconds: dict[str, float]) -> dict[str, float]:
    if unknown := sorted(set(seconds) - set(COMPONENT_KEYS)):
        raise ValueError(f"unknown timer component {', '.join(unknown)} (plans.COMPONENT_KEYS: "
                         f"{', '.join(COMPONENT_KEYS)})")
    return seconds


ComponentSeconds = Annotated[dict[str, float], AfterValidator(_known_components)]
"""Seconds per runtime timer component (``plans.Component``, backward as ``<name>_bwd``)."""


class TrainStepResult(Result):
    """A measured training step of one plan."""

    SOURCE: ClassVar[str] = "bench/steps/train_step.py"

    plan: str = ""
    """The plan file that ran."""
    plan_summary: str = ""
    world: PositiveInt = 1
    step_time_s: PositiveFloat
    mfu: NonNegativeFloat
    peak_memory_gib_per_rank: list[PositiveFloat] = Field(min_length=1)
    """Peak allocated device memory per rank."""
    peak_reserved_gib_per_rank: list[PositiveFloat] | None = None
    """Peak reserved by the caching allocator per rank (what the cost model's peak predicts);
    None where the run did not record it."""
    allocator_per_rank: list[dict] | None = None
    """Where the reserve over the allocated peak sits, per rank (runtime.memory.
    allocator_breakdown: active, requested and fragment peaks, retries, reserved per stream;
    empty off CUDA); None where the run did not record it."""
    eager_step_in_buckets: StrictBool = RESULT_DEFAULTS["eager_step_in_buckets"]
    """How the run's eager optimizer stepped (RuntimeFacts): its peak is priced so."""
    loss_grad_over_logits: StrictBool = RESULT_DEFAULTS["loss_grad_over_logits"]
    """Whether the run's fused loss wrote its gradient over its logits (RuntimeFacts)."""
    head_grad_in_main_grad: StrictBool = RESULT_DEFAULTS["head_grad_in_main_grad"]
    """Whether the run's loss added the head's gradient into its main gradient (RuntimeFacts)."""

    @property
    def facts(self) -> RuntimeFacts:
        return RuntimeFacts(self.eager_step_in_buckets, self.loss_grad_over_logits,
                            self.head_grad_in_main_grad)
    components_s: ComponentSeconds = {}
    """Seconds per runtime component (plans.Component), mean over ranks."""
    tokens_per_step: PositiveInt | None = None
    flops_per_token: PositiveFloat | None = None
    """The model's training FLOPs per token at the run's sequence length (ModelSpec)."""
    measured_steps: PositiveInt
    routing_skew: PositiveFloat | None = None
    """Mean over steps, ranks, MoE layers and micro-batches of max / mean routed slots per
    expert (TrainingSpec.routing_skew's measurement); None where the run did not log it."""
    routing_skew_max: PositiveFloat | None = None
    expert_rows_per_rank: list[NonNegativeInt | None] | None = None
    """Routed rows each rank's experts computed over the measured steps (None on a rank without
    MoE layers); None where the run did not count them."""
    expert_rows_per_rank_layer: list[list[NonNegativeInt] | None] | None = None
    """The same per MoE layer of each rank."""
    ep_rank_load_step: PositiveFloat | None = None
    """The EP groups' busiest rank's rows over the group's mean, of the whole step's rows (every
    layer summed): a lower bound of the per-layer imbalance, since different layers' hot ranks
    average out (None without EP)."""
    ep_rank_load_layer: PositiveFloat | None = None
    """The same per MoE layer, averaged over layers and groups: the measured counterpart of
    cost_models.skew.rank_skew, which paces each layer."""
    optimizer_sharding: OptimizerSharding = OptimizerSharding.zero1
    ulysses_head_groups: PositiveInt | None = None
    """Head groups the runtime's Ulysses cores moved heads in (1: every all-to-all blocking;
    runtime.parallel.attention.head_groups); None where the run did not record them: its
    Ulysses all-to-alls all blocked."""
    prediction: Prediction | None = None


class LogStep(BaseModel):
    """One step of the runtime's JSON-lines log (``--log-file``)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    SOURCE: ClassVar[str] = "the runtime's --log-file"

    step_time_s: PositiveFloat
    mfu: NonNegativeFloat
    peak_memory_gib: PositiveFloat
    components_s: ComponentSeconds = {}


class ParityResult(Result):
    """A layout's bf16 loss and gradients against the one-GPU references."""

    SOURCE: ClassVar[str] = "runtime/parity.py"

    plan: str
    world: PositiveInt
    loss_rel_err: NonNegativeFloat
    grad_max_rel_err: NonNegativeFloat
    passed: bool = Field(alias="pass")


# ---- kernels and collectives --------------------------------------------------------------------


class KernelRow(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    kind: str = Field(alias="class")
    s_per_step: NonNegativeFloat


class ProfileResult(Result):
    """Device seconds per kernel class of one step."""

    SOURCE: ClassVar[str] = "moeplan profile"

    plan: str = ""
    """The plan file that ran, as given."""
    plan_summary: str = ""
    model: str = ""
    """The plan's model name; empty where the profile did not record it."""
    step_wall_s: PositiveFloat
    kernel_calls_per_step: NonNegativeFloat | None = None
    """Kernels the step launched (each class's calls summed); None where not recorded."""
    class_s: dict[str, NonNegativeFloat]
    components_s: ComponentSeconds = {}
    slowest: list[KernelRow]


class SweepOp(StrEnum):
    """What a row of the kernel and collective sweep timed."""

    gemm = "gemm"
    grouped_mm = "grouped_mm"
    flash_attn = "flash_attn"
    attention_core = "attention_core"
    """The runtime's attention core (RoPE, GQA key/value expansion, causal SDPA;
    runtime.model.AttentionCore), priced as the cost model prices FlashAttention."""
    copy = "copy"
    all_to_all = "all_to_all"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    memory = "memory"
    """A memory-bound kernel (elementwise, gather, index_add, sort): ``bytes`` read and written."""
    head_loss = "head_loss"
    """The runtime's final RMSNorm, LM head and cross-entropy (``shape["chunked"]`` 1: the
    chunked loss, 0: materialized) over ``shape["tokens"]`` of catalog model ``shape["model"]``,
    forward + backward, priced as cost_models.pipeline.head_cost."""
    layer_op = "layer_op"
    """One of the runtime's memory-bound layer operators, priced as the cost model's operator
    ``layer_op`` of a layer of catalog model ``shape["model"]`` over ``shape["tokens"]``."""

    @property
    def collective(self) -> bool:
        return self in (SweepOp.all_to_all, SweepOp.all_gather, SweepOp.reduce_scatter)


class SweepRow(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    name: str
    """A label for people; readers use ``op`` and ``bytes``."""
    op: SweepOp
    bytes: PositiveInt | None = None
    """Buffer size of a copy (bytes copied) or collective (the NCCL buffer convention of
    cost_models.comm: all-to-all one rank's send buffer, all-gather / reduce-scatter the full
    buffer); None for compute kernels."""
    measured_s: PositiveFloat
    """One call timed between CUDA events on an idle GPU: the host's dispatch of the call is
    inside (runtime.measure.timed)."""
    device_s: PositiveFloat | None = None
    """The same call's kernels with the host ahead of the GPU (runtime.measure.device_timed:
    a spin kernel holds the GPU while the host queues the call): the die's time, dispatch
    excluded. None for collectives, and for kernel rows of sweeps that did not time it."""
    achieved_tb_s: PositiveFloat | None = None
    shape: dict[str, int | str] = {}
    """What ran (runtime/sweep.py): gemm m, n, k; grouped_mm experts, rows (per
    expert), n, k; flash_attn and attention_core batch, seq, heads, head_dim (attention_core also
    kv_heads and model); layer_op model, tokens; head_loss model, tokens, chunked. Empty where
    the sweep did not record the shape (such kernel rows are not fitted)."""
    backward: bool = False
    """The row timed forward and backward (autograd), not the forward alone."""
    layer_op: str | None = None

    @model_validator(mode="after")
    def _sized(self) -> SweepRow:
        sized = (SweepOp.copy, SweepOp.memory)
        if (self.op.collective or self.op in sized) and self.bytes is None:
            raise ValueError(f"bytes: a {self.op} row needs its buffer size")
        return self


class Sweep(Result):
    """Kernels, copies and collectives as measured; `moeplan calibrate` prices each row."""

    SOURCE: ClassVar[str] = "moeplan sweep"

    world: PositiveInt
    """Ranks the sweep ran on; one rank times kernels and copies only (no collectives)."""
    rows: list[SweepRow]



# ---- communication beside compute -------------------------------------------------------------


class OverlapRow(BaseModel):
    """One MoE shape at EP = 2: its expert GEMMs alone, the dispatch's NCCL all-to-all alone,
    and the two launched together on two streams."""

    model_config = ConfigDict(extra="allow", frozen=True)

    shape: dict[str, str | int] = {}
    """The MoE shape: name, tokens, top_k, hidden, ffn, experts."""
    compute_s: PositiveFloat
    nccl_s: PositiveFloat
    nccl_beside_compute_s: PositiveFloat


class OverlapBench(Result):
    """An NCCL collective on a side stream beside the expert GEMMs (and a copy-engine peer
    copy beside them, which calibration does not read)."""

    SOURCE: ClassVar[str] = "moeplan overlap"

    world: int = Field(ge=2)
    rows: list[OverlapRow] = Field(min_length=1)


# ---- EP dispatchers ------------------------------------------------------------------------------


class DispatchTimes(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    fwd_s: PositiveFloat
    fwd_bwd_s: PositiveFloat


class DispatcherRow(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    measured: DispatchTimes


class DispatchRow(BaseModel):
    """One top-k of one shape: each dispatcher's dispatch + combine."""

    model_config = ConfigDict(extra="allow", frozen=True)

    top_k: PositiveInt
    a2a: DispatcherRow
    ag_rs: DispatcherRow

    def of(self, dispatch: Dispatch) -> DispatcherRow:
        return getattr(self, DISPATCH_KEYS[dispatch])


class DispatchShape(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    hidden: PositiveInt
    experts: PositiveInt
    seq_len: PositiveInt
    tokens_per_rank: PositiveInt
    rows: list[DispatchRow] = Field(min_length=1)


class DispatchSweep(Result):
    """The runtime's EP dispatchers over shapes and top-k (runtime/dispatch_sweep.py):
    measurements only, each point priced by planner.dispatch_fit where it is read."""

    SOURCE: ClassVar[str] = "moeplan dispatch"

    world: int = Field(ge=2)
    configs: list[DispatchShape] = Field(min_length=1)


# ---- reading ------------------------------------------------------------------------------------

R = TypeVar("R", bound=BaseModel)


def _text(path: Path, what: str) -> str:
    """A bounded regular file (plans.io): a device or FIFO is refused, never read."""
    return read_text(path, f"{what}: {path}", "json")


def parse(kind: type[R], text: str, what: str, path: Path) -> R:
    """One JSON document as ``kind``; one-line SpecError naming the field otherwise."""
    data = parse_text(text, f"{what}: {path}", "json")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        source = getattr(kind, "SOURCE", "")
        raise SpecError(f"{what}: {path}: {describe(e)} (is it {source}'s output?)") from None


def read(kind: type[R], path: Path, what: str) -> R:
    """A benchmark result file as ``kind``; one-line SpecError naming the field otherwise."""
    return parse(kind, _text(path, what), what, path)


def read_log(path: Path, what: str) -> list[LogStep]:
    """The runtime's JSON-lines log, one LogStep per line."""
    lines = [ln for ln in _text(path, what).splitlines() if ln.strip()]
    return [parse(LogStep, ln, what, path) for ln in lines]


def recorded_deviations(result: BaseModel) -> list[dict] | None:
    """The plan fields a measured run executed differently, as the result recorded them
    (plans.execution.record); None where it recorded none (plans.execution.executed_as_measured
    then reads the capability table)."""
    return (result.model_extra or {}).get("deviations")
