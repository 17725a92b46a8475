"""docs/cli.md states the plan notation's grammar as plans/notation.py (its one owner) does."""

from __future__ import annotations

import textwrap
from pathlib import Path

from plans import notation

ROOT = Path(__file__).resolve().parents[2]


def test_the_notation_grammar_in_the_docs_is_the_parsers():
    doc = notation.__doc__
    start = doc.rindex("\n", 0, doc.index("layout   pp")) + 1
    grammar = textwrap.dedent(doc[start:].split("\n\n")[0])
    assert grammar.count("\n") >= 4
    assert grammar in (ROOT / "docs" / "cli.md").read_text()
