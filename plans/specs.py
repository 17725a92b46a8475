"""Model, cluster and training specifications: the inputs every plan is made for.

Units are in field names: ``_tflops`` (10^12 FLOP/s), ``_gb_s`` (10^9 bytes/s), ``_tb_s``
(10^12 bytes/s), ``_gib`` (2^30 bytes), ``_us`` (microseconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from functools import cache, cached_property, lru_cache
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from plans.enums import (
    Dispatch,
    Fp8Recipe,
    Kernels,
    LinearBias,
    Precision,
    RouterScore,
    WindowKind,
)

_HASH = "_hash"
"""Where a Frozen instance keeps its hash, in its __dict__ beside the fields (pydantic's equality
and serialisation read the fields only)."""


class Frozen(BaseModel):
    """Base of every contract type: immutable, unknown fields rejected, docstrings as docs.

    Hashed as pydantic hashes a frozen model (its fields' values), once per instance: the cost
    models' caches are keyed on specs and plans, and rehashing a cluster's nested specs on every
    lookup was a tenth of a search (bench/results/search_speed.json). A copy with new values
    (model_copy's update) and a pickled instance (another process hashes strings otherwise) drop
    the kept hash."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True,
        ignored_types=(cached_property,), allow_inf_nan=False,
    )

    def __hash__(self) -> int:
        kept = self.__dict__.get(_HASH)
        if kept is None:
            kept = hash(tuple(self.__dict__[f] for f in type(self).__pydantic_fields__))
            self.__dict__[_HASH] = kept
        return kept

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False):
        copied = super().model_copy(update=update, deep=deep)
        if update:
            copied.__dict__.pop(_HASH, None)
        return copied

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k != _HASH}
        return state


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
OptionalTokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]


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


CAUSAL_FRACTION = 0.5
"""Share of the score matrix a causal mask leaves to compute."""


def attended_fraction(seq_len: int, window: int, kind: WindowKind = WindowKind.sliding
                      ) -> float:
    """Share of the s x s score matrix one causal layer computes: 1/2 over the whole sequence
    (``window`` 0 or at least ``seq_len``); a sliding window of w keys leaves w/s (1 - w/2s);
    chunks of w tokens, each causal inside itself, leave w / 2s."""
    if not window or window >= seq_len:
        return CAUSAL_FRACTION
    w = window / seq_len
    return w * (1 - w / 2) if kind == WindowKind.sliding else w / 2


@cache
def moe_pattern(layers: int, dense_layers: int, moe_layer_interval: int) -> tuple[bool, ...]:
    """Whether each layer's FFN is MoE: after the first ``dense_layers``, the last layer of
    every ``moe_layer_interval`` (Llama-4's ``interleave_moe_layer_step``)."""
    return tuple(i >= dense_layers and (i - dense_layers) % moe_layer_interval
                 == moe_layer_interval - 1 for i in range(layers))


