"""The plan notation: a plan in one line, `pp4 vpp2 dp2 sp8 ep8 a2a mbs1 i1f1b ov:inter+intra
rc:sel sync:bf16`. Plan.layout_notation and Plan.options_notation write it; `parse` reads it
back; every short name is defined once, here.

Grammar: tokens separated by spaces, in any order, each at most once.

    layout   ppN  vppN  dpN  (spN | tpN | cpN)  (epN [a2a | ag+rs] [cfX] | etpN)  mbsN
    options  (1f1b | i1f1b)  ov:(none | inter | inter+intra)  rc:(none | sel | full | MODS)
             sync:(fp32 | bf16 | fp8)  sync-after-bwd  no-gaf  ce:(chunked | materialized)
             k:(eager | fused)  os:(none | zero1)  cg:(none | moe_router | attn_moe_router | layer)
             t:(moeplan | megatron)

MODS: selective recomputation's modules other than its default (the attention core, `sel`),
their tags joined by `+` (`sel+act`: the attention core and the experts' activation; `act`:
the activation alone; MODULE_TAGS).

A part left out takes the Plan's default (pp, vpp, sp, ep, mbs 1; EP with all-to-all;
1f1b, or i1f1b when vpp > 1; ov:inter+intra rc:sel sync:bf16, the loss materialized, eager
kernels, ZeRO-1, no CUDA graphs, target moeplan), except dp: by default the GPUs the pipeline
and the attention group leave.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from plans.enums import (
    AttentionKind,
    CrossEntropy,
    CudaGraphs,
    Dispatch,
    Kernels,
    OptimizerSharding,
    Overlap,
    PipelineSchedule,
    Precision,
    Recompute,
    RecomputeModule,
    Target,
)
from plans.errors import SpecError

ATTENTION_TAGS = {AttentionKind.ulysses_sp: "sp", AttentionKind.tp: "tp", AttentionKind.cp: "cp"}
"""The attention kind as the axis its degree is written on (``sp8``)."""
DISPATCH_TAGS = {Dispatch.all_to_all: "a2a", Dispatch.allgather_reduce_scatter: "ag+rs",
                 Dispatch.deepep: "deepep"}
DISPATCH_KEYS = {d: tag.replace("+", "_") for d, tag in DISPATCH_TAGS.items()}
"""The dispatcher as a key of a results row (an identifier: ``ag_rs``)."""
SCHEDULE_TAGS = {PipelineSchedule.one_f_one_b: "1f1b", PipelineSchedule.interleaved_1f1b: "i1f1b"}
OVERLAP_TAGS = {Overlap.none: "none", Overlap.inter_op: "inter",
                Overlap.inter_intra_op: "inter+intra"}
RECOMPUTE_TAGS = {Recompute.none: "none", Recompute.selective: "sel", Recompute.full: "full"}
"""A plan's recomputation in its notation (``rc:sel``)."""
MODULE_TAGS = {
    RecomputeModule.core_attn: "sel", RecomputeModule.moe_act: "act",
    RecomputeModule.layernorm: "ln", RecomputeModule.mla_up_proj: "mla",
    RecomputeModule.mlp: "mlp", RecomputeModule.moe: "moe",
    RecomputeModule.shared_experts: "shared"}
"""Selective recomputation's modules in its notation, joined by ``+`` (``rc:sel+act``); the
attention core, its default module, is ``sel``."""


def recompute_tag(recompute: Recompute, modules: tuple[RecomputeModule, ...]) -> str:
    """A plan's recomputation and its modules in the notation (``sel``, ``sel+act``, ``full``):
    a selective plan's modules in MODULE_TAGS' order."""
    if recompute != Recompute.selective:
        return RECOMPUTE_TAGS[recompute]
    return "+".join(tag for m, tag in MODULE_TAGS.items() if m in modules)


def recompute_of(text: str) -> tuple[Recompute, tuple[RecomputeModule, ...] | None] | None:
    """The recomputation (and, where the text names them, selective's modules) of a tag
    ``recompute_tag`` writes or a Recompute value; None when it is neither."""
    if (policy := tag_value(RECOMPUTE_TAGS, text)) is not None:
        return policy, None
    modules = [tag_value(MODULE_TAGS, part) for part in text.split("+")]
    if not text or None in modules or len(set(modules)) < len(modules):
        return None
    return Recompute.selective, tuple(m for m in MODULE_TAGS if m in modules)
