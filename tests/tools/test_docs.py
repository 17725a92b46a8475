"""docs/cli.md states the plan notation's grammar as plans/notation.py (its one owner) does."""

from __future__ import annotations

import textwrap
from pathlib import Path

from plans import notation

ROOT = Path(__file__).resolve().parents[2]


def test_the_notation_grammar_in_the_docs_is_the_parsers():
    doc = textwrap.dedent(notation.__doc__)
    grammar = doc[doc.index("layout   pp"):].split("\n\n")[0].strip()
    assert grammar.count("\n") >= 4
    assert grammar in (ROOT / "docs" / "cli.md").read_text()
