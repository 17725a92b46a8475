"""Signals to `moeplan train` (issue 14): SIGTERM to the launcher stops torchrun and every worker
within seconds, exits non-zero with one line and keeps the complete checkpoints; a worker
killed by a signal ends the job with `error: rank R: SIGKILL (worker logs: FILE)` and no worker
traceback on the terminal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_workers import make_plan

from runtime import checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _workers(plan: Path) -> list[int]:
    """Processes running runtime.train on ``plan`` (torchrun's workers)."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"runtime.train" in args and str(plan).encode() in args and b"--check" not in args
                and b"torch.distributed.run" not in args):
            out.append(int(cmdline.parent.name))
    return out


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    plan = tmp_path / "p.json"
    plan.write_text(make_plan(sp=2, ep=2).model_dump_json())
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner.cli", "train", str(plan), "--steps", "100000",
         "--ckpt-dir", str(ck), "--ckpt-every", "2"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 600  # a guard against hanging, not a speed check
        while not (ck / "step-2").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
        assert len(_workers(plan)) == 2
    except AssertionError as e:
        # the launch trains 100000 steps: stop it before reading its output (reading first, as
        # here once, waited for the whole run under a loaded machine)
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"{e}\n{err[-3000:]}") from None
    return proc, plan, ck


def _finish(proc: subprocess.Popen, within_s: float) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=within_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out, err


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if not ln.startswith(("note: ", "warning: "))]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_sigterm_to_the_launcher_stops_everything(tmp_path):
    proc, plan, ck = _start(tmp_path)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = _finish(proc, 30)
    assert time.monotonic() - start < 15
    assert proc.returncode == 128 + signal.SIGTERM
    line = _error_line(err)
    assert line.startswith("error: stopped by SIGTERM") and "worker logs:" in line
    time.sleep(0.5)
    assert _workers(plan) == []
    found = checkpoint.find_resumable(ck, lambda _: None)
    assert found is not None and found[1] >= 2  # the complete checkpoints are intact


def test_a_worker_killed_by_a_signal_is_one_line(tmp_path):
    proc, plan, _ = _start(tmp_path)
    os.kill(max(_workers(plan)), signal.SIGKILL)
    _, err = _finish(proc, 60)
    assert proc.returncode != 0
    line = _error_line(err)
    m = re.fullmatch(r"error: rank (\d): SIGKILL \(worker logs: (\S+)\)", line)
    assert m, line
    assert Path(m.group(2)).is_file() and "SIGKILL" in Path(m.group(2)).read_text()
    time.sleep(0.5)
    assert _workers(plan) == []