OPTIMIZER_SHARDING_TAGS = {OptimizerSharding.none: "none", OptimizerSharding.zero1: "zero1"}
SYNC_AFTER_BWD = "sync-after-bwd"
"""The DP gradient sync runs after the backward (Plan.grad_sync_overlap false)."""
NO_GAF = "no-gaf"
"""Gradient accumulation not fused into the weight-gradient GEMMs."""


class Prefix(StrEnum):
    """The prefixes of the option tokens (``ov:inter``)."""

    overlap = "ov:"
    recompute = "rc:"
    sync = "sync:"
    cross_entropy = "ce:"
    kernels = "k:"
    optimizer_sharding = "os:"
    cuda_graphs = "cg:"
    target = "t:"


_PREFIXED: dict[Prefix, dict] = {
    Prefix.overlap: OVERLAP_TAGS,
    Prefix.recompute: RECOMPUTE_TAGS,
    Prefix.sync: {p: p.value for p in Precision},
    Prefix.cross_entropy: {c: c.value for c in CrossEntropy},
    Prefix.kernels: {k: k.value for k in Kernels},
    Prefix.optimizer_sharding: OPTIMIZER_SHARDING_TAGS,
    Prefix.cuda_graphs: {g: g.value for g in CudaGraphs},
    Prefix.target: {t: t.value for t in Target},
}
_DEGREE = re.compile(r"(pp|vpp|dp|sp|tp|cp|ep|etp|mbs)([0-9]+)")
_GROUP = {"sp": "attention", "tp": "attention", "cp": "attention", "ep": "ffn", "etp": "ffn"}
"""Axes of which a plan has one degree: the attention group's, the FFN's."""
_CAPACITY = re.compile(r"cf([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)")
GRAMMAR = ("ppN vppN dpN spN|tpN|cpN epN a2a|ag+rs cfX etpN mbsN 1f1b|i1f1b "
           "ov:none|inter|inter+intra rc:none|sel|full|sel+act|act sync:fp32|bf16|fp8 "
           "sync-after-bwd no-gaf "
           "ce:chunked|materialized k:eager|fused os:none|zero1")
"""Every token the notation has, for error messages and help."""


def tag_value(table: dict, text: str):
    """The enum member whose short name or value is ``text`` (``sel`` or ``selective``);
    None when neither."""
    for member, tag in table.items():
        if text in (tag, member.value):
            return member
    return None


@dataclass
class Notation:
    """What a line of notation states; None where it is silent."""

    degrees: dict[str, int] = field(default_factory=dict)
    """pp, vpp, dp, sp / tp / cp, ep / etp as written."""
    attention: AttentionKind | None = None
    ffn_tp: bool = False
    """`etpN`: tensor parallelism inside the experts."""
    dispatch: Dispatch | None = None
    capacity_factor: float | None = None
    micro_batch_size: int | None = None
    schedule: PipelineSchedule | None = None
    options: dict[Prefix, object] = field(default_factory=dict)
    sync_after_bwd: bool = False
    no_gaf: bool = False
    recompute_modules: tuple[RecomputeModule, ...] | None = None
    """Selective recomputation's modules where `rc:` names them (``sel+act``)."""


