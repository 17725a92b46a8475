"""Every command with bad input: exit 2, one line `error: <field>: <reason>`, no traceback, and
nothing written (an `--out` or `--plot` target neither created nor changed)."""

from __future__ import annotations

import json
import subprocess

import pytest

from plans import catalog

from .conftest import TINY_JOB, assert_one_line_error, run, snapshot

JOB_OPTS = TINY_JOB[2:]  # --gpus 8 --global-batch 16 --seq-len 256


@pytest.fixture
def no_launch(monkeypatch):
    """`train` must fail before starting torchrun."""
    from planner import launch

    calls = []

    def refuse(cmd, *a, **k):
        calls.append(cmd)
        raise AssertionError(f"train launched {cmd}")

    monkeypatch.setattr(launch, "supervise", refuse)
    monkeypatch.setattr(subprocess, "call", refuse)
    return calls


@pytest.fixture
def files(tmp_path, plan_doc):
    """Bad input files of every kind, beside one good plan."""
    model = catalog.load_model("tiny-moe").model_dump(mode="json")
    cluster = catalog.load_cluster("h100").model_dump(mode="json")
    made = {}

    def put(name, content):
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        made[name] = path

    put("plan.json", json.dumps(plan_doc))
    put("truncated.json", json.dumps(plan_doc)[:200])
    put("truncated.yaml", "model: {name: x, layers: [1,\n")
    put("bytes.json", bytes(range(256)))
    put("list.yaml", "- 1\n- 2\n")
    put("empty.json", "")
    put("v2.json", json.dumps({**plan_doc, "schema_version": 2}))
    put("world.json", json.dumps({**plan_doc, "degrees": {**plan_doc["degrees"],
                                                          "dp": plan_doc["degrees"]["dp"] * 3}}))
    put("stages.json", json.dumps({**plan_doc, "stage_layers": [*plan_doc["stage_layers"], 2]}))
    put("heads.yaml", json.dumps({**model, "query_heads": 6, "kv_heads": 4}))
    put("topk.yaml", json.dumps({**model, "top_k": 5}))
    put("zero.json", json.dumps({**model, "hidden": 0}))
    put("negative.yaml", json.dumps({**model, "layers": -2}))
    put("unknown.yaml", json.dumps({**model, "moe_freq": 2}))
    put("missing.yaml", json.dumps({k: v for k, v in model.items() if k != "experts"}))
    put("wrongtype.json", json.dumps({**model, "experts": "eight"}))
    put("cluster_zero.yaml", json.dumps({**cluster, "gpu": {**cluster["gpu"], "hbm_gib": 0}}))
    put("cluster_odd.yaml", json.dumps({**cluster, "gpus": 12}))
    put("plan_as_model.json", json.dumps(plan_doc))
    return made


# ---- plan-taking commands ----------------------------------------------------------------------

PLAN_CASES = [
    ("missing", ["cannot read"]),
    ("truncated.json", ["not valid json"]),
    ("truncated.yaml", ["not valid yaml"]),
    ("bytes.json", ["not valid json", "UTF-8"]),
    ("list.yaml", ["expected a mapping", "list"]),
    ("empty.json", ["not valid json"]),
    ("v2.json", ["schema_version", "reads plans of schema_version 1", "has 2"]),
    ("world.json", ["degrees", "must equal cluster.gpus (8)"]),
    ("stages.json", ["stage_layers"]),
    ("heads.yaml", ["this is a model document, not a plan"]),
    ("cluster_odd.yaml", ["this is a cluster document, not a plan"]),
]


@pytest.mark.parametrize("command", [["validate"], ["explain"], ["explain", "--json"],
                                     ["export", "--to", "megatron"],
                                     ["export", "--to", "torchrun"], ["export", "--to", "slurm"],
                                     ["train", "--steps", "1"]])
@pytest.mark.parametrize("name,words", PLAN_CASES)
def test_bad_plan_file(command, name, words, files, tmp_path, no_launch):
    path = files.get(name, tmp_path / "nonexistent.json")
    before = snapshot(tmp_path)
    line = assert_one_line_error(run(command[0], path, *command[1:]), *words)
    assert str(path) in line  # the file is named
    assert snapshot(tmp_path) == before
    assert no_launch == []


def test_good_plan_passes_every_plan_command(files, no_launch):
    plan = files["plan.json"]
    assert run("validate", plan).output.startswith("ok: ")
    assert run("explain", plan).exit_code == 0
    for target in ("megatron", "torchrun", "slurm"):
        assert run("export", plan, "--to", target).exit_code == 0


