"""Plans `search` emits never fail at launch: every one passes the runtime's own checks, and a
sample trains for real on this CPU: `runtime.train`'s main on the session's warm gloo ranks
(tests/conftest.py; launching it under torchrun is tested in tests/runtime/test_faults.py and
test_signals.py)."""

from __future__ import annotations

import json
import random

import pytest

from plans import Plan
from plans.enums import Target
from plans.execution import Backend
from runtime.parallel.parallelize import check_supported

from .conftest import run

rng = random.Random(7)
JOBS = [
    (rng.choice(["tiny-moe", "tiny-moe-shared"]), rng.choice(["h100", "h200"]),
     rng.choice([2, 4, 8]), rng.choice([8, 16, 32]), rng.choice([64, 128, 256]))
    for _ in range(5)
]


def emitted(model, cluster, gpus, batch, seq, *extra: str) -> list[Plan]:
    result = run("search", model, cluster, "--gpus", gpus, "--global-batch", batch,
                 "--seq-len", seq, "--top", "5", "--json", *extra)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    return [Plan.model_validate(p["plan"])
            for p in doc["top"] + [doc["baseline"], doc["reference"]] if p]


@pytest.mark.parametrize("job", JOBS)
def test_every_emitted_plan_passes_the_runtime_checks(job):
    """moeplan plans pass moeplan's runtime checks; the baseline and the reference are
    Megatron-Core's plans: its column runs them, and moeplan's runtime refuses them."""
    from plans.execution import UnsupportedFeature, refusals

    for plan in emitted(*job):
        for backend in Backend:  # raises UnsupportedFeature with a field path otherwise
            if plan.target == "moeplan":
                check_supported(plan, backend)
            else:
                assert refusals(plan, target=plan.target) == []
                with pytest.raises(UnsupportedFeature, match="^target: megatron "):
                    check_supported(plan, backend)


@pytest.mark.parametrize("job,pick", [
    (("tiny-moe", "h200", 4, 8, 64), 0),          # the best plan
    (("tiny-moe-shared", "h100", 2, 8, 64), -1),  # the paper's Megatron-LM layout
])
def test_a_sample_of_emitted_plans_trains(request, tmp_path, job, pick):
    # eager kernels: ranks compiling fused ones on a CPU machine take minutes
    # (tests/runtime/test_kernels.py holds fused against eager)
    plan = emitted(*job, "--kernels", "eager")[pick]
    if pick == -1:  # a Megatron layout, trained by moeplan's runtime
        from plans.execution import as_target

        assert plan.attention.kind == "tp" and plan.ffn.kind == "tp"
        plan = as_target(plan, Target.moeplan).model_copy(update={"kernels": "eager"})
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    log = tmp_path / "log.jsonl"
    world = plan.degrees.world
    assert world in (2, 4), plan.summary()  # the session's pools
    pool = request.getfixturevalue(f"pool{world}")
    codes = pool.run("dist_workers", "train_main",
                     ["--plan", str(path), "--steps", "2", "--log-file", str(log)])
    assert codes == [0] * world, (plan.summary(), codes)
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
