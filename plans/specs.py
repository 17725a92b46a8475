"""Model, cluster and training specifications: the inputs every plan is made for.

Units are in field names: ``_tflops`` (10^12 FLOP/s), ``_gb_s`` (10^9 bytes/s), ``_tb_s``
(10^12 bytes/s), ``_gib`` (2^30 bytes), ``_us`` (microseconds).
"""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from typing import Annotated

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from plans.enums import Dispatch, Kernels, Precision


class Frozen(BaseModel):
    """Base of every contract type: immutable, unknown fields rejected, docstrings as docs."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True,
        ignored_types=(cached_property,), allow_inf_nan=False,
    )


# Hardware quantities outside this range (in each field's unit) are typing mistakes, and they make
# the cost model's times overflow to inf or nan.
HARDWARE_RANGE = (1e-6, 1e9)


def _in_range(v: float) -> float:
    lo, hi = HARDWARE_RANGE
    if v != 0 and not lo <= v <= hi:
        raise ValueError(f"{v:g} is out of range (nonzero values must lie in [{lo:g}, {hi:g}])")
    return v


Fraction = Annotated[float, Field(gt=0, le=1), AfterValidator(_in_range)]
"""An efficiency: a fraction of peak in (0, 1]."""
Rate = Annotated[float, Field(gt=0), AfterValidator(_in_range)]
"""A positive hardware quantity (throughput, bandwidth, capacity)."""
Latency = Annotated[float, Field(ge=0, le=HARDWARE_RANGE[1])]
"""A latency: zero or more, finite."""

# Counts beyond these bounds describe no machine or model that exists or is planned, and a count
# of hundreds of digits makes the search's arithmetic (and Python's big integers) run for ever.
MAX_GPUS = 2**20
"""GPUs in a job (about a million)."""
MAX_WIDTH = 2**20
"""hidden, inner FFN widths, head width (the largest models today: hidden 16k, FFN 64k)."""
MAX_LAYERS = 10_000
MAX_HEADS = 2**16
MAX_EXPERTS = 2**20
MAX_VOCAB = 2**32
"""Token ids are stored as uint32 at most."""
MAX_TOKENS = 2**24
"""Sequences per batch and tokens per sequence (16M each)."""
MAX_PER_NODE = 2**16
"""GPUs per NVLink domain, NICs per node, SMs per GPU."""


Layers = Annotated[int, Field(gt=0, le=MAX_LAYERS)]
Width = Annotated[int, Field(gt=0, le=MAX_WIDTH)]
Heads = Annotated[int, Field(gt=0, le=MAX_HEADS)]
Experts = Annotated[int, Field(gt=0, le=MAX_EXPERTS)]
Vocab = Annotated[int, Field(gt=0, le=MAX_VOCAB)]
Tokens = Annotated[int, Field(gt=0, le=MAX_TOKENS)]
PerNode = Annotated[int, Field(gt=0, le=MAX_PER_NODE)]
GPUs = Annotated[int, Field(gt=0, le=MAX_GPUS)]
OptionalLayers = Annotated[int, Field(ge=0, le=MAX_LAYERS)]
OptionalWidth = Annotated[int, Field(ge=0, le=MAX_WIDTH)]
OptionalExperts = Annotated[int, Field(ge=0, le=MAX_EXPERTS)]


def _printable(v: str) -> str:
    if not v.isprintable():
        raise ValueError("must be printable text (no control characters, line breaks or "
                         "unpaired surrogates)")
    return v


Name = Annotated[str, StringConstraints(min_length=1, max_length=200), AfterValidator(_printable)]
"""A name shown in reports and plots: printable, one line, at most 200 characters."""


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class ModelSpec(Frozen):
    """A decoder-only MoE transformer: GQA attention and SwiGLU (routed + shared) experts."""

    name: Name
    """Name shown in reports."""
    layers: Layers
    """Transformer layers, MoE and dense together."""
    hidden: Width
    """Model (residual stream) width h."""
    query_heads: Heads
    """Attention query heads."""
    kv_heads: Heads
    """Attention key/value heads (GQA); query_heads / kv_heads is the paper's m."""
    head_dim: Width
    """Width of one attention head (query_heads * head_dim need not equal hidden)."""
    vocab: Vocab
    """Vocabulary size."""
    expert_ffn_hidden: Width
    """Inner width of one routed SwiGLU expert (h_ffn)."""
    experts: Experts
    """Routed experts per MoE layer."""
    top_k: Experts
    """Routed experts each token is sent to."""
    shared_experts: OptionalExperts = 0
    """Always-active shared experts per MoE layer."""
    shared_expert_ffn_hidden: OptionalWidth = 0
    """Inner width of one shared expert (0 when there are none)."""
    dense_layers: OptionalLayers = 0
    """Leading layers whose FFN is a dense SwiGLU instead of MoE."""
    dense_ffn_hidden: OptionalWidth = 0
    """Inner width of the dense layers' FFN (0 when there are none)."""
    tied_embeddings: bool = False
    """Whether the LM head shares the token-embedding matrix."""
    rope_theta: float = Field(10000.0, gt=0, le=1e12)
    """RoPE base (theta) of the rotary position embedding."""
    norm_eps: float = Field(1e-6, gt=0, lt=1)
    """Epsilon of every RMSNorm."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (head_dim wide) before RoPE (Qwen3, Hunyuan-Large)."""
    router_pre_softmax: bool = False
    """Routing weights are the softmax over all experts taken at the top-k (DeepSeekMoE,
    top-1 routers); false: the kept top-k weights are renormalised to sum to one (Mixtral)."""
    aux_loss_coeff: float = Field(0.01, ge=0, le=1)
    """Weight of the load-balancing loss (0 disables it)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Attention and hidden dropout probability (every catalog model trains without)."""

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.query_heads % self.kv_heads:
            raise ValueError(
                f"query_heads ({self.query_heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= experts ({self.experts})")
        if self.dense_layers >= self.layers:
            raise ValueError(
                f"dense_layers ({self.dense_layers}) must be < layers ({self.layers})"
            )
        if (self.shared_experts > 0) != (self.shared_expert_ffn_hidden > 0):
            raise ValueError(
                f"shared_experts ({self.shared_experts}) and shared_expert_ffn_hidden "
                f"({self.shared_expert_ffn_hidden}) must both be zero or both positive"
            )
        if (self.dense_layers > 0) != (self.dense_ffn_hidden > 0):
            raise ValueError(
                f"dense_layers ({self.dense_layers}) and dense_ffn_hidden "
                f"({self.dense_ffn_hidden}) must both be zero or both positive"
            )
        return self

    # ---- derived shape ----------------------------------------------------------------------
    @property
    def gqa_ratio(self) -> int:
        """m = query heads per KV head (paper notation)."""
        return self.query_heads // self.kv_heads

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def q_dim(self) -> int:
        return self.query_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # ---- parameter counts (norm weights included, biases absent) -----------------------------
    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one layer."""
        return self.hidden * (2 * self.q_dim + 2 * self.kv_dim)

    @property
    def expert_params(self) -> int:
        """One routed SwiGLU expert: fc1, gate (fc3) and fc2."""
        return 3 * self.hidden * self.expert_ffn_hidden

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer."""
        return self.shared_experts * 3 * self.hidden * self.shared_expert_ffn_hidden

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts

    @property
    def dense_ffn_params(self) -> int:
        return 3 * self.hidden * self.dense_ffn_hidden

    @property
    def embedding_params(self) -> int:
        """Token embedding plus, when untied, the LM head."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def _layer_params(self, routed_experts: int) -> int:
        norms = 2 * self.hidden
        moe = routed_experts * self.expert_params + self.shared_expert_params + self.router_params
        dense = self.dense_ffn_params + norms + self.attention_params
        return self.moe_layers * (self.attention_params + norms + moe) + self.dense_layers * dense

    @property
    def total_params(self) -> int:
        return self._layer_params(self.experts) + self.embedding_params + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token touches: top_k routed experts per MoE layer."""
        return self._layer_params(self.top_k) + self.embedding_params + self.hidden

    @property
    def matmul_params_per_token(self) -> int:
        """Weights used in matrix multiplies by one token: active parameters less norms and the
        embedding lookup (the LM head is a GEMM and counts)."""
        norms = (2 * self.layers + 1) * self.hidden
        lookup = self.vocab * self.hidden
        return self.active_params - norms - lookup

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token as the paper's MFU counts them: GEMMs and FlashAttention only.

        Forward = 2 x matmul weights (router and LM head included) + causal attention
        (QK^T and AV: 2 x 2 x s x q_dim per layer, halved by the causal mask).
        Training = 3 x forward (backward is twice the forward); recomputation is not counted.
        """
        gemm = 2 * self.matmul_params_per_token
        attention = self.layers * 2 * 2 * seq_len * self.q_dim * 0.5
        return (3 if training else 1) * (gemm + attention)


# --------------------------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------------------------


class GPUSpec(Frozen):
    name: Name
    bf16_dense_tflops: Rate
    """Peak dense bf16 tensor-core throughput."""
    fp8_dense_tflops: Rate
    """Peak dense fp8 tensor-core throughput."""
    hbm_gib: Rate
    """HBM capacity."""
    hbm_tb_s: Rate
    """HBM bandwidth."""
    sms: PerNode = 132
    """Streaming multiprocessors (wave quantisation of GEMM tiles)."""


class NodeSpec(Frozen):
    """One NVLink domain (a node, or a rack for NVL72)."""

    gpus_per_node: PerNode
    """GPUs sharing one NVLink domain."""
    nvlink_gb_s: Rate
    """NVLink bandwidth per GPU per direction."""
    nvlink_latency_us: Latency = 3.0
    """Latency of one NVLink collective step."""


class NetworkSpec(Frozen):
    """The scale-out network between NVLink domains."""

    name: Name
    nics_per_node: PerNode
    nic_gb_s: Rate
    """Bandwidth of one NIC per direction."""
    latency_us: Latency = 10.0
    """Latency of one network collective step."""


class DispatchFloors(Frozen):
    """A time per EP dispatcher (plans.enums.Dispatch), in microseconds."""

    all_to_all: Annotated[float, Field(ge=0)] = 3840.0
    allgather_reduce_scatter: Annotated[float, Field(ge=0)] = 3290.0

    def of(self, dispatch: Dispatch) -> float:
        return getattr(self, dispatch.value)


class Efficiency(Frozen):
    """Achievable fractions of peak; calibration on real GPUs replaces these."""

    gemm: Fraction = 0.80
    """Best dense GEMM throughput / peak, for large well-shaped GEMMs."""
    grouped_gemm: Fraction = 0.75
    """Best grouped (expert) GEMM throughput / peak, for experts of many rows."""
    grouped_gemm_half_rows: Annotated[float, Field(ge=0, le=MAX_TOKENS)] = 0.0
    """Rows per expert (the smallest dimension of one expert's GEMM) at which grouped GEMM
    throughput falls to half of ``grouped_gemm``: small experts run their tiles' prologues,
    epilogues and group scheduling over little work (cost_models.compute.grouped_efficiency).
    0: no dependence on the expert size (the uncalibrated default)."""
    gemm_launch_us: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    """Fixed time of one dense GEMM call beside its FLOPs: the kernel's launch, prologue and
    epilogue, and the host's dispatch of the call, which the GPU waits for when the call's
    work is small (cost_models.compute). Fitted by `moeplan calibrate` to GEMMs timed one call
    at a time over shapes; 0: throughput only (the uncalibrated default)."""
    grouped_gemm_launch_us: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    """The same for one grouped (expert) GEMM call: the runtime's call also computes the
    experts' row offsets, and the kernel schedules every group's tiles."""
    attention: Fraction = 0.60
    """FlashAttention throughput / peak."""
    hbm: Fraction = 0.85
    """Achieved HBM bandwidth / peak for memory-bound kernels streaming large buffers
    (optimizer step, gradient accumulation, casts, copies)."""
    elementwise: Fraction = 0.85
    """Achieved HBM bandwidth / peak of a layer's memory-bound operators (norms, SwiGLU,
    routing, permutations, residual adds), counted at their fused-kernel bytes: an unfused
    implementation makes extra passes over the activations and lands well below ``hbm``."""
    elementwise_launch_us: Annotated[float, Field(ge=0, le=1e6)] = 0.0
    """Fixed time of one eager kernel of a layer's memory-bound operator beside its bytes: the
    host's dispatch of the PyTorch op (autograd's record of it included) and the launch, which
    the GPU waits for when the kernels are small. An eager operator is several kernels
    (cost_models.layer_graph.eager_launches: RMSNorm 9 forward and 17 backward, the router 63);
    fused regions are priced by ``fused_elementwise`` alone. Fitted by `moeplan calibrate` with
    ``elementwise`` to the runtime's layer operators timed one at a time; 0: bytes only (the
    uncalibrated default)."""
    gather_scatter: Fraction = 0.306
    """Achieved HBM bandwidth / peak of the eager runtime's token permutation (row gathers,
    scatters and index-adds, counted pass by pass in cost_models.dispatch): used for plans with
    ``kernels: eager``. Default: the fit to moeplan's dispatchers on 2 H200s
    (bench/results/h200/dispatch_sweep_x2.json, planner.dispatch_fit)."""
    dispatch_floor_us: DispatchFloors = DispatchFloors()
    """Least time of one MoE layer's eager EP dispatch + combine, forward and backward, per
    dispatcher: the dispatch waits on the host for its split sizes (all-to-all) or kept rows
    (all-gather), so the GPU idles while the CPU launches the following small kernels. Same
    source as ``gather_scatter``; applies to ``kernels: eager`` with EP > 1."""
    fused_elementwise: Fraction = 0.85
    """The same operators as fused regions (plan.kernels fused: one torch.compile region each,
    runtime.kernels), at the same bytes. A prior until `moeplan calibrate` fits it to a
    profiled fused step: ``elementwise``'s default, which is already counted at fused-kernel
    bytes, so an uncalibrated cluster prices fused and eager plans alike (h200-runtime's
    ``elementwise`` was fitted to the eager runtime; its fused factor keeps this prior). Eager
    plans never read it."""
    nvlink: Fraction = 0.80
    """Achieved NVLink bus bandwidth / peak for ring collectives."""
    nvlink_all_to_all: Fraction = 0.65
    """Achieved NVLink bandwidth / peak for all-to-all (every peer at once)."""
    network: Fraction = 0.80
    """Achieved network bandwidth / peak."""
    overlap: float = Field(0.90, ge=0, le=1)
    """Share of overlappable communication actually hidden when compute runs beside it: 0 when
    a collective beside compute costs as much as after it (`moeplan calibrate --overlap`
    measures it: NCCL beside the expert GEMMs on the device, planner.calibrate.fit_overlap)."""
    memory_usable: Fraction = 0.92
    """The planner's memory safety margin: the fraction of HBM a plan's predicted peak (the
    caching allocator's reserve included) may use. The rest stays free for the CUDA context,
    NCCL's buffers and the prediction's error (docs/memory.md: -2.2% .. +6.7% on H200)."""


class FactorSource(StrEnum):
    """Where a cluster's efficiency factors come from."""

    measured = "measured"
    """Fitted to measurements (on this GPU or one of the same die)."""
    prior = "prior"
    """No measurement on this GPU: the Efficiency defaults or a figure carried from another."""


class EfficiencySource(Frozen):
    """The provenance of a cluster's ``efficiency`` factors, shown by `moeplan explain`."""

    kind: FactorSource
    note: Name
    """What was measured, or what the prior is taken from."""


class ClusterSpec(Frozen):
    name: Name
    gpu: GPUSpec
    node: NodeSpec
    network: NetworkSpec
    gpus: GPUs
    """GPUs in the job: a multiple of gpus_per_node, or fewer than one node."""
    efficiency: Efficiency = Efficiency()
    efficiency_source: EfficiencySource | None = None
    """Where ``efficiency`` comes from; None: not stated."""
    stage_time_cv: float = Field(0.023, ge=0, le=1)
    """Coefficient of variation of one GPU's time for one micro-batch's work (clocks, power,
    launch jitter): the pipeline and the data-parallel replicas wait for the slowest
    (cost_models.pipeline.straggler_s). Default: the median over the committed H200 train steps
    (bench/results/h200/train_step_*.json) of the step-time CV x sqrt(micro-batches)."""

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        g = self.node.gpus_per_node
        if self.gpus > g and self.gpus % g:
            raise ValueError(
                f"gpus ({self.gpus}) must be a multiple of node.gpus_per_node ({g}) "
                f"or fewer than one node"
            )
        return self

    @property
    def nvlink_domain(self) -> int:
        """GPUs that talk over NVLink: a node, or the whole job when it is smaller."""
        return min(self.gpus, self.node.gpus_per_node)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.node.gpus_per_node)

    @property
    def network_gb_s_per_gpu(self) -> float:
        """Scale-out bandwidth per GPU per direction."""
        return self.network.nics_per_node * self.network.nic_gb_s / self.node.gpus_per_node

    def with_gpus(self, gpus: int) -> ClusterSpec:
        return ClusterSpec.model_validate({**self.model_dump(), "gpus": gpus})


