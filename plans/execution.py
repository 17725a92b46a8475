"""What each target executes of a plan: the one capability table, a column per target.

A plan's ``target`` names the runtime that executes it (plans.enums.Target): moeplan's own
runtime (``runtime/``, per backend) or Megatron-Core (Megatron-LM's pretrain_gpt.py, as
``moeplan export --to megatron`` launches it; megatron-core 0.15). For every plan field and
value, per target (and for moeplan per backend), one of three answers:

- ``executed``: the target runs it as written (the reason names how: for Megatron-Core, its
  flag);
- ``runs_as``: the target runs another value of the field with the same maths (another
  schedule, not other numbers): the launch prints it, results record it, and the cost model
  prices the run as executed (``executed_plan``), never as written;
- ``refused``: the target cannot run it; the launch fails before any work with one line
  naming the field, the target and the reason (``check``).

A row may also need other fields (``requires``: a rule across fields, e.g. Megatron-Core's
EP overlap needs EP): a plan breaking it is refused on that field the same way.

The runtime's launch check, ``moeplan search --target`` / ``--runnable``, the pricing of a
plan by its target (explain, validate, export) and of measured runs (calibration, fidelity)
read this table; nothing else decides. A test checks that every column covers every field of
the Plan schema and every value of its enum and boolean fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum, StrEnum

from pydantic import BaseModel

from plans.enums import RecomputeModule, RouterScore, Target
from plans.errors import SpecError
from plans.plan import Plan

GRAD_SYNC_BUCKET_PARAMS = 40_000_000
"""Parameters per gradient-sync bucket: the runtime's buckets (runtime.parallel.data_parallel)
and the cost model's last, unhidden bucket (cost_models.grad_sync). Megatron-LM DDP's default
(``bucket_size`` = max(40M, 1M x dp) in megatron/core/distributed/distributed_data_parallel.py;
the dp term only matters past 40 replicas)."""


class Backend(StrEnum):
    """Where moeplan's runtime runs: the parameter dtype and the collectives differ."""

    cpu_gloo = "cpu_gloo"
    """CPU processes over gloo: fp32 parameters and compute (the parity reference)."""
    cuda_nccl = "cuda_nccl"
    """CUDA GPUs over NCCL: bf16 parameters and compute, fp32 optimizer masters."""


class ExportOnly(StrEnum):
    """A launcher moeplan writes a job for from a plan of any target, but neither searches nor
    prices for: its column says what the job runs of the plan (``refusals``), and the plan is
    priced as its own target runs it."""

    torchtitan = "torchtitan"
    """torchtitan 0.3.0's trainer (``python -m torchtitan.train``), as ``moeplan export --to
    torchtitan`` launches it."""


Column = Target | ExportOnly
"""A column of the table: a target, or a launcher moeplan only exports to."""

TARGET_NAMES: dict[Column, str] = {Target.moeplan: "moeplan's runtime",
                                   Target.megatron: "Megatron-Core",
                                   ExportOnly.torchtitan: "torchtitan 0.3.0"}
"""How lines name a target."""


class Support(StrEnum):
    executed = "executed"
    runs_as = "runs_as"
    refused = "refused"


class _Any:
    """Every value of a field (sizes, specs, degrees): what the rule says holds for all."""

    def __repr__(self) -> str:
        return "*"


ANY = _Any()

Rule = Callable[[Plan], "str | None"]
"""A rule across plan fields: why the plan breaks it, or None."""


@dataclass(frozen=True)
class Capability:
    field: str
    """Dotted path of the plan field, e.g. ``attention.kind`` or ``training.precision``."""
    value: object
    """The planned value (an enum member, a bool, a string tag, or ANY)."""
    support: Support
    reason: str = ""
    runs: object = None
    """For ``runs_as``: the value the target executes instead."""
    backends: tuple[Backend, ...] = tuple(Backend)
    """moeplan's backends the row holds on (Megatron-Core runs on CUDA only: ignored)."""
    target: Column = Target.moeplan
    requires: Rule | None = None
    """A rule the rest of the plan must keep for this value to run (refused otherwise)."""

    def matches(self, value: object, backend: Backend, target: Column) -> bool:
        return (target == self.target
                and (target != Target.moeplan or backend in self.backends)
                and (self.value is ANY or self.value == value))


def _executed(field: str, *values: object, reason: str = "",
              backends: tuple[Backend, ...] = tuple(Backend)) -> tuple[Capability, ...]:
    return tuple(Capability(field, v, Support.executed, reason, backends=backends)
                 for v in values)


def _megatron(field: str, value: object, support: Support = Support.executed, reason: str = "",
              runs: object = None, requires: Rule | None = None) -> Capability:
    return Capability(field, value, support, reason, runs, target=Target.megatron,
                      requires=requires)


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


def _moeplan_mla(plan: Plan) -> str | None:
    if plan.model.qk_norm:
        return ("model.qk_norm with mla: moeplan's runtime norms MLA's latents, not its "
                "query and key heads")
    return None


MOEPLAN_MODULES = frozenset({RecomputeModule.core_attn, RecomputeModule.moe_act})
"""The selective-recomputation modules moeplan's runtime reruns (runtime.parallel.
parallelize.apply_recompute): the attention core, checkpointed; the routed experts'
activation, its output freed after fc2's forward and rerun into it in backward
(runtime.parallel.recompute)."""


def _moeplan_recompute_modules(plan: Plan) -> str | None:
    others = [m.value for m in plan.recompute_modules if m not in MOEPLAN_MODULES]
    if others:
        return (f"selective recomputation reruns the attention core (core_attn) and the "
                f"experts' activation (moe_act) only, not {', '.join(others)} (a "
                f"Megatron-Core module: target megatron)")
    return None


