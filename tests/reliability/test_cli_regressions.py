"""Regressions of the CLI layer: click usage errors printed a multi-line box; train launched
torchrun before checking its file and checkpoint options."""

from __future__ import annotations

import json

import pytest

from .conftest import assert_one_line_error, run


@pytest.mark.parametrize("args,words", [
    ([], ["model: required argument"]),
    (["tiny-moe", "h100"], ["--gpus: required option"]),
    (["tiny-moe", "h100", "--gpus", "0"], ["--gpus:", "greater than or equal to 1"]),
    (["tiny-moe", "h100", "--gpus", "two"], ["--gpus:", "integer"]),
    (["tiny-moe", "h100", "--gpus", "8", "--precision", "fp16"], ["--precision:", "fp16"]),
    (["tiny-moe", "h100", "--gpus", "8", "--top", "-1"], ["--top:"]),
    (["tiny-moe", "h100", "--gpus", "8", "--bogus"], ["No such option: --bogus"]),
    (["tiny-moe", "h100", "--gpus", "8", "surplus"], ["unexpected extra argument"]),
    (["tiny-moe", "h100", "--gpus"], ["--gpus", "requires an argument"]),
])
def test_usage_errors_are_one_line(args, words):
    # click's usage errors printed a boxed multi-line panel
    assert_one_line_error(run("search", *args), *words)


def test_unknown_command_is_one_line():
    assert_one_line_error(run("serach", "tiny-moe"), "No such command")


def test_help_still_works():
    result = run("search", "--help")
    assert result.exit_code == 0 and "--gpus" in result.output
    bare = run()
    assert bare.exit_code == 0 and "Commands" in bare.output  # no command: help, status 0


def test_train_checks_inputs_before_launching(tmp_path, plan_doc, monkeypatch):
    from planner import launch

    def no_launch(*a, **k):
        raise AssertionError("train launched a process")

    monkeypatch.setattr(launch, "supervise", no_launch)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_doc))
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"\0" * 64)
    assert_one_line_error(run("train", plan, "--data", tmp_path / "none.u16"), "--data")
    # a .bin names a Megatron indexed dataset: its .idx is needed beside it
    assert_one_line_error(run("train", plan, "--data", tokens), "--data", "tokens.idx")
    assert_one_line_error(run("train", plan, "--resume"), "--resume", "--ckpt-dir")
    assert_one_line_error(run("train", plan, "--ckpt-every", "2"), "--ckpt-every")
    assert_one_line_error(run("train", plan, "--ckpt-dir", tokens), "--ckpt-dir")


def test_a_model_with_a_billion_experts_is_searched_at_once(tmp_path):
    # the EP degrees were the divisors of the expert count, enumerated one by one: the search
    # of a model file with experts = 10^9 never ended (tests/reliability/fuzz_cli.py, seed 0)
    import time

    from plans import catalog

    doc = catalog.load_model("tiny-moe").model_dump(mode="json")
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**doc, "experts": 10**9}))
    start = time.perf_counter()
    result = run("search", str(path), "a100", "--gpus", "2", "--global-batch", "32",
                 "--seq-len", "256", "--top", "1")
    assert time.perf_counter() - start < 10
    assert result.exit_code in (0, 2) and "Traceback" not in result.output


_SUMMARY = """runtime.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_21:39:06
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {other} (pid: 2049)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_21:39:06
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 2048)
============================================================
"""


def test_a_killed_worker_is_named_even_when_its_peers_abort_first():
    """torchrun names the first failure it observed; a peer aborting (SIGABRT, gloo losing its
    pair) can be observed before the worker that was killed (a CI run at c6098f2 reported
    'rank 0: SIGABRT' for a SIGKILL of rank 1). The killed worker is the cause."""
    from pathlib import Path

    from planner.launch import explain_failure

    log = Path("/tmp/w.log")
    killed = explain_failure(1, _SUMMARY.format(other=-9), log)
    assert (killed.code, killed.message) == (137, f"rank 1: SIGKILL (worker logs: {log})")
    # another rank that merely exited: the abort stays the root cause
    exited = explain_failure(1, _SUMMARY.format(other=1), log)
    assert (exited.code, exited.message) == (134, f"rank 0: SIGABRT (worker logs: {log})")


def test_workers_torchrun_stopped_are_never_the_cause():
    """Once a worker fails, torchrun sends SIGTERM to the others, and its failure times are whole
    seconds: a worker it stopped can be listed first (a CI run at 1024a47 said 'rank 0: SIGTERM'
    for a rank that aborted at exit). The worker that failed is named."""
    from pathlib import Path

    from planner.launch import explain_failure

    log = Path("/tmp/w.log")
    # the abort is listed among the failures, a stopped worker as the root cause
    stopped_first = _SUMMARY.replace("exitcode  : -6", "exitcode  : -15").format(other=-6)
    out = explain_failure(1, stopped_first, log)
    assert (out.code, out.message) == (134, f"rank 1: SIGABRT (worker logs: {log})")
    # the abort is the root cause and the stopped worker is listed: the abort stays the cause
    out = explain_failure(1, _SUMMARY.format(other=-15), log)
    assert (out.code, out.message) == (134, f"rank 0: SIGABRT (worker logs: {log})")


