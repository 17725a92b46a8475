"""`moeplan train`'s launcher: check everything, then run torchrun so that it always ends.

1. ``preflight``: ``python -m runtime.train --check`` with the job's world and local sizes: the
   runtime's own checks (plan against what it executes, token file, log and checkpoint paths, this
   machine's GPUs or memory) in one process that starts no worker; its one-line error is ours.
2. ``supervise``: torchrun runs in its own session (a terminal's Ctrl-C reaches the launcher only)
   and dies with the launcher (PR_SET_PDEATHSIG); the launcher is a child subreaper, so workers
   orphaned by a killed torchrun become its children and are killed too. SIGINT, SIGTERM and
   SIGHUP are forwarded to torchrun as SIGTERM (torchrun stops its workers; a checkpoint being
   written stays a ``.tmp-step-N`` directory, the complete ones stay as they are); after
   ``GRACE_S`` everything left is SIGKILLed. Worker and torchrun stderr go to a log file; only
   ``note:`` and ``warning:`` lines are shown as they come, and the end is one line:
   ``error: rank R: SIGKILL (worker logs: FILE)`` and the like.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from plans import SpecError
from plans.proc import adopt_orphans, die_with_parent

GRACE_S = 10.0
"""Seconds torchrun has to stop its workers after a forwarded signal before all get SIGKILL."""
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SHOWN = ("note: ", "warning: ")
"""Worker stderr lines shown on the terminal as they come (the rest goes to the log file)."""


def preflight(runtime_args: list[str], world: int, local: int, env: dict[str, str]) -> None:
    """The runtime's checks, in a process that starts no worker; SpecError with its line."""
    r = subprocess.run(
        [sys.executable, "-m", "runtime.train", *runtime_args, "--check"],
        env={**env, "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "RANK": "0",
             "LOCAL_RANK": "0"},
        capture_output=True, text=True, errors="backslashreplace",
        stdin=subprocess.DEVNULL,
    )
    if r.returncode == 0:
        return
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    if lines:
        raise SpecError(lines[-1].removeprefix("error: "))
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    raise SpecError(f"the runtime's check failed with status {r.returncode}: {tail}")


@dataclass(frozen=True)
class Outcome:
    code: int
    """The launcher's exit status."""
    message: str | None
    """The one line to print (without ``error: ``), or None on success."""


# torchrun's failure summary: "rank      : 1 (local_rank: 1)" / "exitcode  : -9 (pid: 123)"
_ROOT = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank.*?exitcode\s*:\s*(-?\d+)", re.S)


def _root_cause(log_text: str) -> tuple[int, int] | None:
    """(rank, status) of the failure that caused the others. torchrun's root cause is the
    first it observed; when a worker is killed, its peers abort (SIGABRT, from gloo or NCCL
    losing the peer) within milliseconds and one of them can be observed first. A worker
    killed by another signal is then the cause, except SIGTERM: torchrun sends it to the
    workers still running once one failed (and its failure times are whole seconds, so such a
    worker can be listed as the root cause)."""
    found = _ROOT.search(log_text)
    if found is None:
        return None
    start = max(log_text.rfind("Failures:", 0, found.start()), 0)
    failures = [(int(f.group(1)), int(f.group(2)))
                for f in _FAILURE.finditer(log_text, start)]
    root = int(found.group(1)), int(found.group(2))
    stopped = -signal.SIGTERM
    if root[1] == stopped:  # stopped by torchrun: any other failure came first
        root = next((f for f in failures if f[1] != stopped), root)
    if root[1] == -signal.SIGABRT:
        root = next((f for f in failures if f[1] < 0 and f[1] not in (-signal.SIGABRT, stopped)),
                    root)
    return root


def explain_failure(code: int, log_text: str, log: Path) -> Outcome:
    """One line for a torchrun that exited with ``code``: the failed rank that caused the
    others, and why."""
    where = f"(worker logs: {log})"
    found = _root_cause(log_text)
    if found is None:
        return Outcome(code, f"training exited with status {code} {where}")
    rank, status = found
    if status < 0:
        name = _signal_name(-status)
        return Outcome(128 + -status, f"rank {rank}: {name} {where}")
    said = [ln.removeprefix("error: ") for ln in log_text.splitlines()
            if ln.startswith("error: ")]
    own = [ln for ln in said if ln.startswith(f"rank {rank}:")]
    if status == 2 and said:  # bad input found by a rank: its line, as the runtime says it
        return Outcome(2, f"{said[0]} {where}")
    if own:
        return Outcome(status, f"{own[0]} {where}")
    return Outcome(status, f"rank {rank}: exited with status {status} {where}")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _descendants(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, recursively (from /proc; empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_all(proc: subprocess.Popen, keep: set[int]) -> None:
    """SIGKILL torchrun's process group, every process below it and below us (orphaned
    workers re-parented to this subreaper) except ``keep``, ours from before the launch."""
    targets = (set(_descendants(proc.pid)) | set(_descendants(os.getpid()))) - keep
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in targets:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def supervise(cmd: list[str], env: dict[str, str]) -> Outcome:
    """Run torchrun ``cmd`` until it ends or a signal stops it; see the module docstring."""
    fd, name = tempfile.mkstemp(prefix="moeplan-train-", suffix=".log")
    log = Path(name)
    adopt_orphans()
    keep = set(_descendants(os.getpid()))
    received: list[int] = []
    with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as sink:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        reader = threading.Thread(target=_copy, args=(proc.stderr, sink), daemon=True)
        reader.start()

        def forward(signum, _frame):
            received.append(signum)
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)

        previous = {s: signal.signal(s, forward) for s in FORWARDED}
        try:
            deadline = None
            while proc.poll() is None:
                if received and deadline is None:
                    deadline = time.monotonic() + GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    _kill_all(proc, keep)
                time.sleep(0.05)
            _kill_all(proc, keep)  # orphans, if torchrun itself was killed
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        reader.join(timeout=5)
    if received:
        name_ = _signal_name(received[0])
        return Outcome(128 + received[0], f"stopped by {name_}: torchrun and every worker ended; "
                       f"complete checkpoints are kept (worker logs: {log})")
    if proc.returncode == 0:
        log.unlink(missing_ok=True)
        return Outcome(0, None)
    text = log.read_text(encoding="utf-8", errors="replace")
    if proc.returncode < 0:  # torchrun itself killed
        return Outcome(128 + -proc.returncode,
                       f"torchrun: {_signal_name(-proc.returncode)}; every worker was stopped "
                       f"(worker logs: {log})")
    return explain_failure(proc.returncode, text, log)


def _copy(stream, sink) -> None:
    """torchrun's stderr to the log file; note and warning lines to ours as well."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="backslashreplace")
        sink.write(line)
        sink.flush()
        if line.startswith(SHOWN):
            sys.stderr.write(line)
            sys.stderr.flush()