MOEPLAN: tuple[Capability, ...] = (
    Capability("target", "moeplan", Support.executed),
    Capability("cuda_graphs", "none", Support.executed),
    *(Capability("cuda_graphs", v, Support.refused, "moeplan's runtime captures no CUDA graphs")
      for v in ("moe_router", "attn_moe_router", "layer")),
    Capability("target", "megatron", Support.refused,
               "the plan is for Megatron-Core: launch it with `moeplan export --to megatron`"),
    # the job: the model and batch are built as written; the cluster is the launch's
    *_executed("model", ANY, reason="every ModelSpec the schema accepts, dropout aside"),
    Capability("model.dropout", False, Support.executed),
    Capability("model.dropout", True, Support.refused,
               "the model asks for dropout; this runtime trains without (set model.dropout 0)"),
    # the model's architecture features (MODEL_FEATURES): what moeplan's runtime builds
    Capability("model.mla", False, Support.executed),
    Capability("model.mla", True, Support.executed,
               "runtime.mla: the q and kv latents (RMS-normed), RoPE on the rope parts only; "
               "TP splits the up- and output projections by heads, Ulysses moves every head's "
               "expanded keys and values", requires=_moeplan_mla),
    Capability("model.router_score", "softmax", Support.executed),
    Capability("model.router_score", "sigmoid", Support.executed,
               "runtime.router: the kept sigmoid scores renormalised"),
    Capability("model.router_expert_bias", False, Support.executed),
    Capability("model.router_expert_bias", True, Support.executed,
               "runtime.router: a per-expert fp32 bias added to the scores for the top-k "
               "choice only, moved by expert_bias_update_rate after every step from the "
               "step's routed slots summed over the stage (runtime.moe.update_expert_biases)"),
    Capability("model.routed_scaling_factor", False, Support.executed),
    Capability("model.routed_scaling_factor", True, Support.executed,
               "runtime.router: the gate weights multiplied by it"),
    Capability("model.expert_groups", False, Support.executed),
    Capability("model.expert_groups", True, Support.executed,
               "runtime.router: the groups_per_token groups of highest top-2 biased score, "
               "the top-k inside them"),
    Capability("model.mtp_layers", False, Support.executed),
    Capability("model.mtp_layers", True, Support.refused,
               "moeplan's runtime has no multi-token prediction modules; MTP runs on target "
               "megatron"),
    Capability("model.moe_layer_interval", False, Support.executed),
    Capability("model.moe_layer_interval", True, Support.refused,
               "moeplan's runtime places dense layers first only; interleaved MoE layers run on "
               "target megatron"),
    Capability("model.sliding_window", False, Support.executed),
    Capability("model.sliding_window", True, Support.refused,
               "moeplan's runtime attends over the whole causal prefix in every layer; sliding "
               "windows run on target megatron"),
    Capability("model.linear_bias", "none", Support.executed),
    Capability("model.linear_bias", ANY, Support.refused,
               "moeplan's runtime has bias-free linear layers; biases run on target megatron"),
    Capability("model.attention_sinks", False, Support.executed),
    Capability("model.attention_sinks", True, Support.refused,
               "moeplan's runtime has no attention sinks; they run on target megatron "
               "(--softmax-type learnable)"),
    Capability("model.shared_expert_gate", False, Support.executed),
    Capability("model.shared_expert_gate", True, Support.refused,
               "moeplan's runtime adds the shared experts ungated"),
    Capability("model.kv_share_layers", False, Support.executed),
    Capability("model.kv_share_layers", True, Support.refused,
               "moeplan's runtime gives every layer its own keys and values (no cross-layer "
               "attention)"),
    Capability("model.rotary_fraction", False, Support.executed),
    Capability("model.rotary_fraction", True, Support.refused,
               "moeplan's runtime rotates whole heads; partial RoPE runs on target megatron"),
    Capability("model.swiglu_limit", False, Support.executed),
    Capability("model.swiglu_limit", True, Support.refused,
               "moeplan's runtime runs the plain SwiGLU; GPT-OSS's clamped one runs on target "
               "megatron"),
    Capability("model.rope_scaling", False, Support.executed),
    Capability("model.rope_scaling", True, Support.refused,
               "moeplan's runtime computes plain RoPE angles (runtime.kernels.rope_tables), "
               "not YaRN's; YaRN runs on target megatron"),
    *_executed("cluster", ANY, reason="the launch's GPUs; the spec gives peak FLOP/s for MFU"),
    *_executed("training.global_batch", ANY),
    *_executed("training.seq_len", ANY),
    *_executed("training.routing_skew", ANY, reason="the router routes as it learns; the cost "
               "model prices the skew and the runtime logs the measured one (routing_skew)"),
    *_executed("training.memory_cap_gib", ANY, reason="a planning bound: the plan was chosen "
               "to fit under it; the runtime logs its measured peak"),
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
    *_executed("training.fp8_recipe", ANY, reason="read only under fp8, whose GEMMs run in bf16 "
               "here (training.precision)"),
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
    Capability("ffn.dispatch", "deepep", Support.refused,
               "no hierarchical (DeepEP) dispatcher: all_to_all sends every routed copy to "
               "its expert's rank; Megatron-Core runs deepep (target megatron, its flex "
               "dispatcher)"),
    *_executed("ffn.capacity_factor", ANY, reason="null is dropless"),
    *_executed("schedule", "1f1b", "interleaved_1f1b"),
    # how a step runs
    Capability("overlap", "none", Support.executed),
    Capability("overlap", "inter_op", Support.executed, _INTER_OP_WHAT),
    Capability("overlap", "inter_intra_op", Support.runs_as, _INTRA_OP_WHY, "inter_op"),
    *_executed("recompute", "none", "selective", "full",
               reason="selective reruns the plan's recompute_modules"),
    Capability("recompute_modules", ANY, Support.executed,
               "core_attn (RoPE and SDPA), moe_act (the routed experts' SwiGLU)",
               requires=_moeplan_recompute_modules),
    Capability("optimizer_moments", "fp32", Support.executed),
    Capability("optimizer_moments", "bf16", Support.refused,
               "its AdamW keeps fp32 moments (Megatron-Core's precision-aware optimizer: "
               "target megatron)"),
    *_executed("cross_entropy", "chunked", "materialized"),
    Capability("cuda_graphs", "none", Support.executed),
    Capability("cuda_graphs", ANY, Support.refused,
               "moeplan's runtime captures no TransformerEngine CUDA graphs (a Megatron-Core "
               "mechanism: target megatron)"),
    *_executed("kernels", "eager", "fused",
               reason="fused: torch.compile regions (runtime.kernels; inductor's C++ backend "
               "on CPU), the chunked loss's softmax and gradient one region per chunk and its "
               "weight gradient summed in fp32 inside the GEMMs on CUDA; the router and the "
               "materialized loss stay eager"),
    *_executed("optimizer_sharding", "none", "zero1"),
    *_executed("expert_gemm", ANY, reason="null: plans.layout.expert_gemm's rule by rows per "
               "local expert (runtime.trainer.model_options); grouped: one grouped GEMM "
               "(torch._grouped_mm); per_expert: one cuBLAS GEMM per local expert"),
    *_executed("grad_sync_precision", "fp32", "bf16", "fp8",
               reason="fp8: E4M3 payloads in 1 x 128 blocks, fp32 sums"),
    *_executed("grad_sync_overlap", False, True,
               reason="true: buckets of 40M parameters launched from the last micro-batch's "
               "backward hooks, waited for before the optimizer"),
    *_executed("grad_accumulation_fusion", False, True,
               reason="true: the blocks' Linear layers, and routed experts where "
               "plans.layout.accumulates_experts_in_gemm holds (few wide experts per rank, one "
               "matmul each), add their weight gradients into the main gradients inside the GEMM "
               "(addmm), and so does the chunked loss's LM head where plans.layout."
               "accumulates_head_in_gemm holds (not the embedding's own tied weight); the "
               "grouped-GEMM experts, the embedding and the materialized loss's head add theirs "
               "in a separate pass (runtime.parallel.grad_accumulation)"),
)
"""moeplan's column: what its runtime runs, per backend."""


