"""Every plan `search` emits (the top 3 and the Megatron-style baseline) passes `validate`, for
randomly drawn small jobs of the tiny catalog models."""

from __future__ import annotations

import json
import random

import pytest

from plans import Plan

from .conftest import run

rng = random.Random(20240607)
JOBS = [
    (rng.choice(["tiny-moe", "tiny-moe-shared"]), rng.choice(["h100", "h200"]),
     rng.choice([1, 2, 4, 8]), rng.choice([4, 8, 16, 32]), rng.choice([64, 128, 256, 512]),
     rng.choice(["bf16", "fp8"]))
    for _ in range(6)
]


@pytest.mark.parametrize("model,cluster,gpus,batch,seq,precision", JOBS)
def test_emitted_plans_validate(tmp_path, model, cluster, gpus, batch, seq, precision):
    result = run("search", model, cluster, "--gpus", gpus, "--global-batch", batch,
                 "--seq-len", seq, "--precision", precision, "--top", "3", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    plans = [r["plan"] for r in doc["top"]] + ([doc["baseline"]["plan"]] if doc["baseline"]
                                               else [])
    assert doc["top"] and doc["top"][0]["label"] == "#1"
    for i, plan in enumerate(plans):
        parsed = Plan.model_validate(plan)
        assert (parsed.cluster.gpus, parsed.training.global_batch) == (gpus, batch)
        path = tmp_path / f"plan{i}.json"
        path.write_text(json.dumps(plan))
        checked = run("validate", path)
        assert checked.exit_code == 0, (parsed.summary(), checked.output)
        assert checked.output.startswith(f"ok: {parsed.summary()}")
        assert "differs" not in checked.output  # the stored prediction is this cost model's
