"""tools/results_doc.py: the committed docs/results.md and the README's generated blocks are
what the committed results and the CLI give now; the README keeps its two set-up commands,
every command and at most 150 lines."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import typer.main

from planner.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The two set-up commands, exactly (.ci/run runs the second).
SETUP = [
    "pip install -e . && moeplan search internal-352b h800 --gpus 1440 --global-batch 720",
    "pip install torch==2.13.0 -e '.[dev]' && pip install --no-deps megatron-core==0.15.3 "
    "&& python -m pytest",
]
# a command that regenerates a number
COMMAND = re.compile(r"`(python [^`]+|torchrun [^`]+|bash [^`]+|moeplan [^`]+)`")


def _tool():
    spec = importlib.util.spec_from_file_location("results_doc", ROOT / "tools" / "results_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _tool()


def test_the_committed_documents_are_current(tool):
    doc, readme = tool.documents()
    assert tool.DOC.read_text() == doc, "docs/results.md is stale: python -m tools.results_doc"
    assert README.read_text() == readme, "README.md is stale: python -m tools.results_doc"


def test_the_readme_keeps_its_two_setup_commands_and_150_lines():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, len(lines)
    for command in SETUP:
        assert command in lines, command
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in ci and "megatron-core==0.15.3" in ci


def test_the_readme_lists_every_command():
    group = typer.main.get_group(app)
    block = README.read_text().split("## Commands", 1)[1].split("```")[1]
    listed = {line.split()[1] for line in block.splitlines() if line.startswith("moeplan ")}
    assert listed == set(group.commands)


def test_every_number_of_the_results_document_names_its_command(tool):
    sections = tool.DOC.read_text().split("\n- ")[1:]
    assert sections
    for item in sections:
        if re.search(r"\d", item):
            assert COMMAND.search(item), item


def test_every_trust_row_names_its_command():
    block = README.read_text().split("<!-- trust:", 1)[1].split("<!-- end of trust")[0]
    rows = [ln for ln in block.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert rows
    for row in rows:
        assert COMMAND.search(row.split("|")[-2]), row


def test_a_template_value_left_out_is_refused(tool):
    with pytest.raises(KeyError):
        tool.render({}, "readme_trust.md.tmpl")


def test_a_readme_without_its_markers_is_refused(tool):
    with pytest.raises(SystemExit, match="headline"):
        tool.readme_with({}, "# no blocks\n")