# ---- Megatron-Core's rules across fields (megatron-core 0.15: TransformerConfig's and
# Megatron-LM's validate_args checks, and TransformerEngine's attention) -------------------------


def _megatron_model(plan: Plan) -> str | None:
    m = plan.model
    if m.top_k == 1 and not m.router_pre_softmax and m.router_score == RouterScore.softmax:
        return ("top-1 routing with renormalised weights: Megatron-Core's TransformerConfig "
                "needs --moe-router-pre-softmax for top-1 (model.router_pre_softmax)")
    if m.rope_theta != int(m.rope_theta):
        return f"model.rope_theta {m.rope_theta:g}: Megatron's --rotary-base is a whole number"
    return None


def _megatron_cp_split(plan: Plan, cp: int) -> str | None:
    if cp > 1 and plan.training.seq_len % (2 * cp):
        return (f"training.seq_len ({plan.training.seq_len}) is not a multiple of 2 x CP "
                f"(2 x {cp}): Megatron splits each sequence into 2 x CP chunks to balance the "
                "causal mask (megatron.core.utils.get_batch_on_this_cp_rank)")
    return None


def _megatron_ulysses(plan: Plan) -> str | None:
    d, m = plan.degrees, plan.model
    if d.sp > m.kv_heads:
        return (f"Ulysses degree {d.sp} is above model.kv_heads ({m.kv_heads}): Megatron "
                "expresses Ulysses as a2a context parallelism, whose attention "
                "(TransformerEngine) needs the KV heads to divide by the CP size")
    return _megatron_cp_split(plan, d.sp)


def _megatron_cp(plan: Plan) -> str | None:
    return _megatron_cp_split(plan, plan.degrees.cp)


def _megatron_recompute_modules(plan: Plan) -> str | None:
    """TransformerConfig.__post_init__'s check on recompute_modules that a plan can break
    (Megatron-Core 0.15.3): mla_up_proj needs multi-latent attention (its moe_act check,
    grouped GEMMs, the export always sets)."""
    if RecomputeModule.mla_up_proj in plan.recompute_modules and plan.model.mla is None:
        return "mla_up_proj recomputes MLA's up-projections: the model has no MLA"
    return None


def _megatron_moments(plan: Plan) -> str | None:
    """OptimizerConfig.__post_init__ (megatron/core/optimizer/optimizer_config.py, 0.15.3):
    the precision-aware optimizer is Adam's, in the distributed optimizer."""
    if plan.training.optimizer != "adam":
        return "the precision-aware optimizer is Adam's (training.optimizer adam)"
    if plan.optimizer_sharding != "zero1":
        return ("the precision-aware optimizer runs in the distributed optimizer only "
                "(optimizer_sharding zero1)")
    return None


def _megatron_ep_overlap(plan: Plan) -> str | None:
    """--overlap-moe-expert-parallel-comm's checks (TransformerConfig.__post_init__)."""
    d = plan.degrees
    if d.ep == 1:
        return ("Megatron-Core's EP overlap (--overlap-moe-expert-parallel-comm) needs "
                "expert parallelism (ep > 1); plan overlap none")
    if getattr(plan.ffn, "dispatch", None) not in ("all_to_all", "deepep"):
        return ("Megatron-Core's EP overlap runs with the alltoall (or flex) dispatcher "
                "only, not allgather (ffn.dispatch all_to_all)")
    if plan.recompute == "full":
        return "Megatron-Core's EP overlap needs recompute other than full"
    if d.pp > 1 and d.vpp == 1:
        return ("Megatron-Core's EP overlap needs interleaved pipeline stages (vpp > 1) "
                "when pp > 1")
    return None


_EP_OVERLAP = (
    "--overlap-moe-expert-parallel-comm: the EP dispatch and combine all-to-alls of one "
    "micro-batch hidden behind another micro-batch's compute (forward beside backward in "
    "the 1F1B steady state), not chunks of one layer; the a2a context-parallel (Ulysses) "
    "all-to-alls stay blocking")
_TP_FFN = ("--expert-tensor-parallel-size: every routed expert split over etp, tokens moved "
           "by the allgather dispatcher (--moe-token-dispatcher-type allgather)")