# ---- the CLI audit of 2026-12-01 ---------------------------------------------------------------

SMALL = ["tiny-moe", "h100", "--seq-len", "256"]


def test_weak_scaling_validates_its_batch_and_owns_it():
    # model_copy skipped validation: a plan `validate` rejects came out with exit 0
    assert_one_line_error(run("scale", *SMALL, "--gpus", "8", "--weak", "99999999999"),
                          "--weak:", "99,999,999,999", "global_batch")
    # --global-batch beside --weak was dropped without a word
    assert_one_line_error(run("scale", *SMALL, "--gpus", "8,16", "--weak", "4",
                              "--global-batch", "16"), "--global-batch:", "--weak")
    assert_one_line_error(run("scale", *SMALL, "--gpus", "8,8", "--global-batch", "16"),
                          "--gpus:", "8 given twice")


def test_whatif_knob_given_twice_is_refused():
    # two --vary of one knob multiplied into one point instead of making a grid
    base = ["whatif", *SMALL, "--gpus", "8", "--global-batch", "16"]
    assert_one_line_error(run(*base, "--vary", "hbm_gib=2x", "--vary", "hbm_gib=3x"),
                          "--vary hbm_gib:", "given twice")
    assert_one_line_error(run(*base, "--vary", "gpu_tflops=1x,1x"),
                          "--vary gpu_tflops:", "'1x' given twice")


def test_profile_names_the_signal_that_killed_it(tmp_path, monkeypatch):
    import subprocess
    from pathlib import Path

    plan = Path(__file__).resolve().parents[2] / "bench" / "gpu_plans" / "mixtral2l_1gpu.json"
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: -9)
    result = run("profile", str(plan), "--out", str(tmp_path / "p.json"))
    assert result.exit_code == 137, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines == ["error: profiling was killed by SIGKILL (out of memory?)"], result.output


def test_help_reads_whole_at_80_columns():
    """Command summaries were cut at about 45 characters ("beside the..."), examples ran past
    80 columns; train's checkpoint options had no help."""
    from typer.testing import CliRunner

    from planner.cli import app

    narrow = CliRunner(env={"COLUMNS": "80"})
    top = narrow.invoke(app, ["--help"]).output
    commands = top.split("Commands:")[1]
    assert "..." not in commands and "Megatron-Core's best" in commands
    for command in ("", "search", "whatif", "scale", "train", "export", "calibrate", "sweep",
                    "overlap", "dispatch", "parity", "memory"):
        out = narrow.invoke(app, [command, "--help"] if command else ["--help"]).output
        assert max(len(line) for line in out.splitlines()) <= 80, (command, out)
    train = narrow.invoke(app, ["train", "--help"]).output
    for option, words in (("--ckpt-every", "every K steps"), ("--resume", "newest checkpoint"),
                          ("--log-file", "a resumed run continues its own")):
        assert words in " ".join(train.split()), option


def test_exported_scripts_name_the_plan_by_its_absolute_path(tmp_path, monkeypatch):
    import shlex

    plan = tmp_path / "plan.json"
    assert run("search", *SMALL, "--gpus", "8", "--global-batch", "16", "--out",
               str(plan)).exit_code == 0
    monkeypatch.chdir(tmp_path)
    for target in ("torchrun", "slurm"):
        script = run("export", "plan.json", "--to", target).output
        cmd = next(ln for ln in script.splitlines() if ln.startswith("CMD=("))
        words = shlex.split(cmd.removeprefix("CMD=(").removesuffix(")"))
        assert words[words.index("--plan") + 1] == str(plan.resolve()), target


def test_errors_name_the_option_the_user_gave():
    assert_one_line_error(run("search", *SMALL, "--gpus", "8", "--seq-len", "99999999999"),
                          "--seq-len:")
    assert_one_line_error(run("search", *SMALL, "--gpus", "8", "--global-batch",
                              "99999999999"), "--global-batch:")
    # a batch defaulted from --gpus names --gpus, not a --global-batch nobody gave
    assert_one_line_error(run("scale", *SMALL, "--gpus", "99999999999999"),
                          "--gpus:", "default global batch")


def test_ctrl_c_says_interrupted():
    """SIGINT during the searches of a what-if grid (16 of the 352B job: seconds each, so
    the signal comes inside one on any machine): `interrupted` on stderr, status 130, no
    traceback, nothing on stdout (no half-written JSON)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    grid = ["--vary", "network_gb_s=0.5x,1x,2x,4x", "--vary", "nvlink_gb_s=0.5x,1x,2x,4x"]
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", "whatif", "internal-352b",
                             "h800", "--gpus", "1440", *grid, "--json"], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2)  # past the imports, inside the searches
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted" and out == "", err