class MLASpec(Frozen):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 Sec. 2.1): queries and
    keys/values projected down to low-rank latents (each RMS-normed) and up to every head;
    each query and key head is a no-RoPE part and a RoPE part, whose key is one head shared by
    every head, projected from the hidden state with the kv latent."""

    q_lora_rank: OptionalWidth = 0
    """Width of the query latent (0: queries projected from the hidden state directly, as in
    DeepSeek-V2-Lite)."""
    kv_lora_rank: Width
    """Width of the key/value latent."""
    qk_nope_head_dim: Width
    """Width of the part of each query and key head without RoPE."""
    qk_rope_head_dim: Width
    """Width of the RoPE part of each query and key head."""
    v_head_dim: Width
    """Width of each value head."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class YaRNSpec(Frozen):
    """YaRN RoPE scaling (arXiv 2309.00071; Hugging Face's ``rope_scaling`` with type
    ``yarn``): the rotary frequencies whose wavelength fits more than ``beta_fast`` turns in
    the original context are kept, those fitting fewer than ``beta_slow`` are divided by
    ``factor``, a linear ramp between; cos and sin are scaled by ``attention_factor``. The
    angles change, the shapes do not; how a target runs it can (cost_models.megatron
    ``rope_unfused``)."""

    rope_type: Literal["yarn"]
    """The scaling's kind (Hugging Face's ``rope_type``), written out: YaRN is the one
    modelled."""
    factor: float = Field(gt=1, le=1e6)
    """Context extension s: the longest wavelengths are stretched s-fold (GPT-OSS: 32,
    DeepSeek-V3: 40; Megatron-Core's ``yarn_rotary_scaling_factor`` /
    ``rotary_scaling_factor``)."""
    original_max_position_embeddings: Tokens
    """Context length (tokens) the frequencies' boundaries are measured in (4,096 for
    GPT-OSS and DeepSeek-V3)."""
    beta_fast: float = Field(32.0, gt=0, le=1e6)
    """Turns in the original context above which a frequency is kept as is (32)."""
    beta_slow: float = Field(1.0, gt=0, le=1e6)
    """Turns in the original context below which a frequency is fully interpolated (1)."""
    truncate: bool = True
    """Whether the ramp's boundaries are rounded to whole dimensions (Hugging Face's
    ``truncate``; Megatron-Core's ``yarn_correction_range_round_to_int``; GPT-OSS: false)."""
    mscale: float | None = Field(None, gt=0, le=1e6)
    """DeepSeek's ``mscale`` (with ``mscale_all_dim``): the attention factor is
    m(s, mscale) / m(s, mscale_all_dim), m(s, c) = 0.1 c ln s + 1; None (GPT-OSS): m(s, 1)."""
    mscale_all_dim: float | None = Field(None, ge=0, le=1e6)
    """DeepSeek's ``mscale_all_dim``; with MLA the softmax scale is also multiplied by
    m(s, mscale_all_dim)^2."""

    @model_validator(mode="after")
    def _check(self) -> YaRNSpec:
        if self.beta_slow > self.beta_fast:
            raise ValueError(f"beta_slow ({self.beta_slow:g}) must be <= beta_fast "
                             f"({self.beta_fast:g})")
        if (self.mscale is None) != (self.mscale_all_dim is None):
            raise ValueError("mscale and mscale_all_dim must be given together")
        return self

    @property
    def attention_factor(self) -> float:
        """The factor on cos and sin (Megatron-Core's concentration factor,
        yarn_rotary_pos_embedding.py ``_yarn_get_concentration_factor``; Hugging Face's
        ``attention_factor``): 0.1 ln(factor) + 1 without mscale, 1.35 for GPT-OSS's 32."""
        def m(c: float) -> float:
            return 0.1 * c * math.log(self.factor) + 1.0
        if self.mscale is None or self.mscale_all_dim is None:
            return m(1.0)
        return m(self.mscale) / m(self.mscale_all_dim)


