"""bench/kernels/gpu_clocks.py on a machine without nvidia-smi: the command runs alone, its exit
status is the script's, and the CSV says why it holds no samples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.kernels.gpu_clocks", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})


def test_the_command_runs_and_its_status_is_kept(tmp_path):
    csv = tmp_path / "smi.csv"
    r = _run("--csv", str(csv), "--", sys.executable, "-c",
             "import sys; print('ran'); sys.exit(3)")
    assert r.returncode == 3 and "ran" in r.stdout
    assert csv.read_text() == "unavailable: no nvidia-smi on this machine\n"


def test_no_command_is_one_line(tmp_path):
    r = _run("--csv", str(tmp_path / "smi.csv"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "command" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "smi.csv").exists()
