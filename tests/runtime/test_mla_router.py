"""MLA attention and sigmoid / group-limited routing against their definitions written out
here (DeepSeek-V2 Sec. 2.1, DeepSeek-V3 Sec. 2.1.2), and what the capability table says of
them."""

from __future__ import annotations

import math

import pytest
import torch
from dist_workers import make_plan
from test_kernels import one_step
from test_parity import GRAD_RTOL, LOSS_RTOL, _rel

from cost_models.volumes import ACT_BYTES, ulysses_attention
from plans import Kernels, Recompute
from plans.execution import refusals
from plans.specs import ModelSpec
from runtime.config import ModelConfig
from runtime.mla import MLAttention
from runtime.model import Transformer, init_weights
from runtime.moe import Router
from runtime.router import Scoring

MLA = {"query_heads": 4, "kv_heads": 4, "head_dim": 16,
       "mla": {"q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 12,
               "qk_rope_head_dim": 4, "v_head_dim": 8}}
"""tiny-moe's attention as MLA: 4 heads of 12 + 4 query / key and 8 value values."""
SIGMOID_GROUPS = {"experts": 8, "router_score": "sigmoid", "router_expert_bias": True,
                  "routed_scaling_factor": 2.5, "expert_groups": 4, "groups_per_token": 2}
"""DeepSeek-V3's router at tiny size: 8 experts in 4 groups, a token's 2 from 2 groups."""


