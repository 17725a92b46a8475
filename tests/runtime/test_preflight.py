"""`moeplan train` checks everything before any worker starts (issue 14): the runtime's
``--check`` (what the launcher runs first) refuses each bad input in one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from dist_workers import make_plan
from typer.testing import CliRunner

from plans import CPAttention
from runtime import checkpoint, machine
from runtime.train import main


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    plan = tmp_path / "p.json"
    plan.write_text(make_plan().model_dump_json())  # tiny-moe: vocab 256, seq_len 32
    return plan


def _check(capsys, *args: str) -> str:
    code = main([*map(str, args), "--check"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "\n" not in err and err.startswith("error: ") and "Traceback" not in err
    return err


def _tokens(path: Path, ids) -> Path:
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def test_good_input_passes(job, tmp_path, capsys):
    data = _tokens(tmp_path / "t.u16", np.arange(1000) % 256)
    assert main(["--plan", str(job), "--data", str(data), "--log", str(tmp_path / "m.jsonl"),
                 "--ckpt-dir", str(tmp_path / "new" / "ck"), "--check"]) == 0
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "new").exists()


@pytest.mark.parametrize("make,words", [
    (lambda d: _tokens(d / "t.u16", []), ["is empty"]),
    (lambda d: _tokens(d / "t.u16", np.zeros(20)), ["holds 20 tokens", "seq_len + 1 (33)"]),
    (lambda d: (d / "t.u16").write_bytes(b"\0" * 101) and d / "t.u16", ["101 bytes", "whole"]),
    (lambda d: _tokens(d / "t.u16", [*range(100), 65535]), ["token 100 is id 65535", "256"]),
    (lambda d: _tokens(d / "t.u16", [256] * 40), ["token 0 is id 256"]),
    (lambda d: (d / "dir.u16").mkdir() or d / "dir.u16", ["not a regular file"]),
])
def test_bad_token_files(job, tmp_path, capsys, make, words):
    err = _check(capsys, "--plan", job, "--data", make(tmp_path))
    assert err.startswith("error: --data:") and all(w in err for w in words), err


def test_bad_log_and_checkpoint_paths(job, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert "is a directory" in _check(capsys, "--plan", job, "--log", tmp_path)
    assert "does not exist" in _check(capsys, "--plan", job, "--log", tmp_path / "no" / "m")
    err = _check(capsys, "--plan", job, "--ckpt-dir", tmp_path / "file" / "ck")
    assert "is under" in err and "a file, not a folder" in err
    assert "not a folder" in _check(capsys, "--plan", job, "--ckpt-dir", tmp_path / "file")


def test_unsupported_plan_and_machine(job, tmp_path, capsys, monkeypatch):
    cp = tmp_path / "cp.json"
    cp.write_text(make_plan().model_copy(update={"attention": CPAttention()}).model_dump_json())
    assert "attention.kind: cp is not run by target moeplan" in _check(capsys, "--plan", cp)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4096 kB\nMemAvailable: 2048 kB\n")
    monkeypatch.setattr(machine, "MEMINFO", meminfo)
    err = _check(capsys, "--plan", job)
    assert "1 CPU ranks of this plan need about" in err and "0.0 GiB available" in err


def test_another_runs_checkpoints_are_refused(job, tmp_path, capsys):
    ck = tmp_path / "ck"
    (ck / "step-2").mkdir(parents=True)
    assert "without a run.json" in _check(capsys, "--plan", job, "--ckpt-dir", ck,
                                          "--ckpt-every", "1")
    plan = make_plan()
    theirs = checkpoint.RunRecord.of(plan, None, seed=7)
    (ck / "run.json").write_text(theirs.model_dump_json())
    err = _check(capsys, "--plan", job, "--ckpt-dir", ck, "--ckpt-every", "1")
    assert "another run (its seed differs)" in err and "--overwrite" in err
    err = _check(capsys, "--plan", job, "--ckpt-dir", ck, "--resume")
    assert "another run" in err and "cannot be resumed" in err
    (ck / "run.json").write_text(json.dumps({"job": 1}))
    assert "run.json" in _check(capsys, "--plan", job, "--ckpt-dir", ck, "--resume")
    # told to overwrite: accepted (the old checkpoints are deleted when the run starts)
    assert main(["--plan", str(job), "--ckpt-dir", str(ck), "--ckpt-every", "1",
                 "--overwrite", "--check"]) == 0


def test_cli_train_refuses_before_torchrun(tmp_path, monkeypatch):
    from planner import launch
    from planner.cli import app

    launched = []
    monkeypatch.setattr(launch, "supervise", lambda *a, **k: launched.append(a))
    plan = tmp_path / "p.json"
    plan.write_text(make_plan().model_dump_json())
    tokens = _tokens(tmp_path / "t.u16", [65535] * 100)
    result = CliRunner().invoke(app, ["train", str(plan), "--data", str(tokens)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith("error: --data:") and "65535" in result.output
    assert launched == []


def test_a_checkpoint_folder_without_room_for_one_checkpoint_is_refused(job, tmp_path, capsys,
                                                                         monkeypatch):
    """The free-space reading faked: one byte short of this plan's checkpoint is refused,
    with both sizes in the line; exactly enough passes."""
    from plans.catalog import load_plan
    from runtime.train import checkpoint_size

    needed = checkpoint_size(load_plan(job))
    plan = load_plan(job)
    # fp32 parameters (their own masters) + AdamW's two moments
    assert needed == plan.model.total_params * (4 + 8)
    ck = tmp_path / "ck"
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: needed - 1)
    err = _check(capsys, "--plan", job, "--ckpt-dir", ck, "--ckpt-every", "5")
    gib = checkpoint.size_text
    assert err.startswith("error: --ckpt-dir:") and str(ck) in err
    assert f"{gib(needed - 1)} free" in err and f"takes {gib(needed)}" in err
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: needed)
    assert main(["--plan", str(job), "--ckpt-dir", str(ck), "--ckpt-every", "5",
                 "--check"]) == 0