MEGATRON: tuple[Capability, ...] = (
    _megatron("target", "megatron", reason="Megatron-LM's pretrain_gpt.py, as `moeplan export "
              "--to megatron` writes it"),
    _megatron("target", "moeplan", Support.refused,
              "the plan is for moeplan's runtime (`moeplan train`, `export --to "
              "torchrun|slurm`)"),
    _megatron("model", ANY, reason="GPT with RMSNorm, SwiGLU, RoPE, grouped-query attention "
              "and MoE layers (--num-experts, --moe-layer-freq for the dense ones)",
              requires=_megatron_model),
    _megatron("model.dropout", False, reason="--attention-dropout 0 --hidden-dropout 0"),
    _megatron("model.dropout", True, reason="--attention-dropout, --hidden-dropout"),
    # the model's architecture features (MODEL_FEATURES), as Megatron-Core's own arguments
    # (planner.export.megatron_attention, megatron_routing)
    *(_megatron(f"model.{name}", False, reason="the feature unused: Megatron's default")
      for name in (
        "mla", "router_expert_bias", "routed_scaling_factor", "expert_groups", "mtp_layers",
        "moe_layer_interval", "sliding_window", "attention_sinks", "shared_expert_gate",
        "kv_share_layers", "rotary_fraction", "swiglu_limit", "rope_scaling")),
    _megatron("model.mla", True, reason="--multi-latent-attention --q-lora-rank --kv-lora-rank "
              "--qk-head-dim --qk-pos-emb-head-dim --v-head-dim"),
    _megatron("model.router_score", ANY, reason="--moe-router-score-function"),
    _megatron("model.router_expert_bias", True, reason="--moe-router-enable-expert-bias "
              "--moe-router-bias-update-rate"),
    _megatron("model.routed_scaling_factor", True, reason="--moe-router-topk-scaling-factor"),
    _megatron("model.expert_groups", True, reason="--moe-router-num-groups "
              "--moe-router-group-topk"),
    _megatron("model.mtp_layers", True, reason="--mtp-num-layers"),
    _megatron("model.moe_layer_interval", True, reason="--moe-layer-freq"),
    _megatron("model.sliding_window", True, reason="--window-size --window-attn-skip-freq"),
    _megatron("model.linear_bias", ANY, reason="--add-qkv-bias, --add-bias-linear"),
    _megatron("model.attention_sinks", True, reason="--softmax-type learnable"),
    _megatron("model.shared_expert_gate", True, Support.refused,
              "Megatron-LM's arguments have no shared-expert gate"),
    _megatron("model.kv_share_layers", True, Support.refused,
              "Megatron-LM has no cross-layer attention (every layer projects its own keys and "
              "values)"),
    _megatron("model.rotary_fraction", True, reason="--rotary-percent"),
    _megatron("model.swiglu_limit", True, reason="--quick-geglu --glu-linear-offset 1 "
              "--activation-func-clamp-value"),
    _megatron("model.rope_scaling", True, reason="Megatron-Core's YarnRotaryEmbedding: MLA's "
              "--rope-type yarn --rotary-scaling-factor --mscale --mscale-all-dim; GPT "
              "attention's through Megatron-Bridge (position_embedding_type yarn), which "
              "Megatron-LM's arguments cannot express (export refuses it)"),
    _megatron("cluster", ANY, reason="the launch's GPUs (CUDA, NCCL)"),
    _megatron("training.global_batch", ANY, reason="--global-batch-size"),
    _megatron("training.seq_len", ANY, reason="--seq-length"),
    _megatron("training.routing_skew", ANY, reason="the router routes as it learns"),
    _megatron("training.memory_cap_gib", ANY, reason="a planning bound the plan fits under"),
    _megatron("training.optimizer", "adam", reason="--optimizer adam: AdamW (decoupled weight "
              "decay) on fp32 masters"),
    _megatron("training.optimizer", "sgd", reason="--optimizer sgd --sgd-momentum 0"),
    _megatron("training.precision", "bf16", reason="--bf16"),
    _megatron("training.precision", "fp8", reason="--bf16 --fp8-format hybrid: "
              "TransformerEngine's fp8 GEMMs, scaled as training.fp8_recipe says"),
    _megatron("training.precision", "fp32", Support.refused,
              "training is mixed precision (bf16 or fp8)"),
    _megatron("training.fp8_recipe", "tensorwise", reason="--fp8-recipe tensorwise: "
              "TransformerEngine's per-tensor current scaling"),
    _megatron("training.fp8_recipe", "mxfp8", reason="--fp8-recipe mxfp8: TransformerEngine's "
              "MXFP8 block scaling (Blackwell GPUs)"),
    _megatron("degrees", ANY, reason="--tensor-model-parallel-size, "
              "--pipeline-model-parallel-size, --context-parallel-size (cp, or sp as a2a CP), "
              "--expert-model-parallel-size, --expert-tensor-parallel-size; vpp by the layout"),
    _megatron("stage_layers", ANY, reason="--pipeline-model-parallel-layout: the exact split, "
              "pp x vpp chunks (the virtual stages per rank follow from it)"),
    _megatron("micro_batch_size", ANY, reason="--micro-batch-size"),
    _megatron("attention.kind", "tp", reason="--tensor-model-parallel-size with "
              "--sequence-parallel"),
    _megatron("attention.kind", "ulysses_sp", reason="--context-parallel-size sp "
              "--cp-comm-type a2a: Ulysses as context parallelism (heads scattered, sequence "
              "gathered for the attention core), the norms and FFN input sharded over CP too",
              requires=_megatron_ulysses),
    _megatron("attention.kind", "cp", reason="--context-parallel-size --cp-comm-type p2p: "
              "ring attention exchanging K/V", requires=_megatron_cp),
    _megatron("attention.zigzag", True, reason="Megatron's CP balances the causal mask with "
              "2 x CP chunks per sequence"),
    _megatron("attention.zigzag", False, Support.refused,
              "Megatron's context parallelism always balances the causal mask (zigzag chunks)"),
    _megatron("ffn.kind", "ep", reason="--expert-model-parallel-size, whole experts per rank"),
    _megatron("ffn.kind", "tp", reason=_TP_FFN),
    _megatron("ffn.dispatch", "all_to_all", reason="--moe-token-dispatcher-type alltoall"),
    _megatron("ffn.dispatch", "allgather_reduce_scatter",
              reason="--moe-token-dispatcher-type allgather"),
    _megatron("ffn.dispatch", "deepep", reason="--moe-token-dispatcher-type flex "
              "--moe-enable-deepep: one copy per destination node, forwarded over NVLink"),
    _megatron("ffn.capacity_factor", ANY, reason="null: dropless; else "
              "--moe-expert-capacity-factor"),
    _megatron("schedule", "1f1b", reason="Megatron's 1F1B (no virtual stages)"),
    _megatron("schedule", "interleaved_1f1b", reason="interleaved 1F1B over the layout's "
              "pp x vpp chunks (--pipeline-model-parallel-layout)"),
    _megatron("overlap", "none", reason="each layer's communication blocks"),
    _megatron("overlap", "inter_op", reason=_EP_OVERLAP, requires=_megatron_ep_overlap),
    _megatron("overlap", "inter_intra_op", Support.refused,
              "no tile-level fused communication kernels in Megatron-Core (MegaScale-MoE's "
              "own); plan inter_op (its EP overlap) or none"),
    _megatron("recompute", "none", reason="no recomputation"),
    _megatron("recompute", "selective", reason="--recompute-granularity selective "
              "--recompute-modules core_attn"),
    _megatron("recompute", "full", reason="--recompute-granularity full --recompute-method "
              "uniform --recompute-num-layers 1"),
    _megatron("recompute_modules", ANY, reason="--recompute-modules (selective "
              "recomputation's modules)", requires=_megatron_recompute_modules),
    _megatron("optimizer_moments", "fp32", reason="Megatron's default"),
    _megatron("optimizer_moments", "bf16", reason="--use-precision-aware-optimizer "
              "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16", requires=_megatron_moments),
    _megatron("cross_entropy", "materialized", reason="the whole micro-batch's logits and "
              "their loss at once (Megatron's only kind)"),
    _megatron("cross_entropy", "chunked", Support.runs_as,
              "Megatron-Core has no chunked loss: it materialises the whole micro-batch's "
              "logits", "materialized"),
    _megatron("cuda_graphs", "none", reason="no --cuda-graph-impl: kernels launched one by one"),
    _megatron("cuda_graphs", ANY, Support.refused,
              "the exported Megatron-LM (megatron-core 0.15) has no moe_router CUDA-graph scope "
              "(--cuda-graph-scope); the recipes that graph it are priced, not exported"),
    _megatron("kernels", "fused", reason="Megatron-Core's own fused kernels, on by default: "
              "TransformerEngine's RMSNorm and GEMMs, the fused SwiGLU (--bias-swiglu-fusion) "
              "and RoPE (--apply-rope-fusion)"),
    _megatron("kernels", "eager", Support.runs_as,
              "Megatron-Core runs its own fused kernels (on by default)", "fused"),
    _megatron("optimizer_sharding", "zero1", reason="--use-distributed-optimizer: the states "
              "sharded over the data-parallel ranks of dense and expert-data-parallel ranks "
              "of expert parameters"),
    _megatron("optimizer_sharding", "none", reason="without --use-distributed-optimizer"),
    _megatron("grad_sync_precision", "fp32", reason="Megatron's default gradient reduction"),
    _megatron("grad_sync_precision", "bf16", reason="--grad-reduce-in-bf16"),
    _megatron("grad_sync_precision", "fp8", Support.refused,
              "Megatron-Core reduces gradients in fp32 or bf16 only (fp8 gradient sync is "
              "MegaScale-MoE's)"),
    _megatron("grad_sync_overlap", True, reason="--overlap-grad-reduce"),
    _megatron("grad_sync_overlap", False, reason="without --overlap-grad-reduce"),
    _megatron("grad_accumulation_fusion", True, reason="Megatron's default (TransformerEngine's "
              "wgrad GEMMs and the output layer's add into the main gradients)"),
    _megatron("grad_accumulation_fusion", False, reason="--no-gradient-accumulation-fusion"),
    _megatron("expert_gemm", "per_expert", Support.refused,
              reason="Megatron-Core's experts (TEGroupedMLP / GroupedMLP) choose their own GEMMs, "
              "priced as grouped"),
    _megatron("expert_gemm", ANY, reason="null or grouped: TEGroupedMLP, priced as grouped"),
)
"""Megatron-Core's column: what pretrain_gpt.py runs of a plan, each row naming its flag."""

