"""The size targets of issue 33, measured on the files git tracks:

    python -m tools.code_size [--top 10]

bench/'s share of the non-test Python lines (target at most 20%), the lines per top-level
folder, the longest functions outside tests/ and bench/ (target none over 80 lines) and the
README's lines (target at most 150).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_files() -> list[Path]:
    """The .py files git tracks or would (not ignored), outside tests/; every line counts."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.split()
    return [ROOT / f for f in out if not f.startswith("tests/")]


def functions(path: Path) -> list[tuple[int, str]]:
    """(lines, 'file:name') of every function in ``path``, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT)
    return [(n.end_lineno - n.lineno + 1, f"{rel}:{n.lineno} {n.name}")
            for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--top", type=int, default=10, help="how many longest functions to list")
    args = p.parse_args(argv)
    files = python_files()
    per_folder: Counter[str] = Counter()
    for f in files:
        per_folder[f.relative_to(ROOT).parts[0]] += len(f.read_text().splitlines())
    total = sum(per_folder.values())
    print(f"non-test Python lines: {total:,}")
    for folder, n in per_folder.most_common():
        print(f"  {folder + '/':14} {n:6,}  {n / total:6.1%}")
    print(f"bench/ share: {per_folder['bench'] / total:.1%} (target <= 20%)")
    library = [f for f in files if f.relative_to(ROOT).parts[0] not in ("bench", "tools")]
    longest = sorted((fn for f in library for fn in functions(f)), reverse=True)
    print(f"longest library functions (target <= 80 lines; "
          f"{sum(n > 80 for n, _ in longest)} over):")
    for n, where in longest[: args.top]:
        print(f"  {n:4}  {where}")
    print(f"README.md lines: {len((ROOT / 'README.md').read_text().splitlines())} "
          f"(target <= 150)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
