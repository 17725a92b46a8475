"""A plan's rank layout, defined once: the cost model, the runtime and the benchmarks use it.

Ranks are numbered row-major over one of three views of the same world (Megatron-LM /
MegaScale-MoE order, innermost last; paper Sec. 3):

    attention view  (pp, dp, attn)          attn = cp x sp x tp (one of them is the degree)
    FFN view        (pp, edp, ep, etp)      "MoE parallel folding": the same ranks of a stage
    stage view      (pp, stage)             stage = dp x attn, every rank of a pipeline stage

so rank = (pp_i x dp + dp_i) x attn + attn_i = (pp_i x edp + edp_i) x ep x etp + ep_i x etp
+ etp_i. A group along an axis is the ranks that differ only in that coordinate; its stride is
the product of the sizes inside it, and groups of inner axes within a node stay on NVLink. The
two copies of tied embeddings (first and last stage) form the ``embed`` groups. Model chunk c
of pp x vpp runs on stage c mod pp.
"""

from __future__ import annotations

from plans.enums import CHUNK_LOGITS, CrossEntropy, ExpertGemm
from plans.plan import (
    EPFFN,
    AttentionStrategy,
    Degrees,
    FFNStrategy,
    MeshAxis,
    Overlap,
    UlyssesAttention,
)
from plans.specs import ModelSpec

A = MeshAxis
VIEWS: tuple[tuple[MeshAxis, ...], ...] = (
    (A.pp, A.dp, A.attn),
    (A.pp, A.edp, A.ep, A.etp),
    (A.pp, A.stage),
)
"""The views of the world, outermost axis first; every axis but ``embed`` is in one."""


def axis_sizes(d: Degrees) -> dict[MeshAxis, int]:
    return {A.pp: d.pp, A.dp: d.dp, A.attn: d.attention_group, A.stage: d.dp * d.attention_group,
            A.edp: d.edp, A.ep: d.ep, A.etp: d.etp, A.embed: min(d.pp, 2)}


def view_of(axis: MeshAxis) -> tuple[MeshAxis, ...]:
    """The view an axis belongs to (pp: the attention view; all views agree on it)."""
    for view in VIEWS:
        if axis in view:
            return view
    raise ValueError(f"{axis} is not an axis of a mesh view")


def view_shape(d: Degrees, view: tuple[MeshAxis, ...]) -> tuple[int, ...]:
    sizes = axis_sizes(d)
    return tuple(sizes[a] for a in view)


def stride(d: Degrees, axis: MeshAxis) -> int:
    """Rank distance between neighbours of a group along ``axis``: the product of the sizes of
    the axes inside it in its view (the ``embed`` pair: first to last stage)."""
    if axis == A.embed:
        return (d.pp - 1) * stride(d, A.pp)
    view = view_of(axis)
    sizes = axis_sizes(d)
    out = 1
    for inner in view[view.index(axis) + 1:]:
        out *= sizes[inner]
    return out


def coordinate(rank: int, d: Degrees, axis: MeshAxis) -> int:
    """This rank's index along ``axis`` (``embed``: 0 on the first stage, 1 on the last)."""
    if axis == A.embed:
        return 0 if coordinate(rank, d, A.pp) == 0 else 1
    return rank // stride(d, axis) % axis_sizes(d)[axis]


def coordinates(rank: int, d: Degrees) -> dict[MeshAxis, int]:
    return {axis: coordinate(rank, d, axis) for axis in MeshAxis if axis != A.embed}


def groups(d: Degrees, axis: MeshAxis) -> list[list[int]]:
    """Every group along ``axis`` as rank lists, in a fixed order (every rank creates every
    group in the same order, as torch.distributed.new_group requires)."""
    if axis == A.embed:
        last = stride(d, A.embed)
        return [[i, last + i] if d.pp > 1 else [i] for i in range(stride(d, A.pp))]
    size, step = axis_sizes(d)[axis], stride(d, axis)
    return [[base + i * step for i in range(size)]
            for base in range(d.world) if coordinate(base, d, axis) == 0]


def group_of(rank: int, d: Degrees, axis: MeshAxis) -> list[int]:
    """The ranks of ``rank``'s group along ``axis``."""
    return next(g for g in groups(d, axis) if rank in g)


def stage_peer(rank: int, d: Degrees, offset: int) -> int:
    """The rank at the same position ``offset`` pipeline stages away."""
    return rank + offset * stride(d, A.pp)


def stage_of_chunk(chunk: int, pp: int) -> int:
    """Model chunk c (of pp x vpp) runs on pipeline stage c mod pp (interleaved 1F1B;
    Narayanan et al., SC'21)."""
    return chunk % pp