# ---- torchtitan 0.3.0 (torchtitan/config/configs.py ParallelismConfig, TrainingConfig,
# CompileConfig; torchtitan/distributed/parallel_dims.py, activation_checkpoint.py) ---------

TORCHTITAN_MODELS: dict[str, tuple[str, str]] = {
    "qwen3-30b-a3b": ("qwen3", "qwen3_30b_a3b"),
    "deepseek-v3": ("deepseek_v3", "deepseek_v3_671b"),
    "gpt-oss-120b": ("gpt_oss", "gpt_oss_120b"),
}
"""Catalog models and torchtitan 0.3.0's --module / --config building the same architecture:
torchtitan takes its model from a config function, never from sizes."""


def torchtitan_model(model: BaseModel) -> tuple[str, str] | None:
    """torchtitan's (--module, --config) for ``model``: a catalog model as the catalog has it."""
    from plans.catalog import load_model

    for name, job in TORCHTITAN_MODELS.items():
        if model == load_model(name):
            return job
    return None


def _torchtitan_model(plan: Plan) -> str | None:
    if torchtitan_model(plan.model) is None:
        return (f"model {plan.model.name}: torchtitan 0.3.0 builds its model from a config "
                "function, and it has one for the catalog's "
                f"{', '.join(TORCHTITAN_MODELS)} only (as the catalog has them)")
    return None


def _torchtitan_degrees(plan: Plan) -> str | None:
    """ParallelDims' mesh: dense dp_replicate x dp_shard x cp x tp x pp; experts on
    dp_replicate x efsdp x ep with efsdp = dp_shard x cp x tp / ep (EP borrows from FSDP and
    TP); no expert tensor parallelism."""
    d = plan.degrees
    if d.etp > 1:
        return (f"etp {d.etp}: torchtitan 0.3.0 has no expert tensor parallelism (its experts "
                "are whole per EP rank, FSDP-sharded over efsdp)")
    shard = d.dp if plan.optimizer_sharding == "zero1" else 1
    region = shard * d.cp * d.tp
    if region % d.ep:
        return (f"ep {d.ep}: torchtitan's EP borrows its ranks from FSDP and TP (dp_shard x cp "
                f"x tp = {shard} x {d.cp} x {d.tp}, which ep must divide; dp replicas stay "
                "outside); optimizer_sharding zero1 makes dp the FSDP degree")
    return None


