"""The CLI through typer's CliRunner: outputs, files, and bad input (exit 2, one line)."""

import json

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans import Plan

runner = CliRunner(env={"COLUMNS": "250"})
SMALL = ["mixtral-8x7b", "h100", "--gpus", "16", "--global-batch", "32", "--seq-len", "4096"]


def run(*args):
    return runner.invoke(app, list(args))


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def small_search():
    result = run("search", *SMALL, "--json", "--top", "3")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_catalog_lists_everything():
    result = run("catalog")
    assert result.exit_code == 0
    for name in ("internal-352b", "mixtral-8x7b", "qwen3-235b-a22b", "h800", "gb200-nvl72"):
        assert name in result.output
    doc = json.loads(run("catalog", "--json").output)
    assert doc["models"]["tiny-moe"]["experts"] == 4
    assert (doc["command"], doc["job"], doc["schema_version"]) == ("catalog", None, 1)


def test_schema_is_json_schema():
    doc = json.loads(run("schema").output)
    assert doc["title"] == "Plan" and "degrees" in doc["properties"]


def test_search_json_document(small_search):
    doc = small_search
    assert set(doc) >= {"schema_version", "moeplan_version", "command", "job", "top",
                        "baseline", "search"}
    assert doc["command"] == "search" and doc["schema_version"] == 1
    assert doc["job"] == {"model": "Mixtral-8x7B", "cluster": "H100-SXM", "gpus": 16,
                          "global_batch": 32, "seq_len": 4096, "precision": "bf16"}
    best = Plan.model_validate(doc["top"][0]["plan"])
    assert doc["top"][0]["notation"] == best.summary()
    assert doc["top"][0]["step_time_s"] == best.prediction.step_time_s
    assert doc["top"][0]["peak_memory_gib"] <= doc["top"][0]["usable_memory_gib"]
    pred = best.prediction
    assert pred is not None and pred.step_time_s > 0 and 0 < pred.mfu < 1
    assert pred.tokens_per_s == pytest.approx(32 * 4096 / pred.step_time_s)
    assert pred.breakdown_s and pred.peak_memory_gib > 0
    assert len(doc["top"]) == 3
    steps = [t["step_time_s"] for t in doc["top"]]
    assert steps == sorted(steps)
    base = Plan.model_validate(doc["baseline"]["plan"])
    assert base.target == "megatron" and doc["baseline"]["target"] == "megatron"
    assert doc["baseline_kind"] == "Megatron-Core (searched)"
    assert doc["speedup"] == pytest.approx(base.prediction.step_time_s / pred.step_time_s)
    ref = Plan.model_validate(doc["reference"]["plan"])
    assert ref.attention.kind == "tp" and ref.ffn.kind == "tp"
    assert doc["reference_speedup"] == pytest.approx(
        ref.prediction.step_time_s / pred.step_time_s)
    assert doc["search"]["candidates"] >= doc["search"]["feasible"] > 0
    assert doc["search"]["seconds"] > 0


def test_search_is_deterministic(small_search):
    again = json.loads(run("search", *SMALL, "--json", "--top", "3").output)
    assert again["top"] == small_search["top"]


