"""Kernel times on one GPU: GEMMs, grouped (expert) GEMMs, FlashAttention, memory-bound ops.

Every time is a roofline: FLOPs over the achievable tensor-core rate, or bytes over the
achievable HBM rate, whichever is longer. Achievable rates are peak x ``cluster.efficiency``.
"""

from __future__ import annotations

import math

from plans.enums import ExpertGemm
from plans.layout import expert_rows
from plans.specs import CAUSAL_FRACTION, ClusterSpec, Precision  # noqa: F401 (re-exported)

TILE = 128
"""Output tile edge of Hopper bf16/fp8 GEMM kernels (CUTLASS/cuBLAS 128x128 tiles)."""
FULL_SPEED_K = 256
"""Reduction depth at which a tile's main loop hides its prologue and epilogue (about four
64-deep k-blocks in flight in the Hopper TMA pipeline); shallower GEMMs slow down linearly."""
ACT_BYTES = Precision.bf16.bytes
"""Activations between kernels are bf16 (fp8 training casts only at GEMM inputs)."""
FP32_BYTES = Precision.fp32.bytes
CE_FWD_BYTES_PER_LOGIT = ACT_BYTES + FP32_BYTES + 4 * FP32_BYTES
"""The runtime's cross-entropy forward over bf16 logits (runtime.loss): the fp32 cast (read
bf16, write fp32), then log-softmax over rows too long for shared memory (a vocabulary of
32k-152k fp32 logits: PyTorch's multi-pass softmax reads the row for its max, for its sum of
exponentials and for the output, and writes the output); the NLL gather is negligible."""
CE_BWD_BYTES_PER_LOGIT = FP32_BYTES + 4 * FP32_BYTES + FP32_BYTES + ACT_BYTES
"""Its backward: the NLL gradient (a zero-filled fp32 tensor, one write), the log-softmax
backward (reads the gradient for its row sum, then the gradient and the saved output, writes
the input gradient) and the cast back to bf16 (read fp32, write bf16)."""
CE_FUSED_BYTES_PER_LOGIT = 4 * ACT_BYTES
"""The chunked loss's compiled region (runtime.kernels.cross_entropy_grad_over, kernels
fused), forward only (it computes the gradient there): one kernel whose loops over each row
read the bf16 logits for the maximum, for the sum of exponentials and for the gradient, which
it writes in bf16. Measured on H200 at Qwen3-30B-A3B's head (32k tokens, 152k vocabulary):
12.05 ms for 19 chunks, 3.3 TB/s at these bytes (bench/results/h200/kernels/
fused_loss_qwen3.json)."""
ATTENTION_BWD_FLOP_RATIO = 2.5
"""FlashAttention backward FLOPs / forward FLOPs: dQ, dK, dV, dP plus the recomputed S = QK^T
(FlashAttention-2 paper, Sec. 3.1.2: 5 matmuls in backward against 2 in forward)."""
WIDE_HEAD_DIM = 128
"""The widest query / key head the H200 sweep's SDPA backward ran at the forward's rate
(bench/results/h200/fidelity/calibration_h200.json, flash_attn rows): heads of 64 and 128
took 2.5-3.3x their forward's time, the 192-wide row 4.0x (efficiency.attention_wide_bwd)."""


def tensor_tflops(cluster: ClusterSpec, precision: Precision) -> float:
    """Peak dense tensor-core rate for GEMMs: fp8 training runs them on the fp8 units."""
    gpu = cluster.gpu
    return gpu.fp8_dense_tflops if precision == Precision.fp8 else gpu.bf16_dense_tflops


def memory_s(nbytes: float, cluster: ClusterSpec) -> float:
    """A memory-bound kernel: bytes moved over achievable HBM bandwidth."""
    return nbytes / (cluster.gpu.hbm_tb_s * 1e12 * cluster.efficiency.hbm)


def gather_scatter_s(nbytes: float, cluster: ClusterSpec) -> float:
    """An eager token-permutation pass (cost_models.dispatch), ``nbytes`` counted pass by pass,
    at ``efficiency.gather_scatter`` of peak HBM bandwidth."""
    return nbytes / (cluster.gpu.hbm_tb_s * 1e12 * cluster.efficiency.gather_scatter)


def elementwise_s(nbytes: float, cluster: ClusterSpec, launches: int = 0) -> float:
    """A layer's memory-bound operator run as ``launches`` eager kernels, ``nbytes`` its
    fused-kernel traffic: each kernel's fixed ``efficiency.elementwise_launch_us``, then the
    bytes at ``efficiency.elementwise`` of peak HBM bandwidth (the sum, as for a GEMM call)."""
    eff = cluster.efficiency
    return (launches * eff.elementwise_launch_us * 1e-6
            + nbytes / (cluster.gpu.hbm_tb_s * 1e12 * eff.elementwise))