def chunks_of_stage(stage: int, d: Degrees) -> range:
    """The model chunks of ``stage``, in pipeline order."""
    return range(stage, d.stages, d.pp)


def tokens_per_rank(sequences: int, seq_len: int, attention_group: int) -> float:
    """Tokens of ``sequences`` sequences held by one rank outside attention: the sequence is
    sharded over the attention group (``Degrees.attention_group``: Ulysses sp, cp, or tp with
    sequence parallelism in the norm regions)."""
    return sequences * seq_len / attention_group


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the chunked cross-entropy (runtime.loss): CHUNK_LOGITS / vocab."""
    return max(1, CHUNK_LOGITS // vocab)


def loss_chunks(tokens: float, vocab: int) -> int:
    """Chunks of the chunked cross-entropy over a micro-batch of ``tokens`` (the last ragged)."""
    return max(1, -(-int(tokens) // loss_chunk_tokens(vocab)))


INTER_OP_CHUNKS = 2
"""Token chunks of a micro-batch in an inter-operator overlapped MoE layer (paper Sec. 4):
chunk i + 1's dispatch runs beside chunk i's expert GEMMs and chunk i's combine beside chunk
i + 1's, so all but the first dispatch and the last combine (1 / chunks of the traffic each)
can hide. Two, not more: every chunk pays the collectives' latency floor again (about 60 us per
NCCL call on H200, bench/results/calibration_h200.json) and shrinks the grouped GEMMs."""


def moe_chunks(overlap: Overlap, ffn: FFNStrategy, ep: int) -> int:
    """Token chunks one MoE layer's micro-batch is dispatched in: INTER_OP_CHUNKS under
    inter-operator overlap when the experts are spread over an EP group (there is a dispatch
    to hide), else 1. ``overlap`` is the value the runtime executes (plans.execution)."""
    spread = isinstance(ffn, EPFFN) and ep > 1
    return INTER_OP_CHUNKS if overlap == Overlap.inter_op and spread else 1


def kv_heads_sent(model: ModelSpec, degree: int) -> int:
    """KV heads after GQA replication: a head-sharding degree (Ulysses sp, tp) above
    kv_heads replicates each KV head so every rank gets one."""
    return max(model.kv_heads, degree)


def ulysses_chunks(overlap: Overlap, attention: AttentionStrategy, model: ModelSpec,
                   sp: int) -> int:
    """Head groups Ulysses attention moves its heads in: INTER_OP_CHUNKS under
    inter-operator overlap with sp > 1 when every rank's KV heads split into them (each group
    keeps its query heads' KV heads), else 1. Group g + 1's all-to-all to head shards runs
    beside group g's attention core, and group g's all-to-all back beside group g + 1's core
    (runtime.parallel.attention.ChunkedUlyssesCore, priced by cost_models.layer_graph)."""
    if overlap != Overlap.inter_op or not isinstance(attention, UlyssesAttention) or sp == 1:
        return 1
    return INTER_OP_CHUNKS if (kv_heads_sent(model, sp) // sp) % INTER_OP_CHUNKS == 0 else 1


def expert_rows(tokens: float, top_k: int, experts: int) -> float:
    """Rows each expert computes from ``tokens`` under balanced routing: tokens x k / experts
    (the cost model pads them to capacity, cost_models.compute.expert_tokens)."""
    return tokens * top_k / experts


PER_EXPERT_MIN_ROWS = 4096
"""From this many rows per local expert in one call of the experts, one cuBLAS matmul per
expert beats the grouped GEMM (plans.enums.ExpertGemm): with enough rows each expert's GEMMs
run at cuBLAS's dense rate while the grouped kernel stays below it; with fewer, the per-expert
launches and the narrow GEMMs cost more than the grouped kernel loses. Measured on one H200
(torch 2.11), per-expert against grouped. The three expert GEMMs with SwiGLU forward +
backward at 16,384 tokens (python -m bench.kernels.expert_paths_gpu,
bench/results/h200/expert_paths/expert_paths.json), faster from 2,048 rows: Mixtral-8x7B at
4,096 rows per expert 49.8 against 53.2 ms, Phi-3.5-MoE at 2,048 22.4 against 23.6; slower
below: DeepSeekMoE at 1,536 21.2 against 8.8, Qwen3-235B-A22B at 1,024 40.6 against 25.0,
Qwen3-30B-A3B at 1,024 40.7 against 6.9, DeepSeek-V3 at 512 69.4 against 67.7. Whole steps of
Mixtral-8x7B, 2 layers (bench/results/h200/expert_paths/rule/, bench/results/h200/peer_steps/):
micro-batch 8, 8,192 rows per expert, 328.9 against 344.0 ms; micro-batch 1, 1,024 rows,
476.7 against 446.1 ms. The bound sits above the counts of the narrow experts that measured
far slower per expert, as the peer plans run them (DeepSeekMoE's 3,072 rows of 1,408,
Qwen3-30B-A3B's 2,048 of 768), at the smallest count measured faster in a whole layer;
Phi-3.5-MoE's 2,048 rows stay grouped (5% slower than per expert, isolated)."""


def expert_gemm(model: ModelSpec, tokens: float, group: int, chunks: int) -> ExpertGemm:
    """How a rank's routed experts run their GEMMs: per_expert where each local expert gets
    at least PER_EXPERT_MIN_ROWS rows per call under balanced routing, grouped otherwise.
    ``tokens``: this rank's tokens of one micro-batch (``tokens_per_rank``); ``group``: the
    ranks whose tokens reach its experts (ep under expert parallelism, the all-gathering etp
    under expert TP); ``chunks``: the calls one micro-batch's experts make (``moe_chunks``).
    The one rule: the runtime builds its experts with it (runtime.trainer.model_options) and
    the cost model prices its path (cost_models.compute.expert_gemm_s)."""
    rows = expert_rows(tokens * group / chunks, model.top_k, model.experts)
    return ExpertGemm.per_expert if rows >= PER_EXPERT_MIN_ROWS else ExpertGemm.grouped


def plan_expert_gemm(model: ModelSpec, degrees: Degrees, micro_batch_size: int, seq_len: int,
                     chunks: int, pinned: ExpertGemm | None = None) -> ExpertGemm:
    """``expert_gemm`` of a plan's layout: a micro-batch's tokens per rank, the FFN group;
    ``pinned`` (the plan's ``expert_gemm``) when the plan names a path."""
    if pinned is not None:
        return pinned
    tokens = tokens_per_rank(micro_batch_size, seq_len, degrees.attention_group)
    return expert_gemm(model, tokens, degrees.ep * degrees.etp, chunks)


PER_EXPERT_MAX_LOCAL_EXPERTS = 16
PER_EXPERT_MIN_FFN = 4096
"""When each rank's experts are this few and this wide, their weight gradients as one cuBLAS
matmul per expert, each adding into its slice of the main gradient (beta = 1), beat the grouped
GEMM's weight gradient and the separate pass that adds it. Measured on one H200, three expert
GEMMs with SwiGLU forward + backward, the runtime's form (grouped forward and rows' gradient,
per-expert accumulating weight gradients) against grouped + pass (bench/kernels/expert_gemm_gpu.py,
bench/results/h200/kernels/): Mixtral-8x7B's 8 experts of 14,336, 54.2 against 58.7 ms at 16k
tokens and 13.9 against 16.3 at 4,096; DeepSeekMoE-16B's 64 of 1,408, 9.85 against 9.90 (even);
Qwen3-30B-A3B's 128 of 768, 9.60 against 8.14 (the per-expert launches cost more than the pass
they save)."""


def accumulates_head_in_gemm(fusion: bool, loss: CrossEntropy, model: ModelSpec,
                             pp: int) -> bool:
    """Whether the LM head's weight gradient goes straight into its main gradient inside the
    chunked loss's GEMMs (runtime.loss): under gradient-accumulation fusion (``fusion``, the
    value the runtime executes), with the chunked loss, and unless the head is the
    embedding's own weight (tied embeddings on one pipeline stage: the embedding's gradient
    arrives through autograd into the same parameter). Otherwise the loss (or autograd, for
    the materialized loss) writes the head's gradient and a separate pass adds it."""
    return (fusion and loss == CrossEntropy.chunked
            and not (model.tied_embeddings and pp == 1))


def accumulates_experts_in_gemm(fusion: bool, local_experts: int, local_ffn: int,
                                gemm: ExpertGemm = ExpertGemm.grouped) -> bool:
    """Whether a rank's routed experts (``local_experts`` of ``local_ffn`` width each, after
    EP and expert TP) add their weight gradients into the main gradients inside the GEMM
    (per-expert matmuls): under gradient-accumulation fusion, with grouped GEMMs
    (``gemm``, plans.enums.ExpertGemm) at most PER_EXPERT_MAX_LOCAL_EXPERTS experts at least
    PER_EXPERT_MIN_FFN wide, with per-expert GEMMs always. Otherwise the GEMM writes
    each weight gradient and a separate pass adds it. ``fusion`` is the value the runtime
    executes (plans.execution)."""
    if not fusion:
        return False
    return gemm == ExpertGemm.per_expert or (local_experts <= PER_EXPERT_MAX_LOCAL_EXPERTS
                                             and local_ffn >= PER_EXPERT_MIN_FFN)