def test_search_table_and_out_file(tmp_path):
    out = tmp_path / "plan.json"
    result = run("search", *SMALL, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "megatron" in result.output and "speedup" in result.output
    plan = Plan.model_validate_json(out.read_text())
    assert plan.cluster.gpus == 16
    # an existing file is never replaced silently
    before = out.read_text()
    one_line_error(run("search", *SMALL, "--out", str(out)), "--out", "exists", "--force")
    assert out.read_text() == before
    assert run("search", *SMALL, "--out", str(out), "--force").exit_code == 0


def test_explain_and_validate_a_written_plan(tmp_path):
    out = tmp_path / "plan.json"
    assert run("search", *SMALL, "--out", str(out)).exit_code == 0
    result = run("validate", str(out))
    assert result.exit_code == 0 and result.output.startswith("ok: ")
    result = run("explain", str(out))
    assert result.exit_code == 0
    assert "critical path" in result.output and "peak" in result.output
    doc = json.loads(run("explain", str(out), "--json").output)
    assert doc["command"] == "explain" and doc["plan"]["label"] == "plan"
    assert doc["plan"]["step_time_s"] == pytest.approx(sum(doc["step"]["breakdown_s"].values()))


def test_explain_layer_parts_add_up_with_recomputation(tmp_path):
    """forward + backward = compute + recompute + exposed communication (the recomputed
    operators were shown nowhere)."""
    out = tmp_path / "plan.json"
    assert run("search", *SMALL, "--recompute", "full", "--out", str(out)).exit_code == 0
    layer = json.loads(run("explain", str(out), "--json").output)["layer"]
    assert layer["recompute_s"] > 0
    assert layer["forward_s"] + layer["backward_s"] == pytest.approx(
        layer["compute_s"] + layer["recompute_s"] + sum(layer["exposed_comm_s"].values()))
    assert "recompute (reruns in bwd)" in run("explain", str(out)).output


@pytest.mark.parametrize(
    "args,words",
    [
        (["search", "mixtral", "h100", "--gpus", "8"], ["model", "unknown name 'mixtral'"]),
        (["search", "mixtral-8x7b", "h999", "--gpus", "8"], ["cluster", "unknown name 'h999'"]),
        (["search", "mixtral-8x7b", "h100", "--gpus", "12"], ["--gpus", "multiple of"]),
        (["search", "mixtral-8x7b", "h100", "--gpus", "8", "--precision", "fp32"],
         ["--precision", "'fp32' is not one of 'bf16', 'fp8'"]),
        (["search", "mixtral8x7b", "h100", "--gpus", "8"], ["did you mean 'mixtral-8x7b'?"]),
        (["search", "mixtral-8x7b", "h10", "--gpus", "8"], ["did you mean 'h100'?"]),
        (["search", "mixtral-8x22b", "h100", "--gpus", "1", "--global-batch", "8"],
         ["--gpus", "no plan"]),
    ],
)
def test_bad_search_input(args, words):
    one_line_error(run(*args), *words)


def test_bad_plan_files(tmp_path):
    missing = tmp_path / "none.json"
    one_line_error(run("validate", str(missing)), "cannot read")
    truncated = tmp_path / "cut.json"
    truncated.write_text('{"schema_version": 1, "model": {')
    one_line_error(run("validate", str(truncated)), "not valid json")
    good = tmp_path / "plan.json"
    assert run("search", *SMALL, "--out", str(good)).exit_code == 0
    data = json.loads(good.read_text())
    data["schema_version"] = 7
    other = tmp_path / "v7.json"
    other.write_text(json.dumps(data))
    one_line_error(run("explain", str(other)), "schema_version", "7")
    data = json.loads(good.read_text())
    data["degrees"]["dp"] *= 2
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(data))
    one_line_error(run("validate", str(wrong)), "must equal cluster.gpus (16)")


def test_plan_that_does_not_fit_is_refused(tmp_path):
    good = tmp_path / "plan.json"
    assert run("search", *SMALL, "--out", str(good)).exit_code == 0
    data = json.loads(good.read_text())
    data["cluster"]["gpu"]["hbm_gib"] = 1
    small = tmp_path / "small.json"
    small.write_text(json.dumps(data))
    one_line_error(run("validate", str(small)), "does not fit")


def test_runnable_search_emits_plans_the_runtime_runs_as_written(tmp_path):
    from plans.execution import deviations

    out = tmp_path / "p.json"
    result = run("search", *SMALL, "--runnable", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    best = Plan.model_validate_json(out.read_text())
    assert deviations(best) == []
    baseline = Plan.model_validate(doc["baseline"]["plan"])
    assert deviations(baseline) == []
    # the unrestricted search is no slower on paper (fp8 GEMMs and tile-fused overlap, which
    # the runtime runs otherwise, only when asked for)
    free = json.loads(run("search", *SMALL, "--json").output)
    assert free["top"][0]["step_time_s"] <= best.prediction.step_time_s


@pytest.mark.parametrize("extra, words", [
    (["--overlap", "inter_intra_op"], ["--overlap", "runtime"]),
    (["--attention", "cp"], ["--attention", "cp"]),
    (["--precision", "fp8"], ["--precision", "bf16"]),
])
def test_runnable_search_refuses_what_the_runtime_cannot_run(extra, words, tmp_path):
    out = tmp_path / "p.json"
    one_line_error(run("search", *SMALL, "--runnable", *extra, "--out", str(out)), *words)
    assert not out.exists()


def test_validate_says_how_the_runtime_would_run_the_plan(tmp_path):
    out = tmp_path / "p.json"
    assert run("search", *SMALL, "--overlap", "inter_intra_op", "--out", str(out)).exit_code == 0
    result = run("validate", str(out))
    assert result.exit_code == 0, result.output
    assert "moeplan train runs it with overlap inter_op" in result.output
    runnable = tmp_path / "r.json"
    assert run("search", *SMALL, "--runnable", "--json", "--out", str(runnable)).exit_code == 0
    assert "moeplan train runs it" not in run("validate", str(runnable)).output


def test_export_refuses_with_one_line_and_warns_on_infeasible_plans(small_search, tmp_path):
    doc = small_search["top"][0]["plan"]
    fp8 = {**doc, "training": {**doc["training"], "precision": "fp8"},
           "grad_sync_precision": "fp8"}
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(fp8))
    one_line_error(run("export", str(path), "--to", "megatron"), "--to megatron",
                   "fp8 gradient sync")
    assert run("export", str(path), "--to", "torchrun").exit_code == 0
    small_gpu = {**doc, "cluster": {**doc["cluster"], "gpu": {**doc["cluster"]["gpu"],
                                                              "hbm_gib": 1}}}
    path.write_text(json.dumps(small_gpu))
    result = CliRunner().invoke(app, ["export", str(path), "--to", "megatron"])
    assert result.exit_code == 0
    assert "warning:" in result.stderr and "does not fit" in result.stderr
    assert "MEGATRON_ARGS=(" in result.stdout


