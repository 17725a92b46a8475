"""bench/results/INDEX.md: where each committed result comes from, generated from the manifest.

    python -m bench.index [--check]

Per results folder: the campaigns of bench/campaigns.yaml that write it (rerun one with
``bash bench/run_campaign.sh NAME``), what each measures, and the result documents the folder
holds. A folder no campaign writes is listed last, with its files: what a script writes by its
own ``--out``.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from bench.campaign import MANIFEST, load_manifest
from bench.report import ROOT, fill, parser, write_or_check
from plans import SpecError

RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "INDEX.md"


def _documents(folder: Path) -> list[str]:
    """The result documents directly in ``folder`` (logs and sub-folders aside)."""
    return sorted(p.name for p in folder.glob("*.json*")) if folder.is_dir() else []


def render() -> str:
    manifest = load_manifest(MANIFEST)
    writers: dict[str, list[str]] = defaultdict(list)
    for name, c in manifest.campaigns.items():
        # its results folder, and every folder its steps write (a further launch's, a merged
        # campaign's step's own)
        for folder in dict.fromkeys([Path(c.results)] + [(Path(s.folder(c)) / s.output()).parent
                                                         for s in c.steps]):
            writers[str(folder)].append(name)
    folders = ""
    for folder in sorted(writers):
        folders += f"## `{folder}` ({len(_documents(ROOT / folder))} documents)\n\n"
        for n in writers[folder]:
            c = manifest.campaigns[n]
            about = (" ".join(c.about.split()) if c.results.rstrip("/") == folder
                     else f"some of its steps (its folder: `{c.results}`)")
            folders += f"- `{n}` ({c.gpus} GPU): {about}\n"
        folders += "\n"
    others = sorted(str(p.relative_to(ROOT)) for p in RESULTS.rglob("*.json*")
                    if not any(p.parent == ROOT / f for f in writers))
    return fill("index.md.tmpl", {"folders": folders,
                                  "others": "\n".join(f"- `{p}`" for p in others)})


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__, "the index is stale").parse_args(argv)
    try:
        text = render()
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return write_or_check(INDEX, text, "python -m bench.index", args.check)


if __name__ == "__main__":
    sys.exit(main())
