"""Decoder-only MoE transformer built from a ModelSpec, with no parallelism inside.

Parameter names are global (``layers.<global index>...``) so a pipeline stage keeps the names
the full model has, and initialisation derives each parameter from its name and the seed:
every split of the model starts from the same weights.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plans.enums import Kernels
from runtime.config import ModelConfig
from runtime.kernels import EAGER, KernelOps, rope_tables, rotate
from runtime.mla import MLAttention
from runtime.moe import FeedForward, MoE
from runtime.router import Scoring


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: KernelOps = EAGER):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def apply_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) on [b, s, heads, d] at positions 0..s-1."""
    return rotate(x, *rope_tables(x.shape[1], x.shape[-1], theta, x.device))


class AttentionCore(nn.Module):
    """RoPE + causal SDPA on full sequences: q [b, s, Hq, d], k/v [b, s, Hkv, d] -> [b, s, Hq, d].
    Parallel transforms wrap this module (Ulysses moves heads and sequence around it).

    Eager kernels compute the RoPE tables at every call; fused ones keep them in two
    non-persistent buffers, recomputed when the sequence, head dim or device changes."""

    def __init__(self, rope_theta: float, ops: KernelOps = EAGER):
        super().__init__()
        self.rope_theta = rope_theta
        self.ops = ops
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)

    def _rope(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops.kind == Kernels.eager:
            return apply_rope(q, self.rope_theta), apply_rope(k, self.rope_theta)
        seq, half = q.shape[1], q.shape[-1] // 2
        cached = self.rope_cos
        if cached is None or cached.shape != (seq, half) or cached.device != q.device:
            self.rope_cos, self.rope_sin = rope_tables(seq, q.shape[-1], self.rope_theta,
                                                       q.device)
        return self.ops.rotate_qk(q, k, self.rope_cos, self.rope_sin)

    def prologue(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The memory-bound work before SDPA: RoPE on q and k, then k and v repeated to q's
        heads (GQA). The cost model prices it as LayerOperator.rope."""
        q, k = self._rope(q, k)
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        return q, k, v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = self.prologue(q, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.spec
        self.head_dim = m.head_dim
        self.wq = nn.Linear(m.hidden, m.q_dim, bias=False)
        self.wk = nn.Linear(m.hidden, m.kv_dim, bias=False)
        self.wv = nn.Linear(m.hidden, m.kv_dim, bias=False)
        self.wo = nn.Linear(m.q_dim, m.hidden, bias=False)
        # QK norm (Qwen3): one RMSNorm over head_dim shared by every query (key) head, before RoPE
        ops = cfg.ops
        self.q_norm = RMSNorm(m.head_dim, m.norm_eps, ops) if m.qk_norm else None
        self.k_norm = RMSNorm(m.head_dim, m.norm_eps, ops) if m.qk_norm else None
        self.core = AttentionCore(m.rope_theta, ops)

    tp_splits = (("wq", 0), ("wk", 0), ("wv", 0), ("wo", 1))
    """(projection, dim) of the weights TP attention splits by heads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.core(q, k, v)
        return self.wo(out.reshape(b, out.shape[1], -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        m, o, ops = cfg.spec, cfg.options, cfg.ops
        self.attention_norm = RMSNorm(m.hidden, m.norm_eps, ops)
        self.attention = MLAttention(cfg) if m.mla is not None else Attention(cfg)
        self.ffn_norm = RMSNorm(m.hidden, m.norm_eps, ops)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if layer_id < m.dense_layers:
            self.feed_forward = FeedForward(m.hidden, m.dense_ffn_hidden, ops)
        else:
            self.moe = MoE(
                m.hidden,
                m.experts,
                m.top_k,
                m.expert_ffn_hidden,
                cfg.balance_groups,
                m.shared_experts,
                m.shared_expert_ffn_hidden,
                o.capacity_factor,
                pre_softmax=m.router_pre_softmax,
                scoring=Scoring.of(m),
                ops=ops,
                gemm=o.expert_gemm,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe is not None else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it once the pipeline transform has removed the
    parts another stage owns: the input is tokens when the embedding is here, else the previous
    stage's hidden states; the output is logits when the LM head is here, else hidden states."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.spec
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(m.vocab, m.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(m.layers)})
        self.norm: RMSNorm | None = RMSNorm(m.hidden, m.norm_eps, cfg.ops)
        self.output: nn.Linear | None = nn.Linear(m.hidden, m.vocab, bias=False)
        self.head_logits = True
        """The last stage returns logits; false: the final norm's output, for a loss that
        applies the LM head itself (runtime.loss.chunked_cross_entropy)."""
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.cfg.spec.tied_embeddings and self.tok_embeddings and self.output:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.output is None:
            return h
        return self._head(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return self.output(h) if self.head_logits else h

    def forward_chunk(
        self, x: torch.Tensor, layer_ids: range, embed: bool, head: bool
    ) -> torch.Tensor:
        """One model chunk of an interleaved pipeline: the embedding when ``embed``, layers
        ``layer_ids`` in order, the final norm and LM head when ``head``."""
        h = self.tok_embeddings(x) if embed else x
        for i in layer_ids:
            h = self.layers[str(i)](h)
        return self._head(h) if head else h

    def moe_layers(self) -> list[MoE]:
        return [b.moe for b in self.layers.values() if b.moe is not None]

    def init_key(self, name: str) -> str:
        """Global name a parameter is initialised (and checkpointed) under: a tied LM head kept
        apart from the embedding on the last stage starts from the embedding's weights."""
        if name == "output.weight" and self.cfg.spec.tied_embeddings:
            return "tok_embeddings.weight"
        return name


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a parameter: ``parts`` equal pieces along ``dim``, piece ``index``."""

    dim: int
    index: int
    parts: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.parts, dim=self.dim)[self.index]

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] *= self.parts
        return tuple(shape)


def init_tensor(key: str, shape: tuple[int, ...], seed: int, std: float,
                device: torch.device | None = None) -> torch.Tensor:
    """Initial value of the full parameter ``key``: norms ones, matrices N(0, std), drawn from a
    generator of ``device``'s type seeded by (seed, key), so it does not depend on how the model
    is split. On CUDA the draw runs on the GPU (a CPU draw of a 3B-parameter model takes
    seconds per rank); CPU and CUDA runs start from different (each deterministic) weights."""
    device = device or torch.device("cpu")
    if key.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen, device=device) * std


def init_weights(
    model: Transformer,
    seed: int,
    shards: Mapping[str, Shard],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Materialise a (meta or real) model on ``device`` with its deterministic weights, held in
    ``dtype`` (drawn in fp32, then rounded), the routers' expert biases at zero in fp32 (their
    steps of 0.001 would round away in bf16)."""
    model.to_empty(device=device)
    model.to(dtype=dtype)
    model.tie_weights()
    std = model.cfg.options.init_std
    with torch.no_grad():
        for moe in model.moe_layers():
            if moe.router.expert_bias is not None:
                moe.router.expert_bias = torch.zeros(moe.router.experts, device=device)
        for name, p in model.named_parameters():
            shard = shards.get(name)
            shape = shard.full_shape(p.shape) if shard else tuple(p.shape)
            full = init_tensor(model.init_key(name), shape, seed, std, device)
            p.copy_(shard.take(full) if shard else full)
