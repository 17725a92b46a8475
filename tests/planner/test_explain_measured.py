"""`moeplan explain PLAN --measured RESULT.json`: a committed H200 step against the cost model,
per runtime component; a result of another plan is refused in one line."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cost_models import evaluate
from cost_models.components import LAYER_COMPONENTS, predicted_components
from planner.cli import app
from planner.measured import COMPONENT_ORDER, DISJOINT, STEP, compare
from plans import catalog
from plans.execution import executed_plan

ROOT = Path(__file__).parents[2]
PLANS, RUNS = ROOT / "bench/gpu_plans", ROOT / "bench/results/h200"
PAIRS = ["mixtral2l_sp2_ep2_a2a", "mixtral2l_tp2_etp2", "mixtral2l_1gpu_recompute_full",
         "mixtral4l_pp2_vpp2"]
runner = CliRunner(env={"COLUMNS": "80"})


def paths(name: str) -> tuple[Path, Path]:
    return PLANS / f"{name}.json", RUNS / f"train_step_{name}.json"


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --measured: "), result.output
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("name", PAIRS)
def test_components_are_the_measurement_and_the_executed_plans_prediction(name):
    plan_path, run_path = paths(name)
    c = compare(catalog.load_plan(plan_path), run_path)
    measured = json.loads(run_path.read_text())
    assert [r.component for r in c.rows] == [*COMPONENT_ORDER, STEP]
    ran = executed_plan(catalog.load_plan(plan_path))
    predicted = predicted_components(ran)
    for r in c.rows[:-1]:
        assert r.measured_s == measured["components_s"].get(r.component)
        assert r.predicted_s == pytest.approx(predicted[r.component])
    assert c.rows[-1].measured_s == measured["step_time_s"]
    assert c.rows[-1].predicted_s == pytest.approx(evaluate(ran).step_time_s)
    p = {r.component: r.predicted_s for r in c.rows}
    # the regions nest as the runtime's do: layer regions and the loss inside forward and
    # backward (recomputed forwards run in backward), those and the stage transfers inside
    # the schedule, the step around it all
    layers = sum(p[k] + p[f"{k}_bwd"] for k in LAYER_COMPONENTS)
    assert layers + p["loss"] <= (p["forward"] + p["backward"]) * (1 + 1e-9)
    assert p["forward"] + p["backward"] <= p["forward_backward"] * (1 + 1e-9)
    assert p["forward_backward"] + p["grad_sync"] + p["optimizer"] == pytest.approx(p[STEP])
    assert c.worst() is not None and c.worst().component in DISJOINT


def test_recomputation_counts_the_rerun_forward_again():
    """The runtime's forward regions time a recomputed forward again (runtime.metrics)."""
    plan, run = paths("mixtral2l_1gpu_recompute_full")
    full = compare(catalog.load_plan(plan), run)
    plain = compare(catalog.load_plan(paths("mixtral2l_1gpu")[0]), paths("mixtral2l_1gpu")[1])
    fwd = {r.component: r.predicted_s for r in full.rows}
    base = {r.component: r.predicted_s for r in plain.rows}
    assert fwd["expert_compute"] == pytest.approx(2 * base["expert_compute"])
    assert fwd["expert_compute_bwd"] == pytest.approx(base["expert_compute_bwd"])


def test_cli_table_fits_80_columns_and_json_matches():
    plan_path, run_path = paths("mixtral2l_sp2_ep2_a2a")
    result = runner.invoke(app, ["explain", str(plan_path), "--measured", str(run_path)])
    assert result.exit_code == 0, result.output
    table = result.output.split("Seconds per step, mean over ranks\n", 1)[1].splitlines()
    rows = table[: table.index(next(ln for ln in table if ln.startswith("error =")))]
    assert len(rows) == 2 + len(COMPONENT_ORDER) + 1 and max(map(len, rows)) <= 80
    assert "most off: " in result.output
    doc = json.loads(runner.invoke(app, ["explain", str(plan_path), "--measured", str(run_path),
                                         "--json"]).output)
    assert doc["command"] == "explain" and doc["measured"]["result"] == str(run_path)
    got = {row["component"]: row for row in doc["measured"]["components"]}
    assert set(got) == {*COMPONENT_ORDER, STEP}
    assert got[STEP]["measured_s"] == json.loads(run_path.read_text())["step_time_s"]
    # the committed GPU plans are written as the runtime runs them: nothing priced differently
    assert doc["measured"]["evaluated_as_executed"] == []