# --------------------------------------------------------------------------------------------
# Training job
# --------------------------------------------------------------------------------------------


class Optimizer(StrEnum):
    adam = "adam"
    sgd = "sgd"

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 master weights + optimizer moments (Adam: m and v)."""
        return {"adam": 12, "sgd": 4}[self.value]

    def runs_fused(self, kernels: Kernels) -> bool:
        """Whether the update is one compiled pass (runtime.kernels.adamw_step: the gradient
        read in its own dtype, the weights written with the master): AdamW in the fused kernel
        set. Otherwise torch's optimizer after a cast to fp32 and before a copy back."""
        return self == Optimizer.adam and kernels == Kernels.fused


class TrainingSpec(Frozen):
    global_batch: Tokens = 720
    """Sequences per optimizer step."""
    seq_len: Tokens = 8192
    """Tokens per sequence."""
    precision: Precision = Precision.bf16
    """Compute precision of GEMMs (bf16, or fp8 with bf16 elsewhere)."""
    optimizer: Optimizer = Optimizer.adam
    routing_skew: float = Field(1.0, ge=1, le=MAX_EXPERTS)
    """Expert load imbalance of the trained router beyond sampling: max / mean routed tokens
    per expert in one micro-batch's expert-parallel group, as the runtime logs it
    (``routing_skew`` of a step). 1: a balanced router, whose loads still differ by sampling
    (cost_models.skew prices that floor). The busiest EP rank paces the grouped GEMMs and
    receives the most dispatched rows."""

    @model_validator(mode="after")
    def _check(self) -> TrainingSpec:
        if self.precision == Precision.fp32:
            raise ValueError("precision must be bf16 or fp8 (mixed precision); got fp32")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len
