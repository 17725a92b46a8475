"""Shared helpers of the reliability suite: the CLI under CliRunner and a fast valid plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app

# A search that takes a fraction of a second and yields a valid plan.
TINY_JOB = ["tiny-moe", "h100", "--gpus", "8", "--global-batch", "16", "--seq-len", "256"]

runner = CliRunner(env={"COLUMNS": "250"})


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *words: str) -> str:
    """Exit 2, exactly one non-empty line starting with `error: `, no traceback."""
    out = result.output
    assert result.exit_code == 2, out
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in out
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("error: "), lines[0]
    assert len(lines[0]) > len("error: ") + 3
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="session")
def plan_doc(tmp_path_factory) -> dict:
    """A valid plan written by `search --out`, as a JSON document."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    result = run("search", *TINY_JOB, "--top", "1", "--out", path)
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under a directory with its bytes, to check nothing was created or changed."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}