def test_a_result_of_another_plan_is_refused(tmp_path):
    plan = str(paths("mixtral2l_sp2_ep2_a2a")[0])

    def explain(result: Path):
        return runner.invoke(app, ["explain", plan, "--measured", str(result)])

    one_line_error(explain(paths("mixtral2l_1gpu")[1]), "world", "1 ranks", "plan 2")
    one_line_error(explain(paths("mixtral2l_sp2_ep2_ag")[1]), "plan_summary", "ag+rs", "a2a")
    one_line_error(explain(paths("mixtral2l_tp2_ep2")[1]), "plan_summary", "tp2")
    doc = json.loads(paths("mixtral2l_sp2_ep2_a2a")[1].read_text())
    other_model = tmp_path / "other_model.json"
    other_model.write_text(json.dumps({**doc, "flops_per_token": 2 * doc["flops_per_token"]}))
    one_line_error(explain(other_model), "flops_per_token", "another model")
    other_batch = tmp_path / "other_batch.json"
    other_batch.write_text(json.dumps({**doc, "tokens_per_step": 2 * doc["tokens_per_step"]}))
    one_line_error(explain(other_batch), "tokens_per_step")


def test_a_file_that_is_not_a_result_is_refused(tmp_path):
    plan = str(paths("mixtral2l_sp2_ep2_a2a")[0])
    one_line_error(runner.invoke(app, ["explain", plan, "--measured", plan]),
                   "bench/steps/train_step.py")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    one_line_error(runner.invoke(app, ["explain", plan, "--measured", str(garbage)]))
    one_line_error(runner.invoke(app, ["explain", plan, "--measured", str(tmp_path / "none")]))
    no_components = tmp_path / "old.json"
    doc = json.loads(paths("mixtral2l_sp2_ep2_a2a")[1].read_text())
    no_components.write_text(json.dumps({**doc, "components_s": {}}))
    one_line_error(runner.invoke(app, ["explain", plan, "--measured", str(no_components)]),
                   "components_s")


def test_cluster_prices_the_plan_on_a_calibrated_spec_and_a_bad_one_is_one_line():
    """--cluster h200-runtime: the run held against the cluster it was measured on, the plan's
    GPU count kept; an unknown cluster is refused in one line."""
    plan_path, run_path = paths("mixtral2l_sp2_ep2_a2a")
    plan = catalog.load_plan(plan_path)
    calibrated = catalog.load_cluster("h200-runtime", gpus=plan.cluster.gpus)
    expected = evaluate(executed_plan(plan.model_copy(update={"cluster": calibrated})))
    assert expected.step_time_s != pytest.approx(evaluate(executed_plan(plan)).step_time_s)
    doc = json.loads(runner.invoke(app, ["explain", str(plan_path), "--measured", str(run_path),
                                         "--cluster", "h200-runtime", "--json"]).output)
    step = next(r for r in doc["measured"]["components"] if r["component"] == STEP)
    assert step["predicted_s"] == pytest.approx(expected.step_time_s)
    assert doc["job"]["cluster"] == calibrated.name and doc["job"]["gpus"] == plan.cluster.gpus
    bad = runner.invoke(app, ["explain", str(plan_path), "--cluster", "nope"])
    assert bad.exit_code == 2
    lines = [ln for ln in bad.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope" in lines[0]
