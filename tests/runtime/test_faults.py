"""Training faults: a worker killed mid-run under torchrun ends the job with a one-line reason;
--resume continues from the last complete checkpoint with exactly the losses of an
uninterrupted run; damaged checkpoints are detected and skipped."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_workers import make_plan

from runtime import checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "-m", "runtime.train", *args]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _losses(log: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, log.read_text().splitlines())}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find workers")
def test_sigkill_of_a_worker_then_resume_matches_uninterrupted_run(tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(make_plan(sp=2, ep=2).model_dump_json())
    ck = tmp_path / "ck"
    base = ["--plan", str(plan), "--lr", "1e-2", "--timeout-s", "60"]
    killed_log = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        _torchrun(*base, "--steps", "100000", "--ckpt-dir", str(ck), "--ckpt-every", "2",
                  "--log-file", str(killed_log)),
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (ck / "step-2").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out
    # the surviving rank reports why it stopped in one line, torchrun names the killed worker
    assert any(line.startswith("error: rank ") for line in out.splitlines()), out
    assert "SIGKILL" in out or "Signal 9" in out, out

    found = checkpoint.find_resumable(ck)
    assert found is not None
    _, last = found
    steps = last + 3
    resumed_log, full_log = tmp_path / "resumed.jsonl", tmp_path / "full.jsonl"
    r = subprocess.run(
        _torchrun(*base, "--steps", str(steps), "--ckpt-dir", str(ck), "--resume",
                  "--log-file", str(resumed_log)),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"after step {last}" in r.stdout
    r = subprocess.run(
        _torchrun(*base, "--steps", str(steps), "--log-file", str(full_log)),
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    full, resumed = _losses(full_log), _losses(resumed_log)
    assert sorted(resumed) == list(range(last + 1, steps + 1))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)
    killed = _losses(killed_log)
    assert all(killed[s] == full[s] for s in killed if s in full)


def _truncate(root: Path) -> None:
    data = max((p for p in root.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def _corrupt_metadata(root: Path) -> None:
    meta = root / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    meta.write_bytes(bytes(raw))


def _drop_file(root: Path) -> None:
    next(root.rglob("*.distcp")).unlink()


def _bad_manifest(root: Path) -> None:
    (root / checkpoint.MANIFEST).write_text("{not json")


DAMAGE = {
    "truncated": (_truncate, "bytes"),
    "metadata": (_corrupt_metadata, "SHA-256"),
    "missing": (_drop_file, "missing"),
    "manifest": (_bad_manifest, "unreadable"),
}


def test_damaged_checkpoints_are_detected_and_skipped(train_here, tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(make_plan().model_dump_json())
    ck = tmp_path / "ck"
    base = ["--plan", str(plan), "--ckpt-dir", str(ck)]
    r = train_here(*base, "--steps", "2", "--ckpt-every", "1")
    assert r.returncode == 0, r.stderr
    assert checkpoint.verify(ck / "step-2") is None
    pristine = tmp_path / "pristine"
    shutil.copytree(ck / "step-2", pristine)
    for name, (damage, words) in DAMAGE.items():
        shutil.rmtree(ck / "step-2")
        shutil.copytree(pristine, ck / "step-2")
        damage(ck / "step-2")
        problem = checkpoint.verify(ck / "step-2")
        assert problem is not None and words in problem, (name, problem)
    # the last damage kind, end to end: reported in one line, the previous checkpoint is used
    r = train_here(*base, "--steps", "3", "--resume")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "step-2" in warnings[0] and "damaged" in warnings[0]
    assert "step-1 after step 1" in r.stdout


def test_a_checkpoint_write_that_fails_ends_the_run_in_one_line(train_here, tmp_path,
                                                               monkeypatch):
    """The disk fills during step 4's checkpoint (its first file half written, then ENOSPC):
    one line names the rank, the step, the folder and the sizes; the partial .tmp-step-4 is
    removed and step-2 kept and still resumable."""
    import errno

    plan = tmp_path / "p.json"
    plan.write_text(make_plan().model_dump_json())
    ck = tmp_path / "ck"
    real = checkpoint.dcp.save

    def fill_the_disk(state, checkpoint_id):
        if not checkpoint_id.endswith("step-4"):
            return real(state, checkpoint_id=checkpoint_id)
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", fill_the_disk)
    monkeypatch.setattr(checkpoint, "free_bytes", lambda folder: 10 * 2**30)
    r = train_here("--plan", str(plan), "--steps", "6", "--ckpt-dir", str(ck),
                   "--ckpt-every", "2")
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: rank 0: writing the checkpoint of step 4 to {ck}")
    assert "No space left on device" in lines[0] and "GiB free" not in lines[0]
    from runtime.train import checkpoint_size

    needed = checkpoint_size(make_plan())
    assert f"needs {checkpoint.size_text(needed)}, 10.00 GiB are free" in lines[0]
    written = sum(p.stat().st_size for p in (ck / "step-2").rglob("*") if p.is_file())
    assert 0.9 * needed < written < 1.1 * needed, (written, needed)  # the estimate holds
    assert not list(ck.glob(".tmp-step-*"))
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-2"]
    assert checkpoint.verify(ck / "step-2") is None
    assert "step 5 loss" not in r.stdout  # the run ended at the failed save