@pytest.mark.parametrize("args,words", [
    (["export", "{plan}", "--to", "deepspeed"], ["--to", "deepspeed"]),
    (["export", "{plan}"], ["--to", "required"]),
    (["export", "{plan}", "--to", "slurm", "--steps", "0"], ["--steps"]),
    (["train", "{plan}", "--nproc-per-node", "3"], ["--nproc-per-node", "world size is 8"]),
    (["train", "{plan}", "--steps", "-1"], ["--steps"]),
    (["train", "{plan}", "--steps", "many"], ["--steps", "integer"]),
    (["train", "{plan}", "--data", "{tmp}/none.u32"], ["--data", "No such file"]),
    (["train", "{plan}", "--resume"], ["--resume", "--ckpt-dir"]),
    (["validate"], ["plan", "missing"]),
    (["validate", "{plan}", "{plan}"], ["unexpected extra argument"]),
])
def test_bad_plan_command_options(args, words, files, tmp_path, no_launch):
    argv = [a.format(plan=files["plan.json"], tmp=tmp_path) for a in args]
    before = snapshot(tmp_path)
    assert_one_line_error(run(*argv), *words)
    assert snapshot(tmp_path) == before
    assert no_launch == []


# ---- spec-taking commands: search, whatif, scale ----------------------------------------------

SPEC_CASES = [
    (["tiny-mo", "h100"], ["model: unknown name 'tiny-mo'", "tiny-moe"]),
    (["tiny-moe", "h1000"], ["cluster: unknown name 'h1000'", "h100"]),
    (["{heads.yaml}", "h100"], ["{heads.yaml}", "query_heads (6) must be a multiple of kv_heads"]),
    (["{topk.yaml}", "h100"], ["{topk.yaml}", "top_k (5) must be <= experts (4)"]),
    (["{zero.json}", "h100"], ["{zero.json}: hidden:", "greater than 0"]),
    (["{negative.yaml}", "h100"], ["{negative.yaml}: layers:", "greater than 0"]),
    (["{unknown.yaml}", "h100"], ["{unknown.yaml}: moe_freq: unknown field"]),
    (["{missing.yaml}", "h100"], ["{missing.yaml}: experts: required field is missing"]),
    (["{wrongtype.json}", "h100"], ["{wrongtype.json}: experts:", "integer"]),
    (["{truncated.yaml}", "h100"], ["{truncated.yaml}: not valid yaml"]),
    (["{bytes.json}", "h100"], ["{bytes.json}: not valid json"]),
    (["{plan_as_model.json}", "h100"],
     ["{plan_as_model.json}: this is a plan document, not a model"]),
    (["tiny-moe", "{plan_as_model.json}"],
     ["{plan_as_model.json}: this is a plan document, not a cluster"]),
    (["tiny-moe", "{cluster_zero.yaml}"], ["{cluster_zero.yaml}: gpu.hbm_gib:"]),
    (["tiny-moe", "{truncated.json}"], ["{truncated.json}: not valid json"]),
]


def _fill(items, files):
    """Replace `{name}` by the path of the file of that name."""
    out = []
    for a in items:
        for name, path in files.items():
            a = a.replace("{" + name + "}", str(path))
        out.append(a)
    return out


@pytest.mark.parametrize("command", ["search", "whatif", "scale"])
@pytest.mark.parametrize("specs,words", SPEC_CASES)
def test_bad_specs(command, specs, words, files, tmp_path):
    argv = [command, *_fill(specs, files)]
    if command == "scale":
        argv += ["--gpus", "1,8", "--global-batch", "16", "--seq-len", "256"]
    else:
        argv += JOB_OPTS
    if command == "whatif":
        argv += ["--vary", "hbm_gib=2x", "--plot", str(tmp_path / "p.png")]
    if command == "search":
        argv += ["--out", str(tmp_path / "best.json")]
    before = snapshot(tmp_path)
    assert_one_line_error(run(*argv), *_fill(words, files))
    assert snapshot(tmp_path) == before  # no --out / --plot file


