"""The plan's enumerations, importable without pydantic (the CLI declares its options with
them before any model is loaded)."""

from __future__ import annotations

from enum import StrEnum


class Precision(StrEnum):
    """A number format, from the widest to the narrowest (the search's order of memory)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"

    @property
    def bytes(self) -> int:
        return {"fp32": 4, "bf16": 2, "fp8": 1}[self.value]


class Fp8Recipe(StrEnum):
    """How fp8 GEMM operands are scaled (TransformerEngine's recipes, Megatron's
    ``--fp8-recipe``); read only under precision fp8."""

    tensorwise = "tensorwise"
    """Per-tensor current scaling (TE's Float8CurrentScaling): each operand's amax is taken
    before its cast, a pass of its own over the bf16 tensor."""
    mxfp8 = "mxfp8"
    """MXFP8 (Blackwell): a scale per 32 elements, computed in the cast's own pass."""


class Overlap(StrEnum):
    """Communication-computation overlap inside a layer (paper Sec. 4), from the weakest to
    the strongest."""

    none = "none"
    inter_op = "inter_op"
    """Independent operators' communication hidden behind compute (hand-scheduled layer)."""
    inter_intra_op = "inter_intra_op"
    """Plus tile-level fused communication inside GEMMs (copy engines)."""


class Dispatch(StrEnum):
    """How tokens reach their experts across the EP group (paper Sec. 3.2)."""

    all_to_all = "all_to_all"
    """All-to-all(v) of routed tokens there and back."""
    allgather_reduce_scatter = "allgather_reduce_scatter"
    """All-gather + local scatter to dispatch; local gather + reduce-scatter to combine."""
    deepep = "deepep"
    """DeepEP's hierarchical all-to-all (Megatron-Core's ``flex`` dispatcher): each token
    crosses the network once per destination node, to the GPU of its own local index there,
    which forwards it over NVLink to that node's destination GPUs; a GPU receives each token
    once, whatever number of its experts it goes to. The combine mirrors it
    (cost_models.volumes.ep_link_shares prices the links)."""

    @property
    def moves_routed_copies(self) -> bool:
        """Whether the dispatch sends tokens to the ranks of their routed experts (all-to-all
        and DeepEP's) rather than all-gathering every rank's tokens."""
        return self != Dispatch.allgather_reduce_scatter


class Recompute(StrEnum):
    """Which layer operators are rerun in backward instead of keeping their activations: the
    set ``plans.operators.RECOMPUTED`` gives, which the runtime wraps in checkpointing and the
    cost model prices (cost_models.memory, layer_graph); from the fewest operators rerun to
    the most."""

    none = "none"
    selective = "selective"
    """Recompute the plan's modules (Plan.recompute_modules; by default the attention core,
    RoPE and SDPA), keeping their inputs."""
    full = "full"
    """Keep only each layer's input; recompute the whole layer in backward."""


class RecomputeModule(StrEnum):
    """A module selective recomputation reruns: Megatron-Core's ``--recompute-modules``
    (megatron/core/transformer/transformer_config.py, ``recompute_modules``); the operators
    each reruns are ``plans.operators.MODULE_OPERATORS``."""

    core_attn = "core_attn"
    """The attention core (RoPE and SDPA); Megatron's default module."""
    layernorm = "layernorm"
    """The input and pre-MLP norms."""
    moe_act = "moe_act"
    """The routed experts' activation (SwiGLU)."""
    mla_up_proj = "mla_up_proj"
    """MLA's up-projections of the q and kv latents."""
    mlp = "mlp"
    """A dense layer's MLP."""
    moe = "moe"
    """The whole MoE block: router, dispatch, experts, combine."""
    shared_experts = "shared_experts"
    """The shared experts."""


class PipelineSchedule(StrEnum):
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"


class AttentionKind(StrEnum):
    """The kinds of attention strategy (the tags of plans.plan.AttentionStrategy)."""

    ulysses_sp = "ulysses_sp"
    tp = "tp"
    cp = "cp"


class CrossEntropy(StrEnum):
    """How the last stage computes the LM head and the loss."""

    chunked = "chunked"
    """LM head and cross-entropy over chunks of tokens, gradients computed in the forward: at
    most a chunk of logits exists at once (runtime.loss)."""
    materialized = "materialized"
    """The whole micro-batch's logits, their fp32 copy and log-probabilities (12 bytes per
    logit at the backward peak)."""


CHUNK_LOGITS = 2**28
"""Logits per chunk of the chunked cross-entropy (runtime.loss; priced by cost_models.memory
and cost_models.pipeline.cross_entropy_s): a chunk holds them at its peak in about 10 bytes
each under eager kernels (2.5 GiB: the parameter dtype and fp32), 4 under fused ones (1 GiB),
and each chunk after the first adds the head's weight gradient into an fp32 sum (eager, a
pass over vocab x hidden: 20.6 ms of 18 adds beside 73 ms of GEMMs at Qwen3-30B-A3B's head on
H200; fused, inside the GEMMs: 5.3 ms); under gradient-accumulation fusion every chunk's GEMM
adds it into the head's main gradient instead (plans.layout.accumulates_head_in_gemm)."""


class Kernels(StrEnum):
    """How the layers' memory-bound operators run (RMSNorm, RoPE, SwiGLU, the router's softmax,
    top-k and renormalisation, the token permutation and its weighted un-permutation), and
    the chunked loss's (its softmax and gradient, its weight gradient's sum over chunks)."""

    eager = "eager"
    """One PyTorch kernel per operation (several passes over the activations each): the token
    permutation's row gathers, scatters and index-adds priced pass by pass
    (cost_models.dispatch) at ``efficiency.gather_scatter``, and an EP dispatch that waits on
    the host never faster than ``efficiency.dispatch_floor_us``."""
    fused = "fused"
    """Each operator one torch.compile region (runtime.kernels): its fused bytes, one read of
    its inputs and one write of its outputs; except the router's softmax and top-k, which stay
    eager (their compiled region measured slower on H200), and the token permutation with every
    slot routed, which runs as gathers both ways and a per-token weighted sum, never an atomic
    index-add (cost_models.dispatch.fused_every_slot). The chunked loss: one region per chunk
    from its logits to their gradient, and on CUDA the head's weight gradient summed in fp32
    by its GEMMs (cost_models.pipeline.cross_entropy_s); the materialized loss stays eager."""


class OptimizerSharding(StrEnum):
    """Where the optimizer states (fp32 master weights and moments) live."""

    none = "none"
    """Every replica of a parameter keeps its full states and updates it in full."""
    zero1 = "zero1"
    """ZeRO stage 1 (Rajbhandari et al., SC'20): the states are sharded over each parameter's
    replicas; gradients are reduce-scattered, each replica updates its slice and the updated
    weights are all-gathered."""


class CudaGraphs(StrEnum):
    """Which parts of each layer Megatron-Core captures as CUDA graphs (TransformerEngine's
    graphs, ``--cuda-graph-impl transformer_engine --cuda-graph-scope ...``): a graphed part
    is replayed by one launch, forward and backward, instead of launching its kernels one by
    one from the host (cost_models.megatron prices the host's launches)."""

    none = "none"
    moe_router = "moe_router"
    """The MoE router and the dispatcher's preprocessing (scopes moe_router, moe_preprocess)."""
    attn_moe_router = "attn_moe_router"
    """Those and the attention block (scopes attn, moe_router, moe_preprocess)."""
    layer = "layer"
    """Each whole TransformerLayer, its MoE block included (``--cuda-graph-impl local``, its
    default layerwise scope; Megatron-Bridge's ``enable_cuda_graph``): a graph needs static
    shapes, so a MoE layer must be capacity-bound (``ffn.capacity_factor``)."""


class Target(StrEnum):
    """Which runtime executes a plan: what it runs and how it is priced
    (plans.execution: one capability column per target)."""

    moeplan = "moeplan"
    """moeplan's own runtime (runtime/, `moeplan train`, `export --to torchrun|slurm`)."""
    megatron = "megatron"
    """Megatron-Core through Megatron-LM's pretrain_gpt.py (`export --to megatron`)."""


class RouterScore(StrEnum):
    """The function turning a token's router logits into expert scores."""

    softmax = "softmax"
    """Softmax over the experts (Mixtral, Qwen, DeepSeek-V2)."""
    sigmoid = "sigmoid"
    """An independent sigmoid per expert; the kept top-k scores are renormalised to sum to
    one (DeepSeek-V3, Kimi-K2, GLM-4.5)."""


class LinearBias(StrEnum):
    """Which linear layers carry a bias vector."""

    none = "none"
    qkv = "qkv"
    """The query, key and value projections (Qwen2-MoE, GLM-4.5)."""
    all = "all"
    """Every linear layer: attention in and out, router, experts and dense FFNs (GPT-OSS)."""


class WindowKind(StrEnum):
    """How a windowed attention layer limits the keys a query sees."""

    sliding = "sliding"
    """The ``sliding_window`` keys before it, itself included (GPT-OSS, Mistral)."""
    chunked = "chunked"
    """The keys of its own ``sliding_window``-token chunk up to itself (Llama-4's chunked
    local attention)."""
class ExpertGemm(StrEnum):
    """How a rank's routed experts run their three GEMMs (runtime.moe.GroupedExperts); the
    weights, their layout and their gradients are the same in each."""

    grouped = "grouped"
    """Three grouped GEMMs (torch._grouped_mm) over the rows per expert on the device: no
    wait on the host."""
    per_expert = "per_expert"
    """One cuBLAS matmul per expert, each product written into its slice of one output (no
    split and no concatenation), the weight gradients likewise: the rows per expert are read
    on the host, copied behind an event when the experts' forward starts and waited for
    there (the dispatch's kernels finished, the experts' not yet queued)."""