def fused_elementwise_s(nbytes: float, cluster: ClusterSpec) -> float:
    """The same operator as one fused region (plan.kernels fused), at
    ``efficiency.fused_elementwise`` of peak HBM bandwidth."""
    return nbytes / (cluster.gpu.hbm_tb_s * 1e12 * cluster.efficiency.fused_elementwise)


def row_tiles(rows: float, sd: float = 0.0, block: int = TILE) -> float:
    """Expected ``block``-row blocks down a group of ``rows`` rows on average, spread ``sd``
    over the groups (routed rows): E[ceil(r / block)] = sum_j P(r > j block), r normal with a
    continuity correction; ceil(rows / block) when sd is 0."""
    if sd <= 0.0:
        return math.ceil(rows / block)
    j = max(0, math.ceil((rows - 8.0 * sd - 0.5) / block))  # below it P(r > j block) = 1
    blocks = float(j)
    while j * block < rows + 8.0 * sd:
        blocks += 0.5 * math.erfc((j * block + 0.5 - rows) / (sd * math.sqrt(2.0)))
        j += 1
    return blocks


def grouped_block_rows(rows: float) -> int:
    """The rows one CTA cluster of torch._grouped_mm's sm90 kernel computes down a group: 2 x 1
    clusters of 64-row tiles where the mean rows per group are at most 128, of 128-row tiles
    above (aten/src/ATen/native/cuda/GroupMM.cu). Measured on one H200 at DeepSeek-V3's
    experts (bench/results/h200/deepseek_v3/expert_gemm_rows_*): 96 and 128 rows each take
    2.10 ms, 160 to 256 2.5-2.7, 320 to 512 4.7-5.3."""
    return 128 if rows <= 128 else 256