def test_validate_says_the_runtime_refuses_a_cp_plan(tmp_path):
    out = tmp_path / "cp.json"
    assert run("search", *SMALL, "--attention", "cp", "--json", "--out", str(out)).exit_code == 0
    result = run("validate", str(out))
    assert result.exit_code == 0, result.output
    assert "moeplan train refuses it: attention.kind: cp " in result.output


def test_tile_fused_rows_say_no_runtime_executes_them():
    result = run("search", *SMALL, "--overlap", "inter_intra_op", "--top", "2")
    assert result.exit_code == 0, result.output
    assert "#1*" in result.output and "no runtime executes tile-fused overlap" in result.output
    assert "no runtime executes" not in run("search", *SMALL, "--top", "2").output


def test_a_megatron_target_search_and_its_plans_across_commands(tmp_path):
    out = tmp_path / "m.json"
    result = run("search", *SMALL, "--target", "megatron", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert {t["target"] for t in doc["top"]} == {"megatron"}
    plan = Plan.model_validate_json(out.read_text())
    assert plan.target == "megatron" and "t:megatron" in plan.summary()
    checked = run("validate", str(out))
    assert checked.exit_code == 0 and "Megatron-Core runs it" in checked.output
    assert run("explain", str(out)).exit_code == 0
    assert "MEGATRON_ARGS=(" in run("export", str(out), "--to", "megatron").output
    one_line_error(run("export", str(out), "--to", "torchrun"), "target", "megatron",
                   "--to megatron")
    # a field Megatron-Core cannot run: one line naming the field, the target and the reason
    data = json.loads(out.read_text())
    data["overlap"], data["prediction"] = "inter_intra_op", None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    for command in ("explain", "validate"):
        one_line_error(run(command, str(bad)), "overlap: inter_intra_op", "target megatron",
                       "tile-level")
    one_line_error(run("search", *SMALL, "--target", "megatron", "--precision", "fp8",
                       "--overlap", "inter_intra_op"), "--overlap", "Megatron-Core")


def test_a_moeplan_plan_exported_to_megatron_is_priced_anew(tmp_path):
    out = tmp_path / "p.json"
    assert run("search", *SMALL, "--runnable", "--out", str(out)).exit_code == 0
    result = CliRunner().invoke(app, ["export", str(out), "--to", "megatron"])
    assert result.exit_code == 0, result.output
    assert "priced anew as a megatron plan: predicted step" in result.stderr
    assert "MEGATRON_ARGS=(" in result.stdout


def test_an_unknown_target_is_one_line():
    one_line_error(run("search", *SMALL, "--target", "deepspeed"), "--target", "deepspeed")


def test_search_under_a_memory_cap_says_so_and_refuses_a_bad_one():
    """--memory-cap GIB: the job line names the cap, every plan's peak stays under it; a cap
    that is not positive is one line naming the option, exit 2."""
    ok = run("search", *SMALL, "--memory-cap", "60", "--top", "1")
    assert ok.exit_code == 0, ok.output
    assert "at most 60 GiB per GPU" in ok.output.splitlines()[0]
    assert "/60.0" in ok.output
    one_line_error(run("search", *SMALL, "--memory-cap", "0"), "--memory-cap")
    # a cap no plan fits under is named as the reason, not the GPU count
    one_line_error(run("search", *SMALL, "--memory-cap", "0.5"), "--memory-cap",
                   "under 0.5 GiB")
