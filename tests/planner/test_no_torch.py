"""plans, cost_models and planner never import torch (docs/architecture.md): checked in a
process where importing torch raises, so a stray import fails here rather than slowing every
`moeplan` command by seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

NO_TORCH = """
import sys
from importlib.abc import MetaPathFinder

class NoTorch(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError(f"torch is not allowed here (imported: {name})")
        return None

sys.meta_path.insert(0, NoTorch())
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_guard_itself_refuses_torch():
    done = run_without_torch("import torch\n")
    assert done.returncode != 0 and "torch is not allowed here" in done.stderr


def test_plans_cost_models_and_planner_import_and_search_without_torch():
    code = (
        "import importlib, pkgutil\n"
        "import plans, cost_models, planner\n"
        "for pkg in (plans, cost_models, planner):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "from planner.cli import app\n"
        "app(['search', 'tiny-moe', 'h200', '--gpus', '8', '--global-batch', '16',\n"
        "     '--seq-len', '256', '--runnable', '--json'])\n"
    )
    done = run_without_torch(code)
    assert done.returncode == 0, done.stderr[-2000:]
    best = json.loads(done.stdout)["top"][0]["plan"]
    assert best["degrees"] and best["prediction"]["step_time_s"] > 0


def run_cli_without_torch(*args: str) -> subprocess.CompletedProcess:
    """`moeplan ARGS` as its console script runs it, in a process where torch is missing."""
    code = (f"import sys\nsys.argv = ['moeplan', *{list(args)!r}]\n"
            "from planner.cli import main\nmain()\n")
    return run_without_torch(code)


def test_moeplan_search_runs_without_torch():
    done = run_cli_without_torch("search", "tiny-moe", "h800", "--gpus", "8")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Best plans" in done.stdout and "predicted speedup" in done.stdout


def test_the_runtime_commands_say_in_one_line_that_they_need_torch(tmp_path):
    plan = tmp_path / "plan.json"
    made = run_cli_without_torch("search", "tiny-moe", "h200", "--gpus", "1", "--global-batch",
                                 "2", "--seq-len", "128", "--runnable", "--out", str(plan))
    assert made.returncode == 0, made.stderr[-2000:]
    for command, args in (("train", [str(plan)]),
                          ("profile", [str(plan), "--out", str(tmp_path / "p.json")]),
                          ("sweep", ["--out", str(tmp_path / "s.json")]),
                          ("overlap", ["--out", str(tmp_path / "o.json")]),
                          ("dispatch", ["--out", str(tmp_path / "d.json")]),
                          ("parity", [str(plan), "--out", str(tmp_path / "c.json")]),
                          ("memory", [str(plan), "--out", str(tmp_path / "m.json")])):
        done = run_cli_without_torch(command, *args)
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.splitlines() == [
            f"error: {command}: needs torch (the runtime): pip install -e '.[runtime]'"]
