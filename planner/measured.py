"""A measured training step held against the cost model, component by component
(`moeplan explain PLAN --measured RESULT.json`).

The result is a bench/steps/train_step.py document (plans.results.TrainStepResult); it must be a
run of this plan: the same ranks, model and tokens per step, and the same layout. The plan is
priced as the runtime executed it (plans.execution.executed_as_measured: what the run
recorded), in the runtime's components (cost_models.components).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from cost_models import Evaluation, evaluate
from cost_models.components import LAYER_COMPONENTS, STEP_COMPONENTS, predicted_components
from plans import Plan, SpecError
from plans.execution import Deviation, executed_as_measured, measured_deviations
from plans.notation import DISPATCH_TAGS, RECOMPUTE_TAGS
from plans.results import ProfileResult, TrainStepResult, read, recorded_deviations

COMPONENT_ORDER = (*(k for c in LAYER_COMPONENTS for k in (c, f"{c}_bwd")), *STEP_COMPONENTS)
"""Rows in the order a step runs: the layers' regions, then the step's."""
DISJOINT = frozenset((*COMPONENT_ORDER[: 2 * len(LAYER_COMPONENTS)], "loss", "pipeline_comm",
                      "grad_sync", "optimizer"))
"""Components that contain no other (forward, backward and forward_backward contain these)."""
STEP = "step"
"""The row of the whole step (measured wall time against the predicted step)."""


_DEGREE = re.compile(r"(pp|vpp|dp|sp|tp|cp|ep|etp|mbs|cf)([\d.]+)")


@dataclass(frozen=True)
class ComponentRow:
    component: str
    predicted_s: float
    measured_s: float | None
    """None when the run did not time this component."""

    @property
    def error(self) -> float | None:
        """predicted / measured - 1 (positive: the model is pessimistic); None when either
        side is zero or unmeasured."""
        if not self.measured_s or not self.predicted_s:
            return None
        return self.predicted_s / self.measured_s - 1


@dataclass(frozen=True)
class Comparison:
    executed: Plan
    """The plan as the runtime ran it."""
    evaluation: Evaluation
    """The cost model on ``executed``."""
    deviations: tuple[Deviation, ...]
    rows: tuple[ComponentRow, ...]
    """COMPONENT_ORDER, then the step."""
    result: TrainStepResult

    def worst(self) -> ComponentRow | None:
        """The component whose prediction is off by the most seconds."""
        rows = [r for r in self.rows if r.measured_s is not None and r.component in DISJOINT]
        return max(rows, key=lambda r: abs(r.predicted_s - r.measured_s), default=None)


_DISPATCH = {**{tag: tag for tag in DISPATCH_TAGS.values()},
             **{d.value: tag for d, tag in DISPATCH_TAGS.items()}}


def layout_of(summary: str) -> dict[str, str]:
    """The degrees, dispatcher and micro-batch of a plan summary (Plan.layout_notation, or the
    notation results were written in before it: `pp1 vpp1 dp1 ulysses_sp1 ep1/all_to_all`)."""
    out = {"vpp": "1"}
    for token in summary.replace("/", " ").split():
        token = token.removeprefix("ulysses_")
        if token in _DISPATCH:
            out["dispatch"] = _DISPATCH[token]
        elif (m := _DEGREE.fullmatch(token)) is not None:
            out[m.group(1)] = m.group(2)
    return out


def check_pairing(plan: Plan, r: TrainStepResult, path: Path) -> None:
    """One line naming what differs when ``r`` is not a run of ``plan``."""
    where = f"--measured: {path}"
    if r.world != plan.degrees.world:
        raise SpecError(f"{where}: world: the run had {r.world} ranks, the plan "
                        f"{plan.degrees.world}")
    flops = plan.model.flops_per_token(plan.training.seq_len)
    if r.flops_per_token is not None and not math.isclose(r.flops_per_token, flops,
                                                          rel_tol=1e-9):
        raise SpecError(f"{where}: flops_per_token: the run's model does {r.flops_per_token:.4g} "
                        f"FLOPs per token, the plan's {plan.model.name} {flops:.4g} (another "
                        "model or sequence length)")
    tokens = plan.training.tokens_per_step
    if r.tokens_per_step is not None and r.tokens_per_step != tokens:
        raise SpecError(f"{where}: tokens_per_step: the run trained {r.tokens_per_step:,} tokens "
                        f"per step, the plan {tokens:,}")
    layout = plan.layout_notation()
    if r.plan_summary and layout_of(r.plan_summary) != layout_of(layout):
        ran = r.plan_summary.split(" 1f1b ")[0].split(" i1f1b ")[0]
        raise SpecError(f"{where}: plan_summary: the run's layout is '{ran}', the plan's "
                        f"'{layout}'")
    if not r.components_s:
        raise SpecError(f"{where}: components_s: the result has no per-component times")


_RECOMPUTE = re.compile(r"(?:rc:|recompute=)([\w+]+)")


def _options_of(summary: str) -> dict[str, str]:
    """Recomputation and kernels of a plan summary (either notation: `rc:sel`, `rc:sel+act`,
    `recompute=selective`; `k:fused`, absent for eager)."""
    m = _RECOMPUTE.search(summary)
    tags = {tag: policy.value for policy, tag in RECOMPUTE_TAGS.items()}
    rc = tags.get(m.group(1), m.group(1)) if m else "none"
    return {"recompute": rc, "kernels": "fused" if "k:fused" in summary.split() else "eager"}


def check_profile_pairing(plan: Plan, profile: ProfileResult, path: Path, what: str,
                          plan_option: str) -> None:
    """One line naming what differs when the profile at ``path`` is not a run of ``plan``: its
    model (recorded since profiles name it; before, read from the plan file it names where that
    file is here), its layout, recomputation and kernels (its ``plan_summary``)."""
    where = f"{what}: {path}"
    model = profile.model
    if not model and profile.plan and Path(profile.plan).is_file():
        from plans import catalog

        try:
            model = catalog.load_plan(profile.plan).model.name
        except SpecError:
            model = ""
    if model and model != plan.model.name:
        raise SpecError(f"{where}: model: the profile ran {model}, {plan_option} is a plan of "
                        f"{plan.model.name}")
    if not profile.plan_summary:
        return
    ran, planned = layout_of(profile.plan_summary), layout_of(plan.layout_notation())
    ran_opts, planned_opts = _options_of(profile.plan_summary), _options_of(plan.summary())
    for key, value in {**planned, **planned_opts}.items():
        got = {**ran, **ran_opts}.get(key)
        if got is not None and got != value:
            raise SpecError(f"{where}: plan_summary: the profile ran {key} {got}, {plan_option}"
                            f" has {value} ({profile.plan_summary!r} against "
                            f"{plan.summary()!r})")


def compare(plan: Plan, path: Path) -> Comparison:
    """Read ``path`` (a bench/steps/train_step.py result of ``plan``) and price its components."""
    r = read(TrainStepResult, path, "--measured")
    check_pairing(plan, r, path)
    recorded = recorded_deviations(r)
    ran = executed_as_measured(plan, recorded)
    e = evaluate(ran)
    predicted = predicted_components(ran, e)
    rows = [ComponentRow(k, predicted[k], r.components_s.get(k)) for k in COMPONENT_ORDER]
    rows.append(ComponentRow(STEP, e.step_time_s, r.step_time_s))
    return Comparison(ran, e, tuple(measured_deviations(plan, recorded)), tuple(rows), r)