JOB_CASES = [
    (["--gpus", "0"], ["--gpus:", "greater than or equal to 1"]),
    (["--gpus", "-8"], ["--gpus:"]),
    (["--gpus", "eight"], ["--gpus:", "integer"]),
    (["--gpus", "12"], ["--gpus:", "multiple of node.gpus_per_node (8)"]),
    (["--gpus", "4096"], ["--gpus: no plan of tiny-moe fits 4096"]),
    (["--gpus", "8", "--global-batch", "0"], ["--global-batch:"]),
    (["--gpus", "8", "--seq-len", "-256"], ["--seq-len:"]),
    (["--gpus", "8", "--precision", "fp32"], ["--precision:", "'fp32' is not one of"]),
    (["--gpus", "8", "--precision", "int4"], ["--precision:", "int4"]),
]


@pytest.mark.parametrize("options,words", JOB_CASES)
def test_bad_search_numbers_write_nothing(options, words, tmp_path):
    out = tmp_path / "best.json"
    assert_one_line_error(run("search", "tiny-moe", "h100", "--global-batch", "16",
                              "--seq-len", "256", *options, "--out", out), *words)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_existing_out_file_is_kept_on_failure(tmp_path):
    out = tmp_path / "best.json"
    out.write_text("mine\n")
    # failing search, even with --force: unchanged
    assert_one_line_error(run("search", "tiny-moe", "h100", "--gpus", "12", "--out", out,
                              "--force"), "--gpus")
    # a search that would succeed but may not replace it without --force
    assert_one_line_error(run("search", *TINY_JOB, "--out", out), "--out", "exists", "--force")
    assert out.read_text() == "mine\n"
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]  # no temporary left


def test_search_no_plan_fits_writes_nothing(tmp_path):
    out = tmp_path / "best.json"
    result = run("search", "mixtral-8x22b", "h100", "--gpus", "1", "--global-batch", "8",
                 "--seq-len", "4096", "--out", out)
    assert_one_line_error(result, "--gpus: no plan of", "fits 1 x")
    assert not out.exists()


@pytest.mark.parametrize("vary,words", [
    ("hbm_gib", ["--vary", "KNOB=V1,V2"]),
    ("vram=2x", ["--vary: unknown knob 'vram'"]),
    ("hbm_gib=", ["--vary hbm_gib: no values"]),
    ("hbm_gib=two", ["--vary hbm_gib:", "'two' is not a number"]),
    ("hbm_gib=-1", ["--vary hbm_gib:", "positive"]),
    ("nvlink_domain=1.5", ["--vary nvlink_domain:", "whole GPU count"]),
    ("nvlink_domain=3", ["--vary nvlink_domain=3:", "multiple of node.gpus_per_node (3)"]),
    ("gpu_tflops=1e-30", ["--vary gpu_tflops=1e-30: gpu.bf16_dense_tflops:", "out of range"]),
    ("hbm_tb_s=inf", ["--vary hbm_tb_s:", "'inf' must be a finite number"]),
    ("hbm_tb_s=1e300", ["--vary hbm_tb_s=1e300: gpu.hbm_tb_s:", "out of range"]),
])
def test_bad_whatif_vary(vary, words, tmp_path):
    plot = tmp_path / "whatif.png"
    assert_one_line_error(run("whatif", *TINY_JOB, "--vary", vary, "--plot", plot), *words)
    assert not plot.exists()


def test_whatif_plot_with_wrong_suffix_writes_nothing(tmp_path):
    plot = tmp_path / "whatif.txt"
    assert_one_line_error(run("whatif", *TINY_JOB, "--vary", "hbm_gib=2x", "--plot", plot),
                          "--plot", ".png or .svg")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("gpus,extra,words", [
    ("", [], ["--gpus", "empty value"]),
    ("1,x", [], ["--gpus", "'x' is not a positive GPU count"]),
    ("8,0", [], ["--gpus", "positive"]),
    ("1,12", [], ["--gpus: gpus (12) must be a multiple of node.gpus_per_node (8)"]),
    ("8,4096", [], ["--gpus: no plan of tiny-moe fits 4096"]),
    ("8", ["--weak", "0"], ["--weak:"]),
])
def test_bad_scale_counts(gpus, extra, words, tmp_path):
    plot = tmp_path / "scale.png"
    assert_one_line_error(run("scale", "tiny-moe", "h100", "--gpus", gpus, "--global-batch",
                              "16", "--seq-len", "256", *extra, "--plot", plot), *words)
    assert not plot.exists()


def test_usage_errors_of_every_command_are_one_line():
    for argv in (["search"], ["whatif", "tiny-moe"], ["scale", "tiny-moe", "h100"],
                 ["explain"], ["export"], ["train"], ["catalog", "--yaml"], ["schema", "x"],
                 ["plan"]):
        assert_one_line_error(run(*argv))
