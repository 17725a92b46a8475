"""What moeplan's runtime (``runtime/``) executes of a plan: the plan fields it runs differently
from what the plan says. Part of the contract, so the runtime can say it at launch and the
planner can price a measured run as it was executed (calibration, fidelity checks)."""

from __future__ import annotations

from dataclasses import dataclass

from plans import Overlap, Plan, Precision


@dataclass(frozen=True)
class Deviation:
    """A plan field this runtime runs differently from what the plan (and its prediction)
    says: the run is still the plan's layout and maths, only slower or with more traffic."""

    field: str
    planned: str
    executed: str
    reason: str

    def note(self) -> str:
        return f"note: {self.field}: planned {self.planned}, runs {self.executed}: {self.reason}"


EXECUTED: dict[str, tuple[object, str]] = {
    "overlap": (Overlap.none, "every collective runs blocking, in program order"),
    "grad_sync_overlap": (False, "gradients are synchronised after the last backward"),
    "grad_accumulation_fusion": (False, "each micro-batch's gradients are added to the main "
                                        "gradients in a separate pass"),
}
"""Plan fields the runtime always runs one way: field -> (the value it runs, why)."""
EXECUTED_PRECISION = (Precision.bf16, "GEMMs run in bf16; fp8 applies to the gradient sync only")
"""training.precision: what the runtime's GEMMs run in."""


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def deviations(plan: Plan) -> list[Deviation]:
    """The plan fields this runtime does not execute as written (check_supported refuses the
    ones it cannot run at all). Hold a measurement against the plan as executed."""
    out = [Deviation(name, _text(getattr(plan, name)), _text(runs), why)
           for name, (runs, why) in EXECUTED.items() if getattr(plan, name) != runs]
    precision, why = EXECUTED_PRECISION
    if plan.training.precision != precision:
        out.append(Deviation("training.precision", plan.training.precision.value,
                             precision.value, why))
    return out


def executed_plan(plan: Plan) -> Plan:
    """The plan as this runtime runs it (for the cost model; not re-validated, since fp8
    gradient sync over bf16 GEMMs is a combination plans do not offer)."""
    training = plan.training.model_copy(update={"precision": EXECUTED_PRECISION[0]})
    runs = {name: value for name, (value, _) in EXECUTED.items()}
    return plan.model_copy(update={**runs, "training": training, "prediction": None})