def tile_efficiency(m: float, n: float, sms: int, groups: int = 1, m_sd: float = 0.0,
                    block: int = TILE) -> float:
    """Useful share of the launched 128x128 output tiles, times the share of the last wave of
    tiles over ``sms`` that is filled (tile and wave quantisation); ``m_sd``: the spread of m
    over the groups (row_tiles); ``block``: the rows a group's tiles come in (a multiple of
    TILE: grouped_block_rows)."""
    tiles = groups * row_tiles(m, m_sd, block) * (block // TILE) * math.ceil(n / TILE)
    if tiles == 0:
        return 1.0
    tile_eff = groups * m * n / (tiles * TILE * TILE)
    waves = math.ceil(tiles / sms)
    return tile_eff * tiles / (waves * sms)


def depth_efficiency(k: float) -> float:
    """Penalty for a shallow reduction dimension."""
    return min(1.0, k / FULL_SPEED_K)


def _gemm_s(
    m: float, n: float, k: float, groups: int, peak_eff: float, launch_us: float,
    cluster: ClusterSpec, precision: Precision, m_sd: float = 0.0, grouped_rows: bool = False,
) -> float:
    """One GEMM call: its fixed ``launch_us``, then its tiles at the tensor-core rate or its
    operands at the HBM rate, whichever is longer. ``grouped_rows``: a grouped GEMM grouped
    over its rows, whose clusters each compute a block of a group's rows (grouped_block_rows,
    padded) and stream the group's B operand (its weights) once per block, at
    ``grouped_gemm_stream_tb_s``: the kernel measured and fitted (torch._grouped_mm on sm90). A
    cluster without that fit prices any GEMM's rows in TILE-row tiles, its weights read once."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    stream_tb_s = cluster.efficiency.grouped_gemm_stream_tb_s if grouped_rows else None
    block = grouped_block_rows(m) if stream_tb_s is not None else TILE
    blocks = row_tiles(m, m_sd, block) if stream_tb_s is not None else 1.0
    shape_eff = (tile_efficiency(m, n, cluster.gpu.sms, groups, m_sd, block)
                 * depth_efficiency(k))
    flops = 2.0 * groups * m * n * k
    compute_s = flops / (tensor_tflops(cluster, precision) * 1e12 * peak_eff * shape_eff)
    in_bytes = precision.bytes if precision == Precision.fp8 else ACT_BYTES
    traffic = groups * ((m * k + blocks * k * n) * in_bytes + m * n * ACT_BYTES)
    stream_s = (traffic / (stream_tb_s * 1e12) if stream_tb_s is not None
                else memory_s(traffic, cluster))
    return launch_us * 1e-6 + max(compute_s, stream_s)


def backward_gemms(m: float, n: float, k: float
                   ) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """The backward of C[m, n] = A[m, k] B[k, n] as (m, n, k) GEMMs: the data gradient
    dA = dC B^T [m, k] and the weight gradient dB = A^T dC [k, n] (reduction over m)."""
    return (m, k, n), (k, n, m)


def gemm_s(m: float, n: float, k: float, cluster: ClusterSpec, precision: Precision) -> float:
    """C[m, n] = A[m, k] B[k, n] at ``efficiency.gemm`` of peak, less shape losses."""
    eff = cluster.efficiency
    return _gemm_s(m, n, k, 1, eff.gemm, eff.gemm_launch_us, cluster, precision)


def grouped_efficiency(m: float, n: float, k: float, cluster: ClusterSpec) -> float:
    """Peak fraction of a grouped GEMM whose experts are [m, k] x [k, n]: ``grouped_gemm``
    x d / (d + ``grouped_gemm_half_rows``), d the smallest of m, n, k (the rows per expert in
    forward, data- and weight-gradient GEMMs alike, when experts get fewer rows than their
    widths). A saturating curve fitted by `moeplan calibrate` to grouped GEMMs timed over
    8..128 experts and 32..4096 rows per expert (bench/kernels/calibrate_gpu.py); with the default
    half-point 0 it is ``grouped_gemm`` at every size."""
    eff = cluster.efficiency
    d = min(m, n, k)
    return eff.grouped_gemm * d / (d + eff.grouped_gemm_half_rows)


def grouped_gemm_s(
    groups: int, m_per_group: float, n: float, k: float,
    cluster: ClusterSpec, precision: Precision, m_sd: float = 0.0, over_rows: bool = True,
) -> float:
    """``groups`` GEMMs of one shape in one persistent kernel (local experts), at
    ``grouped_efficiency`` of peak; their tiles share the waves. ``over_rows``: grouped over
    the rows (forward, data gradient: blocks of rows, _gemm_s), else over the reduction (the
    weight gradient: each group's output tiles fixed); ``m_sd``: the spread of the groups'
    rows (routed rows)."""
    if m_per_group <= 0 or n <= 0 or k <= 0:
        return 0.0
    peak = grouped_efficiency(m_per_group, n, k, cluster)
    launch = cluster.efficiency.grouped_gemm_launch_us
    return _gemm_s(m_per_group, n, k, groups, peak, launch, cluster, precision,
                   m_sd if over_rows else 0.0, grouped_rows=over_rows)


def expert_gemm_s(
    gemm: ExpertGemm, groups: int, m_per_group: float, n: float, k: float,
    cluster: ClusterSpec, precision: Precision, m_sd: float = 0.0, over_rows: bool = True,
) -> float:
    """A rank's ``groups`` experts' GEMM of one shape as ``gemm`` runs it
    (plans.layout.expert_gemm): one grouped kernel at the grouped GEMM's efficiency
    (``grouped_gemm_s``), or one cuBLAS GEMM per expert at the dense GEMM's (``gemm_s`` each,
    its launch included: per-expert cuBLAS measured at the dense rate on one H200 at
    Mixtral-8x7B's shape, 695 against 696 TFLOP/s, bench/results/h200/expert_paths/)."""
    if gemm == ExpertGemm.per_expert:
        return groups * gemm_s(m_per_group, n, k, cluster, precision)
    return grouped_gemm_s(groups, m_per_group, n, k, cluster, precision, m_sd, over_rows)


def routed_rows_sd(rows: float, top_k: int, experts: int) -> float:
    """Spread of an expert's routed rows around their mean ``rows`` when each token picks its
    top_k of ``experts`` (a sum of Bernoulli(top_k / experts) draws)."""
    return math.sqrt(max(0.0, rows * (1.0 - top_k / experts)))


def expert_tokens(tokens: float, top_k: int, experts: int, capacity_factor: float | None) -> float:
    """Tokens per expert under balanced routing (plans.layout.expert_rows), padded to capacity
    when a capacity factor is set (fixed-capacity buffers are computed in full)."""
    balanced = expert_rows(tokens, top_k, experts)
    return balanced if capacity_factor is None else balanced * capacity_factor


def attention_fwd_flops(
    batch: int, q_len: float, kv_len: float, heads: float, head_dim: int, mask_fraction: float
) -> float:
    """QK^T and PV: 2 matmuls x 2 FLOPs x q x kv x head_dim per head, times the share of the
    score matrix the mask keeps."""
    return 4.0 * batch * q_len * kv_len * heads * head_dim * mask_fraction


def flash_attention_fwd_s(flops: float, cluster: ClusterSpec) -> float:
    """FlashAttention runs in bf16 (also under fp8 training) at ``efficiency.attention``."""
    return flops / (cluster.gpu.bf16_dense_tflops * 1e12 * cluster.efficiency.attention)


def flash_attention_bwd_s(fwd_flops: float, cluster: ClusterSpec, qk_head_dim: float
                          ) -> float:
    """The backward of a forward of ``fwd_flops`` whose query / key heads are ``qk_head_dim``
    wide: ATTENTION_BWD_FLOP_RATIO times its FLOPs at ``efficiency.attention``, slowed by
    ``efficiency.attention_wide_bwd`` for heads wider than WIDE_HEAD_DIM."""
    seconds = flash_attention_fwd_s(ATTENTION_BWD_FLOP_RATIO * fwd_flops, cluster)
    if qk_head_dim > WIDE_HEAD_DIM:
        return seconds / cluster.efficiency.attention_wide_bwd
    return seconds
