"""What bench/'s generated docs share: a template of bench/templates/ with its ``{{name}}``
parts filled in, its tables, then written, or with ``--check`` held against the committed doc
(exit 1 when it is stale or the report's own targets are missed). No torch."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from plans.io import write_atomic

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "bench" / "templates"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
PIECE = re.compile(r"^<!-- (\w+) -->\n", re.MULTILINE)


def fill(template: str, parts: Mapping[str, object], piece: str | None = None) -> str:
    """bench/templates/``template`` with each ``{{name}}`` replaced by ``parts[name]``; with
    ``piece``, only the template's lines after the line ``<!-- piece -->`` up to the next such
    line (a report whose parts come and go keeps each part's prose as a piece)."""
    text = (TEMPLATES / template).read_text()
    if piece is not None:
        cut = PIECE.split(text)
        text = dict(zip(cut[1::2], cut[2::2], strict=True))[piece]
    return substitute(text, parts)


def substitute(text: str, parts: Mapping[str, object]) -> str:
    """``text`` with each ``{{name}}`` replaced by ``parts[name]``."""
    return PLACEHOLDER.sub(lambda m: str(parts[m.group(1)]), text)


def load(path: Path) -> dict:
    """A committed result document."""
    return json.loads(path.read_text())


def row(cells: Iterable[object]) -> str:
    """A markdown table's line; an empty cell is ``| |``."""
    return "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)


def table(head: Sequence[str], rows: Iterable[Iterable[object]], align: str = "") -> str:
    """A markdown table: ``head``, its rule (``align``: ``l`` or ``r`` a column, left past its
    end) and a line per row of cells."""
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(head), "l"))
    return "\n".join([row(head), rule, *map(row, rows)])


def parser(doc: str, check: str) -> argparse.ArgumentParser:
    """A generator's command line: its module docstring's first line, and ``--check`` (write
    nothing; exit 1 when ``check``)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--check", action="store_true", help=f"write nothing; exit 1 when {check}")
    return p


def write_or_check(doc: Path, text: str, command: str, check: bool,
                   misses: Iterable[str] = ()) -> int:
    """Write ``text`` to ``doc``; with ``check`` write nothing and return 1 when the committed
    ``doc`` differs (rerun ``command``) or ``misses`` names a missed target."""
    name = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
    if not check:
        write_atomic(doc, text, str(name), force=True)
        print(f"wrote {name}")
        return 0
    failed = [f"{name} is stale: {command}"] if not doc.exists() or doc.read_text() != text \
        else []
    failed += list(misses)
    for line in failed:
        print(line, file=sys.stderr)
    if not failed:
        print(f"{name} current")
    return 1 if failed else 0
