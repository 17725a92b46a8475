"""The options that pin or restrict a search (`--tp 1,2 --ep 8 --recompute sel`), one list rule
for every command: one value, or a list comma-separated (`--tp 1,2,4`), or the option repeated
(`--tp 1 --tp 2`), or both. A bad value is one line naming the option.

Importable without pydantic and the models (the CLI declares its options from PINS before any
model is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from plans.enums import (
    AttentionKind,
    Dispatch,
    OptimizerSharding,
    Overlap,
    Precision,
    Recompute,
)

LIST_RULE = ("One value or a list: comma-separated (1,2,4) or the option repeated; "
             "default: all.")
"""The list rule, as every list option's help states it."""


@dataclass(frozen=True)
class Pin:
    name: str
    """The command's parameter (and, dashed, the option: grad_sync -> --grad-sync)."""
    field: str
    """The planner.space.SearchSpace field it sets."""
    help: str
    values: type[StrEnum] | None = None
    """The enum of its values (their plan-notation short names accepted too); None: whole
    numbers, 1 or more."""
    tags: str | None = None
    """The name of the plans.notation table of short names for ``values``."""

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


PINS = (
    Pin("pp", "pp", "Pipeline degrees."),
    Pin("vpp", "vpp_degrees", "Virtual stages per pipeline stage (1: the 1f1b schedule)."),
    Pin("sp", "sp_degrees", "Ulysses sequence-parallel degrees of attention (1: none)."),
    Pin("tp", "tp_degrees", "Tensor-parallel degrees of attention (1: none)."),
    Pin("cp", "cp_degrees", "Context-parallel degrees of attention (1: none; above 1 allows "
        "cp attention, which the runtime does not run)."),
    Pin("ep", "ep_degrees", "Expert-parallel degrees (1: no EP)."),
    Pin("etp", "expert_tp_degrees", "Tensor-parallel degrees inside the experts (1: whole "
        "experts, an EP FFN)."),
    Pin("mbs", "micro_batch_sizes", "Micro-batch sizes (sequences)."),
    Pin("attention", "attention", "Attention strategies: ulysses_sp (sp), tp, cp.",
        AttentionKind, "ATTENTION_TAGS"),
    Pin("dispatch", "dispatch", "Token dispatchers: all_to_all (a2a), "
        "allgather_reduce_scatter (ag+rs).", Dispatch, "DISPATCH_TAGS"),
    Pin("overlap", "overlap", "Overlap levels: none, inter_op (inter), inter_intra_op "
        "(inter+intra).", Overlap, "OVERLAP_TAGS"),
    Pin("recompute", "recompute", "Recomputation: none, selective (sel), full.", Recompute,
        "RECOMPUTE_TAGS"),
    Pin("grad_sync", "grad_sync", "Gradient-sync precisions: fp32, bf16, fp8 (fp8 training "
        "only).", Precision),
    Pin("optimizer_sharding", "optimizer_sharding", "Optimizer-state sharding: zero1, none "
        "(default zero1).", OptimizerSharding, "OPTIMIZER_SHARDING_TAGS"),
)
"""Every pin option, in the order the commands list them."""


def split_values(option: str, raw: list[str] | None) -> list[str] | None:
    """The values of a list option under LIST_RULE; None when it was not given."""
    if not raw:
        return None
    items = [v.strip() for text in raw for v in text.split(",")]
    if any(not v for v in items):
        from plans.errors import SpecError

        raise SpecError(f"{option}: empty value in {','.join(raw)!r}")
    return items


def parse_pin(pin: Pin, raw: list[str] | None) -> tuple | None:
    """The typed values of one pin option; SpecError naming it for a bad or repeated one."""
    from plans.errors import SpecError

    items = split_values(pin.option, raw)
    if items is None:
        return None
    if pin.values is None:
        values = []
        for item in items:
            if not item.isdigit() or int(item) < 1:
                raise SpecError(f"{pin.option}: {item!r} is not a whole number of 1 or more")
            values.append(int(item))
    else:
        import plans.notation

        table = (getattr(plans.notation, pin.tags) if pin.tags
                 else {m: m.value for m in pin.values})
        values = []
        for item in items:
            member = plans.notation.tag_value(table, item)
            if member is None:
                names = ", ".join(f"{m.value} ({t})" if t != m.value else m.value
                                  for m, t in table.items())
                raise SpecError(f"{pin.option}: {item!r} is not one of {names}")
            values.append(member)
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        raise SpecError(f"{pin.option}: {twice} given twice")
    return tuple(values)


@dataclass(frozen=True)
class Pinned:
    fields: dict
    """SearchSpace field -> its allowed values, for the pins given."""
    text: str
    """The pins as given, normalised: `--tp 2 --ep 4,8` ('' when none)."""


def parse_pins(raw: dict[str, list[str] | None], precision: Precision) -> Pinned:
    """The pins of a command (its raw values by parameter name) as SearchSpace fields; a
    pinned sp / tp / cp degree above 1 also allows its attention kind (unless --attention
    narrows the kinds), and an fp8 gradient sync is refused for bf16 training."""
    from plans.errors import SpecError

    fields, text = {}, []
    for pin in PINS:
        values = parse_pin(pin, raw.get(pin.name))
        if values is None:
            continue
        fields[pin.field] = values
        text.append(f"{pin.option} {','.join(str(v) for v in values)}")
    if Precision.fp8 in fields.get("grad_sync", ()) and precision != Precision.fp8:
        raise SpecError("--grad-sync: fp8 gradient sync needs --precision fp8")
    if "attention" not in fields and any(d > 1 for d in fields.get("cp_degrees", ())):
        from planner.space import SearchSpace

        fields["attention"] = (*SearchSpace().attention, AttentionKind.cp)
    return Pinned(fields, " ".join(text))