class ModelSpec(Frozen):
    """A decoder-only MoE transformer: GQA or MLA attention, SwiGLU routed and shared experts,
    dense-FFN layers first or interleaved, optional sliding-window layers and multi-token
    prediction."""

    name: Name
    """Name shown in reports."""
    layers: Layers
    """Transformer layers, MoE and dense together (MTP modules not included)."""
    hidden: Width
    """Model (residual stream) width h."""
    query_heads: Heads
    """Attention query heads."""
    kv_heads: Heads
    """Attention key/value heads (GQA); query_heads / kv_heads is the paper's m. With MLA every
    head has its own key and value: kv_heads = query_heads."""
    head_dim: Width
    """Width of one query and key head (query_heads * head_dim need not equal hidden); with
    MLA, qk_nope_head_dim + qk_rope_head_dim."""
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
    shared_expert_gate: bool = False
    """The shared experts' output is scaled by a sigmoid of one learned projection of the token
    (Qwen2-MoE's ``shared_expert_gate``)."""
    dense_layers: OptionalLayers = 0
    """Leading layers whose FFN is a dense SwiGLU instead of MoE."""
    moe_layer_interval: Layers = 1
    """After the dense_layers, the last layer of every moe_layer_interval layers is MoE and
    the others dense (Llama-4 Maverick: 2); 1: every one is MoE."""
    dense_ffn_hidden: OptionalWidth = 0
    """Inner width of the dense layers' FFN (0 when there are none)."""
    tied_embeddings: bool = False
    """Whether the LM head shares the token-embedding matrix."""
    mla: MLASpec | None = None
    """Multi-head latent attention's shapes; absent: GQA (query_heads, kv_heads, head_dim)."""
    kv_share_layers: Layers = 1
    """Cross-layer attention (Hunyuan-Large's CLA: 2): each run of this many consecutive layers
    attends over the keys and values of its first layer; the others have no K and V
    projections. 1: every layer its own."""
    linear_bias: LinearBias = LinearBias.none
    """Which linear layers carry a bias."""
    attention_sinks: bool = False
    """A learned logit per head joins every softmax over the keys (GPT-OSS)."""
    sliding_window: OptionalTokens = 0
    """Keys a windowed layer's query attends to (window_kind); 0: every layer attends over the
    whole causal prefix."""
    window_kind: WindowKind = WindowKind.sliding
    """How the windowed layers limit their keys."""
    full_attention_every: OptionalLayers = 0
    """With a sliding_window: every layer whose number (from 1) this divides attends over the
    whole prefix, the others over the window (GPT-OSS: 2, Megatron's --window-attn-skip-freq);
    0: every layer is windowed."""
    rope_theta: float = Field(10000.0, gt=0, le=1e12)
    """RoPE base (theta) of the rotary position embedding."""
    rotary_fraction: float = Field(1.0, gt=0, le=1)
    """Share of each query and key head RoPE rotates (GLM-4.5: 0.5; Megatron's
    --rotary-percent); the rest passes unrotated."""
    rope_scaling: YaRNSpec | None = None
    """RoPE's frequency scaling (Hugging Face's ``rope_scaling``) where it changes how a target
    runs the model: YaRN (GPT-OSS, DeepSeek-V2/V3, Kimi-K2); None: plain RoPE at
    rope_theta."""
    swiglu_limit: float = Field(0.0, ge=0, le=1e6)
    """GPT-OSS's clamped SwiGLU (Hugging Face's ``swiglu_limit``): each routed expert's gate
    input is clamped above at this limit and its linear input to [-limit, limit], the gate
    taken as x sigmoid(1.702 x) and the linear input offset by 1 (Megatron-Core's quick-GEGLU
    with ``glu_linear_offset`` 1 and ``activation_func_clamp_value``); 0: the plain SwiGLU.
    Modelled for models whose every FFN is routed (no shared experts, no dense layers)."""
    norm_eps: float = Field(1e-6, gt=0, lt=1)
    """Epsilon of every RMSNorm."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (head_dim wide) before RoPE (Qwen3, Hunyuan-Large)."""
    router_score: RouterScore = RouterScore.softmax
    """How the router turns its logits into expert scores."""
    router_pre_softmax: bool = False
    """Routing weights are the softmax over all experts taken at the top-k (DeepSeekMoE,
    top-1 routers); false: the kept top-k weights are renormalised to sum to one (Mixtral)."""
    router_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 Sec. 2.1.2): a per-expert
    bias, updated from the experts' loads outside the gradient, is added to the scores for the
    top-k choice only."""
    expert_bias_update_rate: float = Field(1e-3, ge=0, le=1)
    """With router_expert_bias, the bias's step after every training step (DeepSeek-V3's
    gamma, 0.001; Megatron-Core's --moe-router-bias-update-rate): an expert that took fewer
    routed slots than the mean over the step's tokens (every micro-batch, every rank) gains it,
    one that took more loses it (runtime.router.updated_expert_bias); 0 keeps the bias at
    zero. Unused without router_expert_bias."""
    routed_scaling_factor: float = Field(1.0, gt=0, le=1000)
    """The routed experts' summed output is multiplied by this (DeepSeek-V3: 2.5)."""
    expert_groups: Experts = 1
    """Group-limited routing: the experts form this many equal groups (DeepSeek-V3: 8, one per
    node of its EP64); 1: no groups."""
    groups_per_token: Experts = 1
    """Groups a token's top_k experts are chosen from (DeepSeek-V3: 4); equal to
    expert_groups: no limit."""
    aux_loss_coeff: float = Field(0.01, ge=0, le=1)
    """Weight of the load-balancing loss (0 disables it)."""
    mtp_layers: OptionalLayers = 0
    """Multi-token prediction depth (DeepSeek-V3 Sec. 2.2): modules after the last layer, each
    an RMSNorm of its input and of the next token's embedding, a projection of the two (2h to
    h), one transformer layer of the last layer's kind and the shared LM head with its own
    final norm; the embedding and the head are the model's."""
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
        if self.layers - self.dense_layers < self.moe_layer_interval:
            raise ValueError(
                f"moe_layer_interval ({self.moe_layer_interval}) leaves no MoE layer in the "
                f"{self.layers - self.dense_layers} layers after dense_layers"
            )
        if (self.shared_experts > 0) != (self.shared_expert_ffn_hidden > 0):
            raise ValueError(
                f"shared_experts ({self.shared_experts}) and shared_expert_ffn_hidden "
                f"({self.shared_expert_ffn_hidden}) must both be zero or both positive"
            )
        if self.shared_expert_gate and not self.shared_experts:
            raise ValueError("shared_expert_gate: the model has no shared experts")
        dense = self.dense_ffn_layers
        if (dense > 0) != (self.dense_ffn_hidden > 0):
            raise ValueError(
                f"dense_ffn_hidden ({self.dense_ffn_hidden}) must be positive exactly when some "
                f"layer is dense ({dense} are: dense_layers {self.dense_layers}, "
                f"moe_layer_interval {self.moe_layer_interval})"
            )
        if self.mla is not None:
            if self.kv_heads != self.query_heads:
                raise ValueError(f"kv_heads ({self.kv_heads}) must equal query_heads "
                                 f"({self.query_heads}) with mla (every head has its own key)")
            if self.head_dim != self.mla.qk_head_dim:
                raise ValueError(f"head_dim ({self.head_dim}) must equal mla.qk_nope_head_dim "
                                 f"+ mla.qk_rope_head_dim ({self.mla.qk_head_dim})")
            if self.linear_bias != LinearBias.none:
                raise ValueError(f"linear_bias ({self.linear_bias}) must be none with mla")
            if self.kv_share_layers != 1:
                raise ValueError(f"kv_share_layers ({self.kv_share_layers}) must be 1 with mla")
        if self.experts % self.expert_groups:
            raise ValueError(f"expert_groups ({self.expert_groups}) must divide experts "
                             f"({self.experts})")
        if self.groups_per_token > self.expert_groups:
            raise ValueError(f"groups_per_token ({self.groups_per_token}) must be <= "
                             f"expert_groups ({self.expert_groups})")
        if self.top_k > self.groups_per_token * self.experts_per_group:
            raise ValueError(
                f"top_k ({self.top_k}) must be <= groups_per_token x experts per group "
                f"({self.groups_per_token} x {self.experts_per_group})")
        if self.router_score == RouterScore.sigmoid and self.router_pre_softmax:
            raise ValueError("router_pre_softmax must be false with router_score sigmoid "
                             "(the kept sigmoid scores are renormalised)")
        if self.full_attention_every and not self.sliding_window:
            raise ValueError(f"full_attention_every ({self.full_attention_every}) needs a "
                             f"sliding_window")
        if self.swiglu_limit and (self.shared_experts or self.dense_ffn_layers):
            raise ValueError("swiglu_limit is modelled for routed experts only: the model "
                             "must have no shared experts and no dense layers")
        if self.full_attention_every > self.layers:
            raise ValueError(f"full_attention_every ({self.full_attention_every}) must be <= "
                             f"layers ({self.layers})")
        return self

    # ---- derived shape ----------------------------------------------------------------------
    @property
    def gqa_ratio(self) -> int:
        """m = query heads per KV head (paper notation)."""
        return self.query_heads // self.kv_heads

    @property
    def moe_pattern(self) -> tuple[bool, ...]:
        """Whether each layer's FFN is MoE (plans.specs.moe_pattern)."""
        return moe_pattern(self.layers, self.dense_layers, self.moe_layer_interval)

    @property
    def moe_layers(self) -> int:
        return sum(self.moe_pattern)

    @property
    def dense_ffn_layers(self) -> int:
        """Layers whose FFN is dense: the leading dense_layers and the interleaved ones."""
        return self.layers - self.moe_layers

    @property
    def experts_per_group(self) -> int:
        return self.experts // self.expert_groups

    @property
    def mtp_layer_is_moe(self) -> bool:
        """An MTP module's transformer layer is of the model's last layer's kind."""
        return self.moe_pattern[-1]

    def layer_window(self, layer: int) -> int:
        """Keys layer ``layer`` (from 0) attends to: the sliding_window, or 0 for the whole
        prefix (Megatron-Core's is_layer_window_attention)."""
        if not self.sliding_window:
            return 0
        every = self.full_attention_every
        return 0 if every and (layer + 1) % every == 0 else self.sliding_window

    @property
    def q_dim(self) -> int:
        return self.query_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys of one token (and of its values under GQA)."""
        return self.kv_heads * self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of the values of one token: kv_dim under GQA, query_heads x v_head_dim with
        MLA; the attention output (the out projection's input) is query_heads x v_head_dim."""
        return self.kv_heads * self.v_head_dim

    @property
    def attn_out_dim(self) -> int:
        return self.query_heads * self.v_head_dim

    # ---- parameter counts (norm weights included) ---------------------------------------------
    @property
    def attention_gemm_params(self) -> int:
        """Weights of one layer's attention projections (GEMMs).

        GQA: Q, K, V and output. MLA: the query down- (h x q_lora_rank) and up-projection
        (q_lora_rank x heads x qk_head_dim; with q_lora_rank 0 one h x heads x qk_head_dim),
        the kv down-projection with the shared RoPE key (h x (kv_lora_rank + qk_rope_head_dim)),
        its up-projection (kv_lora_rank x heads x (qk_nope_head_dim + v_head_dim)) and the
        output (heads x v_head_dim x h)."""
        h, out = self.hidden, self.attn_out_dim * self.hidden
        if self.mla is None:
            return h * (self.q_dim + 2 * self.kv_dim) + out
        a = self.mla
        q = (h * a.q_lora_rank + a.q_lora_rank * self.q_dim) if a.q_lora_rank else h * self.q_dim
        kv_down = h * (a.kv_lora_rank + a.qk_rope_head_dim)
        kv_up = a.kv_lora_rank * self.query_heads * (a.qk_nope_head_dim + a.v_head_dim)
        return q + kv_down + kv_up + out

    @property
    def kv_projection_params(self) -> int:
        """The K and V projections (and their biases) of one layer under GQA, which a layer
        sharing another's keys and values lacks (kv_share_layers)."""
        bias = self.kv_dim + self.v_dim if self.linear_bias != LinearBias.none else 0
        return 0 if self.mla else self.hidden * (self.kv_dim + self.v_dim) + bias

    @property
    def kv_borrowing_layers(self) -> int:
        """Layers using an earlier layer's keys and values: all but the first of each run of
        kv_share_layers."""
        return self.layers - -(-self.layers // self.kv_share_layers)

    @property
    def attention_params(self) -> int:
        """One layer's attention: its projections, MLA's latent norms, biases and sinks."""
        other = self.mla.q_lora_rank + self.mla.kv_lora_rank if self.mla else 0
        if self.linear_bias != LinearBias.none:
            other += self.q_dim + self.kv_dim + self.v_dim
        if self.linear_bias == LinearBias.all:
            other += self.hidden
        if self.attention_sinks:
            other += self.query_heads
        return self.attention_gemm_params + other

    @property
    def expert_params(self) -> int:
        """One routed SwiGLU expert: fc1, gate (fc3) and fc2 (and their biases)."""
        bias = 2 * self.expert_ffn_hidden + self.hidden if self.linear_bias == LinearBias.all \
            else 0
        return 3 * self.hidden * self.expert_ffn_hidden + bias

    @property
    def shared_expert_params(self) -> int:
        """All shared experts of one MoE layer (and their gate)."""
        gate = self.hidden if self.shared_expert_gate else 0
        return self.shared_experts * 3 * self.hidden * self.shared_expert_ffn_hidden + gate

    @property
    def router_params(self) -> int:
        bias = self.experts if self.linear_bias == LinearBias.all else 0
        return self.hidden * self.experts + bias

    @property
    def dense_ffn_params(self) -> int:
        bias = 2 * self.dense_ffn_hidden + self.hidden if self.linear_bias == LinearBias.all \
            else 0
        return 3 * self.hidden * self.dense_ffn_hidden + bias

    @property
    def embedding_params(self) -> int:
        """Token embedding plus, when untied, the LM head."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def mtp_extra_params(self) -> int:
        """One MTP module beside its transformer layer: its three RMSNorms and the 2h x h
        projection."""
        return 3 * self.hidden + 2 * self.hidden * self.hidden

    def layer_params(self, moe: bool, routed_experts: int) -> int:
        """One transformer layer's parameters, an MoE one counting ``routed_experts``."""
        ffn = (routed_experts * self.expert_params + self.shared_expert_params
               + self.router_params) if moe else self.dense_ffn_params
        return self.attention_params + 2 * self.hidden + ffn

    def _params(self, routed_experts: int) -> int:
        layers = sum(self.layer_params(moe, routed_experts) for moe in (True, False)
                     for _ in range(self.moe_layers if moe else self.dense_ffn_layers))
        mtp = self.mtp_layers * (self.layer_params(self.mtp_layer_is_moe, routed_experts)
                                 + self.mtp_extra_params)
        borrowed = self.kv_borrowing_layers * self.kv_projection_params
        return layers - borrowed + mtp + self.embedding_params + self.hidden

    @property
    def total_params(self) -> int:
        """Every trained parameter, MTP modules included (they share the embedding and head)."""
        return self._params(self.experts)

    @property
    def active_params(self) -> int:
        """Parameters one token touches: top_k routed experts per MoE layer, the embedding row
        and the LM head, the MTP modules included."""
        return self._params(self.top_k)

    @property
    def matmul_params_per_token(self) -> int:
        """Weights used in matrix multiplies by one token: the projections, the top_k routed and
        the shared experts, the routers, the dense FFNs, the LM head (an untied one), and per
        MTP module its projection, its layer's and the head once more."""

        def layer(moe: bool) -> int:
            ffn = (self.top_k * 3 * self.hidden * self.expert_ffn_hidden
                   + self.shared_experts * 3 * self.hidden * self.shared_expert_ffn_hidden
                   + self.hidden * self.experts
                   + (self.hidden if self.shared_expert_gate else 0)) if moe \
                else 3 * self.hidden * self.dense_ffn_hidden
            return self.attention_gemm_params + ffn

        head = self.embedding_params - self.vocab * self.hidden
        mtp = layer(self.mtp_layer_is_moe) + 2 * self.hidden * self.hidden + head
        borrowed = self.kv_borrowing_layers * self.hidden * (self.kv_dim + self.v_dim)
        return (self.moe_layers * layer(True) + self.dense_ffn_layers * layer(False) + head
                + self.mtp_layers * mtp - (0 if self.mla else borrowed))

    @property
    def kv_projection_share(self) -> float:
        """Share of the layers that project their own keys and values (kv_share_layers)."""
        return 1 - self.kv_borrowing_layers / self.layers

    def attended_share(self, seq_len: int) -> float:
        """The layers' attended fractions of the s x s score matrix, summed
        (attended_fraction of each layer's window)."""
        return sum(attended_fraction(seq_len, self.layer_window(i), self.window_kind)
                   for i in range(self.layers))

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of every layer's attention core per token: QK^T at head_dim and PV at
        v_head_dim, 2 x s x heads x width each, times the layer's attended fraction
        (attended_fraction: 1/2 causal, less over a window); MTP layers attend causally."""
        per_key = 2 * seq_len * self.query_heads * (self.head_dim + self.v_head_dim)
        return per_key * (self.attended_share(seq_len) + self.mtp_layers * CAUSAL_FRACTION)

    def flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token as the paper's MFU counts them: GEMMs and FlashAttention only.

        Forward = 2 x matmul weights (router and LM head included) + causal attention
        (attention_flops_per_token). Training = 3 x forward (backward is twice the forward);
        recomputation is not counted.
        """
        gemm = 2 * self.matmul_params_per_token
        return (3 if training else 1) * (gemm + self.attention_flops_per_token(seq_len))


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
        # DeepEP's dispatch also waits on the host for its receive counts: the all-to-all's
        # floor, a prior (no moeplan runtime runs it eagerly; plans.execution)
        if dispatch == Dispatch.deepep:
            return self.all_to_all
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
    grouped_gemm_stream_tb_s: Rate | None = None
    """The rate (TB/s) at which a grouped GEMM grouped over its rows (forward, data gradient)
    feeds its tiles where their operands bound it: each block of a group's rows streams the
    group's weights (cost_models.compute._gemm_s). A property of the die and its kernel, not
    of the HBM beside it (H100, H800 and H200 carry one value). Fitted by `moeplan calibrate`
    with the other grouped factors. None (the uncalibrated default): the kernel's row blocks
    are not known either, so its rows are priced in 128-row tiles, each group's weights read
    once, at ``hbm``."""
    attention: Fraction = 0.60
    """FlashAttention throughput / peak."""
    attention_wide_bwd: Fraction = 1.0
    """The attention backward's rate for query / key heads wider than
    cost_models.compute.WIDE_HEAD_DIM (MLA's 192), as a share of ``attention``'s; the
    forward keeps ``attention``. 1: no difference (the uncalibrated default)."""
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
    gather_scatter: Fraction = 0.304
    """Achieved HBM bandwidth / peak of the eager runtime's token permutation (row gathers,
    scatters and index-adds, counted pass by pass in cost_models.dispatch): used for plans with
    ``kernels: eager``. Default: h200-runtime's, which `moeplan calibrate --dispatch` fitted to
    moeplan's dispatchers on 2 H200s (bench/results/h200/moe_layer/dispatch_sweep_x2.json,
    planner.dispatch_fit)."""
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
    published = "published"
    """Fitted to a system's published measurements (the note names them)."""


KERNEL_FACTORS = ("gemm", "grouped_gemm", "attention", "fused_elementwise")
"""The Efficiency factors that rate a GPU's compute kernels (GEMMs, grouped GEMMs,
FlashAttention, fused memory-bound regions): what a catalog cluster's ``kernel_scale``
multiplies (plans.catalog)."""


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


FP32_STATE = 4
"""Bytes of an fp32 master weight."""


class Optimizer(StrEnum):
    adam = "adam"
    sgd = "sgd"

    @property
    def state_bytes_per_param(self) -> int:
        """fp32 master weights + fp32 optimizer moments (Adam: m and v)."""
        return self.state_bytes(Precision.fp32)

    def state_bytes(self, moments: Precision) -> int:
        """Bytes per parameter of the fp32 master weight and the moments (Adam's m and v,
        none for plain SGD) in ``moments``: 12 for Adam in fp32, 8 with bf16 moments
        (Megatron-Core's precision-aware optimizer)."""
        return FP32_STATE + {"adam": 2, "sgd": 0}[self.value] * moments.bytes

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
    fp8_recipe: Fp8Recipe = Fp8Recipe.tensorwise
    """How fp8 GEMM operands are scaled; a recipe other than the default needs precision fp8."""
    optimizer: Optimizer = Optimizer.adam
    routing_skew: float = Field(1.0, ge=1, le=MAX_EXPERTS)
    """Expert load imbalance of the trained router beyond sampling: max / mean routed tokens
    per expert in one micro-batch's expert-parallel group, as the runtime logs it
    (``routing_skew`` of a step). 1: a balanced router, whose loads still differ by sampling
    (cost_models.skew prices that floor). The busiest EP rank paces the grouped GEMMs and
    receives the most dispatched rows."""
    memory_cap_gib: float | None = Field(None, gt=0)
    """The most memory per GPU the job may take, in GiB (2^30 bytes), below what the GPU
    offers (cluster.gpu.hbm_gib x efficiency.memory_usable): as a user holds a job to the
    memory another trainer used, or leaves room for other work. A plan fits where its
    predicted peak is at most the smaller of the two (cost_models.memory.
    memory_capacity_bytes); None: the GPU's usable memory."""

    @model_validator(mode="after")
    def _check(self) -> TrainingSpec:
        if self.precision == Precision.fp32:
            raise ValueError("precision must be bf16 or fp8 (mixed precision); got fp32")
        if self.fp8_recipe != Fp8Recipe.tensorwise and self.precision != Precision.fp8:
            raise ValueError(f"fp8_recipe {self.fp8_recipe.value} needs precision fp8; got "
                             f"{self.precision.value}")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def mfu(model: ModelSpec, seq_len: int, tokens: float, seconds: float, gpus: int,
        gpu: GPUSpec) -> float:
    """Model FLOPs utilization: ``tokens`` of ``seq_len``-token sequences trained in ``seconds``
    (ModelSpec.flops_per_token) over ``gpus`` GPUs' peak dense bf16 throughput, what the
    predictions, the runtime's steps and the paper's MFU all report."""
    return _flops_per_token(model, seq_len) * tokens / (gpus * gpu.bf16_dense_tflops * 1e12
                                                        * seconds)


@lru_cache(maxsize=1024)
def _flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """ModelSpec.flops_per_token of a training step, once per model and length (a search
    prices thousands of plans of one model)."""
    return model.flops_per_token(seq_len)
