"""runtime.parallel.mesh.end_process_groups: a run's gloo groups, and their worker threads, are
gone before Python finalises, also a group that a reference cycle keeps alive (a gloo worker
that drops a collective's tensors during finalisation aborts the process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, json, os, sys
sys.path.insert(0, {root!r})
import torch
import torch.distributed as dist
from runtime.parallel.mesh import end_process_groups

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
out = {out!r} + os.environ["RANK"]
# registered first, so it runs last among the exit handlers: after end_process_groups' collection
atexit.register(lambda: open(out, "w").write(json.dumps({{"before": before, "at_exit": threads(),
                                                          "during": during}})))
dist.init_process_group("gloo")

class Holder:  # a cycle that holds the group, as a dispatcher inside a module cycle does
    def __init__(self):
        self.group, self.me = dist.group.WORLD, self

def main():
    global during
    held = Holder()  # alive while the run ends; garbage (a cycle) once main returns
    x = torch.ones(4)
    dist.all_reduce(x)
    during = threads()
    {end}

main()
"""


def _run(tmp_path: Path, end: str, clean_exit: bool = True) -> list[dict]:
    """Each rank's thread counts. ``clean_exit``: the launch must end with status 0 (the
    control may not: its held group's threads can abort the process in finalisation, after
    the exit handler wrote its counts)."""
    script = tmp_path / "t.py"
    script.write_text(SCRIPT.format(root=str(ROOT), out=str(tmp_path / "threads."), end=end))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(script)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 or not clean_exit, r.stdout + r.stderr
    return [json.loads((tmp_path / f"threads.{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_groups_and_their_threads_are_gone_before_finalisation(tmp_path):
    for counts in _run(tmp_path, "end_process_groups()"):
        assert counts["during"] > counts["before"]  # gloo's worker and TCP-loop threads
        assert counts["at_exit"] == counts["before"], counts


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_without_it_the_cycle_keeps_the_threads_into_finalisation(tmp_path):
    """The control: destroy_process_group alone leaves the held group's threads running when
    Python starts to finalise (what aborted about one CPU run in ten)."""
    counts = _run(tmp_path, "dist.barrier(); dist.destroy_process_group()", clean_exit=False)
    assert all(c["at_exit"] > c["before"] for c in counts), counts