def spec(**update) -> ModelSpec:
    return make_plan(spec_update=update).model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [b, s, H, d] at positions 0..s-1, written per position pair."""
    s, d = x.shape[1], x.shape[-1]
    out = torch.empty_like(x)
    for pos in range(s):
        for i in range(d // 2):
            angle = pos / theta ** (2 * i / d)
            c, n = math.cos(angle), math.sin(angle)
            a, b = x[:, pos, :, i], x[:, pos, :, i + d // 2]
            out[:, pos, :, i] = a * c - b * n
            out[:, pos, :, i + d // 2] = b * c + a * n
    return out


def reference_mla(attn: MLAttention, m: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    """MLA from its definition: latents, per-head up-projections, RoPE on the rope parts,
    softmax(q k^T / sqrt(nope + rope)) under the causal mask, the output projection."""
    a, heads, eps = m.mla, m.query_heads, m.norm_eps
    b, s, _ = x.shape
    q = _rms(x @ attn.wq_a.weight.T, attn.q_a_norm.weight, eps) @ attn.wq_b.weight.T
    q = q.view(b, s, heads, a.qk_head_dim)
    q_nope, q_rope = q[..., :a.qk_nope_head_dim], q[..., a.qk_nope_head_dim:]
    down = x @ attn.wkv_a.weight.T
    latent, k_rope = down[..., :a.kv_lora_rank], down[..., a.kv_lora_rank:]
    kv = (_rms(latent, attn.kv_a_norm.weight, eps) @ attn.wkv_b.weight.T).view(
        b, s, heads, a.qk_nope_head_dim + a.v_head_dim)
    k_nope, v = kv[..., :a.qk_nope_head_dim], kv[..., a.qk_nope_head_dim:]
    q_rope = _rope(q_rope, m.rope_theta)
    k_rope = _rope(k_rope[:, :, None, :], m.rope_theta)  # one key head shared by all
    scores = (torch.einsum("bqhd,bkhd->bhqk", q_nope, k_nope)
              + torch.einsum("bqhd,bkxd->bhqk", q_rope, k_rope)) / math.sqrt(a.qk_head_dim)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, heads * a.v_head_dim)
    return out @ attn.wo.weight.T


def test_mla_matches_its_definition():
    m = spec(**MLA)
    model = Transformer(ModelConfig(m))
    init_weights(model, 7, {}, torch.device("cpu"))
    attn = model.layers["0"].attention
    assert isinstance(attn, MLAttention)
    x = torch.randn(2, 6, m.hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = attn(x), reference_mla(attn, m, x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_mla_parameters_are_the_specs_count():
    """The built attention holds exactly the parameters plans.specs counts for one layer."""
    for q_lora in (32, 0):
        m = spec(**{**MLA, "mla": {**MLA["mla"], "q_lora_rank": q_lora}})
        attn = MLAttention(ModelConfig(m))
        assert sum(p.numel() for p in attn.parameters()) == m.attention_params


def reference_route(logits, bias, m: ModelSpec):
    """Per token, DeepSeek-V3's MoEGate written as loops: sigmoid scores, biased choice, the
    groups_per_token groups of highest top-2 sum, top-k inside them, the unbiased scores
    renormalised and scaled."""
    scores = logits.sigmoid()
    per_group = m.experts // m.expert_groups
    out_w, out_i = [], []
    for t in range(logits.shape[0]):
        choice = [float(scores[t, e] + bias[e]) for e in range(m.experts)]
        group_score = [sum(sorted(choice[g * per_group:(g + 1) * per_group])[-2:])
                       for g in range(m.expert_groups)]
        groups = sorted(range(m.expert_groups), key=lambda g: -group_score[g])
        allowed = [e for e in range(m.experts) if e // per_group in groups[:m.groups_per_token]]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:m.top_k]
        w = torch.stack([scores[t, e] for e in chosen])
        out_w.append(w / w.sum() * m.routed_scaling_factor)
        out_i.append(chosen)
    return torch.stack(out_w), torch.tensor(out_i)


def test_sigmoid_group_routing_matches_its_definition():
    m = spec(**SIGMOID_GROUPS)
    router = Router(m.hidden, m.experts, m.top_k, m.experts, scoring=Scoring.of(m))
    x = torch.randn(32, m.hidden, generator=torch.Generator().manual_seed(5))
    bias = torch.linspace(-0.3, 0.3, m.experts)
    router.expert_bias.copy_(bias)
    routing = router(x)
    want_w, want_i = reference_route(router.gate(x).detach(), bias, m)
    assert torch.equal(routing.indices, want_i)
    assert torch.allclose(routing.weights, want_w, rtol=1e-6)
    # every token's experts lie in at most groups_per_token groups
    per_group = m.experts // m.expert_groups
    assert all(len(set((row // per_group).tolist())) <= m.groups_per_token
               for row in routing.indices)


def test_the_expert_bias_moves_the_choice_not_the_weights():
    m = spec(**SIGMOID_GROUPS)
    router = Router(m.hidden, m.experts, m.top_k, m.experts, scoring=Scoring.of(m))
    x = torch.randn(16, m.hidden, generator=torch.Generator().manual_seed(6))
    router.expert_bias.fill_(0.0)
    router.expert_bias[3] = 10.0  # every token now takes expert 3
    routing = router(x)
    assert (routing.indices == 3).any(1).all()
    scores = router.gate(x).detach().sigmoid()
    kept = scores.gather(1, routing.indices)
    assert torch.allclose(routing.weights, kept / kept.sum(1, keepdim=True) * 2.5, rtol=1e-6)
    assert "expert_bias" not in dict(router.named_parameters())


def test_the_expert_bias_starts_at_zero():
    m = spec(**SIGMOID_GROUPS)
    with torch.device("meta"):
        model = Transformer(ModelConfig(m))
    init_weights(model, 1, {}, torch.device("cpu"))
    biases = [layer.router.expert_bias for layer in model.moe_layers()]
    assert biases and all(torch.equal(b, torch.zeros(m.experts)) for b in biases)


def test_plain_softmax_routing_keeps_the_fused_route():
    assert Scoring.of(spec()) is None
    assert Scoring.of(spec(expert_groups=2, groups_per_token=2)) is None
    assert Scoring.of(spec(**SIGMOID_GROUPS)) is not None


def test_the_runtime_runs_mla_and_deepseek_routing_and_refuses_mtp():
    assert refusals(make_plan(spec_update={**MLA, **SIGMOID_GROUPS})) == []
    (mtp,) = refusals(make_plan(spec_update={**MLA, "mtp_layers": 1}))
    assert mtp.startswith("model.mtp_layers") and "multi-token prediction" in mtp
    (norm,) = refusals(make_plan(spec_update={**MLA, "qk_norm": True}))
    assert norm.startswith("model.mla") and "qk_norm" in norm


@pytest.mark.parametrize("update", [MLA, SIGMOID_GROUPS], ids=["mla", "sigmoid_groups"])
def test_the_model_trains_a_step(update):
    """Loss and gradients are finite, and every parameter gets a gradient."""
    m = spec(**update)
    model = Transformer(ModelConfig(m))
    init_weights(model, 2, {}, torch.device("cpu"))
    tokens = torch.randint(0, m.vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    assert torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_fused_kernels_train_mla_and_sigmoid_routing_as_eager():
    """The compiled RoPE on MLA's rope parts (under selective recomputation) and the sigmoid
    router beside the fused norms give the eager model's loss and gradients."""
    layout = dict(recompute=Recompute.selective, global_batch=2,
                  spec_update={**MLA, **SIGMOID_GROUPS})
    eager_loss, eager = one_step(make_plan(**layout))
    fused_loss, fused = one_step(make_plan(kernels=Kernels.fused, **layout))
    assert abs(fused_loss - eager_loss) / eager_loss < LOSS_RTOL, (fused_loss, eager_loss)
    assert fused.keys() == eager.keys()
    for name, grad in fused.items():
        assert _rel(grad, eager[name]) < GRAD_RTOL, (name, _rel(grad, eager[name]))


def test_the_heads_ulysses_moves_are_the_cost_models_bytes():
    """What MLA hands its core (q, every head's expanded k, v) and gets back is what
    cost_models.volumes.ulysses_attention prices the two all-to-alls at."""
    m = spec(**MLA)
    attn = MLAttention(ModelConfig(m))
    seen = {}

    def record(_module, args, out):
        seen["in"], seen["out"] = sum(t.numel() for t in args), out.numel()

    attn.core.register_forward_hook(record)
    b, s = 2, 8
    attn(torch.randn(b, s, m.hidden))
    qkv, out = ulysses_attention(m, b, s, 1)
    assert seen["in"] * ACT_BYTES == qkv.buffer_bytes
    assert seen["out"] * ACT_BYTES == out.buffer_bytes
