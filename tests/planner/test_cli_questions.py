"""Questions and answers through the CLI (typer's CliRunner): the pin options under one list
rule, plans in notation (parsed back from Plan.summary()), compare, whatif over machines, the
answers' formats (ms, TFLOP/s/GPU, ties, counts, the legend, YAML) and the plots."""

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

import plans
from planner.cli import app
from planner.report import TIE_TOLERANCE, format_count, ms_column
from planner.search import search, split_stages
from plans import Plan
from plans.notation import parse, plan_from_notation

runner = CliRunner(env={"COLUMNS": "250"})
TINY = ["tiny-moe", "h200", "--gpus", "4", "--global-batch", "8", "--seq-len", "256"]
JOB = ["--model", "tiny-moe", "--cluster", "h200", "--gpus", "4", "--global-batch", "8",
       "--seq-len", "256"]


def run(*args):
    return runner.invoke(app, list(args))


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    for w in words:
        assert w in lines[0], lines[0]


def searched(*args) -> dict:
    result = run("search", *TINY, "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


# ---- the notation ---------------------------------------------------------------------------


@pytest.mark.parametrize("model,gpus,precision", [("tiny-moe", 4, "bf16"),
                                                  ("tiny-moe-shared", 8, "fp8"),
                                                  ("tiny-moe", 2, "bf16")])
def test_notation_round_trips_every_searched_plan(model, gpus, precision):
    m = plans.catalog.load_model(model)
    c = plans.catalog.load_cluster("h200", gpus=gpus)
    t = plans.TrainingSpec(global_batch=16, seq_len=256, precision=precision)
    result = search(m, c, t, top=8)
    for r in [*result.top, result.baseline]:
        plan = r.plan.model_copy(update={"prediction": None})
        again = split_stages(plan_from_notation(plan.summary(), m, c, t))
        assert again == plan, plan.summary()


def test_notation_round_trips_the_fields_the_search_leaves_at_their_defaults():
    m = plans.catalog.load_model("tiny-moe")
    c = plans.catalog.load_cluster("h200", gpus=8)
    t = plans.TrainingSpec(global_batch=16, seq_len=256)
    for text in ("pp2 vpp2 dp2 cp2 ep2 ag+rs cf1.5 mbs2 i1f1b ov:none rc:full sync:fp32 "
                 "sync-after-bwd no-gaf ce:chunked k:fused os:none",
                 "pp1 dp4 tp2 etp2 mbs1 1f1b ov:inter rc:none sync:bf16"):
        plan = plan_from_notation(text, m, c, t)
        assert plan.summary() == text
        assert plan_from_notation(plan.summary(), m, c, t) == plan


def test_notation_defaults_and_any_order():
    m = plans.catalog.load_model("tiny-moe")
    c = plans.catalog.load_cluster("h200", gpus=8)
    t = plans.TrainingSpec(global_batch=16, seq_len=256)
    plan = plan_from_notation("mbs2 ep4 pp2 vpp2 a2a", m, c, t)
    # dp from the GPUs left, interleaved for vpp > 1, the Plan's defaults for the rest
    assert (plan.degrees.dp, plan.degrees.sp, plan.schedule.value) == (4, 1, "interleaved_1f1b")
    assert plan.stage_layers == (1, 1, 1, 1)
    assert plan.summary() == ("pp2 vpp2 dp4 sp1 ep4 a2a mbs2 i1f1b ov:inter+intra rc:sel "
                              "sync:bf16")
    assert parse("rc:selective ov:inter_op").options  # enum values read as well as tags


@pytest.mark.parametrize("text,words", [
    ("pp2 dp2 foo", ["unknown token 'foo'"]),
    ("pp2 pp4", ["'pp4'", "pp given twice"]),
    ("sp2 tp2", ["'tp2' beside 'sp2'", "one attention degree"]),
    ("ep2 etp2", ["one FFN degree"]),
    ("etp2 a2a", ["'a2a' goes with epN"]),
    ("pp0", ["'pp0'", "1 or more"]),
    ("", ["empty plan notation"]),
    ("pp2 sp2 ep3", ["ep x etp"]),
    ("pp3", ["dp:", "divide the 4 GPUs"]),
])
def test_bad_notation_is_one_line(text, words):
    one_line_error(run("explain", text, *JOB), *words)


def test_explain_takes_notation_and_a_plan_file_takes_no_job(tmp_path):
    result = run("explain", "pp2 dp1 sp2 ep2 a2a mbs1", *JOB)
    assert result.exit_code == 0, result.output
    assert "plan: pp2 dp1 sp2 ep2 a2a mbs1 1f1b ov:inter+intra rc:sel sync:bf16" in result.output
    doc = json.loads(run("explain", "pp2 sp2 ep2", *JOB, "--json").output)
    assert doc["plan"]["notation"].startswith("pp2 dp1 sp2 ep2 a2a mbs1")
    one_line_error(run("explain", "pp2 sp2"), "--model", "needs --model, --cluster and --gpus")
    out = tmp_path / "p.json"
    out.write_text(Plan.model_validate(doc["plan"]["plan"]).model_dump_json())
    one_line_error(run("explain", str(out), "--model", "tiny-moe"), "--model",
                   "a plan file holds its job")
    checked = run("validate", "pp2 sp2 ep2 mbs1", *JOB)
    assert checked.exit_code == 0 and checked.output.startswith("ok: pp2 dp1 sp2 ep2")


def test_export_takes_notation_for_megatron_and_refuses_it_for_a_node_script(tmp_path):
    result = run("export", "pp2 sp2 ep2 a2a mbs1 ov:none", *JOB, "--to", "megatron")
    assert result.exit_code == 0, result.output
    header = next(ln for ln in result.output.splitlines() if ln.startswith("# moeplan export"))
    assert header.startswith("# moeplan export: pp2 dp1 sp2 ep2 a2a mbs1")
    assert "t:megatron" in header  # the header's prediction: the plan as Megatron runs it
    one_line_error(run("export", "pp2 sp2 ep2 mbs1", *JOB, "--to", "torchrun"),
                   "--to torchrun", "plan file")
    one_line_error(run("export", "pp2 sp2 ep2 mbs1", "--to", "megatron"), "--model")
    doc = json.loads(run("explain", "pp2 sp2 ep2 mbs1", *JOB, "--json").output)
    out = tmp_path / "p.json"
    out.write_text(Plan.model_validate(doc["plan"]["plan"]).model_dump_json())
    one_line_error(run("export", str(out), "--cluster", "h200", "--to", "torchrun"),
                   "--cluster", "a plan file holds its cluster")
    assert run("export", str(out), "--to", "torchrun").exit_code == 0


# ---- pins -----------------------------------------------------------------------------------


def test_pins_restrict_the_search():
    doc = searched("--tp", "2", "--mbs", "2,4", "--recompute", "sel")
    for r in doc["top"]:
        plan = Plan.model_validate(r["plan"])
        assert plan.degrees.tp == 2 and plan.micro_batch_size in (2, 4)
        assert plan.recompute.value == "selective"
    assert doc["job"]["pins"] == "--tp 2 --mbs 2,4 --recompute selective"
    # the list rule: repeated flags are the same list as comma-separated values
    assert searched("--mbs", "2", "--mbs", "4", "--ep", "1,2")["top"] == \
        searched("--mbs", "2,4", "--ep", "2", "--ep", "1")["top"]


def test_pins_reach_every_axis_and_option():
    doc = searched("--pp", "2", "--vpp", "2", "--ep", "2", "--dispatch", "ag+rs",
                   "--overlap", "none", "--grad-sync", "fp32", "--optimizer-sharding", "none",
                   "--top", "2")
    for r in doc["top"]:
        plan = Plan.model_validate(r["plan"])
        assert (plan.degrees.pp, plan.degrees.vpp, plan.degrees.ep) == (2, 2, 2)
        assert plan.ffn.dispatch.value == "allgather_reduce_scatter"
        assert (plan.overlap.value, plan.grad_sync_precision.value) == ("none", "fp32")
        assert plan.optimizer_sharding.value == "none" and "os:none" in r["notation"]
    cp = searched("--cp", "2", "--top", "1")["top"][0]["plan"]
    assert cp["attention"]["kind"] == "cp" and cp["degrees"]["cp"] == 2
    etp = searched("--etp", "2", "--sp", "1", "--top", "1")["top"][0]["plan"]
    assert etp["ffn"]["kind"] == "tp" and etp["degrees"]["etp"] == 2


@pytest.mark.parametrize("args,words", [
    (["--tp", "x"], ["--tp: 'x' is not a whole number"]),
    (["--pp", "0"], ["--pp: '0'"]),
    (["--mbs", "2,,4"], ["--mbs: empty value"]),
    (["--ep", "2", "--ep", "2"], ["--ep: 2 given twice"]),
    (["--dispatch", "bogus"], ["--dispatch: 'bogus' is not one of", "all_to_all (a2a)"]),
    (["--recompute", "most"], ["--recompute: 'most'"]),
    (["--overlap", "all"], ["--overlap: 'all'"]),
    (["--attention", "ring"], ["--attention: 'ring'"]),
    (["--optimizer-sharding", "zero3"], ["--optimizer-sharding: 'zero3'"]),
    (["--grad-sync", "fp8"], ["--grad-sync: fp8 gradient sync needs --precision fp8"]),
    (["--ep", "16"], ["--ep: no layout of tiny-moe", "matches --ep 16"]),
    (["--vpp", "2", "--pp", "1"], ["--pp: no layout"]),
])
def test_bad_pins_are_one_line(args, words):
    one_line_error(run("search", *TINY, *args), *words)


def test_pins_on_explain_whatif_and_scale():
    explained = json.loads(run("explain", *JOB, "--tp", "2", "--json").output)
    assert explained["plan"]["plan"]["degrees"]["tp"] == 2
    one_line_error(run("explain", "pp2 sp2", *JOB, "--tp", "2"), "--tp",
                   "a PLAN states its layout")
    one_line_error(run("explain", "--tp", "2"), "--model")
    points = json.loads(run("whatif", *TINY, "--vary", "gpu_tflops=1x,2x", "--ep", "2",
                            "--json").output)["points"]
    assert all(p["best"]["plan"]["degrees"]["ep"] == 2 for p in points)
    scaled = run("scale", "tiny-moe", "h200", "--gpus", "2", "--gpus", "4", "--global-batch",
                 "8", "--seq-len", "256", "--sp", "1", "--json")
    doc = json.loads(scaled.output)
    assert doc["job"]["gpus"] == [2, 4]
    assert all(p["best"]["plan"]["degrees"]["sp"] == 1 for p in doc["points"])
    one_line_error(run("scale", "tiny-moe", "h200", "--gpus", "2,2"), "--gpus: 2 given twice")
    one_line_error(run("whatif", *TINY, "--vary", "gpu_tflops=2x", "--tp", "y"), "--tp")


# ---- compare and machines -------------------------------------------------------------------


def test_compare_plans_side_by_side(tmp_path):
    best = tmp_path / "best.yaml"
    assert run("search", *TINY, "--out", str(best)).exit_code == 0
    result = run("compare", "pp2 dp1 sp2 ep2 a2a mbs1", str(best), *JOB)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "A: pp2 dp1 sp2 ep2 a2a mbs1" in out and f"({best})" in out
    assert "B-A" in out and "TFLOP/s/GPU" in out
    why = [ln for ln in out.splitlines() if ln.startswith("B is ")]
    assert len(why) == 1 and "as fast as A" in why[0] and "most of it in" in why[0]
    doc = json.loads(run("compare", "pp2 sp2 ep2 mbs1", "pp2 sp2 ep2 ag+rs mbs1", *JOB,
                         "--json").output)
    assert doc["command"] == "compare" and [p["label"] for p in doc["plans"]] == ["A", "B"]
    a, b = (p["step_time_s"] for p in doc["plans"])
    assert doc["delta_s"]["B"]["step"] == pytest.approx(b - a)
    assert sum(v for k, v in doc["delta_s"]["B"].items() if k != "step") == pytest.approx(b - a)
    assert len(doc["why"]) == 1
    one_line_error(run("compare", str(best)), "PLAN: give two plans or more")
    one_line_error(run("compare", str(best), str(best), "--gpus", "4"), "--gpus",
                   "a plan file holds its job")
    one_line_error(run("compare", "pp2 sp2", "pp2 sp2 bad", *JOB), "unknown token 'bad'")


def test_whatif_compares_machines():
    doc = json.loads(run("whatif", "tiny-moe", "--cluster", "h100,h200", "--gpus", "4",
                         "--global-batch", "8", "--seq-len", "256", "--json").output)
    assert doc["job"]["cluster"] == ["H100-SXM", "H200-SXM"]
    assert [p["best"]["plan"]["cluster"]["gpu"]["name"] for p in doc["points"]] == \
        ["H100-SXM", "H200-SXM"]
    table = run("whatif", "tiny-moe", "--cluster", "h100", "--cluster", "h200", "--gpus", "4",
                "--global-batch", "8", "--seq-len", "256", "--vary", "gpu_tflops=1x,2x")
    assert table.exit_code == 0, table.output
    assert "h200, gpu_tflops=2x" in table.output
    one_line_error(run("whatif", *TINY, "--cluster", "h100"), "--cluster", "not both")
    one_line_error(run("whatif", "tiny-moe", "--cluster", "h100", "--gpus", "4"), "--vary")
    one_line_error(run("whatif", "tiny-moe", "--cluster", "h100,h100", "--gpus", "4"),
                   "--cluster: h100 given twice")
    one_line_error(run("whatif", "tiny-moe", "--cluster", "h100,nope", "--gpus", "4"),
                   "--cluster", "nope")


# ---- answers --------------------------------------------------------------------------------


def test_times_share_one_format_per_column():
    assert ms_column([1.304, 0.002, 0.0]) == ["1,304", "2", "0"]
    assert ms_column([0.01235, 0.00041, 0.0]) == ["12.35", "0.41", "0.00"]
    assert ms_column([0.000654, 0.00001]) == ["0.654", "0.010"]
    assert ms_column([0.002, -0.1, -1e-9], signed=True) == ["+2.0", "-100.0", "0.0"]
    assert ms_column([None, 0.5]) == ["-", "500.0"]


def test_counts_in_k_m_b_t():
    assert [format_count(n) for n in (999, 1234, 12e3, 350e6, 999.96e6, 46.7e9, 140.6e9,
                                      1.2e12)] == \
        ["999", "1.23K", "12.0K", "350M", "1.00B", "46.7B", "141B", "1.20T"]
    assert "46.7B" in run("catalog").output


def test_explain_answers_in_ms_with_rates_and_a_legend():
    out = run("explain", "pp2 sp2 ep2 mbs1", *JOB).output
    per_step = out.split("Per step")[1].split("tokens/s")[0]
    cells = [ln.split()[1] for ln in per_step.splitlines()[3:] if ln.strip()]
    assert len({len(c.split(".")[1]) if "." in c else 0 for c in cells}) == 1, cells
    assert "e-0" not in per_step
    assert "TFLOP/s/GPU" in out and "bf16 dense peak, 989 TFLOP/s" in out
    terms = out.split("Terms:")[1]
    for term in ("stragglers:", "grad_accumulation:", "pipeline_bubble:", "memory logits:",
                 "exposed_comm.ep_dispatch:"):
        assert term in terms
    assert "model: 378K parameters, 231K active per token" in out
    fp8 = run("explain", "pp2 sp2 ep2 mbs1", *JOB, "--precision", "fp8").output
    assert "for fp8 training too" in fp8 and "fp8 dense peak, 1,979 TFLOP/s" in fp8
    doc = json.loads(run("explain", "pp2 sp2 ep2 mbs1", *JOB, "--json").output)
    assert doc["plan"]["tflops_per_gpu"] == pytest.approx(doc["plan"]["mfu"] * 989)
    assert set(doc["step"]["breakdown_s"]) <= set(doc["legend"])


def test_search_marks_ties_within_the_stated_error():
    result = run("search", *TINY)
    assert result.exit_code == 0
    assert "step ms" in result.output and "TFLOP/s/GPU" in result.output
    doc = searched()
    best = doc["top"][0]["step_time_s"]
    for r in doc["top"]:
        assert r["tie_with_best"] == (r["step_time_s"] <= best * (1 + TIE_TOLERANCE))
    if any(r["tie_with_best"] for r in doc["top"][1:]):
        assert " tie" in result.output and "within 5% of #1" in result.output


def test_out_writes_yaml_for_a_yaml_name(tmp_path):
    for name in ("plan.yaml", "plan.yml", "plan.json"):
        path = tmp_path / name
        assert run("search", *TINY, "--out", str(path)).exit_code == 0
    data = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert data["degrees"] and not (tmp_path / "plan.yaml").read_text().lstrip().startswith("{")
    json.loads((tmp_path / "plan.json").read_text())
    assert plans.catalog.load_plan(tmp_path / "plan.yml") == \
        plans.catalog.load_plan(tmp_path / "plan.json")


# ---- plots ----------------------------------------------------------------------------------


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    for args in (["explain", "pp2 sp2 ep2", *JOB],
                 ["compare", "pp2 sp2 ep2", "pp1 sp4 ep2", *JOB],
                 ["search", *TINY, "--top", "2"],
                 ["whatif", *TINY, "--vary", "gpu_tflops=1x,2x", "--vary", "hbm_tb_s=1x,2x"],
                 ["scale", "tiny-moe", "h200", "--gpus", "2,4", "--global-batch", "8",
                  "--seq-len", "256"]):
        path = tmp_path / f"{args[0]}.png"
        result = run(*args, "--plot", str(path))
        assert result.exit_code == 0, result.output
        assert path.stat().st_size > 1000 and f"plot written to {path}" in result.output
    one_line_error(run("explain", "pp2 sp2", *JOB, "--plot", str(tmp_path / "x.pdf")),
                   "--plot", ".png or .svg")


def test_whatif_grid_dimensions_pick_the_plot():
    from planner.plots import _axes
    from planner.whatif import parse_vary, whatif, whatif_machines

    m = plans.catalog.load_model("tiny-moe")
    c = plans.catalog.load_cluster("h200", gpus=4)
    t = plans.TrainingSpec(global_batch=8, seq_len=256)
    grid = whatif(m, c, t, [parse_vary("gpu_tflops=1x,2x"), parse_vary("hbm_tb_s=1x,2x")])
    assert [name for name, _ in _axes(grid)] == ["gpu_tflops", "hbm_tb_s"]  # a heatmap
    machines = whatif_machines(m, [("a", c), ("b", c)], t, [parse_vary("gpu_tflops=1x,2x")])
    assert [(name, values) for name, values in _axes(machines)] == \
        [("machine", ["a", "b"]), ("gpu_tflops", ["1x", "2x"])]


def test_docs_legend_is_explains():
    from pathlib import Path

    from planner.report import legend_markdown

    docs = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    assert legend_markdown() in docs
    help_text = " ".join(run("--help").output.split())
    assert "comma-separated or the option repeated" in help_text
    assert "One value or a list: comma-separated" in " ".join(run("search", "--help")
                                                              .output.split())


def test_rows_their_target_refuses_are_marked_with_the_reason(tmp_path):
    """A model with multi-token prediction: the moeplan target's rows are priced but its
    runtime refuses them, which the table marks (`!`, the reason once) and the JSON carries
    (`refused`); Megatron-Core, which runs MTP, is not marked."""
    model = plans.catalog.load_model("deepseek-v3")
    assert model.mtp_layers > 0
    path = tmp_path / "dsv3-4l.json"
    path.write_text(model.model_copy(update={"name": "dsv3-4L", "layers": 4, "dense_layers": 1})
                    .model_dump_json())
    job = [str(path), "h800", "--gpus", "16", "--global-batch", "32", "--seq-len", "1024"]
    doc = json.loads(run("search", *job, "--json", "--top", "2").output)
    assert all(any("mtp_layers" in r for r in row["refused"]) for row in doc["top"])
    assert doc["baseline"]["refused"] == []
    text = run("search", *job, "--top", "2").output
    assert "#1!" in text and "megatron!" not in text
    assert sum("mtp_layers" in line for line in text.splitlines()) == 1, text
    # the what-if and scaling tables mark their best plans alike, the reason once
    for args in (("whatif", *job, "--vary", "network_gb_s=1x,2x"),
                 ("scale", str(path), "h800", "--gpus", "16,32", "--global-batch", "32",
                  "--seq-len", "1024")):
        text = run(*args).output
        assert re.search(r"k:\w+!", text), text
        assert sum("mtp_layers" in line for line in text.splitlines()) == 1, text