def _torchtitan_stages(plan: Plan) -> str | None:
    if plan.degrees.pp > 1 and 0 in plan.stage_layers[1:-1]:
        return ("a pipeline chunk without layers: torchtitan builds every model part from "
                "module names (--parallelism.module_fqns_per_model_part), none empty")
    return None


def _torchtitan_no_ulysses(plan: Plan) -> str | None:
    if plan.degrees.sp > 1:
        return (f"Ulysses sp {plan.degrees.sp}: torchtitan's context parallelism is ring "
                "attention (context_parallel_degree); it has no all-to-all (Ulysses) sequence "
                "parallelism")
    return None


def _torchtitan_dropless(plan: Plan) -> str | None:
    if getattr(plan.ffn, "capacity_factor", None) is not None:
        return ("torchtitan's MoE is dropless (no expert capacity); plan capacity_factor "
                "null")
    return None


def _torchtitan(field: str, value: object, support: Support = Support.executed,
                reason: str = "", runs: object = None, requires: Rule | None = None
                ) -> Capability:
    return Capability(field, value, support, reason, runs, target=ExportOnly.torchtitan,
                      requires=requires)


_TT_MODEL = "as torchtitan's config function for the model builds it (the model row)"
TORCHTITAN: tuple[Capability, ...] = (
    _torchtitan("target", ANY, reason="a torchtitan job whichever target the plan is for"),
    _torchtitan("model", ANY, reason="--module / --config: the config function building the "
                "model (TORCHTITAN_MODELS)", requires=_torchtitan_model),
    _torchtitan("model.dropout", False, reason="no dropout (torchtitan's models have none)"),
    _torchtitan("model.dropout", True, Support.refused,
                "torchtitan's models train without dropout"),
    *(_torchtitan(f"model.{name}", ANY, reason=_TT_MODEL) for name in (
        "mla", "router_score", "router_expert_bias", "routed_scaling_factor",
        "expert_groups", "moe_layer_interval", "sliding_window", "linear_bias",
        "attention_sinks", "shared_expert_gate", "kv_share_layers", "rotary_fraction",
        "swiglu_limit", "rope_scaling")),
    _torchtitan("model.mtp_layers", False, reason="no MTP modules"),
    _torchtitan("model.mtp_layers", True, Support.refused,
                "torchtitan 0.3.0's config functions for these models build no multi-token "
                "prediction modules"),
    _torchtitan("cluster", ANY, reason="the launch's GPUs (CUDA, NCCL)"),
    _torchtitan("training.global_batch", ANY, reason="--training.global_batch_size"),
    _torchtitan("training.seq_len", ANY, reason="--training.seq_len"),
    _torchtitan("training.routing_skew", ANY, reason="the router routes as it learns"),
    _torchtitan("training.memory_cap_gib", ANY, reason="a planning bound the plan fits under"),
    _torchtitan("training.optimizer", "adam", reason="AdamW, the config function's optimizer "
                "param group"),
    _torchtitan("training.optimizer", "sgd", Support.refused,
                "torchtitan's config functions train AdamW (their optimizer param groups); "
                "SGD is no argument of the job"),
    _torchtitan("training.precision", "bf16", reason="FSDP2 mixed precision: bf16 parameters "
                "(--training.mixed_precision_param bfloat16), fp32 reductions"),
    _torchtitan("training.precision", "fp8", Support.refused,
                "torchtitan's fp8 GEMMs are a model converter of dedicated config functions "
                "(e.g. deepseek_v3_671b_float8), not an argument of this job"),
    _torchtitan("training.precision", "fp32", Support.refused,
                "training is mixed precision (bf16 or fp8)"),
    _torchtitan("training.fp8_recipe", ANY, reason="read only under fp8, which this export "
                "refuses (training.precision)"),
    _torchtitan("degrees", ANY, reason="--parallelism.data_parallel_shard_degree (zero1) or "
                "data_parallel_replicate_degree (none), tensor_parallel_degree, "
                "context_parallel_degree, pipeline_parallel_degree, expert_parallel_degree",
                requires=_torchtitan_degrees),
    _torchtitan("stage_layers", ANY, reason="--parallelism.module_fqns_per_model_part: the "
                "exact split, pp x vpp model parts", requires=_torchtitan_stages),
    _torchtitan("micro_batch_size", ANY, reason="--training.local_batch_size (pp = 1: "
                "gradient accumulation to the global batch) or "
                "--parallelism.pipeline_parallel_microbatch_size"),
    _torchtitan("attention.kind", "ulysses_sp", reason="no sequence parallelism of the "
                "attention (sp = 1)", requires=_torchtitan_no_ulysses),
    _torchtitan("attention.kind", "tp", reason="--parallelism.tensor_parallel_degree with "
                "--parallelism.enable_sequence_parallel"),
    _torchtitan("attention.kind", "cp", reason="--parallelism.context_parallel_degree: ring "
                "attention"),
    _torchtitan("attention.zigzag", True, reason="--parallelism.context_parallel_load_balancer "
                "headtail (the zigzag chunks)"),
    _torchtitan("attention.zigzag", False, reason="--parallelism.context_parallel_load_balancer "
                "None"),
    _torchtitan("ffn.kind", "ep", reason="--parallelism.expert_parallel_degree, whole experts "
                "per rank"),
    _torchtitan("ffn.kind", "tp", reason="experts unsplit (etp 1), FSDP-sharded over efsdp"),
    _torchtitan("ffn.dispatch", "all_to_all", reason="torchtitan's EP all-to-all dispatch"),
    _torchtitan("ffn.dispatch", "allgather_reduce_scatter", Support.refused,
                "torchtitan's EP dispatches by all-to-all only"),
    _torchtitan("ffn.dispatch", "deepep", Support.refused,
                "torchtitan's DeepEP dispatch is a model backend of dedicated config functions "
                "(e.g. qwen3_moe_deepep), not an argument of this job"),
    _torchtitan("ffn.capacity_factor", ANY, reason="dropless", requires=_torchtitan_dropless),
    _torchtitan("schedule", "1f1b", reason="--parallelism.pipeline_parallel_schedule 1F1B"),
    _torchtitan("schedule", "interleaved_1f1b", reason="--parallelism."
                "pipeline_parallel_schedule Interleaved1F1B (part c on stage c mod pp)"),
    _torchtitan("overlap", "none", reason="each layer's communication blocks"),
    _torchtitan("overlap", ANY, Support.refused,
                "torchtitan 0.3.0 overlaps no EP communication with compute in this job (its "
                "async EP is a model backend of dedicated config functions); plan overlap none"),
    _torchtitan("recompute", "none", reason="activation_checkpoint:none"),
    _torchtitan("recompute", "full", reason="activation_checkpoint:full (FullAC: every block "
                "rerun from its input)"),
    _torchtitan("recompute", "selective", Support.refused,
                "torchtitan's selective AC is per operator (it keeps matmul and attention "
                "outputs and reruns every second matmul), not the attention core alone"),
    _torchtitan("recompute_modules", ANY, reason="read under selective recomputation only, "
                "which the recompute row refuses"),
    _torchtitan("optimizer_moments", "fp32", reason="AdamW's fp32 moments"),
    _torchtitan("optimizer_moments", "bf16", Support.refused,
                "torchtitan's AdamW keeps its moments in the parameters' fp32"),
    _torchtitan("cross_entropy", "chunked", reason="the config functions' ChunkedLossWrapper"),
    _torchtitan("cross_entropy", "materialized", Support.runs_as,
                "the config functions wrap the loss in ChunkedLossWrapper", "chunked"),
    _torchtitan("cuda_graphs", "none", reason="no CUDA graphs"),
    _torchtitan("cuda_graphs", ANY, Support.refused,
                "no TransformerEngine CUDA-graph scopes in torchtitan"),
    _torchtitan("kernels", "fused", reason="--compile.enable --compile.components model,loss "
                "(torch.compile)"),
    _torchtitan("kernels", "eager", reason="--compile.no-enable"),
    _torchtitan("optimizer_sharding", "zero1", reason="FSDP2 over dp "
                "(--parallelism.data_parallel_shard_degree): states, gradients and parameters "
                "sharded (ZeRO-3: parameters all-gathered for the forward and the backward)"),
    _torchtitan("optimizer_sharding", "none", reason="replicas "
                "(--parallelism.data_parallel_replicate_degree)"),
    _torchtitan("grad_sync_precision", "fp32", reason="--training.mixed_precision_reduce "
                "float32 (its only choice)"),
    _torchtitan("grad_sync_precision", ANY, Support.refused,
                "torchtitan 0.3.0 reduces gradients in float32 only "
                "(training.mixed_precision_reduce)"),
    _torchtitan("grad_sync_overlap", True, reason="FSDP2 / replicate reduce during the "
                "backward"),
    _torchtitan("grad_sync_overlap", False, Support.runs_as,
                "FSDP2 and replicate always reduce during the backward", True),
    _torchtitan("grad_accumulation_fusion", False, reason="autograd accumulates .grad"),
    _torchtitan("grad_accumulation_fusion", True, Support.runs_as,
                "torchtitan accumulates gradients in autograd", False),
    _torchtitan("expert_gemm", "per_expert", Support.refused,
                reason="torchtitan's GroupedExperts run one grouped GEMM"),
    _torchtitan("expert_gemm", ANY, reason="null or grouped: GroupedExperts' grouped GEMM"),
)
"""torchtitan 0.3.0's column: what the exported job runs of a plan (export-only: plans are
not searched or priced for it)."""