def parse(text: str, where: str = "plan") -> Notation:
    """The parts of one line of notation; SpecError naming the token that is not one, or
    that repeats or contradicts another."""
    tokens = text.split()
    if not tokens:
        raise SpecError(f"{where}: empty plan notation; tokens: {GRAMMAR}")
    out, seen = Notation(), set()

    def once(key: str, token: str) -> None:
        if key in seen:
            raise SpecError(f"{where}: {token!r}: {key} given twice in {text!r}")
        seen.add(key)

    for token in tokens:
        if (m := _DEGREE.fullmatch(token)) is not None:
            axis, value = m.group(1), int(m.group(2))
            if value < 1:
                raise SpecError(f"{where}: {token!r}: a degree is 1 or more")
            if axis == "mbs":
                once("mbs", token)
                out.micro_batch_size = value
                continue
            group = _GROUP.get(axis, axis)
            if group in seen:
                other = next(f"{a}{v}" for a, v in out.degrees.items()
                             if _GROUP.get(a, a) == group)
                what = {"attention": "one attention degree (sp, tp or cp)",
                        "ffn": "one FFN degree (ep or etp)"}.get(group, f"{axis} given twice")
                raise SpecError(f"{where}: {token!r} beside {other!r}: {what}")
            seen.add(group)
            out.degrees[axis] = value
            if group == "attention":
                out.attention = tag_value(ATTENTION_TAGS, axis)
            out.ffn_tp = out.ffn_tp or axis == "etp"
        elif (dispatch := tag_value(DISPATCH_TAGS, token)) is not None:
            once("dispatch", token)
            out.dispatch = dispatch
        elif (m := _CAPACITY.fullmatch(token)) is not None:
            once("capacity factor", token)
            out.capacity_factor = float(m.group(1))
        elif (schedule := _schedule(token)) is not None:
            once("schedule", token)
            out.schedule = schedule
        elif token == SYNC_AFTER_BWD:
            once(token, token)
            out.sync_after_bwd = True
        elif token == NO_GAF:
            once(token, token)
            out.no_gaf = True
        else:
            prefix = next((p for p in Prefix if token.startswith(p.value)), None)
            value = None if prefix is None else tag_value(_PREFIXED[prefix],
                                                           token[len(prefix):])
            if prefix == Prefix.recompute and value is None:
                value, out.recompute_modules = recompute_of(token[len(prefix):]) or (None, None)
            if value is None:
                raise SpecError(f"{where}: unknown token {token!r} in {text!r}; tokens: "
                                f"{GRAMMAR}")
            once(prefix.value, token)
            out.options[prefix] = value
    if out.ffn_tp and (out.dispatch is not None or out.capacity_factor is not None):
        extra = DISPATCH_TAGS[out.dispatch] if out.dispatch else f"cf{out.capacity_factor:g}"
        raise SpecError(f"{where}: {extra!r} goes with epN (expert parallelism), not "
                        f"etp{out.degrees['etp']}")
    return out


def _schedule(token: str) -> PipelineSchedule | None:
    return tag_value(SCHEDULE_TAGS, token)


def plan_from_notation(text: str, model, cluster, training, where: str = "plan"):
    """The Plan a line of notation states for these specs, layers split evenly over the
    pipeline's chunks (the planner's split: planner.search.split_stages); SpecError with
    one line where the notation or the plan it states is not valid."""
    from pydantic import ValidationError

    from plans.errors import describe
    from plans.plan import EPFFN, TPFFN, CPAttention, Degrees, Plan, TPAttention, UlyssesAttention

    n = parse(text, where)
    d = dict(n.degrees)
    pp, vpp = d.get("pp", 1), d.get("vpp", 1)
    group = d.get("sp", 1) * d.get("tp", 1) * d.get("cp", 1)
    if "dp" not in d:
        if cluster.gpus % (pp * group):
            raise SpecError(f"{where}: dp: pp x the attention degree ({pp} x {group}) must "
                            f"divide the {cluster.gpus} GPUs; or give dpN")
        d["dp"] = cluster.gpus // (pp * group)
    attention = {None: UlyssesAttention, AttentionKind.ulysses_sp: UlyssesAttention,
                 AttentionKind.tp: TPAttention, AttentionKind.cp: CPAttention}[n.attention]()
    ffn = TPFFN() if n.ffn_tp else EPFFN(dispatch=n.dispatch or Dispatch.all_to_all,
                                          capacity_factor=n.capacity_factor)
    schedule = n.schedule or (PipelineSchedule.interleaved_1f1b if vpp > 1
                              else PipelineSchedule.one_f_one_b)
    chunks = pp * vpp
    base, extra = divmod(model.layers, chunks)
    if base == 0:
        raise SpecError(f"{where}: pp x vpp ({pp} x {vpp} = {chunks}) exceeds the "
                        f"{model.layers} layers of {model.name}")
    fields = {
        "overlap": Prefix.overlap, "recompute": Prefix.recompute,
        "grad_sync_precision": Prefix.sync, "cross_entropy": Prefix.cross_entropy,
        "kernels": Prefix.kernels, "optimizer_sharding": Prefix.optimizer_sharding,
        "cuda_graphs": Prefix.cuda_graphs, "target": Prefix.target,
    }
    try:
        return Plan(
            model=model, cluster=cluster, training=training, degrees=Degrees(**d),
            attention=attention, ffn=ffn,
            stage_layers=tuple(base + (1 if c < extra else 0) for c in range(chunks)),
            schedule=schedule,
            **({"micro_batch_size": n.micro_batch_size} if n.micro_batch_size else {}),
            grad_sync_overlap=not n.sync_after_bwd, grad_accumulation_fusion=not n.no_gaf,
            **({"recompute_modules": n.recompute_modules} if n.recompute_modules else {}),
            **{name: n.options[p] for name, p in fields.items() if p in n.options},
        )
    except ValidationError as e:
        raise SpecError(f"{where}: {text!r}: {describe(e)}") from None
