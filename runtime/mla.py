"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 Sec. 2.1; DeepSeek-V3's shapes).

The hidden state x [b, s, h] is projected down to a query latent (q_lora_rank, RMS-normed;
without one the queries come from x directly) and to a key/value latent (kv_lora_rank,
RMS-normed) beside one RoPE key of qk_rope_head_dim shared by every head. Up-projections give
every head its query (a no-RoPE and a RoPE part), its no-RoPE key and its value. RoPE rotates
the RoPE parts only; the softmax scale is 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim).

The core takes per-head tensors q, k [b, s, H, qk_nope + qk_rope] (the shared RoPE key copied
to every head) and v [b, s, H, v_head_dim], so the head-parallel transforms act on it as on
GQA's (runtime.parallel.attention): Ulysses moves every head's expanded keys and values after
the projections on the rank's tokens, TP splits the up-projections and the output projection
by heads and keeps the down-projections (and the latent norms) on every tp rank, as
cost_models.layer_graph._projections prices them (Megatron-Core's MLASelfAttention).

RoPE here is the rotate-half form of runtime.kernels.rotate (the kernel set's rotate_qk);
DeepSeek's reference permutes the RoPE part's columns to interleaved pairs first, a fixed
relabelling of the projections' output columns that weights drawn from scratch do not see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig
from runtime.kernels import EAGER, KernelOps, rope_tables


class MLACore(nn.Module):
    """RoPE on the last ``rope_dim`` values of every query and key head, then causal SDPA:
    q, k [b, s, H, d_qk], v [b, s, H, d_v] -> [b, s, H, d_v]."""

    def __init__(self, rope_dim: int, rope_theta: float, ops: KernelOps = EAGER):
        super().__init__()
        self.rope_dim = rope_dim
        self.rope_theta = rope_theta
        self.ops = ops

    def prologue(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rope_dim
        cos, sin = rope_tables(q.shape[1], r, self.rope_theta, q.device)
        q_rope, k_rope = self.ops.rotate_qk(q[..., -r:], k[..., -r:], cos, sin)
        return (torch.cat([q[..., :-r], q_rope], dim=-1),
                torch.cat([k[..., :-r], k_rope], dim=-1))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k = self.prologue(q, k)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)


class MLAttention(nn.Module):
    """MLA's projections around an MLACore (the module doc). Parameters: ``wq_a``,
    ``q_a_norm``, ``wq_b`` (with a query latent) or ``wq`` (without), ``wkv_a`` (to the kv
    latent and the RoPE key), ``kv_a_norm``, ``wkv_b`` (to every head's no-RoPE key and value,
    head-major) and ``wo``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from runtime.model import RMSNorm  # runtime.model builds this module

        m, ops = cfg.spec, cfg.ops
        a = m.mla
        self.nope, self.rope, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora = a.kv_lora_rank
        if a.q_lora_rank:
            self.wq_a = nn.Linear(m.hidden, a.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(a.q_lora_rank, m.norm_eps, ops)
            self.wq_b = nn.Linear(a.q_lora_rank, m.query_heads * a.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(m.hidden, m.query_heads * a.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(m.hidden, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(a.kv_lora_rank, m.norm_eps, ops)
        self.wkv_b = nn.Linear(a.kv_lora_rank, m.query_heads * (a.qk_nope_head_dim
                                                                + a.v_head_dim), bias=False)
        self.wo = nn.Linear(m.query_heads * a.v_head_dim, m.hidden, bias=False)
        self.core = MLACore(a.qk_rope_head_dim, m.rope_theta, ops)

    @property
    def tp_splits(self) -> tuple[tuple[str, int], ...]:
        """(projection, dim) of the weights TP attention splits by heads: the up-projections'
        rows and the output projection's columns; the down-projections stay whole."""
        q = "wq_b" if hasattr(self, "wq_b") else "wq"
        return ((q, 0), ("wkv_b", 0), ("wo", 1))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq_b"):
            return self.wq_b(self.q_a_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._queries(x).view(b, s, -1, self.nope + self.rope)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_a_norm(latent)).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = kv.shape[2]
        k = torch.cat([k_nope, k_rope[:, :, None, :].expand(b, s, heads, self.rope)], dim=-1)
        out = self.core(q, k, v.contiguous())
        return self.wo(out.reshape(b, out.shape[1], -1))