TABLE: tuple[Capability, ...] = MOEPLAN + MEGATRON + TORCHTITAN
"""The capability table: every plan field, every value, per target (and backend)."""

NOT_EXECUTED = ("schema_version", "prediction")
"""Plan fields that describe the plan and instruct nothing."""

MODEL_FEATURES = ("mla", "router_score", "router_expert_bias", "routed_scaling_factor",
                  "expert_groups", "mtp_layers", "moe_layer_interval", "sliding_window",
                  "linear_bias", "attention_sinks", "shared_expert_gate", "kv_share_layers",
                  "rotary_fraction", "swiglu_limit", "rope_scaling")
"""ModelSpec fields the table answers for: an enum's value, else whether the model departs
from the field's default (uses the feature)."""


def model_features(model: BaseModel) -> Iterator[tuple[str, object]]:
    """(``model.<field>``, value) of every MODEL_FEATURES field of ``model``."""
    for name in MODEL_FEATURES:
        value = getattr(model, name)
        yield f"model.{name}", (value if isinstance(value, Enum)
                                else value != type(model).model_fields[name].default)


def _text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple) and all(isinstance(v, Enum) for v in value):
        return ", ".join(v.value for v in value)
    return value.value if isinstance(value, Enum) else str(value)


def lookup(field: str, value: object, backend: Backend = Backend.cuda_nccl,
           target: Column = Target.moeplan) -> Capability:
    """The table's answer for ``field`` = ``value`` on ``target`` (moeplan: on ``backend``;
    the first matching row)."""
    text = value if isinstance(value, bool) or value is ANY else _text(value)
    for row in TABLE:
        if row.field == field and row.matches(text, backend, target):
            return row
    where = backend if target == Target.moeplan else target
    raise KeyError(f"plans.execution.TABLE has no row for {field} = {_text(value)} on {where}")


def executed_value(field: str, value: object, backend: Backend = Backend.cuda_nccl,
                   target: Target = Target.moeplan) -> object:
    """The value of ``field`` the target runs when the plan says ``value`` (``value`` itself
    unless the table says runs_as), in the field's type."""
    row = lookup(field, value, backend, target)
    return _typed(value, row.runs) if row.support == Support.runs_as else value


def executes(field: str, value: object, backend: Backend = Backend.cuda_nccl,
             target: Column = Target.moeplan) -> bool:
    """Whether the target runs ``field`` = ``value`` as written (its rules across fields
    aside: ``refusals`` checks a whole plan)."""
    return lookup(field, value, backend, target).support == Support.executed


def executed_anywhere(field: str, value: object) -> bool:
    """Whether some target (on some backend) runs ``field`` = ``value`` as written: what a
    default search may choose."""
    return any(executes(field, value, backend, target)
               for target in Target for backend in Backend)


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
            yield from model_features(value)


