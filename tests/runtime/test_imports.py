import subprocess
import sys
from pathlib import Path


def test_runtime_never_imports_planner_or_cost_models():
    code = (
        "import sys, runtime.train, runtime.checkpoint\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('planner', 'cost_models')]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)
