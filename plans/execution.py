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


def deviations(plan: Plan) -> list[Deviation]:
    """The plan fields this runtime does not execute as written (check_supported refuses the
    ones it cannot run at all). Hold a measurement against the plan as executed."""
    out = []
    if plan.overlap != Overlap.none:
        out.append(Deviation("overlap", plan.overlap.value, Overlap.none.value,
                             "every collective runs blocking, in program order"))
    if plan.grad_sync_overlap:
        out.append(Deviation("grad_sync_overlap", "true", "false",
                             "gradients are synchronised after the last backward"))
    if plan.grad_accumulation_fusion:
        out.append(Deviation("grad_accumulation_fusion", "true", "false",
                             "each micro-batch's gradients are added to the main gradients in "
                             "a separate pass"))
    if plan.training.precision == Precision.fp8:
        out.append(Deviation("training.precision", "fp8", "bf16",
                             "GEMMs run in bf16; fp8 applies to the gradient sync only"))
    return out


def executed_plan(plan: Plan) -> Plan:
    """The plan as this runtime runs it (for the cost model; not re-validated, since fp8
    gradient sync over bf16 GEMMs is a combination plans do not offer)."""
    training = plan.training
    if plan.training.precision == Precision.fp8:
        training = training.model_copy(update={"precision": Precision.bf16})
    return plan.model_copy(update={"overlap": Overlap.none, "grad_sync_overlap": False,
                                   "grad_accumulation_fusion": False, "training": training,
                                   "prediction": None})