def _answers(plan: Plan, backend: Backend, target: Column
             ) -> Iterator[tuple[Capability, object]]:
    for field, value in plan_fields(plan):
        if isinstance(value, BaseModel | tuple) or value is None:
            yield lookup(field, ANY, backend, target), value
        elif isinstance(value, Enum | bool | str):
            yield lookup(field, value, backend, target), value
        else:
            yield lookup(field, ANY, backend, target), value


class UnsupportedFeature(SpecError):
    """A plan field the target cannot run: one line naming the field, the target and the
    reason."""


def _refusal(row: Capability, value: object, backend: Backend, reason: str) -> str:
    who = (f"its runtime on {backend}" if row.target == Target.moeplan
           else TARGET_NAMES[row.target])
    # a spec is named, not printed whole (its reason names the part): the line stays one line
    if isinstance(value, BaseModel):
        shown = f"{row.field}: {value.name}" if hasattr(value, "name") else row.field
    else:
        shown = f"{row.field}: {_text(value)}"
    return f"{shown} is not run by target {row.target} ({who}): {reason}"


def refusals(plan: Plan, backend: Backend = Backend.cuda_nccl,
             target: Column = Target.moeplan) -> list[str]:
    """One line per plan field the target cannot run (moeplan: on ``backend``): a refused
    value, or a rule across fields the plan breaks."""
    out = []
    for row, value in _answers(plan, backend, target):
        if row.support == Support.refused:
            out.append(_refusal(row, value, backend, row.reason))
        elif row.requires is not None and (why := row.requires(plan)) is not None:
            out.append(_refusal(row, value, backend, why))
    return out


RULES: dict[Column, tuple[Capability, ...]] = {
    t: tuple(r for r in TABLE if r.target == t and r.requires is not None)
    for t in (*Target, *ExportOnly)}
"""Per target, the rows with a rule across fields."""


def rule_refusals(plan: Plan, target: Column, fields: frozenset[str] | None = None
                  ) -> list[str]:
    """The lines of ``refusals`` from rules across fields only (of the rows on ``fields``
    when given), for a plan whose values the target runs one by one (a search narrowed to
    the column): fast enough per candidate."""
    out = []
    for row in RULES[target]:
        if fields is not None and row.field not in fields:
            continue
        value = _value_of(plan, row.field)
        if row.value is not ANY and _text(row.value) != _text(value):
            continue
        if (why := row.requires(plan)) is not None:
            out.append(_refusal(row, value, Backend.cuda_nccl, why))
    return out


def check(plan: Plan, backend: Backend = Backend.cuda_nccl,
          target: Target = Target.moeplan) -> None:
    """Refuse, before any work, a plan with a field the target cannot run (the first one)."""
    if found := refusals(plan, backend, target):
        raise UnsupportedFeature(found[0])


@dataclass(frozen=True)
class Deviation:
    """A plan field the target runs as another value with the same maths: the run is the
    plan's layout and numbers, only another schedule or more traffic."""

    field: str
    planned: str
    executed: str
    reason: str

    def note(self) -> str:
        return f"note: {self.field}: planned {self.planned}, runs {self.executed}: {self.reason}"


def _deviating(plan: Plan, backend: Backend, target: Column
               ) -> list[tuple[Capability, object]]:
    return [(row, value) for row, value in _answers(plan, backend, target)
            if row.support == Support.runs_as]


def deviations(plan: Plan, backend: Backend = Backend.cuda_nccl,
               target: Column = Target.moeplan) -> list[Deviation]:
    """The plan fields the target runs as another value (moeplan: on ``backend``; ``check``
    refuses the ones it cannot run at all). Hold a measurement against the plan as
    executed."""
    return [Deviation(row.field, _text(value), _text(row.runs), row.reason)
            for row, value in _deviating(plan, backend, target)]


def _typed(current: object, text: object) -> object:
    """The table's value ``text`` in the type of the field's current value."""
    return type(current)(text) if isinstance(current, Enum) else text


def executed_plan(plan: Plan, backend: Backend = Backend.cuda_nccl,
                  recorded: list[dict] | None = None,
                  target: Target = Target.moeplan) -> Plan:
    """The plan as the target runs it (moeplan: on ``backend``), for the cost model; not
    re-validated, since e.g. fp8 gradient sync over bf16 GEMMs is a combination plans do not
    offer. UnsupportedFeature when a field is refused. ``recorded``: the deviations a
    measured run wrote (``{"field", "executed"}`` each: what the runtime of its commit ran),
    applied instead of this table's."""
    check(plan, backend, target)
    ran = ([(row.field, value, row.runs) for row, value in _deviating(plan, backend, target)]
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


def as_target(plan: Plan, target: Target) -> Plan:
    """``plan`` for another target: the same instructions, to be checked against and priced
    by ``target``'s column (``executed_plan(..., target=target)``)."""
    if plan.target == target:
        return plan
    return plan.model_copy(update={"target": target, "prediction": None})


def _value_of(plan: Plan, field: str) -> object:
    value: object = plan
    for part in field.split("."):
        value = getattr(value, part)
    return value


def _parsed(current: object, text: object) -> object:
    return text == "true" if isinstance(current, bool) and isinstance(text, str) else text


def record(plan: Plan, backend: Backend) -> list[dict]:
    """What a measured result writes of how its run executed ``plan`` (``deviations``): read
    back by ``executed_as_measured``."""
    return [{"field": d.field, "planned": d.planned, "executed": d.executed}
            for d in deviations(plan, backend)]


def measured_deviations(plan: Plan, recorded: list[dict] | None,
                        backend: Backend = Backend.cuda_nccl) -> list[Deviation]:
    """The fields a measured run executed differently from ``plan`` (``executed_as_measured``)."""
    if recorded is None:
        return deviations(plan, backend)
    return [Deviation(d["field"], d["planned"], d["executed"], "recorded by the run")
            for d in recorded]


def executed_as_measured(plan: Plan, recorded: list[dict] | None,
                         backend: Backend = Backend.cuda_nccl) -> Plan:
    """The plan as a measured run executed it: the deviations the run recorded
    (bench/steps/train_step.py, ``moeplan profile`` and the runtime's log write them), or this
    table's for a result that recorded none."""
    return executed_plan(plan, backend, recorded)
