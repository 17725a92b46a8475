"""Hostile input (issue 14): files that are not files, YAML that expands without end, counts of
hundreds of digits, names that are markup, outputs that are not regular files. Each ends in one
line and exit 2 within seconds, writes nothing, and leaves what a user made as it was."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from plans import SpecError, catalog
from plans.io import MAX_YAML_NODES, read_bytes, read_document, write_atomic

from .conftest import TINY_JOB, assert_one_line_error, run, snapshot

BOMB = "".join(
    f"{chr(97 + i)}: &{chr(97 + i)} [" + ",".join([f"*{chr(96 + i)}"] * 9 if i else ['"x"'] * 9)
    + "]\n" for i in range(9)
)  # 9 levels of 9 aliases: 9^9 = 387M leaves once expanded


@pytest.fixture
def model_doc() -> dict:
    return catalog.load_model("tiny-moe").model_dump(mode="json")


def _put(path: Path, doc) -> Path:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


# ---- files that are not documents --------------------------------------------------------------


@pytest.mark.parametrize("text,words", [
    (BOMB, ["not valid yaml", "aliases expand", f"{MAX_YAML_NODES:,}"]),
    ("a: &a [*a]\n", ["not valid yaml", "recursive alias"]),
])
def test_yaml_alias_bombs_are_refused_at_once(tmp_path, text, words):
    path = _put(tmp_path / "m.yaml", text)
    start = time.perf_counter()
    assert_one_line_error(run("search", path, "h100", "--gpus", "8"), str(path), *words)
    assert_one_line_error(run("validate", path), *words)
    assert time.perf_counter() - start < 10


def test_a_few_aliases_are_fine(tmp_path, model_doc):
    text = "base: &w 256\n" + "\n".join(f"{k}: {json.dumps(v)}" for k, v in model_doc.items()
                                         if k != "hidden") + "\nhidden: *w\n"
    doc = read_document(_put(tmp_path / "m.yaml", text))
    assert doc["hidden"] == 256


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_devices_are_not_read(device):
    if not Path(device).exists():
        pytest.skip(f"no {device}")
    assert_one_line_error(run("validate", device), device, "character device")
    assert_one_line_error(run("search", "tiny-moe", device, "--gpus", "8"), "character device")


def test_a_fifo_is_not_opened(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    start = time.perf_counter()
    assert_one_line_error(run("validate", fifo), "FIFO")
    assert_one_line_error(run("calibrate", fifo, "--plan", fifo, "--out", tmp_path / "c.yaml"),
                          "FIFO")
    assert time.perf_counter() - start < 10


def test_a_directory_and_an_oversized_file(tmp_path):
    assert_one_line_error(run("validate", tmp_path), "a directory")
    big = _put(tmp_path / "big.json", "{}" + " " * 2048)
    with pytest.raises(SpecError, match="2,050 bytes, more than the 1,024"):
        read_bytes(big, limit=1024)


# ---- numbers no machine or model has ---------------------------------------------------------


HUGE = int("9" * 400)


@pytest.mark.parametrize("field", ["vocab", "hidden", "layers", "experts", "head_dim"])
def test_model_counts_of_hundreds_of_digits(tmp_path, model_doc, field):
    path = _put(tmp_path / "m.json", {**model_doc, field: HUGE})
    assert_one_line_error(run("search", path, "h100", "--gpus", "8"), f"{field}:",
                          "less than or equal")


@pytest.mark.parametrize("part,field", [("gpu", "sms"), ("network", "nics_per_node"),
                                        ("node", "gpus_per_node"), (None, "gpus")])
def test_cluster_counts_of_hundreds_of_digits(tmp_path, part, field):
    doc = catalog.load_cluster("h100").model_dump(mode="json")
    (doc[part] if part else doc)[field] = HUGE
    path = _put(tmp_path / "c.json", doc)
    assert_one_line_error(run("search", "tiny-moe", path, "--gpus", "8"), field,
                          "less than or equal")


@pytest.mark.parametrize("args", [
    ["search", "tiny-moe", "h100", "--gpus", str(HUGE)],
    ["search", "tiny-moe", "h100", "--gpus", "1e18"],
    ["search", "tiny-moe", "h100", "--gpus", "8", "--global-batch", str(HUGE)],
    ["search", "tiny-moe", "h100", "--gpus", "8", "--seq-len", str(10**18)],
    ["scale", "tiny-moe", "h100", "--gpus", str(10**18)],
    ["whatif", "tiny-moe", "h100", "--gpus", str(10**18), "--vary", "hbm_gib=2x"],
])
def test_absurd_job_sizes_are_one_line_at_once(args):
    start = time.perf_counter()
    assert_one_line_error(run(*args))
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("field,value", [
    (("training", "global_batch"), HUGE), (("training", "seq_len"), HUGE),
    (("degrees", "dp"), HUGE), (("model", "vocab"), HUGE), (("cluster", "gpus"), HUGE),
    (("micro_batch_size",), HUGE), (("ffn", "capacity_factor"), 1e-320),
    (("ffn", "capacity_factor"), 5e-324), (("ffn", "capacity_factor"), 0.001),
])
def test_plan_fields_out_of_range(tmp_path, plan_doc, field, value):
    doc = json.loads(json.dumps(plan_doc))
    if field[0] == "ffn":
        doc["ffn"] = {"kind": "ep"}
    target = doc
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    path = _put(tmp_path / "p.json", doc)
    for cmd in ("validate", "explain"):
        assert_one_line_error(run(cmd, path), field[0], field[-1])


def test_scale_over_hundreds_of_counts_is_refused_before_searching():
    counts = ",".join(str(8 * i) for i in range(1, 201))
    start = time.perf_counter()
    assert_one_line_error(run("scale", "internal-352b", "h800", "--gpus", counts),
                          "--gpus", "200 searches", "at most 32")
    assert time.perf_counter() - start < 10


def test_whatif_grid_is_bounded():
    values = ",".join(f"{1 + i / 10:g}x" for i in range(8))
    assert_one_line_error(run("whatif", *TINY_JOB, "--vary", f"hbm_gib={values}",
                              "--vary", f"gpu_tflops={values}"), "--vary", "64 searches")


@pytest.mark.parametrize("field,value,words", [
    ("step_time_s", -1.0, ["prediction.step_time_s", "greater than 0"]),
    ("mfu", 0.0, ["prediction.mfu"]),
    ("tokens_per_s", 1e30, ["prediction.tokens_per_s", "contradicts"]),
    ("step_time_s", 1e-9, ["prediction", "contradicts"]),
])
def test_tampered_prediction_is_refused(tmp_path, plan_doc, field, value, words):
    doc = json.loads(json.dumps(plan_doc))
    doc["prediction"][field] = value
    path = _put(tmp_path / "p.json", doc)
    assert_one_line_error(run("validate", path), *words)


# ---- names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["[/bold]", "[red]Mixtral[/red]", "50$ model $x^2", "a]b[/"])
def test_markup_in_names_is_printed_literally(tmp_path, plan_doc, name):
    doc = json.loads(json.dumps(plan_doc))
    doc["model"]["name"] = name
    doc["cluster"]["gpu"]["name"] = name
    path = _put(tmp_path / "p.json", doc)
    result = run("explain", path)
    assert result.exit_code == 0, result.output
    assert f"{name} (378K total, 231K active) on 8 x {name}" in result.output


@pytest.mark.parametrize("name", ["bad\ud800name", "two\nlines", "bell\x07", ""])
def test_unprintable_names_are_refused(tmp_path, model_doc, name):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**model_doc, "name": name}))  # \ud800 as a JSON escape
    assert_one_line_error(run("search", path, "h100", "--gpus", "8"), "name")


def test_markup_names_in_a_plot(tmp_path, model_doc):
    pytest.importorskip("matplotlib")
    path = _put(tmp_path / "m.json", {**model_doc, "name": "$x^{2 [bold]"})
    plot = tmp_path / "s.png"
    result = run("scale", path, "h100", "--gpus", "8", "--global-batch", "16", "--seq-len",
                 "256", "--plot", plot)
    assert result.exit_code == 0, result.output
    assert plot.read_bytes().startswith(b"\x89PNG")


# ---- outputs ----------------------------------------------------------------------------


def _out_cases(tmp_path: Path) -> dict[str, tuple[Path, list[str]]]:
    (tmp_path / "file").write_text("mine\n")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "target.json").write_text("target\n")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    return {
        "parent is a file": (tmp_path / "file" / "best.json", ["is not a folder"]),
        "parent missing": (tmp_path / "none" / "best.json", ["does not exist"]),
        "a directory": (tmp_path / "folder", ["a directory"]),
        "a FIFO": (tmp_path / "fifo.json", ["a FIFO"]),
        "a symlink": (tmp_path / "link.json", ["a symbolic link"]),
        "name too long": (tmp_path / ("x" * 300 + ".json"), ["file name longer than"]),
        "a character device": (Path("/dev/null"), ["a character device"]),
    }


@pytest.mark.parametrize("case", ["parent is a file", "parent missing", "a directory", "a FIFO",
                                  "a symlink", "name too long", "a character device"])
def test_bad_out_destinations_even_with_force(tmp_path, case):
    out, words = _out_cases(tmp_path)[case]
    before = snapshot(tmp_path)
    assert_one_line_error(run("search", *TINY_JOB, "--out", out, "--force"), "--out", *words)
    assert snapshot(tmp_path) == before
    assert (tmp_path / "target.json").read_text() == "target\n"
    assert not list(tmp_path.glob(".*.tmp"))


def test_plot_obeys_force(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "s.png"
    plot.write_text("mine\n")
    args = ["scale", "tiny-moe", "h100", "--gpus", "8", "--global-batch", "16", "--seq-len",
            "256", "--plot", plot]
    assert_one_line_error(run(*args), "--plot", "exists", "--force")
    assert plot.read_text() == "mine\n"
    assert run(*args, "--force").exit_code == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["s.png"]


def test_profile_out_is_checked_before_profiling(tmp_path, plan_doc):
    (tmp_path / "file").write_text("x")
    plan = _put(tmp_path / "p.json", plan_doc)
    # an 8-GPU plan is refused first; a 1-GPU plan into a bad --out never starts the profiler
    one = json.loads(json.dumps(plan_doc))
    path = Path(__file__).parents[2] / "bench" / "gpu_plans" / "mixtral2l_1gpu.json"
    assert_one_line_error(run("profile", plan, "--out", tmp_path / "o.json"), "profiling runs")
    assert_one_line_error(run("profile", path, "--out", tmp_path / "file" / "o.json"),
                          "--out", "not a folder")
    assert one  # the plan document is untouched
    assert_one_line_error(run("profile", path, "--out", tmp_path / "file"), "--out", "exists")


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "a.json"
    write_atomic(out, "one", "--out", force=False)
    with pytest.raises(SpecError, match="exists"):
        write_atomic(out, "two", "--out", force=False)
    write_atomic(out, "two", "--out", force=True)
    assert out.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert stat.S_IMODE(out.stat().st_mode) & 0o600 == 0o600
    # a directory squatting on the old fixed temporary name changes nothing now
    (tmp_path / ".b.json.tmp").mkdir()
    write_atomic(tmp_path / "b.json", "three", "--out", force=False)
    assert (tmp_path / "b.json").read_text() == "three"
